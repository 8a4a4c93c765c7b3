package chaos

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestToxiproxyRestartsWhenItsAPIHangs checks the harness's way out of
// toxiproxy's control API hanging (Shopify/toxiproxy#558), which cannot be
// caused on demand: the server is stopped (SIGSTOP), so its API times out
// as it does then. Control calls that hang together make one restart
// between them (the first to time out kills the server, which cuts the
// others short): the server is killed and a new one serves the same
// proxy on the same port with the steady toxic and no other, the
// connections through the old one are cut, and new ones go through. A
// reset that times out is done by a restart. Past the bound, a call fails
// naming the upstream issue.
func TestToxiproxyRestartsWhenItsAPIHangs(t *testing.T) {
	echo := startEcho(t)

	tp := startToxiproxy(t)
	tp.callTimeout, tp.maxRestarts = 3*time.Second, 2
	addr := tp.proxy("echo", echo.Addr().String())
	lag := toxic{Name: "lag", Type: "latency", Stream: "downstream", Toxicity: 1, Attributes: map[string]int64{"latency": 1}}
	if err := tp.setSteady([]proxyToxic{{"echo", lag}}); err != nil {
		t.Fatal(err)
	}
	roundTrip := func(c net.Conn) error {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping\n")); err != nil {
			return err
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		if err == nil && line != "ping\n" {
			t.Fatalf("echo through the proxy = %q", line)
		}
		return err
	}
	dialTrip := func() {
		t.Helper()
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("dial the proxy on %s: %v", addr, err)
		}
		defer c.Close()
		if err := roundTrip(c); err != nil {
			t.Fatalf("echo through the proxy on %s: %v", addr, err)
		}
	}
	toxicNames := func() []string {
		t.Helper()
		var list []struct {
			Name string `json:"name"`
		}
		if err := tp.call(http.MethodGet, "/proxies/echo/toxics", nil, &list); err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, x := range list {
			names = append(names, x.Name)
		}
		return names
	}
	hang := func() int {
		t.Helper()
		pid := tp.pid()
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		// The signal takes effect asynchronously: wait for the state
		// "T (stopped)".
		for deadline := time.Now().Add(5 * time.Second); ; {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(string(b), "\nState:\tT") {
				return pid
			}
			if time.Now().After(deadline) {
				t.Fatalf("toxiproxy, pid %d, did not stop:\n%s", pid, b)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	gone := func(pid int) {
		t.Helper()
		if tp.pid() == pid {
			t.Fatalf("toxiproxy is still pid %d", pid)
		}
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Fatalf("the old toxiproxy, pid %d: kill -0 = %v, want ESRCH", pid, err)
		}
	}

	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := roundTrip(c); err != nil {
		t.Fatal(err)
	}

	// Three control calls hang, a second apart: the first times out and
	// restarts the server, which cuts the two others short; all three
	// report the restart.
	pid := hang()
	errs := make([]error, 3)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Go(func() {
			time.Sleep(time.Duration(i) * time.Second)
			errs[i] = tp.add("echo", toxic{Name: "fault-" + string(rune('a'+i)), Type: "timeout", Stream: "upstream", Toxicity: 1,
				Attributes: map[string]int64{"timeout": 0}})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if !errors.Is(err, errToxiproxyRestarted) {
			t.Fatalf("add %d to a stopped toxiproxy = %v, want errToxiproxyRestarted", i, err)
		}
	}
	if n := tp.restartCount(); n != 1 {
		t.Fatalf("restarts = %d, want 1", n)
	}
	gone(pid)
	if err := roundTrip(c); err == nil {
		t.Fatal("a connection through the killed toxiproxy still echoes")
	}
	dialTrip()
	if names := toxicNames(); strings.Join(names, ",") != "lag" {
		t.Fatalf("toxics after the restart = %v, want the steady one only, [lag]", names)
	}

	// A reset that times out: the restart leaves no toxics.
	if err := tp.setSteady(nil); err != nil {
		t.Fatal(err)
	}
	pid = hang()
	if err := tp.reset(); err != nil {
		t.Fatalf("reset of a stopped toxiproxy: %v", err)
	}
	if n := tp.restartCount(); n != 2 {
		t.Fatalf("restarts = %d, want 2", n)
	}
	gone(pid)
	dialTrip()
	if names := toxicNames(); len(names) != 0 {
		t.Fatalf("toxics after a reset by restart = %v, want none", names)
	}

	// Past the bound: an error naming the upstream issue, then and after.
	hang()
	for range 2 {
		err := tp.remove("echo", "lag")
		if err == nil || errors.Is(err, errToxiproxyRestarted) || !strings.Contains(err.Error(), "Shopify/toxiproxy#558") {
			t.Fatalf("a call past the bound of restarts = %v, want an error naming Shopify/toxiproxy#558", err)
		}
		t.Logf("past the bound: %v", err)
	}
	if n := tp.restartCount(); n != 2 {
		t.Fatalf("restarts = %d, want 2", n)
	}
}
