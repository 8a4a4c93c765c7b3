package server

import (
	"context"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

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
		Policy: stateMachinePolicy(pol),
	}

	res, err := s.store.BeginWait(ctx, p, req.GetWait().AsDuration())
	s.metrics.observeBegin(req.GetScope(), res, err)
	if err != nil {
		noteCall(ctx, p.ID.Tenant, p.ID.Scope, "")
		return nil, s.status(ctx, err)
	}
	noteCall(ctx, p.ID.Tenant, p.ID.Scope, outcomeLabels[res.Outcome])
	out := beginResponse(req, res)
	if res.Outcome == statemachine.OutcomeAcquired {
		out.Ttl, out.FailureTtl = optDuration(res.Record.TTL), optDuration(res.Record.FailureTTL)
	}
	return out, nil
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
		Token: req.GetLeaseToken(), FailureKind: statemachine.FailureKind(req.GetKind()), //nolint:gosec // protovalidate (enum.defined_only) admits only the FailureKind values, all below 256
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

// Heartbeat extends the current attempt's lease, and records its
// checkpoint when it carries one; see idempotency.v1.Coordinator.
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
	ev := statemachine.Event{Kind: statemachine.EventHeartbeat, Token: req.GetLeaseToken(), Lease: lease}
	if c := req.GetCheckpoint(); c != nil {
		ev.Checkpoint = &statemachine.Checkpoint{Phase: c.GetPhase(), Data: c.GetData()}
	}
	res, err := s.finish(ctx, req.GetScope(), req.GetKey(), ev)
	if err != nil {
		return nil, err
	}
	if ev.Checkpoint != nil {
		s.metrics.observeCheckpoint(req.GetScope())
	}
	return &idempotencyv1.HeartbeatResponse{Record: recordToProto(req.GetScope(), req.GetKey(), res.Record)}, nil
}

// finish applies a Complete, Fail or Heartbeat, counts it, and returns the
// result or a gRPC status error.
func (s *Server) finish(ctx context.Context, scope, key string, ev statemachine.Event) (*ledger.Result, error) {
	id := identity(ctx, scope, key)
	res, err := s.store.Finish(ctx, &ledger.FinishParams{ID: id, Event: ev,
		Policy: stateMachinePolicy(s.policies.Load().For(scope))})
	s.metrics.observeFinish(scope, res, err)
	noteCall(ctx, id.Tenant, scope, "")
	if err != nil {
		return nil, s.status(ctx, err)
	}
	return res, nil
}

// stateMachinePolicy is the part of a scope's policy that statemachine.Next
// decides with.
func stateMachinePolicy(pol Policy) statemachine.Policy {
	return statemachine.Policy{OnExpired: pol.OnExpired, OnUnknown: pol.OnUnknown, MaxAttempts: pol.MaxAttempts}
}

func (s *Server) status(ctx context.Context, err error) error {
	return toStatus(ctx, s.logger, err)
}
