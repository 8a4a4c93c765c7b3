package ledger_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestRunTxWaitingLostCommitRunsOnce loses the answer of a waiting RunTx's
// commit after PostgreSQL committed it, and checks that the call answers
// fn's outcome, once: its next try, within Wait, must find the committed
// record its own (one lease token across tries), not fail the call with
// ErrUnavailable, nor replay its own result as another's.
//
// The RunTx waits for a key held over gRPC; the holder fails RETRYABLE and
// the RunTx takes over and runs fn. The lost answer is real, as in the
// server's TestWaitingBeginLostReplyAcquiresOnce: every commit is made to
// wait for a synchronous standby that does not exist, and the backend is
// terminated while the RunTx's commit waits (PostgreSQL keeps the commit:
// "the transaction has already committed locally").
//
// Before RunTx shared the waiting Begin's wait, it answered ErrUnavailable.
func TestRunTxWaitingLostCommitRunsOnce(t *testing.T) {
	t.Parallel()
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	url := cluster.URL("postgres")
	if err := ledger.Migrate(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	// Without notifications the waiter polls (and no ping of a listener
	// commits beside the RunTx).
	db := openTxDB(t, url, ledger.WithoutNotifications())
	s, ctx := db.store, context.Background()
	id := ledger.Identity{Tenant: ledger.DefaultTenant, Scope: "charge", Key: "lost"}
	token := beginID(t, s, id, time.Minute, time.Hour)

	var calls atomic.Int32
	running, release := make(chan struct{}), make(chan struct{})
	var first, released sync.Once
	unblock := func() { released.Do(func() { close(release) }) }
	t.Cleanup(unblock) // a failed test must not leave fn waiting (Close waits for it)
	fn := charge(id.Key, &calls)
	type result struct {
		resp     *statemachine.Response
		replayed bool
		err      error
	}
	done := make(chan result, 1)
	go func() {
		resp, replayed, err := s.RunTx(ctx, id, ledger.TxOptions{Wait: time.Minute}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
			first.Do(func() {
				close(running)
				<-release
			})
			return fn(ctx, tx)
		})
		done <- result{resp, replayed, err}
	}()
	waitFor(t, "the waiting RunTx to watch the record", func() (bool, error) {
		return db.count(t, `SELECT count(*) FROM idempotency_records WHERE key = $1 AND watched`, id.Key) == 1, nil
	})
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: token, FailureKind: statemachine.FailureRetryable}}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-running:
	case <-time.After(time.Minute):
		t.Fatal("the waiting RunTx did not take the key over within a minute")
	}

	// From now on every commit waits for a standby that never comes. A
	// probe's commit shows the setting has reached the committing side.
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.conn.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`CREATE TABLE probe (n int)`)
	exec(`ALTER SYSTEM SET synchronous_standby_names = 'nobody'`)
	exec(`SELECT pg_reload_conf()`)
	// (synchronous_commit is the test cluster's default too; said here
	// because the probe needs it.)
	probe, err := pgx.Connect(ctx, url+"&synchronous_commit=on")
	if err != nil {
		t.Fatal(err)
	}
	var probePID int
	if err := probe.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&probePID); err != nil {
		t.Fatal(err)
	}
	probed := make(chan struct{})
	t.Cleanup(func() {
		_, _ = db.conn.Exec(ctx, `SELECT pg_terminate_backend($1)`, probePID)
		<-probed
	})
	go func() {
		defer close(probed)
		defer probe.Close(ctx)
		for {
			// Returns at once until commits wait; then until terminated.
			if _, err := probe.Exec(ctx, `INSERT INTO probe VALUES (1)`); err != nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	syncRepWaiter := func(app string) int {
		var pid int
		waitFor(t, "a commit of "+app+" waiting for the synchronous standby", func() (bool, error) {
			err := db.conn.QueryRow(ctx, `SELECT coalesce(max(pid), 0) FROM pg_stat_activity
				WHERE wait_event = 'SyncRep' AND application_name = $1`, app).Scan(&pid)
			return pid != 0, err
		})
		return pid
	}
	if pid := syncRepWaiter(""); pid != probePID {
		t.Fatalf("pid %d waits for the standby, want the probe's %d", pid, probePID)
	}
	exec(`SELECT pg_terminate_backend($1)`, probePID)
	<-probed

	// fn returns; RunTx's commit is written locally and waits. Its
	// backend is terminated: the commit stays, its answer is lost.
	unblock()
	exec(`SELECT pg_terminate_backend($1)`, syncRepWaiter("idemcoord"))
	exec(`ALTER SYSTEM RESET synchronous_standby_names`)
	exec(`SELECT pg_reload_conf()`)

	var r result
	select {
	case r = <-done:
	case <-time.After(90 * time.Second):
		t.Fatal("RunTx did not answer within 90 s")
	}
	if r.err != nil || r.replayed || r.resp == nil || calls.Load() != 1 {
		t.Fatalf("RunTx answered %v, replayed %v, %v with fn called %d times; want fn's response, not replayed, fn called once",
			r.resp, r.replayed, r.err, calls.Load())
	}
	// The pool may still hand out a connection that the terminations
	// above ended; a caller retries an unavailable read, and so does this.
	rec, _, err := s.Lookup(ctx, id)
	for i := 0; i < 5 && errors.Is(err, ledger.ErrUnavailable); i++ {
		rec, _, err = s.Lookup(ctx, id)
	}
	if err != nil || rec.State != statemachine.StateCompleted || rec.Attempt != 2 || !rec.Response.Equal(r.resp) {
		t.Fatalf("the record is %+v (%v), want COMPLETED at attempt 2 with RunTx's response", rec, err)
	}
	if n := db.charges(t, id.Key); n != 1 {
		t.Fatalf("%d charge rows, want 1", n)
	}
}

// TestRunTxWaiterOutlastsAnOutage: a RunTx waits for a key held over gRPC
// while the database stops for a few seconds; its re-reads meanwhile find
// the database unreachable, which does not end the wait. When the database
// is back and the holder completes, RunTx replays the holder's result.
//
// Before RunTx shared the waiting Begin's wait, its first re-read during
// the outage ended it with ErrUnavailable.
func TestRunTxWaiterOutlastsAnOutage(t *testing.T) {
	t.Parallel()
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	url := cluster.URL("postgres")
	if err := ledger.Migrate(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	db := openTxDB(t, url)
	s := db.store
	id := ledger.Identity{Tenant: ledger.DefaultTenant, Scope: "charge", Key: "outage"}
	token := beginID(t, s, id, time.Hour, time.Hour)
	var calls atomic.Int32
	type result struct {
		resp     *statemachine.Response
		replayed bool
		err      error
	}
	done := make(chan result, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		resp, replayed, err := s.RunTx(ctx, id, ledger.TxOptions{Wait: time.Minute}, charge(id.Key, &calls))
		done <- result{resp, replayed, err}
	}()
	waitFor(t, "the waiting RunTx to watch the record", func() (bool, error) {
		return db.count(t, `SELECT count(*) FROM idempotency_records WHERE key = $1 AND watched`, id.Key) == 1, nil
	})
	if err := cluster.Stop(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the store to poll", func() (bool, error) { return s.NotificationStats().Polling, nil })
	time.Sleep(3 * time.Second) // the waiter re-reads, at most a second apart, and fails (not a synchronization)
	if err := cluster.Start(); err != nil {
		t.Fatal(err)
	}
	// The pool may still hold connections of the stopped server.
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		_, err := s.Finish(context.Background(), &ledger.FinishParams{ID: id, Event: statemachine.Event{
			Kind: statemachine.EventComplete, Token: token, Response: &statemachine.Response{Body: []byte("done")}}})
		if err == nil {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("Complete after the database came back: %v", err)
		}
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(90 * time.Second):
		t.Fatal("RunTx did not answer within 90 s")
	}
	if r.err != nil || !r.replayed || r.resp == nil || string(r.resp.Body) != "done" || calls.Load() != 0 {
		t.Fatalf("RunTx answered %v, replayed %v, %v with fn called %d times; want the holder's result replayed",
			r.resp, r.replayed, r.err, calls.Load())
	}
}
