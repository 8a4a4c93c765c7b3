package server

import (
	"context"
	"errors"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// DefaultTenant is the tenant of every caller while auth is disabled.
const DefaultTenant = "default"

// waitMargin is kept free before a caller's deadline when Begin waits, so
// the IN_PROGRESS answer arrives before the deadline does.
const waitMargin = 50 * time.Millisecond

// leaseSlack is added to a lease expiry a waiting Begin wakes up at, so the
// lease has surely run out when it looks again.
const leaseSlack = 5 * time.Millisecond

// While the store does not trust change notifications (--notifications=off,
// a listener that fell behind or lost its connection), a waiting Begin
// re-reads the record on a backoff: pollFirst after its first read, doubling
// up to pollMax. A holder that finishes quickly is seen quickly, and a long
// wait costs about one read a second.
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

func identity(ctx context.Context, scope, key string) ledger.Identity {
	return ledger.Identity{Tenant: tenantFrom(ctx), Scope: scope, Key: key}
}

// Begin claims a key; see idempotency.v1.Coordinator.
func (s *Server) Begin(ctx context.Context, req *idempotencyv1.BeginRequest) (*idempotencyv1.BeginResponse, error) {
	pols := s.policies.Load()
	pol := pols.For(req.GetScope())
	if err := s.validateBegin(req, pol, pols.Limits()); err != nil {
		return nil, s.status(ctx, err)
	}
	if err := authorizeScope(ctx, req.GetScope()); err != nil {
		return nil, err
	}
	ttl, lease := pol.TTL, pol.Lease
	if req.GetTtl() != nil {
		ttl = req.GetTtl().AsDuration()
	}
	if req.GetLease() != nil {
		lease = req.GetLease().AsDuration()
	}
	p := &ledger.BeginParams{
		ID: identity(ctx, req.GetScope(), req.GetKey()),
		Event: statemachine.Event{
			Fingerprint:          req.GetFingerprint(),
			AttemptID:            req.GetAttemptId(),
			AcceptSchemaVersions: req.GetAcceptSchemaVersions(),
			TTL:                  ttl,
			FailureTTL:           min(pol.FailureTTL, ttl),
			Lease:                lease,
		},
		Policy: statemachine.Policy{OnExpired: pol.OnExpired, OnUnknown: pol.OnUnknown, MaxAttempts: pol.MaxAttempts},
	}

	wait := req.GetWait().AsDuration()
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(dl)-waitMargin)
	}
	var res *ledger.Result
	var err error
	if wait <= 0 {
		res, err = s.store.Begin(ctx, p)
	} else {
		// The re-reads of a waiting Begin are Begins: one whose answer is
		// lost (the database unreachable after its commit) may have
		// acquired the key. They all offer the same lease token, so the
		// next finds that acquisition its own and answers it, instead of
		// waiting for it to lapse and taking the key a second time.
		p.Event.NewToken = ledger.NewLeaseToken()
		res, err = s.beginWaiting(ctx, p, time.Now().Add(wait))
	}
	s.metrics.observeBegin(req.GetScope(), res, err)
	if err != nil {
		return nil, s.status(ctx, err)
	}
	logging.AddFields(ctx, logging.Fields{"tenant", p.ID.Tenant, "scope", p.ID.Scope, "outcome", outcomeLabels[res.Outcome]})
	return beginResponse(req, res), nil
}

// beginWaiting repeats Begin while another attempt holds the key, waking on
// every committed change of the record and at its lease expiry, until
// giveUp. It holds no row lock or connection while it waits.
func (s *Server) beginWaiting(ctx context.Context, p *ledger.BeginParams, giveUp time.Time) (*ledger.Result, error) {
	changed, unsubscribe := s.store.Subscribe(p.ID)
	defer unsubscribe()
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	var last *ledger.Result
	var poll time.Duration
	var watched [2]int32 // generation and attempt last marked watched
	for {
		res, err := s.store.Begin(ctx, p)
		fresh := err == nil
		left := time.Until(giveUp)
		if err != nil {
			// A re-read that finds the database unreachable (waiters poll
			// while change notifications cannot be trusted, an outage
			// included) keeps waiting on what the last read found; the
			// outage is the answer only if it outlasts the wait.
			// Its own lost acquisition, lapsed, ends the wait: waiting on
			// could only take the key again.
			if last == nil || left <= 0 || !errors.Is(err, ledger.ErrUnavailable) || errors.Is(err, ledger.ErrLostAcquisition) {
				return nil, err
			}
			res = last
		}
		last = res
		// A record held UNKNOWN (on_unknown: hold) waits for an operator,
		// not for an attempt: answer at once.
		if res.Outcome != statemachine.OutcomeInProgress || res.Record.State == statemachine.StateUnknown || left <= 0 {
			return res, nil
		}
		sleep := left
		if rec := res.Record; rec.State == statemachine.StateInProgress {
			sleep = min(sleep, rec.LeaseExpiresAt.Sub(res.Now)+leaseSlack)
			// Only changes someone waits for are notified: say so, then
			// read again if the attempt ended meanwhile. (With the
			// database unreachable, wait on the last read, as above.)
			// Mark each attempt once: every re-read (a poll, a wake-up)
			// would otherwise write the row again.
			if attempt := [2]int32{rec.Generation, rec.Attempt}; fresh && attempt != watched {
				held, err := s.store.Watch(ctx, p.ID)
				if err != nil && !errors.Is(err, ledger.ErrUnavailable) {
					return nil, err
				}
				if err == nil && !held {
					continue
				}
				if err == nil {
					watched = attempt
				}
			}
		}
		if s.store.NotificationStats().Polling {
			poll = nextPoll(poll)
			sleep = min(sleep, poll)
		}
		timer.Reset(max(sleep, 0))
		select {
		case <-changed:
			if !timer.Stop() {
				<-timer.C
			}
		case <-timer.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func beginResponse(req *idempotencyv1.BeginRequest, res *ledger.Result) *idempotencyv1.BeginResponse {
	out := &idempotencyv1.BeginResponse{
		Outcome: idempotencyv1.Outcome(res.Outcome),
		Record:  recordToProto(req.GetScope(), req.GetKey(), res.Record),
	}
	switch res.Outcome {
	case statemachine.OutcomeAcquired:
		out.LeaseToken = res.Record.LeaseToken
		out.PreviousState = idempotencyv1.State(res.PreviousState)
	case statemachine.OutcomeInProgress:
		out.RetryAfter = optDuration(res.RetryAfter)
	}
	return out
}

// Complete ends an attempt successfully; see idempotency.v1.Coordinator.
func (s *Server) Complete(ctx context.Context, req *idempotencyv1.CompleteRequest) (*idempotencyv1.CompleteResponse, error) {
	if err := s.validateComplete(req, s.policies.Load().Limits()); err != nil {
		return nil, s.status(ctx, err)
	}
	if err := authorizeScope(ctx, req.GetScope()); err != nil {
		return nil, err
	}
	res, err := s.finish(ctx, req.GetScope(), req.GetKey(), statemachine.Event{Kind: statemachine.EventComplete, Token: req.GetLeaseToken(),
		Response: responseFromProto(req.GetResponse())})
	if err != nil {
		return nil, err
	}
	return &idempotencyv1.CompleteResponse{Record: recordToProto(req.GetScope(), req.GetKey(), res.Record)}, nil
}

// Fail ends an attempt with a failure; see idempotency.v1.Coordinator.
func (s *Server) Fail(ctx context.Context, req *idempotencyv1.FailRequest) (*idempotencyv1.FailResponse, error) {
	if err := s.validateFail(req, s.policies.Load().Limits()); err != nil {
		return nil, s.status(ctx, err)
	}
	if err := authorizeScope(ctx, req.GetScope()); err != nil {
		return nil, err
	}
	res, err := s.finish(ctx, req.GetScope(), req.GetKey(), statemachine.Event{Kind: statemachine.EventFail,
		Token: req.GetLeaseToken(), FailureKind: statemachine.FailureKind(req.GetKind()),
		Response: responseFromProto(req.GetResponse()), Reason: req.GetReason()})
	if err != nil {
		return nil, err
	}
	out := &idempotencyv1.FailResponse{}
	if res.Exists {
		out.Record = recordToProto(req.GetScope(), req.GetKey(), res.Record)
	}
	return out, nil
}

// Lookup reads a record as in effect now; see idempotency.v1.Coordinator.
func (s *Server) Lookup(ctx context.Context, req *idempotencyv1.LookupRequest) (*idempotencyv1.LookupResponse, error) {
	if err := s.validateLookup(req, s.policies.Load().Limits()); err != nil {
		return nil, s.status(ctx, err)
	}
	if err := authorizeScope(ctx, req.GetScope()); err != nil {
		return nil, err
	}
	rec, _, err := s.store.Lookup(ctx, identity(ctx, req.GetScope(), req.GetKey()))
	if err != nil {
		return nil, s.status(ctx, err)
	}
	return &idempotencyv1.LookupResponse{Record: recordToProto(req.GetScope(), req.GetKey(), rec)}, nil
}

// Heartbeat extends the current attempt's lease; see
// idempotency.v1.Coordinator.
func (s *Server) Heartbeat(ctx context.Context, req *idempotencyv1.HeartbeatRequest) (*idempotencyv1.HeartbeatResponse, error) {
	pols := s.policies.Load()
	if err := s.validateHeartbeat(req, pols.Limits()); err != nil {
		return nil, s.status(ctx, err)
	}
	if err := authorizeScope(ctx, req.GetScope()); err != nil {
		return nil, err
	}
	lease := pols.For(req.GetScope()).Lease
	if req.GetLease() != nil {
		lease = req.GetLease().AsDuration()
	}
	res, err := s.finish(ctx, req.GetScope(), req.GetKey(), statemachine.Event{Kind: statemachine.EventHeartbeat,
		Token: req.GetLeaseToken(), Lease: lease})
	if err != nil {
		return nil, err
	}
	return &idempotencyv1.HeartbeatResponse{Record: recordToProto(req.GetScope(), req.GetKey(), res.Record)}, nil
}

// finish applies a Complete, Fail or Heartbeat, counts it, and returns the
// result or a gRPC status error.
func (s *Server) finish(ctx context.Context, scope, key string, ev statemachine.Event) (*ledger.Result, error) {
	id := identity(ctx, scope, key)
	res, err := s.store.Finish(ctx, &ledger.FinishParams{ID: id, Event: ev})
	s.metrics.observeFinish(scope, res, err)
	if err != nil {
		return nil, s.status(ctx, err)
	}
	logging.AddFields(ctx, logging.Fields{"tenant", id.Tenant, "scope", scope})
	return res, nil
}

func (s *Server) status(ctx context.Context, err error) error {
	return toStatus(ctx, s.logger, err)
}
