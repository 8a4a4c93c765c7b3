package ledger_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// holdNewKey starts a RunTx on the new key id whose fn blocks, and returns
// once fn runs: the RunTx's uncommitted insert then holds the key's row.
// rollBack makes fn fail and returns once the RunTx has rolled back (it
// fails the test if the RunTx committed); the test's cleanup calls it too.
func holdNewKey(t *testing.T, db *txDB, id ledger.Identity) (rollBack func()) {
	t.Helper()
	running, fail := make(chan struct{}), make(chan struct{})
	rolledBack := make(chan error, 1)
	go func() {
		_, _, err := db.store.RunTx(context.Background(), id, ledger.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
			close(running)
			<-fail
			return nil, errors.New("the business write failed")
		})
		rolledBack <- err
	}()
	<-running
	var once sync.Once
	rollBack = func() {
		once.Do(func() {
			close(fail)
			if err := <-rolledBack; err == nil {
				t.Error("RunTx committed; want fn's error")
			}
		})
	}
	t.Cleanup(rollBack)
	return rollBack
}

// TestBeginWhoseCallerLeftDuringItsWriteLeavesNoAcquisition: a Begin whose
// caller gives up while its write is in flight returns at once, and its
// write may still commit afterwards (it is never cancelled: see
// commitTimeout). Here the write waits on another transaction's insert of
// the key (a RunTx whose fn then fails), the caller cancels, and the
// holder's rollback lets the write create the key for a caller that has
// gone. Nobody would ever end that acquisition (the Go client's release of
// its attempt may already have run, found nothing to release and
// returned), so the key would read UNKNOWN once its lease ran out and, under
// on_unknown: hold, wait for an operator. The Store ends it itself, with
// Fail ABANDONED: the key is left absent, as if that Begin never was.
//
// Before, the write's answer was dropped with its caller (the batch's
// answer, or the detached statement's), and the key stayed IN_PROGRESS
// with the gone caller's token.
func TestBeginWhoseCallerLeftDuringItsWriteLeavesNoAcquisition(t *testing.T) {
	t.Parallel()
	for _, mode := range []struct {
		name string
		opts []ledger.Option
	}{{"batched", nil}, {"single", []ledger.Option{ledger.WithoutBatching()}}} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			db := newTxDB(t, mode.opts...)
			id := ledger.Identity{Tenant: ledger.DefaultTenant, Scope: "charge", Key: "late"}
			failNow := holdNewKey(t, db, id)

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			began := make(chan error, 1)
			go func() {
				_, err := db.store.Begin(ctx, &ledger.BeginParams{ID: id, Event: statemachine.Event{
					AttemptID: "gone", TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
				began <- err
			}()
			// The Begin's statement waits on the RunTx's row; then its
			// caller gives up.
			writers := pgtest.WaitForLockWaiters(t, db.conn)
			cancel()
			if err := <-began; !errors.Is(err, context.Canceled) {
				t.Fatalf("Begin cancelled while its write waited: %v, want context.Canceled", err)
			}
			// The holder rolls back at once, well within the statement's
			// lock wait, so the statement goes on and creates the key.
			failNow()
			// The write goes on and commits (the key is then held until
			// the Store's release commits), or finds the key held no
			// longer.
			pgtest.WaitForBackendsDone(t, db.conn, writers)
			deadline := time.Now().Add(5 * time.Second)
			for db.records(t, id.Key) != 0 {
				if time.Now().After(deadline) {
					var state, token string
					_ = db.conn.QueryRow(context.Background(), `SELECT state::text, lease_token FROM idempotency_records WHERE key = $1`, id.Key).Scan(&state, &token)
					t.Fatalf("the key is held (state %s, token %s) 5 s after its only Begin's caller gave up; want no record", state, token)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}
