package server_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

func batchBegin(scope, key string, mods ...func(*idempotencyv1.BeginRequest)) *idempotencyv1.BatchCall {
	req := &idempotencyv1.BeginRequest{Scope: scope, Key: key}
	for _, m := range mods {
		m(req)
	}
	return &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Begin{Begin: req}}
}

func batchComplete(scope, key, token string, resp *idempotencyv1.StoredResponse) *idempotencyv1.BatchCall {
	return &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Complete{Complete: &idempotencyv1.CompleteRequest{
		Scope: scope, Key: key, LeaseToken: token, Response: resp}}}
}

func batchLookup(scope, key string) *idempotencyv1.BatchCall {
	return &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Lookup{Lookup: &idempotencyv1.LookupRequest{Scope: scope, Key: key}}}
}

// batch sends calls in one Batch under c and fails t unless the RPC
// answers one result per call.
func batch(t *testing.T, c context.Context, client idempotencyv1.CoordinatorClient, calls ...*idempotencyv1.BatchCall) []*idempotencyv1.BatchResult {
	t.Helper()
	resp, err := client.Batch(c, &idempotencyv1.BatchRequest{Calls: calls})
	if err != nil {
		t.Fatalf("Batch of %d calls: %v", len(calls), err)
	}
	if len(resp.GetResults()) != len(calls) {
		t.Fatalf("Batch of %d calls answered %d results", len(calls), len(resp.GetResults()))
	}
	return resp.GetResults()
}

// resultErr is the error a result carries, as the status error a unary
// call would have returned, or nil.
func resultErr(r *idempotencyv1.BatchResult) error {
	if r.GetError() == nil {
		return nil
	}
	return status.FromProto(r.GetError()).Err()
}

// wantViolation fails t unless st carries a BadRequest violation of field.
func wantViolation(t *testing.T, st *status.Status, field string) {
	t.Helper()
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				if v.GetField() == field {
					return
				}
			}
		}
	}
	t.Fatalf("%v: no BadRequest violation of %q in %v", st.Err(), field, st.Details())
}

// A batch answers each call as its unary call would: Begins of new keys
// acquire and store what a unary Begin stores, Completes end them, a Begin
// of a completed key replays it, in the order of the calls.
func TestBatchAnswersAsUnaryCalls(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	lease := withLease(time.Minute)
	unary := e.mustBegin("build", "unary", acquired, lease, withFingerprint("fp"))
	res := batch(t, ctx(t), e.client, batchBegin("build", "a", lease, withFingerprint("fp")), batchLookup("build", "unary"),
		batchBegin("build", "b", lease, withFingerprint("fp")), batchBegin("build", "c", lease, withFingerprint("fp")))
	if got := res[1].GetLookup().GetRecord(); !proto.Equal(got, unary.GetRecord()) {
		t.Fatalf("Lookup in a batch = %v, want %v", res[1], unary.GetRecord())
	}
	tokens := map[string]string{}
	for _, r := range []*idempotencyv1.BatchResult{res[0], res[2], res[3]} {
		b := r.GetBegin()
		if b.GetOutcome() != acquired || b.GetLeaseToken() == "" {
			t.Fatalf("Begin of a new key in a batch: %v", r)
		}
		key := b.GetRecord().GetKey()
		tokens[key] = b.GetLeaseToken()
		want := proto.CloneOf(unary)
		want.LeaseToken, want.Record.Key = b.GetLeaseToken(), key
		if !proto.Equal(b, want) {
			t.Fatalf("Begin of %s in a batch = %v, want as the unary Begin: %v", key, b, want)
		}
		rec, err := e.lookup("build", key)
		if want := unary.GetRecord(); err != nil || rec.GetState() != want.GetState() || string(rec.GetFingerprint()) != "fp" ||
			!rec.GetLeaseExpiresAt().AsTime().Equal(want.GetLeaseExpiresAt().AsTime()) {
			t.Fatalf("record %s after a batched Begin: %v, %v; want like %v", key, rec, err, want)
		}
	}
	if len(tokens) != 3 {
		t.Fatalf("results name keys %v, want a, b and c in the order of the calls", tokens)
	}
	if res[0].GetBegin().GetRecord().GetKey() != "a" || res[3].GetBegin().GetRecord().GetKey() != "c" {
		t.Fatalf("results out of order: %v", res)
	}

	var completes []*idempotencyv1.BatchCall
	for _, key := range []string{"a", "b", "c"} {
		completes = append(completes, batchComplete("build", key, tokens[key], sampleResponse()))
	}
	for i, r := range batch(t, ctx(t), e.client, completes...) {
		if r.GetComplete().GetRecord().GetState() != idempotencyv1.State_STATE_COMPLETED {
			t.Fatalf("Complete %d in a batch: %v", i, r)
		}
	}
	for _, key := range []string{"a", "b", "c"} {
		if rec, err := e.lookup("build", key); err != nil || rec.GetState() != idempotencyv1.State_STATE_COMPLETED ||
			!proto.Equal(rec.GetResponse(), sampleResponse()) {
			t.Fatalf("record %s after a batched Complete: %v, %v", key, rec, err)
		}
	}
	r := batch(t, ctx(t), e.client, batchBegin("build", "b", withFingerprint("fp")))[0].GetBegin()
	if r.GetOutcome() != replay || !proto.Equal(r.GetRecord().GetResponse(), sampleResponse()) {
		t.Fatalf("Begin of a completed key in a batch: %v", r)
	}
}

// One invalid call fails alone, INVALID_ARGUMENT with the BadRequest its
// unary call would carry, and writes nothing; the others succeed.
func TestBatchInvalidCallFailsAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	res := batch(t, ctx(t), e.client, batchBegin("build", "x"), batchBegin("build", ""), batchBegin("build", "y"))
	st := wantCode(t, resultErr(res[1]), codes.InvalidArgument, "")
	wantViolation(t, st, "key")
	_, unaryErr := e.begin("build", "")
	if unary := status.Convert(unaryErr).Proto(); !proto.Equal(res[1].GetError(), unary) {
		t.Fatalf("batched call's error %v, want the unary call's %v", res[1].GetError(), unary)
	}
	for _, i := range []int{0, 2} {
		if res[i].GetBegin().GetOutcome() != acquired {
			t.Fatalf("valid call %d beside an invalid one: %v", i, res[i])
		}
	}
	if n := e.rowCount(); n != 2 {
		t.Fatalf("rows = %d, want 2: the invalid call wrote", n)
	}
}

// A Begin that would wait fails alone: a batch never waits on a holder.
// So does a call whose timeout is not more than 0.
func TestBatchRefusesWaitAndBadTimeout(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	zero := &idempotencyv1.BatchCall{Call: batchBegin("build", "z").GetCall(), Timeout: durationpb.New(0)}
	res := batch(t, ctx(t), e.client, batchBegin("build", "ok"), batchBegin("build", "w", withWait(time.Second)), zero,
		batchBegin("build", "w0", withWait(0)))
	wantViolation(t, wantCode(t, resultErr(res[1]), codes.InvalidArgument, ""), "calls[1].begin.wait")
	wantViolation(t, wantCode(t, resultErr(res[2]), codes.InvalidArgument, ""), "calls[2].timeout")
	if res[0].GetBegin().GetOutcome() != acquired || res[3].GetBegin().GetOutcome() != acquired {
		t.Fatalf("calls beside refused ones: %v", res)
	}
	if n := e.rowCount(); n != 2 {
		t.Fatalf("rows = %d, want 2: a refused call wrote", n)
	}
}

// A batch with no calls, more than 256, or a call without a request, is
// refused whole.
func TestBatchRefusedWhole(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	many := make([]*idempotencyv1.BatchCall, 257)
	for i := range many {
		many[i] = batchBegin("build", fmt.Sprint(i))
	}
	for name, calls := range map[string][]*idempotencyv1.BatchCall{
		"no calls":   nil,
		"257 calls":  many,
		"no request": {batchBegin("build", "k"), {}},
	} {
		_, err := e.client.Batch(ctx(t), &idempotencyv1.BatchRequest{Calls: calls})
		st := wantCode(t, err, codes.InvalidArgument, "")
		field := "calls"
		if name == "no request" {
			field = "calls[1]"
		}
		wantViolation(t, st, field)
	}
	// Invalid UTF-8 in calls[1].begin.key: the codec marks the whole
	// request, not the call, and names the call by its index.
	raw, err := proto.Marshal(&idempotencyv1.BatchRequest{Calls: []*idempotencyv1.BatchCall{batchBegin("s", "ok"), batchBegin("s", "\x01\x02")}})
	if err != nil {
		t.Fatal(err)
	}
	raw = bytes.Replace(raw, []byte("\x01\x02"), []byte("\xff\xfe"), 1)
	var out []byte
	err = e.coord.Dial(t).Invoke(ctx(t), idempotencyv1.Coordinator_Batch_FullMethodName, &raw, &out, grpc.ForceCodecV2(rawCodec{}))
	wantViolation(t, wantCode(t, err, codes.InvalidArgument, ""), "calls[1].begin.key")
	if n := e.rowCount(); n != 0 {
		t.Fatalf("rows = %d after refused batches", n)
	}
	if res := batch(t, ctx(t), e.client, many[:256]...); res[255].GetBegin().GetOutcome() != acquired {
		t.Fatalf("call 255 of 256: %v", res[255])
	}
}

// Concurrent Begins of one new key, in one batch or across batches, let
// exactly one acquire; the others see it in progress.
func TestBatchDuplicatesAcquireOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	count := func(results []*idempotencyv1.BatchResult) (acq, inProg int) {
		for _, r := range results {
			switch r.GetBegin().GetOutcome() {
			case acquired:
				acq++
			case inProgress:
				inProg++
			default:
				t.Fatalf("duplicate Begin: %v", r)
			}
		}
		return acq, inProg
	}
	same := func(key string) []*idempotencyv1.BatchCall {
		calls := make([]*idempotencyv1.BatchCall, 20)
		for i := range calls {
			calls[i] = batchBegin("build", key)
		}
		return calls
	}
	if acq, inProg := count(batch(t, ctx(t), e.client, same("one-batch")...)); acq != 1 || inProg != 19 {
		t.Fatalf("20 Begins of one key in a batch: %d acquired, %d in progress", acq, inProg)
	}

	var mu sync.Mutex
	var all []*idempotencyv1.BatchResult
	var wg sync.WaitGroup
	for range 5 {
		wg.Go(func() {
			resp, err := e.client.Batch(ctx(t), &idempotencyv1.BatchRequest{Calls: same("five-batches")})
			if err != nil {
				t.Errorf("Batch: %v", err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			all = append(all, resp.GetResults()...)
		})
	}
	wg.Wait()
	if acq, inProg := count(all); acq != 1 || inProg != 99 {
		t.Fatalf("100 Begins of one key in 5 concurrent batches: %d acquired, %d in progress", acq, inProg)
	}
}

// A call's timeout ends that call alone: a Begin of a key that a RunTx
// transaction holds ends DEADLINE_EXCEEDED and leaves no acquisition,
// while Begins of other keys in the batch acquire.
func TestBatchCallTimeoutEndsItAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{realClock: true})
	_, rollBack := holdNewKey(t, e.dbURL, ledger.Identity{Scope: "build", Key: "held"})

	held := batchBegin("build", "held")
	held.Timeout = durationpb.New(time.Millisecond)
	bctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	res := batch(t, bctx, e.client, batchBegin("build", "free-1"), held, batchBegin("build", "free-2"))
	elapsed := time.Since(start)
	wantCode(t, resultErr(res[1]), codes.DeadlineExceeded, "")
	if res[0].GetBegin().GetOutcome() != acquired || res[2].GetBegin().GetOutcome() != acquired {
		t.Fatalf("calls beside the timed-out one: %v", res)
	}
	if elapsed > 3*time.Second {
		t.Fatalf("batch took %v: the timed-out call held it", elapsed)
	}
	rollBack()
	// The timed-out Begin must not run once the row is free.
	time.Sleep(200 * time.Millisecond) // give a Begin that outlived its call the time to write (it must not)
	if _, err := e.lookup("build", "held"); status.Code(err) != codes.NotFound {
		t.Fatalf("Lookup of the held key after the RunTx rolled back: %v; want NOT_FOUND (no acquisition left)", err)
	}
	if n := e.rowCount(); n != 2 {
		t.Fatalf("rows = %d, want 2", n)
	}
}

// Each call takes a token of its tenant's rate limit, the Batch RPC none:
// with a burst of 5, a batch of 8 has exactly 3 calls refused as unary
// calls over the limit are.
func TestBatchCallsTakeRateLimitTokens(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: "rate_limit: { requests_per_second: 0.001, burst: 5 }\n"})
	calls := make([]*idempotencyv1.BatchCall, 8)
	for i := range calls {
		calls[i] = batchBegin("build", fmt.Sprint(i))
	}
	var limited int
	for _, r := range batch(t, ctx(t), e.client, calls...) {
		if err := resultErr(r); err != nil {
			st := wantCode(t, err, codes.ResourceExhausted, "")
			if !strings.Contains(st.Message(), "/idempotency.v1.Coordinator/Begin is rejected by grpc_ratelimit middleware") {
				t.Fatalf("limited call's message %q, want the unary call's", st.Message())
			}
			limited++
		}
	}
	if limited != 3 {
		t.Fatalf("%d of 8 calls limited with a burst of 5, want 3", limited)
	}
	_, err := e.begin("build", "unary")
	wantCode(t, err, codes.ResourceExhausted, "")
}

// A batch is authenticated as a whole, and each call's scope is checked
// against the tenant's as its unary call's would be.
func TestBatchAuth(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: authConfig()})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	e := &testEnv{t: t, coord: c, dbURL: c.DatabaseURL, client: client}
	_, err := client.Batch(ctx(t), &idempotencyv1.BatchRequest{Calls: []*idempotencyv1.BatchCall{batchBegin("build", "k")}})
	wantCode(t, err, codes.Unauthenticated, "")
	_, err = client.Batch(withToken("wrong"), &idempotencyv1.BatchRequest{Calls: []*idempotencyv1.BatchCall{batchBegin("build", "k")}})
	wantCode(t, err, codes.Unauthenticated, "")
	if n := e.rowCount(); n != 0 {
		t.Fatalf("rows = %d after unauthenticated batches", n)
	}

	// Tenant builds may use scope build only.
	res := batch(t, withToken("build-secret"), client, batchBegin("build", "k"), batchBegin("/payments.v1.Payments/Charge", "k"),
		batchLookup("deploy", "k"))
	if res[0].GetBegin().GetOutcome() != acquired {
		t.Fatalf("call of an allowed scope: %v", res[0])
	}
	wantCode(t, resultErr(res[1]), codes.PermissionDenied, "")
	wantCode(t, resultErr(res[2]), codes.PermissionDenied, "")
	if n := e.rowCount(); n != 1 {
		t.Fatalf("rows = %d, want 1", n)
	}
	// The record is tenant builds' own.
	if _, err := client.Lookup(withToken("pay-secret"), &idempotencyv1.LookupRequest{Scope: "build", Key: "k"}); status.Code(err) != codes.NotFound {
		t.Fatalf("another tenant's Lookup: %v", err)
	}
}

// A failed call is logged on its own line, with its method, tenant, scope
// and code; a successful one under the slow-call threshold is not logged at
// info. The threshold is one no call reaches: on a busy machine (CI, Citus)
// a first Begin can take longer than the default 250 ms.
func TestBatchLogsFailedCalls(t *testing.T) {
	t.Parallel()
	logs, withLogs := capturedLogs(slog.LevelInfo)
	c := coordtest.Start(t, coordtest.Options{ServerOptions: []server.Option{withLogs, server.WithSlowCallThreshold(time.Hour)}})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	batch(t, ctx(t), client, batchBegin("build", "fine"), batchLookup("deploy", "absent"))
	lines := callLines(t, logs.String())
	var lookup map[string]any
	for _, l := range lines {
		if l["grpc.method"] == "Begin" {
			t.Fatalf("a fast successful call was logged: %v", l)
		}
		if l["grpc.method"] == "Lookup" {
			lookup = l
		}
	}
	if lookup == nil || lookup["grpc.service"] != "idempotency.v1.Coordinator" || lookup["tenant"] != "default" ||
		lookup["scope"] != "deploy" || lookup["grpc.code"] != "NotFound" || lookup["batch.call"] != float64(1) {
		t.Fatalf("failed call's line = %v, in %s", lookup, logs.String())
	}
}

// A batch works over the HTTP/JSON listener, with the same authentication
// as the other methods.
func TestHTTPBatch(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: authConfig()})
	api := newHTTPAPI(t, c)
	body := `{"calls":[{"begin":{"scope":"build","key":"h"}},{"lookup":{"scope":"deploy","key":"h"}},{"begin":{"scope":"build","key":""}}]}`
	api.post("idempotency.v1.Coordinator/Batch", body).wantError(t, http.StatusUnauthorized, "unauthenticated", "")
	r := api.post("idempotency.v1.Coordinator/Batch", body, "Authorization: Bearer build-secret")
	if r.status != http.StatusOK {
		t.Fatalf("Batch: HTTP %d %s", r.status, r.body)
	}
	results, _ := r.json(t)["results"].([]any)
	if len(results) != 3 {
		t.Fatalf("Batch: %s", r.body)
	}
	begin, _ := results[0].(map[string]any)["begin"].(map[string]any)
	denied, _ := results[1].(map[string]any)["error"].(map[string]any)
	invalid, _ := results[2].(map[string]any)["error"].(map[string]any)
	if begin["outcome"] != "OUTCOME_ACQUIRED" || denied["code"] != float64(codes.PermissionDenied) ||
		invalid["code"] != float64(codes.InvalidArgument) || !strings.Contains(string(r.body), "google.rpc.BadRequest") {
		t.Fatalf("Batch results: %s", r.body)
	}
}

// The gRPC metrics count the Batch RPC, not its calls; the domain metrics
// count every call as its unary call.
func TestBatchMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: "scopes:\n  - { match: s }\n"})
	res := batch(t, ctx(t), e.client, batchBegin("s", "k"), batchBegin("s", "k"), batchBegin("s", "other"), batchBegin("s", ""))
	wantCode(t, resultErr(res[3]), codes.InvalidArgument, "")
	rec := httptest.NewRecorder()
	e.coord.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	text := rec.Body.String()
	for _, line := range []string{
		`idempotency_begin_total{outcome="acquired",scope="s"} 2`,
		`idempotency_begin_total{outcome="in_progress",scope="s"} 1`,
		`grpc_server_handled_total{grpc_code="OK",grpc_method="Batch",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 1`,
		`grpc_server_handled_total{grpc_code="OK",grpc_method="Begin",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 0`,
	} {
		if !strings.Contains(text, "\n"+line+"\n") {
			t.Errorf("/metrics lacks %s", line)
		}
	}
}

// A Batch's answer stays receivable: calls that change nothing (Lookups,
// replays) whose answers would take it past 3 MiB are answered
// RESOURCE_EXHAUSTED instead, while the acquisition in the same batch gets
// its answer and lease token. Before, six 1 MB replays in a batch with a
// Begin of a new key made an answer of 6 MB that a client with gRPC's
// default 4 MiB receive limit refused whole, after the acquisition had
// committed: the key stayed held by a token nobody had.
func TestBatchAnswerBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	big := &idempotencyv1.StoredResponse{Body: []byte(strings.Repeat("x", 1_000_000))}
	b := e.mustBegin("s", "big", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if _, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "big", LeaseToken: b.GetLeaseToken(), Response: big}); err != nil {
		t.Fatal(err)
	}
	calls := []*idempotencyv1.BatchCall{batchBegin("s", "new")}
	for range 3 {
		calls = append(calls, batchLookup("s", "big"), batchBegin("s", "big"))
	}
	results := batch(t, ctx(t), e.client, calls...) // fails if the answer is too large to receive
	if r := results[0].GetBegin(); r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || r.GetLeaseToken() == "" {
		t.Fatalf("the Begin of a new key answered %v, want ACQUIRED with its token", results[0])
	}
	answered, refused := 0, 0
	for i, r := range results[1:] {
		switch st := status.FromProto(r.GetError()); {
		case r.GetError() == nil:
			answered++
			if len(r.GetLookup().GetRecord().GetResponse().GetBody())+len(r.GetBegin().GetRecord().GetResponse().GetBody()) != len(big.GetBody()) {
				t.Fatalf("call %d answered without the stored response: %v", i+1, r)
			}
		case st.Code() == codes.ResourceExhausted && strings.Contains(st.Message(), "make it alone"):
			refused++
		default:
			t.Fatalf("call %d answered %v, want its answer or RESOURCE_EXHAUSTED", i+1, st.Err())
		}
	}
	if answered == 0 || refused == 0 || answered > 3 {
		t.Fatalf("%d of 6 big answers sent and %d refused; want at most 3 MB of them sent and the rest refused", answered, refused)
	}
}
