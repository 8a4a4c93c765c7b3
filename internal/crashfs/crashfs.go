// Package crashfs is a test helper: a FUSE file system that passes a
// directory through and, on Crash, loses every write that was not made
// durable by fsync, the way a machine that loses power loses its page
// cache. Killing a process alone keeps the operating system's page cache,
// so a database that skips fsync survives a kill -9; it does not survive
// crashfs.Crash.
//
// What is lost: file contents and sizes changed since the file's last
// fsync (or fdatasync) are rolled back to what they were at that fsync.
// Writes through a descriptor opened with O_SYNC or O_DSYNC are durable at
// once. Changes to the namespace (creating, renaming, deleting files and
// directories) are kept: the layer is a model of lost data pages, not of a
// lost directory journal, so it can only be more lenient than a real
// crash there.
//
// Mounting needs /dev/fuse and either root (the mount is made directly) or
// the fusermount3 helper of Debian's fuse3 package. It imports no other
// package of the module.
package crashfs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sync"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// FS is a mounted crashfs. Its methods are safe for concurrent use.
type FS struct {
	backing, mountpoint string

	mu     sync.Mutex
	server *fuse.Server
	undo   map[uint64]*undoLog // by inode of the backing file
	stats  Stats
}

// Stats count what the file system saw.
type Stats struct {
	// Writes and Syncs count write and fsync calls since Mount.
	Writes, Syncs int64
	// LostWrites counts the writes rolled back by Crash calls.
	LostWrites int64
	// Crashes counts Crash calls.
	Crashes int64
}

// undoLog restores one file to its state at its last fsync.
type undoLog struct {
	fd     int   // a descriptor of the backing file, kept until sync or crash
	size   int64 // the size at the last fsync
	images []image
	writes int64
}

// image is the content a write replaced.
type image struct {
	off  int64
	data []byte
}

// Mount makes the contents of backing (an existing directory) visible at
// mountpoint (an existing empty directory).
func Mount(backing, mountpoint string) (*FS, error) {
	f := &FS{backing: backing, mountpoint: mountpoint, undo: map[uint64]*undoLog{}}
	if err := f.mount(); err != nil {
		return nil, err
	}
	return f, nil
}

func (f *FS) mount() error {
	var st syscall.Stat_t
	if err := syscall.Stat(f.backing, &st); err != nil {
		return fmt.Errorf("crashfs: %w", err)
	}
	root := &fs.LoopbackRoot{Path: f.backing, Dev: st.Dev}
	root.NewNode = func(r *fs.LoopbackRoot, _ *fs.Inode, _ string, _ *syscall.Stat_t) fs.InodeEmbedder {
		return &node{LoopbackNode: fs.LoopbackNode{RootData: r}, fs: f}
	}
	rootNode := root.NewNode(root, nil, "", &st)
	root.RootNode = rootNode
	asRoot := os.Geteuid() == 0
	srv, err := fs.Mount(f.mountpoint, rootNode, &fs.Options{MountOptions: fuse.MountOptions{
		FsName: "crashfs", Name: "crashfs",
		// As root the kernel mount is made directly and other users
		// (PostgreSQL runs as "postgres") may use it; otherwise
		// fusermount3 mounts it for the caller alone.
		DirectMount: asRoot, AllowOther: asRoot,
	}})
	if err != nil {
		return fmt.Errorf("crashfs: mount %s: %w", f.mountpoint, err)
	}
	f.mu.Lock()
	f.server = srv
	f.mu.Unlock()
	return nil
}

// Stats returns the counts so far.
func (f *FS) Stats() Stats {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stats
}

// Crash simulates a power loss: it unmounts the file system (every process
// using it must be gone), rolls back every write not yet fsynced in the
// backing directory, and mounts it again, with an empty page cache.
func (f *FS) Crash() error {
	if err := f.Unmount(); err != nil {
		return err
	}
	f.mu.Lock()
	var errs []error
	for ino, u := range f.undo {
		if err := u.rollBack(); err != nil {
			errs = append(errs, fmt.Errorf("crashfs: roll back inode %d: %w", ino, err))
		}
		f.stats.LostWrites += u.writes
		_ = syscall.Close(u.fd)
		delete(f.undo, ino)
	}
	f.stats.Crashes++
	f.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return f.mount()
}

// Unmount unmounts the file system, keeping unsynced writes in the backing
// directory (as a clean shutdown would). Unmounting twice is harmless.
func (f *FS) Unmount() error {
	f.mu.Lock()
	srv := f.server
	f.server = nil
	f.mu.Unlock()
	if srv == nil {
		return nil
	}
	if err := srv.Unmount(); err != nil {
		f.mu.Lock()
		f.server = srv
		f.mu.Unlock()
		return fmt.Errorf("crashfs: unmount %s: %w", f.mountpoint, err)
	}
	return nil
}

func (u *undoLog) rollBack() error {
	for _, im := range slices.Backward(u.images) {
		if _, err := syscall.Pwrite(u.fd, im.data, im.off); err != nil {
			return err
		}
	}
	return syscall.Ftruncate(u.fd, u.size)
}

// logFor returns the undo log of the file behind fd, starting one (with
// the file's current size) when it has none. f.mu must be held.
func (f *FS) logFor(fd int) (*undoLog, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, err
	}
	if u, ok := f.undo[st.Ino]; ok {
		return u, nil
	}
	// A descriptor of its own, readable and writable whatever fd is.
	own, err := syscall.Open(fmt.Sprintf("/proc/self/fd/%d", fd), syscall.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	u := &undoLog{fd: own, size: st.Size}
	f.undo[st.Ino] = u
	return u, nil
}

// remember records what a change of [off, off+n) of the file behind fd
// replaces, so Crash can undo it.
func (f *FS) remember(fd int, off, n int64) error {
	u, err := f.logFor(fd)
	if err != nil {
		return err
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(u.fd, &st); err != nil {
		return err
	}
	end := min(off+n, st.Size)
	if end > off {
		old := make([]byte, end-off)
		m, err := syscall.Pread(u.fd, old, off)
		if err != nil {
			return err
		}
		u.images = append(u.images, image{off: off, data: old[:m]})
	}
	u.writes++
	return nil
}

// synced forgets the undo log of the file behind fd: its data is durable.
func (f *FS) synced(fd int) {
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return
	}
	if u, ok := f.undo[st.Ino]; ok {
		_ = syscall.Close(u.fd)
		delete(f.undo, st.Ino)
	}
}

// node is a loopback node whose files remember their unsynced writes.
type node struct {
	fs.LoopbackNode
	fs *FS
}

var (
	_ fs.NodeOpener         = (*node)(nil)
	_ fs.NodeCreater        = (*node)(nil)
	_ fs.NodeSetattrer      = (*node)(nil)
	_ fs.NodeCopyFileRanger = (*node)(nil)
)

func (n *node) path() string {
	return n.RootData.Path + "/" + n.Path(n.Root())
}

// Open opens the backing file and returns a handle that records writes.
func (n *node) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	flags &^= syscall.O_APPEND | fuse.FMODE_EXEC
	fd, err := syscall.Open(n.path(), int(flags&^syscall.O_TRUNC), 0)
	if err != nil {
		return nil, 0, fs.ToErrno(err)
	}
	if flags&syscall.O_TRUNC != 0 {
		if errno := n.fs.truncate(fd, 0); errno != 0 {
			_ = syscall.Close(fd)
			return nil, 0, errno
		}
	}
	return n.fs.file(fd, flags), 0, 0
}

// truncate records the data a truncation to size drops, then truncates.
func (f *FS) truncate(fd int, size int64) syscall.Errno {
	f.mu.Lock()
	defer f.mu.Unlock()
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return fs.ToErrno(err)
	}
	if err := f.remember(fd, size, max(st.Size-size, 0)); err != nil {
		return fs.ToErrno(err)
	}
	return fs.ToErrno(syscall.Ftruncate(fd, size))
}

// Create creates the file through the loopback node and swaps its handle
// for one that records writes.
func (n *node) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	if flags&syscall.O_TRUNC != 0 {
		// An existing file loses its content only through truncate.
		if fd, err := syscall.Open(n.path()+"/"+name, syscall.O_RDWR, 0); err == nil {
			errno := n.fs.truncate(fd, 0)
			_ = syscall.Close(fd)
			if errno != 0 {
				return nil, nil, 0, errno
			}
		}
	}
	inode, fh, fuseFlags, errno := n.LoopbackNode.Create(ctx, name, flags, mode, out)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	if r, ok := fh.(fs.FileReleaser); ok {
		_ = r.Release(ctx)
	}
	fd, err := syscall.Open(n.path()+"/"+name, int(flags&^(syscall.O_APPEND|syscall.O_CREAT|syscall.O_EXCL|syscall.O_TRUNC)), 0)
	if err != nil {
		return nil, nil, 0, fs.ToErrno(err)
	}
	return inode, n.fs.file(fd, flags), fuseFlags, 0
}

// Setattr records a change of size before making it.
func (n *node) Setattr(ctx context.Context, fh fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if size, ok := in.GetSize(); ok {
		fd, err := syscall.Open(n.path(), syscall.O_RDWR, 0)
		if err != nil {
			return fs.ToErrno(err)
		}
		defer syscall.Close(fd)
		if errno := n.fs.truncate(fd, int64(size)); errno != 0 {
			return errno
		}
	}
	return n.LoopbackNode.Setattr(ctx, nil, in, out)
}

// CopyFileRange is refused, so the kernel falls back to reads and writes,
// which are recorded.
func (n *node) CopyFileRange(context.Context, fs.FileHandle, uint64, *fs.Inode, fs.FileHandle, uint64, uint64, uint64) (uint32, syscall.Errno) {
	return 0, syscall.EOPNOTSUPP
}

// file is an open backing file.
type file struct {
	fs   *FS
	fd   int
	sync bool // opened O_SYNC or O_DSYNC: every write is durable
}

var (
	_ fs.FileReader    = (*file)(nil)
	_ fs.FileWriter    = (*file)(nil)
	_ fs.FileFsyncer   = (*file)(nil)
	_ fs.FileReleaser  = (*file)(nil)
	_ fs.FileGetattrer = (*file)(nil)
	_ fs.FileAllocater = (*file)(nil)
)

func (f *FS) file(fd int, flags uint32) *file {
	return &file{fs: f, fd: fd, sync: flags&(syscall.O_SYNC|syscall.O_DSYNC) != 0}
}

func (h *file) Read(_ context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n, err := syscall.Pread(h.fd, dest, off)
	if err != nil {
		return nil, fs.ToErrno(err)
	}
	return fuse.ReadResultData(dest[:n]), 0
}

func (h *file) Write(_ context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	h.fs.mu.Lock()
	defer h.fs.mu.Unlock()
	h.fs.stats.Writes++
	if !h.sync {
		if err := h.fs.remember(h.fd, off, int64(len(data))); err != nil {
			return 0, fs.ToErrno(err)
		}
	}
	n, err := syscall.Pwrite(h.fd, data, off)
	if err != nil {
		return 0, fs.ToErrno(err)
	}
	if h.sync {
		// A synchronous write is durable, with everything before it.
		h.fs.synced(h.fd)
	}
	return uint32(n), 0
}

func (h *file) Fsync(_ context.Context, _ uint32) syscall.Errno {
	if err := syscall.Fsync(h.fd); err != nil {
		return fs.ToErrno(err)
	}
	h.fs.mu.Lock()
	defer h.fs.mu.Unlock()
	h.fs.stats.Syncs++
	h.fs.synced(h.fd)
	return 0
}

func (h *file) Allocate(_ context.Context, off, size uint64, mode uint32) syscall.Errno {
	h.fs.mu.Lock()
	defer h.fs.mu.Unlock()
	if err := h.fs.remember(h.fd, int64(off), 0); err != nil {
		return fs.ToErrno(err)
	}
	return fs.ToErrno(unix.Fallocate(h.fd, mode, int64(off), int64(size)))
}

func (h *file) Getattr(_ context.Context, out *fuse.AttrOut) syscall.Errno {
	var st syscall.Stat_t
	if err := syscall.Fstat(h.fd, &st); err != nil {
		return fs.ToErrno(err)
	}
	out.FromStat(&st)
	return 0
}

func (h *file) Release(context.Context) syscall.Errno {
	return fs.ToErrno(syscall.Close(h.fd))
}

// Available reports why crashfs cannot mount on this machine, or nil. It
// mounts and unmounts a scratch directory: that needs /dev/fuse, and
// either root with the right to mount (CAP_SYS_ADMIN) or fusermount3
// (Debian: fuse3).
func Available() error {
	if os.Geteuid() != 0 {
		if _, err := exec.LookPath("fusermount3"); err != nil {
			if _, err2 := exec.LookPath("fusermount"); err2 != nil {
				return errors.New("not root and no fusermount3 on PATH (Debian package fuse3)")
			}
		}
	}
	dir, err := os.MkdirTemp("", "crashfs-probe-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	backing, mnt := dir+"/b", dir+"/m"
	for _, d := range []string{backing, mnt} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return err
		}
	}
	f, err := Mount(backing, mnt)
	if err != nil {
		return err
	}
	return f.Unmount()
}
