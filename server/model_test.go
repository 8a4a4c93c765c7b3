package server_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestModelAgreesWithStateMachine runs random calls on a few keys against
// the server and checks every answer against statemachine.Next applied to a
// model of the records.
func TestModelAgreesWithStateMachine(t *testing.T) {
	t.Parallel()
	for seed := range uint64(4) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			t.Parallel()
			runModel(t, seed, 400)
		})
	}
}

var modelReasons = map[error]string{
	statemachine.ErrFingerprintMismatch:      "FINGERPRINT_MISMATCH",
	statemachine.ErrLeaseLost:                "LEASE_LOST",
	statemachine.ErrAlreadyFinished:          "ALREADY_FINISHED",
	statemachine.ErrAttemptsExhausted:        "ATTEMPTS_EXHAUSTED",
	statemachine.ErrSchemaVersionNotAccepted: "SCHEMA_VERSION_NOT_ACCEPTED",
	statemachine.ErrKeyExpired:               "KEY_EXPIRED",
}

func runModel(t *testing.T, seed uint64, steps int) {
	e := newEnv(t, envOptions{config: `
scopes:
  - { match: "hold", on_unknown: hold, max_attempts: 3, on_expired: reject }
`})
	rng := rand.New(rand.NewPCG(seed, 42))
	pick := func(xs ...string) string { return xs[rng.IntN(len(xs))] }
	model := map[[2]string]*statemachine.Record{}
	tokens := map[[2]string][]string{} // every token each key was given
	policies := map[string]statemachine.Policy{
		"free": {},
		"hold": {OnUnknown: statemachine.UnknownHold, MaxAttempts: 3, OnExpired: statemachine.ExpiredReject},
	}

	for step := range steps {
		scope := pick("free", "hold")
		key := pick("a", "b", "c")
		id := [2]string{scope, key}
		cur := model[id]
		now := e.clock.Now()
		token := func() string {
			ts := tokens[id]
			if len(ts) == 0 || rng.IntN(5) == 0 {
				return "lt1.bogus"
			}
			if rng.IntN(4) == 0 {
				return ts[rng.IntN(len(ts))]
			}
			return ts[len(ts)-1]
		}
		var resp *idempotencyv1.StoredResponse
		if rng.IntN(2) == 0 {
			resp = &idempotencyv1.StoredResponse{Body: []byte(pick("x", "y")), SchemaVersion: pick("v1", "v2")}
		}
		where := fmt.Sprintf("step %d %s/%s (model %+v)", step, scope, key, cur)

		var ev statemachine.Event
		var err error
		var gotRec *idempotencyv1.Record
		var gotOutcome idempotencyv1.Outcome
		var gotToken string
		var gotPrev idempotencyv1.State
		switch op := rng.IntN(7); op {
		case 0, 1: // Begin
			lease := time.Duration(1+rng.IntN(4)) * time.Second
			ttl := time.Duration(2+rng.IntN(10)) * time.Second
			ev = statemachine.Event{Kind: statemachine.EventBegin, Fingerprint: []byte(pick("", "f1", "f2")),
				AttemptID: pick("", "", "p", "q"), TTL: ttl, FailureTTL: min(time.Hour, ttl), Lease: lease}
			if rng.IntN(4) == 0 {
				ev.AcceptSchemaVersions = []string{pick("v1", "v2")}
			}
			var r *idempotencyv1.BeginResponse
			r, err = e.client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: scope, Key: key, Fingerprint: ev.Fingerprint,
				AttemptId: ev.AttemptID, Ttl: durationpb.New(ttl), Lease: durationpb.New(lease), AcceptSchemaVersions: ev.AcceptSchemaVersions})
			gotRec, gotOutcome, gotToken, gotPrev = r.GetRecord(), r.GetOutcome(), r.GetLeaseToken(), r.GetPreviousState()
			ev.NewToken = gotToken
		case 2:
			ev = statemachine.Event{Kind: statemachine.EventComplete, Token: token(), Response: responseOf(resp)}
			var r *idempotencyv1.CompleteResponse
			r, err = e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: scope, Key: key, LeaseToken: ev.Token, Response: resp})
			gotRec = r.GetRecord()
		case 3:
			kind := statemachine.FailureKind(1 + rng.IntN(4))
			if kind == statemachine.FailureReplayable && resp == nil {
				resp = &idempotencyv1.StoredResponse{}
			}
			ev = statemachine.Event{Kind: statemachine.EventFail, Token: token(), FailureKind: kind, Response: responseOf(resp), Reason: pick("", "r")}
			var r *idempotencyv1.FailResponse
			r, err = e.client.Fail(ctx(t), &idempotencyv1.FailRequest{Scope: scope, Key: key, LeaseToken: ev.Token,
				Kind: idempotencyv1.FailureKind(kind), Response: resp, Reason: ev.Reason})
			gotRec = r.GetRecord()
		case 4:
			lease := time.Duration(1+rng.IntN(4)) * time.Second
			ev = statemachine.Event{Kind: statemachine.EventHeartbeat, Token: token(), Lease: lease}
			var r *idempotencyv1.HeartbeatResponse
			r, err = e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: scope, Key: key, LeaseToken: ev.Token, Lease: durationpb.New(lease)})
			gotRec = r.GetRecord()
		case 5: // Lookup
			rec, err := e.lookup(scope, key)
			if cur == nil {
				if status.Code(err) != codes.NotFound {
					t.Fatalf("%s: Lookup of absent record: %v", where, err)
				}
				continue
			}
			if err != nil {
				t.Fatalf("%s: Lookup: %v", where, err)
			}
			compareRecord(t, where+" Lookup", rec, statemachine.Effective(*cur, now))
			continue
		case 6:
			e.clock.Advance(time.Duration(rng.IntN(3000)) * time.Millisecond)
			continue
		}

		d := statemachine.Next(cur, ev, policies[scope], now)
		if d.Err != nil {
			reason := modelReasons[d.Err]
			code := codes.FailedPrecondition
			if errors.Is(d.Err, statemachine.ErrNotFound) {
				code = codes.NotFound
			}
			if status.Code(err) != code || errorReason(err) != reason {
				t.Fatalf("%s: %v: got %v, model says %v", where, ev.Kind, err, d.Err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: event %+v: got %v, model says %+v", where, ev, err, d)
		}
		if ev.Kind == statemachine.EventBegin {
			if gotOutcome != idempotencyv1.Outcome(d.Outcome) {
				t.Fatalf("%s: Begin outcome %v, model %v", where, gotOutcome, d.Outcome)
			}
			if d.Outcome == statemachine.OutcomeAcquired {
				if gotPrev != idempotencyv1.State(d.PreviousState) {
					t.Fatalf("%s: previous_state %v, model %v", where, gotPrev, d.PreviousState)
				}
				if d.Record.LeaseToken != gotToken {
					t.Fatalf("%s: token %q, model %q", where, gotToken, d.Record.LeaseToken)
				}
				if len(tokens[id]) == 0 || tokens[id][len(tokens[id])-1] != gotToken {
					tokens[id] = append(tokens[id], gotToken)
				}
			}
		}
		switch {
		case d.Write == statemachine.WriteDelete:
			delete(model, id)
			if gotRec != nil {
				t.Fatalf("%s: deleted record came back as %v", where, gotRec)
			}
		case d.Exists:
			rec := d.Record
			if d.Write != statemachine.WriteNone {
				model[id] = &rec
			}
			compareRecord(t, where+" "+fmt.Sprint(ev.Kind), gotRec, statemachine.Effective(rec, now))
		}
	}
}

func responseOf(r *idempotencyv1.StoredResponse) *statemachine.Response {
	if r == nil {
		return nil
	}
	return &statemachine.Response{SchemaVersion: r.GetSchemaVersion(), ContentType: r.GetContentType(),
		Body: r.GetBody(), StatusCode: r.GetStatusCode(), Metadata: r.GetMetadata()}
}

func errorReason(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

func compareRecord(t *testing.T, where string, got *idempotencyv1.Record, want statemachine.Record) {
	t.Helper()
	ts := func(tm time.Time) string {
		if tm.IsZero() {
			return "unset"
		}
		return tm.UTC().Format(time.RFC3339Nano)
	}
	gts := func(has bool, tm time.Time) string {
		if !has {
			return "unset"
		}
		return ts(tm)
	}
	g := fmt.Sprintf("state=%v attempt=%d gen=%d fp=%q lease=%s expires=%s reason=%q",
		statemachine.State(got.GetState()), got.GetAttempt(), got.GetGeneration(), got.GetFingerprint(),
		gts(got.GetLeaseExpiresAt() != nil, got.GetLeaseExpiresAt().AsTime()), gts(got.GetExpiresAt() != nil, got.GetExpiresAt().AsTime()), got.GetFailureReason())
	w := fmt.Sprintf("state=%v attempt=%d gen=%d fp=%q lease=%s expires=%s reason=%q",
		want.State, want.Attempt, want.Generation, want.Fingerprint, ts(want.LeaseExpiresAt), ts(want.ExpiresAt), want.FailureReason)
	if g != w {
		t.Fatalf("%s:\n got  %s\n want %s", where, g, w)
	}
	if want.State.Terminal() {
		if !responseOf(got.GetResponse()).Equal(want.Response) {
			t.Fatalf("%s: response %v, want %+v", where, got.GetResponse(), want.Response)
		}
	} else if got.GetResponse() != nil {
		t.Fatalf("%s: %v record carries a response", where, want.State)
	}
}
