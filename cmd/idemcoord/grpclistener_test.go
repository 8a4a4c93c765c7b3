package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/server"
)

// rawGRPCConn is a client HTTP/2 connection to the gRPC listener written
// frame by frame, so that a test can do what no gRPC client does: open a
// call and send only part of its request message. It keeps to the
// server's flow-control windows, as a careful attacker does (sending past
// them only gets the connection closed).
type rawGRPCConn struct {
	conn net.Conn
	fr   *http2.Framer

	mu            sync.Mutex // guards what follows, and writing frames
	changed       *sync.Cond // windows grew, a call ended, or reading failed
	connWindow    int64
	initialWindow int64
	windows       map[uint32]int64
	ended         map[uint32]string // the grpc-status of a call the server answered, or "RST <code>"
	readErr       error
	nextID        uint32
	headers       bytes.Buffer
	enc           *hpack.Encoder
}

// dialRawGRPC opens a raw HTTP/2 connection to the gRPC listener at addr.
func dialRawGRPC(t *testing.T, addr string) *rawGRPCConn {
	t.Helper()
	return dialRawGRPCFrom(t, addr, "")
}

// dialRawGRPCFrom is dialRawGRPC from the local IP address from (a
// loopback one other than 127.0.0.1 is another client to the listener);
// "" lets the system choose.
func dialRawGRPCFrom(t *testing.T, addr, from string) *rawGRPCConn {
	t.Helper()
	var d net.Dialer
	if from != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(from)}
	}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	c := &rawGRPCConn{conn: conn, fr: http2.NewFramer(conn, conn), connWindow: 65535, initialWindow: 65535,
		windows: map[uint32]int64{}, ended: map[uint32]string{}, nextID: 1}
	c.changed = sync.NewCond(&c.mu)
	c.enc = hpack.NewEncoder(&c.headers)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if _, err := conn.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	if err := c.fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	go c.read()
	return c
}

// read handles the server's frames until the connection fails.
func (c *rawGRPCConn) read() {
	for {
		f, err := c.fr.ReadFrame()
		c.mu.Lock()
		if err != nil {
			c.readErr = err
			c.changed.Broadcast()
			c.mu.Unlock()
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				if v, ok := f.Value(http2.SettingInitialWindowSize); ok {
					for id := range c.windows {
						c.windows[id] += int64(v) - c.initialWindow
					}
					c.initialWindow = int64(v)
				}
				_ = c.fr.WriteSettingsAck()
			}
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 {
				c.connWindow += int64(f.Increment)
			} else {
				c.windows[f.StreamID] += int64(f.Increment)
			}
		case *http2.MetaHeadersFrame:
			if s := f.PseudoValue("status"); s != "" && s != "200" {
				c.ended[f.StreamID] = "HTTP " + s
			}
			for _, hf := range f.RegularFields() {
				if hf.Name == "grpc-status" {
					c.ended[f.StreamID] = hf.Value
				}
			}
		case *http2.RSTStreamFrame:
			if _, ok := c.ended[f.StreamID]; !ok {
				c.ended[f.StreamID] = "RST " + f.ErrCode.String()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				_ = c.fr.WritePing(true, f.Data)
			}
		case *http2.GoAwayFrame:
			c.readErr = fmt.Errorf("GOAWAY %v", f.ErrCode)
		}
		c.changed.Broadcast()
		c.mu.Unlock()
	}
}

// open starts a call of method with the metadata md (name, value pairs)
// and no request yet, and returns its stream id.
func (c *rawGRPCConn) open(method string, md ...string) (uint32, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.headers.Reset()
	fields := []string{":method", "POST", ":scheme", "http", ":path", method, ":authority", "idemcoord",
		"content-type", "application/grpc", "te", "trailers"}
	fields = append(fields, md...)
	for i := 0; i+1 < len(fields); i += 2 {
		if err := c.enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]}); err != nil {
			return 0, err
		}
	}
	id := c.nextID
	c.nextID += 2
	c.windows[id] = c.initialWindow
	return id, c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.headers.Bytes(), EndHeaders: true})
}

// send writes data on stream id as the windows allow, until all of it is
// sent, the server ends the call, the connection fails or deadline
// passes; it returns how much it sent.
func (c *rawGRPCConn) send(id uint32, data []byte, deadline time.Time) int {
	stop := time.AfterFunc(time.Until(deadline), func() {
		c.mu.Lock()
		c.changed.Broadcast()
		c.mu.Unlock()
	})
	defer stop.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	sent := 0
	for sent < len(data) {
		if _, ok := c.ended[id]; ok || c.readErr != nil || time.Now().After(deadline) {
			break
		}
		n := min(int64(len(data)-sent), c.windows[id], c.connWindow, 16384)
		if n <= 0 {
			c.changed.Wait()
			continue
		}
		if err := c.fr.WriteData(id, false, data[sent:sent+int(n)]); err != nil {
			break
		}
		c.windows[id] -= n
		c.connWindow -= n
		sent += int(n)
	}
	return sent
}

// waitEnded waits until the server has ended the call on stream id, or
// deadline passes, and returns how it ended ("" when it has not).
func (c *rawGRPCConn) waitEnded(id uint32, deadline time.Time) string {
	stop := time.AfterFunc(time.Until(deadline), func() {
		c.mu.Lock()
		c.changed.Broadcast()
		c.mu.Unlock()
	})
	defer stop.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		if s, ok := c.ended[id]; ok || c.readErr != nil || time.Now().After(deadline) {
			return s
		}
		c.changed.Wait()
	}
}

// grpcMessage is msg in the gRPC wire format: a flag byte (not
// compressed), its length in 4 bytes, the message.
func grpcMessage(t *testing.T, msg proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	return append(binary.BigEndian.AppendUint32([]byte{0}, uint32(len(b))), b...)
}

// largeBegin is a Begin request message just under the 4 MiB message
// limit.
func largeBegin() *idempotencyv1.BeginRequest {
	return &idempotencyv1.BeginRequest{Scope: "build", Key: "k", Fingerprint: bytes.Repeat([]byte("a"), 4<<20-1024)}
}

// startWithTenants runs the binary with auth on (tenants payments, token
// "pay-secret", and shipping, token "ship-secret") on loopback ports, with
// args added, and returns it with its HTTP address.
func startWithTenants(t *testing.T, args ...string) (*proc, string) {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "idemcoord.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("tenants:\n  - { name: payments, token_sha256: %s, scopes: [\"*\"] }\n"+
		"  - { name: shipping, token_sha256: %s, scopes: [\"*\"] }\n",
		tokenHash("pay-secret"), tokenHash("ship-secret"))), 0o644); err != nil {
		t.Fatal(err)
	}
	httpAddr := coordtest.FreeAddr(t)
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), httpAddr,
		append([]string{"--config", cfg}, args...)...)
	return p, httpAddr
}

// TestGRPCUnauthenticatedFloodBoundsMemory: 2 connections × 200 calls that
// each send all but the last byte of a 4 MiB Begin, with no token, are
// refused UNAUTHENTICATED from their headers: the coordinator holds none of
// their bodies (unbounded, they held 1.6 GB), and a caller with a token is
// served meanwhile.
func TestGRPCUnauthenticatedFloodBoundsMemory(t *testing.T) {
	p, _ := startWithTenants(t)
	msg := grpcMessage(t, largeBegin())
	before := processMemory(t, p.cmd.Process.Pid)
	const conns, calls = 2, 200
	all := floodBegins(t, p.grpcAddr, msg, conns, calls)
	// Each body held would be 4 MiB: bounded, the coordinator holds no
	// body, only the connections and refused streams, plus garbage the
	// collector has not yet reclaimed.
	wantMemoryBounded(t, p, fmt.Sprintf("%d×%d unauthenticated 4 MiB Begins, all but their last byte", conns, calls), before, 2*rssBoundBytes)
	wantBeginAcquired(t, p.grpcAddr, "pay-secret", "Begin with a valid token after the flood")
	for _, c := range all {
		if got := c.c.waitEnded(c.id, time.Now().Add(5*time.Second)); got != strconv.Itoa(16) {
			t.Fatalf("an unauthenticated Begin's call ended %q, want grpc-status 16 (UNAUTHENTICATED)", got)
		}
	}
	p.stop()
}

// TestGRPCAuthenticatedFloodBoundsMemory: 2 connections × 200 calls of
// one tenant that each send all but the last byte of a 4 MiB Begin hold
// at most the tenant's share of the listener's budget of request messages
// (unbounded, they held 1.6 GB): the calls the share cannot take are
// refused RESOURCE_EXHAUSTED, and another tenant is served meanwhile.
func TestGRPCAuthenticatedFloodBoundsMemory(t *testing.T) {
	p, _ := startWithTenants(t)
	msg := grpcMessage(t, largeBegin())
	before := processMemory(t, p.cmd.Process.Pid)
	const conns, calls = 2, 200
	all := floodBegins(t, p.grpcAddr, msg, conns, calls, "authorization", "Bearer pay-secret")
	// Each body held would be 4 MiB (1.6 GB in all): bounded, the tenant
	// holds its share of the budget (2 calls of 8 MiB by default), and
	// the calls waiting for it at most their 64 KiB windows, plus
	// garbage the collector has not yet reclaimed.
	wantMemoryBounded(t, p, fmt.Sprintf("%d×%d authenticated 4 MiB Begins, all but their last byte", conns, calls), before, 256<<20)
	wantBeginAcquired(t, p.grpcAddr, "ship-secret", "another tenant's Begin during the flood")
	refused := 0
	for _, c := range all {
		if got := c.c.waitEnded(c.id, time.Now()); got == strconv.Itoa(int(codes.ResourceExhausted)) {
			refused++
		}
	}
	// The share takes 2 calls at once: every other call is refused (a few
	// more may be taken as the refused ones end).
	if refused < conns*calls*3/4 {
		t.Fatalf("%d of %d flooding calls refused RESOURCE_EXHAUSTED, want most of them", refused, conns*calls)
	}
	for _, c := range all {
		_ = c.c.conn.Close() // the calls still holding their share
	}
	p.stop()
}

// floodCall is one call of a flood on a raw connection.
type floodCall struct {
	c  *rawGRPCConn
	id uint32
}

// floodBegins opens calls Begin calls (with metadata md) on each of conns
// raw connections to addr, sends each all but the last byte of msg, and
// returns them once every send has ended (a second later, so the
// coordinator has taken what it will).
func floodBegins(t *testing.T, addr string, msg []byte, conns, calls int, md ...string) []floodCall {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var wg sync.WaitGroup
	var all []floodCall
	for range conns {
		c := dialRawGRPC(t, addr)
		for range calls {
			id, err := c.open(beginMethod, md...)
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, floodCall{c, id})
			wg.Go(func() { c.send(id, msg[:len(msg)-1], deadline) })
		}
	}
	wg.Wait()
	time.Sleep(time.Second)
	return all
}

// wantBeginAcquired fails t unless a Begin with token, through the real
// client, acquires a new key.
func wantBeginAcquired(t *testing.T, addr, token, what string) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx := metadata.AppendToOutgoingContext(callCtx(t), "authorization", "Bearer "+token)
	if r, err := idempotencyv1.NewCoordinatorClient(conn).Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "k"}); err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("%s: %v %v", what, r, err)
	}
}

// beginMethod is the full name of Coordinator.Begin.
const beginMethod = "/idempotency.v1.Coordinator/Begin"

// TestGRPCRefusesUnauthenticatedBeforeReading: while auth is on, a call
// without a token, or with a wrong one, is refused UNAUTHENTICATED from its
// headers, before it sends any of its request message (the coordinator
// does not wait for it), and counted as the chain counts its refusals; a
// call with a valid token is served by the real client, and one whose
// message is still coming is not refused.
func TestGRPCRefusesUnauthenticatedBeforeReading(t *testing.T) {
	p, httpAddr := startWithTenants(t)
	c := dialRawGRPC(t, p.grpcAddr)
	for _, md := range [][]string{nil, {"authorization", "Bearer wrong"}} {
		id, err := c.open(beginMethod, md...)
		if err != nil {
			t.Fatal(err)
		}
		if got := c.waitEnded(id, time.Now().Add(10*time.Second)); got != "16" {
			t.Fatalf("a Begin with metadata %q and no message yet ended %q, want grpc-status 16 (UNAUTHENTICATED)", md, got)
		}
	}
	id, err := c.open(beginMethod, "authorization", "Bearer pay-secret")
	if err != nil {
		t.Fatal(err)
	}
	if got := c.waitEnded(id, time.Now().Add(time.Second)); got != "" {
		t.Fatalf("a Begin with a valid token and no message yet ended %q, want it waiting for its message", got)
	}

	conn, err := grpc.NewClient(p.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := idempotencyv1.NewCoordinatorClient(conn)
	ctx := metadata.AppendToOutgoingContext(callCtx(t), "authorization", "Bearer pay-secret")
	if r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "k"}); err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("Begin with a valid token: %v %v", r, err)
	}
	if _, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("Begin without a token through the client: %v, want UNAUTHENTICATED", err)
	}
	// The refusals are counted as the chain counts them.
	const refused = `grpc_server_handled_total{grpc_code="Unauthenticated",grpc_method="Begin",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 3`
	if scrape := scrapeMetrics(t, httpAddr); !strings.Contains(scrape, refused) {
		t.Fatalf("no %s in /metrics", refused)
	}
	_ = c.conn.Close() // the call still waiting for its message
	p.stop()
}

// scrapeMetrics returns the text of httpAddr's /metrics.
func scrapeMetrics(t *testing.T, httpAddr string) string {
	t.Helper()
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestGRPCListenerFlags reads --grpc-max-connections and
// --grpc-read-timeout from the flags or the environment, with defaults,
// and refuses values that are not of their kind.
func TestGRPCListenerFlags(t *testing.T) {
	c, err := parseFlags([]string{"--database-url", "postgres://x"})
	if err != nil || c.grpcMaxConns != defaultGRPCMaxConns || c.grpcReadTimeout != server.DefaultGRPCReadTimeout {
		t.Fatalf("defaults: %+v %v", c, err)
	}
	if c, err = parseFlags([]string{"--database-url", "postgres://x", "--grpc-max-connections", "0", "--grpc-read-timeout", "2s"}); err != nil ||
		c.grpcMaxConns != 0 || c.grpcReadTimeout != 2*time.Second {
		t.Fatalf("flags: %+v %v", c, err)
	}
	t.Setenv("IDEMCOORD_GRPC_MAX_CONNECTIONS", "9")
	t.Setenv("IDEMCOORD_GRPC_READ_TIMEOUT", "5s")
	if c, err = parseFlags([]string{"--database-url", "postgres://x"}); err != nil || c.grpcMaxConns != 9 || c.grpcReadTimeout != 5*time.Second {
		t.Fatalf("environment: %+v %v", c, err)
	}
	for _, args := range [][]string{{"--grpc-read-timeout", "0s"}, {"--grpc-read-timeout", "soon"}, {"--grpc-max-connections", "-1"}} {
		if _, err := parseFlags(append([]string{"--database-url", "postgres://x"}, args...)); err == nil {
			t.Fatalf("%q accepted", args)
		}
	}
}

// TestGRPCBudgetFlags reads --grpc-max-buffered-bytes and its per-client
// share from the flags or the environment (0, the default, leaves the
// server's), and refuses values under one call's charge.
func TestGRPCBudgetFlags(t *testing.T) {
	c, err := parseFlags([]string{"--database-url", "postgres://x"})
	if err != nil || c.grpcMaxBuffered != 0 || c.grpcClientBuf != 0 {
		t.Fatalf("defaults: %+v %v", c, err)
	}
	call := strconv.Itoa(server.GRPCBufferedCallBytes)
	if c, err = parseFlags([]string{"--database-url", "postgres://x", "--grpc-max-buffered-bytes", "1073741824",
		"--grpc-max-buffered-bytes-per-client", call}); err != nil || c.grpcMaxBuffered != 1<<30 || c.grpcClientBuf != server.GRPCBufferedCallBytes {
		t.Fatalf("flags: %+v %v", c, err)
	}
	t.Setenv("IDEMCOORD_GRPC_MAX_BUFFERED_BYTES", "536870912")
	t.Setenv("IDEMCOORD_GRPC_MAX_BUFFERED_BYTES_PER_CLIENT", "67108864")
	if c, err = parseFlags([]string{"--database-url", "postgres://x"}); err != nil || c.grpcMaxBuffered != 512<<20 || c.grpcClientBuf != 64<<20 {
		t.Fatalf("environment: %+v %v", c, err)
	}
	for _, args := range [][]string{{"--grpc-max-buffered-bytes", "-1"}, {"--grpc-max-buffered-bytes", "1MiB"}, {"--grpc-max-buffered-bytes", "4194304"},
		{"--grpc-max-buffered-bytes-per-client", "1024"}} {
		if _, err := parseFlags(append([]string{"--database-url", "postgres://x"}, args...)); err == nil {
			t.Fatalf("%q accepted", args)
		}
	}
}

// TestGRPCHealthNotStarvedByWatchers: while one connection without a token
// holds 16 Health/Watch calls (they never end), a Health/Check, kubelet's
// gRPC probe (the Helm chart's readiness probe without TLS), is answered:
// a health call holds a slot only while its message is read, not while a
// Watch stays open (every Check was refused RESOURCE_EXHAUSTED). The
// coordinator still exits promptly on SIGTERM: Watch streams end at
// shutdown.
func TestGRPCHealthNotStarvedByWatchers(t *testing.T) {
	p, _ := startWithTenants(t)
	c := dialRawGRPC(t, p.grpcAddr)
	for range 16 {
		id, err := c.open("/grpc.health.v1.Health/Watch")
		if err != nil {
			t.Fatal(err)
		}
		c.mu.Lock()
		_ = c.fr.WriteData(id, true, []byte{0, 0, 0, 0, 0})
		c.mu.Unlock()
	}
	time.Sleep(time.Second)
	wantServing(t, p.grpcAddr, 1, "a health check while one unauthenticated connection holds 16 Watch calls")
	p.stop()
}

// silentCheck is a Health/Check call that sent its headers and never its
// message.
type silentCheck struct {
	c  *rawGRPCConn
	id uint32
}

// openSilentChecks opens n silent Health/Check calls on c.
func openSilentChecks(t *testing.T, c *rawGRPCConn, n int) []silentCheck {
	t.Helper()
	var calls []silentCheck
	for range n {
		id, err := c.open("/grpc.health.v1.Health/Check")
		if err != nil {
			t.Fatal(err)
		}
		calls = append(calls, silentCheck{c, id})
	}
	return calls
}

// endedCalls returns the indexes of the calls of calls that have ended
// (within a moment: they were cancelled already).
func endedCalls(calls []silentCheck) []int {
	var ended []int
	for i, s := range calls {
		if s.c.waitEnded(s.id, time.Now().Add(100*time.Millisecond)) != "" {
			ended = append(ended, i)
		}
	}
	return ended
}

// wantEnded fails t unless exactly the calls of calls at the indexes want
// have ended.
func wantEnded(t *testing.T, what string, calls []silentCheck, want ...int) {
	t.Helper()
	if ended := endedCalls(calls); !slices.Equal(ended, want) {
		t.Errorf("%s: the silent calls %v have ended, want %v", what, ended, want)
	}
}

// TestGRPCHealthNotStarvedBySilentCallers: three clients without a token
// (three addresses, each at its share of four) open twelve Health/Check
// calls that send headers and never their message, holding every slot of
// the health calls being read; a fifth from one of them takes the slot
// of that address's oldest. A Health/Check from a fourth address, as
// kubelet's gRPC probe sends it (message with the headers), is answered
// SERVING: it takes the slot of the oldest silent call, which is ended,
// and gives it back once its message is read, so the next check finds it
// free. Before, the probe was refused RESOURCE_EXHAUSTED until the silent
// calls' read timeout (30 s), and they could open new ones.
func TestGRPCHealthNotStarvedBySilentCallers(t *testing.T) {
	p, _ := startWithTenants(t)
	var calls []silentCheck
	for _, from := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"} {
		calls = append(calls, openSilentChecks(t, dialRawGRPCFrom(t, p.grpcAddr, from), 4)...)
	}
	calls = append(calls, openSilentChecks(t, calls[11].c, 1)...) // a fifth from 127.0.0.4
	wantEnded(t, "a fifth silent call from one address", calls, 8)
	wantServing(t, p.grpcAddr, 2, "health checks while 12 silent calls from 3 addresses hold the read slots")
	// The first check took the slot of the silent call the listener
	// admitted first (which of the three connections' calls that is
	// depends on how their headers were scheduled) and gave it back once
	// its message was read: the second found that slot free.
	if ended := endedCalls(calls); len(ended) != 2 || !slices.Contains(ended, 8) {
		t.Errorf("two checks: the silent calls %v have ended, want 8 and one other", ended)
	}
}

// TestGRPCHealthNotStarvedFromItsOwnAddress: four silent Health/Check
// calls from the probe's own address (another process on kubelet's node,
// or behind the same NAT) hold that address's whole share of the read
// slots. The probe is answered SERVING all the same: it takes the slot
// of its address's oldest silent call. Before, every probe was refused
// RESOURCE_EXHAUSTED (an outside attack met it: 689 of 689 probes).
func TestGRPCHealthNotStarvedFromItsOwnAddress(t *testing.T) {
	p, _ := startWithTenants(t)
	calls := openSilentChecks(t, dialRawGRPC(t, p.grpcAddr), 4)
	wantServing(t, p.grpcAddr, 2, "health checks while 4 silent calls from their own address hold its share")
	wantEnded(t, "two checks", calls, 0)
}

// TestGRPCHealthFloodBoundsMemory: rounds of twelve Health/Check calls
// without a token, from three new addresses each round, that each send all
// but the last byte of a 4 MiB request: each round's calls take the slots
// of the round before, whose calls are cancelled. The coordinator reads at
// most twelve such messages at once, so its memory stays bounded (the 96
// held would be 384 MiB), and a probe is answered afterwards.
func TestGRPCHealthFloodBoundsMemory(t *testing.T) {
	p, _ := startWithTenants(t)
	msg := grpcMessage(t, &healthpb.HealthCheckRequest{Service: strings.Repeat("s", 4<<20-1024)})
	before := processMemory(t, p.cmd.Process.Pid)
	const rounds = 8
	var all []floodCall
	for r := range rounds {
		var wg sync.WaitGroup
		for a := range 3 {
			c := dialRawGRPCFrom(t, p.grpcAddr, fmt.Sprintf("127.0.1.%d", 3*r+a+1))
			for range 4 {
				id, err := c.open("/grpc.health.v1.Health/Check")
				if err != nil {
					t.Fatal(err)
				}
				all = append(all, floodCall{c, id})
				wg.Go(func() { c.send(id, msg[:len(msg)-1], time.Now().Add(30*time.Second)) })
			}
		}
		wg.Wait()
	}
	// At most 12 messages of up to 4 MiB being read (each charged twice
	// that), plus garbage the collector has not yet reclaimed.
	wantMemoryBounded(t, p, fmt.Sprintf("%d rounds of 12 unauthenticated 4 MiB health calls, all but their last byte", rounds), before, 12*8<<20+rssBoundBytes)
	ended := 0
	for _, c := range all[:len(all)-12] {
		if c.c.waitEnded(c.id, time.Now().Add(5*time.Second)) != "" {
			ended++
		}
	}
	if ended != len(all)-12 {
		t.Errorf("%d of the %d calls whose slots later rounds took have ended, want all", ended, len(all)-12)
	}
	wantServing(t, p.grpcAddr, 1, "a health check after the flood")
	for _, c := range all[len(all)-12:] {
		_ = c.c.conn.Close() // the calls still reading (a graceful stop waits for them)
	}
	p.stop()
}

// wantServing fails t unless n Health/Check calls without a token, one
// after another on one connection to the gRPC listener at addr (as
// kubelet's probe sends them), are answered SERVING.
func wantServing(t *testing.T, addr string, n int, what string) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for i := range n {
		if r, err := healthpb.NewHealthClient(conn).Check(callCtx(t), &healthpb.HealthCheckRequest{}); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("%s (check %d of %d): %v %v", what, i+1, n, r, err)
		}
	}
}

// TestGRPCReadTimeoutEndsAStalledCall: a call that sends its headers and
// part of its request message, then stalls, is ended after
// --grpc-read-timeout, CANCELLED (what gRPC answers for a call whose
// context ended before its message was read), and writes nothing.
func TestGRPCReadTimeoutEndsAStalledCall(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDatabase(t)
	grpcAddr := coordtest.FreeAddr(t)
	startBinary(t, coordtest.BuildBinary(t), db, grpcAddr, coordtest.FreeAddr(t), "--grpc-read-timeout", "1s")
	c := dialRawGRPC(t, grpcAddr)
	id, err := c.open("/idempotency.v1.Coordinator/Begin")
	if err != nil {
		t.Fatal(err)
	}
	msg := grpcMessage(t, &idempotencyv1.BeginRequest{Scope: "build", Key: "stalled"})
	if n := c.send(id, msg[:len(msg)-1], time.Now().Add(10*time.Second)); n != len(msg)-1 {
		t.Fatalf("sent %d of %d bytes", n, len(msg)-1)
	}
	ended := c.waitEnded(id, time.Now().Add(30*time.Second))
	if want := strconv.Itoa(int(codes.Canceled)); ended != want {
		t.Fatalf("the stalled call ended %q, want grpc-status %s (CANCELLED)", ended, want)
	}
	wantNoRecord(t, db, "stalled")
}

// wantNoRecord fails t when the database at dbURL holds a record of key.
func wantNoRecord(t *testing.T, dbURL, key string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM idempotency_records WHERE key = $1", key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d records of key %q, want none", n, key)
	}
}
