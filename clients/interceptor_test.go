package clients_test

import (
	"bytes"
	"context"
	"strconv"
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
	"github.com/idemcoord/idemcoord/server"
)

// retryAborted is a grpc-go retry policy for ABORTED: the client honours
// the interceptor's grpc-retry-pushback-ms trailer between attempts.
const retryAborted = `{"methodConfig":[{"name":[{"service":"projects.v1.ProjectsService"}],
  "retryPolicy":{"maxAttempts":5,"initialBackoff":"0.1s","maxBackoff":"2s","backoffMultiplier":2,
  "retryableStatusCodes":["ABORTED"]}}]}`

// A retry storm: 50 concurrent and then 50 sequential calls with one key
// run the handler once; everyone gets the same bytes; all but the first
// are "replayed".
func TestRetryStormRunsHandlerOnce(t *testing.T) {
	t.Parallel()
	f := start(t, setup{
		dialOpts: []grpc.DialOption{grpc.WithDefaultServiceConfig(retryAborted)},
		charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			time.Sleep(300 * time.Millisecond) // keep the others in progress meanwhile
			return bookCharge(ctx, req, n)
		},
	})
	const key = "storm-1"
	replies := make([]reply, 100)
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Go(func() { replies[i] = f.charge(t, key, chargeReq(500)) })
	}
	wg.Wait()
	for i := 50; i < 100; i++ {
		replies[i] = f.charge(t, key, chargeReq(500))
	}

	if n := f.svc.chargeCalls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
	var first []byte
	counts := map[string]int{}
	for i, r := range replies {
		if r.err != nil {
			t.Fatalf("call %d: %v", i, r.err)
		}
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(r.resp)
		if err != nil {
			t.Fatal(err)
		}
		if first == nil {
			first = b
		} else if !bytes.Equal(b, first) {
			t.Fatalf("call %d got %v, call 0 got other bytes", i, r.resp)
		}
		counts[r.result()]++
	}
	if counts["created"] != 1 || counts["replayed"] != 99 {
		t.Fatalf("idempotency-result headers: %v, want 1 created and 99 replayed", counts)
	}
	for i := 50; i < 100; i++ {
		if replies[i].result() != "replayed" {
			t.Fatalf("sequential call %d: result %q", i, replies[i].result())
		}
	}
	f.mustState(t, key, idempotencyv1.State_STATE_COMPLETED)
}

// The same key with a different request is FAILED_PRECONDITION
// (FINGERPRINT_MISMATCH) and the handler does not run.
func TestSameKeyDifferentRequest(t *testing.T) {
	t.Parallel()
	f := start(t, setup{})
	if r := f.charge(t, "k", chargeReq(100)); r.err != nil {
		t.Fatal(r.err)
	}
	r := f.charge(t, "k", chargeReq(200))
	if got := errorReason(wantCode(t, r.err, codes.FailedPrecondition)); got != "FINGERPRINT_MISMATCH" {
		t.Fatalf("reason %q, want FINGERPRINT_MISMATCH", got)
	}
	if n := f.svc.chargeCalls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

// attemptSeen records what handlers saw through AttemptFrom.
type attemptSeen struct {
	mu   sync.Mutex
	seen []string
}

func (a *attemptSeen) record(ctx context.Context) {
	attempt, prev, ok := clients.AttemptFrom(ctx)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.seen = append(a.seen, strconv.Itoa(int(attempt))+" "+prev.String()+" "+strconv.FormatBool(ok))
}

func (a *attemptSeen) get() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.seen...)
}

// failFirst answers err on the handler's first run and books a charge
// afterwards, recording AttemptFrom each time.
func failFirst(seen *attemptSeen, err error) func(context.Context, *projectsv1.ChargeRequest, int32) (*projectsv1.ChargeResponse, error) {
	return func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
		seen.record(ctx)
		if n == 1 {
			return nil, err
		}
		return bookCharge(ctx, req, n)
	}
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] { //nolint:gosec // i ranges over a, and len(b) == len(a) is checked above
			return false
		}
	}
	return true
}

// Each class of handler error behaves as the table of docs/go.md says.
func TestHandlerErrorClasses(t *testing.T) {
	t.Parallel()

	t.Run("replayable is replayed without running the handler", func(t *testing.T) {
		t.Parallel()
		st, _ := status.New(codes.FailedPrecondition, "card declined").
			WithDetails(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "projects.v1"},
				&errdetails.LocalizedMessage{Locale: "de-DE", Message: "Karte abgelehnt"})
		var seen attemptSeen
		f := start(t, setup{charge: failFirst(&seen, st.Err())})
		first := f.charge(t, "declined", chargeReq(100))
		second := f.charge(t, "declined", chargeReq(100))
		for i, r := range []reply{first, second} {
			got := wantCode(t, r.err, codes.FailedPrecondition)
			if !proto.Equal(got.Proto(), st.Proto()) {
				t.Fatalf("call %d: status %v, want %v", i, got.Proto(), st.Proto())
			}
		}
		if first.result() != "created" || second.result() != "replayed" {
			t.Fatalf("results %q, %q; want created, replayed", first.result(), second.result())
		}
		if n := f.svc.chargeCalls.Load(); n != 1 {
			t.Fatalf("handler ran %d times, want 1", n)
		}
		rec := f.mustState(t, "declined", idempotencyv1.State_STATE_FAILED_REPLAYABLE)
		if rec.GetResponse().GetStatusCode() != int32(codes.FailedPrecondition) ||
			rec.GetResponse().GetSchemaVersion() != clients.SchemaVersionStatus {
			t.Fatalf("stored %v", rec.GetResponse())
		}
	})

	t.Run("retryable lets the next call run as attempt 2", func(t *testing.T) {
		t.Parallel()
		var seen attemptSeen
		f := start(t, setup{charge: failFirst(&seen, status.Error(codes.Unavailable, "bank offline"))})
		wantCode(t, f.charge(t, "retry", chargeReq(100)).err, codes.Unavailable)
		f.mustState(t, "retry", idempotencyv1.State_STATE_FAILED_RETRYABLE)
		r := f.charge(t, "retry", chargeReq(100))
		if r.err != nil || r.result() != "created" {
			t.Fatalf("second call: %v, result %q", r.err, r.result())
		}
		want := []string{"1 STATE_UNSPECIFIED true", "2 STATE_FAILED_RETRYABLE true"}
		if got := seen.get(); !equalStrings(got, want) {
			t.Fatalf("AttemptFrom saw %v, want %v", got, want)
		}
		f.mustState(t, "retry", idempotencyv1.State_STATE_COMPLETED)
	})

	t.Run("invalid argument leaves no record; the corrected request runs", func(t *testing.T) {
		t.Parallel()
		var seen attemptSeen
		f := start(t, setup{charge: failFirst(&seen, status.Error(codes.InvalidArgument, "amount too small"))})
		wantCode(t, f.charge(t, "fixme", chargeReq(1)).err, codes.InvalidArgument)
		if _, err := f.lookup(t, "fixme"); status.Code(err) != codes.NotFound {
			t.Fatalf("Lookup after INVALID_ARGUMENT: %v, want NOT_FOUND", err)
		}
		r := f.charge(t, "fixme", chargeReq(100)) // a different request, same key
		if r.err != nil || r.result() != "created" {
			t.Fatalf("corrected call: %v, result %q", r.err, r.result())
		}
		want := []string{"1 STATE_UNSPECIFIED true", "1 STATE_UNSPECIFIED true"}
		if got := seen.get(); !equalStrings(got, want) {
			t.Fatalf("AttemptFrom saw %v, want %v", got, want)
		}
	})

	t.Run("internal leaves the key UNKNOWN; the next call sees it", func(t *testing.T) {
		t.Parallel()
		var seen attemptSeen
		f := start(t, setup{charge: failFirst(&seen, status.Error(codes.Internal, "bank said 500"))})
		wantCode(t, f.charge(t, "unk", chargeReq(100)).err, codes.Internal)
		rec := f.mustState(t, "unk", idempotencyv1.State_STATE_UNKNOWN)
		if rec.GetFailureReason() == "" {
			t.Fatalf("no failure reason stored: %v", rec)
		}
		if r := f.charge(t, "unk", chargeReq(100)); r.err != nil {
			t.Fatal(r.err)
		}
		want := []string{"1 STATE_UNSPECIFIED true", "2 STATE_UNKNOWN true"}
		if got := seen.get(); !equalStrings(got, want) {
			t.Fatalf("AttemptFrom saw %v, want %v", got, want)
		}
	})

	t.Run("an overridden code takes its new class", func(t *testing.T) {
		t.Parallel()
		var seen attemptSeen
		f := start(t, setup{
			charge: failFirst(&seen, status.Error(codes.NotFound, "account not found yet")),
			interceptor: []clients.InterceptorOption{clients.WithFailureKinds(map[codes.Code]idempotencyv1.FailureKind{
				codes.NotFound: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE})},
		})
		wantCode(t, f.charge(t, "nf", chargeReq(100)).err, codes.NotFound)
		f.mustState(t, "nf", idempotencyv1.State_STATE_FAILED_RETRYABLE)
		if r := f.charge(t, "nf", chargeReq(100)); r.err != nil {
			t.Fatal(r.err)
		}
	})
}

// A panicking handler leaves the key UNKNOWN, and the next call acquires it
// with previous state UNKNOWN.
func TestPanicLeavesKeyUnknown(t *testing.T) {
	t.Parallel()
	var seen attemptSeen
	f := start(t, setup{charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
		seen.record(ctx)
		if n == 1 {
			panic("boom")
		}
		return bookCharge(ctx, req, n)
	}})
	wantCode(t, f.charge(t, "p", chargeReq(100)).err, codes.Internal) // from the recovery interceptor
	rec := f.mustState(t, "p", idempotencyv1.State_STATE_UNKNOWN)
	if rec.GetFailureReason() != "panic: boom" {
		t.Fatalf("failure reason %q", rec.GetFailureReason())
	}
	r := f.charge(t, "p", chargeReq(100))
	if r.err != nil || r.result() != "created" {
		t.Fatalf("after the panic: %v, result %q", r.err, r.result())
	}
	want := []string{"1 STATE_UNSPECIFIED true", "2 STATE_UNKNOWN true"}
	if got := seen.get(); !equalStrings(got, want) {
		t.Fatalf("AttemptFrom saw %v, want %v", got, want)
	}
}

// A handler slower than its lease keeps the key through heartbeats: a call
// meanwhile is told "in progress" instead of taking over, and the record
// completes as attempt 1.
func TestHeartbeatsKeepSlowHandlersKey(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}), make(chan struct{})
	f := start(t, setup{
		config: `scopes: [{ match: "/projects.v1.ProjectsService/*", lease: 1s }]`,
		charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			if n == 1 {
				close(started)
				<-release
				if ctx.Err() != nil {
					return nil, status.FromContextError(ctx.Err()).Err()
				}
			}
			return bookCharge(ctx, req, n)
		},
	})
	done := make(chan reply, 1)
	go func() { done <- f.charge(t, "slow", chargeReq(100)) }()
	<-started
	// Past the first lease, and renewed by a heartbeat: conditions, polled.
	firstLease := f.mustState(t, "slow", idempotencyv1.State_STATE_IN_PROGRESS).GetLeaseExpiresAt().AsTime()
	eventually(t, "a heartbeat past the first lease", func() bool {
		rec, err := f.lookup(t, "slow")
		return err == nil && time.Now().After(firstLease) && rec.GetLeaseExpiresAt().AsTime().After(firstLease)
	})
	mid := f.charge(t, "slow", chargeReq(100))
	wantCode(t, mid.err, codes.Aborted) // in progress, not taken over
	close(release)
	first := <-done
	if first.err != nil || first.result() != "created" {
		t.Fatalf("slow call: %v, result %q", first.err, first.result())
	}
	rec := f.mustState(t, "slow", idempotencyv1.State_STATE_COMPLETED)
	if rec.GetAttempt() != 1 {
		t.Fatalf("attempt %d, want 1", rec.GetAttempt())
	}
	if n := f.svc.chargeCalls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

// Another attempt in progress: ABORTED with RetryInfo and the pushback
// trailer by default; with WithWaitForResult, the stored result.
func TestInProgress(t *testing.T) {
	t.Parallel()
	blockFirst := func(release <-chan struct{}, started chan<- struct{}) func(context.Context, *projectsv1.ChargeRequest, int32) (*projectsv1.ChargeResponse, error) {
		return func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			if n == 1 {
				close(started)
				<-release
			}
			return bookCharge(ctx, req, n)
		}
	}

	t.Run("aborted with retry info", func(t *testing.T) {
		t.Parallel()
		release, started := make(chan struct{}), make(chan struct{})
		f := start(t, setup{charge: blockFirst(release, started)})
		done := make(chan reply, 1)
		go func() { done <- f.charge(t, "busy", chargeReq(100)) }()
		<-started
		r := f.charge(t, "busy", chargeReq(100))
		close(release)
		st := wantCode(t, r.err, codes.Aborted)
		var delay time.Duration
		for _, d := range st.Details() {
			if ri, ok := d.(*errdetails.RetryInfo); ok {
				delay = ri.GetRetryDelay().AsDuration()
			}
		}
		if delay <= 0 || delay > time.Second {
			t.Fatalf("RetryInfo delay %v, want in (0, 1s]; details %v", delay, st.Details())
		}
		ms := r.trailer.Get(clients.PushbackTrailer)
		if len(ms) != 1 || ms[0] != strconv.FormatInt(delay.Milliseconds(), 10) {
			t.Fatalf("trailer %s = %v, want %d", clients.PushbackTrailer, ms, delay.Milliseconds())
		}
		if first := <-done; first.err != nil {
			t.Fatal(first.err)
		}
		if n := f.svc.chargeCalls.Load(); n != 1 {
			t.Fatalf("handler ran %d times, want 1", n)
		}
	})

	t.Run("wait for the result", func(t *testing.T) {
		t.Parallel()
		release, started := make(chan struct{}), make(chan struct{})
		f := start(t, setup{
			charge:      blockFirst(release, started),
			interceptor: []clients.InterceptorOption{clients.WithWaitForResult(20 * time.Second)},
		})
		done := make(chan reply, 1)
		go func() { done <- f.charge(t, "busy", chargeReq(100)) }()
		<-started
		waiter := make(chan reply, 1)
		go func() { waiter <- f.charge(t, "busy", chargeReq(100)) }()
		f.coord.WaitInFlight(t, "Begin", 1) // the second call's Begin is waiting in the coordinator
		close(release)
		first, second := <-done, <-waiter
		if first.err != nil || second.err != nil {
			t.Fatalf("errors: %v, %v", first.err, second.err)
		}
		if second.result() != "replayed" || !proto.Equal(first.resp, second.resp) {
			t.Fatalf("waiter got %v (%q), first got %v", second.resp, second.result(), first.resp)
		}
		if n := f.svc.chargeCalls.Load(); n != 1 {
			t.Fatalf("handler ran %d times, want 1", n)
		}
	})
}

// A key held UNKNOWN (on_unknown: hold) answers FAILED_PRECONDITION with
// reason UNKNOWN_HELD and runs nothing.
func TestUnknownHeld(t *testing.T) {
	t.Parallel()
	f := start(t, setup{
		config: `scopes: [{ match: "/projects.v1.ProjectsService/Charge", on_unknown: hold }]`,
		charge: func(context.Context, *projectsv1.ChargeRequest, int32) (*projectsv1.ChargeResponse, error) {
			return nil, status.Error(codes.DeadlineExceeded, "bank timed out")
		},
	})
	wantCode(t, f.charge(t, "held", chargeReq(100)).err, codes.DeadlineExceeded)
	r := f.charge(t, "held", chargeReq(100))
	if got := errorReason(wantCode(t, r.err, codes.FailedPrecondition)); got != clients.ReasonUnknownHeld {
		t.Fatalf("reason %q, want %s", got, clients.ReasonUnknownHeld)
	}
	if n := f.svc.chargeCalls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

// With the coordinator stopped, a wrapped method fails closed with
// UNAVAILABLE and runs nothing, or with fail-open runs the handler
// unprotected.
func TestCoordinatorDown(t *testing.T) {
	t.Parallel()
	t.Run("fail closed", func(t *testing.T) {
		t.Parallel()
		f := start(t, setup{})
		f.coord.Stop()
		wantCode(t, f.charge(t, "down", chargeReq(100)).err, codes.Unavailable)
		if n := f.svc.chargeCalls.Load(); n != 0 {
			t.Fatalf("handler ran %d times, want 0", n)
		}
	})
	t.Run("fail open", func(t *testing.T) {
		t.Parallel()
		var seen attemptSeen
		f := start(t, setup{
			interceptor: []clients.InterceptorOption{clients.WithFailOpen()},
			charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
				seen.record(ctx)
				return bookCharge(ctx, req, n)
			},
		})
		f.coord.Stop()
		r := f.charge(t, "down", chargeReq(100))
		if r.err != nil || r.result() != "" {
			t.Fatalf("fail open: %v, result %q", r.err, r.result())
		}
		if got, want := seen.get(), []string{"0 STATE_UNSPECIFIED false"}; !equalStrings(got, want) {
			t.Fatalf("AttemptFrom saw %v, want %v", got, want)
		}
	})
}

// Complete failing after a successful handler: the caller still gets the
// response, and the record ends COMPLETED once the coordinator is back
// within the lease.
func TestCompleteFailsAfterSuccess(t *testing.T) {
	t.Parallel()
	started, proceed := make(chan struct{}), make(chan struct{})
	f := start(t, setup{charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
		close(started)
		<-proceed
		return bookCharge(ctx, req, n)
	}})
	done := make(chan reply, 1)
	go func() { done <- f.charge(t, "lost-complete", chargeReq(100)) }()
	<-started
	f.coord.Stop() // the handler's side effect is done; the coordinator goes away
	close(proceed)
	r := <-done
	if r.err != nil || r.resp.GetChargeId() != "ch_1" {
		t.Fatalf("caller got %v, %v; want the handler's response", r.resp, r.err)
	}
	f.coord.Restart()
	eventually(t, "the record to complete in the background", func() bool {
		rec, err := f.lookup(t, "lost-complete")
		return err == nil && rec.GetState() == idempotencyv1.State_STATE_COMPLETED
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := f.idem.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	again := f.charge(t, "lost-complete", chargeReq(100))
	if again.err != nil || again.result() != "replayed" || !proto.Equal(again.resp, r.resp) {
		t.Fatalf("replay: %v %v %q", again.resp, again.err, again.result())
	}
}

// Which calls are wrapped: not NO_SIDE_EFFECTS methods, not methods outside
// WithMethods, not calls without a key (unless a key is required).
func TestMethodSelectionAndKeys(t *testing.T) {
	t.Parallel()
	f := start(t, setup{interceptor: []clients.InterceptorOption{clients.WithMethods(chargeMethod, getProjectMethod)}})
	ctx := withKey(context.Background(), "k1")
	for range 2 {
		var h metadata.MD
		if _, err := f.api.GetProject(ctx, &projectsv1.GetProjectRequest{Id: "prj_1"}, grpc.Header(&h)); err != nil {
			t.Fatal(err)
		}
		if v := h.Get(clients.ResultHeader); len(v) != 0 {
			t.Fatalf("NO_SIDE_EFFECTS method got %v", v)
		}
		if _, err := f.api.CreateProject(ctx, &projectsv1.CreateProjectRequest{Name: "x"}, grpc.Header(&h)); err != nil {
			t.Fatal(err)
		}
		if v := h.Get(clients.ResultHeader); len(v) != 0 {
			t.Fatalf("unselected method got %v", v)
		}
	}
	if n := f.svc.otherCalls.Load(); n != 4 {
		t.Fatalf("unwrapped handlers ran %d times, want 4", n)
	}
	for range 2 {
		if r := f.charge(t, "", chargeReq(100)); r.err != nil || r.result() != "" {
			t.Fatalf("call without key: %v, result %q", r.err, r.result())
		}
	}
	if n := f.svc.chargeCalls.Load(); n != 2 {
		t.Fatalf("keyless calls ran the handler %d times, want 2", n)
	}

	g := start(t, setup{interceptor: []clients.InterceptorOption{clients.WithRequireKey()}})
	wantCode(t, g.charge(t, "", chargeReq(100)).err, codes.InvalidArgument)
	if n := g.svc.chargeCalls.Load(); n != 0 {
		t.Fatalf("handler ran %d times without a key, want 0", n)
	}
}

// A principal is folded into the key: two users with one key get two
// records; one user's retry replays.
func TestPrincipalFolding(t *testing.T) {
	t.Parallel()
	f := start(t, setup{interceptor: []clients.InterceptorOption{clients.WithPrincipal(func(ctx context.Context) (string, error) {
		return metadataUser(ctx), nil
	})}})
	call := func(user string) reply {
		ctx := withUser(context.Background(), user)
		var r reply
		r.resp, r.err = f.api.Charge(withKey(ctx, "same-key"), chargeReq(100), grpc.Header(&r.header))
		return r
	}
	alice, bob, alice2 := call("alice"), call("bob"), call("alice")
	for _, r := range []reply{alice, bob, alice2} {
		if r.err != nil {
			t.Fatal(r.err)
		}
	}
	if alice.resp.GetChargeId() == bob.resp.GetChargeId() || alice2.result() != "replayed" ||
		!proto.Equal(alice.resp, alice2.resp) {
		t.Fatalf("alice %v, bob %v, alice again %v (%q)", alice.resp, bob.resp, alice2.resp, alice2.result())
	}
	f.mustState(t, clients.FoldPrincipal("bob", "same-key"), idempotencyv1.State_STATE_COMPLETED)
}

// A stored response under another schema version is refused, not decoded.
func TestSchemaVersion(t *testing.T) {
	t.Parallel()
	f := start(t, setup{})
	if r := f.charge(t, "v", chargeReq(100)); r.err != nil {
		t.Fatal(r.err)
	}
	rec := f.mustState(t, "v", idempotencyv1.State_STATE_COMPLETED)
	if got := rec.GetResponse().GetSchemaVersion(); got != "projects.v1.ChargeResponse" {
		t.Fatalf("schema version %q", got)
	}
	idem2 := clients.New(f.coord.Dial(t))
	srv := clients.UnaryServerInterceptor(idem2, clients.WithSchemaVersion(chargeMethod, "projects.v1.ChargeResponse/2"))
	ctx := withIncomingKey(context.Background(), "v")
	_, err := srv(ctx, chargeReq(100), &grpc.UnaryServerInfo{FullMethod: chargeMethod},
		func(context.Context, any) (any, error) { t.Fatal("handler ran"); return nil, nil })
	if got := errorReason(wantCode(t, err, codes.FailedPrecondition)); got != "SCHEMA_VERSION_NOT_ACCEPTED" {
		t.Fatalf("reason %q", got)
	}
}

// A method without a registered descriptor is passed through by default
// (its response could not be replayed) and refused when selected on purpose.
func TestUnregisteredMethod(t *testing.T) {
	t.Parallel()
	conn, err := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := clients.New(conn) // never reached: nothing is wrapped
	const unknown = "/unknown.v1.Things/Do"
	ran := 0
	handler := func(context.Context, any) (any, error) { ran++; return chargeReq(1), nil }
	info := &grpc.UnaryServerInfo{FullMethod: unknown}
	ctx := withIncomingKey(context.Background(), "k")
	if _, err := clients.UnaryServerInterceptor(c)(ctx, chargeReq(1), info, handler); err != nil || ran != 1 {
		t.Fatalf("default selection: %v, handler ran %d times", err, ran)
	}
	_, err = clients.UnaryServerInterceptor(c, clients.WithMethods(unknown))(ctx, chargeReq(1), info, handler)
	if wantCode(t, err, codes.Internal); ran != 1 {
		t.Fatalf("explicit selection ran the handler")
	}
}

// A call whose deadline ends while the interceptor's Begin is in flight
// (the coordinator acquired the key; its answer never arrived) leaves no
// trace: the handler does not run, the record is gone again, and a retry
// with the key acquires at once as the first attempt.
func TestInterceptorCallerGivesUpDuringBegin(t *testing.T) {
	t.Parallel()
	lost := &lostAcquisitions{}
	lost.armed.Store(true)
	f := start(t, setup{serverOpts: []server.Option{lost.option()}})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err := f.api.Charge(withKey(ctx, "gave-up"), chargeReq(100))
	wantCode(t, err, codes.DeadlineExceeded)
	lost.armed.Store(false)
	if n := lost.held.Load(); n != 1 {
		t.Fatalf("%d Begin answers kept back, want 1", n)
	}
	within(t, 10*time.Second, "the abandoned acquisition released (record absent)", func() bool {
		_, err := f.lookup(t, "gave-up")
		return status.Code(err) == codes.NotFound
	})
	r := f.charge(t, "gave-up", chargeReq(100))
	if r.err != nil || r.result() != "created" {
		t.Fatalf("retry: %v, result %q; want created at once", r.err, r.result())
	}
	if n := f.svc.chargeCalls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
	if rec := f.mustState(t, "gave-up", idempotencyv1.State_STATE_COMPLETED); rec.GetAttempt() != 1 || rec.GetGeneration() != 1 {
		t.Fatalf("record attempt %d generation %d, want 1 and 1", rec.GetAttempt(), rec.GetGeneration())
	}
}

// A takeover that the caller gave up on during Begin is released too: the
// key reads FAILED_RETRYABLE as before, the released acquisition does not
// count against max_attempts, and the retry runs the handler as attempt 2
// with previous state FAILED_RETRYABLE.
func TestInterceptorReleasedTakeoverDoesNotCountAgainstMaxAttempts(t *testing.T) {
	t.Parallel()
	var seen attemptSeen
	lost := &lostAcquisitions{}
	f := start(t, setup{
		config:     `scopes: [{ match: "/projects.v1.ProjectsService/Charge", max_attempts: 2 }]`,
		serverOpts: []server.Option{lost.option()},
		charge:     failFirst(&seen, status.Error(codes.Unavailable, "bank unavailable")),
	})
	wantCode(t, f.charge(t, "k", chargeReq(100)).err, codes.Unavailable)
	f.mustState(t, "k", idempotencyv1.State_STATE_FAILED_RETRYABLE)

	lost.armed.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err := f.api.Charge(withKey(ctx, "k"), chargeReq(100))
	wantCode(t, err, codes.DeadlineExceeded)
	lost.armed.Store(false)
	within(t, 10*time.Second, "the abandoned takeover released (FAILED_RETRYABLE, attempt 1)", func() bool {
		rec, err := f.lookup(t, "k")
		return err == nil && rec.GetState() == idempotencyv1.State_STATE_FAILED_RETRYABLE && rec.GetAttempt() == 1
	})
	r := f.charge(t, "k", chargeReq(100))
	if r.err != nil || r.result() != "created" {
		t.Fatalf("retry: %v, result %q; want created", r.err, r.result())
	}
	want := []string{"1 STATE_UNSPECIFIED true", "2 STATE_FAILED_RETRYABLE true"}
	if got := seen.get(); !equalStrings(got, want) {
		t.Fatalf("AttemptFrom saw %v, want %v", got, want)
	}
}

// A handler that succeeds after its lease was lost (another attempt took
// the key over before Complete) gets its response passed on, but never
// "idempotency-result: created": nothing was stored for it.
func TestInterceptorLeaseLostBeforeCompleteIsNotCreated(t *testing.T) {
	t.Parallel()
	var f *fixture
	f = start(t, setup{fakeClock: true, clientOpts: []clients.Option{clients.WithLease(time.Second)},
		charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			l, _ := clients.LeaseFrom(ctx)
			// Let the lease run out and take the key over; a heartbeat
			// landing between the two revives the lease, so repeat until
			// the takeover wins.
			for {
				f.coord.Clock.Advance(2 * time.Second)
				res, err := f.idem.Begin(context.WithoutCancel(ctx), &idempotencyv1.BeginRequest{Scope: l.Scope, Key: l.Key, AttemptId: "successor"})
				if err != nil {
					return nil, err
				}
				if res.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED {
					return bookCharge(ctx, req, n)
				}
			}
		}})
	r := f.charge(t, "taken", chargeReq(100))
	if r.err != nil || r.resp.GetChargeId() != "ch_1" {
		t.Fatalf("call: %v %v, want the handler's response", r.resp, r.err)
	}
	if got := r.result(); got == "created" {
		t.Fatalf("idempotency-result %q for a response that was not stored", got)
	}
	f.mustState(t, "taken", idempotencyv1.State_STATE_IN_PROGRESS) // the successor's
}
