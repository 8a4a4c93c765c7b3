package server_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

const (
	stUnknown    = idempotencyv1.State_STATE_UNKNOWN
	stCompleted  = idempotencyv1.State_STATE_COMPLETED
	stRetryable  = idempotencyv1.State_STATE_FAILED_RETRYABLE
	stInProgress = idempotencyv1.State_STATE_IN_PROGRESS
	asCompleted  = idempotencyv1.Resolution_RESOLUTION_COMPLETED
	asRetryable  = idempotencyv1.Resolution_RESOLUTION_RETRYABLE
)

func (e *testEnv) admin() idempotencyv1.AdminClient {
	return idempotencyv1.NewAdminClient(e.coord.Dial(e.t))
}

// listKeys follows every page of req and returns "scope key state" rows.
func listKeys(t *testing.T, admin idempotencyv1.AdminClient, req *idempotencyv1.ListRecordsRequest) []string {
	t.Helper()
	return listKeysAs(t, ctx(t), admin, req)
}

// listKeysAs is listKeys with the caller's context (and credentials).
func listKeysAs(t *testing.T, callCtx context.Context, admin idempotencyv1.AdminClient, req *idempotencyv1.ListRecordsRequest) []string {
	t.Helper()
	req = proto.Clone(req).(*idempotencyv1.ListRecordsRequest)
	var out []string
	for range 100 {
		resp, err := admin.ListRecords(callCtx, req)
		if err != nil {
			t.Fatalf("ListRecords(%v): %v", req, err)
		}
		if req.GetPageSize() > 0 && len(resp.GetRecords()) > int(req.GetPageSize()) {
			t.Fatalf("page of %d records for page_size %d", len(resp.GetRecords()), req.GetPageSize())
		}
		for _, r := range resp.GetRecords() {
			if r.GetResponse() != nil {
				t.Errorf("%s %s listed with a response", r.GetScope(), r.GetKey())
			}
			out = append(out, fmt.Sprintf("%s %s %s", r.GetScope(), r.GetKey(), strings.TrimPrefix(r.GetState().String(), "STATE_")))
		}
		if resp.GetNextPageToken() == "" {
			return out
		}
		req.PageToken = resp.GetNextPageToken()
	}
	t.Fatal("more than 100 pages")
	return nil
}

// TestAdminResolveCompleted is the operator's story: a holder dies, its
// lease runs out, ListRecords finds the key UNKNOWN, the operator resolves
// it as completed, and later Begins replay the operator's response.
func TestAdminResolveCompleted(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	admin := e.admin()
	b := e.mustBegin("charge", "k1", acquired, withLease(5*time.Second), withTTL(2*time.Hour), withFingerprint("fp"))
	e.mustBegin("charge", "live", acquired, withLease(time.Hour))
	e.clock.Advance(6 * time.Second)

	if got, want := listKeys(t, admin, &idempotencyv1.ListRecordsRequest{State: stUnknown}), []string{"charge k1 UNKNOWN"}; !slices.Equal(got, want) {
		t.Fatalf("UNKNOWN records: %q, want %q", got, want)
	}
	resp := sampleResponse()
	r, err := admin.Resolve(ctx(t), &idempotencyv1.ResolveRequest{Scope: "charge", Key: "k1", Resolution: asCompleted, Response: resp})
	if err != nil {
		t.Fatal(err)
	}
	rec := r.GetRecord()
	if rec.GetState() != stCompleted || !proto.Equal(rec.GetResponse(), resp) ||
		!rec.GetExpiresAt().AsTime().Equal(e.clock.Now().Add(2*time.Hour)) || rec.GetLeaseExpiresAt() != nil {
		t.Fatalf("resolved record: %v (now %v)", rec, e.clock.Now())
	}
	again := e.mustBegin("charge", "k1", replay, withFingerprint("fp"))
	if !proto.Equal(again.GetRecord().GetResponse(), resp) {
		t.Fatalf("replayed %v, want %v", again.GetRecord().GetResponse(), resp)
	}
	// The dead holder's token no longer works; a second Resolve is refused.
	_, err = e.complete("charge", "k1", b.GetLeaseToken(), nil)
	wantCode(t, err, codes.FailedPrecondition, "LEASE_LOST")
	_, err = admin.Resolve(ctx(t), &idempotencyv1.ResolveRequest{Scope: "charge", Key: "k1", Resolution: asRetryable})
	st := wantCode(t, err, codes.FailedPrecondition, "NOT_UNKNOWN")
	if !strings.Contains(st.Message(), "COMPLETED") {
		t.Errorf("message %q does not name the state", st.Message())
	}
	// A live holder's record is not UNKNOWN either; a missing one is absent.
	_, err = admin.Resolve(ctx(t), &idempotencyv1.ResolveRequest{Scope: "charge", Key: "live", Resolution: asCompleted})
	wantCode(t, err, codes.FailedPrecondition, "NOT_UNKNOWN")
	_, err = admin.Resolve(ctx(t), &idempotencyv1.ResolveRequest{Scope: "charge", Key: "never", Resolution: asCompleted})
	wantCode(t, err, codes.NotFound, "")
}

// TestAdminResolveRetryable resolves a Fail UNKNOWN as retryable: the next
// Begin acquires the key, and the record kept for failure_ttl meanwhile.
func TestAdminResolveRetryable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: `defaults: { failure_ttl: 10m }`})
	admin := e.admin()
	b := e.mustBegin("build", "k", acquired)
	e.mustFail("build", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, nil)
	r, err := admin.Resolve(ctx(t), &idempotencyv1.ResolveRequest{Scope: "build", Key: "k", Resolution: asRetryable})
	if err != nil {
		t.Fatal(err)
	}
	if rec := r.GetRecord(); rec.GetState() != stRetryable || rec.GetResponse() != nil ||
		!rec.GetExpiresAt().AsTime().Equal(e.clock.Now().Add(10*time.Minute)) || rec.GetFailureReason() == "" {
		t.Fatalf("resolved record: %v", rec)
	}
	next := e.mustBegin("build", "k", acquired)
	if next.GetPreviousState() != stRetryable || next.GetRecord().GetAttempt() != 2 {
		t.Fatalf("Begin after Resolve: %v", next)
	}
}

// TestAdminResolveHeldUnknown: under on_unknown: hold a Begin, even one
// that would wait, answers at once while the record waits for an operator;
// after the operator's Resolve it replays.
func TestAdminResolveHeldUnknown(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: `defaults: { on_unknown: hold }`})
	b := e.mustBegin("pay", "k", acquired)
	e.mustFail("pay", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, nil)
	r := e.mustBegin("pay", "k", inProgress, withWait(30*time.Second))
	if r.GetRecord().GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("held record: %v", r)
	}
	if _, err := e.admin().Resolve(ctx(t), &idempotencyv1.ResolveRequest{Scope: "pay", Key: "k", Resolution: asCompleted,
		Response: sampleResponse()}); err != nil {
		t.Fatal(err)
	}
	if r := e.mustBegin("pay", "k", replay); !proto.Equal(r.GetRecord().GetResponse(), sampleResponse()) {
		t.Fatalf("after Resolve: %v", r)
	}
}

// TestAdminListRecords pages through records in (scope, key) order with
// filters on the state in effect now and on the scope.
func TestAdminListRecords(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	admin := e.admin()
	done := func(scope, key string) {
		b := e.mustBegin(scope, key, acquired)
		e.mustComplete(scope, key, b.GetLeaseToken(), sampleResponse())
	}
	done("/payments.v1.Payments/Charge", "a")
	done("/payments.v1.Payments/Refund", "b")
	e.mustBegin("/payments.v1.Payments/Charge", "c", acquired, withLease(time.Second))
	e.mustBegin("build", "d", acquired, withLease(time.Hour))
	done("build", "e")
	e.mustBegin("build_x", "f", acquired, withLease(time.Second))
	e.clock.Advance(2 * time.Second)

	all := []string{
		"/payments.v1.Payments/Charge a COMPLETED", "/payments.v1.Payments/Charge c UNKNOWN",
		"/payments.v1.Payments/Refund b COMPLETED", "build d IN_PROGRESS", "build e COMPLETED", "build_x f UNKNOWN",
	}
	for _, size := range []int32{0, 1, 4, 1000} {
		if got := listKeys(t, admin, &idempotencyv1.ListRecordsRequest{PageSize: size}); !slices.Equal(got, all) {
			t.Fatalf("page_size %d:\n got  %q\n want %q", size, got, all)
		}
	}
	for _, c := range []struct {
		req  *idempotencyv1.ListRecordsRequest
		want []string
	}{
		{&idempotencyv1.ListRecordsRequest{ScopeGlob: "/payments.v1.Payments/*", PageSize: 1},
			[]string{"/payments.v1.Payments/Charge a COMPLETED", "/payments.v1.Payments/Charge c UNKNOWN", "/payments.v1.Payments/Refund b COMPLETED"}},
		{&idempotencyv1.ListRecordsRequest{State: stUnknown, PageSize: 1},
			[]string{"/payments.v1.Payments/Charge c UNKNOWN", "build_x f UNKNOWN"}},
		{&idempotencyv1.ListRecordsRequest{State: stUnknown, ScopeGlob: "build*"}, []string{"build_x f UNKNOWN"}},
		{&idempotencyv1.ListRecordsRequest{State: stInProgress}, []string{"build d IN_PROGRESS"}},
		{&idempotencyv1.ListRecordsRequest{ScopeGlob: "build"}, []string{"build d IN_PROGRESS", "build e COMPLETED"}},
		{&idempotencyv1.ListRecordsRequest{State: idempotencyv1.State_STATE_EXPIRED}, nil},
		{&idempotencyv1.ListRecordsRequest{KeyPrefix: "c", PageSize: 1}, []string{"/payments.v1.Payments/Charge c UNKNOWN"}},
		{&idempotencyv1.ListRecordsRequest{KeyPrefix: "e", ScopeGlob: "build*", State: stCompleted}, []string{"build e COMPLETED"}},
		{&idempotencyv1.ListRecordsRequest{KeyPrefix: "*"}, nil},
	} {
		if got := listKeys(t, admin, c.req); !slices.Equal(got, c.want) {
			t.Errorf("%v:\n got  %q\n want %q", c.req, got, c.want)
		}
	}

	// A page token only continues the listing it came from.
	first, err := admin.ListRecords(ctx(t), &idempotencyv1.ListRecordsRequest{PageSize: 2, State: stCompleted})
	if err != nil || first.GetNextPageToken() == "" {
		t.Fatalf("first page: %v %v", first, err)
	}
	for _, req := range []*idempotencyv1.ListRecordsRequest{
		{PageToken: first.GetNextPageToken()},
		{PageToken: first.GetNextPageToken(), State: stCompleted, ScopeGlob: "build"},
		{PageToken: "not a token"},
		{PageToken: first.GetNextPageToken()[:len(first.GetNextPageToken())-3], State: stCompleted},
		{PageToken: first.GetNextPageToken(), State: stCompleted, KeyPrefix: "a"},
		{KeyPrefix: "bad\x00prefix"},
		{KeyPrefix: strings.Repeat("k", 256)},
	} {
		_, err := admin.ListRecords(ctx(t), req)
		wantCode(t, err, codes.InvalidArgument, "")
	}
}

// TestAdminListUncertain: ListRecords with uncertain lists the records that
// need an operator's decision: UNKNOWN ones (a lapsed lease included) and
// uncertain FAILED_RETRYABLE ones, never a COMPLETED one or a plain
// FAILED_RETRYABLE one; it combines with state and pages with its own
// tokens.
func TestAdminListUncertain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	admin := e.admin()
	fail := func(key string, kind idempotencyv1.FailureKind) {
		b := e.mustBegin("s", key, acquired)
		e.mustFail("s", key, b.GetLeaseToken(), kind, nil)
	}
	fail("failed-unknown", idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN)
	fail("uncertain-retryable", idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN)
	fail("uncertain-retryable", idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE) // takes over, then fails
	fail("retryable", idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE)
	b := e.mustBegin("s", "completed", acquired)
	e.mustComplete("s", "completed", b.GetLeaseToken(), sampleResponse())
	e.mustBegin("s", "lapsed", acquired, withLease(time.Second))
	e.mustBegin("s", "held", acquired, withLease(time.Hour))
	e.clock.Advance(2 * time.Second)
	if rec := e.mustLookup("s", "uncertain-retryable"); rec.GetState() != stRetryable || !rec.GetUncertain() {
		t.Fatalf("uncertain-retryable: %v", rec)
	}

	want := []string{"s failed-unknown UNKNOWN", "s lapsed UNKNOWN", "s uncertain-retryable FAILED_RETRYABLE"}
	for _, size := range []int32{0, 1, 2} {
		if got := listKeys(t, admin, &idempotencyv1.ListRecordsRequest{Uncertain: true, PageSize: size}); !slices.Equal(got, want) {
			t.Fatalf("uncertain, page_size %d:\n got  %q\n want %q", size, got, want)
		}
	}
	if got := listKeys(t, admin, &idempotencyv1.ListRecordsRequest{Uncertain: true, State: stRetryable}); !slices.Equal(got, want[2:]) {
		t.Errorf("uncertain FAILED_RETRYABLE: %q", got)
	}
	if got := listKeys(t, admin, &idempotencyv1.ListRecordsRequest{Uncertain: true, State: stUnknown, PageSize: 1}); !slices.Equal(got, want[:2]) {
		t.Errorf("uncertain UNKNOWN: %q", got)
	}
	// A page token of the uncertain list continues only that list.
	first, err := admin.ListRecords(ctx(t), &idempotencyv1.ListRecordsRequest{Uncertain: true, PageSize: 1})
	if err != nil || first.GetNextPageToken() == "" {
		t.Fatalf("first page: %v %v", first, err)
	}
	_, err = admin.ListRecords(ctx(t), &idempotencyv1.ListRecordsRequest{PageToken: first.GetNextPageToken()})
	wantCode(t, err, codes.InvalidArgument, "")
}

// TestAdminCountRecords counts the caller's records by scope and state in
// effect now; another tenant's records are not counted.
func TestAdminCountRecords(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	admin := e.admin()
	b := e.mustBegin("/p.v1.P/Charge", "a", acquired)
	e.mustComplete("/p.v1.P/Charge", "a", b.GetLeaseToken(), sampleResponse())
	e.mustBegin("/p.v1.P/Charge", "b", acquired, withLease(time.Second))
	e.mustBegin("/p.v1.P/Charge", "c", acquired, withLease(time.Second))
	e.mustBegin("build", "d", acquired, withLease(time.Hour))
	e.clock.Advance(2 * time.Second)
	resp, err := admin.CountRecords(ctx(t), &idempotencyv1.CountRecordsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range resp.GetCounts() {
		got = append(got, fmt.Sprintf("%s %s %d", c.GetScope(), c.GetState(), c.GetCount()))
	}
	want := []string{"/p.v1.P/Charge STATE_COMPLETED 1", "/p.v1.P/Charge STATE_UNKNOWN 2", "build STATE_IN_PROGRESS 1"}
	if !slices.Equal(got, want) || resp.GetTruncated() {
		t.Fatalf("counts %q (truncated %v), want %q", got, resp.GetTruncated(), want)
	}
	resp, err = admin.CountRecords(ctx(t), &idempotencyv1.CountRecordsRequest{MaxGroups: 1})
	if err != nil || len(resp.GetCounts()) != 1 || !resp.GetTruncated() {
		t.Fatalf("max_groups 1: %v %v", resp, err)
	}
	_, err = admin.CountRecords(ctx(t), &idempotencyv1.CountRecordsRequest{MaxGroups: 1001})
	wantCode(t, err, codes.InvalidArgument, "")

	// GetRecord reads a record with its response.
	g, err := admin.GetRecord(ctx(t), &idempotencyv1.GetRecordRequest{Scope: "/p.v1.P/Charge", Key: "a"})
	if err != nil || g.GetRecord().GetState() != stCompleted || !proto.Equal(g.GetRecord().GetResponse(), sampleResponse()) {
		t.Fatalf("GetRecord: %v %v", g, err)
	}
	_, err = admin.GetRecord(ctx(t), &idempotencyv1.GetRecordRequest{Scope: "/p.v1.P/Charge", Key: "nope"})
	wantCode(t, err, codes.NotFound, "")
	_, err = admin.GetRecord(ctx(t), &idempotencyv1.GetRecordRequest{Scope: "/p.v1.P/Charge"})
	wantCode(t, err, codes.InvalidArgument, "")
}

func TestAdminForget(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	admin := e.admin()
	b := e.mustBegin("s", "k", acquired)
	e.mustComplete("s", "k", b.GetLeaseToken(), sampleResponse())
	r, err := admin.Forget(ctx(t), &idempotencyv1.ForgetRequest{Scope: "s", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetRecord().GetState() != stCompleted || !proto.Equal(r.GetRecord().GetResponse(), sampleResponse()) {
		t.Fatalf("forgotten record: %v", r.GetRecord())
	}
	_, err = e.lookup("s", "k")
	wantCode(t, err, codes.NotFound, "")
	_, err = admin.Forget(ctx(t), &idempotencyv1.ForgetRequest{Scope: "s", Key: "k"})
	wantCode(t, err, codes.NotFound, "")
	if n := e.rowCount(); n != 0 {
		t.Fatalf("%d rows left", n)
	}
	if a := e.mustBegin("s", "k", acquired); a.GetPreviousState() != idempotencyv1.State_STATE_UNSPECIFIED || a.GetRecord().GetAttempt() != 1 {
		t.Fatalf("Begin after Forget: %v", a)
	}
	// An IN_PROGRESS record is forgotten too; its holder then finds nothing.
	held := e.mustBegin("s", "held", acquired)
	if _, err := admin.Forget(ctx(t), &idempotencyv1.ForgetRequest{Scope: "s", Key: "held"}); err != nil {
		t.Fatal(err)
	}
	_, err = e.complete("s", "held", held.GetLeaseToken(), nil)
	wantCode(t, err, codes.NotFound, "")
}

// TestAdminValidation: bad input is INVALID_ARGUMENT and writes nothing.
func TestAdminValidation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: `limits: { max_response_bytes: 100 }`})
	admin := e.admin()
	b := e.mustBegin("s", "k", acquired)
	e.mustFail("s", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, nil)
	long := strings.Repeat("x", 256)
	for name, req := range map[string]*idempotencyv1.ResolveRequest{
		"no resolution":          {Scope: "s", Key: "k"},
		"undefined resolution":   {Scope: "s", Key: "k", Resolution: 7},
		"retryable with a body":  {Scope: "s", Key: "k", Resolution: asRetryable, Response: sampleResponse()},
		"no scope":               {Key: "k", Resolution: asCompleted},
		"no key":                 {Scope: "s", Resolution: asCompleted},
		"scope too long":         {Scope: long, Key: "k", Resolution: asCompleted},
		"key with a control":     {Scope: "s", Key: "k\n", Resolution: asCompleted},
		"schema_version control": {Scope: "s", Key: "k", Resolution: asCompleted, Response: &idempotencyv1.StoredResponse{SchemaVersion: "v\x01"}},
	} {
		_, err := admin.Resolve(ctx(t), req)
		if err == nil {
			t.Fatalf("%s: accepted", name)
		}
		wantCode(t, err, codes.InvalidArgument, "")
	}
	_, err := admin.Resolve(ctx(t), &idempotencyv1.ResolveRequest{Scope: "s", Key: "k", Resolution: asCompleted,
		Response: &idempotencyv1.StoredResponse{Body: make([]byte, 200)}})
	wantCode(t, err, codes.InvalidArgument, "RESPONSE_TOO_LARGE")
	for name, req := range map[string]*idempotencyv1.ForgetRequest{
		"no scope": {Key: "k"}, "no key": {Scope: "s"}, "key too long": {Scope: "s", Key: long},
	} {
		_, err := admin.Forget(ctx(t), req)
		if err == nil {
			t.Fatalf("Forget %s: accepted", name)
		}
		wantCode(t, err, codes.InvalidArgument, "")
	}
	for name, req := range map[string]*idempotencyv1.ListRecordsRequest{
		"page_size too large": {PageSize: 1001},
		"negative page_size":  {PageSize: -1},
		"undefined state":     {State: 42},
		"glob with a control": {ScopeGlob: "a\tb"},
		"glob too long":       {ScopeGlob: strings.Repeat("*", 1025)},
		"uncertain completed": {Uncertain: true, State: stCompleted},
		"uncertain archived":  {Uncertain: true, Archived: true},
	} {
		_, err := admin.ListRecords(ctx(t), req)
		if err == nil {
			t.Fatalf("ListRecords %s: accepted", name)
		}
		wantCode(t, err, codes.InvalidArgument, "")
	}
	if rec := e.mustLookup("s", "k"); rec.GetState() != stUnknown {
		t.Fatalf("bad input changed the record: %v", rec)
	}
}

// TestAdminTenants: with auth on, only admin tenants may call Admin, and
// they act within their own tenant.
func TestAdminTenants(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{FakeClock: true, Config: fmt.Sprintf(`
tenants:
  - { name: ops,      token_sha256: %s, scopes: ["*"], admin: true }
  - { name: payments, token_sha256: %s, scopes: ["*"] }
`, sha("ops-secret"), sha("pay-secret"))})
	conn := c.Dial(t)
	coord, admin := idempotencyv1.NewCoordinatorClient(conn), idempotencyv1.NewAdminClient(conn)
	ops, pay := withToken("ops-secret"), withToken("pay-secret")
	call := func(ctx context.Context) []error {
		_, e1 := admin.ListRecords(ctx, &idempotencyv1.ListRecordsRequest{})
		_, e2 := admin.Resolve(ctx, &idempotencyv1.ResolveRequest{Scope: "s", Key: "k", Resolution: asCompleted})
		_, e3 := admin.Forget(ctx, &idempotencyv1.ForgetRequest{Scope: "s", Key: "k"})
		_, e4 := admin.CountRecords(ctx, &idempotencyv1.CountRecordsRequest{})
		_, e5 := admin.GetRecord(ctx, &idempotencyv1.GetRecordRequest{Scope: "s", Key: "k"})
		return []error{e1, e2, e3, e4, e5}
	}
	if _, err := coord.Begin(pay, &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Lease: durationpb.New(time.Second)}); err != nil {
		t.Fatal(err)
	}
	c.Clock.Advance(2 * time.Second)
	for _, err := range call(pay) {
		wantCode(t, err, codes.PermissionDenied, "")
	}
	for _, err := range call(context.Background()) {
		wantCode(t, err, codes.Unauthenticated, "")
	}
	// The admin tenant acts within its own tenant: payments' UNKNOWN record
	// is absent to it, and stays as it was.
	if got := listKeysAs(t, ops, admin, &idempotencyv1.ListRecordsRequest{}); got != nil {
		t.Fatalf("ops lists %q", got)
	}
	errs := call(ops)
	wantCode(t, errs[1], codes.NotFound, "")
	wantCode(t, errs[2], codes.NotFound, "")
	wantCode(t, errs[4], codes.NotFound, "")
	if r, err := coord.Lookup(pay, &idempotencyv1.LookupRequest{Scope: "s", Key: "k"}); err != nil || r.GetRecord().GetState() != stUnknown {
		t.Fatalf("payments' record after ops' calls: %v %v", r, err)
	}
	if _, err := coord.Begin(ops, &idempotencyv1.BeginRequest{Scope: "s", Key: "mine"}); err != nil {
		t.Fatal(err)
	}
	if got, want := listKeysAs(t, ops, admin, &idempotencyv1.ListRecordsRequest{}), []string{"s mine IN_PROGRESS"}; !slices.Equal(got, want) {
		t.Fatalf("ops lists %q, want %q", got, want)
	}
	if r, err := admin.CountRecords(ops, &idempotencyv1.CountRecordsRequest{}); err != nil || len(r.GetCounts()) != 1 || r.GetCounts()[0].GetCount() != 1 {
		t.Fatalf("ops counts %v %v, want only its own record", r, err)
	}
}
