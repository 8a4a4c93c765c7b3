package main

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/server"
)

// rssBoundBytes is how much the coordinator's peak resident memory may grow
// while it refuses oversized requests: a correct cap (6 MiB by default)
// stays well under it, inflating or buffering 100 MB does not.
const rssBoundBytes = 40 << 20

// memory is the resident set of a process, from /proc/<pid>/status.
type memory struct{ rss, peak int64 }

// processMemory reads the current (VmRSS) and peak (VmHWM) resident set of
// the process pid.
func processMemory(t *testing.T, pid int) memory {
	t.Helper()
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Skipf("no /proc to measure the coordinator's memory: %v", err)
	}
	var m memory
	for line := range strings.Lines(string(data)) {
		name, value, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(value), " kB"), 10, 64)
		if err != nil {
			continue
		}
		switch name {
		case "VmRSS":
			m.rss = kb << 10
		case "VmHWM":
			m.peak = kb << 10
		}
	}
	if m.rss == 0 || m.peak == 0 {
		t.Fatalf("no VmRSS or VmHWM in /proc/%d/status", pid)
	}
	return m
}

// wantMemoryBounded fails t when the process's peak resident set grew by
// bound bytes or more since before, and logs the figures.
func wantMemoryBounded(t *testing.T, p *proc, what string, before memory, bound int64) {
	t.Helper()
	after := processMemory(t, p.cmd.Process.Pid)
	t.Logf("%s: VmRSS %d → %d MiB, VmHWM %d → %d MiB", what, before.rss>>20, after.rss>>20, before.peak>>20, after.peak>>20)
	if grew := after.peak - before.peak; grew >= bound {
		t.Fatalf("%s: the coordinator's peak RSS grew by %d MiB (bound %d MiB)", what, grew>>20, bound>>20)
	}
}

// startListener runs the binary with auth off on loopback ports, with the
// environment variables env (NAME=value) added, and returns it with its
// HTTP address.
func startListener(t *testing.T, env ...string) (*proc, string) {
	t.Helper()
	for _, kv := range env {
		name, value, _ := strings.Cut(kv, "=")
		t.Setenv(name, value)
	}
	httpAddr := coordtest.FreeAddr(t)
	return startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), httpAddr), httpAddr
}

// httpCall is one request to the binary's HTTP listener.
type httpCall struct {
	method, path string
	host         string            // the Host header; empty: the address dialled
	header       map[string]string // extra headers
	body         io.Reader
	length       int64 // the Content-Length; -1: unknown (chunked)
}

// answer is an HTTP status and body.
type answer struct {
	status int
	body   string
}

// do sends call to addr and returns the answer.
func (call httpCall) do(t *testing.T, addr string) answer {
	t.Helper()
	a, err := call.send(addr)
	if err != nil {
		t.Fatalf("%s %s: %v", call.method, call.path, err)
	}
	return a
}

// send sends call to addr and returns the answer, one that arrived before
// a write of the body failed included (coordtest.AnswerFirstTransport):
// the listener answers an oversized body 413 before reading all of it.
// With net/http's own Transport, TestHTTPBodyCapBoundsMemory failed 1
// run in 15 on a busy machine (a broken pipe instead of the 413).
func (call httpCall) send(addr string) (answer, error) {
	if call.method == "" {
		call.method = http.MethodPost
	}
	req, err := http.NewRequest(call.method, "http://"+addr+call.path, call.body)
	if err != nil {
		return answer{}, err
	}
	if call.body != nil {
		req.ContentLength = call.length
	}
	req.Host = call.host
	if call.method == http.MethodPost {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range call.header {
		req.Header.Set(k, v)
	}
	resp, err := (&http.Client{Transport: coordtest.AnswerFirstTransport{}}).Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, body: string(b)}, err
}

// post is a POST of a JSON body to path.
func post(path, body string, header ...string) httpCall {
	h := map[string]string{}
	for i := 0; i+1 < len(header); i += 2 {
		h[header[i]] = header[i+1]
	}
	return httpCall{path: path, header: h, body: strings.NewReader(body), length: int64(len(body))}
}

// gzipped compresses data.
func gzipped(t *testing.T, data string) []byte {
	t.Helper()
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	if _, err := io.WriteString(zw, data); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// wantOutcome fails t unless a is a 200 whose JSON outcome is want.
func wantOutcome(t *testing.T, what string, a answer, want string) {
	t.Helper()
	var m struct{ Outcome string }
	if a.status != http.StatusOK || json.Unmarshal([]byte(a.body), &m) != nil || m.Outcome != want {
		t.Fatalf("%s: HTTP %d %s, want %s", what, a.status, a.body, want)
	}
}

const (
	beginPath  = "/idempotency.v1.Coordinator/Begin"
	lookupPath = "/idempotency.v1.Coordinator/Lookup"
	forgetPath = "/idempotency.v1.Admin/Forget"
)

// TestHTTPGzipBombRefused: a gzip body is inflated with the body cap before
// anything decodes it: an unauthenticated ~130 KB body that inflates to
// 128 MiB gets 413 and the coordinator's peak memory barely moves; a
// compressed Begin under the cap works.
func TestHTTPGzipBombRefused(t *testing.T) {
	p, addr := startListener(t)
	gz := map[string]string{"Content-Encoding": "gzip"}
	// An hour's lease: the last Begin finds it held however slow the
	// machine (with the default 30 s, a busy CI machine saw it lapse).
	small := gzipped(t, `{"scope":"build","key":"small","lease":"3600s"}`)
	wantOutcome(t, "warm-up gzip Begin", httpCall{path: beginPath, header: gz, body: bytes.NewReader(small), length: int64(len(small))}.do(t, addr), "OUTCOME_ACQUIRED")

	var bomb bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&bomb, gzip.BestCompression)
	_, _ = io.WriteString(zw, `{"scope":"build","key":"`)
	chunk := bytes.Repeat([]byte("a"), 1<<20)
	for range 128 {
		_, _ = zw.Write(chunk)
	}
	_, _ = io.WriteString(zw, `"}`)
	_ = zw.Close()
	t.Logf("bomb: %d bytes of gzip inflating to %d MiB", bomb.Len(), 128)

	before := processMemory(t, p.cmd.Process.Pid)
	a := httpCall{path: beginPath, header: gz, body: bytes.NewReader(bomb.Bytes()), length: int64(bomb.Len())}.do(t, addr)
	wantMemoryBounded(t, p, "gzip bomb", before, rssBoundBytes)
	if a.status != http.StatusRequestEntityTooLarge {
		t.Fatalf("gzip bomb: HTTP %d %.300s, want 413", a.status, a.body)
	}

	// 4 MiB once inflated, under the default cap of 6 MiB: decoded (and
	// refused by validation, the fingerprint being too long).
	under := gzipped(t, `{"scope":"build","key":"under","fingerprint":"`+strings.Repeat("A", 4<<20)+`"}`)
	a = httpCall{path: beginPath, header: gz, body: bytes.NewReader(under), length: int64(len(under))}.do(t, addr)
	if a.status != http.StatusBadRequest || !strings.Contains(a.body, "invalid_argument") {
		t.Fatalf("gzip Begin of 4 MiB: HTTP %d %.300s, want invalid_argument", a.status, a.body)
	}
	wantOutcome(t, "gzip Begin", httpCall{path: beginPath, header: gz, body: bytes.NewReader(small), length: int64(len(small))}.do(t, addr), "OUTCOME_IN_PROGRESS")
	p.stop()
}

// TestHTTPBodyCapBoundsMemory: an uncompressed 16 MiB body gets 413 before
// it is buffered, with its length announced or chunked, alone or 16 at
// once, and the coordinator's peak memory stays bounded. The bodies all
// come from one client, whose share is the whole budget here.
func TestHTTPBodyCapBoundsMemory(t *testing.T) {
	p, addr := startListener(t, "IDEMCOORD_HTTP_MAX_BUFFERED_BYTES_PER_CLIENT="+strconv.Itoa(server.DefaultHTTPMaxBufferedBytes))
	wantOutcome(t, "warm-up Begin", post(beginPath, `{"scope":"build","key":"k"}`).do(t, addr), "OUTCOME_ACQUIRED")
	const prefix = `{"scope":"build","key":"big","fingerprint":"`
	body := prefix + strings.Repeat("A", 16<<20-len(prefix)-2) + `"}`
	before := processMemory(t, p.cmd.Process.Pid)
	a := post(beginPath, body).do(t, addr)
	chunked := httpCall{path: beginPath, body: io.MultiReader(strings.NewReader(body)), length: -1}.do(t, addr)
	wantMemoryBounded(t, p, "one 16 MiB body, then one chunked", before, rssBoundBytes)
	if a.status != http.StatusRequestEntityTooLarge || chunked.status != http.StatusRequestEntityTooLarge {
		t.Fatalf("16 MiB body: HTTP %d %.300s; chunked: HTTP %d %.300s; want 413", a.status, a.body, chunked.status, chunked.body)
	}

	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Go(func() {
			a, err := post(beginPath, body).send(addr)
			if err == nil && a.status != http.StatusRequestEntityTooLarge {
				err = fmt.Errorf("HTTP %d %.300s, want 413", a.status, a.body)
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	wantMemoryBounded(t, p, "16 concurrent 16 MiB bodies", before, rssBoundBytes)
	for err := range errs {
		if err != nil {
			t.Fatalf("one of 16 concurrent 16 MiB bodies: %v", err)
		}
	}

	// Chunked, their length unknown, each is read up to the cap before it
	// is refused: 16 at once cost at most 16 caps.
	errs = make(chan error, 16)
	for range 16 {
		wg.Go(func() {
			a, err := httpCall{path: beginPath, body: io.MultiReader(strings.NewReader(body)), length: -1}.send(addr)
			if err == nil && a.status != http.StatusRequestEntityTooLarge {
				err = fmt.Errorf("HTTP %d %.300s, want 413", a.status, a.body)
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	wantMemoryBounded(t, p, "16 concurrent chunked 16 MiB bodies", before, 16*server.DefaultHTTPMaxBodyBytes+rssBoundBytes)
	for err := range errs {
		if err != nil {
			t.Fatalf("one of 16 concurrent chunked 16 MiB bodies: %v", err)
		}
	}
	wantOutcome(t, "Begin after", post(beginPath, `{"scope":"build","key":"k"}`).do(t, addr), "OUTCOME_IN_PROGRESS")
	p.stop()
}

// TestHTTPUnsupportedEncoding: a request compressed in a way the listener
// does not inflate itself, with a cap, gets 415: another Content-Encoding,
// and the per-message compression of Connect streaming, gRPC-Web and
// Connect GET.
func TestHTTPUnsupportedEncoding(t *testing.T) {
	p, addr := startListener(t)
	begin := `{"scope":"build","key":"k"}`
	for name, call := range map[string]httpCall{
		"Content-Encoding: br":       post(beginPath, begin, "Content-Encoding", "br"),
		"Content-Encoding: deflate":  post(beginPath, begin, "Content-Encoding", "deflate"),
		"Content-Encoding: gzip, br": post(beginPath, begin, "Content-Encoding", "gzip, br"),
		"gRPC-Web with Grpc-Encoding: gzip": post(lookupPath, "\x01\x00\x00\x00\x00", "Content-Type", "application/grpc-web+proto",
			"Grpc-Encoding", "gzip"),
		"Connect streaming with Connect-Content-Encoding: gzip": post(lookupPath, "\x01\x00\x00\x00\x00",
			"Content-Type", "application/connect+json", "Connect-Content-Encoding", "gzip"),
		"Connect GET with compression=gzip": {method: http.MethodGet,
			path: lookupPath + "?connect=v1&encoding=json&compression=gzip&base64=1&message=" + base64.RawURLEncoding.EncodeToString(gzipped(t, "{}"))},
	} {
		if a := call.do(t, addr); a.status != http.StatusUnsupportedMediaType {
			t.Errorf("%s: HTTP %d %.300s, want 415", name, a.status, a.body)
		}
	}
	// identity is no encoding.
	wantOutcome(t, "Content-Encoding: identity", post(beginPath, begin, "Content-Encoding", "identity").do(t, addr), "OUTCOME_ACQUIRED")
	p.stop()
}

// TestHTTPHostAllowListWithoutAuth: with auth off, a request whose Host is
// neither a loopback name or address nor listed in --http-allowed-hosts
// gets 421 and changes nothing (a DNS-rebinding page cannot call the API);
// loopback hosts and listed ones are served.
func TestHTTPHostAllowListWithoutAuth(t *testing.T) {
	p, addr := startListener(t, "IDEMCOORD_HTTP_ALLOWED_HOSTS=idemcoord.internal, Coord.Example.")
	_, port, _ := net.SplitHostPort(addr)
	begin := `{"scope":"build","key":"k"}`
	wantOutcome(t, "Begin", post(beginPath, begin).do(t, addr), "OUTCOME_ACQUIRED")

	for _, host := range []string{"evil.example:" + port, "evil.example", "127.0.0.1.evil.example:" + port, "localhost.evil.example:" + port, "10.0.0.1:" + port} {
		for _, call := range []httpCall{post(forgetPath, begin), post(beginPath, `{"scope":"build","key":"rebound"}`),
			{method: http.MethodGet, path: "/metrics"}} {
			call.host = host
			if a := call.do(t, addr); a.status != http.StatusMisdirectedRequest {
				t.Fatalf("%s %s with Host %s: HTTP %d %.300s, want 421", call.method, call.path, host, a.status, a.body)
			}
		}
	}
	// Nothing was written: the record is still in progress, the other key
	// is absent.
	wantOutcome(t, "Begin after the refused Forget", post(beginPath, begin).do(t, addr), "OUTCOME_IN_PROGRESS")
	if a := post(lookupPath, `{"scope":"build","key":"rebound"}`).do(t, addr); a.status != http.StatusNotFound {
		t.Fatalf("Lookup of the refused Begin's key: HTTP %d %s", a.status, a.body)
	}
	for i, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "LOCALHOST", "[::1]:" + port, "127.0.0.2:" + port,
		"idemcoord.internal:" + port, "coord.example"} {
		call := post(beginPath, fmt.Sprintf(`{"scope":"build","key":"h%d"}`, i))
		call.host = host
		wantOutcome(t, "Begin with Host "+host, call.do(t, addr), "OUTCOME_ACQUIRED")
	}
	// The probes answer whatever the Host: they reveal nothing.
	for _, path := range []string{"/healthz", "/readyz"} {
		if a := (httpCall{method: http.MethodGet, path: path, host: "evil.example"}).do(t, addr); a.status != http.StatusOK {
			t.Fatalf("%s with another Host: HTTP %d %s", path, a.status, a.body)
		}
	}
	p.stop()
}

// TestHTTPSlowBodyDisconnected: a client that sends its headers and then
// trickles its body, or stops sending it, is cut off after the read
// timeout; a waiting Begin longer than the read timeout still gets its
// answer.
func TestHTTPSlowBodyDisconnected(t *testing.T) {
	p, addr := startListener(t, "IDEMCOORD_HTTP_READ_TIMEOUT=2s")
	for _, trickle := range []bool{false, true} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"scope\":", beginPath, addr)
		closed := make(chan error, 1)
		go func() {
			_, err := io.Copy(io.Discard, bufio.NewReader(conn))
			closed <- err
		}()
		tick := time.NewTicker(200 * time.Millisecond)
		timeout := time.After(12 * time.Second)
	wait:
		for {
			select {
			case <-closed: //nolint:errcheck // only the closing matters, not how the read ended
				break wait
			case <-tick.C:
				if trickle {
					_, _ = conn.Write([]byte(" "))
				}
			case <-timeout:
				t.Fatalf("trickle %v: the connection is still open %v after the headers", trickle, time.Since(start).Round(time.Second))
			}
		}
		tick.Stop()
		conn.Close()
		if took := time.Since(start); took < time.Second {
			t.Fatalf("trickle %v: closed after %v, before the read timeout", trickle, took)
		}
	}
	// A Begin that waits 4 s for a key in progress outlives the read
	// timeout: it answers IN_PROGRESS after its wait.
	wantOutcome(t, "Begin", post(beginPath, `{"scope":"build","key":"w"}`).do(t, addr), "OUTCOME_ACQUIRED")
	start := time.Now()
	wantOutcome(t, "waiting Begin", post(beginPath, `{"scope":"build","key":"w","wait":"4s"}`).do(t, addr), "OUTCOME_IN_PROGRESS")
	if took := time.Since(start); took < 4*time.Second {
		t.Fatalf("the waiting Begin answered after %v", took)
	}
	p.stop()
}

// TestHTTPBufferedBodiesBounded: bodies of unknown length being buffered at
// once share the listener's budget (--http-max-buffered-bytes): 40
// connections that each send a few KB of gzip inflating to just under the
// body cap, and never finish it, cost the coordinator at most the budget;
// those past it get 503 with Retry-After, and once they are gone a request
// is served again. The bodies all come from one client, whose share is
// the whole budget here (TestHTTPTrickleFloodLeavesAPIServed tests
// shares).
func TestHTTPBufferedBodiesBounded(t *testing.T) {
	const budget = 8 << 20
	p, addr := startListener(t, "IDEMCOORD_HTTP_MAX_BUFFERED_BYTES="+strconv.Itoa(budget),
		"IDEMCOORD_HTTP_MAX_BUFFERED_BYTES_PER_CLIENT="+strconv.Itoa(budget))
	wantOutcome(t, "warm-up Begin", post(beginPath, `{"scope":"build","key":"k"}`).do(t, addr), "OUTCOME_ACQUIRED")

	// A gzip stream flushed but never finished: the coordinator inflates
	// it and waits for the rest.
	var part bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&part, gzip.BestCompression)
	prefix := `{"scope":"build","key":"held","fingerprint":"`
	_, _ = io.WriteString(zw, prefix+strings.Repeat("a", server.DefaultHTTPMaxBodyBytes-len(prefix)-200))
	_ = zw.Flush()

	before := processMemory(t, p.cmd.Process.Pid)
	const conns = 60
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"+
			"Transfer-Encoding: chunked\r\n\r\n%x\r\n", lookupPath, addr, part.Len())
		_, _ = c.Write(part.Bytes())
		_, _ = io.WriteString(c, "\r\n")
	}
	time.Sleep(3 * time.Second)
	// Unbounded, the 60 bodies would hold 360 MiB; bounded, the budget's
	// 8 MiB plus garbage the collector has not yet reclaimed, which on a
	// loaded machine has reached 85 MiB in all (hence 10× the budget).
	wantMemoryBounded(t, p, fmt.Sprintf("%d unfinished gzip bodies of %d MiB", conns, server.DefaultHTTPMaxBodyBytes>>20),
		before, 10*budget+rssBoundBytes)

	refused := 0
	for _, c := range held {
		_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			continue // still held
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
			t.Fatalf("an unfinished gzip body: HTTP %d (Retry-After %q), want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
		refused++
	}
	if refused == 0 {
		t.Fatalf("none of %d unfinished gzip bodies was refused", conns)
	}
	t.Logf("%d of %d unfinished gzip bodies refused with 503", refused, conns)
	for _, c := range held {
		c.Close()
	}
	held = nil
	time.Sleep(500 * time.Millisecond)
	wantOutcome(t, "Begin once the budget is free", post(beginPath, `{"scope":"build","key":"k"}`).do(t, addr), "OUTCOME_IN_PROGRESS")
	chunked := gzipped(t, `{"scope":"build","key":"k"}`)
	wantOutcome(t, "chunked gzip Begin once the budget is free", httpCall{path: beginPath, header: map[string]string{"Content-Encoding": "gzip"},
		body: io.MultiReader(bytes.NewReader(chunked)), length: -1}.do(t, addr), "OUTCOME_IN_PROGRESS")
	p.stop()
}

// trickleFlood opens n connections to addr from the loopback address from,
// each sending request (its headers, ending with a chunked body's first
// chunk) and then one more byte of body every second, never finishing it.
// It returns the connections; closing them ends the flood.
func trickleFlood(t *testing.T, addr, from string, n int, request string) []net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
	conns := make([]net.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range n {
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("connection %d of the flood from %s: %v", len(conns)+1, from, err)
		}
		conns = append(conns, c)
		_, _ = io.WriteString(c, request)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	go func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				for _, c := range conns {
					_ = c.SetWriteDeadline(time.Now().Add(10 * time.Millisecond))
					_, _ = io.WriteString(c, "1\r\n \r\n")
				}
			}
		}
	}()
	return conns
}

// refusedOf counts the connections of a flood that the listener has
// answered, by status.
func refusedOf(conns []net.Conn) map[int]int {
	statuses := map[int]int{}
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			continue // still held (or closed without an answer)
		}
		resp.Body.Close()
		statuses[resp.StatusCode]++
	}
	return statuses
}

// TestHTTPTrickleFloodLeavesAPIServed: thousands of connections from one
// client that each send a little of a body and then trickle the rest do
// not starve the listener's budget of buffered bodies: while
// unauthenticated ones flood paths that are not API methods (which have a
// budget of their own), and then while an authenticated tenant's flood an
// API method (16 KiB each, past the client's share of the budget), the
// flood's requests past the share get 429, authenticated calls from
// another client are served (never 503), /healthz answers, and the
// coordinator's memory stays bounded.
func TestHTTPTrickleFloodLeavesAPIServed(t *testing.T) {
	const conns = 2200 // 2,100 × 64 KiB fill the default budget of 128 MiB
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("tenants:\n  - { name: builds, token_sha256: %s, scopes: [\"*\"] }\n"+
		"  - { name: noisy, token_sha256: %s, scopes: [\"*\"] }\n", tokenHash("build-secret"), tokenHash("noisy-secret"))), 0o600); err != nil {
		t.Fatal(err)
	}
	httpAddr := coordtest.FreeAddr(t)
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), httpAddr, "--config", cfg)
	auth := []string{"Authorization", "Bearer build-secret"}
	wantOutcome(t, "warm-up Begin", post(beginPath, `{"scope":"build","key":"warm"}`, auth...).do(t, httpAddr), "OUTCOME_ACQUIRED")

	for i, flood := range []struct{ name, request string }{
		{"unauthenticated, to /nowhere and /metrics", "POST /nowhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"},
		{"authenticated, to Begin", "POST " + beginPath + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
			"Authorization: Bearer noisy-secret\r\nTransfer-Encoding: chunked\r\n\r\n4000\r\n{" + strings.Repeat(" ", 16<<10-1) + "\r\n"},
	} {
		before := processMemory(t, p.cmd.Process.Pid)
		flooding := trickleFlood(t, httpAddr, "127.0.0.2", conns, flood.request)
		if i == 0 {
			flooding = append(flooding, trickleFlood(t, httpAddr, "127.0.0.2", conns/10,
				strings.Replace(flood.request, "/nowhere", "/metrics", 1))...)
		}
		time.Sleep(2 * time.Second) // the listener reads what each sent
		failed := 0
		for k := range 10 {
			a := post(beginPath, fmt.Sprintf(`{"scope":"build","key":"during-%d-%d"}`, i, k), auth...).do(t, httpAddr)
			if a.status != http.StatusOK {
				failed++
				t.Logf("%s flood: Begin %d: HTTP %d %.200s", flood.name, k, a.status, a.body)
			}
			time.Sleep(200 * time.Millisecond)
		}
		if a := (httpCall{method: http.MethodGet, path: "/healthz"}).do(t, httpAddr); a.status != http.StatusOK {
			t.Errorf("%s flood: /healthz: HTTP %d %.200s", flood.name, a.status, a.body)
		}
		statuses := refusedOf(flooding)
		t.Logf("%s flood of %d connections from 127.0.0.2: %d of 10 authenticated Begins failed; the flood's answers: %v",
			flood.name, len(flooding), failed, statuses)
		// The flood's bodies are held within the budget (128 MiB) or
		// refused; the connections themselves cost some tens of MiB.
		wantMemoryBounded(t, p, flood.name+" flood", before, server.DefaultHTTPMaxBufferedBytes)
		if failed > 0 {
			t.Fatalf("%s flood: %d of 10 authenticated Begins from another client failed", flood.name, failed)
		}
		if statuses[http.StatusTooManyRequests] == 0 {
			t.Fatalf("%s flood: none of its requests got 429 (past the client's share): %v", flood.name, statuses)
		}
		for _, c := range flooding {
			c.Close()
		}
	}
	p.stop()
}

// TestHTTPListenerLimitsConnections: with --http-max-connections 2 (here
// from the environment), two open connections that send nothing keep a
// third from being served until one closes. The flag defaults to
// defaultHTTPMaxConns; 0 is no limit.
func TestHTTPListenerLimitsConnections(t *testing.T) {
	c, err := parseFlags([]string{"--database-url", "postgres://x"})
	if err != nil || c.httpMaxConns != defaultHTTPMaxConns {
		t.Fatalf("defaults: %+v %v", c, err)
	}
	if c, err = parseFlags([]string{"--database-url", "postgres://x", "--http-max-connections", "0"}); err != nil || c.httpMaxConns != 0 {
		t.Fatalf("--http-max-connections 0: %+v %v", c, err)
	}
	if _, err = parseFlags([]string{"--database-url", "postgres://x", "--http-max-connections", "-1"}); err == nil {
		t.Fatal("--http-max-connections -1 accepted")
	}

	p, addr := startListener(t, "IDEMCOORD_HTTP_MAX_CONNECTIONS=2")
	get := func(timeout time.Duration) error {
		client := &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true}}
		resp, err := client.Get("http://" + addr + "/healthz")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	if err := get(10 * time.Second); err != nil {
		t.Fatalf("/healthz with no other connection: %v", err)
	}
	var held []net.Conn
	for range 2 {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		held = append(held, conn)
	}
	if err := get(time.Second); err == nil {
		t.Fatal("/healthz answered while 2 connections held both slots")
	}
	_ = held[0].Close()
	if err := get(10 * time.Second); err != nil {
		t.Fatalf("/healthz once a connection closed: %v", err)
	}
	_ = held[1].Close()
	p.stop()
}
