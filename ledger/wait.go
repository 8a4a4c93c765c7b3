package ledger

import (
	"context"
	"errors"
	"time"

	"github.com/idemcoord/idemcoord/statemachine"
)

// waitMargin is kept free before a caller's deadline when it waits for a
// held key, so that its answer (IN_PROGRESS, ErrInProgress) arrives before
// the deadline does.
const waitMargin = 50 * time.Millisecond

// leaseSlack is added to a lease expiry a waiter wakes up at, so the lease
// has surely run out when it looks again.
const leaseSlack = 5 * time.Millisecond

// While the store does not trust change notifications (WithoutNotifications,
// a listener that fell behind or lost its connection), a waiter re-reads
// the record on a backoff: pollFirst after its first read, doubling up to
// pollMax. A holder that finishes quickly is seen quickly, and a long wait
// costs about one read a second.
const (
	pollFirst = 50 * time.Millisecond
	pollMax   = time.Second
)

// nextPoll returns the delay before the re-read that follows one waited
// for prev (0 before the first wait).
func nextPoll(prev time.Duration) time.Duration {
	if prev <= 0 {
		return pollFirst
	}
	return min(2*prev, pollMax)
}

// waitEnd is when a call that may wait up to wait for a held key gives up:
// wait from now, but no later than waitMargin before ctx's deadline. The
// result is not after now when the call must not wait.
func waitEnd(ctx context.Context, now time.Time, wait time.Duration) time.Time {
	end := now.Add(max(wait, 0))
	if dl, ok := ctx.Deadline(); ok {
		if byDeadline := dl.Add(-waitMargin); byDeadline.Before(end) {
			end = byDeadline
		}
	}
	return end
}

// holding is what one try of a waiting call found about the key.
type holding struct {
	// held: another attempt holds the key under a lease (IN_PROGRESS),
	// so the call waits. Otherwise the try's answer stands (a record
	// held UNKNOWN waits for an operator, not for an attempt, and is an
	// answer too).
	held bool
	// leaseLeft is the holder's lease left as of the try (0: unknown).
	leaseLeft time.Duration
	// attempt is the holder's generation and attempt.
	attempt [2]int32
}

// holdingOf is what a Begin's result says about the key.
func holdingOf(res *Result) holding {
	rec := res.Record
	if res.Outcome != statemachine.OutcomeInProgress || rec.State == statemachine.StateUnknown {
		return holding{}
	}
	h := holding{held: true, attempt: [2]int32{rec.Generation, rec.Attempt}}
	if rec.State == statemachine.StateInProgress {
		h.leaseLeft = max(rec.LeaseExpiresAt.Sub(res.Now), time.Nanosecond)
	}
	return h
}

// waitWhileHeld is the one wait for a held key, of a waiting Begin and of
// RunTx. It calls try until try finds the key not held, or giveUp passes
// (heldAtEnd: the last try found it held), or try or ctx fails. Between
// tries it holds no row lock or connection: it wakes on every committed
// change of the record id (subscribe), at the holder's lease expiry, and,
// while notifications are not trusted, on a poll backoff (nextPoll).
//
// Each attempt that holds the key is marked watched once (watch), so that
// the change that ends it is notified.
//
// A try that finds the database unavailable, after an earlier try found
// the key held, does not end the wait: the call waits on what that try
// found, and the outage is the answer only if it outlasts the wait. The
// exceptions are ErrLostAcquisition, the caller's own acquisition, lapsed,
// which waiting on could only take the key a second time, and a try's
// finalError. Callers make their tries recognise their own acquisition
// (one lease token across all tries), since a try whose answer was lost
// may have committed one.
//
// try's own answer is kept by the caller from its last successful call.
func (s *Store) waitWhileHeld(ctx context.Context, id Identity, giveUp time.Time,
	try func(context.Context) (holding, error),
) (heldAtEnd bool, err error) {
	changed, unsubscribe := s.subscribe(id)
	defer unsubscribe()
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	var last *holding
	var poll time.Duration
	var watched [2]int32 // generation and attempt last marked watched
	for {
		h, err := try(ctx)
		fresh := err == nil
		left := time.Until(giveUp)
		if err != nil {
			var final finalError
			if last == nil || left <= 0 || !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrLostAcquisition) ||
				errors.As(err, &final) {
				return false, err
			}
			h = *last
		}
		last = &h
		if !h.held {
			return false, nil
		}
		if left <= 0 {
			return true, nil
		}
		sleep := left
		if h.leaseLeft > 0 {
			sleep = min(sleep, h.leaseLeft+leaseSlack)
			// Only changes someone waits for are notified: say so, then
			// read again if the attempt ended meanwhile. (With the
			// database unreachable, wait on the last read, as above.)
			// Each attempt is marked once: every re-read (a poll, a
			// wake-up) would otherwise write the row again.
			if fresh && h.attempt != watched {
				held, err := s.watch(ctx, id)
				if err != nil && !errors.Is(err, ErrUnavailable) {
					return false, err
				}
				if err == nil && !held {
					continue
				}
				if err == nil {
					watched = h.attempt
				}
			}
		}
		if s.notifier.Polling() {
			poll = nextPoll(poll)
			sleep = min(sleep, poll)
		}
		sleep = max(sleep, 0)
		if timer == nil {
			timer = time.NewTimer(sleep)
		} else {
			timer.Reset(sleep) // no stale tick survives Reset (Go ≥ 1.23)
		}
		select {
		case <-changed:
		case <-timer.C:
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
}

// BeginWait is Begin for a caller that, while another attempt holds the
// key, waits for it (docs/design.md, "One wait loop"): up to wait, but no later than
// 50 ms before ctx's deadline, without holding a row lock or a connection,
// waking on every committed change of the record and at its lease expiry,
// and then answers as Begin would. When the wait runs out with the key
// still held, the answer is Begin's OutcomeInProgress; a record held
// UNKNOWN is answered at once. A wait of 0 (or a deadline too close) is a
// plain Begin.
//
// Its re-reads are Begins: one whose answer was lost (its connection broke
// after the statement was sent) may have acquired the key. They all offer
// one lease token (p.Event.NewToken, or a fresh one), so that what follows
// a lost answer finds that acquisition its own and answers it, instead of
// waiting for it to lapse and taking the key a second time; if it has
// lapsed already, BeginWait returns ErrLostAcquisition. After a lost answer
// the re-reads write nothing (beginWithoutWrite): they answer the caller's
// own acquisition, or what needs no write (the key held: wait on; a
// replay), and a Begin that would have to write (create the key, take it
// over) ends the wait with the lost answer's ErrUnavailable. Writing then,
// with the same token, could create the key a second time after an
// operator's Forget deleted the lost acquisition: one call taking effect
// twice (TestLinearizableReference found it). A re-read that finds the
// database unavailable does not end the wait; the outage is the answer
// only if it outlasts it.
func (s *Store) BeginWait(ctx context.Context, p *BeginParams, wait time.Duration) (*Result, error) {
	giveUp := waitEnd(ctx, time.Now(), wait)
	if !time.Now().Before(giveUp) {
		return s.Begin(ctx, p)
	}
	q := *p
	if q.Event.NewToken == "" {
		q.Event.NewToken = newToken()
	}
	// The event of the re-reads that write nothing, as Begin makes it.
	readEv := storedDurations(q.Event)
	readEv.Kind = statemachine.EventBegin
	var res *Result
	var lost error // the error of a re-read whose answer was lost
	_, err := s.waitWhileHeld(ctx, p.ID, giveUp, func(ctx context.Context) (holding, error) {
		if lost == nil {
			r, err := s.Begin(ctx, &q)
			if err == nil {
				res = r
				return holdingOf(r), nil
			}
			if !answerLost(err) {
				return holding{}, err
			}
			lost = err
		}
		r, ok, err := s.beginWithoutWrite(ctx, &q, readEv)
		switch {
		case err != nil:
			return holding{}, err
		case !ok:
			return holding{}, finalError{lost}
		}
		res = r
		return holdingOf(r), nil
	})
	if err != nil {
		return nil, err
	}
	return res, nil
}

// finalError is a try's error that ends a wait although it is
// ErrUnavailable (see waitWhileHeld); it wraps that error.
type finalError struct{ error }

func (e finalError) Unwrap() error { return e.error }
