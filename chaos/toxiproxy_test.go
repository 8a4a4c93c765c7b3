package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
)

// toxiproxyVersion is the toxiproxy release the Makefile installs into
// ./bin as toxiproxy-server (`make tools`).
const toxiproxyVersion = "2.5.0"

// toxiproxy is a running toxiproxy server (Shopify's fault-injecting TCP
// proxy), driven over its HTTP API. It listens on 127.0.0.1 only, as do
// the proxies it makes.
//
// toxiproxy v2.5.0's control API can hang for good (Shopify/toxiproxy#558:
// removing or adding a toxic waits, holding the collection's mutex, for a
// toxic stuck sending to a connection that died). When a control call times
// out, the harness kills the server and starts a new one on the same
// ports, with the same proxies (same listen addresses) and the steady
// toxics, if any are set (restart). A restart cuts every connection
// through the proxies: a fault of its own, which the test counts
// (restarts), at most maxRestarts times per test.
type toxiproxy struct {
	t       *testing.T
	bin     string
	apiAddr string
	api     string // http://apiAddr
	client  *http.Client
	// callTimeout bounds every control call; one that times out restarts
	// the server.
	callTimeout time.Duration
	maxRestarts int

	// restartMu is held by a restart from start to end: a call that failed
	// takes it to learn, once the restart is done, whether the server was
	// replaced under it. mu is held shared by a control call and
	// exclusively by a restart once the old server is dead (the calls in
	// flight then fail at once), holding back new calls until the new
	// server is ready. proc, gen, restarts and broken are written with
	// both held, proxies and steady with mu held.
	restartMu sync.Mutex
	mu        sync.RWMutex
	proc      *toxiproxyProcess
	gen       int // incremented by every restart
	restarts  int
	broken    error // set when a restart failed or the bound is reached
	proxies   []toxiproxyProxy
	steady    []proxyToxic
}

// toxiproxyProcess is one toxiproxy-server process.
type toxiproxyProcess struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once it has exited and been waited for
	log  *testkit.LogBuffer
}

// toxiproxyProxy is a proxy as made, for a restart to make it again.
type toxiproxyProxy struct {
	name, listen, upstream string
}

// proxyToxic is a toxic on a proxy.
type proxyToxic struct {
	proxy string
	toxic toxic
}

// errToxiproxyRestarted is the error of a control call that timed out, or
// was made on a server replaced since, once the server has been restarted
// (no toxics but the steady ones): the call's effect is void, and the
// caller may carry on.
var errToxiproxyRestarted = errors.New("toxiproxy restarted")

// toxiproxyBinary returns the toxiproxy server that `make tools` installs
// (or IDEMCOORD_TOXIPROXY), or skips the test naming what is missing (fails
// it under CI=true).
func toxiproxyBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("IDEMCOORD_TOXIPROXY")
	if bin == "" {
		var err error
		if bin, err = filepath.Abs(filepath.Join("..", "bin", "toxiproxy-server")); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(bin); err != nil {
		missingToolf(t, "no toxiproxy server at %s: install it with `make tools` (toxiproxy v%s) or set IDEMCOORD_TOXIPROXY", bin, toxiproxyVersion)
	}
	return bin
}

// missingToolf skips the test naming what is missing, or fails it under
// CI=true, where every tool must be installed (.ci/run installs them).
func missingToolf(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true and %s", msg)
	}
	t.Skip("skipping: " + msg)
}

// startToxiproxy starts a toxiproxy server on a free loopback port and
// stops it when the test ends.
func startToxiproxy(t *testing.T) *toxiproxy {
	t.Helper()
	addr := coordtest.FreeAddr(t)
	tp := &toxiproxy{t: t, bin: toxiproxyBinary(t), apiAddr: addr, api: "http://" + addr,
		client:      &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()},
		callTimeout: 5 * time.Second, maxRestarts: 3}
	proc, err := tp.start()
	if err != nil {
		t.Fatal(err)
	}
	tp.proc = proc
	t.Cleanup(func() {
		tp.restartMu.Lock()
		defer tp.restartMu.Unlock()
		tp.mu.Lock()
		defer tp.mu.Unlock()
		tp.proc.kill()
	})
	return tp
}

// start starts a toxiproxy server on tp.apiAddr and waits until it
// answers.
func (tp *toxiproxy) start() (*toxiproxyProcess, error) {
	host, port, _ := net.SplitHostPort(tp.apiAddr)
	cmd := exec.Command(tp.bin, "-host", host, "-port", port)
	cmd.Env = append(os.Environ(), "LOG_LEVEL=error")
	p := &toxiproxyProcess{cmd: cmd, done: make(chan struct{}), log: &testkit.LogBuffer{}}
	cmd.Stdout, cmd.Stderr = p.log, p.log
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %v", tp.bin, err)
	}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := tp.do(http.MethodGet, "/version", nil, nil)
		if err == nil {
			return p, nil
		}
		select {
		case <-p.done:
			return nil, fmt.Errorf("toxiproxy exited before it answered on %s: %v\n%s", tp.apiAddr, cmd.ProcessState, p.log.String())
		default:
		}
		if time.Now().After(deadline) {
			p.kill()
			return nil, fmt.Errorf("toxiproxy did not answer on %s: %v\n%s", tp.apiAddr, err, p.log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// kill kills the process (SIGKILL, which ends a stopped process too) and
// waits until it has exited, its sockets closed.
func (p *toxiproxyProcess) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// pid is the process id of the running server.
func (tp *toxiproxy) pid() int {
	tp.mu.RLock()
	defer tp.mu.RUnlock()
	return tp.proc.cmd.Process.Pid
}

// generation counts the servers so far: a toxic added under one
// generation is gone once it has changed (a restart adds only the steady
// ones again).
func (tp *toxiproxy) generation() int {
	tp.mu.RLock()
	defer tp.mu.RUnlock()
	return tp.gen
}

// restartCount is how many times the server was restarted.
func (tp *toxiproxy) restartCount() int {
	tp.mu.RLock()
	defer tp.mu.RUnlock()
	return tp.restarts
}

// setSteady makes toxics the steady ones, added now and again after every
// restart, until the next setSteady (nil: none).
func (tp *toxiproxy) setSteady(toxics []proxyToxic) error {
	tp.mu.Lock()
	tp.steady = toxics
	tp.mu.Unlock()
	for _, pt := range toxics {
		err := tp.add(pt.proxy, pt.toxic)
		if errors.Is(err, errToxiproxyRestarted) {
			return nil // the restart, after setSteady began, added them all
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// proxy makes a proxy named name in front of upstream and returns the
// address it listens on.
func (tp *toxiproxy) proxy(name, upstream string) string {
	tp.t.Helper()
	var p struct {
		Listen string `json:"listen"`
	}
	if err := tp.call(http.MethodPost, "/proxies", map[string]any{
		"name": name, "listen": "127.0.0.1:0", "upstream": upstream, "enabled": true}, &p); err != nil {
		tp.t.Fatalf("toxiproxy: create proxy %s: %v", name, err)
	}
	tp.mu.Lock()
	tp.proxies = append(tp.proxies, toxiproxyProxy{name: name, listen: p.Listen, upstream: upstream})
	tp.mu.Unlock()
	return p.Listen
}

// toxic is one toxic as toxiproxy's API takes it: type is latency,
// reset_peer, timeout, slicer, bandwidth, slow_close or limit_data; stream
// is "upstream" (client to server) or "downstream"; toxicity is the share
// of connections it applies to.
type toxic struct {
	Name       string           `json:"name"`
	Type       string           `json:"type"`
	Stream     string           `json:"stream"`
	Toxicity   float64          `json:"toxicity"`
	Attributes map[string]int64 `json:"attributes"`
}

// add adds a toxic to proxy.
func (tp *toxiproxy) add(proxy string, tx toxic) error {
	return tp.call(http.MethodPost, "/proxies/"+proxy+"/toxics", tx, nil)
}

// remove removes the toxic named name from proxy.
func (tp *toxiproxy) remove(proxy, name string) error {
	return tp.call(http.MethodDelete, "/proxies/"+proxy+"/toxics/"+name, nil, nil)
}

// reset removes every toxic of every proxy (and enables them all), after a
// restart if it times out.
func (tp *toxiproxy) reset() error {
	err := tp.call(http.MethodPost, "/reset", nil, nil)
	if errors.Is(err, errToxiproxyRestarted) {
		err = tp.call(http.MethodPost, "/reset", nil, nil)
	}
	return err
}

// call makes a control call. When it times out, call restarts the server
// and returns an error wrapping errToxiproxyRestarted (or why the restart
// failed); when it failed because another call's restart killed the
// server, it returns such an error too, once the restart is done.
func (tp *toxiproxy) call(method, path string, in, out any) error {
	tp.mu.RLock()
	if tp.broken != nil {
		tp.mu.RUnlock()
		return tp.broken
	}
	gen := tp.gen
	err := tp.do(method, path, in, out)
	tp.mu.RUnlock()
	if err == nil {
		return nil
	}
	if errors.Is(err, context.DeadlineExceeded) || isTimeout(err) {
		return tp.restart(gen, fmt.Errorf("%s %s: %w", method, path, err))
	}
	tp.restartMu.Lock()
	replaced := tp.gen != gen
	tp.restartMu.Unlock()
	if replaced {
		return fmt.Errorf("%w (by another call) under %s %s: %v", errToxiproxyRestarted, method, path, err)
	}
	return err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// restart replaces the server that a control call made under gen found
// hung (cause), unless a restart did already.
func (tp *toxiproxy) restart(gen int, cause error) error {
	tp.restartMu.Lock()
	defer tp.restartMu.Unlock()
	if tp.broken != nil {
		return tp.broken
	}
	if tp.gen != gen {
		return fmt.Errorf("%w (by another call) after %v", errToxiproxyRestarted, cause)
	}
	if tp.restarts >= tp.maxRestarts {
		tp.mu.Lock()
		defer tp.mu.Unlock()
		tp.broken = fmt.Errorf("toxiproxy's control API hung once more after %d restarts (the upstream bug Shopify/toxiproxy#558, whose fix is Shopify/toxiproxy#760): %v",
			tp.restarts, cause)
		return tp.broken
	}
	// Kill first: the calls in flight fail at once and let go of mu.
	old := tp.proc.cmd.Process.Pid
	tp.proc.kill()
	tp.mu.Lock()
	defer tp.mu.Unlock()
	tp.client.CloseIdleConnections()
	tp.restarts++
	tp.gen++
	if err := tp.recreate(); err != nil {
		tp.broken = fmt.Errorf("toxiproxy: restart %d after %v: %v", tp.restarts, cause, err)
		return tp.broken
	}
	tp.t.Logf("toxiproxy: %v (the upstream hang Shopify/toxiproxy#558?): killed pid %d and restarted it as pid %d on the same ports, %d proxies and %d steady toxics (restart %d of at most %d)",
		cause, old, tp.proc.cmd.Process.Pid, len(tp.proxies), len(tp.steady), tp.restarts, tp.maxRestarts)
	return fmt.Errorf("%w after %v", errToxiproxyRestarted, cause)
}

// recreate starts a new server (the old one has exited) on the same API
// port, makes the proxies again on their listen addresses and adds the
// steady toxics. Binding a port again can take a few tries: another
// process may hold it a moment (Go's listeners set SO_REUSEADDR, so the
// old connections' TIME_WAIT do not stop it).
func (tp *toxiproxy) recreate() error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		p, err := tp.start()
		if err == nil {
			tp.proc = p
			break
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, px := range tp.proxies {
		for {
			err := tp.do(http.MethodPost, "/proxies", map[string]any{
				"name": px.name, "listen": px.listen, "upstream": px.upstream, "enabled": true}, nil)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("create proxy %s on %s again: %v", px.name, px.listen, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	for _, pt := range tp.steady {
		if err := tp.do(http.MethodPost, "/proxies/"+pt.proxy+"/toxics", pt.toxic, nil); err != nil {
			return fmt.Errorf("add steady toxic %s to %s: %v", pt.toxic.Name, pt.proxy, err)
		}
	}
	return nil
}

// do makes one control call, bounded by callTimeout.
func (tp *toxiproxy) do(method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), tp.callTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, tp.api+path, body)
	if err != nil {
		return err
	}
	resp, err := tp.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("%s %s: reading the answer: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(b))
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}
