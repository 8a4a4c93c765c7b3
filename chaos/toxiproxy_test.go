package chaos

import (
	"bytes"
	"context"
	"encoding/json"
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
)

// toxiproxyVersion is the toxiproxy release the Makefile installs into
// ./bin as toxiproxy-server (`make tools`).
const toxiproxyVersion = "2.5.0"

// toxiproxy is a running toxiproxy server (Shopify's fault-injecting TCP
// proxy), driven over its HTTP API. It listens on 127.0.0.1 only, as do
// the proxies it makes.
type toxiproxy struct {
	t   *testing.T
	api string // http://127.0.0.1:port
}

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
		missingTool(t, "no toxiproxy server at %s: install it with `make tools` (toxiproxy v%s) or set IDEMCOORD_TOXIPROXY", bin, toxiproxyVersion)
	}
	return bin
}

// missingTool skips the test naming what is missing, or fails it under
// CI=true, where every tool must be installed (.ci/run installs them).
func missingTool(t *testing.T, format string, args ...any) {
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
	bin := toxiproxyBinary(t)
	addr := coordtest.FreeAddr(t)
	host, port, _ := net.SplitHostPort(addr)
	cmd := exec.Command(bin, "-host", host, "-port", port)
	cmd.Env = append(os.Environ(), "LOG_LEVEL=error")
	var log syncBuffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	tp := &toxiproxy{t: t, api: "http://" + addr}
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := tp.call(http.MethodGet, "/version", nil, nil)
		if err == nil {
			return tp
		}
		if time.Now().After(deadline) {
			t.Fatalf("toxiproxy did not answer on %s: %v\n%s", addr, err, log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
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

// reset removes every toxic of every proxy (and enables them all).
func (tp *toxiproxy) reset() error {
	return tp.call(http.MethodPost, "/reset", nil, nil)
}

func (tp *toxiproxy) call(method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, tp.api+path, body)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
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

// syncBuffer is a bytes.Buffer safe for a process's output and the test.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
