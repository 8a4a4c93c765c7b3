package server_test

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
	"github.com/idemcoord/idemcoord/statemachine"
)

func TestMain(m *testing.M) {
	os.Exit(coordtest.Main(m))
}

// testEnv is a coordinator on a loopback port over its own database, and a
// client of it.
type testEnv struct {
	t      *testing.T
	coord  *coordtest.Coordinator
	clock  *coordtest.Clock
	dbURL  string
	client idempotencyv1.CoordinatorClient
}

type envOptions struct {
	realClock bool
	config    string
	// serverOptions are passed to server.New after the defaults.
	serverOptions []server.Option
}

func newEnv(t *testing.T, opts envOptions) *testEnv {
	t.Helper()
	c := coordtest.Start(t, coordtest.Options{Config: opts.config, FakeClock: !opts.realClock,
		ServerOptions: opts.serverOptions})
	return &testEnv{t: t, coord: c, clock: c.Clock, dbURL: c.DatabaseURL,
		client: idempotencyv1.NewCoordinatorClient(c.Dial(t))}
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

// errHeldRolledBack is what holdNewKey's RunTx function fails with.
var errHeldRolledBack = errors.New("the business write failed")

// holdNewKey has a service's own store on the database at dbURL run a
// RunTx of id, a new key, that holds the key's row until rollBack, which
// makes the function fail (the transaction rolls back) and checks that it
// did. rollBack also runs when the test ends. It returns the service's
// store.
func holdNewKey(t *testing.T, dbURL string, id ledger.Identity) (svc *ledger.Store, rollBack func()) {
	t.Helper()
	svc, err := ledger.Open(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Close)
	running, fail, rolledBack := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		_, _, err := svc.RunTx(context.Background(), id, ledger.TxOptions{}, func(context.Context, pgx.Tx) (*statemachine.Response, error) {
			close(running)
			<-fail
			return nil, errHeldRolledBack
		})
		rolledBack <- err
	}()
	<-running
	var once sync.Once
	rollBack = func() {
		once.Do(func() {
			close(fail)
			if err := <-rolledBack; !errors.Is(err, errHeldRolledBack) {
				t.Errorf("RunTx: %v; want fn's error (rolled back)", err)
			}
		})
	}
	t.Cleanup(rollBack) // before svc.Close, should the test fail with the row held
	return svc, rollBack
}

// skipOnCitus skips a test that does not hold on Citus (the tests run there
// with pgtest.CitusEnv set), saying why.
func skipOnCitus(t *testing.T, why string) {
	t.Helper()
	if os.Getenv(pgtest.CitusEnv) == "1" {
		t.Skip("on Citus " + why)
	}
}
