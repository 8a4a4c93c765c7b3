package statemachine

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"testing"
	"time"
)

// The fields the fuzz input sets, in the order it is read: one selector byte
// each (which picks from a small set of values chosen to collide often, or
// "raw" for bytes read from the input), then raw bytes where chosen. Input
// that runs out reads as zeros, so a seed names only the fields it needs.
const (
	fzNow = iota
	fzHasRecord
	fzState
	fzFingerprint
	fzAttempt
	fzGeneration
	fzLeaseToken
	fzAttemptID
	fzAcquiredFrom
	fzEndedBy
	fzResponse
	fzFailureReason
	fzTTL
	fzFailureTTL
	fzCreatedAt
	fzUpdatedAt
	fzLeaseExpiresAt
	fzExpiresAt
	fzUncertain
	fzEventKind
	fzEventFingerprint
	fzEventAttemptID
	fzAccept
	fzNewToken
	fzEventTTL
	fzEventFailureTTL
	fzLease
	fzToken
	fzFailureKind
	fzEventResponse
	fzReason
	fzOnExpired
	fzOnUnknown
	fzMaxAttempts
	fzResolveAs
	fzCheckpoint
	fzEventCheckpoint
	fzFields
)

// seed builds fuzz input that sets field i to selector v, for each pair
// (i, v); the fields are laid out without raw bytes.
func seed(pairs ...int) []byte {
	b := make([]byte, fzFields)
	for i := 0; i+1 < len(pairs); i += 2 {
		b[pairs[i]] = byte(pairs[i+1])
	}
	return b
}

// Selector values used by the seeds, matching the palettes below.
const (
	selT1, selT2           = 0, 1 // tokens
	selA1, selA2           = 1, 2 // attempt ids
	selFpA, selFpB         = 1, 2
	selTimeNow, selTimeP1h = 1, 5 // times: now, now+1h
	selTimeM1h             = 4    // now-1h
	selResp1               = 2
)

func FuzzNext(f *testing.F) {
	// A new key; Begin.
	f.Add(seed(fzEventKind, int(EventBegin), fzEventFingerprint, selFpA))
	// IN_PROGRESS, lease live, Begin of another attempt and of the holder's.
	f.Add(seed(fzHasRecord, 1, fzState, int(StateInProgress), fzFingerprint, selFpA, fzAttemptID, selA1,
		fzLeaseExpiresAt, selTimeP1h, fzEventKind, int(EventBegin), fzEventAttemptID, selA2))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateInProgress), fzAttemptID, selA1,
		fzLeaseExpiresAt, selTimeNow, fzEventKind, int(EventBegin), fzEventAttemptID, selA1))
	// IN_PROGRESS lapsed under hold.
	f.Add(seed(fzHasRecord, 1, fzState, int(StateInProgress), fzLeaseExpiresAt, selTimeM1h,
		fzEventKind, int(EventBegin), fzOnUnknown, int(UnknownHold)))
	// COMPLETED: replay with accept_schema_versions; a repeated Complete.
	f.Add(seed(fzHasRecord, 1, fzState, int(StateCompleted), fzResponse, selResp1, fzEndedBy, int(EndingCompleted),
		fzExpiresAt, selTimeP1h, fzEventKind, int(EventBegin), fzAccept, 1))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateCompleted), fzResponse, selResp1, fzEndedBy, int(EndingCompleted),
		fzExpiresAt, selTimeP1h, fzEventKind, int(EventComplete), fzToken, selT1, fzEventResponse, selResp1))
	// COMPLETED past expires_at, restart and reject.
	f.Add(seed(fzHasRecord, 1, fzState, int(StateCompleted), fzResponse, selResp1, fzExpiresAt, selTimeNow,
		fzEventKind, int(EventBegin), fzEventFingerprint, selFpB))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateExpired), fzResponse, selResp1,
		fzEventKind, int(EventBegin), fzOnExpired, int(ExpiredReject)))
	// FAILED_RETRYABLE at max_attempts; UNKNOWN taken over.
	f.Add(seed(fzHasRecord, 1, fzState, int(StateFailedRetryable), fzExpiresAt, selTimeP1h,
		fzEventKind, int(EventBegin), fzMaxAttempts, 0))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateUnknown), fzEndedBy, int(EndingUnknown), fzEventKind, int(EventBegin)))
	// Fail ABANDONED, Fail UNKNOWN, Heartbeat, stale token.
	f.Add(seed(fzHasRecord, 1, fzState, int(StateInProgress), fzLeaseExpiresAt, selTimeP1h,
		fzEventKind, int(EventFail), fzFailureKind, int(FailureAbandoned), fzAttempt, 2))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateInProgress), fzLeaseExpiresAt, selTimeM1h,
		fzEventKind, int(EventFail), fzFailureKind, int(FailureUnknown)))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateUnknown), fzEventKind, int(EventHeartbeat)))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateFailedReplayable), fzResponse, selResp1,
		fzEventKind, int(EventFail), fzToken, selT2, fzFailureKind, int(FailureReplayable)))
	// An event of no defined kind on a record.
	f.Add(seed(fzHasRecord, 1, fzState, int(StateCompleted), fzResponse, selResp1, fzEventKind, 0))
	// Resolve: UNKNOWN as COMPLETED, a lapsed lease as FAILED_RETRYABLE, a
	// COMPLETED record refused, an undefined resolution.
	f.Add(seed(fzHasRecord, 1, fzState, int(StateUnknown), fzEndedBy, int(EndingUnknown), fzEventKind, int(EventResolve),
		fzEventResponse, selResp1, fzResolveAs, int(StateCompleted)))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateInProgress), fzLeaseExpiresAt, selTimeM1h,
		fzEventKind, int(EventResolve), fzResolveAs, int(StateFailedRetryable)))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateCompleted), fzResponse, selResp1, fzExpiresAt, selTimeP1h,
		fzEventKind, int(EventResolve), fzResolveAs, int(StateCompleted)))
	f.Add(seed(fzHasRecord, 1, fzState, int(StateUnknown), fzEventKind, int(EventResolve), fzResolveAs, int(StateExpired)))

	f.Fuzz(func(t *testing.T, data []byte) {
		in := fuzzInput{data: data}
		now := in.now()
		hasRecord := in.sel(2) == 1
		rec := in.record(now)
		ev := in.event()
		pol := in.policy()
		ev.ResolveAs = State(in.sel(8))
		switch in.sel(3) { // the record's checkpoint: none, its latest attempt's, an earlier one's
		case 1:
			rec.Checkpoint = &Checkpoint{Phase: "reserved", Data: []byte("r"), At: now.Add(-time.Second), Attempt: rec.Attempt}
		case 2:
			rec.Checkpoint = &Checkpoint{Phase: "reserved", Data: []byte("r"), At: now.Add(-time.Second), Attempt: rec.Attempt - 1}
		}
		if in.sel(2) == 1 {
			ev.Checkpoint = &Checkpoint{Phase: "charged", Data: []byte("c")}
		}
		var cur *Record
		if hasRecord {
			cur = &rec
		}
		checkInvariants(t, cur, ev, pol, now)
	})
}

// checkInvariants runs Next and checks what must hold whatever the input.
// Some invariants assume the stored record is one the store can hold
// (wellFormed): a malformed record may yield a malformed result, but never a
// panic.
func checkInvariants(t *testing.T, cur *Record, ev Event, pol Policy, now time.Time) {
	t.Helper()
	var before *Record
	var eff Record
	if cur != nil {
		before = copyRecord(cur)
		eff = Effective(*cur, now)
		if d := diffRecord(Effective(eff, now), eff); d != nil {
			t.Fatalf("Effective is not idempotent: %v", d)
		}
		if eff.State == StateExpired && eff.Response != nil {
			t.Fatalf("Effective reads EXPIRED with a response")
		}
	}
	good := cur == nil || wellFormed(*cur)

	d := Next(cur, ev, pol, now)

	if cur != nil {
		if diff := diffRecord(*cur, *before); diff != nil {
			t.Fatalf("Next changed its input: %v", diff)
		}
	}
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("cur=%+v\nev=%+v\npol=%+v now=%v\ndecision=%+v\n"+format,
			append([]any{cur, ev, pol, now, d}, args...)...)
	}

	// Refusals write nothing and report the record as it reads.
	if d.Err != nil {
		if d.Write != WriteNone || d.Outcome != OutcomeOK || d.EnteredUnknown || d.RetryAfter != 0 {
			fail("a refusal has a write, an outcome, a retry hint or EnteredUnknown")
		}
		if d.FoundExpired && !(ev.Kind == EventBegin && eff.State == StateExpired) {
			fail("FoundExpired on a record that does not read EXPIRED")
		}
		if cur == nil {
			if d.Exists || diffRecord(d.Record, Record{}) != nil {
				fail("a refusal with no record reports one")
			}
		} else if !d.Exists || diffRecord(d.Record, eff) != nil {
			fail("a refusal does not report the record as it reads")
		}
	}
	if d.Write == WriteNone && d.Err == nil {
		if cur == nil {
			fail("an accepted event on no record writes nothing")
		}
		if !d.Exists || diffRecord(d.Record, eff) != nil {
			fail("a decision without a write does not report the record as it reads: %v", diffRecord(d.Record, eff))
		}
	}

	// Checkpoints: only an accepted Heartbeat that carries one replaces
	// it; a record that reads EXPIRED, and a new generation, have none;
	// the attempt that recorded one is never abandoned.
	if cur != nil && d.Err == nil && d.Exists {
		var want *Checkpoint
		switch {
		case d.Record.State == StateExpired, d.FoundExpired:
		case ev.Kind == EventHeartbeat && ev.Checkpoint != nil && d.Write == WriteUpdate:
			want = &Checkpoint{Phase: "charged", Data: []byte("c"), At: now, Attempt: d.Record.Attempt}
		case ev.Kind == EventFail && ev.FailureKind == FailureAbandoned && eff.Checkpoint != nil &&
			d.Record.Checkpoint != nil && d.Record.Checkpoint.Attempt == 0:
			// An abandoned takeover gave its number back: the checkpoint
			// is kept, marked as no acquisition's that can still act.
			c := *eff.Checkpoint
			c.Attempt = 0
			want = &c
		default:
			want = eff.Checkpoint
		}
		if !d.Record.Checkpoint.Equal(want) {
			fail("checkpoint %s, want %s", fmtCheckpoint(d.Record.Checkpoint), fmtCheckpoint(want))
		}
	}
	if cur != nil && ev.Kind == EventFail && ev.FailureKind == FailureAbandoned && d.Err == nil && d.Write != WriteNone &&
		eff.Checkpoint != nil && eff.Checkpoint.Attempt == eff.Attempt {
		fail("an attempt that recorded a checkpoint was abandoned")
	}
	if cur != nil && ev.Kind == EventFail && ev.FailureKind == FailureAbandoned && d.Err == nil && d.Write == WriteUpdate &&
		d.Record.Checkpoint != nil && d.Record.Checkpoint.Attempt == d.Record.Attempt && d.Record.LeaseToken == ev.Token {
		// The abandoned acquisition's token may still end the record: it
		// must not read as the checkpoint's recorder.
		fail("after ABANDONED the checkpoint reads as recorded by attempt %d, the abandoned token's record", d.Record.Attempt)
	}

	// Which events may do what.
	if ev.Kind != EventBegin && d.Outcome != OutcomeOK {
		fail("outcome %v for a non-Begin event", d.Outcome)
	}
	if cur == nil && ev.Kind >= EventComplete && ev.Kind <= EventHeartbeat && !errors.Is(d.Err, ErrNotFound) {
		fail("a %v on no record is not NOT_FOUND", ev.Kind)
	}
	if cur == nil && ev.Kind == EventBegin && (d.Write != WriteInsert || d.Outcome != OutcomeAcquired) {
		fail("a Begin on no record does not insert")
	}
	if d.Write == WriteInsert && cur != nil {
		fail("insert over an existing record")
	}
	if d.Write == WriteDelete && (ev.Kind != EventFail || ev.FailureKind != FailureAbandoned || d.Exists ||
		diffRecord(d.Record, Record{}) != nil) {
		fail("delete by anything but Fail ABANDONED, or a record after a delete")
	}
	if cur != nil && ev.Kind >= EventComplete && ev.Kind <= EventHeartbeat &&
		(ev.Token == "" || ev.Token != cur.LeaseToken) && !errors.Is(d.Err, ErrLeaseLost) {
		fail("a token other than the latest acquisition's is not LEASE_LOST")
	}
	if cur != nil && ev.Kind == EventBegin && cur.State >= StateInProgress && cur.State <= StateUnknown &&
		eff.State != StateExpired && len(ev.Fingerprint) > 0 && len(eff.Fingerprint) > 0 &&
		!bytes.Equal(ev.Fingerprint, eff.Fingerprint) && !errors.Is(d.Err, ErrFingerprintMismatch) {
		fail("a different fingerprint is not FINGERPRINT_MISMATCH")
	}

	// Answers.
	if d.Outcome == OutcomeInProgress {
		if d.RetryAfter < MinRetryAfter || d.RetryAfter > MaxRetryAfter {
			fail("retry_after %v out of [%v, %v]", d.RetryAfter, MinRetryAfter, MaxRetryAfter)
		}
	} else if d.RetryAfter != 0 {
		fail("retry_after on outcome %v", d.Outcome)
	}
	if d.Outcome == OutcomeAcquired {
		r := d.Record
		if r.State != StateInProgress {
			fail("ACQUIRED with a record in state %v", r.State)
		}
		if good && r.LeaseExpiresAt.IsZero() {
			fail("ACQUIRED without a lease expiry")
		}
		sameAttempt := cur != nil && ev.AttemptID != "" && ev.AttemptID == cur.AttemptID && r.LeaseToken == cur.LeaseToken
		if r.LeaseToken != ev.NewToken && !sameAttempt {
			fail("ACQUIRED with token %q, neither the new one nor the holder's", r.LeaseToken)
		}
	}
	if d.Outcome == OutcomeReplay && (!eff.State.Replayable() || d.Write != WriteNone) {
		fail("REPLAY of a record that reads %v, or with a write", eff.State)
	}
	if d.Record.State == StateExpired && d.Record.Response != nil {
		fail("an EXPIRED answer carries a response")
	}
	if d.FoundExpired && !(ev.Kind == EventBegin && eff.State == StateExpired) {
		fail("FoundExpired on a record that does not read EXPIRED")
	}
	if ev.Kind == EventBegin && cur != nil && eff.State == StateExpired && !d.FoundExpired {
		fail("a Begin that found the record expired does not say so")
	}

	// Written records.
	if d.Write == WriteInsert || d.Write == WriteUpdate {
		r := d.Record
		if !d.Exists {
			fail("a written record does not exist")
		}
		switch r.State {
		case StateInProgress, StateUnknown:
			if good && !r.ExpiresAt.IsZero() {
				fail("%v written with expires_at set", r.State)
			}
		case StateCompleted, StateFailedReplayable, StateFailedRetryable:
			if r.State != StateFailedRetryable && r.Response == nil {
				fail("%v written without a response", r.State)
			}
			ttl := r.FailureTTL
			if r.State == StateCompleted {
				ttl = r.TTL
			}
			want := now.Add(ttl)
			if r.State == StateFailedRetryable && r.Uncertain && ev.Kind == EventFail {
				want = time.Time{} // an uncertain failure needs a decision: no expiry
			}
			if !r.ExpiresAt.Equal(want) || !r.LeaseExpiresAt.IsZero() {
				fail("%v written with expires_at %v (want %v) or a lease", r.State, r.ExpiresAt, want)
			}
		case StateExpired:
			// Only a released restart goes back to EXPIRED, in the
			// generation before, as if expired now.
			if ev.Kind != EventFail || ev.FailureKind != FailureAbandoned || !r.ExpiresAt.Equal(now) ||
				!r.LeaseExpiresAt.IsZero() || r.Response != nil || r.Uncertain {
				fail("written EXPIRED by %v, or with expires_at %v, a lease, a response or uncertain", ev.Kind, r.ExpiresAt)
			}
		default:
			fail("written in state %v", r.State)
		}
		if !r.UpdatedAt.Equal(now) {
			fail("written without updated_at = now")
		}
		if good {
			if r.Attempt < 1 || r.Generation < 1 {
				fail("written with attempt %d, generation %d", r.Attempt, r.Generation)
			}
			// A Fail ABANDONED takes the attempt back: one attempt back
			// within the generation, or a restart back to the generation
			// before.
			released := cur != nil && ev.Kind == EventFail && ev.FailureKind == FailureAbandoned &&
				(r.Generation == cur.Generation && r.Attempt == cur.Attempt-1 ||
					r.Generation == cur.Generation-1 && r.Attempt == 1 && r.State == StateExpired)
			if cur != nil && !released && !(r.Generation == cur.Generation && (r.Attempt == cur.Attempt || r.Attempt == cur.Attempt+1) ||
				r.Generation == cur.Generation+1 && r.Attempt == 1) {
				fail("attempt %d generation %d follows attempt %d generation %d",
					r.Attempt, r.Generation, cur.Attempt, cur.Generation)
			}
			if r.FailureTTL > r.TTL {
				fail("written with failure_ttl %v > ttl %v", r.FailureTTL, r.TTL)
			}
		}
	}
	// Uncertainty is sticky: once an attempt of a generation may have done
	// the side effect, no later write of that generation forgets it, except
	// an outcome (COMPLETED, FAILED_REPLAYABLE) or an operator's Resolve;
	// every later acquisition of the generation answers previous_state
	// UNKNOWN; an uncertain record is never deleted; and a record written
	// UNKNOWN is uncertain.
	written := d.Write == WriteInsert || d.Write == WriteUpdate
	if written && d.Record.State == StateUnknown && !d.Record.Uncertain {
		fail("written UNKNOWN without uncertain")
	}
	if written && d.Record.State.Replayable() && d.Record.Uncertain {
		fail("written %v still uncertain", d.Record.State)
	}
	if written && ev.Kind == EventFail && d.Record.Uncertain && !d.Record.ExpiresAt.IsZero() {
		fail("a Fail wrote an uncertain %v record with an expiry: the warning would expire with it", d.Record.State)
	}
	if cur != nil && good && eff.Uncertain {
		if d.Write == WriteDelete {
			fail("an uncertain record was deleted")
		}
		sameGen := d.Record.Generation == eff.Generation
		if written && sameGen && ev.Kind != EventResolve && !d.Record.State.Replayable() && !d.Record.Uncertain {
			fail("uncertainty dropped by a %v write in state %v", ev.Kind, d.Record.State)
		}
		renewed := ev.AttemptID != "" && ev.AttemptID == eff.AttemptID && d.Record.LeaseToken == eff.LeaseToken
		if d.Outcome == OutcomeAcquired && sameGen && !renewed && d.PreviousState != StateUnknown {
			fail("an acquisition of an uncertain generation answered previous_state %v", d.PreviousState)
		}
	}
	// A Heartbeat never revives an ended attempt.
	if cur != nil && ev.Kind == EventHeartbeat && d.Err == nil && eff.EndedBy != EndingNone {
		fail("a Heartbeat was accepted on a record ended by %v", eff.EndedBy)
	}

	resolvedLapse := ev.Kind == EventResolve && cur != nil && cur.State == StateInProgress
	if d.EnteredUnknown && (d.Write != WriteUpdate ||
		!(d.Record.State == StateUnknown || d.Outcome == OutcomeAcquired && d.PreviousState == StateUnknown || resolvedLapse)) {
		fail("EnteredUnknown without writing UNKNOWN down, taking it over or resolving a lapse")
	}

	// Resolve ends only a record that needs a decision (reads UNKNOWN, or
	// an uncertain FAILED_RETRYABLE), as COMPLETED or FAILED_RETRYABLE, and
	// revokes the holder's token.
	if ev.Kind == EventResolve && cur != nil {
		decidable := eff.State == StateUnknown || eff.State == StateFailedRetryable && eff.Uncertain
		if !decidable && !errors.Is(d.Err, ErrNotUnknown) {
			fail("a Resolve of a record that reads %v is not NOT_UNKNOWN", eff.State)
		}
		if d.Err == nil && (d.Record.State != ev.ResolveAs || d.Record.LeaseToken != "" || d.Record.AttemptID != "" ||
			d.Record.EndedBy != EndingResolved && d.Record.EndedBy != EndingResolvedRetryable || d.Record.Uncertain) {
			fail("a Resolve wrote state %v, token %q, ended by %v", d.Record.State, d.Record.LeaseToken, d.Record.EndedBy)
		}
	}
}

// wellFormed reports whether r is a record the store can hold and Next can
// have written: a valid state, counters in range (and short of overflow),
// failure_ttl no more than ttl, no expiry while held, a lease while IN_PROGRESS, a response on a
// replayable state.
func wellFormed(r Record) bool {
	if r.State < StateInProgress || r.State > StateUnknown {
		return false
	}
	if r.Attempt < 1 || r.Attempt == math.MaxInt32 || r.Generation < 1 || r.Generation == math.MaxInt32 {
		return false
	}
	if r.FailureTTL > r.TTL {
		return false
	}
	switch r.State {
	case StateInProgress:
		return r.ExpiresAt.IsZero() && !r.LeaseExpiresAt.IsZero()
	case StateUnknown:
		return r.ExpiresAt.IsZero()
	case StateCompleted, StateFailedReplayable:
		return r.Response != nil
	}
	return true
}

// fuzzInput reads fields off the fuzzer's bytes; past the end it reads zeros.
type fuzzInput struct {
	data []byte
	pos  int
}

func (in *fuzzInput) byte() byte {
	if in.pos >= len(in.data) {
		in.pos++
		return 0
	}
	b := in.data[in.pos]
	in.pos++
	return b
}

// sel reads a selector for n choices.
func (in *fuzzInput) sel(n int) int { return int(in.byte()) % n }

func (in *fuzzInput) raw64() int64 {
	var b [8]byte
	for i := range b {
		b[i] = in.byte()
	}
	return int64(binary.LittleEndian.Uint64(b[:]))
}

func (in *fuzzInput) rawBytes() []byte {
	n := in.sel(9)
	b := make([]byte, n)
	for i := range b {
		b[i] = in.byte()
	}
	return b
}

var fuzzBase = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

func (in *fuzzInput) now() time.Time {
	if in.sel(2) == 1 {
		// Anywhere within about ±292 years.
		return fuzzBase.Add(time.Duration(in.raw64()))
	}
	return fuzzBase
}

func (in *fuzzInput) fingerprint() []byte {
	switch in.sel(5) {
	case 1:
		return []byte("A")
	case 2:
		return []byte("B")
	case 3:
		return []byte{}
	case 4:
		return in.rawBytes()
	}
	return nil
}

func (in *fuzzInput) int32() int32 {
	switch in.sel(9) {
	case 1:
		return 0
	case 2:
		return 2
	case 3:
		return 3
	case 4:
		return math.MaxInt32 - 1
	case 5:
		return math.MaxInt32
	case 6:
		return -1
	case 7:
		return math.MinInt32
	case 8:
		return int32(in.raw64())
	}
	return 1
}

func (in *fuzzInput) str(choices ...string) string {
	i := in.sel(len(choices) + 1)
	if i == len(choices) {
		return string(in.rawBytes())
	}
	return choices[i]
}

func (in *fuzzInput) response() *Response {
	switch in.sel(5) {
	case 1:
		return &Response{}
	case 2:
		return &Response{SchemaVersion: "s1", Body: []byte("x"), StatusCode: 200}
	case 3:
		return &Response{SchemaVersion: "s2", Body: []byte("y"), Metadata: map[string]string{"k": "v"}}
	case 4:
		return &Response{SchemaVersion: "s1", Body: []byte{}, StatusCode: 200, Metadata: map[string]string{}}
	}
	return nil
}

func (in *fuzzInput) duration() time.Duration {
	switch in.sel(7) {
	case 1:
		return 0
	case 2:
		return time.Second
	case 3:
		return 24 * time.Hour
	case 4:
		return -time.Second
	case 5:
		return 1
	case 6:
		return time.Duration(in.raw64())
	}
	return time.Hour
}

func (in *fuzzInput) time(now time.Time) time.Time {
	switch in.sel(7) {
	case 1:
		return now
	case 2:
		return now.Add(-1)
	case 3:
		return now.Add(1)
	case 4:
		return now.Add(-time.Hour)
	case 5:
		return now.Add(time.Hour)
	case 6:
		return now.Add(time.Duration(in.raw64()))
	}
	return time.Time{}
}

func (in *fuzzInput) record(now time.Time) Record {
	var r Record
	r.State = State(in.sel(8))
	r.Fingerprint = in.fingerprint()
	r.Attempt = in.int32()
	r.Generation = in.int32()
	r.LeaseToken = in.str("t1", "t2", "")
	r.AttemptID = in.str("", "a1", "a2")
	r.AcquiredFrom = State(in.sel(8))
	r.EndedBy = Ending(in.sel(8))
	r.Response = in.response()
	r.FailureReason = in.str("", "r1", "r2")
	r.TTL = in.duration()
	r.FailureTTL = in.duration()
	r.CreatedAt = in.time(now)
	r.UpdatedAt = in.time(now)
	r.LeaseExpiresAt = in.time(now)
	r.ExpiresAt = in.time(now)
	r.Uncertain = in.sel(2) == 1
	return r
}

func (in *fuzzInput) event() Event {
	var e Event
	e.Kind = EventKind(in.sel(6))
	e.Fingerprint = in.fingerprint()
	e.AttemptID = in.str("", "a1", "a2")
	switch in.sel(5) {
	case 1:
		e.AcceptSchemaVersions = []string{"s1"}
	case 2:
		e.AcceptSchemaVersions = []string{"s2"}
	case 3:
		e.AcceptSchemaVersions = []string{"s1", "s2"}
	case 4:
		e.AcceptSchemaVersions = []string{""}
	}
	e.NewToken = in.str("tn", "t1", "")
	e.TTL = in.duration()
	e.FailureTTL = in.duration()
	e.Lease = in.duration()
	e.Token = in.str("t1", "t2", "")
	e.FailureKind = FailureKind(in.sel(6))
	e.Response = in.response()
	e.Reason = in.str("", "r1", "r2")
	return e
}

func (in *fuzzInput) policy() Policy {
	return Policy{OnExpired: OnExpired(in.sel(3)), OnUnknown: OnUnknown(in.sel(3)), MaxAttempts: in.int32()}
}
