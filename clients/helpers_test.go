package clients_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

func TestMain(m *testing.M) {
	if os.Getenv(httpChildEnv) != "" {
		os.Exit(runHTTPChild()) // this binary, re-executed as a service to kill (see http_crash_test.go)
	}
	os.Exit(coordtest.Main(m))
}

// callBatchingEnv, set to a number, makes the fixtures' Clients share RPCs
// (clients.WithCallBatching with that many RPCs in flight): `make test`
// runs this package a second time with it, so that every promise tested
// through a fixture is tested through Batch RPCs too.
const callBatchingEnv = "IDEMCOORD_TEST_CALL_BATCHING"

// fixtureOptions returns opts, with clients.WithCallBatching appended when
// callBatchingEnv asks for it.
func fixtureOptions(opts ...clients.Option) []clients.Option {
	if n, err := strconv.Atoi(os.Getenv(callBatchingEnv)); err == nil && n > 0 {
		opts = append(opts, clients.WithCallBatching(n))
	}
	return opts
}

// Full method names of the demo proto that these tests serve.
const (
	chargeMethod     = "/projects.v1.ProjectsService/Charge"
	createMethod     = "/projects.v1.ProjectsService/CreateProject"
	getProjectMethod = "/projects.v1.ProjectsService/GetProject"
)

// testService is a ProjectsService whose handlers the test chooses; it
// counts the calls that reach them.
type testService struct {
	projectsv1.UnimplementedProjectsServiceServer
	chargeCalls atomic.Int32
	otherCalls  atomic.Int32
	charge      func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error)
}

// bookCharge is the default Charge handler: a new charge id per run.
func bookCharge(_ context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
	return &projectsv1.ChargeResponse{ChargeId: fmt.Sprintf("ch_%d", n), AmountCents: req.GetAmountCents(),
		Currency: req.GetCurrency(), TotalCents: int64(n) * req.GetAmountCents()}, nil
}

func (s *testService) Charge(ctx context.Context, req *projectsv1.ChargeRequest) (*projectsv1.ChargeResponse, error) {
	n := s.chargeCalls.Add(1)
	if s.charge == nil {
		return bookCharge(ctx, req, n)
	}
	return s.charge(ctx, req, n)
}

func (s *testService) CreateProject(_ context.Context, req *projectsv1.CreateProjectRequest) (*projectsv1.CreateProjectResponse, error) {
	n := s.otherCalls.Add(1)
	return &projectsv1.CreateProjectResponse{Project: &projectsv1.Project{Id: fmt.Sprintf("prj_%d", n), Name: req.GetName()}}, nil
}

func (s *testService) GetProject(_ context.Context, req *projectsv1.GetProjectRequest) (*projectsv1.GetProjectResponse, error) {
	s.otherCalls.Add(1)
	return &projectsv1.GetProjectResponse{Project: &projectsv1.Project{Id: req.GetId()}}, nil
}

// setup configures a fixture.
type setup struct {
	config      string // coordinator policy YAML
	fakeClock   bool
	serverOpts  []server.Option // for the coordinator
	clientOpts  []clients.Option
	interceptor []clients.InterceptorOption
	dialOpts    []grpc.DialOption // for the connection to the demo server
	charge      func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error)
}

// fixture is a real coordinator, a Client of it, and a demo server on
// 127.0.0.1:0 with recovery and the interceptor.
type fixture struct {
	coord *coordtest.Coordinator
	idem  *clients.Client
	svc   *testService
	api   projectsv1.ProjectsServiceClient
}

func start(t *testing.T, s setup) *fixture {
	t.Helper()
	coord := coordtest.Start(t, coordtest.Options{Config: s.config, FakeClock: s.fakeClock, ServerOptions: s.serverOpts})
	logger := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	idem := clients.New(coord.Dial(t), fixtureOptions(append([]clients.Option{clients.WithLogger(logger)}, s.clientOpts...)...)...)
	svc := &testService{charge: s.charge}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		recovery.UnaryServerInterceptor(recovery.WithRecoveryHandler(func(any) error {
			return status.Error(codes.Internal, "internal error")
		})),
		clients.UnaryServerInterceptor(idem, s.interceptor...),
	))
	projectsv1.RegisterProjectsServiceServer(srv, svc)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(),
		append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, s.dialOpts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		srv.Stop()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := idem.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: background work did not finish: %v", err)
		}
	})
	return &fixture{coord: coord, idem: idem, svc: svc, api: projectsv1.NewProjectsServiceClient(conn)}
}

// testLog sends log lines to t.Log.
type testLog struct{ t testing.TB }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}

// reply is what a call answered.
type reply struct {
	resp    *projectsv1.ChargeResponse
	err     error
	header  metadata.MD
	trailer metadata.MD
}

// result is the idempotency-result header of the reply ("" when absent).
func (r reply) result() string {
	if v := r.header.Get(clients.ResultHeader); len(v) > 0 {
		return v[0]
	}
	return ""
}

func withKey(ctx context.Context, key string) context.Context {
	if key == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, clients.MetadataKey, key)
}

// charge calls Charge with key.
func (f *fixture) charge(t *testing.T, key string, req *projectsv1.ChargeRequest) reply {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var r reply
	r.resp, r.err = f.api.Charge(withKey(ctx, key), req, grpc.Header(&r.header), grpc.Trailer(&r.trailer))
	return r
}

// lookup reads the record of the Charge method's key.
func (f *fixture) lookup(t *testing.T, key string) (*idempotencyv1.Record, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := f.idem.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: chargeMethod, Key: key})
	return res.GetRecord(), err
}

// mustState fails t unless the Charge record of key is in state want.
func (f *fixture) mustState(t *testing.T, key string, want idempotencyv1.State) *idempotencyv1.Record {
	t.Helper()
	rec, err := f.lookup(t, key)
	if err != nil {
		t.Fatalf("Lookup %q: %v", key, err)
	}
	if rec.GetState() != want {
		t.Fatalf("record %q is %v, want %v (%v)", key, rec.GetState(), want, rec)
	}
	return rec
}

// eventually polls cond every 50 ms until it holds or the generous
// deadline passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(45 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// wantCode fails t unless err has code want.
func wantCode(t *testing.T, err error, want codes.Code) *status.Status {
	t.Helper()
	st := status.Convert(err)
	if st.Code() != want {
		t.Fatalf("got %v (%v), want code %v", st.Code(), err, want)
	}
	return st
}

// errorReason returns the ErrorInfo reason in st's details.
func errorReason(st *status.Status) string {
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.GetReason()
		}
	}
	return ""
}

func chargeReq(amount int64) *projectsv1.ChargeRequest {
	return &projectsv1.ChargeRequest{AccountId: "acct_1", AmountCents: amount, Currency: "EUR"}
}

func withUser(ctx context.Context, user string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "x-user-id", user)
}

func metadataUser(ctx context.Context) string {
	if v := metadata.ValueFromIncomingContext(ctx, "x-user-id"); len(v) > 0 {
		return v[0]
	}
	return ""
}

// withIncomingKey is the context of an incoming call with key, for calling
// the interceptor directly.
func withIncomingKey(ctx context.Context, key string) context.Context {
	return metadata.NewIncomingContext(ctx, metadata.Pairs(clients.MetadataKey, key))
}

// lostAcquisitions is a coordinator interceptor (install it with option)
// that, while armed, lets a Begin that acquires the key commit and then
// keeps its answer until the caller gives up: the caller's deadline ends,
// or its client disconnects, while its Begin is in flight. Only the first
// acquiring answer for each attempt_id is kept back, so a library that
// sends Begin again with that attempt_id (to release the acquisition) gets
// its answer.
type lostAcquisitions struct {
	armed atomic.Bool
	held  atomic.Int32 // answers kept back
	mu    sync.Mutex
	seen  map[string]bool
}

func (l *lostAcquisitions) option() server.Option { return server.WithUnaryInterceptors(l.intercept) }

func (l *lostAcquisitions) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if !l.armed.Load() {
		return handler(ctx, req)
	}
	switch r := req.(type) {
	case *idempotencyv1.BeginRequest:
		resp, err := handler(context.WithoutCancel(ctx), req) // commits even if the caller gives up meanwhile
		if res, _ := resp.(*idempotencyv1.BeginResponse); err != nil || !l.firstAcquired(r, res) {
			return resp, err
		}
		<-ctx.Done()
		return nil, status.FromContextError(ctx.Err()).Err()
	case *idempotencyv1.BatchRequest:
		// A Batch (clients.WithCallBatching): its RPC ends only at the
		// latest of its calls' deadlines, so its answer is kept back until
		// then or for 2 s, whichever comes first, and then sent: the
		// acquisition reaches a client whose caller has left.
		resp, err := handler(context.WithoutCancel(ctx), req)
		res, _ := resp.(*idempotencyv1.BatchResponse)
		held := false
		for i, c := range r.GetCalls() {
			if c.GetBegin() != nil && i < len(res.GetResults()) && l.firstAcquired(c.GetBegin(), res.GetResults()[i].GetBegin()) {
				held = true
			}
		}
		if held {
			select {
			case <-ctx.Done():
				return nil, status.FromContextError(ctx.Err()).Err()
			case <-time.After(2 * time.Second):
			}
		}
		return resp, err
	}
	return handler(ctx, req)
}

// firstAcquired reports whether res acquired the key for req's attempt_id
// for the first time, and counts it as held.
func (l *lostAcquisitions) firstAcquired(req *idempotencyv1.BeginRequest, res *idempotencyv1.BeginResponse) bool {
	if res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen == nil {
		l.seen = map[string]bool{}
	}
	if l.seen[req.GetAttemptId()] {
		return false
	}
	l.seen[req.GetAttemptId()] = true
	l.held.Add(1)
	return true
}

// within polls cond every 20 ms until it holds, failing t after d.
func within(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
