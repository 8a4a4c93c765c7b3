package crashfs_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/idemcoord/idemcoord/internal/crashfs"
)

// mount mounts a crashfs for t, skipping the test where FUSE cannot work
// (see Available).
func mount(t *testing.T) (f *crashfs.FS, backing, mnt string) {
	t.Helper()
	if err := crashfs.Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("crashfs cannot mount here: %v", err)
		}
		t.Skipf("crashfs cannot mount here: %v", err)
	}
	backing, mnt = t.TempDir(), t.TempDir()
	f, err := crashfs.Mount(backing, mnt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Unmount() })
	return f, backing, mnt
}

// TestCrashLosesUnsyncedWrites: what was fsynced survives Crash, what was
// written after is rolled back (content and size), through a read-write
// handle, a truncation and a file created and never synced.
func TestCrashLosesUnsyncedWrites(t *testing.T) {
	f, _, mnt := mount(t)
	synced := filepath.Join(mnt, "synced")
	h, err := os.OpenFile(synced, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	write := func(b string, off int64) {
		t.Helper()
		if _, err := h.WriteAt([]byte(b), off); err != nil {
			t.Fatal(err)
		}
	}
	write("durable.", 0)
	if err := h.Sync(); err != nil {
		t.Fatal(err)
	}
	write("LOST", 0)
	write(" and more lost", 8)
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mnt, "never-synced"), []byte("gone"), 0o644); err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(mnt, "truncated")
	if err := os.WriteFile(truncated, []byte("whole"), 0o644); err != nil {
		t.Fatal(err)
	}
	syncFile(t, truncated)
	if err := os.Truncate(truncated, 2); err != nil {
		t.Fatal(err)
	}
	if got := read(t, synced); got != "LOSTble. and more lost" {
		t.Fatalf("before Crash the file holds %q, want every write", got)
	}

	if err := f.Crash(); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{synced: "durable.", filepath.Join(mnt, "never-synced"): "", truncated: "whole"} {
		if got := read(t, path); got != want {
			t.Errorf("after Crash %s holds %q, want %q", filepath.Base(path), got, want)
		}
	}
	if st := f.Stats(); st.LostWrites == 0 || st.Syncs == 0 || st.Crashes != 1 {
		t.Errorf("stats %+v: want lost writes, syncs and one crash", st)
	}
}

// TestSyncedDataSurvives: with every write synced, Crash changes nothing.
func TestSyncedDataSurvives(t *testing.T) {
	f, backing, mnt := mount(t)
	want := bytes.Repeat([]byte("0123456789"), 100_000)
	path := filepath.Join(mnt, "big")
	if err := os.WriteFile(path, want, 0o600); err != nil {
		t.Fatal(err)
	}
	syncFile(t, path)
	if err := f.Crash(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(backing, "big"))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("synced file changed by Crash: %d bytes, %v", len(got), err)
	}
	if got := read(t, path); len(got) != len(want) {
		t.Fatalf("read back through the mount: %d bytes, want %d", len(got), len(want))
	}
}

func syncFile(t *testing.T, path string) {
	t.Helper()
	h, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := h.Sync(); err != nil {
		t.Fatal(err)
	}
}

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
