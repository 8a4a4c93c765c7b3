package chaos

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// TestRefModel checks the checker: hand-written histories of one key that a
// correct coordinator could produce pass the reference model, and histories
// with a lost write, a double acquisition, a replay of the wrong body or a
// reaper that deletes a live record fail, each with a visualization
// written.
func TestRefModel(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	at := func(d time.Duration) []time.Time { return []time.Time{now.Add(d)} }
	us := func(d time.Duration) int64 { return now.Add(d).UnixMicro() }
	id := 0
	newCall := func(kind refKind, nows []time.Time) refCall {
		id++
		return refCall{id: id, kind: kind, scope: "free", key: "k", pol: refPolicies["free"], nows: nows}
	}
	begin := func(aid string, nows []time.Time) refCall {
		c := newCall(rkBegin, nows)
		c.attemptID, c.ttl, c.lease = aid, time.Hour, time.Second
		return c
	}
	complete := func(tok, body string) refCall {
		c := newCall(rkComplete, at(0))
		c.token, c.resp, c.hasResp = tok, canonicalResponse("", "", body, 0, nil), true
		return c
	}
	lookup := func(nows []time.Time) refCall { return newCall(rkLookup, nows) }
	reap := func(nows []time.Time) refCall {
		c := newCall(rkReap, nows)
		c.client, c.retention = -1, refRetention
		return c
	}
	// The records a correct coordinator answers.
	held := func(since time.Duration) *refView {
		return &refView{state: rsInProgress, attempt: 1, gen: 1, lease: us(since + time.Second)}
	}
	done := func(body string) *refView {
		return &refView{state: rsCompleted, attempt: 1, gen: 1, expires: us(time.Hour),
			resp: canonicalResponse("", "", body, 0, nil), hasResp: true}
	}
	acquired := func(tok string, since time.Duration) refAnswer {
		return refAnswer{outcome: roAcquired, token: tok, prev: rsNone, rec: held(since)}
	}
	// takeover is the answer of a Begin that takes the key over from a
	// holder whose lease lapsed.
	takeover := func(tok string, since time.Duration) refAnswer {
		return refAnswer{outcome: roAcquired, token: tok, prev: rsUnknown,
			rec: &refView{state: rsInProgress, attempt: 2, gen: 1, lease: us(since + time.Second)}}
	}
	replayed := func(body string) refAnswer { return refAnswer{outcome: roReplay, rec: done(body)} }
	inProgress := refAnswer{outcome: roInProgress, rec: held(0)}
	unknown := refAnswer{unknown: true}
	notFound := refAnswer{err: "NOT_FOUND"}
	ok := refAnswer{}
	type call struct {
		in        refCall
		out       refAnswer
		call, ret int64
	}
	seq := func(calls ...call) []porcupine.Operation {
		var ops []porcupine.Operation
		for i, c := range calls {
			if c.call == 0 && c.ret == 0 {
				c.call, c.ret = int64(10*i+1), int64(10*i+2)
			}
			c.in.start, c.in.end = c.call, c.ret
			ops = append(ops, porcupine.Operation{ClientId: c.in.client + 1, Input: c.in, Output: c.out, Call: c.call, Return: c.ret})
		}
		return ops
	}
	expired := time.Hour + refRetention + time.Second // the record expired and its retention passed

	for _, tc := range []struct {
		name string
		ok   bool
		ops  []porcupine.Operation
	}{
		{"begin complete replay", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: begin("b", at(0)), out: replayed("x")},
		)},
		{"unanswered begin may have acquired", true, seq(
			call{in: begin("a", at(0)), out: unknown, call: 1, ret: 100},
			call{in: begin("b", at(0)), out: inProgress, call: 10, ret: 20},
			call{in: begin("a", at(0)), out: acquired("T1", 0), call: 30, ret: 40},
		)},
		{"unanswered begin may have done nothing", true, seq(
			call{in: begin("a", at(0)), out: unknown},
			call{in: begin("b", at(0)), out: acquired("T2", 0)},
		)},
		{"unanswered complete may land late", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: unknown, call: 11, ret: 100},
			call{in: lookup(at(0)), out: refAnswer{rec: held(0)}, call: 20, ret: 30},
			call{in: begin("b", at(0)), out: replayed("x"), call: 40, ret: 50},
		)},
		{"a lease lapses while a lookup is in flight", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: lookup([]time.Time{now, now.Add(2 * time.Second)}), out: refAnswer{rec: &refView{state: rsUnknown, attempt: 1, gen: 1}}},
		)},
		{"the reaper deletes an expired record, the key starts anew", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: reap(at(expired)), out: ok},
			call{in: lookup(at(expired)), out: notFound},
			call{in: begin("b", at(expired)), out: acquired("T2", expired)},
		)},
		{"a takeover after the lease lapsed", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: begin("b", at(2*time.Second)), out: takeover("T2", 2*time.Second)},
		)},
		{"a forgotten record replays from a cache within 1 s, after the key got a new record too", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: newCall(rkForget, at(0)), out: refAnswer{rec: done("x")}},
			call{in: begin("b", at(0)), out: acquired("T2", 0)},
			call{in: begin("c", at(0)), out: replayed("x")},
		)},
		{"two tokens at once", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: begin("b", at(0)), out: acquired("T2", 0)},
		)},
		{"a takeover before the lease lapsed", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: begin("b", at(time.Second/2)), out: takeover("T2", time.Second/2)},
		)},
		{"acknowledged begin lost", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: lookup(at(0)), out: notFound},
		)},
		{"acknowledged complete lost", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: lookup(at(0)), out: refAnswer{rec: held(0)}},
		)},
		{"replay of another body", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: begin("b", at(0)), out: replayed("y")},
		)},
		{"retried begin with another token", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: begin("a", at(0)), out: acquired("T2", 0)},
		)},
		{"a forgotten record replays more than 1 s after Forget returned", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: newCall(rkForget, at(0)), out: refAnswer{rec: done("x")}, call: 21, ret: 22},
			call{in: begin("b", at(0)), out: acquired("T2", 0), call: 31, ret: 32},
			call{in: begin("c", at(0)), out: replayed("x"), call: 22 + int64(2*time.Second), ret: 23 + int64(2*time.Second)},
		)},
		{"the reaper deletes a record before it expired", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: reap(at(time.Minute)), out: ok},
			call{in: lookup(at(time.Minute)), out: notFound},
		)},
	} {
		res, info := porcupine.CheckOperationsVerbose(refModel(), tc.ops, 10*time.Second)
		if got := res == porcupine.Ok; got != tc.ok {
			t.Errorf("%s: result %s, want linearizable=%v", tc.name, res, tc.ok)
		}
		if !tc.ok {
			path := filepath.Join(t.TempDir(), "history.html")
			if err := porcupine.VisualizePath(refModel(), info, path); err != nil {
				t.Fatal(err)
			}
			if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
				t.Fatalf("%s: no visualization written: %v", tc.name, err)
			}
		}
	}
}
