package ledger

import (
	"context"
	"errors"
	"fmt"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/statemachine"
)

// Limits of CheckpointTx, as the coordinator's defaults bound a
// Heartbeat's checkpoint.
const (
	// MaxPhaseBytes bounds a checkpoint's phase.
	MaxPhaseBytes = 128
	// MaxCheckpointBytes bounds a checkpoint's data (the coordinator's
	// default limits.max_checkpoint_bytes).
	MaxCheckpointBytes = 64 << 10
)

// CheckpointParams are the inputs of CheckpointTx.
type CheckpointParams struct {
	// ID is the record, its Tenant as the coordinator stores it
	// (DefaultTenant for every caller while auth is off).
	ID Identity
	// Token is the holder's lease token (the one its Begin returned; see
	// clients.LeaseFrom).
	Token string
	// Phase (1-MaxPhaseBytes printable bytes) and Data (at most
	// MaxCheckpointBytes) are the checkpoint.
	Phase string
	Data  []byte
	// Lease, when positive, extends the lease to Lease from now, as a
	// Heartbeat's does; 0 keeps the lease's end as it is.
	Lease time.Duration
}

// CheckpointTx records a checkpoint of the record p.ID in tx, a transaction
// the caller runs on the store's database: the holder of the lease (p.Token)
// writes a step's business rows and the checkpoint that says the step is
// done in one transaction, and they commit (or roll back) together. It is
// fenced as a Heartbeat is: it locks the record in tx (other calls on the
// key wait until tx ends) and refuses with statemachine.ErrLeaseLost when
// p.Token no longer holds it, statemachine.ErrAlreadyFinished when the
// attempt already ended, statemachine.ErrNotFound when there is no record,
// and ErrInvalidArgument for a phase or data out of bounds; it then writes
// nothing, and tx may go on or roll back. It returns the record as it will
// read once tx commits. The checkpoint's data is sealed with the store's
// keyring, if it has one.
//
// It is for a holder whose attempt runs over the coordinator (Begin,
// Heartbeat, Complete: a handler under the interceptor, say) and whose
// business data lives in the coordinator's database. A RunTx function
// needs none: all it writes commits with its result, or nothing does.
func (s *Store) CheckpointTx(ctx context.Context, tx pgx.Tx, p *CheckpointParams) (statemachine.Record, error) {
	id := p.ID
	if err := checkIdentity(id); err != nil {
		return statemachine.Record{}, err
	}
	if err := validCheckpoint(p.Phase, p.Data); err != nil {
		return statemachine.Record{}, err
	}
	q := s.sql.lockNow(id, s.now())
	cur, now, err := s.scanFullRecordNow(tx.QueryRow(ctx, q.sql, q.args...), id)
	if errors.Is(err, pgx.ErrNoRows) {
		return statemachine.Record{}, statemachine.ErrNotFound
	}
	if err != nil {
		return statemachine.Record{}, classify(err)
	}
	lease := p.Lease
	if lease <= 0 {
		lease = max(cur.LeaseExpiresAt.Sub(now), 0)
	}
	ev := storedDurations(statemachine.Event{Kind: statemachine.EventHeartbeat, Token: p.Token, Lease: lease,
		Checkpoint: &statemachine.Checkpoint{Phase: p.Phase, Data: p.Data}})
	d := s.decide(id, &cur, ev, statemachine.Policy{}, now)
	if d.Err != nil {
		return statemachine.Record{}, d.Err
	}
	cols, err := s.recordArgs(id, d.Record)
	if err != nil {
		return statemachine.Record{}, err
	}
	q = s.sql.update(id, cols)
	if _, err := tx.Exec(ctx, q.sql, q.args...); err != nil {
		return statemachine.Record{}, classify(err)
	}
	return d.Record, nil
}

// validCheckpoint checks a checkpoint as the coordinator checks a
// Heartbeat's (with its default limit).
func validCheckpoint(phase string, data []byte) error {
	switch {
	case phase == "":
		return fmt.Errorf("%w: checkpoint phase is empty", ErrInvalidArgument)
	case len(phase) > MaxPhaseBytes:
		return fmt.Errorf("%w: checkpoint phase is %d bytes, at most %d", ErrInvalidArgument, len(phase), MaxPhaseBytes)
	case !utf8.ValidString(phase):
		return fmt.Errorf("%w: checkpoint phase is not valid UTF-8", ErrInvalidArgument)
	case len(data) > MaxCheckpointBytes:
		return fmt.Errorf("%w: checkpoint data is %d bytes, at most %d", ErrInvalidArgument, len(data), MaxCheckpointBytes)
	}
	for _, r := range phase {
		if unicode.Is(unicode.Cc, r) {
			return fmt.Errorf("%w: checkpoint phase contains the control character %U", ErrInvalidArgument, r)
		}
	}
	return nil
}
