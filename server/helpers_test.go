package server_test

import (
	"context"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

func TestMain(m *testing.M) {
	os.Exit(pgtest.Main(m, ledger.Migrate))
}

// fakeClock is a clock the test moves by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// testEnv is a coordinator on a loopback port over its own database.
type testEnv struct {
	t      *testing.T
	dbURL  string
	clock  *fakeClock
	store  *ledger.Store
	srv    *server.Server
	addr   string
	conn   *grpc.ClientConn
	client idempotencyv1.CoordinatorClient
}

type envOptions struct {
	realClock bool
	config    string
	dbURL     string
}

func newEnv(t *testing.T, opts envOptions) *testEnv {
	t.Helper()
	e := &testEnv{t: t, dbURL: opts.dbURL, clock: newFakeClock()}
	if e.dbURL == "" {
		e.dbURL = pgtest.NewDatabase(t)
	}
	e.start(opts)
	return e
}

func (e *testEnv) start(opts envOptions) {
	t := e.t
	t.Helper()
	var sopts []ledger.Option
	if !opts.realClock {
		sopts = append(sopts, ledger.WithClock(e.clock.Now))
	}
	store, err := ledger.Open(context.Background(), e.dbURL, sopts...)
	if err != nil {
		t.Fatal(err)
	}
	policies := server.DefaultPolicies()
	if opts.config != "" {
		if policies, err = server.ParsePolicies([]byte(opts.config)); err != nil {
			t.Fatal(err)
		}
	}
	logger := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	srv, err := server.New(store, server.WithPolicies(policies), server.WithLogger(logger),
		server.WithHealthInterval(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	e.store, e.srv, e.addr, e.conn = store, srv, lis.Addr().String(), conn
	e.client = idempotencyv1.NewCoordinatorClient(conn)
	t.Cleanup(e.stop)
}

// stop shuts the coordinator down (idempotent).
func (e *testEnv) stop() {
	if e.srv == nil {
		return
	}
	_ = e.conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	e.srv.Shutdown(ctx)
	e.store.Close()
	e.srv = nil
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

func (e *testEnv) begin(scope, key string, mods ...func(*idempotencyv1.BeginRequest)) (*idempotencyv1.BeginResponse, error) {
	req := &idempotencyv1.BeginRequest{Scope: scope, Key: key}
	for _, m := range mods {
		m(req)
	}
	return e.client.Begin(ctx(e.t), req)
}

func (e *testEnv) mustBegin(scope, key string, want idempotencyv1.Outcome, mods ...func(*idempotencyv1.BeginRequest)) *idempotencyv1.BeginResponse {
	e.t.Helper()
	resp, err := e.begin(scope, key, mods...)
	if err != nil {
		e.t.Fatalf("Begin(%s, %s): %v", scope, key, err)
	}
	if resp.GetOutcome() != want {
		e.t.Fatalf("Begin(%s, %s) outcome = %v, want %v (record %v)", scope, key, resp.GetOutcome(), want, resp.GetRecord())
	}
	return resp
}

func withFingerprint(fp string) func(*idempotencyv1.BeginRequest) {
	return func(r *idempotencyv1.BeginRequest) { r.Fingerprint = []byte(fp) }
}

func withAttemptID(id string) func(*idempotencyv1.BeginRequest) {
	return func(r *idempotencyv1.BeginRequest) { r.AttemptId = id }
}

func withTTL(d time.Duration) func(*idempotencyv1.BeginRequest) {
	return func(r *idempotencyv1.BeginRequest) { r.Ttl = durationpb.New(d) }
}

func withLease(d time.Duration) func(*idempotencyv1.BeginRequest) {
	return func(r *idempotencyv1.BeginRequest) { r.Lease = durationpb.New(d) }
}

func withWait(d time.Duration) func(*idempotencyv1.BeginRequest) {
	return func(r *idempotencyv1.BeginRequest) { r.Wait = durationpb.New(d) }
}

// wantCode fails unless err is a status with code c and, if reason is not
// empty, an ErrorInfo with that reason in domain idempotency.v1.
func wantCode(t *testing.T, err error, c codes.Code, reason string) *status.Status {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok || st.Code() != c {
		t.Fatalf("error = %v, want code %v", err, c)
	}
	if reason != "" {
		got := ""
		for _, d := range st.Details() {
			if info, ok := d.(*errdetails.ErrorInfo); ok {
				if info.GetDomain() != "idempotency.v1" {
					t.Fatalf("ErrorInfo domain = %q", info.GetDomain())
				}
				got = info.GetReason()
			}
		}
		if got != reason {
			t.Fatalf("error %v: ErrorInfo reason = %q, want %q", err, got, reason)
		}
	}
	return st
}

// rowCount counts the records in the database.
func (e *testEnv) rowCount() int {
	e.t.Helper()
	conn, err := pgxConnect(e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_records`).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func pgxConnect(url string) (*pgx.Conn, error) {
	return pgx.Connect(context.Background(), url)
}
