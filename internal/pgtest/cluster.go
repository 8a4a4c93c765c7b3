package pgtest

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// ClusterOptions configures a cluster started by StartCluster.
type ClusterOptions struct {
	// Durable keeps fsync and full_page_writes on, so that committed data
	// survives Kill the way it would on a real server. The default turns
	// them off, which is faster and is safe for data that a test throws
	// away. synchronous_commit stays on either way: with fsync off it
	// costs a commit one write into the kernel's page cache, and it keeps
	// every commit PostgreSQL acknowledged through a kill of PostgreSQL's
	// processes (not of the machine), for every session: the coordinator's
	// own sessions ask for it, but a Citus worker's sessions, which the
	// coordinator node opens, run with the worker's default.
	Durable bool
	// DataDir, when set, is where the data directory is created (it must
	// not exist yet, and its parent must be writable by the server's
	// user), for instance on a file system the test controls. The test
	// removes it.
	DataDir string
	// Settings are extra server settings ("name=value"), applied last.
	Settings []string
}

// A Cluster is a PostgreSQL server that a test owns: its data directory,
// socket and log live in a temporary directory, it listens on 127.0.0.1 on
// a port that stays the same across Stop and Start, and its superuser
// "postgres" connects without a password.
//
// Its methods are safe for concurrent use.
type Cluster struct {
	bin     string // directory holding initdb and postgres
	root    string // temporary directory; owned by the server's user
	data    string // data directory, symlinks resolved
	logPath string
	port    int
	opts    ClusterOptions
	asUser  *user.User // non-nil: run server programs as this user

	watchdog *exec.Cmd

	mu   sync.Mutex
	proc *server // nil when stopped
	// lastPID is the postmaster PID of the previous run, so that a stale
	// postmaster.pid left by Kill is not mistaken for a started server.
	lastPID int
	closed  bool
}

// server is one run of the postmaster.
type server struct {
	cmd  *exec.Cmd
	pid  int             // the postmaster's PID
	done <-chan struct{} // closed when cmd has exited
}

const (
	startTimeout = 60 * time.Second
	stopTimeout  = 60 * time.Second
	logTailBytes = 4 << 10
)

// StartCluster initialises and starts a new cluster for t, separate from the
// one Main starts, and stops and deletes it when t's cleanup runs. When t has
// failed, the end of the server log is logged first.
func StartCluster(t testing.TB, opts ClusterOptions) *Cluster {
	t.Helper()
	c, err := startCluster(opts)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("pgtest: end of the server log %s:\n%s", c.logPath, c.logTail())
		}
		if err := c.destroy(); err != nil {
			t.Errorf("pgtest: %v", err)
		}
	})
	return c
}

// URL returns the URL of database dbname on the cluster, as the superuser
// "postgres".
func (c *Cluster) URL(dbname string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User("postgres"),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(c.port)),
		Path:     "/" + dbname,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// Stop shuts the server down the way "pg_ctl stop -m fast" does: it rolls
// back open transactions, disconnects clients and writes a shutdown
// checkpoint. It returns once the server has exited. Stopping a stopped
// cluster does nothing.
func (c *Cluster) Stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.stopLocked(); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return nil
}

// Start starts a stopped (or killed) cluster again on the same port with the
// same data. It returns once the server accepts connections.
func (c *Cluster) Start() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errors.New("pgtest: Start on a removed cluster")
	}
	if c.proc != nil {
		return errors.New("pgtest: Start on a running cluster")
	}
	if err := c.startLocked(); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return nil
}

// Kill sends SIGKILL to the postmaster, as a crash would, and returns once
// it and every server process it had started are gone. Start then runs crash
// recovery. Killing a stopped cluster does nothing.
func (c *Cluster) Kill() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.proc
	if p == nil {
		return nil
	}
	if err := syscall.Kill(p.pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("pgtest: kill postmaster %d: %w", p.pid, err)
	}
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		return fmt.Errorf("pgtest: postmaster %d still running %v after SIGKILL", p.pid, stopTimeout)
	}
	c.proc = nil
	// Backends notice the postmaster's death on their own; until they have
	// exited, a new postmaster refuses the data directory.
	deadline := time.Now().Add(stopTimeout)
	for processesIn(c.data) {
		if time.Now().After(deadline) {
			return fmt.Errorf("pgtest: server processes in %s still running %v after the postmaster was killed", c.data, stopTimeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// startCluster creates, initialises and starts a cluster in a new temporary
// directory. On error it leaves nothing behind.
func startCluster(opts ClusterOptions) (_ *Cluster, err error) {
	bin, err := findBinaries()
	if err != nil {
		return nil, err
	}
	c := &Cluster{bin: bin, opts: opts}
	if os.Geteuid() == 0 {
		c.asUser, err = user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root needs a \"postgres\" system user to run PostgreSQL: %w", err)
		}
	}

	root, err := os.MkdirTemp(tempParent(opts), "pgtest-")
	if err != nil {
		return nil, fmt.Errorf("create temporary directory: %w", err)
	}
	if c.root, err = filepath.EvalSymlinks(root); err != nil {
		_ = os.RemoveAll(root)
		return nil, fmt.Errorf("resolve temporary directory: %w", err)
	}
	defer func() {
		if err != nil {
			_ = c.destroy()
		}
	}()
	c.data = filepath.Join(c.root, "data")
	if opts.DataDir != "" {
		c.data = opts.DataDir
	}
	c.logPath = filepath.Join(c.root, "server.log")
	if c.asUser != nil {
		uid, _ := strconv.Atoi(c.asUser.Uid)
		gid, _ := strconv.Atoi(c.asUser.Gid)
		if err := os.Chown(c.root, uid, gid); err != nil {
			return nil, fmt.Errorf("hand %s to the postgres user: %w", c.root, err)
		}
	}
	if err := c.startWatchdog(); err != nil {
		return nil, err
	}

	initdb := []string{
		"-D", c.data, "-U", "postgres", "-A", "trust",
		"-E", "UTF8", "--locale=C", "--no-instructions",
	}
	if !opts.Durable {
		initdb = append(initdb, "--no-sync")
	}
	if err := c.run("initdb", initdb...); err != nil {
		return nil, err
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	// The port is free when picked but may be taken before the server
	// binds it; pick another then.
	for attempt := 1; ; attempt++ {
		if c.port, err = freePort(); err != nil {
			return nil, err
		}
		err = c.startLocked()
		if err == nil || attempt == 5 || !strings.Contains(c.logTail(), "could not bind") {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	return c, nil
}

// run runs one of the cluster's programs to completion, its output going to
// the server log. It is killed if this process dies first.
func (c *Cluster) run(program string, args ...string) error {
	logf, err := os.OpenFile(c.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open server log: %w", err)
	}
	defer logf.Close()
	cmd := c.command(program, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	done, err := startTied(cmd, syscall.SIGKILL)
	if err != nil {
		return fmt.Errorf("start %s: %w", program, err)
	}
	<-done
	if !cmd.ProcessState.Success() {
		return fmt.Errorf("%s: %v; end of %s:\n%s", program, cmd.ProcessState, c.logPath, c.logTail())
	}
	return nil
}

// command returns a command running one of the server programs, as the
// postgres user when the process runs as root. The user is switched by the
// kernel before the program starts (SysProcAttr.Credential), not by a
// wrapper such as runuser: the program stays this process's direct child,
// and its parent-death signal (see startTied) survives the switch.
func (c *Cluster) command(program string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(c.bin, program), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: credential(c.asUser)}
	if c.asUser != nil {
		// The server connects out too (Citus to its workers, with libpq,
		// which reads client certificates under $HOME/.postgresql): not
		// root's home, which the postgres user cannot read.
		cmd.Env = append(os.Environ(), "HOME="+c.root)
	}
	return cmd
}

// credential is the credential of u for SysProcAttr, or nil for the
// current user when u is nil.
func credential(u *user.User) *syscall.Credential {
	if u == nil {
		return nil
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
}

// startLocked starts the postmaster and waits until it accepts connections.
func (c *Cluster) startLocked() error {
	settings := []string{
		"listen_addresses=127.0.0.1",
		"unix_socket_directories=" + c.root,
		"max_connections=300",
	}
	if !c.opts.Durable {
		settings = append(settings, "fsync=off", "full_page_writes=off")
	}
	settings = append(settings, c.opts.Settings...)
	args := []string{"-D", c.data, "-p", strconv.Itoa(c.port)}
	for _, s := range settings {
		args = append(args, "-c", s)
	}

	logf, err := os.OpenFile(c.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open server log: %w", err)
	}
	defer logf.Close()
	cmd := c.command("postgres", args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group keeps a terminal's Ctrl-C away from the server.
	// When the test binary dies, however it dies, the postmaster gets
	// SIGQUIT (immediate shutdown: it stops its server processes and
	// exits); the watchdog then deletes the files.
	cmd.SysProcAttr.Setpgid = true
	done, err := startTied(cmd, syscall.SIGQUIT)
	if err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	p := &server{cmd: cmd, done: done}

	deadline := time.Now().Add(startTimeout)
	for {
		if pid, ok := readyPID(c.data); ok && pid != c.lastPID {
			p.pid = pid
			c.proc, c.lastPID = p, pid
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("postgres exited during start-up; end of %s:\n%s", c.logPath, c.logTail())
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			<-p.done
			return fmt.Errorf("postgres not ready after %v; end of %s:\n%s", startTimeout, c.logPath, c.logTail())
		}
	}
}

// stopLocked shuts the postmaster down (fast mode) and waits for it to exit.
func (c *Cluster) stopLocked() error {
	p := c.proc
	if p == nil {
		return nil
	}
	c.proc = nil
	// SIGINT is PostgreSQL's fast shutdown, what "pg_ctl stop -m fast" sends.
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGQUIT, syscall.SIGKILL} {
		if err := syscall.Kill(p.pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("signal postmaster %d: %w", p.pid, err)
		}
		select {
		case <-p.done:
			if sig != syscall.SIGINT {
				return fmt.Errorf("postmaster %d ignored fast shutdown for %v; stopped it with %v", p.pid, stopTimeout, sig)
			}
			return nil
		case <-time.After(stopTimeout):
		}
	}
	return fmt.Errorf("postmaster %d does not exit", p.pid)
}

// destroy stops the server and the watchdog and deletes the temporary
// directory.
func (c *Cluster) destroy() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	err := c.stopLocked()
	if c.watchdog != nil {
		_ = c.watchdog.Process.Kill()
		_ = c.watchdog.Wait()
	}
	if c.root != "" {
		if rmErr := os.RemoveAll(c.root); rmErr != nil && err == nil {
			err = fmt.Errorf("remove %s: %w", c.root, rmErr)
		}
	}
	return err
}

// watchdogScript stops the server and removes its directory once the process
// that started it is gone without doing so itself: after a test timeout, a
// panic in a test or a kill. (On Linux the server has already had its
// parent-death signal by then; the script stops it where there is none.)
// Arguments: owner PID, cluster directory.
const watchdogScript = `
owner=$1 root=$2
while kill -0 "$owner" 2>/dev/null; do sleep 1; done
if [ -f "$root/data/postmaster.pid" ]; then
	pid=$(head -n 1 "$root/data/postmaster.pid")
	kill -QUIT "$pid" 2>/dev/null
	i=0
	while kill -0 "$pid" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
fi
rm -rf "$root"
`

// startWatchdog starts the shell process running watchdogScript, in its own
// session and without the test binary's output pipes, so that it outlives
// the test binary and does not hold "go test" up.
func (c *Cluster) startWatchdog() error {
	cmd := exec.Command("/bin/sh", "-c", watchdogScript, "pgtest-watchdog", strconv.Itoa(os.Getpid()), c.root)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start watchdog: %w", err)
	}
	c.watchdog = cmd
	return nil
}

// logTail returns the end of the server log.
func (c *Cluster) logTail() string {
	b, err := os.ReadFile(c.logPath)
	if err != nil {
		return fmt.Sprintf("(cannot read server log: %v)", err)
	}
	if len(b) > logTailBytes {
		b = b[len(b)-logTailBytes:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return string(b)
}

// readyPID reads postmaster.pid and reports the postmaster's PID once it
// says the server accepts connections (as a primary or a hot standby).
func readyPID(data string) (int, bool) {
	b, err := os.ReadFile(filepath.Join(data, "postmaster.pid"))
	if err != nil {
		return 0, false
	}
	// Line 1 is the PID, line 8 the status (PostgreSQL 10 and later).
	lines := strings.Split(string(b), "\n")
	// A hot standby that accepts read-only connections says "standby".
	if len(lines) < 8 || (strings.TrimSpace(lines[7]) != "ready" && strings.TrimSpace(lines[7]) != "standby") {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(lines[0]))
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, true
}

// processesIn reports whether any process has dir as its working directory,
// as every PostgreSQL server process has its data directory.
func processesIn(dir string) bool {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		if cwd, err := os.Readlink("/proc/" + e.Name() + "/cwd"); err == nil && cwd == dir {
			return true
		}
	}
	return false
}

// tempParent returns the directory to create a cluster's directory in:
// /dev/shm for a cluster that need not be durable, when TMPDIR is not set
// and /dev/shm has room, because it makes CREATE DATABASE several times
// faster than a disk does; else the default temporary directory.
func tempParent(opts ClusterOptions) string {
	const shm, minFree = "/dev/shm", 1 << 30
	if opts.Durable || os.Getenv("TMPDIR") != "" {
		return ""
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(shm, &st); err != nil || st.Bavail*uint64(st.Bsize) < minFree {
		return ""
	}
	if syscall.Access(shm, 0o2|0o1) != nil { // W_OK|X_OK
		return ""
	}
	return shm
}

// freePort returns a TCP port on 127.0.0.1 that nothing listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil //nolint:forcetypeassert // a "tcp" listener's address is a *net.TCPAddr
}

// findBinaries returns the directory holding initdb and postgres: PG_BIN,
// else the newest /usr/lib/postgresql/*/bin, else the directory of the
// initdb on PATH.
func findBinaries() (string, error) {
	has := func(dir string) bool {
		for _, p := range []string{"initdb", "postgres"} {
			if fi, err := os.Stat(filepath.Join(dir, p)); err != nil || fi.IsDir() {
				return false
			}
		}
		return true
	}
	if dir := os.Getenv("PG_BIN"); dir != "" {
		if !has(dir) {
			return "", fmt.Errorf("PG_BIN=%s holds no initdb and postgres", dir)
		}
		return dir, nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	version := func(dir string) float64 {
		v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(dir)), 64)
		return v
	}
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, dir := range dirs {
		if has(dir) {
			return dir, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil && has(filepath.Dir(p)) {
		return filepath.Dir(p), nil
	}
	return "", errors.New("no PostgreSQL server binaries (initdb, postgres) found in PG_BIN, /usr/lib/postgresql/*/bin or PATH: " +
		"install them (Debian: apt-get install postgresql), set PG_BIN, or set TEST_DATABASE_URL to use a running server")
}
