package clients

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
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
	// releaseTimeout bounds the Begin (and its retries) that finds out
	// whether an unread Begin acquired the key (see releaseBegin).
	releaseTimeout = 3 * time.Second
)

// ReleaseReason is the failure_reason with which Once, the interceptor and
// HTTPMiddleware end, with Fail ABANDONED, an acquisition nobody will act
// on: the caller gave up (its context ended, or the Begin failed without a
// readable answer) before the handler ran. The key is then as if that
// attempt never was.
const ReleaseReason = "caller gave up before the handler ran"

type attemptKey struct{}

// attemptState is the attempt a context carries: its lease and whether its
// function marked the start of its side effect.
type attemptState struct {
	lease  Lease
	marked atomic.Bool
	// holder is the acquisition, for Checkpoint.
	holder *lease
	// checkpoints holds the attempt's checkpoints (see Checkpoint).
	checkpoints checkpointState
}

func attemptOf(ctx context.Context) *attemptState {
	a, _ := ctx.Value(attemptKey{}).(*attemptState)
	return a
}

// Lease describes the acquisition that a handler under
// UnaryServerInterceptor or HTTPMiddleware, or a function run by
// Client.Once, runs under.
// With it the handler can fence its own write: store (Key, Generation) or
// Token with its side effect under a unique constraint, so that a second
// attempt of the same generation cannot apply it twice even if the
// coordinator's lease was lost meanwhile (see the LeaseFrom example).
type Lease struct {
	// Scope is the coordinator scope (the full method name, under the
	// interceptor; "http" or WithHTTPScope's, under HTTPMiddleware).
	Scope string
	// Key is the idempotency key as stored, after principal folding (see
	// WithPrincipal, WithHTTPPrincipal).
	Key string
	// Token is this acquisition's lease token, a fencing token: a later
	// acquisition of the key gets another one.
	Token string
	// Generation counts restarts of the key after expiry (1 for the
	// first); Attempt counts acquisitions within the generation (1 for the
	// first).
	Generation, Attempt int32
	// Previous is the state the key was in before this acquisition (see
	// AttemptFrom).
	Previous idempotencyv1.State
	// Uncertain reports that an earlier attempt of this generation may have
	// done the side effect (Record.uncertain); Previous is then
	// STATE_UNKNOWN.
	Uncertain bool
}

// LeaseFrom returns the lease of the attempt that ctx belongs to: inside a
// handler the interceptor or HTTPMiddleware runs (an HTTP handler passes
// r.Context()), or a function Once runs. ok is false outside such a call,
// and when the interceptor or the middleware runs a handler unprotected (no
// key, or fail-open).
func LeaseFrom(ctx context.Context) (Lease, bool) {
	if a := attemptOf(ctx); a != nil {
		return a.lease, true
	}
	return Lease{}, false
}

// MarkSideEffect tells Once, the interceptor or HTTPMiddleware that the
// attempt ctx belongs to is about to take its first irreversible step (charge the card, send the
// mail). Call it just before that step. From then on, any error or panic of
// the attempt ends it FAILURE_KIND_UNKNOWN, whatever its gRPC code and
// whatever WithFailureKinds says, except a *FailureError whose Kind is
// FAILURE_KIND_REPLAYABLE, which is stored as such: the next attempt then
// sees previous state STATE_UNKNOWN and checks the outside world before it
// repeats the step. Before the mark, errors are classified by their code as
// usual. Under HTTPMiddleware, after the mark every response that would not
// be stored (any status but 2xx and 3xx and the replayable ones, 404, 409 and
// 422 by default) ends the attempt UNKNOWN. Outside an attempt (no key, fail-open, plain calls) it does
// nothing. Calling it more than once is harmless.
func MarkSideEffect(ctx context.Context) {
	if a := attemptOf(ctx); a != nil {
		a.marked.Store(true)
	}
}

// AttemptFrom reports, inside a handler the interceptor or HTTPMiddleware
// runs (or a function Once runs), which attempt of its key this is within the record's
// generation (1 for the first) and the state the key was in before this
// attempt acquired it: STATE_UNSPECIFIED for a new key, STATE_FAILED_RETRYABLE
// after a retryable failure, STATE_EXPIRED after expiry, and STATE_UNKNOWN
// when an earlier attempt of the generation may have done the side effect,
// even if a later one failed retryably or was abandoned in between: a
// handler that sees STATE_UNKNOWN checks the outside world before it repeats
// the side effect.
// ok is false outside such a call, and when the interceptor or the
// middleware runs a handler unprotected (no key, or fail-open).
func AttemptFrom(ctx context.Context) (attempt int32, previous idempotencyv1.State, ok bool) {
	if a := attemptOf(ctx); a != nil {
		return a.lease.Attempt, a.lease.Previous, true
	}
	return 0, 0, false
}

// beginWaiting calls Begin and, while another attempt holds the key, waits
// for it with Begin's wait until giveUp (zero: until ctx ends). It answers
// the last Begin answer, which is OUTCOME_IN_PROGRESS only when the time
// ran out or the key is held UNKNOWN.
//
// The first Begin asks for no wait, so a key held UNKNOWN (which only an
// operator can change) is answered at once rather than after a long poll.
//
// sent is the local time at which the last Begin was sent: a lease it
// granted runs at least until sent plus the lease, by the local clock.
func (c *Client) beginWaiting(ctx context.Context, req *idempotencyv1.BeginRequest, giveUp time.Time) (res *idempotencyv1.BeginResponse, sent time.Time, err error) {
	req.Wait = nil
	defer func() {
		// A refusal is an answer; a call cut off, timed out or cancelled
		// (the caller giving up) may have acquired the key unread.
		if err != nil && unanswered(err) {
			c.releaseBegin(ctx, req, err)
		}
	}()
	sent = time.Now()
	res, err = c.Begin(ctx, req)
	if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS ||
		res.GetRecord().GetState() == idempotencyv1.State_STATE_UNKNOWN {
		return res, sent, err
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
			return res, sent, nil
		}
		asked := min(left, maxBeginWait)
		req.Wait = durationpb.New(asked)
		start := time.Now()
		sent = start
		if res, err = c.Begin(ctx, req); err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS ||
			res.GetRecord().GetState() == idempotencyv1.State_STATE_UNKNOWN {
			return res, sent, err
		}
		// The coordinator answered well before the wait we asked for ran
		// out (its limit may be lower): pause as it suggests before asking
		// again.
		if time.Since(start) < asked/2 {
			t := time.NewTimer(min(res.GetRetryAfter().AsDuration(), asked))
			select {
			case <-ctx.Done():
				t.Stop()
				return res, sent, nil
			case <-t.C:
			}
		}
	}
}

// releaseBegin releases the acquisition that a Begin of req may have made
// although its answer was never read: the caller gave up during the call,
// or it failed without a readable answer. It sends Begin again with the
// same attempt_id and no wait, on a context detached from ctx and bounded
// by releaseTimeout, and when that answers ACQUIRED (the acquisition is
// this attempt's) ends it at once with Fail ABANDONED, reason
// ReleaseReason: the key is then as if the attempt never was. This happens
// before releaseBegin returns, except when the caller is still there and
// the coordinator could not be reached (err is UNAVAILABLE): then in the
// background, so the caller's answer is not delayed (see Shutdown). (A
// DEADLINE_EXCEEDED may arrive a moment before ctx itself ends: it is the
// caller giving up.) If the coordinator stays unreachable, the
// acquisition's lease lapses and the key reads UNKNOWN.
func (c *Client) releaseBegin(ctx context.Context, req *idempotencyv1.BeginRequest, err error) {
	req = proto.CloneOf(req)
	req.Wait = nil
	if ctx.Err() == nil && status.Code(err) == codes.Unavailable {
		c.background(func(bg context.Context) { c.release(bg, req) })
		return
	}
	c.release(context.WithoutCancel(ctx), req)
}

func (c *Client) release(ctx context.Context, req *idempotencyv1.BeginRequest) {
	bctx, cancel := context.WithTimeout(ctx, releaseTimeout)
	sent := time.Now()
	res, err := c.Begin(bctx, req)
	cancel()
	switch {
	case err != nil:
		c.logger.WarnContext(ctx, "idempotency: could not release an acquisition nobody will act on; "+
			"if it was made, the key reads UNKNOWN once its lease runs out",
			"scope", req.GetScope(), "key", req.GetKey(), "err", err)
	case res.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED:
		_ = c.newLease(req, res, sent).release(ctx)
	}
}

// release ends the acquisition l, which nobody will act on (the handler
// did not run), with Fail ABANDONED, reason ReleaseReason.
func (l *lease) release(ctx context.Context) error {
	return l.finish(ctx, ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, reason: ReleaseReason})
}

// lease is an acquisition this process holds.
type lease struct {
	c          *Client
	scope, key string
	token      string
	length     time.Duration        // the lease in force
	request    *durationpb.Duration // sent with heartbeats; nil: the policy's
	// sent is when the Begin that granted the lease was sent (local clock).
	sent    time.Time
	attempt *attemptState
}

// newLease is the lease that res (the answer to req, sent at sent)
// granted.
func (c *Client) newLease(req *idempotencyv1.BeginRequest, res *idempotencyv1.BeginResponse, sent time.Time) *lease {
	rec := res.GetRecord()
	l := &lease{c: c, scope: req.GetScope(), key: req.GetKey(), token: res.GetLeaseToken(), request: req.GetLease(),
		sent: sent, attempt: &attemptState{lease: Lease{Scope: req.GetScope(), Key: req.GetKey(), Token: res.GetLeaseToken(),
			Generation: rec.GetGeneration(), Attempt: rec.GetAttempt(), Previous: res.GetPreviousState(),
			Uncertain: rec.GetUncertain()}}}
	l.attempt.holder = l
	l.attempt.checkpoints.resumed = rec.GetCheckpoint()
	if l.request != nil {
		l.length = l.request.AsDuration()
	} else {
		l.length = leaseLength(rec)
	}
	if l.length <= 0 {
		l.length = defaultLease
	}
	return l
}

// leaseLength is the lease a Begin or Heartbeat answer granted: from its
// updated_at (the call's time) to lease_expires_at; 0 when not told.
func leaseLength(rec *idempotencyv1.Record) time.Duration {
	if rec.GetLeaseExpiresAt() == nil || rec.GetUpdatedAt() == nil {
		return 0
	}
	return rec.GetLeaseExpiresAt().AsTime().Sub(rec.GetUpdatedAt().AsTime())
}

// margin is how long before the lease would run out, by the local clock,
// fn's context is cancelled when no Heartbeat confirmed it.
func (l *lease) margin() time.Duration { return max(l.length/10, minHeartbeat) }

// leaseRequest is the lease Once and the interceptor ask for.
func (c *Client) leaseRequest() *durationpb.Duration {
	if c.opts.lease <= 0 {
		return nil
	}
	return durationpb.New(c.opts.lease)
}

// runEnd is how run ended.
type runEnd uint8

const (
	// runDone: fn ran and returned; its outcome is to be recorded.
	runDone runEnd = iota
	// runLost: a heartbeat learnt that the lease was lost; the new holder
	// records the outcome.
	runLost
	// runNotStarted: the lease could not be confirmed before fn would have
	// started, so fn did not run.
	runNotStarted
	// runCallerGone: the caller's context ended before fn would have
	// started, so fn did not run; the caller releases the acquisition.
	runCallerGone
)

// run calls fn with ctx carrying the attempt (see AttemptFrom, LeaseFrom,
// MarkSideEffect) and heartbeats while fn runs. fn's context is cancelled
// with cause ErrLeaseLost when a heartbeat learns that the lease was lost
// (run then answers runLost), and with cause ErrLeaseUnconfirmed when no
// heartbeat could confirm the lease before it would run out by the local
// clock. If fn panics, run records the attempt UNKNOWN and panics again
// with the same value.
//
// When the Begin that granted the lease took long (a wait for another
// attempt), run first confirms the lease with a Heartbeat; if the lease
// cannot be confirmed for long enough to start fn, fn does not run. Nor does
// it when ctx has ended before fn would start (runCallerGone).
func (l *lease) run(ctx context.Context, fn func(ctx context.Context)) runEnd {
	if ctx.Err() != nil {
		return runCallerGone
	}
	confirmed := l.sent
	if time.Since(confirmed) > l.length/3 {
		sent := time.Now()
		hctx, hcancel := context.WithTimeout(context.WithoutCancel(ctx), max(l.length/3, minHeartbeat))
		length, err := l.heartbeat(hctx)
		hcancel()
		switch {
		case err == nil:
			confirmed = sent
			if length > 0 {
				l.length = length
			}
		case leaseGone(err):
			return runLost
		}
	}
	if time.Until(confirmed.Add(l.length-l.margin())) <= 0 {
		return runNotStarted
	}
	if ctx.Err() != nil {
		return runCallerGone
	}
	fctx, stop := l.keepAlive(context.WithValue(ctx, attemptKey{}, l.attempt), confirmed)
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
	if stop() {
		return runLost
	}
	return runDone
}

// marked reports whether fn called MarkSideEffect.
func (l *lease) marked() bool { return l.attempt.marked.Load() }

// keepAlive heartbeats until stop is called: a third of the lease after the
// last confirmation, and more often while the coordinator cannot be
// reached. The returned context is cancelled with cause ErrLeaseLost when a
// heartbeat learns that the lease was lost, and with cause
// ErrLeaseUnconfirmed when no heartbeat confirmed the lease before it would
// run out by the local clock (minus a margin): two holders never run at
// once because one of them was cut off from the coordinator. stop waits
// for a heartbeat in flight (so none lands after a later Fail) and reports
// whether the lease was lost; calling it again is harmless.
func (l *lease) keepAlive(ctx context.Context, confirmed time.Time) (context.Context, func() (lost bool)) {
	fctx, cancel := context.WithCancelCause(ctx)
	quit, done := make(chan struct{}), make(chan struct{})
	var lost atomic.Bool
	interval := max(l.length/3, minHeartbeat)
	retry := max(interval/4, minHeartbeat)

	// until is the local time at which fn's context is cancelled unless a
	// heartbeat confirms the lease again; the watch timer enforces it on
	// its own goroutine, so a heartbeat that hangs cannot delay it.
	var until atomic.Int64
	until.Store(confirmed.Add(l.length - l.margin()).UnixNano())
	var watch *time.Timer
	watch = time.AfterFunc(math.MaxInt64, func() {
		if left := time.Until(time.Unix(0, until.Load())); left > 0 {
			watch.Reset(left)
			return
		}
		if context.Cause(fctx) == nil {
			l.c.logger.WarnContext(ctx, "idempotency: could not confirm the lease before it would run out; cancelling the attempt",
				"scope", l.scope, "key", l.key)
		}
		cancel(ErrLeaseUnconfirmed)
	})
	watch.Reset(time.Until(time.Unix(0, until.Load())))

	go func() {
		defer close(done)
		t := time.NewTimer(time.Until(confirmed.Add(interval)))
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-t.C:
			}
			sent := time.Now()
			hctx, hcancel := context.WithTimeout(context.WithoutCancel(ctx), interval)
			length, err := l.heartbeat(hctx)
			hcancel()
			switch {
			case err == nil:
				if length <= 0 {
					length = l.length
				}
				until.Store(sent.Add(length - l.margin()).UnixNano())
				t.Reset(time.Until(sent.Add(max(length/3, minHeartbeat))))
			case leaseGone(err):
				lost.Store(true)
				cancel(ErrLeaseLost)
				return
			default:
				t.Reset(retry)
			}
		}
	}()
	var once sync.Once
	return fctx, func() bool {
		once.Do(func() {
			watch.Stop()
			close(quit)
			<-done
			cancel(nil)
		})
		return lost.Load()
	}
}

// heartbeat extends the lease and answers the lease it was extended by (0
// when the answer does not tell).
func (l *lease) heartbeat(ctx context.Context) (time.Duration, error) {
	res, err := l.c.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: l.scope, Key: l.key,
		LeaseToken: l.token, Lease: l.request})
	if err != nil {
		if !unreachable(err) {
			l.c.logger.WarnContext(ctx, "idempotency: heartbeat refused", "scope", l.scope, "key", l.key, "err", err)
		}
		return 0, err
	}
	return leaseLength(res.GetRecord()), nil
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

// finish ends the attempt with e (a Fail ABANDONED as Fail RETRYABLE once
// the attempt recorded a checkpoint). When the coordinator cannot be reached it
// answers nil and keeps trying in the background (see finishLater). When
// the coordinator refuses to store the response (too large, say), the
// attempt is recorded UNKNOWN instead, since its side effect happened. Other
// refusals (the lease was lost) are answered.
func (l *lease) finish(ctx context.Context, e ending) error {
	if e.kind == idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED && l.attempt.checkpoints.recorded() {
		// The attempt has acted: the coordinator refuses to abandon it.
		// RETRYABLE keeps the checkpoint for the next attempt.
		e.kind = idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	err := l.send(fctx, e)
	cancel()
	switch {
	case err == nil:
		return nil
	case l.abandonRefused(e, err):
		return l.finish(ctx, retryableInstead(e))
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
			if done && l.abandonRefused(e, err) {
				e = retryableInstead(e)
				done, err = l.tryFinish(ctx, e)
			}
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

// abandonRefused reports whether err is the coordinator's refusal of e, a
// Fail ABANDONED, because the attempt recorded a checkpoint this library
// did not see (ledger.Store.CheckpointTx in the handler's own transaction,
// say), and then notes that the attempt recorded one.
func (l *lease) abandonRefused(e ending, err error) bool {
	if e.kind != idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED ||
		errorReason(err) != idempotencyv1.ErrorReason_ERROR_REASON_CHECKPOINT_RECORDED {
		return false
	}
	l.attempt.checkpoints.markRecorded()
	return true
}

// retryableInstead is the ending of an attempt that may not be abandoned
// (it recorded a checkpoint): RETRYABLE, which keeps the checkpoint for
// the next attempt.
func retryableInstead(e ending) ending {
	return ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, reason: e.reason}
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
	// ALREADY_FINISHED: the call did land and only its reply was lost (or
	// another ending did); the next try of e tells which.
	if _, herr := l.heartbeat(cctx); leaseGone(herr) && errorReason(herr) != idempotencyv1.ErrorReason_ERROR_REASON_ALREADY_FINISHED {
		return true, herr
	}
	return false, err
}
