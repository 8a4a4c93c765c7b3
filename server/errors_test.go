package server_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

func TestRefusalsCarryReasons(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: `
scopes:
  - { match: "limited", max_attempts: 2 }
  - { match: "strict",  ttl: 1m, on_expired: reject }
`})
	// FINGERPRINT_MISMATCH in every state but EXPIRED, changing nothing.
	b := e.mustBegin("s", "k", acquired, withFingerprint("a"))
	_, err := e.begin("s", "k", withFingerprint("b"))
	wantCode(t, err, codes.FailedPrecondition, "FINGERPRINT_MISMATCH")
	e.mustComplete("s", "k", b.GetLeaseToken(), sampleResponse())
	_, err = e.begin("s", "k", withFingerprint("b"))
	wantCode(t, err, codes.FailedPrecondition, "FINGERPRINT_MISMATCH")
	e.mustBegin("s", "k", replay, withFingerprint("a"))

	// SCHEMA_VERSION_NOT_ACCEPTED leaves the record as it was.
	_, err = e.begin("s", "k", func(r *idempotencyv1.BeginRequest) { r.AcceptSchemaVersions = []string{"payments.v1.ChargeResponse/4"} })
	wantCode(t, err, codes.FailedPrecondition, "SCHEMA_VERSION_NOT_ACCEPTED")
	e.mustBegin("s", "k", replay, func(r *idempotencyv1.BeginRequest) {
		r.AcceptSchemaVersions = []string{"payments.v1.ChargeResponse/4", "payments.v1.ChargeResponse/3"}
	})

	// ATTEMPTS_EXHAUSTED once max_attempts attempts failed.
	for i := range 2 {
		b := e.mustBegin("limited", "k", acquired)
		if b.GetRecord().GetAttempt() != int32(i+1) {
			t.Fatalf("attempt = %d", b.GetRecord().GetAttempt())
		}
		e.mustFail("limited", "k", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil)
	}
	_, err = e.begin("limited", "k")
	wantCode(t, err, codes.FailedPrecondition, "ATTEMPTS_EXHAUSTED")

	// KEY_EXPIRED under on_expired: reject.
	b = e.mustBegin("strict", "k", acquired)
	e.mustComplete("strict", "k", b.GetLeaseToken(), nil)
	e.clock.Advance(time.Minute)
	_, err = e.begin("strict", "k")
	wantCode(t, err, codes.FailedPrecondition, "KEY_EXPIRED")

	// NOT_FOUND.
	_, err = e.lookup("s", "never-used")
	wantCode(t, err, codes.NotFound, "")
	_, err = e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "never-used", LeaseToken: "x"})
	wantCode(t, err, codes.NotFound, "")
}

func TestUnknownHeldUnderHoldPolicy(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: `
scopes:
  - { match: "/payments.v1.Payments/*", on_unknown: hold }
limits: { max_wait: 1h }
`})
	const scope = "/payments.v1.Payments/Charge"
	b := e.mustBegin(scope, "k", acquired, withLease(time.Second))
	e.clock.Advance(2 * time.Second)
	r := e.mustBegin(scope, "k", inProgress)
	if r.GetRecord().GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("held record reads %v", r.GetRecord().GetState())
	}
	e.mustBegin(scope, "k", inProgress)
	// A wait does not wait for an operator: with an hour's wait allowed and
	// asked for, the answer (the held UNKNOWN record) still comes at once;
	// two minutes is a margin no slow machine needs, an hour is what a
	// waiting server would take.
	answered := make(chan *idempotencyv1.BeginResponse, 1)
	go func() {
		wctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
		defer cancel()
		r, err := e.client.Begin(wctx, &idempotencyv1.BeginRequest{Scope: scope, Key: "k", Wait: durationpb.New(time.Hour)})
		if err != nil {
			t.Error(err)
		}
		answered <- r
	}()
	select {
	case r := <-answered:
		if r.GetOutcome() != inProgress || r.GetRecord().GetState() != idempotencyv1.State_STATE_UNKNOWN {
			t.Fatalf("Begin with wait on a held UNKNOWN: %v, record %v", r.GetOutcome(), r.GetRecord().GetState())
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("Begin with wait on a held UNKNOWN waited for an operator")
	}
	// The holder may still finish it.
	e.mustComplete(scope, "k", b.GetLeaseToken(), sampleResponse())
	e.mustBegin(scope, "k", replay)
}

func TestInvalidArgumentsWriteNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	long := strings.Repeat("k", 256)
	dur := durationpb.New
	type call struct {
		name  string
		field string
		do    func() error
	}
	begin := func(mod func(*idempotencyv1.BeginRequest)) func() error {
		return func() error {
			req := &idempotencyv1.BeginRequest{Scope: "s", Key: "k"}
			mod(req)
			_, err := e.client.Begin(ctx(t), req)
			return err
		}
	}
	calls := []call{
		{"empty key", "key", begin(func(r *idempotencyv1.BeginRequest) { r.Key = "" })},
		{"empty scope", "scope", begin(func(r *idempotencyv1.BeginRequest) { r.Scope = "" })},
		{"256-byte key", "key", begin(func(r *idempotencyv1.BeginRequest) { r.Key = long })},
		{"256-byte scope", "scope", begin(func(r *idempotencyv1.BeginRequest) { r.Scope = long })},
		{"key with newline", "key", begin(func(r *idempotencyv1.BeginRequest) { r.Key = "a\nb" })},
		{"key with NUL", "key", begin(func(r *idempotencyv1.BeginRequest) { r.Key = "a\x00b" })},
		{"scope with DEL", "scope", begin(func(r *idempotencyv1.BeginRequest) { r.Scope = "a\x7fb" })},
		{"key with C1 control", "key", begin(func(r *idempotencyv1.BeginRequest) { r.Key = "a\u0085b" })},
		{"65-byte fingerprint", "fingerprint", begin(func(r *idempotencyv1.BeginRequest) { r.Fingerprint = make([]byte, 65) })},
		{"zero ttl", "ttl", begin(func(r *idempotencyv1.BeginRequest) { r.Ttl = dur(0) })},
		{"negative ttl", "ttl", begin(func(r *idempotencyv1.BeginRequest) { r.Ttl = dur(-time.Second) })},
		{"ttl over max_ttl", "ttl", begin(func(r *idempotencyv1.BeginRequest) { r.Ttl = dur(721 * time.Hour) })},
		{"lease under 1s", "lease", begin(func(r *idempotencyv1.BeginRequest) { r.Lease = dur(999 * time.Millisecond) })},
		{"lease over 1h", "lease", begin(func(r *idempotencyv1.BeginRequest) { r.Lease = dur(time.Hour + time.Second) })},
		{"wait over 30s", "wait", begin(func(r *idempotencyv1.BeginRequest) { r.Wait = dur(31 * time.Second) })},
		{"negative wait", "wait", begin(func(r *idempotencyv1.BeginRequest) { r.Wait = dur(-time.Second) })},
		{"malformed duration", "lease", begin(func(r *idempotencyv1.BeginRequest) {
			r.Lease = &durationpb.Duration{Seconds: 5, Nanos: -1}
		})},
		{"65-byte attempt_id", "attempt_id", begin(func(r *idempotencyv1.BeginRequest) { r.AttemptId = strings.Repeat("a", 65) })},
		{"attempt_id with control character", "attempt_id", begin(func(r *idempotencyv1.BeginRequest) { r.AttemptId = "a\tb" })},
		{"schema_version with NUL", "response.schema_version", func() error {
			_, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: "t",
				Response: &idempotencyv1.StoredResponse{SchemaVersion: "v\x00"}})
			return err
		}},
		{"reason with NUL", "reason", func() error {
			_, err := e.client.Fail(ctx(t), &idempotencyv1.FailRequest{Scope: "s", Key: "k", LeaseToken: "t",
				Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Reason: "a\x00b"})
			return err
		}},
		{"complete without token", "lease_token", func() error {
			_, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k"})
			return err
		}},
		{"complete with over-large response", "response", func() error {
			_, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: "t",
				Response: &idempotencyv1.StoredResponse{Body: make([]byte, 1<<20)}})
			return err
		}},
		{"fail without kind", "kind", func() error {
			_, err := e.client.Fail(ctx(t), &idempotencyv1.FailRequest{Scope: "s", Key: "k", LeaseToken: "t"})
			return err
		}},
		{"fail with undefined kind", "kind", func() error {
			_, err := e.client.Fail(ctx(t), &idempotencyv1.FailRequest{Scope: "s", Key: "k", LeaseToken: "t", Kind: 99})
			return err
		}},
		{"replayable fail without response", "response", func() error {
			_, err := e.client.Fail(ctx(t), &idempotencyv1.FailRequest{Scope: "s", Key: "k", LeaseToken: "t",
				Kind: idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE})
			return err
		}},
		{"over-long reason", "reason", func() error {
			_, err := e.client.Fail(ctx(t), &idempotencyv1.FailRequest{Scope: "s", Key: "k", LeaseToken: "t",
				Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Reason: strings.Repeat("r", 1025)})
			return err
		}},
		{"lookup without key", "key", func() error {
			_, err := e.client.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "s"})
			return err
		}},
		{"heartbeat with short lease", "lease", func() error {
			_, err := e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k", LeaseToken: "t", Lease: dur(time.Millisecond)})
			return err
		}},
		{"129-byte token", "lease_token", func() error {
			_, err := e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k", LeaseToken: strings.Repeat("t", 129)})
			return err
		}},
	}
	for _, c := range calls {
		st := wantCode(t, c.do(), codes.InvalidArgument, "")
		var fields []string
		for _, d := range st.Details() {
			if br, ok := d.(*errdetails.BadRequest); ok {
				for _, v := range br.GetFieldViolations() {
					fields = append(fields, v.GetField())
				}
			}
		}
		found := false
		for _, f := range fields {
			found = found || f == c.field
		}
		if !found {
			t.Errorf("%s: violations on %v, want one on %q (%v)", c.name, fields, c.field, st.Message())
		}
	}
	_, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: "t",
		Response: &idempotencyv1.StoredResponse{Body: make([]byte, 1<<20)}})
	wantCode(t, err, codes.InvalidArgument, "RESPONSE_TOO_LARGE")
	if n := e.rowCount(); n != 0 {
		t.Fatalf("rejected calls wrote %d records", n)
	}
	// Exactly at the limits is fine.
	e.mustBegin(strings.Repeat("s", 255), strings.Repeat("k", 255), acquired, withFingerprint(strings.Repeat("f", 64)),
		withLease(time.Hour), withTTL(720*time.Hour))
}

func TestConcurrentBeginsOneWinner(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	const n = 200
	var wg sync.WaitGroup
	outcomes := make(chan idempotencyv1.Outcome, n)
	errs := make(chan error, n)
	start := make(chan struct{})
	for range n {
		wg.Go(func() {
			<-start
			r, err := e.begin("race", "one-key")
			if err != nil {
				errs <- err
				return
			}
			outcomes <- r.GetOutcome()
		})
	}
	close(start)
	wg.Wait()
	close(outcomes)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	counts := map[idempotencyv1.Outcome]int{}
	for o := range outcomes {
		counts[o]++
	}
	if counts[acquired] != 1 || counts[inProgress] != n-1 {
		t.Fatalf("outcomes = %v, want exactly one ACQUIRED", counts)
	}
}

func TestRestartKeepsCompletedRecords(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	want := map[string]*idempotencyv1.StoredResponse{}
	for i := range 20 {
		key := "k" + strings.Repeat("x", i)
		b := e.mustBegin("s", key, acquired)
		resp := sampleResponse()
		resp.Body = append(resp.Body, byte(i))
		e.mustComplete("s", key, b.GetLeaseToken(), resp)
		want[key] = resp
	}
	e.coord.Restart()
	for key, resp := range want {
		r := e.mustBegin("s", key, replay)
		if got := r.GetRecord().GetResponse(); !bytes.Equal(got.GetBody(), resp.GetBody()) {
			t.Fatalf("%s after restart: %v", key, got)
		}
	}
}

// TestConcurrentPairsAndRepeats: 32 callers each run pairs of new keys
// (Begin, a repeated Begin while held, Complete, a replay) at once, so that
// Begins, Completes and repeats share coalesced rounds: every pair ends
// COMPLETED with its own body, every repeat while held is IN_PROGRESS,
// every replay returns the body, and nothing else is written. It is one of
// the contract tests run again through PgBouncer in transaction pooling.
func TestConcurrentPairsAndRepeats(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	const callers, pairs = 32, 12
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for c := range callers {
		wg.Go(func() {
			for p := range pairs {
				key := fmt.Sprintf("pair-%d-%d", c, p)
				b, err := e.begin("pairs", key)
				if err != nil || b.GetOutcome() != acquired {
					errs <- fmt.Errorf("Begin %s: %v %v", key, b.GetOutcome(), err)
					return
				}
				if r, err := e.begin("pairs", key); err != nil || r.GetOutcome() != inProgress {
					errs <- fmt.Errorf("repeated Begin of held %s: %v %v, want IN_PROGRESS", key, r.GetOutcome(), err)
					return
				}
				body := []byte("body of " + key)
				if _, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "pairs", Key: key, LeaseToken: b.GetLeaseToken(),
					Response: &idempotencyv1.StoredResponse{Body: body}}); err != nil {
					errs <- fmt.Errorf("Complete %s: %v", key, err)
					return
				}
				r, err := e.begin("pairs", key)
				if err != nil || r.GetOutcome() != replay || !bytes.Equal(r.GetRecord().GetResponse().GetBody(), body) {
					errs <- fmt.Errorf("replay of %s: %v %q %v", key, r.GetOutcome(), r.GetRecord().GetResponse().GetBody(), err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := e.rowCount(); n != callers*pairs {
		t.Fatalf("%d records, want %d", n, callers*pairs)
	}
}
