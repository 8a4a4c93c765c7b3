package chaos

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// TestRefModel checks the checker: hand-written histories of one key that a
// correct coordinator could produce pass the reference model, and histories
// with a lost write, a double acquisition, a replay of the wrong body, a
// reaper that deletes a live record, or a checkpoint lost, stale, leaked
// into a new generation, recorded by a fenced token or abandoned fail, each
// with a visualization written.
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
	refused := func(reason string) refAnswer { return refAnswer{err: reason} }
	ok := refAnswer{}

	// Checkpoints.
	checkpoint := func(tok, phase, data string, nows []time.Time) refCall {
		c := newCall(rkHeartbeat, nows)
		c.token, c.lease, c.hasCk, c.ckPhase, c.ckData = tok, time.Second, true, phase, data
		return c
	}
	fail := func(tok string, kind int) refCall {
		c := newCall(rkFail, at(0))
		c.token, c.failKind = tok, kind
		return c
	}
	ck := func(phase, data string, d time.Duration) refCheckpoint {
		return refCheckpoint{set: true, phase: phase, data: data, at: us(d)}
	}
	// with returns the answer a with the record's checkpoint c.
	with := func(a refAnswer, c refCheckpoint) refAnswer {
		v := *a.rec
		v.ck = c
		a.rec = &v
		return a
	}
	heldBy := func(attempt int32, since time.Duration, c refCheckpoint) *refView {
		return &refView{state: rsInProgress, attempt: attempt, gen: 1, lease: us(since + time.Second), ck: c}
	}
	// recorded is the answer of a Heartbeat at since that recorded c.
	recorded := func(attempt int32, since time.Duration, c refCheckpoint) refAnswer {
		return refAnswer{rec: heldBy(attempt, since, c)}
	}
	retryable := func(attempt int32, c refCheckpoint) *refView {
		return &refView{state: rsFailedRetryable, attempt: attempt, gen: 1, expires: us(3 * time.Second), ck: c}
	}
	takenFrom := func(prev int, tok string, attempt int32, since time.Duration, c refCheckpoint) refAnswer {
		return refAnswer{outcome: roAcquired, token: tok, prev: prev, rec: heldBy(attempt, since, c)}
	}
	// A checkpoint out of bounds.
	tooLong := checkpoint("T1", strings.Repeat("p", 129), "1", at(0))
	tooLong.ckBad = true
	// The key after its first generation expired.
	afterTTL := time.Hour + time.Second
	expiredRec := refAnswer{rec: &refView{state: rsExpired, attempt: 1, gen: 1, expires: us(time.Hour)}}
	restarted := refAnswer{outcome: roAcquired, token: "T2", prev: rsExpired,
		rec: &refView{state: rsInProgress, attempt: 1, gen: 2, lease: us(afterTTL + time.Second)}}
	c1, c2 := ck("charge", "1", time.Second/2), ck("provision", "2", time.Second/2+time.Second/5)
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
		{"a checkpoint outlives a lapsed lease, goes to the takeover, and the old token is fenced", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: begin("b", at(3*time.Second)), out: takenFrom(rsUnknown, "T2", 2, 3*time.Second, c1)},
			call{in: checkpoint("T1", "receipt", "9", at(3*time.Second)), out: refused("LEASE_LOST")},
			call{in: lookup(at(3 * time.Second)), out: refAnswer{rec: heldBy(2, 3*time.Second, c1)}},
		)},
		{"the holder records a checkpoint after its lease lapsed, before a takeover", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(2*time.Second)), out: recorded(1, 2*time.Second, ck("charge", "1", 2*time.Second))},
			call{in: begin("b", at(2*time.Second)), out: refAnswer{outcome: roInProgress, rec: heldBy(1, 2*time.Second, ck("charge", "1", 2*time.Second))}},
		)},
		{"the latest checkpoint wins", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: checkpoint("T1", "provision", "2", at(time.Second/2+time.Second/5)), out: recorded(1, time.Second/2+time.Second/5, c2)},
			call{in: begin("b", at(3*time.Second)), out: takenFrom(rsUnknown, "T2", 2, 3*time.Second, c2)},
		)},
		{"a checkpoint outlives Fail RETRYABLE; a later attempt that recorded none abandons, keeping it", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: fail("T1", rfRetryable), out: refAnswer{rec: retryable(1, c1)}},
			call{in: begin("b", at(0)), out: takenFrom(rsFailedRetryable, "T2", 2, 0, c1)},
			call{in: fail("T2", rfAbandoned), out: refAnswer{rec: retryable(1, c1)}},
			call{in: begin("c", at(0)), out: takenFrom(rsFailedRetryable, "T3", 2, 0, c1)},
		)},
		{"a checkpoint outlives Fail UNKNOWN", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: fail("T1", rfUnknown), out: refAnswer{rec: &refView{state: rsUnknown, attempt: 1, gen: 1, ck: c1}}},
			call{in: begin("b", at(0)), out: takenFrom(rsUnknown, "T2", 2, 0, c1)},
		)},
		{"Fail ABANDONED after the attempt's own checkpoint is refused and changes nothing", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: fail("T1", rfAbandoned), out: refused("CHECKPOINT_RECORDED")},
			call{in: lookup(at(time.Second / 2)), out: refAnswer{rec: heldBy(1, time.Second/2, c1)}},
			call{in: complete("T1", "x"), out: with(refAnswer{rec: done("x")}, c1)},
			call{in: checkpoint("T1", "receipt", "3", at(0)), out: refused("ALREADY_FINISHED")},
			call{in: begin("b", at(0)), out: with(replayed("x"), c1)},
		)},
		{"a replay, an IN_PROGRESS answer and Complete's answer may leave the checkpoint out", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: begin("b", at(time.Second/2)), out: refAnswer{outcome: roInProgress, rec: heldBy(1, time.Second/2, refCheckpoint{})}},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: begin("c", at(0)), out: replayed("x")},
			call{in: lookup(at(0)), out: with(refAnswer{rec: done("x")}, c1)},
		)},
		{"a completed record's checkpoint expires with it, and a new generation starts without one", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: complete("T1", "x"), out: with(refAnswer{rec: done("x")}, c1)},
			call{in: lookup(at(afterTTL)), out: expiredRec},
			call{in: begin("b", at(afterTTL)), out: restarted},
		)},
		{"a checkpoint out of bounds is refused and writes nothing", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: tooLong, out: refused("INVALID_ARGUMENT")},
			call{in: lookup(at(0)), out: refAnswer{rec: held(0)}},
		)},
		{"an unanswered checkpoint may land", true, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: unknown, call: 11, ret: 100},
			call{in: lookup(at(time.Second / 2)), out: refAnswer{rec: heldBy(1, time.Second/2, c1)}, call: 20, ret: 30},
		)},
		{"the takeover loses the checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: begin("b", at(3*time.Second)), out: takeover("T2", 3*time.Second)},
		)},
		{"the takeover gets an older checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: checkpoint("T1", "provision", "2", at(time.Second/2+time.Second/5)), out: recorded(1, time.Second/2+time.Second/5, c2)},
			call{in: begin("b", at(3*time.Second)), out: takenFrom(rsUnknown, "T2", 2, 3*time.Second, c1)},
		)},
		{"the takeover gets other data", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: begin("b", at(3*time.Second)), out: takenFrom(rsUnknown, "T2", 2, 3*time.Second, ck("charge", "2", time.Second/2))},
		)},
		{"Fail RETRYABLE drops the checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: fail("T1", rfRetryable), out: refAnswer{rec: retryable(1, c1)}},
			call{in: begin("b", at(0)), out: takenFrom(rsFailedRetryable, "T2", 2, 0, refCheckpoint{})},
		)},
		{"a checkpoint's time is not when the coordinator recorded it", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, ck("charge", "1", 0))},
		)},
		{"Fail ABANDONED accepted after the attempt's own checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: fail("T1", rfAbandoned), out: ok},
		)},
		{"a refused Fail ABANDONED deleted the record", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: fail("T1", rfAbandoned), out: refused("CHECKPOINT_RECORDED")},
			call{in: lookup(at(time.Second / 2)), out: notFound},
		)},
		{"Fail ABANDONED of a later attempt that recorded none is refused", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: fail("T1", rfRetryable), out: refAnswer{rec: retryable(1, c1)}},
			call{in: begin("b", at(0)), out: takenFrom(rsFailedRetryable, "T2", 2, 0, c1)},
			call{in: fail("T2", rfAbandoned), out: refused("CHECKPOINT_RECORDED")},
		)},
		{"Fail ABANDONED of a later attempt drops the earlier checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: fail("T1", rfRetryable), out: refAnswer{rec: retryable(1, c1)}},
			call{in: begin("b", at(0)), out: takenFrom(rsFailedRetryable, "T2", 2, 0, c1)},
			call{in: fail("T2", rfAbandoned), out: refAnswer{rec: retryable(1, refCheckpoint{})}},
		)},
		{"a fenced token records a checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: begin("b", at(3*time.Second)), out: takeover("T2", 3*time.Second)},
			call{in: checkpoint("T1", "charge", "1", at(3*time.Second)), out: recorded(2, 3*time.Second, ck("charge", "1", 3*time.Second))},
		)},
		{"a fenced checkpoint answered LEASE_LOST is written anyway", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: begin("b", at(3*time.Second)), out: takeover("T2", 3*time.Second)},
			call{in: checkpoint("T1", "charge", "1", at(3*time.Second)), out: refused("LEASE_LOST")},
			call{in: lookup(at(3 * time.Second)), out: refAnswer{rec: heldBy(2, 3*time.Second, ck("charge", "1", 3*time.Second))}},
		)},
		{"a checkpoint after Complete is accepted", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: checkpoint("T1", "charge", "1", at(0)), out: with(refAnswer{rec: done("x")}, ck("charge", "1", 0))},
		)},
		{"a replay with another checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: complete("T1", "x"), out: with(refAnswer{rec: done("x")}, c1)},
			call{in: begin("b", at(0)), out: with(replayed("x"), c2)},
		)},
		{"a Lookup of a completed record without its checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: complete("T1", "x"), out: refAnswer{rec: done("x")}},
			call{in: lookup(at(0)), out: refAnswer{rec: done("x")}},
		)},
		{"an expired record still shows its checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: complete("T1", "x"), out: with(refAnswer{rec: done("x")}, c1)},
			call{in: lookup(at(afterTTL)), out: with(expiredRec, c1)},
		)},
		{"a new generation inherits the old generation's checkpoint", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: checkpoint("T1", "charge", "1", at(time.Second/2)), out: recorded(1, time.Second/2, c1)},
			call{in: complete("T1", "x"), out: with(refAnswer{rec: done("x")}, c1)},
			call{in: begin("b", at(afterTTL)), out: with(restarted, c1)},
		)},
		{"a checkpoint out of bounds is accepted", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: tooLong, out: recorded(1, 0, ck(tooLong.ckPhase, "1", 0))},
		)},
		{"a checkpoint out of bounds is refused but written", false, seq(
			call{in: begin("a", at(0)), out: acquired("T1", 0)},
			call{in: tooLong, out: refused("INVALID_ARGUMENT")},
			call{in: lookup(at(0)), out: refAnswer{rec: heldBy(1, 0, ck(tooLong.ckPhase, "1", 0))}},
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
			// The history fails at its last call, the wrong answer:
			// without it, it passes.
			if res := porcupine.CheckOperations(refModel(), tc.ops[:len(tc.ops)-1]); !res {
				t.Errorf("%s: fails before its last call", tc.name)
			}
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
