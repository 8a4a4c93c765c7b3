package chaos

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idemcoord/idemcoord/statemachine"
)

// TestLinearizabilityModel checks the checker: hand-written histories that
// a correct coordinator could produce pass, and histories with a lost write,
// a double acquisition or a replay of the wrong body fail.
func TestLinearizabilityModel(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	begin := func(id int, aid string) linInput {
		return linInput{id: id, op: opBegin, scope: "free", key: "k", now: now, ev: statemachine.Event{
			Kind: statemachine.EventBegin, AttemptID: aid, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Second}}
	}
	complete := func(id int, tok, body string) linInput {
		return linInput{id: id, op: opComplete, scope: "free", key: "k", now: now, ev: statemachine.Event{
			Kind: statemachine.EventComplete, Token: tok, Response: &statemachine.Response{Body: []byte(body)}}}
	}
	lookup := func(id int) linInput { return linInput{id: id, op: opLookup, scope: "free", key: "k", now: now} }
	// The records a correct coordinator answers.
	held := statemachine.Record{State: statemachine.StateInProgress, Attempt: 1, Generation: 1, CreatedAt: now,
		UpdatedAt: now, LeaseExpiresAt: now.Add(time.Second)}
	done := func(body string) *statemachine.Record {
		r := held
		r.State, r.LeaseExpiresAt, r.ExpiresAt = statemachine.StateCompleted, time.Time{}, now.Add(time.Hour)
		r.Response = &statemachine.Response{Body: []byte(body)}
		return &r
	}
	acquired := func(tok string) linOutput {
		return linOutput{outcome: statemachine.OutcomeAcquired, token: tok, rec: &held}
	}
	replayed := func(body string) linOutput {
		return linOutput{outcome: statemachine.OutcomeReplay, rec: done(body)}
	}
	inProgress := linOutput{outcome: statemachine.OutcomeInProgress, rec: &held}
	unknown := linOutput{unknown: true}
	type call struct {
		in        linInput
		out       linOutput
		call, ret int64
	}
	seq := func(calls ...call) []porcupine.Operation {
		var ops []porcupine.Operation
		for i, c := range calls {
			if c.call == 0 && c.ret == 0 {
				c.call, c.ret = int64(10*i+1), int64(10*i+2)
			}
			ops = append(ops, porcupine.Operation{Input: c.in, Output: c.out, Call: c.call, Return: c.ret})
		}
		return ops
	}

	for _, tc := range []struct {
		name string
		ok   bool
		ops  []porcupine.Operation
	}{
		{"begin complete replay", true, seq(
			call{in: begin(1, "a"), out: acquired("T1")},
			call{in: complete(2, "T1", "x"), out: linOutput{rec: done("x")}},
			call{in: begin(3, "b"), out: replayed("x")},
		)},
		{"unanswered begin may have acquired", true, seq(
			call{in: begin(1, "a"), out: unknown, call: 1, ret: 100},
			call{in: begin(2, "b"), out: inProgress, call: 10, ret: 20},
			call{in: begin(3, "a"), out: acquired("T1"), call: 30, ret: 40},
		)},
		{"unanswered begin may have done nothing", true, seq(
			call{in: begin(1, "a"), out: unknown},
			call{in: begin(2, "b"), out: acquired("T2")},
		)},
		{"unanswered complete may land late", true, seq(
			call{in: begin(1, "a"), out: acquired("T1")},
			call{in: complete(2, "T1", "x"), out: unknown, call: 11, ret: 100},
			call{in: lookup(3), out: linOutput{rec: &held}, call: 20, ret: 30},
			call{in: begin(4, "b"), out: replayed("x"), call: 40, ret: 50},
		)},
		{"two tokens at once", false, seq(
			call{in: begin(1, "a"), out: acquired("T1")},
			call{in: begin(2, "b"), out: acquired("T2")},
		)},
		{"acknowledged complete lost", false, seq(
			call{in: begin(1, "a"), out: acquired("T1")},
			call{in: complete(2, "T1", "x"), out: linOutput{rec: done("x")}},
			call{in: lookup(3), out: linOutput{rec: &held}},
		)},
		{"replay of another body", false, seq(
			call{in: begin(1, "a"), out: acquired("T1")},
			call{in: complete(2, "T1", "x"), out: linOutput{rec: done("x")}},
			call{in: begin(3, "b"), out: replayed("y")},
		)},
		{"retried begin with another token", false, seq(
			call{in: begin(1, "a"), out: acquired("T1")},
			call{in: begin(2, "a"), out: acquired("T2")},
		)},
	} {
		res, info := porcupine.CheckOperationsVerbose(linModel(), tc.ops, 10*time.Second)
		if got := res == porcupine.Ok; got != tc.ok {
			t.Errorf("%s: result %s, want linearizable=%v", tc.name, res, tc.ok)
		}
		if !tc.ok {
			path := filepath.Join(t.TempDir(), "history.html")
			if err := porcupine.VisualizePath(linModel(), info, path); err != nil {
				t.Fatal(err)
			}
			if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
				t.Fatalf("%s: no visualization written: %v", tc.name, err)
			}
		}
	}
}
