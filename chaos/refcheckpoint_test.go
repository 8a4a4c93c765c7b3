package chaos

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// TestCheckpointInAnswers walks keys through the answers that carry a
// record while the generation has a checkpoint, with no fault, and checks
// them as the reference model of TestLinearizableReference does: Heartbeat,
// Lookup (of the held and of the completed key), Fail RETRYABLE and the
// Begin that takes over carry it (phase, data and the coordinator's time
// of it); a Begin that does not acquire (the held key's, a replay twice, the
// second perhaps from the replay cache, an UNKNOWN key held under
// on_unknown: hold), Complete and Forget carry it or none, never another.
// Each wrong answer is its own error, so a failure names the paths.
func TestCheckpointInAnswers(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{FakeClock: true, Config: refConfig})
	conn := dial(t, c.Addr)
	client, admin := idempotencyv1.NewCoordinatorClient(conn), idempotencyv1.NewAdminClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	// carries checks that rec, answered by answer, carries the
	// generation's last checkpoint want (at: the coordinator's time).
	carries := func(answer string, rec *idempotencyv1.Record, want *idempotencyv1.Checkpoint) {
		t.Helper()
		if got := rec.GetCheckpoint(); !proto.Equal(got, want) {
			t.Errorf("%s: record (%v) carries checkpoint %v, want the generation's last one %v", answer, rec.GetState(), got, want)
		}
	}
	// mayOmit checks that rec carries want or no checkpoint.
	mayOmit := func(answer string, rec *idempotencyv1.Record, want *idempotencyv1.Checkpoint) {
		t.Helper()
		if got := rec.GetCheckpoint(); got != nil && !proto.Equal(got, want) {
			t.Errorf("%s: record (%v) carries checkpoint %v, want none or the generation's last one %v", answer, rec.GetState(), got, want)
		}
	}
	begin := func(scope, key, aid string) *idempotencyv1.BeginResponse {
		t.Helper()
		r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: scope, Key: key, AttemptId: aid,
			Lease: durationpb.New(5 * time.Second), Ttl: durationpb.New(time.Hour)})
		must("Begin "+scope+"/"+key, err)
		return r
	}
	// record records a checkpoint with token and returns the one the
	// answers must carry from now on.
	record := func(scope, key, token, phase, data string) *idempotencyv1.Checkpoint {
		t.Helper()
		at := c.Clock.Now()
		r, err := client.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: scope, Key: key, LeaseToken: token,
			Lease: durationpb.New(5 * time.Second), Checkpoint: &idempotencyv1.Checkpoint{Phase: phase, Data: []byte(data)}})
		must("Heartbeat "+scope+"/"+key, err)
		want := &idempotencyv1.Checkpoint{Phase: phase, Data: []byte(data), At: timestamppb.New(at)}
		carries("Heartbeat "+scope+"/"+key, r.GetRecord(), want)
		return want
	}

	// A key held, completed, replayed and forgotten.
	a := begin("free", "done", "a1")
	ck := record("free", "done", a.GetLeaseToken(), "charge", "1")
	c.Clock.Advance(time.Second)
	r := begin("free", "done", "a2")
	if r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS {
		t.Fatalf("Begin of a held key answered %v", r.GetOutcome())
	}
	mayOmit("Begin of the held key (OUTCOME_IN_PROGRESS)", r.GetRecord(), ck)
	l, err := client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: "free", Key: "done"})
	must("Lookup", err)
	carries("Lookup of the held key", l.GetRecord(), ck)
	cr, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "free", Key: "done", LeaseToken: a.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("x")}})
	must("Complete", err)
	mayOmit("Complete", cr.GetRecord(), ck)
	for i, aid := range []string{"a3", "a4"} {
		r := begin("free", "done", aid)
		if r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY {
			t.Fatalf("Begin of a completed key answered %v", r.GetOutcome())
		}
		mayOmit([]string{"the first replay", "the second replay"}[i], r.GetRecord(), ck)
	}
	l, err = client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: "free", Key: "done"})
	must("Lookup", err)
	carries("Lookup of the completed key", l.GetRecord(), ck)
	f, err := admin.Forget(ctx, &idempotencyv1.ForgetRequest{Scope: "free", Key: "done"})
	must("Forget", err)
	mayOmit("Forget (the record as it was)", f.GetRecord(), ck)

	// A key failed RETRYABLE and taken over.
	a = begin("free", "retried", "b1")
	ck = record("free", "retried", a.GetLeaseToken(), "provision", "2")
	fr, err := client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "free", Key: "retried", LeaseToken: a.GetLeaseToken(),
		Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE})
	must("Fail", err)
	carries("Fail RETRYABLE", fr.GetRecord(), ck)
	r = begin("free", "retried", "b2")
	if r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("Begin of a FAILED_RETRYABLE key answered %v", r.GetOutcome())
	}
	carries("the Begin that takes over from FAILED_RETRYABLE", r.GetRecord(), ck)

	// A key whose lease lapsed, held UNKNOWN (on_unknown: hold).
	a = begin("hold", "lapsed", "c1")
	ck = record("hold", "lapsed", a.GetLeaseToken(), "receipt", "3")
	c.Clock.Advance(6 * time.Second)
	r = begin("hold", "lapsed", "c2")
	if r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS || r.GetRecord().GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("Begin of a lapsed key under on_unknown: hold answered %v %v", r.GetOutcome(), r.GetRecord().GetState())
	}
	mayOmit("Begin of the UNKNOWN key under on_unknown: hold", r.GetRecord(), ck)
}
