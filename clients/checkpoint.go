package clients

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// ErrNoAttempt is the error of Checkpoint called outside an attempt: not
// inside a handler that UnaryServerInterceptor or HTTPMiddleware runs
// protected by a key, nor inside a function Once runs.
var ErrNoAttempt = errors.New("clients: Checkpoint outside an attempt (no handler or Once function with an idempotency key)")

// checkpointState is what an attempt knows of its key's checkpoint.
type checkpointState struct {
	mu sync.Mutex
	// resumed is the checkpoint the Begin that acquired the key returned
	// (an earlier attempt's), or nil.
	resumed *idempotencyv1.Checkpoint
	// own is the last checkpoint this attempt recorded, or nil.
	own *idempotencyv1.Checkpoint
	// elsewhere: the coordinator said the attempt recorded one, not
	// through Checkpoint.
	elsewhere bool
}

// recorded reports whether the attempt recorded a checkpoint.
func (s *checkpointState) recorded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.own != nil || s.elsewhere
}

// markRecorded notes that the attempt recorded a checkpoint by other means
// than Checkpoint.
func (s *checkpointState) markRecorded() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.elsewhere = true
}

func (s *checkpointState) last() *idempotencyv1.Checkpoint {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.own != nil {
		return s.own
	}
	return s.resumed
}

// Checkpoint records that the attempt ctx belongs to has finished the step
// phase of a multi-step operation, with data the next attempt needs to
// resume after it (a charge id, say): a Heartbeat with the attempt's lease
// token and the checkpoint, which also extends the lease. If the attempt
// fails (its lease lapses, it fails RETRYABLE or UNKNOWN, its process
// dies), the next attempt of the key finds the checkpoint with
// CheckpointFrom and skips the steps before it. Call it after the step's
// effect is durable, before the next step.
//
// ctx is the context of a handler that UnaryServerInterceptor or
// HTTPMiddleware runs protected by a key (an HTTP handler passes
// r.Context()), or of a function Once runs; elsewhere Checkpoint returns
// ErrNoAttempt and sends nothing. When another attempt took the key over
// (or the record ended meanwhile) it returns an error that matches
// ErrLeaseLost and is the coordinator's status (FAILED_PRECONDITION); the
// handler should stop. A phase must be 1-128 printable bytes and data at
// most the coordinator's limits.max_checkpoint_bytes (64 KiB by default):
// otherwise the coordinator answers INVALID_ARGUMENT and records nothing.
//
// Once an attempt recorded a checkpoint it has acted: when the library
// would end it with Fail ABANDONED (a handler error of the ABANDONED class,
// such as INVALID_ARGUMENT), it ends it FAILURE_KIND_RETRYABLE instead,
// which keeps the checkpoint for the next attempt (also after a checkpoint
// recorded otherwise, with ledger.Store.CheckpointTx: when the coordinator
// refuses the ABANDONED with CHECKPOINT_RECORDED). Uncertainty still
// applies to the work after the last checkpoint: MarkSideEffect before a
// step's irreversible effect as without checkpoints.
func Checkpoint(ctx context.Context, phase string, data []byte) error {
	a := attemptOf(ctx)
	if a == nil || a.holder == nil {
		return ErrNoAttempt
	}
	l := a.holder
	c := &idempotencyv1.Checkpoint{Phase: phase, Data: bytes.Clone(data)}
	res, err := l.c.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: l.scope, Key: l.key,
		LeaseToken: l.token, Lease: l.request, Checkpoint: c})
	if err != nil {
		if leaseGone(err) {
			return fmt.Errorf("%w: %w", ErrLeaseLost, err)
		}
		return err
	}
	if got := res.GetRecord().GetCheckpoint(); got != nil {
		c.At = got.GetAt()
	}
	a.checkpoints.mu.Lock()
	defer a.checkpoints.mu.Unlock()
	// Concurrent Checkpoint calls of one attempt may be answered in
	// another order than the coordinator wrote them: the one it wrote
	// last (the latest coordinator time) stays.
	if own := a.checkpoints.own; own == nil || c.GetAt() == nil || own.GetAt() == nil || !c.GetAt().AsTime().Before(own.GetAt().AsTime()) {
		a.checkpoints.own = c
	}
	return nil
}

// CheckpointFrom returns the checkpoint of the attempt ctx belongs to (see
// Checkpoint): the last one this attempt recorded (of calls made at once,
// the one the coordinator wrote last), or else the one the
// attempt resumes after, which an earlier attempt of the key recorded
// (returned by the Begin that acquired the key). ok is false when there is
// none, and outside an attempt. data is a copy.
func CheckpointFrom(ctx context.Context) (phase string, data []byte, ok bool) {
	a := attemptOf(ctx)
	if a == nil {
		return "", nil, false
	}
	c := a.checkpoints.last()
	if c == nil {
		return "", nil, false
	}
	return c.GetPhase(), bytes.Clone(c.GetData()), true
}
