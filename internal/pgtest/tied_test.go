package pgtest

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// tiedHelperEnv makes the test binary a helper for TestChildrenEndWithTestBinary
// (see TestMain): it starts a cluster, a PgBouncer in front of it and a
// long sleep through StartTied (as coordtest.StartTied starts coordinator
// binaries), prints the cluster's directory, and waits to be killed.
const tiedHelperEnv = "PGTEST_TIED_HELPER"

// helperTB is the testing.TB that the helper hands StartPgBouncer: Skip and
// Fatal end the calling goroutine, as in a test.
type helperTB struct {
	testing.TB
	failed bool
	msg    string
}

func (h *helperTB) Helper()             {}
func (h *helperTB) Cleanup(func())      {}
func (h *helperTB) Failed() bool        { return h.failed }
func (h *helperTB) Logf(string, ...any) {}
func (h *helperTB) Skip(args ...any)    { h.msg = fmt.Sprint(args...); runtime.Goexit() }
func (h *helperTB) Fatalf(f string, a ...any) {
	h.failed, h.msg = true, fmt.Sprintf(f, a...)
	runtime.Goexit()
}

// runTiedHelper is the helper's main.
func runTiedHelper() int {
	c, err := startCluster(ClusterOptions{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	tb := &helperTB{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		StartPgBouncer(tb, c.URL("postgres"))
	}()
	<-done
	if tb.failed {
		fmt.Fprintln(os.Stderr, tb.msg)
		return 1
	}
	if err := StartTied(exec.Command("sleep", "1000"), syscall.SIGKILL, make(chan struct{})); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Printf("root %s\npgbouncer %v\n", c.root, tb.msg == "")
	select {} // until killed
}

// TestChildrenEndWithTestBinary: the processes pgtest starts (a cluster's
// postmaster and its server processes, a PgBouncer, any StartTied process)
// end within a few
// seconds of the test binary that started them being killed with SIGKILL,
// which leaves it no chance to clean up, and the cluster's files go too.
func TestChildrenEndWithTestBinary(t *testing.T) {
	t.Parallel()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	helper := exec.Command(exe, "-test.run", "^$")
	helper.Env = append(os.Environ(), tiedHelperEnv+"=1")
	helper.Stderr = os.Stderr
	out, err := helper.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = helper.Process.Kill(); _ = helper.Wait() })
	lines := bufio.NewScanner(out)
	report := map[string]string{}
	for len(report) < 2 && lines.Scan() {
		if k, v, ok := strings.Cut(lines.Text(), " "); ok {
			report[k] = v
		}
	}
	root := report["root"]
	if root == "" {
		t.Fatalf("the helper did not start its children (it said %q)", report)
	}
	if report["pgbouncer"] != "true" {
		t.Log("no pgbouncer installed: only the cluster's processes are checked")
	}
	children := descendants(helper.Process.Pid)
	names := map[int]string{}
	for _, pid := range children {
		names[pid] = command(pid)
	}
	want := []string{"postgres", "sleep"}
	if report["pgbouncer"] == "true" {
		want = append(want, "pgbouncer")
	}
	for _, w := range want {
		found := false
		for _, n := range names {
			found = found || n == w
		}
		if !found {
			t.Fatalf("no %s among the helper's descendants %v", w, names)
		}
	}

	if err := helper.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = helper.Wait()
	killed := time.Now()
	deadline := killed.Add(10 * time.Second)
	for {
		var alive []string
		for _, pid := range children {
			if running(pid) && names[pid] != "sh" { // the watchdog ends once it has cleaned up
				alive = append(alive, fmt.Sprintf("%d (%s)", pid, names[pid]))
			}
		}
		_, statErr := os.Stat(filepath.Join(root, "data"))
		if len(alive) == 0 && os.IsNotExist(statErr) {
			t.Logf("all %d processes gone and the cluster's files removed %v after the SIGKILL", len(children), time.Since(killed).Round(time.Millisecond))
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("10s after the test binary was killed: still running %v; cluster files removed: %v", alive, os.IsNotExist(statErr))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// descendants returns the PIDs of every living descendant of pid.
func descendants(pid int) []int {
	parent := map[int]int{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if pp, ok := stat(p); ok {
			parent[p] = pp.ppid
		}
	}
	var out []int
	var walk func(int)
	walk = func(of int) {
		for p, pp := range parent {
			if pp == of {
				out = append(out, p)
				walk(p)
			}
		}
	}
	walk(pid)
	return out
}

type procStat struct {
	state byte
	ppid  int
}

// stat reads a process's state and parent from /proc/PID/stat.
func stat(pid int) (procStat, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, false
	}
	// "pid (comm) state ppid ...": comm may hold spaces and parentheses.
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 2 {
		return procStat{}, false
	}
	ppid, _ := strconv.Atoi(f[1])
	return procStat{state: f[0][0], ppid: ppid}, true
}

// running reports whether pid is a process that has not exited (a zombie
// that nobody reaped has exited).
func running(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil {
		return false
	}
	st, ok := stat(pid)
	return ok && st.state != 'Z' && st.state != 'X'
}

// command returns a process's program name.
func command(pid int) string {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	return strings.TrimSpace(string(b))
}

// TestTiedChildOutlivesEndingThreads: a StartTied process keeps running
// while other threads of this process end, as a thread does when a
// goroutine locked to it returns (every tie does when its process ends).
// The control shows why that matters: a parent-death signal set on
// whatever thread a goroutine runs on fires when that thread ends, with
// the process alive. make bench started its coordinator that way, and
// lost it when the Citus cells stopped their cluster.
func TestTiedChildOutlivesEndingThreads(t *testing.T) {
	t.Parallel()
	alive := func(cmd *exec.Cmd, done <-chan struct{}) bool {
		select {
		case <-done:
			return false
		case <-time.After(500 * time.Millisecond):
			return cmd.Process.Signal(syscall.Signal(0)) == nil
		}
	}
	waited := func(cmd *exec.Cmd) <-chan struct{} {
		done := make(chan struct{})
		go func() {
			_ = cmd.Wait()
			close(done)
		}()
		return done
	}

	// The control: started from a goroutine whose thread then ends.
	control := exec.Command("sleep", "60")
	control.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		started <- control.Start()
	}()
	if err := <-started; err != nil {
		t.Fatal(err)
	}
	if alive(control, waited(control)) {
		_ = control.Process.Kill()
		t.Fatal("the control outlived the thread that started it: this kernel does not tie the parent-death signal to the thread, and the test shows nothing")
	}

	release := make(chan struct{})
	tied := exec.Command("sleep", "60")
	if err := StartTied(tied, syscall.SIGKILL, release); err != nil {
		t.Fatal(err)
	}
	done := waited(tied)
	t.Cleanup(func() {
		close(release)
		<-done
	})
	for range 16 {
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			runtime.LockOSThread() // this thread ends when the goroutine returns
		}()
		<-ended
	}
	if !alive(tied, done) {
		t.Fatal("a StartTied process was killed when other threads of the test binary ended")
	}
}
