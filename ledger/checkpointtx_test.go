package ledger_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestCheckpointTxCommitsWithTheStep: a holder's business row and its
// checkpoint written in one transaction commit together, and roll back
// together; a stale token or a bad phase is refused and writes nothing,
// and the transaction can still commit its own rows.
func TestCheckpointTxCommitsWithTheStep(t *testing.T) {
	t.Parallel()
	db := newTxDB(t)
	ctx := context.Background()
	id := ledger.Identity{Tenant: "t", Scope: "orders", Key: "o-1"}
	res, err := db.store.Begin(ctx, &ledger.BeginParams{ID: id, Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
	if err != nil || res.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("Begin: %+v %v", res, err)
	}
	token := res.Record.LeaseToken
	step := func(charge string, p *ledger.CheckpointParams, commit bool) error {
		t.Helper()
		tx, err := db.conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := tx.Exec(ctx, `INSERT INTO charges (key, amount, token) VALUES ($1, 100, $2)`, charge, token); err != nil {
			t.Fatal(err)
		}
		_, cerr := db.store.CheckpointTx(ctx, tx, p)
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		return cerr
	}
	checkpoint := func() *statemachine.Checkpoint {
		t.Helper()
		rec, _, err := db.store.Lookup(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return rec.Checkpoint
	}

	// Rolled back: neither the charge nor the checkpoint.
	if err := step("rolled-back", &ledger.CheckpointParams{ID: id, Token: token, Phase: "charged", Data: []byte("ch_0")}, false); err != nil {
		t.Fatal(err)
	}
	if n := db.count(t, `SELECT count(*) FROM charges`); n != 0 || checkpoint() != nil {
		t.Fatalf("after a rollback: %d charges, checkpoint %+v", n, checkpoint())
	}
	// Committed: both.
	if err := step("ch_1", &ledger.CheckpointParams{ID: id, Token: token, Phase: "charged", Data: []byte("ch_1")}, true); err != nil {
		t.Fatal(err)
	}
	if c := checkpoint(); db.count(t, `SELECT count(*) FROM charges WHERE key = 'ch_1'`) != 1 || c == nil ||
		c.Phase != "charged" || string(c.Data) != "ch_1" || c.Attempt != 1 {
		t.Fatalf("after the commit: checkpoint %+v", c)
	}
	// Refused: nothing of the checkpoint; the transaction's own rows are
	// the caller's to keep.
	for _, p := range []*ledger.CheckpointParams{
		{ID: id, Token: "lt1.stale", Phase: "shipped"},
		{ID: id, Token: token, Phase: ""},
		{ID: id, Token: token, Phase: "a\tb"},
		{ID: id, Token: token, Phase: "shipped", Data: make([]byte, ledger.MaxCheckpointBytes+1)},
	} {
		err := step("refused-"+p.Phase+p.Token, p, true)
		if !errors.Is(err, statemachine.ErrLeaseLost) && !errors.Is(err, ledger.ErrInvalidArgument) {
			t.Fatalf("CheckpointTx %q %q: %v, want LEASE_LOST or invalid argument", p.Token, p.Phase, err)
		}
		if c := checkpoint(); c == nil || c.Phase != "charged" {
			t.Fatalf("a refused CheckpointTx changed the checkpoint: %+v", c)
		}
	}
	// The holder's own lease end is kept (Lease 0), and the attempt can
	// no longer be abandoned.
	rec, _, err := db.store.Lookup(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if !rec.LeaseExpiresAt.Equal(res.Record.LeaseExpiresAt) {
		t.Fatalf("lease moved from %v to %v", res.Record.LeaseExpiresAt, rec.LeaseExpiresAt)
	}
	_, err = db.store.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: token, FailureKind: statemachine.FailureAbandoned}})
	if !errors.Is(err, statemachine.ErrCheckpointRecorded) {
		t.Fatalf("Fail ABANDONED after CheckpointTx: %v", err)
	}
}
