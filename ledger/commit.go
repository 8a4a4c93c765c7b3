package ledger

import (
	"context"
	"sync/atomic"
	"time"
)

// commitTimeout bounds a COMMIT, and a single-statement write that commits
// by itself, once it no longer follows its caller's context.
//
// Why a commit does not follow its caller: with a synchronous standby, a
// COMMIT first writes the transaction locally and then waits for the
// standby. If its query is cancelled during that wait (pgx sends a cancel
// request when the caller's context ends), PostgreSQL stops waiting and
// keeps the transaction committed on the primary only: other callers then
// read it (a Begin replays the stored response), and a failover to the
// standby erases it afterwards. So a commit runs under
// context.WithoutCancel with this bound of its own, long enough for any
// failover to end the wait first (the killed primary's connections break,
// which cancels nothing).
const commitTimeout = 2 * time.Minute

// commitContext returns ctx's values without its cancellation, bounded by
// commitTimeout; see commitTimeout for why.
func commitContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
}

// detached runs fn, a commit, under commitContext(ctx) and returns its
// result; when ctx ends first it returns ctx's error at once and fn goes
// on by itself (its result is dropped: the caller cannot know whether it
// committed, as after a lost connection). When ctx has ended already, fn
// does not run.
func detached[T any](ctx context.Context, fn func(context.Context) (T, error)) (T, error) {
	return detachedThen(ctx, fn, nil)
}

// detachedThen is detached, except that when ctx ends first and fn goes on
// by itself, late (if not nil) is called with fn's result once fn returns,
// on fn's goroutine. Exactly one of the two learns the result: the caller
// or late.
func detachedThen[T any](ctx context.Context, fn func(context.Context) (T, error), late func(T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	if err := ctx.Err(); err != nil {
		var zero T
		return zero, err
	}
	const (
		waiting = iota
		returned
		left
	)
	var handoff atomic.Int32
	cctx, cancel := commitContext(ctx)
	done := make(chan result, 1)
	go func() {
		defer cancel()
		v, err := fn(cctx)
		if !handoff.CompareAndSwap(waiting, returned) {
			if late != nil {
				late(v, err)
			}
			return
		}
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
		if !handoff.CompareAndSwap(waiting, left) {
			r := <-done // fn has returned: its result is the caller's
			return r.v, r.err
		}
		var zero T
		return zero, ctx.Err()
	}
}
