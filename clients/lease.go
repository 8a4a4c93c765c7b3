package clients

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

const (
	// defaultLease is used for heartbeats when a Begin answer does not
	// tell the lease (it always does from idemcoord).
	defaultLease = 30 * time.Second
	// minHeartbeat bounds how often a lease is extended.
	minHeartbeat = 50 * time.Millisecond
	// finishTimeout bounds the Complete or Fail made before a call returns;
	// after it the call returns and the work goes on in the background.
	finishTimeout = 5 * time.Second
	// callTimeout bounds one background call to the coordinator.
	callTimeout = 5 * time.Second
	// maxBeginWait is the longest wait one Begin asks for (the
	// coordinator's default limit).
	maxBeginWait = 30 * time.Second
	// deadlineMargin is kept free before a caller's deadline when waiting.
	deadlineMargin = 100 * time.Millisecond
)

type attemptKey struct{}

type attemptInfo struct {
	attempt  int32
	previous idempotencyv1.State
}

// AttemptFrom reports, inside a handler the interceptor runs (or a function
// Once runs), which attempt of its key this is within the record's
// generation (1 for the first) and the state the key was in before this
// attempt acquired it: STATE_UNSPECIFIED for a new key, STATE_FAILED_RETRYABLE
// after a retryable failure, STATE_EXPIRED after expiry, and STATE_UNKNOWN
// when an earlier attempt may have done the side effect: a handler that sees
// STATE_UNKNOWN checks the outside world before it repeats the side effect.
// ok is false outside such a call, and when the interceptor runs a handler
// unprotected (no key, or fail-open).
func AttemptFrom(ctx context.Context) (attempt int32, previous idempotencyv1.State, ok bool) {
	info, ok := ctx.Value(attemptKey{}).(attemptInfo)
	return info.attempt, info.previous, ok
}

func withAttempt(ctx context.Context, res *idempotencyv1.BeginResponse) context.Context {
	return context.WithValue(ctx, attemptKey{}, attemptInfo{attempt: res.GetRecord().GetAttempt(), previous: res.GetPreviousState()})
}

// beginWaiting calls Begin and, while another attempt holds the key, waits
// for it with Begin's wait until giveUp (zero: until ctx ends). It answers
// the last Begin answer, which is OUTCOME_IN_PROGRESS only when the time
// ran out or the key is held UNKNOWN.
//
// The first Begin asks for no wait, so a key held UNKNOWN (which only an
// operator can change) is answered at once rather than after a long poll.
func (c *Client) beginWaiting(ctx context.Context, req *idempotencyv1.BeginRequest, giveUp time.Time) (*idempotencyv1.BeginResponse, error) {
	req.Wait = nil
	res, err := c.Begin(ctx, req)
	if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS ||
		res.GetRecord().GetState() == idempotencyv1.State_STATE_UNKNOWN {
		return res, err
	}
	for {
		left := time.Duration(1<<63 - 1)
		if !giveUp.IsZero() {
			left = time.Until(giveUp)
		}
		if dl, ok := ctx.Deadline(); ok {
			left = min(left, time.Until(dl)-deadlineMargin)
		}
		if left <= 0 {
			return res, nil
		}
		asked := min(left, maxBeginWait)
		req.Wait = durationpb.New(asked)
		start := time.Now()
		if res, err = c.Begin(ctx, req); err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS ||
			res.GetRecord().GetState() == idempotencyv1.State_STATE_UNKNOWN {
			return res, err
		}
		// The coordinator answered well before the wait we asked for ran
		// out (its limit may be lower): pause as it suggests before asking
		// again.
		if time.Since(start) < asked/2 {
			t := time.NewTimer(min(res.GetRetryAfter().AsDuration(), asked))
			select {
			case <-ctx.Done():
				t.Stop()
				return res, nil
			case <-t.C:
			}
		}
	}
}

// lease is an acquisition this process holds.
type lease struct {
	c          *Client
	scope, key string
	token      string
	length     time.Duration        // the lease in force
	request    *durationpb.Duration // sent with heartbeats; nil: the policy's
}

func (c *Client) newLease(req *idempotencyv1.BeginRequest, res *idempotencyv1.BeginResponse) *lease {
	l := &lease{c: c, scope: req.GetScope(), key: req.GetKey(), token: res.GetLeaseToken(), request: req.GetLease()}
	if l.request != nil {
		l.length = l.request.AsDuration()
	} else if rec := res.GetRecord(); rec.GetLeaseExpiresAt() != nil && rec.GetUpdatedAt() != nil {
		l.length = rec.GetLeaseExpiresAt().AsTime().Sub(rec.GetUpdatedAt().AsTime())
	}
	if l.length <= 0 {
		l.length = defaultLease
	}
	return l
}

// leaseRequest is the lease Once and the interceptor ask for.
func (c *Client) leaseRequest() *durationpb.Duration {
	if c.opts.lease <= 0 {
		return nil
	}
	return durationpb.New(c.opts.lease)
}

// run calls fn with ctx carrying the attempt (see AttemptFrom) and
// heartbeats every third of the lease while fn runs. fn's context is
// cancelled with cause ErrLeaseLost when a heartbeat learns that the lease
// was lost; run then reports lost. If fn panics, run records the attempt
// UNKNOWN and panics again with the same value.
func (l *lease) run(ctx context.Context, res *idempotencyv1.BeginResponse, fn func(ctx context.Context)) (lost bool) {
	fctx, stop := l.keepAlive(withAttempt(ctx, res))
	defer func() {
		if p := recover(); p != nil {
			if !stop() {
				_ = l.finish(ctx, ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN,
					reason: failReason(fmt.Sprintf("panic: %v", p))})
			}
			panic(p)
		}
	}()
	fn(fctx)
	return stop()
}

// keepAlive heartbeats until stop is called. stop waits for a heartbeat in
// flight (so none lands after a later Fail) and reports whether the lease
// was lost; calling it again is harmless.
func (l *lease) keepAlive(ctx context.Context) (context.Context, func() (lost bool)) {
	fctx, cancel := context.WithCancelCause(ctx)
	quit, done := make(chan struct{}), make(chan struct{})
	var lost atomic.Bool
	interval := max(l.length/3, minHeartbeat)
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-t.C:
			}
			hctx, hcancel := context.WithTimeout(context.WithoutCancel(ctx), interval)
			err := l.heartbeat(hctx)
			hcancel()
			if leaseGone(err) {
				lost.Store(true)
				cancel(ErrLeaseLost)
				return
			}
		}
	}()
	var once sync.Once
	return fctx, func() bool {
		once.Do(func() {
			close(quit)
			<-done
			cancel(nil)
		})
		return lost.Load()
	}
}

func (l *lease) heartbeat(ctx context.Context) error {
	_, err := l.c.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: l.scope, Key: l.key,
		LeaseToken: l.token, Lease: l.request})
	if err != nil && !unreachable(err) {
		l.c.logger.WarnContext(ctx, "idempotency: heartbeat refused", "scope", l.scope, "key", l.key, "err", err)
	}
	return err
}

// leaseGone reports whether a Heartbeat's error means this attempt no
// longer holds the key: taken over (LEASE_LOST), ended (ALREADY_FINISHED,
// by an operator's Resolve, say) or forgotten (NOT_FOUND).
func leaseGone(err error) bool {
	switch status.Code(err) {
	case codes.FailedPrecondition, codes.NotFound:
		return true
	}
	return false
}

// ending is the call that ends an attempt: Complete when complete is set,
// else Fail.
type ending struct {
	complete *idempotencyv1.StoredResponse
	kind     idempotencyv1.FailureKind
	response *idempotencyv1.StoredResponse
	reason   string
}

func (e ending) String() string {
	if e.complete != nil {
		return "Complete"
	}
	return "Fail " + e.kind.String()
}

func (l *lease) send(ctx context.Context, e ending) error {
	if e.complete != nil {
		_, err := l.c.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: l.scope, Key: l.key,
			LeaseToken: l.token, Response: e.complete})
		return err
	}
	_, err := l.c.Fail(ctx, &idempotencyv1.FailRequest{Scope: l.scope, Key: l.key, LeaseToken: l.token,
		Kind: e.kind, Response: e.response, Reason: e.reason})
	return err
}

// finish ends the attempt with e. When the coordinator cannot be reached it
// answers nil and keeps trying in the background (see finishLater). When
// the coordinator refuses to store the response (too large, say), the
// attempt is recorded UNKNOWN instead, since its side effect happened. Other
// refusals (the lease was lost) are answered.
func (l *lease) finish(ctx context.Context, e ending) error {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	err := l.send(fctx, e)
	cancel()
	switch {
	case err == nil:
		return nil
	case unreachable(err):
		l.c.logger.WarnContext(ctx, "idempotency: coordinator unreachable at the end of an attempt; retrying in the background",
			"scope", l.scope, "key", l.key, "call", e.String(), "err", err)
		l.c.background(func(bg context.Context) { l.finishLater(bg, e) })
		return nil
	case status.Code(err) == codes.InvalidArgument && (e.complete != nil || e.response != nil):
		l.c.logger.ErrorContext(ctx, "idempotency: coordinator refused to store the response; recording the attempt UNKNOWN",
			"scope", l.scope, "key", l.key, "call", e.String(), "err", err)
		return l.finish(ctx, ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN,
			reason: failReason("response not stored: " + err.Error())})
	}
	l.c.logger.WarnContext(ctx, "idempotency: coordinator refused the end of an attempt",
		"scope", l.scope, "key", l.key, "call", e.String(), "err", err)
	return err
}

// finishLater retries e, heartbeating between tries so the key stays held,
// for up to one lease from now or until ctx (the Client's background
// context) ends.
func (l *lease) finishLater(ctx context.Context, e ending) {
	ctx, cancel := context.WithTimeout(ctx, l.length)
	defer cancel()
	delay := 100 * time.Millisecond
	t := time.NewTimer(delay)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
		case <-t.C:
			done, err := l.tryFinish(ctx, e)
			switch {
			case !done:
				delay = min(delay*2, 2*time.Second)
				t.Reset(delay)
				continue
			case err == nil:
				l.c.logger.InfoContext(ctx, "idempotency: ended an attempt in the background",
					"scope", l.scope, "key", l.key, "call", e.String())
				return
			case ctx.Err() == nil:
				l.c.logger.ErrorContext(ctx, "idempotency: coordinator refused the end of an attempt",
					"scope", l.scope, "key", l.key, "call", e.String(), "err", err)
				return
			}
		}
		l.c.logger.ErrorContext(ctx, "idempotency: gave up ending an attempt; the record will read UNKNOWN once its lease runs out",
			"scope", l.scope, "key", l.key, "call", e.String())
		return
	}
}

// tryFinish sends e once (with the Client's retries) and, while the
// coordinator stays unreachable, heartbeats; done is false when it is worth
// trying again.
func (l *lease) tryFinish(ctx context.Context, e ending) (done bool, err error) {
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	err = l.send(cctx, e)
	if err == nil || !unreachable(err) || ctx.Err() != nil {
		return true, err
	}
	if herr := l.heartbeat(cctx); leaseGone(herr) {
		return true, herr
	}
	return false, err
}
