package clients_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemcoord/idemcoord/clients"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// leaseSeen records what handlers saw through LeaseFrom.
type leaseSeen struct {
	mu   sync.Mutex
	seen []clients.Lease
}

func (l *leaseSeen) record(ctx context.Context) {
	lease, ok := clients.LeaseFrom(ctx)
	if !ok {
		lease = clients.Lease{Scope: "(none)"}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seen = append(l.seen, lease)
}

func (l *leaseSeen) get() []clients.Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]clients.Lease(nil), l.seen...)
}

// The double-charge story (docs/go.md, "Worked example") through the interceptor. Run 1 books
// the charge and times out (UNKNOWN). Run 2 is told UNKNOWN, cannot reach
// the bank to check and answers UNAVAILABLE (RETRYABLE). Run 3 must still
// be told UNKNOWN (it was told FAILED_RETRYABLE: "nothing happened", and
// charged again); it rejects the request (INVALID_ARGUMENT, ABANDONED),
// which must not free the key for another request.
func TestUncertaintySurvivesLaterFailures(t *testing.T) {
	t.Parallel()
	var seen leaseSeen
	f := start(t, setup{
		interceptor: []clients.InterceptorOption{clients.WithoutPrincipal()},
		charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			seen.record(ctx)
			switch n {
			case 1:
				clients.MarkSideEffect(ctx)
				return nil, status.Error(codes.DeadlineExceeded, "bank timed out")
			case 2:
				return nil, status.Error(codes.Unavailable, "bank unreachable; cannot check")
			case 3:
				return nil, status.Error(codes.InvalidArgument, "card expired meanwhile")
			}
			return bookCharge(ctx, req, n)
		},
	})
	wantCode(t, f.charge(t, "order-7", chargeReq(100)).err, codes.DeadlineExceeded)
	wantCode(t, f.charge(t, "order-7", chargeReq(100)).err, codes.Unavailable)
	if rec := f.mustState(t, "order-7", idempotencyv1.State_STATE_FAILED_RETRYABLE); !rec.GetUncertain() {
		t.Fatalf("FAILED_RETRYABLE after an UNKNOWN attempt is not uncertain: %v", rec)
	}
	wantCode(t, f.charge(t, "order-7", chargeReq(100)).err, codes.InvalidArgument)
	rec := f.mustState(t, "order-7", idempotencyv1.State_STATE_UNKNOWN)
	if len(rec.GetFingerprint()) == 0 {
		t.Fatalf("ABANDONED after an uncertain takeover cleared the fingerprint: %v", rec)
	}
	// Another request cannot take the key an earlier attempt may have acted on.
	st := wantCode(t, f.charge(t, "order-7", chargeReq(999)).err, codes.FailedPrecondition)
	if errorReason(st) != "FINGERPRINT_MISMATCH" {
		t.Fatalf("another request: %v, want FINGERPRINT_MISMATCH", st)
	}
	if r := f.charge(t, "order-7", chargeReq(100)); r.err != nil || r.result() != "created" {
		t.Fatalf("run 4: %v %q", r.err, r.result())
	}
	var prev []string
	for _, l := range seen.get() {
		prev = append(prev, l.Previous.String())
		if l.Attempt > 1 && !l.Uncertain {
			t.Errorf("attempt %d: Lease.Uncertain false", l.Attempt)
		}
	}
	want := []string{"STATE_UNSPECIFIED", "STATE_UNKNOWN", "STATE_UNKNOWN", "STATE_UNKNOWN"}
	if !equalStrings(prev, want) {
		t.Fatalf("handlers saw previous states %v, want %v", prev, want)
	}
	if rec := f.mustState(t, "order-7", idempotencyv1.State_STATE_COMPLETED); rec.GetUncertain() {
		t.Fatalf("COMPLETED still uncertain: %v", rec)
	}
}

// After MarkSideEffect, an error of any code ends the attempt UNKNOWN
// (whatever WithFailureKinds says), except a FailureError naming
// REPLAYABLE; before it, the code decides as before.
func TestMarkSideEffect(t *testing.T) {
	t.Parallel()
	markThen := func(err error, seen *attemptSeen) func(context.Context, *projectsv1.ChargeRequest, int32) (*projectsv1.ChargeResponse, error) {
		return func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			if n == 1 {
				clients.MarkSideEffect(ctx) // the charge is booked here...
				return nil, err             // ...and then something else fails
			}
			seen.record(ctx)
			return bookCharge(ctx, req, n)
		}
	}
	for _, tc := range []struct {
		name string
		err  error
		opts []clients.InterceptorOption
		want idempotencyv1.State
	}{
		{"UNAVAILABLE", status.Error(codes.Unavailable, "fraud service down"), nil, idempotencyv1.State_STATE_UNKNOWN},
		{"INVALID_ARGUMENT", status.Error(codes.InvalidArgument, "receipt address invalid"), nil, idempotencyv1.State_STATE_UNKNOWN},
		{"ABORTED overridden as ABANDONED", status.Error(codes.Aborted, "conflict"),
			[]clients.InterceptorOption{clients.WithFailureKinds(map[codes.Code]idempotencyv1.FailureKind{
				codes.Aborted: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED})}, idempotencyv1.State_STATE_UNKNOWN},
		{"a FailureError naming RETRYABLE", &clients.FailureError{Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE,
			Err: status.Error(codes.Unavailable, "x")}, nil, idempotencyv1.State_STATE_UNKNOWN},
		{"a FailureError naming REPLAYABLE", &clients.FailureError{Kind: idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE,
			Err: status.Error(codes.FailedPrecondition, "card declined")}, nil, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var seen attemptSeen
			f := start(t, setup{charge: markThen(tc.err, &seen), interceptor: tc.opts})
			if r := f.charge(t, "k", chargeReq(100)); r.err == nil {
				t.Fatal("the failing call succeeded")
			}
			f.mustState(t, "k", tc.want)
			if tc.want != idempotencyv1.State_STATE_UNKNOWN {
				return
			}
			if r := f.charge(t, "k", chargeReq(100)); r.err != nil {
				t.Fatal(r.err)
			}
			if got, want := seen.get(), []string{"2 STATE_UNKNOWN true"}; !equalStrings(got, want) {
				t.Fatalf("the retry saw %v, want %v", got, want)
			}
		})
	}

	t.Run("Once", func(t *testing.T) {
		t.Parallel()
		_, c := newClient(t, coordtest.Options{})
		ctx := testCtx(t)
		_, err := c.Once(ctx, "mail", "welcome-7", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
			clients.MarkSideEffect(ctx)
			return nil, status.Error(codes.Unavailable, "mail sent, then the audit log was down")
		})
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("Once: %v", err)
		}
		res, err := c.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: "mail", Key: "welcome-7"})
		if err != nil || res.GetRecord().GetState() != idempotencyv1.State_STATE_UNKNOWN {
			t.Fatalf("after a marked failure: %v %v, want UNKNOWN", res.GetRecord(), err)
		}
	})

	t.Run("outside an attempt it does nothing", func(t *testing.T) {
		clients.MarkSideEffect(context.Background())
		if _, ok := clients.LeaseFrom(context.Background()); ok {
			t.Fatal("LeaseFrom outside an attempt reports one")
		}
	})
}

// A handler and a Once function get the lease they run under, with the key
// as stored (after principal folding), to fence their own writes.
func TestLeaseFrom(t *testing.T) {
	t.Parallel()
	var seen leaseSeen
	f := start(t, setup{
		interceptor: []clients.InterceptorOption{clients.WithPrincipal(func(ctx context.Context) (string, error) {
			return metadataUser(ctx), nil
		})},
		charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			seen.record(ctx)
			return bookCharge(ctx, req, n)
		},
	})
	ctx := withKey(withUser(context.Background(), "alice"), "k")
	if _, err := f.api.Charge(ctx, chargeReq(100)); err != nil {
		t.Fatal(err)
	}
	got := seen.get()
	if len(got) != 1 {
		t.Fatalf("handler saw %v", got)
	}
	l := got[0]
	if l.Scope != chargeMethod || l.Key != clients.FoldPrincipal("alice", "k") || l.Token == "" ||
		l.Generation != 1 || l.Attempt != 1 || l.Previous != idempotencyv1.State_STATE_UNSPECIFIED || l.Uncertain {
		t.Fatalf("LeaseFrom: %+v", l)
	}
	f.mustState(t, clients.FoldPrincipal("alice", "k"), idempotencyv1.State_STATE_COMPLETED)

	_, c := newClient(t, coordtest.Options{})
	var inOnce clients.Lease
	if _, err := c.Once(testCtx(t), "deploy", "r1", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		inOnce, _ = clients.LeaseFrom(ctx)
		return nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	if inOnce.Scope != "deploy" || inOnce.Key != "r1" || inOnce.Token == "" || inOnce.Attempt != 1 {
		t.Fatalf("LeaseFrom in Once: %+v", inOnce)
	}
}

// A holder cut off from the coordinator is stopped before its lease would
// run out by the local clock, so it never runs alongside a successor that
// takes the key over (the coordinator used to cancel it only when a
// heartbeat was refused, which never happens when none gets through).
func TestCutOffHolderIsCancelled(t *testing.T) {
	t.Parallel()
	waitCancelled := func(ctx context.Context, started chan<- struct{}, cause *error) {
		close(started)
		<-ctx.Done()
		*cause = context.Cause(ctx)
	}

	t.Run("interceptor", func(t *testing.T) {
		t.Parallel()
		started := make(chan struct{})
		var cause error
		f := start(t, setup{
			clientOpts: []clients.Option{clients.WithLease(time.Second)},
			charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
				clients.MarkSideEffect(ctx)
				waitCancelled(ctx, started, &cause)
				return nil, status.FromContextError(ctx.Err()).Err()
			},
		})
		done := make(chan reply, 1)
		go func() { done <- f.charge(t, "cut", chargeReq(100)) }()
		<-started
		f.coord.Stop() // no heartbeat gets through from now on
		r := <-done
		if !errors.Is(cause, clients.ErrLeaseUnconfirmed) {
			t.Fatalf("handler's context cause %v, want ErrLeaseUnconfirmed (call: %v)", cause, r.err)
		}
		wantCode(t, r.err, codes.Canceled)
		// The marked attempt is recorded UNKNOWN once the coordinator is back
		// (Fail is retried in the background within a lease), or reads
		// UNKNOWN by its lapsed lease: either way, never untouched.
		f.coord.Restart()
		eventually(t, "the record to read UNKNOWN, uncertain", func() bool {
			rec, err := f.lookup(t, "cut")
			return err == nil && rec.GetState() == idempotencyv1.State_STATE_UNKNOWN && rec.GetUncertain()
		})
	})

	t.Run("Once", func(t *testing.T) {
		t.Parallel()
		coord, c := newClient(t, coordtest.Options{}, clients.WithLease(time.Second))
		started := make(chan struct{})
		var cause error
		done := make(chan error, 1)
		go func() {
			_, err := c.Once(testCtx(t), "deploy", "cut", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
				waitCancelled(ctx, started, &cause)
				return nil, ctx.Err()
			})
			done <- err
		}()
		<-started
		coord.Stop()
		err := <-done
		if !errors.Is(cause, clients.ErrLeaseUnconfirmed) {
			t.Fatalf("fn's context cause %v, want ErrLeaseUnconfirmed (Once: %v)", cause, err)
		}
	})
}

// Headers and trailers a handler sets are stored with its result and
// replayed; only idempotency-result differs. Transport and auth metadata
// are left out by default; WithReplayMetadata narrows the set.
func TestHeadersAndTrailersReplayed(t *testing.T) {
	t.Parallel()
	handler := func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch_1", "x-charge-id", "ch_1b", "set-cookie", "session=secret",
			"x-receipt-bin", "\x00\xffraw"))
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-ledger-seq", "42"))
		if req.GetAmountCents() < 0 {
			return nil, status.Error(codes.FailedPrecondition, "negative amount")
		}
		return bookCharge(ctx, req, n)
	}
	strip := func(md metadata.MD, keys ...string) metadata.MD {
		md = md.Copy()
		for _, k := range append(keys, clients.ResultHeader, clients.ExpiresHeader, "content-type", "date") {
			delete(md, k)
		}
		return md
	}

	t.Run("default", func(t *testing.T) {
		t.Parallel()
		f := start(t, setup{charge: handler})
		for _, amount := range []int64{100, -1} { // a result and a replayable failure
			key := fmt.Sprint("h", amount)
			first := f.charge(t, key, chargeReq(amount))
			second := f.charge(t, key, chargeReq(amount))
			if first.result() != "created" || second.result() != "replayed" {
				t.Fatalf("amount %d: results %q, %q", amount, first.result(), second.result())
			}
			if status.Code(first.err) != status.Code(second.err) {
				t.Fatalf("amount %d: errors %v, %v", amount, first.err, second.err)
			}
			if got, want := strip(second.header), strip(first.header, "set-cookie"); !mdEqual(got, want) {
				t.Fatalf("amount %d: replayed headers %v, want %v", amount, got, want)
			}
			if got, want := strip(second.trailer, "grpc-status", "grpc-message"), strip(first.trailer, "grpc-status", "grpc-message"); !mdEqual(got, want) {
				t.Fatalf("amount %d: replayed trailers %v, want %v", amount, got, want)
			}
			if v := second.header.Get("set-cookie"); len(v) != 0 {
				t.Fatalf("amount %d: set-cookie replayed: %v", amount, v)
			}
			if v := second.header.Get("x-receipt-bin"); len(v) != 1 || v[0] != "\x00\xffraw" {
				t.Fatalf("amount %d: binary header replayed as %q", amount, v)
			}
			if amount > 0 && (first.err != nil || !proto.Equal(first.resp, second.resp)) {
				t.Fatalf("responses %v %v, %v", first.resp, second.resp, first.err)
			}
		}
		if n := f.svc.chargeCalls.Load(); n != 2 {
			t.Fatalf("handler ran %d times, want 2", n)
		}
	})

	t.Run("allow-list", func(t *testing.T) {
		t.Parallel()
		f := start(t, setup{charge: handler, interceptor: []clients.InterceptorOption{clients.WithReplayMetadata("X-Ledger-Seq")}})
		f.charge(t, "h", chargeReq(100))
		second := f.charge(t, "h", chargeReq(100))
		if v := second.header.Get("x-charge-id"); len(v) != 0 {
			t.Fatalf("x-charge-id replayed though not allowed: %v", v)
		}
		if v := second.trailer.Get("x-ledger-seq"); len(v) != 1 || v[0] != "42" {
			t.Fatalf("x-ledger-seq trailer: %v", v)
		}
	})
}

func mdEqual(a, b metadata.MD) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !equalStrings(v, b[k]) {
			return false
		}
	}
	return true
}

// The interceptor warns at construction when the principal was not decided
// (neither WithPrincipal nor WithoutPrincipal).
func TestPrincipalIsADecision(t *testing.T) {
	t.Parallel()
	conn, err := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, tc := range []struct {
		name string
		opts []clients.InterceptorOption
		warn bool
	}{
		{"neither", nil, true},
		{"WithoutPrincipal", []clients.InterceptorOption{clients.WithoutPrincipal()}, false},
		{"WithPrincipal", []clients.InterceptorOption{clients.WithPrincipal(func(context.Context) (string, error) { return "u", nil })}, false},
	} {
		var buf bytes.Buffer
		c := clients.New(conn, clients.WithLogger(slog.New(slog.NewTextHandler(&buf, nil))))
		clients.UnaryServerInterceptor(c, tc.opts...)
		if got := strings.Contains(buf.String(), "WithPrincipal"); got != tc.warn {
			t.Errorf("%s: warning logged %v, want %v: %q", tc.name, got, tc.warn, buf.String())
		}
	}
}

// fakeCoordinator answers every Begin with one error: the seam for
// coordinator answers a real one only gives under load or misconfiguration.
type fakeCoordinator struct {
	idempotencyv1.UnimplementedCoordinatorServer
	err error
}

func (f *fakeCoordinator) Begin(context.Context, *idempotencyv1.BeginRequest) (*idempotencyv1.BeginResponse, error) {
	return nil, f.err
}

// Fail-open opens only for transport failures of the coordinator
// (UNAVAILABLE, DEADLINE_EXCEEDED), never for its rate limit or an auth
// refusal.
func TestFailOpenOnlyOnTransportFailure(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		code    codes.Code
		runs    bool
		answers codes.Code
	}{
		{codes.Unavailable, true, codes.OK},
		{codes.DeadlineExceeded, true, codes.OK},
		{codes.ResourceExhausted, false, codes.ResourceExhausted},
		{codes.PermissionDenied, false, codes.Internal},
		{codes.Unauthenticated, false, codes.Internal},
	} {
		t.Run(tc.code.String(), func(t *testing.T) {
			t.Parallel()
			srv := grpc.NewServer()
			idempotencyv1.RegisterCoordinatorServer(srv, &fakeCoordinator{err: status.Error(tc.code, "coordinator says no")})
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			go func() { _ = srv.Serve(lis) }()
			defer srv.Stop()
			conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			c := clients.New(conn, clients.WithMaxAttempts(1))
			intercept := clients.UnaryServerInterceptor(c, clients.WithFailOpen(), clients.WithoutPrincipal())
			ran := false
			_, err = intercept(withIncomingKey(testCtx(t), "k"), chargeReq(1), &grpc.UnaryServerInfo{FullMethod: chargeMethod},
				func(context.Context, any) (any, error) { ran = true; return &projectsv1.ChargeResponse{}, nil })
			if ran != tc.runs || status.Code(err) != tc.answers {
				t.Fatalf("coordinator %v: handler ran %v, answered %v; want ran %v, %v", tc.code, ran, err, tc.runs, tc.answers)
			}
		})
	}
}

// flakyEnd is a coordinator whose first Fail replies are lost (the Fail
// lands, the caller sees UNAVAILABLE) and whose Heartbeat then answers, as
// idemcoord does after an ending call, ALREADY_FINISHED.
type flakyEnd struct {
	idempotencyv1.UnimplementedCoordinatorServer
	mu         sync.Mutex
	fails      int
	heartbeats int
}

func (f *flakyEnd) Begin(_ context.Context, req *idempotencyv1.BeginRequest) (*idempotencyv1.BeginResponse, error) {
	return &idempotencyv1.BeginResponse{Outcome: idempotencyv1.Outcome_OUTCOME_ACQUIRED, LeaseToken: "tok",
		Record: &idempotencyv1.Record{Scope: req.GetScope(), Key: req.GetKey(), Attempt: 1, Generation: 1,
			State: idempotencyv1.State_STATE_IN_PROGRESS}}, nil
}

func (f *flakyEnd) Fail(context.Context, *idempotencyv1.FailRequest) (*idempotencyv1.FailResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fails++
	if f.fails <= 2 {
		return nil, status.Error(codes.Unavailable, "reply lost")
	}
	return &idempotencyv1.FailResponse{}, nil
}

func (f *flakyEnd) Heartbeat(context.Context, *idempotencyv1.HeartbeatRequest) (*idempotencyv1.HeartbeatResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.heartbeats++
	st, _ := status.New(codes.FailedPrecondition, "the record already ended with this token").
		WithDetails(&errdetails.ErrorInfo{Reason: "ALREADY_FINISHED", Domain: clients.ErrorDomain})
	return nil, st.Err()
}

func (f *flakyEnd) counts() (fails, heartbeats int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fails, f.heartbeats
}

// A Fail retried in the background whose first reply was lost: the
// Heartbeat in between answers ALREADY_FINISHED (it no longer revives the
// record), and the retry goes on until the repeated Fail is acknowledged
// instead of giving up.
func TestBackgroundFailSurvivesAlreadyFinishedHeartbeat(t *testing.T) {
	t.Parallel()
	fake := &flakyEnd{}
	srv := grpc.NewServer()
	idempotencyv1.RegisterCoordinatorServer(srv, fake)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := clients.New(conn, clients.WithMaxAttempts(1), clients.WithLease(time.Minute))
	_, err = c.Once(testCtx(t), "mail", "m1", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		return nil, status.Error(codes.Internal, "maybe sent")
	})
	if status.Code(err) != codes.Internal {
		t.Fatalf("Once: %v", err)
	}
	eventually(t, "the repeated Fail to be acknowledged", func() bool {
		fails, _ := fake.counts()
		return fails >= 3
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if fails, heartbeats := fake.counts(); fails != 3 || heartbeats < 1 {
		t.Fatalf("%d Fails, %d Heartbeats; want 3 Fails with a Heartbeat in between", fails, heartbeats)
	}
}
