package statemachine

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"time"
)

// The refusals Next can decide. None of them changes the record.
var (
	// ErrNotFound: the event needs a record and there is none.
	ErrNotFound = errors.New("no such record")
	// ErrFingerprintMismatch: a Begin's fingerprint differs from the
	// generation's.
	ErrFingerprintMismatch = errors.New("fingerprint differs from the one the key was first used with")
	// ErrLeaseLost: the token is not the latest acquisition's.
	ErrLeaseLost = errors.New("lease token does not hold the lease")
	// ErrAlreadyFinished: the acquisition already ended differently.
	ErrAlreadyFinished = errors.New("the record already ended with this token")
	// ErrAttemptsExhausted: the policy's max_attempts was reached.
	ErrAttemptsExhausted = errors.New("the policy's max_attempts was reached")
	// ErrSchemaVersionNotAccepted: the stored response's schema version is
	// not among the accepted ones.
	ErrSchemaVersionNotAccepted = errors.New("stored schema version is not accepted")
	// ErrKeyExpired: the record expired and the policy rejects a restart.
	ErrKeyExpired = errors.New("key expired and the policy rejects reuse")
	// ErrNotUnknown: a Resolve found a record that needs no decision: not
	// UNKNOWN and not an uncertain FAILED_RETRYABLE (as in effect now). The
	// error names its state.
	ErrNotUnknown = errors.New("only an UNKNOWN or uncertain record can be resolved")
	// ErrCheckpointRecorded: a Fail ABANDONED by an attempt that recorded
	// a checkpoint; that attempt has acted, so the key cannot go back to
	// how it was before it.
	ErrCheckpointRecorded = errors.New("the attempt recorded a checkpoint, so it cannot be abandoned (fail it RETRYABLE or UNKNOWN)")
)

// ResolvedReason is the failure_reason of a record resolved as
// FAILED_RETRYABLE.
const ResolvedReason = "resolved as retryable by an operator"

// Retry hints for OUTCOME_IN_PROGRESS answers.
const (
	// MaxRetryAfter caps the retry_after of an in-progress answer.
	MaxRetryAfter = time.Second
	// MinRetryAfter is the smallest retry_after ever answered.
	MinRetryAfter = 10 * time.Millisecond
)

// Decision is what an event does to a record.
type Decision struct {
	// Err is one of the package's errors when the event is refused; the
	// record is then unchanged and Write is WriteNone.
	Err error
	// Outcome is the answer of a Begin (OutcomeOK for other events).
	Outcome Outcome
	// Write is what the store must do: insert or update Record, delete the
	// record, or nothing.
	Write Write
	// Record is the record after the event, as in effect at now (after a
	// delete, the zero Record with Exists false).
	Record Record
	// Exists reports whether a record exists after the event.
	Exists bool
	// PreviousState is the previous_state of an acquiring Begin.
	PreviousState State
	// RetryAfter is set for OutcomeInProgress.
	RetryAfter time.Duration
	// EnteredUnknown reports that this event moved the record into UNKNOWN
	// (by Fail UNKNOWN, or by writing down a lease found lapsed), or is the
	// first write after its lease was found lapsed (a takeover, a Resolve).
	EnteredUnknown bool
	// FoundExpired reports that a Begin found the record expired, whether it
	// restarted it or was refused with ErrKeyExpired.
	FoundExpired bool
}

// Effective returns rec as in effect at now: an IN_PROGRESS record whose
// lease ran out (now at or after LeaseExpiresAt) reads UNKNOWN, and a
// COMPLETED or FAILED_* record at or after ExpiresAt reads EXPIRED with its
// response and checkpoint dropped. An EXPIRED record never reads with a
// response or a checkpoint, and a
// record that reads UNKNOWN always reads Uncertain.
func Effective(rec Record, now time.Time) Record {
	switch {
	case rec.State == StateInProgress && !rec.LeaseExpiresAt.IsZero() && !now.Before(rec.LeaseExpiresAt):
		rec.State = StateUnknown
		rec.Uncertain = true
	case rec.State.Terminal() && !rec.ExpiresAt.IsZero() && !now.Before(rec.ExpiresAt):
		rec.State = StateExpired
		rec.Response = nil
		rec.Checkpoint = nil
	case rec.State == StateExpired:
		rec.Response = nil
		rec.Checkpoint = nil
	case rec.State == StateUnknown:
		rec.Uncertain = true
	}
	return rec
}

// Next decides what ev does to the stored record cur (nil when the key has
// no record) under pol at now. It never panics, whatever its input.
//
// Fail ABANDONED puts the key back as it was before the acquisition, as far
// as the record can tell, with the attempt counter as it was (so it does
// not count against max_attempts): a record the acquisition created is
// deleted; a restart is EXPIRED again in the generation before (as a
// failure under on_expired: reject, where only failures restart, else as a
// result); a takeover from FAILED_RETRYABLE is FAILED_RETRYABLE again with
// its fingerprint cleared and failure_ttl counting anew; an uncertain
// generation, or a takeover from UNKNOWN, is UNKNOWN again with its
// fingerprint kept (an uncertain FAILED_RETRYABLE so comes back UNKNOWN).
// An acquisition that may itself have acted (it ended Fail UNKNOWN first,
// or its own lease lapsed) leaves the key UNKNOWN and counts; one that
// recorded a checkpoint has acted for sure, and its Fail ABANDONED is
// refused with ErrCheckpointRecorded.
//
// A checkpoint (a Heartbeat's Event.Checkpoint) belongs to the generation:
// it is fenced like the Heartbeat, kept through lapsed leases, takeovers,
// failures and the end of the generation (every acquisition of the
// generation finds it in the record), and dropped when the record expires;
// a new generation starts without one.
func Next(cur *Record, ev Event, pol Policy, now time.Time) Decision {
	switch ev.Kind {
	case EventBegin:
		return begin(cur, ev, pol, now)
	case EventComplete, EventFail, EventHeartbeat:
		return finish(cur, ev, pol, now)
	case EventResolve:
		return resolve(cur, ev, now)
	default:
		d := Decision{Err: errors.New("unknown event kind")}
		if cur != nil {
			d.Record, d.Exists = Effective(*cur, now), true
		}
		return d
	}
}

func begin(cur *Record, ev Event, pol Policy, now time.Time) Decision {
	if cur == nil {
		rec := Record{
			Generation: 1,
			CreatedAt:  now,
		}
		acquire(&rec, ev, now, StateNone)
		rec.Fingerprint = clone(ev.Fingerprint)
		return Decision{Outcome: OutcomeAcquired, Write: WriteInsert, Record: rec, Exists: true, PreviousState: StateNone}
	}
	eff := Effective(*cur, now)
	lapsed := cur.State == StateInProgress && eff.State == StateUnknown

	if eff.State == StateExpired {
		// on_expired protects results, not failures: an expired
		// FAILED_RETRYABLE record restarts under either policy.
		if pol.OnExpired == ExpiredReject && !eff.EndedBy.failure(eff.FailureReason) {
			d := refuse(ErrKeyExpired, eff)
			d.FoundExpired = true
			return d
		}
		rec := eff
		rec.Generation++
		rec.Attempt = 0
		rec.Uncertain = false // uncertainty belongs to a generation
		rec.Checkpoint = nil  // and so do checkpoints
		acquire(&rec, ev, now, StateExpired)
		rec.Fingerprint = clone(ev.Fingerprint)
		d := acquired(rec, StateExpired)
		d.FoundExpired = true
		return d
	}
	if len(ev.Fingerprint) > 0 && len(eff.Fingerprint) > 0 && !bytes.Equal(ev.Fingerprint, eff.Fingerprint) {
		return refuse(ErrFingerprintMismatch, eff)
	}
	sameAttempt := ev.AttemptID != "" && ev.AttemptID == eff.AttemptID

	switch eff.State {
	case StateInProgress:
		if sameAttempt {
			// A repeated Begin of the holder's attempt: same token again,
			// with a full lease from now.
			rec := eff
			rec.LeaseExpiresAt = now.Add(ev.Lease)
			rec.UpdatedAt = now
			keepFirstFingerprint(&rec, ev)
			return Decision{Outcome: OutcomeAcquired, Write: WriteUpdate, Record: rec, Exists: true, PreviousState: eff.AcquiredFrom}
		}
		return inProgress(eff, eff.LeaseExpiresAt.Sub(now))

	case StateUnknown:
		if sameAttempt && eff.EndedBy == EndingNone {
			// The holder's own Begin, retried after its lease ran out and
			// before anyone took over: it keeps its token and gets a new lease.
			rec := eff
			rec.State = StateInProgress
			rec.LeaseExpiresAt = now.Add(ev.Lease)
			rec.UpdatedAt = now
			keepFirstFingerprint(&rec, ev)
			return Decision{Outcome: OutcomeAcquired, Write: WriteUpdate, Record: rec, Exists: true, PreviousState: eff.AcquiredFrom}
		}
		if exhausted(eff, pol) {
			return refuse(ErrAttemptsExhausted, eff)
		}
		if pol.OnUnknown == UnknownHold {
			d := inProgress(eff, MaxRetryAfter)
			if lapsed {
				// Write the lapse down once, so it is counted once.
				d.Record.UpdatedAt = now
				d.Record.LeaseExpiresAt = time.Time{}
				d.Write = WriteUpdate
				d.EnteredUnknown = true
			}
			return d
		}
		return takeover(eff, ev, now, StateUnknown, lapsed)

	case StateFailedRetryable:
		if exhausted(eff, pol) {
			return refuse(ErrAttemptsExhausted, eff)
		}
		return takeover(eff, ev, now, StateFailedRetryable, false)

	case StateCompleted, StateFailedReplayable:
		if len(ev.AcceptSchemaVersions) > 0 {
			var v string
			if eff.Response != nil {
				v = eff.Response.SchemaVersion
			}
			if !slices.Contains(ev.AcceptSchemaVersions, v) {
				return refuse(ErrSchemaVersionNotAccepted, eff)
			}
		}
		return Decision{Outcome: OutcomeReplay, Record: eff, Exists: true}
	}
	return refuse(errors.New("record in an invalid state "+eff.State.String()), eff)
}

func finish(cur *Record, ev Event, pol Policy, now time.Time) Decision {
	if cur == nil {
		return Decision{Err: ErrNotFound}
	}
	eff := Effective(*cur, now)
	if ev.Token == "" || ev.Token != cur.LeaseToken {
		return refuse(ErrLeaseLost, eff)
	}
	lapsed := cur.State == StateInProgress && eff.State == StateUnknown
	held := eff.State == StateInProgress || eff.State == StateUnknown

	if !held {
		// The acquisition already ended. Only a repeat of the very call
		// that ended it is accepted, and it changes nothing.
		if eff.State != StateExpired && ev.Kind != EventHeartbeat && sameEnding(eff, ev) {
			return Decision{Record: eff, Exists: true}
		}
		return refuse(ErrAlreadyFinished, eff)
	}
	if eff.EndedBy != EndingNone {
		// UNKNOWN by a Fail of this token (UNKNOWN, or ABANDONED of an
		// uncertain attempt). A Heartbeat never revives an ended attempt;
		// a repeat of that Fail changes nothing; another Complete or Fail
		// still ends it as from IN_PROGRESS.
		if ev.Kind == EventHeartbeat {
			return refuse(ErrAlreadyFinished, eff)
		}
		if sameEnding(eff, ev) {
			return Decision{Record: eff, Exists: true}
		}
	}

	rec := eff
	rec.UpdatedAt = now
	switch ev.Kind {
	case EventHeartbeat:
		rec.State = StateInProgress
		rec.EndedBy = EndingNone
		rec.LeaseExpiresAt = now.Add(ev.Lease)
		if ev.Checkpoint != nil {
			rec.Checkpoint = &Checkpoint{Phase: ev.Checkpoint.Phase, Data: clone(ev.Checkpoint.Data), At: now, Attempt: rec.Attempt}
		}
		return Decision{Write: WriteUpdate, Record: rec, Exists: true}

	case EventComplete:
		resp := ev.Response
		if resp == nil {
			resp = &Response{}
		}
		end(&rec, StateCompleted, EndingCompleted, resp, "", now.Add(rec.TTL))
		rec.Uncertain = false
		return Decision{Write: WriteUpdate, Record: rec, Exists: true}
	}

	// EventFail.
	switch ev.FailureKind {
	case FailureRetryable:
		expires := now.Add(rec.FailureTTL)
		if rec.Uncertain {
			// An earlier attempt of this generation may have acted: like
			// UNKNOWN, the record needs a decision and never expires, so
			// no restart after failure_ttl can forget the warning.
			expires = time.Time{}
		}
		end(&rec, StateFailedRetryable, EndingRetryable, ev.Response, ev.Reason, expires)
	case FailureReplayable:
		resp := ev.Response
		if resp == nil {
			resp = &Response{}
		}
		end(&rec, StateFailedReplayable, EndingReplayable, resp, ev.Reason, now.Add(rec.FailureTTL))
		rec.Uncertain = false
	case FailureUnknown:
		end(&rec, StateUnknown, EndingUnknown, ev.Response, ev.Reason, time.Time{})
		rec.Uncertain = true
		return Decision{Write: WriteUpdate, Record: rec, Exists: true, EnteredUnknown: eff.State != StateUnknown || lapsed}
	case FailureAbandoned:
		if rec.Checkpoint != nil && rec.Checkpoint.Attempt == rec.Attempt {
			return refuse(ErrCheckpointRecorded, eff)
		}
		return abandon(rec, eff, ev, pol, now, lapsed)
	default:
		return refuse(errors.New("unknown failure kind"), eff)
	}
	return Decision{Write: WriteUpdate, Record: rec, Exists: true}
}

// abandon ends the acquisition rec (eff as it reads, lapsed if its lease
// ran out unwritten) with Fail ABANDONED: the attempt did nothing, so the
// key goes back to how it was before this acquisition, as far as the record
// can tell, and the acquisition does not count against max_attempts:
//
//   - the generation is uncertain (an earlier attempt may have acted, or
//     this one's lease lapsed), or the acquisition took over from UNKNOWN:
//     UNKNOWN again, fingerprint kept; abandoning never makes the key look
//     untouched;
//   - the acquisition created the record: the record is deleted;
//   - it restarted an expired record: EXPIRED again, in the generation
//     before (its response was dropped at expiry anyway). Whether that
//     generation ended in a result or a failure is not kept: under
//     on_expired: reject it must have been a failure (a result would not
//     have restarted), otherwise it is kept as a result, so a later switch
//     to reject protects it. Its retention counts from now;
//   - it took over from FAILED_RETRYABLE: FAILED_RETRYABLE again, with its
//     fingerprint cleared (the caller may fix the request and use the key
//     again) and failure_ttl counting from now.
//
// In every case but the first two the attempt counter goes back by one.
// This holds for every ABANDONED, whatever its reason: a release by a
// library whose caller gave up before the handler ran, and a request the
// handler rejected before doing anything (the interceptor's
// INVALID_ARGUMENT, say). Neither was an attempt at the side effect.
func abandon(rec, eff Record, ev Event, pol Policy, now time.Time, lapsed bool) Decision {
	// An acquisition that may itself have acted (it said Fail UNKNOWN, or
	// its own lease lapsed) counts; the uncertainty of a takeover from
	// UNKNOWN came before it.
	takeover := rec.AcquiredFrom == StateFailedRetryable || rec.AcquiredFrom == StateUnknown
	acted := eff.EndedBy == EndingUnknown || rec.Uncertain && rec.AcquiredFrom != StateUnknown
	// An acquisition that said ABANDONED before (its record stayed
	// UNKNOWN, so its token may end it again) gave its number back then:
	// a second ABANDONED, with another reason, takes none.
	givenBack := eff.EndedBy == EndingAbandoned
	if takeover && !acted && !givenBack && rec.Attempt > 1 {
		rec.Attempt--
		if rec.Checkpoint != nil && rec.Checkpoint.Attempt == rec.Attempt {
			// The number now names the acquisition before this one, which
			// recorded the checkpoint and can no longer act (it was taken
			// over). This acquisition's token can still end the record
			// once it is UNKNOWN again, and did not record the checkpoint:
			// marked as nobody's, it does not refuse that token's Fail
			// ABANDONED (found by the reference-model chaos test).
			cp := *rec.Checkpoint
			cp.Attempt = 0
			rec.Checkpoint = &cp
		}
	}
	if rec.Uncertain || rec.AcquiredFrom == StateUnknown {
		end(&rec, StateUnknown, EndingAbandoned, nil, ev.Reason, time.Time{})
		rec.Uncertain = true
		return Decision{Write: WriteUpdate, Record: rec, Exists: true, EnteredUnknown: eff.State != StateUnknown || lapsed}
	}
	switch {
	case rec.AcquiredFrom == StateNone && rec.Generation <= 1 && rec.Attempt <= 1:
		return Decision{Write: WriteDelete}
	case rec.AcquiredFrom == StateExpired && rec.Generation > 1:
		by := EndingCompleted
		if pol.OnExpired == ExpiredReject {
			by = EndingAbandoned
		}
		rec.Generation--
		rec.Attempt = 1
		rec.Fingerprint = nil
		rec.Checkpoint = nil // an EXPIRED record has none
		end(&rec, StateExpired, by, nil, ev.Reason, now)
		return Decision{Write: WriteUpdate, Record: rec, Exists: true}
	}
	end(&rec, StateFailedRetryable, EndingAbandoned, nil, ev.Reason, now.Add(rec.FailureTTL))
	rec.Fingerprint = nil
	return Decision{Write: WriteUpdate, Record: rec, Exists: true}
}

// resolve ends a record that needs a decision (UNKNOWN, a lapsed lease
// included, or an uncertain FAILED_RETRYABLE) as an operator decided: COMPLETED with ev.Response, or FAILED_RETRYABLE, expiring after
// the record's own ttl or failure_ttl like an ending call. The operator
// takes the holder's place: its token and attempt_id stop being valid, so a
// late Complete, Fail or Heartbeat of the vanished holder fails LEASE_LOST.
func resolve(cur *Record, ev Event, now time.Time) Decision {
	if cur == nil {
		return Decision{Err: ErrNotFound}
	}
	eff := Effective(*cur, now)
	if !eff.NeedsDecision() {
		return refuse(fmt.Errorf("%w: it is %v", ErrNotUnknown, eff.State), eff)
	}
	rec := eff
	rec.UpdatedAt = now
	rec.LeaseToken = ""
	rec.AttemptID = ""
	rec.Uncertain = false // the operator checked the outside world
	switch ev.ResolveAs {
	case StateCompleted:
		resp := ev.Response
		if resp == nil {
			resp = &Response{}
		}
		end(&rec, StateCompleted, EndingResolved, resp, "", now.Add(rec.TTL))
	case StateFailedRetryable:
		end(&rec, StateFailedRetryable, EndingResolvedRetryable, nil, ResolvedReason, now.Add(rec.FailureTTL))
	default:
		return refuse(errors.New("a record can be resolved only as COMPLETED or FAILED_RETRYABLE"), eff)
	}
	// A lease found lapsed enters UNKNOWN with this write, as with a takeover.
	lapsed := cur.State == StateInProgress
	return Decision{Write: WriteUpdate, Record: rec, Exists: true, EnteredUnknown: lapsed}
}

// acquire makes rec the new acquisition of ev.
func acquire(rec *Record, ev Event, now time.Time, from State) {
	rec.State = StateInProgress
	rec.Attempt++
	rec.LeaseToken = ev.NewToken
	rec.AttemptID = ev.AttemptID
	rec.AcquiredFrom = from
	rec.EndedBy = EndingNone
	rec.Response = nil
	rec.FailureReason = ""
	rec.TTL = ev.TTL
	rec.FailureTTL = min(ev.FailureTTL, ev.TTL)
	rec.UpdatedAt = now
	rec.LeaseExpiresAt = now.Add(ev.Lease)
	rec.ExpiresAt = time.Time{}
}

// keepFirstFingerprint stores ev's fingerprint in rec when the generation
// has none yet: the fingerprint is the generation's first non-empty one,
// whichever Begin brings it (a repeated Begin of the holder's attempt
// included).
func keepFirstFingerprint(rec *Record, ev Event) {
	if len(rec.Fingerprint) == 0 {
		rec.Fingerprint = clone(ev.Fingerprint)
	}
}

// takeover acquires a record that reads FAILED_RETRYABLE or UNKNOWN. An
// uncertain record is taken over as from UNKNOWN, whatever it reads.
func takeover(eff Record, ev Event, now time.Time, from State, lapsed bool) Decision {
	if eff.Uncertain {
		from = StateUnknown
	}
	rec := eff
	acquire(&rec, ev, now, from)
	keepFirstFingerprint(&rec, ev)
	d := acquired(rec, from)
	d.EnteredUnknown = lapsed
	return d
}

func acquired(rec Record, from State) Decision {
	return Decision{Outcome: OutcomeAcquired, Write: WriteUpdate, Record: rec, Exists: true, PreviousState: from}
}

func inProgress(eff Record, wait time.Duration) Decision {
	return Decision{Outcome: OutcomeInProgress, Record: eff, Exists: true, RetryAfter: min(max(wait, MinRetryAfter), MaxRetryAfter)}
}

func refuse(err error, eff Record) Decision {
	return Decision{Err: err, Record: eff, Exists: true}
}

func exhausted(eff Record, pol Policy) bool {
	return pol.MaxAttempts > 0 && eff.Attempt >= pol.MaxAttempts
}

func end(rec *Record, st State, by Ending, resp *Response, reason string, expires time.Time) {
	rec.State = st
	rec.EndedBy = by
	rec.Response = resp
	rec.FailureReason = reason
	rec.LeaseExpiresAt = time.Time{}
	rec.ExpiresAt = expires
}

// sameEnding reports whether ev repeats the call that ended eff.
func sameEnding(eff Record, ev Event) bool {
	switch ev.Kind {
	case EventComplete:
		resp := ev.Response
		if resp == nil {
			resp = &Response{}
		}
		return eff.EndedBy == EndingCompleted && eff.Response.Equal(resp)
	case EventFail:
		if !ev.FailureKind.Valid() || eff.EndedBy != Ending(ev.FailureKind) || eff.FailureReason != ev.Reason {
			return false
		}
		resp := ev.Response
		switch ev.FailureKind {
		case FailureAbandoned:
			return true
		case FailureReplayable:
			if resp == nil {
				resp = &Response{}
			}
		}
		return eff.Response.Equal(resp)
	}
	return false
}

func clone(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return bytes.Clone(b)
}
