package clients

import (
	"context"
	"errors"
	"time"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Result is the recorded outcome of a key, as Once returns it.
type Result struct {
	// Response is the stored response: the one fn returned when this call
	// ran it, the stored one on a replay. For a replayable failure it is the
	// stored failure (a google.rpc.Status unless fn gave its own).
	Response *idempotencyv1.StoredResponse
	// Replayed reports that fn did not run in this call: Response was
	// stored by an earlier one.
	Replayed bool
	// State is STATE_COMPLETED, or STATE_FAILED_REPLAYABLE for a replayable
	// failure.
	State idempotencyv1.State
	// Attempt is the attempt that produced Response (1 for the first).
	Attempt int32
}

// Once runs fn at most once per (scope, key) across every process that
// shares the coordinator, and returns the recorded outcome.
//
// It calls Begin with fingerprint (empty skips the check) and:
//
//   - when it acquires the key, runs fn with a context that carries the
//     attempt (see AttemptFrom and LeaseFrom; a fn that sees previous
//     STATE_UNKNOWN checks the outside world first) and heartbeats every
//     third of the lease while fn runs. If a heartbeat learns that the lease
//     was lost, fn's context is cancelled with cause ErrLeaseLost and Once
//     returns ErrLeaseLost without recording anything (the new holder
//     will). If no heartbeat can confirm the lease before it would run out
//     by the local clock, fn's context is cancelled with cause
//     ErrLeaseUnconfirmed, so a holder cut off from the coordinator stops
//     before another can take over. Otherwise fn's outcome is recorded: its
//     response with Complete (nil stores an empty response), its error with
//     Fail of the kind a *FailureError in it names or, by default, of the
//     kind its gRPC code maps to (see WithFailureKinds; errors without a
//     status count as UNKNOWN). Once fn has called MarkSideEffect, any error
//     is recorded UNKNOWN unless a *FailureError names REPLAYABLE. A panic in
//     fn is recorded UNKNOWN and re-panicked;
//   - when the key already has an outcome, returns it without running fn:
//     Replayed is true;
//   - while another attempt holds the key, waits for its outcome (with
//     Begin's long-poll) until ctx ends;
//   - when the key is held UNKNOWN for an operator, fails with an error
//     matching ErrUnknownHeld.
//
// A replayable failure, whether fn just returned it or it is replayed, is
// returned as a Result with State STATE_FAILED_REPLAYABLE together with an
// error: fn's error, or on a replay the stored gRPC status (or a
// *FailureError carrying fn's own stored response). Other failures return a
// nil Result and fn's error.
//
// Complete and Fail are made even when ctx has ended. If the coordinator
// cannot be reached for them, Once still returns fn's outcome and keeps
// trying in the background for up to one lease (see Shutdown). If it
// refuses them (the lease was lost meanwhile), Once returns fn's outcome
// and that refusal as the error.
//
// A caller may give up at any moment (ctx ends). Before fn starts, giving
// up never strands the key: when ctx ends while Begin is in flight or
// while Once waits, or after Begin acquired the key but before fn starts,
// fn does not run and Once, before it returns ctx's error, releases the
// acquisition: it sends Begin again with the same attempt_id on a context
// detached from ctx (bounded by a few seconds) and ends what that acquires
// with Fail ABANDONED, reason ReleaseReason. The key is then as if the
// attempt never was: absent if it was new, otherwise in its earlier state,
// and the next Once acquires at once with the previous state it would have
// had; the released attempt does not count against max_attempts. A Begin
// that fails without a readable answer (the coordinator unreachable) is
// released the same way, in the background. Only if the coordinator cannot
// be reached for the release does the acquisition's lease lapse (UNKNOWN).
// Once fn has started, its outcome is recorded as above whether or not ctx
// ends meanwhile.
func (c *Client) Once(ctx context.Context, scope, key string, fingerprint []byte,
	fn func(ctx context.Context) (*idempotencyv1.StoredResponse, error)) (*Result, error) {
	breq := &idempotencyv1.BeginRequest{Scope: scope, Key: key, Fingerprint: fingerprint,
		Lease: c.leaseRequest(), AttemptId: newAttemptID()}
	res, sent, err := c.beginWaiting(ctx, breq, time.Time{})
	if err != nil {
		return nil, err
	}
	rec := res.GetRecord()
	switch res.GetOutcome() {
	case idempotencyv1.Outcome_OUTCOME_REPLAY:
		out := &Result{Response: rec.GetResponse(), Replayed: true, State: rec.GetState(), Attempt: rec.GetAttempt()}
		if rec.GetState() == idempotencyv1.State_STATE_FAILED_REPLAYABLE {
			return out, storedError(rec)
		}
		return out, nil
	case idempotencyv1.Outcome_OUTCOME_IN_PROGRESS:
		if rec.GetState() == idempotencyv1.State_STATE_UNKNOWN {
			return nil, unknownHeldError()
		}
		if ctx.Err() != nil {
			return nil, contextStatus(ctx)
		}
		return nil, inProgressError(res.GetRetryAfter().AsDuration())
	}

	l := c.newLease(breq, res, sent)
	var resp *idempotencyv1.StoredResponse
	var ferr error
	switch l.run(ctx, func(ctx context.Context) { resp, ferr = fn(ctx) }) {
	case runLost:
		return nil, ErrLeaseLost
	case runCallerGone:
		return nil, joinFinish(contextStatus(ctx), l.release(ctx))
	case runNotStarted:
		// fn never ran: the key goes back to how it was.
		return nil, joinFinish(ErrLeaseUnconfirmed, l.finish(ctx, ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED,
			reason: "the lease could not be confirmed before the attempt started"}))
	}
	out := &Result{Attempt: rec.GetAttempt()}
	if ferr == nil {
		if resp == nil {
			resp = &idempotencyv1.StoredResponse{}
		}
		out.Response, out.State = resp, idempotencyv1.State_STATE_COMPLETED
		return out, l.finish(ctx, ending{complete: resp})
	}
	e := ending{kind: endingKind(ferr, defaultFailureKinds(), l.marked()), reason: failReason(ferr.Error())}
	if e.kind != idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE {
		return nil, joinFinish(ferr, l.finish(ctx, e))
	}
	var fe *FailureError
	if errors.As(ferr, &fe) && fe.Response != nil {
		e.response = fe.Response
	} else if e.response, err = statusResponse(ferr); err != nil {
		e.kind = idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN
		return nil, joinFinish(ferr, l.finish(ctx, e))
	}
	out.Response, out.State = e.response, idempotencyv1.State_STATE_FAILED_REPLAYABLE
	return out, joinFinish(ferr, l.finish(ctx, e))
}

// joinFinish adds the error of Complete/Fail to fn's error, if any.
func joinFinish(ferr, finishErr error) error {
	if finishErr == nil {
		return ferr
	}
	return errors.Join(ferr, finishErr)
}
