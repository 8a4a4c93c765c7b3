package statemachine

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func ckpt(phase, data string, attempt int32) *Checkpoint {
	return &Checkpoint{Phase: phase, Data: []byte(data), At: t0.Add(-30 * time.Second), Attempt: attempt}
}

func withCheckpoint(c *Checkpoint) mod { return func(r *Record) { r.Checkpoint = c } }

func evHeartbeatCheckpoint(token, phase, data string) Event {
	ev := evHeartbeat(token)
	// At and Attempt are the event's to ignore: Next sets them.
	ev.Checkpoint = &Checkpoint{Phase: phase, Data: []byte(data), At: t0.Add(time.Hour), Attempt: 99}
	return ev
}

// TestCheckpointRules plays every event on every state of the table twice:
// on the record without a checkpoint and on the same record with one
// (recorded by an earlier attempt, or by the record's own latest attempt),
// and holds the two decisions to the checkpoint rules. Whatever the
// checkpoint, the decision is the same (outcome, write, error, the record
// but its checkpoint), except that Fail ABANDONED of the attempt that
// recorded it is refused. The checkpoint itself is replaced only by an
// accepted Heartbeat that carries one (as recorded by the holder's
// attempt, now), dropped by a new generation and when the record reads
// EXPIRED, and kept by everything else: takeovers, failures, completion,
// a refusal, a Resolve.
func TestCheckpointRules(t *testing.T) {
	events := []struct {
		name string
		ev   Event
	}{
		{"Begin", evBegin(fpA)},
		{"Begin same attempt", evBegin(fpA, sameAttemptID)},
		{"Heartbeat", evHeartbeat(tokHeld)},
		{"Heartbeat stale", evHeartbeat(tokStale)},
		{"Heartbeat checkpoint", evHeartbeatCheckpoint(tokHeld, "charged", "ch_2")},
		{"Heartbeat checkpoint stale", evHeartbeatCheckpoint(tokStale, "charged", "ch_2")},
		{"Complete", evComplete(tokHeld, respOK())},
		{"Complete stale", evComplete(tokStale, respOK())},
		{"Fail RETRYABLE", evFail(tokHeld, FailureRetryable, nil, "upstream unavailable")},
		{"Fail REPLAYABLE", evFail(tokHeld, FailureReplayable, respNotFound(), "no such card")},
		{"Fail UNKNOWN", evFail(tokHeld, FailureUnknown, nil, "deadline exceeded")},
		{"Fail ABANDONED", evFail(tokHeld, FailureAbandoned, nil, "gave up")},
		{"Fail ABANDONED repeat", evFail(tokHeld, FailureAbandoned, nil, "bad request")},
		{"Fail ABANDONED stale", evFail(tokStale, FailureAbandoned, nil, "gave up")},
		{"Resolve COMPLETED", evResolve(StateCompleted, respOK())},
		{"Resolve FAILED_RETRYABLE", evResolve(StateFailedRetryable, nil)},
	}
	policies := []struct {
		name string
		pol  Policy
	}{{"default", polDefault}, {"reject", polReject}, {"hold", polHold}, {"max_attempts 2", polMax2}}
	refusals := 0
	for _, s := range fixtureStates() {
		for _, owner := range []string{"earlier attempt", "own attempt"} {
			for _, e := range events {
				for _, p := range policies {
					t.Run(s.name+"/"+owner+"/"+e.name+"/"+p.name, func(t *testing.T) {
						plain := s.rec()
						by := plain.Attempt - 1
						if owner == "own attempt" {
							by = plain.Attempt
						}
						cp := ckpt("reserved", "ch_1", by)
						withCP := s.rec(withCheckpoint(cp))
						before := copyRecord(withCP)

						base := Next(plain, e.ev, p.pol, t0)
						got := Next(withCP, e.ev, p.pol, t0)
						checkAlways(t, withCP, e.ev, got)
						if d := diffRecord(*withCP, *before); d != nil {
							t.Errorf("Next changed its input record: %s", strings.Join(d, "; "))
						}

						if owner == "own attempt" && e.ev.Kind == EventFail && e.ev.FailureKind == FailureAbandoned &&
							base.Err == nil && base.Write != WriteNone {
							refusals++
							checkDecision(t, got, refuse(ErrCheckpointRecorded, Effective(*withCP, t0)))
							return
						}

						// The same decision but for the checkpoint.
						wantCP := cp
						switch {
						case !got.Exists || got.Record.State == StateExpired:
							wantCP = nil
						case got.FoundExpired && got.Outcome == OutcomeAcquired:
							wantCP = nil // a new generation
						case e.ev.Checkpoint != nil && got.Err == nil && got.Write == WriteUpdate:
							wantCP = &Checkpoint{Phase: "charged", Data: []byte("ch_2"), At: t0, Attempt: plain.Attempt}
						case e.ev.Kind == EventFail && e.ev.FailureKind == FailureAbandoned && got.Err == nil &&
							got.Record.Attempt < plain.Attempt && got.Record.Attempt == cp.Attempt:
							// An abandoned takeover gave its number back to
							// the recorder's: the checkpoint is nobody's now.
							c := *cp
							c.Attempt = 0
							wantCP = &c
						}
						if !got.Record.Checkpoint.Equal(wantCP) {
							t.Errorf("Checkpoint = %s, want %s", fmtCheckpoint(got.Record.Checkpoint), fmtCheckpoint(wantCP))
						}
						if !errors.Is(base.Err, ErrCheckpointRecorded) && errors.Is(got.Err, ErrCheckpointRecorded) {
							t.Errorf("refused with %v", got.Err)
						}
						got.Record.Checkpoint, base.Record.Checkpoint = nil, nil
						if got.Err != nil && base.Err != nil && got.Err.Error() == base.Err.Error() {
							got.Err = base.Err // the same refusal, not always a sentinel
						}
						checkDecision(t, got, base)
					})
				}
			}
		}
	}
	if refusals == 0 {
		t.Fatal("no row refused an ABANDONED after its own checkpoint")
	}
}

// storyStep returns what plays one event of a story through Next: on
// *rec at *now, failing the test unless the error is want; the record
// written becomes *rec, and *now moves on a second.
func storyStep(t *testing.T, rec **Record, now *time.Time) func(ev Event, want error) Decision {
	return func(ev Event, want error) Decision {
		t.Helper()
		d := Next(*rec, ev, polDefault, *now)
		if !errors.Is(d.Err, want) || (want == nil) != (d.Err == nil) {
			t.Fatalf("%v %v: err %v, want %v", ev.Kind, ev.FailureKind, d.Err, want)
		}
		if d.Err == nil && d.Write != WriteNone {
			r := d.Record
			*rec = &r
		}
		*now = now.Add(time.Second)
		return d
	}
}

// storyBegin is a Begin of fpA by attempt_id att, offering token tok and
// asking for a 10 s lease.
func storyBegin(att, tok string) Event {
	return evBegin(fpA, func(e *Event) { e.AttemptID, e.NewToken, e.Lease = att, tok, 10*time.Second })
}

// TestAbandonedTwiceGivesOneNumberBack: attempts 1 and 2 end UNKNOWN;
// attempt 3 takes over and is abandoned twice, with two reasons (its
// record stays UNKNOWN, so its token may end it again): it gives its
// number back once. Before, the second ABANDONED took attempt 2's too.
func TestAbandonedTwiceGivesOneNumberBack(t *testing.T) {
	now := t0
	var rec *Record
	step, begin := storyStep(t, &rec, &now), storyBegin
	step(begin("a1", "t1"), nil)
	step(evFail("t1", FailureUnknown, nil, "timed out"), nil)
	step(begin("a2", "t2"), nil)
	step(evFail("t2", FailureUnknown, nil, "timed out"), nil)
	step(begin("a3", "t3"), nil)
	for _, reason := range []string{"gave up", "gave up again"} {
		if d := step(evFail("t3", FailureAbandoned, nil, reason), nil); d.Record.State != StateUnknown || d.Record.Attempt != 2 {
			t.Fatalf("ABANDONED (%s) of attempt 3: %v attempt %d, want UNKNOWN, attempt 2", reason, d.Record.State, d.Record.Attempt)
		}
	}
}

// TestCheckpointStory plays a three-step operation through Next: attempt
// 1 records a checkpoint and its lease lapses; attempt 2 takes over and
// finds it, records the next step and fails RETRYABLE; attempt 3 finds
// that one, is abandoned (it recorded nothing, so it may be) and leaves
// the checkpoint; attempt 4 completes. The completed record keeps the last
// checkpoint until it expires; the generation after starts without one.
func TestCheckpointStory(t *testing.T) {
	now := t0
	var rec *Record
	step, begin := storyStep(t, &rec, &now), storyBegin

	d := step(begin("a1", "t1"), nil)
	if d.Record.Checkpoint != nil {
		t.Fatalf("a new key has checkpoint %s", fmtCheckpoint(d.Record.Checkpoint))
	}
	at1 := now
	step(evHeartbeatCheckpoint("t1", "reserved", "r_1"), nil)
	now = now.Add(time.Minute) // attempt 1's lease lapses

	d = step(begin("a2", "t2"), nil)
	want := &Checkpoint{Phase: "reserved", Data: []byte("r_1"), At: at1, Attempt: 1}
	if d.PreviousState != StateUnknown || !d.Record.Checkpoint.Equal(want) {
		t.Fatalf("takeover: previous %v checkpoint %s, want UNKNOWN and %s", d.PreviousState, fmtCheckpoint(d.Record.Checkpoint), fmtCheckpoint(want))
	}
	step(evHeartbeatCheckpoint("t1", "charged", "stale"), ErrLeaseLost) // the vanished holder is fenced
	at2 := now
	step(evHeartbeatCheckpoint("t2", "charged", "ch_2"), nil)
	step(evFail("t2", FailureAbandoned, nil, "gave up"), ErrCheckpointRecorded)
	if rec.State != StateInProgress || rec.LeaseToken != "t2" {
		t.Fatalf("refused ABANDONED changed the record: %v %s", rec.State, rec.LeaseToken)
	}
	step(evFail("t2", FailureRetryable, nil, "upstream unavailable"), nil)

	want = &Checkpoint{Phase: "charged", Data: []byte("ch_2"), At: at2, Attempt: 2}
	d = step(begin("a3", "t3"), nil)
	if !d.Record.Checkpoint.Equal(want) {
		t.Fatalf("after RETRYABLE: checkpoint %s, want %s", fmtCheckpoint(d.Record.Checkpoint), fmtCheckpoint(want))
	}
	d = step(evFail("t3", FailureAbandoned, nil, "gave up"), nil)
	// Attempt 3 gave its number back: the record reads attempt 2 again,
	// and the checkpoint is marked as no live acquisition's.
	want.Attempt = 0
	if d.Record.Attempt != 2 || !d.Record.Checkpoint.Equal(want) {
		t.Fatalf("after ABANDONED: checkpoint %s, want %s", fmtCheckpoint(d.Record.Checkpoint), fmtCheckpoint(want))
	}
	d = step(begin("a4", "t4"), nil)
	if !d.Record.Checkpoint.Equal(want) {
		t.Fatalf("attempt 4: checkpoint %s, want %s", fmtCheckpoint(d.Record.Checkpoint), fmtCheckpoint(want))
	}
	d = step(evComplete("t4", respOK()), nil)
	if d.Record.State != StateCompleted || !d.Record.Checkpoint.Equal(want) {
		t.Fatalf("completed: %v checkpoint %s, want %s", d.Record.State, fmtCheckpoint(d.Record.Checkpoint), fmtCheckpoint(want))
	}
	if r := Effective(*rec, rec.ExpiresAt); r.State != StateExpired || r.Checkpoint != nil {
		t.Fatalf("expired record reads %v with checkpoint %s", r.State, fmtCheckpoint(r.Checkpoint))
	}
	now = rec.ExpiresAt
	d = step(begin("b1", "u1"), nil)
	if d.Record.Generation != 2 || d.Record.Checkpoint != nil {
		t.Fatalf("new generation %d has checkpoint %s", d.Record.Generation, fmtCheckpoint(d.Record.Checkpoint))
	}
}

// TestAbandonedRestartReadsExpiredWithoutCheckpoint: Fail ABANDONED of a
// restart puts the key back EXPIRED, and an EXPIRED record has no
// checkpoint, whatever the abandoned acquisition's record held (found by
// FuzzNext).
func TestAbandonedRestartReadsExpiredWithoutCheckpoint(t *testing.T) {
	held := fxInProgress(gen(2), from(StateExpired), withCheckpoint(ckpt("reserved", "r", 0)))
	d := Next(held, evFail(tokHeld, FailureAbandoned, nil, "gave up"), polDefault, t0)
	if d.Err != nil || d.Record.State != StateExpired || d.Record.Checkpoint != nil {
		t.Fatalf("abandoned restart: %v %v checkpoint %s", d.Err, d.Record.State, fmtCheckpoint(d.Record.Checkpoint))
	}
}

// TestAbandonedTakeoverMayStillAbandon replays what the reference-model
// chaos test found: attempt 1 records a checkpoint and fails UNKNOWN;
// attempt 2 takes over and is abandoned, which gives its number back (the
// record reads attempt 1 again) and leaves the record UNKNOWN with
// attempt 2's token; that token fails UNKNOWN, then ABANDONED. Attempt 2
// never recorded the checkpoint, so its ABANDONED is not refused, even
// though the record's attempt is now the checkpoint's number.
func TestAbandonedTakeoverMayStillAbandon(t *testing.T) {
	now := t0
	var rec *Record
	played, begin := storyStep(t, &rec, &now), storyBegin
	step := func(ev Event) Decision { t.Helper(); return played(ev, nil) }
	step(begin("a1", "t1"))
	step(evHeartbeatCheckpoint("t1", "charged", "ch_1"))
	step(evFail("t1", FailureUnknown, nil, "timed out"))
	step(begin("a2", "t2"))
	d := step(evFail("t2", FailureAbandoned, nil, "gave up"))
	if d.Record.State != StateUnknown || d.Record.Attempt != 1 || d.Record.LeaseToken != "t2" {
		t.Fatalf("abandoned takeover: %v attempt %d token %s, want UNKNOWN, 1, t2", d.Record.State, d.Record.Attempt, d.Record.LeaseToken)
	}
	if c := d.Record.Checkpoint; c == nil || c.Phase != "charged" || c.Attempt == d.Record.Attempt {
		t.Fatalf("abandoned takeover: checkpoint %s, want attempt 1's, marked as no longer the record's attempt", fmtCheckpoint(c))
	}
	step(evFail("t2", FailureUnknown, nil, "not sure"))
	d = step(evFail("t2", FailureAbandoned, nil, "gave up again"))
	if d.Record.State != StateUnknown || d.Record.Checkpoint == nil || d.Record.Checkpoint.Phase != "charged" {
		t.Fatalf("second ABANDONED: %v checkpoint %s, want UNKNOWN keeping the checkpoint", d.Record.State, fmtCheckpoint(d.Record.Checkpoint))
	}
}
