package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// received reports whether ch holds a wake-up, without waiting.
func received(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestHeartbeatDoesNotWake subscribes to a held record, heartbeats it,
// then completes another record: notifications arrive in commit order on
// one connection, so once the other record's wake-up arrived, a wake-up
// for any Heartbeat would have arrived before it. None did; the Complete
// of the held record wakes it.
func TestHeartbeatDoesNotWake(t *testing.T) {
	t.Parallel()
	s, err := ledger.Open(context.Background(), pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ledger.SkipOnCitus(t, s, "the two records' changes notify on the workers that hold them, over two connections, "+
		"so the sentinel's wake-up does not prove the earlier ones arrived (TestCitusReplayCacheForgetOnEveryWorker checks notifications there)")
	ctx := context.Background()
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	held := ledger.Identity{Tenant: "t", Scope: "s", Key: "held"}
	sentinel := ledger.Identity{Tenant: "t", Scope: "s", Key: "sentinel"}
	tokens := map[ledger.Identity]string{}
	for _, id := range []ledger.Identity{held, sentinel} {
		res, err := s.Begin(ctx, &ledger.BeginParams{ID: id, Event: ev})
		if err != nil {
			t.Fatal(err)
		}
		tokens[id] = res.Record.LeaseToken
	}
	// The first wake-up says the listener is up; after it, a new
	// subscription gets exactly one at once.
	sentinelCh, stop := s.Subscribe(sentinel)
	defer stop()
	<-sentinelCh
	heldCh, stop2 := s.Subscribe(held)
	defer stop2()
	<-heldCh
	// As a waiting Begin does: only the end of a watched attempt (and any
	// change of a replayable record) is notified.
	for _, id := range []ledger.Identity{held, sentinel} {
		if ok, err := s.Watch(ctx, id); err != nil || !ok {
			t.Fatalf("Watch %v: %v %v", id, ok, err)
		}
	}

	for range 10 {
		if _, err := s.Finish(ctx, &ledger.FinishParams{ID: held, Event: statemachine.Event{
			Kind: statemachine.EventHeartbeat, Token: tokens[held], Lease: time.Hour}}); err != nil {
			t.Fatal(err)
		}
	}
	complete := func(id ledger.Identity) {
		t.Helper()
		if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{
			Kind: statemachine.EventComplete, Token: tokens[id]}}); err != nil {
			t.Fatal(err)
		}
	}
	complete(sentinel)
	<-sentinelCh
	if received(heldCh) {
		t.Fatal("a Heartbeat woke the record's waiters")
	}
	complete(held)
	<-heldCh
}

// TestNotificationQueueOverLimit stalls a listener (a session that LISTENs
// inside an open transaction never reads), so PostgreSQL's notification
// queue holds a backlog, and lowers the writer's limit below it: writes
// go on, their changes are counted instead of notified, and another
// replica that cached a record stops replaying it once it is forgotten,
// and its waiting Begins wake (they poll) when a held record completes.
//
// Not parallel: PostgreSQL has one notification queue per cluster, so
// with the writer's tiny limit any other test's unread notifications
// would count as a backlog too and turn off this test's cache phase.
func TestNotificationQueueOverLimit(t *testing.T) {
	url := pgtest.NewDatabase(t)
	ctx := context.Background()
	writer, err := ledger.Open(ctx, url, ledger.WithNotifyQueueLimit("0.0000001"))
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Close()
	replica, err := ledger.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer replica.Close()
	ledger.SkipWithoutNotifications(t, replica)
	ledger.SkipOnCitus(t, replica, "the writer's idemcoord.notify_queue_limit is a setting of its sessions on the coordinator node, "+
		"which does not reach the workers where the trigger runs (TestCitusNotifyOverflowOnWorker)")
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	cached := ledger.Identity{Tenant: "t", Scope: "s", Key: "cached"}
	res, err := writer.Begin(ctx, &ledger.BeginParams{ID: cached, Event: ev})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := writer.Finish(ctx, &ledger.FinishParams{ID: cached, Event: statemachine.Event{
		Kind: statemachine.EventComplete, Token: res.Record.LeaseToken}}); err != nil {
		t.Fatal(err)
	}
	waitFresh(t, replica, cached, ev)
	heldID := ledger.Identity{Tenant: "t", Scope: "s", Key: "held"}
	held, err := writer.Begin(ctx, &ledger.BeginParams{ID: heldID, Event: ev})
	if err != nil {
		t.Fatal(err)
	}

	stalled, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close(ctx)
	if _, err := stalled.Exec(ctx, `LISTEN stalled`); err != nil {
		t.Fatal(err)
	}
	tx, err := stalled.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	filler, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close(ctx)
	for {
		if _, err := filler.Exec(ctx, `SELECT pg_notify('idemcoord_filler', i::text || repeat('x', 7000)) FROM generate_series(1, 4) i`); err != nil {
			t.Fatal(err)
		}
		var usage float64
		if err := filler.QueryRow(ctx, `SELECT pg_notification_queue_usage()`).Scan(&usage); err != nil {
			t.Fatal(err)
		}
		if usage > 0 {
			break
		}
	}
	dropped := replica.NotificationStats().Dropped

	// The waiter subscribes before the change, as a waiting Begin does.
	heldCh, stop := replica.Subscribe(heldID)
	defer stop()
	if ok, err := replica.Watch(ctx, heldID); err != nil || !ok {
		t.Fatalf("Watch: %v %v", ok, err)
	}
	if _, err := writer.Forget(ctx, &ledger.ForgetParams{ID: cached}); err != nil {
		t.Fatalf("Forget with the queue over its limit: %v", err)
	}
	if _, err := writer.Finish(ctx, &ledger.FinishParams{ID: heldID, Event: statemachine.Event{
		Kind: statemachine.EventComplete, Token: held.Record.LeaseToken}}); err != nil {
		t.Fatalf("Complete with the queue over its limit: %v", err)
	}
	// The replica learns from the pings that changes went un-notified:
	// it stops serving its cache and wakes its waiters.
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := replica.NotificationStats()
		if st.Dropped > dropped && st.Polling {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the replica never noticed un-notified changes: %+v (dropped before %d)", st, dropped)
		}
		time.Sleep(50 * time.Millisecond)
	}
	r, err := replica.Begin(ctx, &ledger.BeginParams{ID: cached, Event: ev})
	if err != nil || r.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("the forgotten record on the replica: %+v %v, want acquired", r, err)
	}
	for {
		<-heldCh
		rec, _, err := replica.Lookup(ctx, heldID)
		if err != nil {
			t.Fatal(err)
		}
		if rec.State == statemachine.StateCompleted {
			break
		}
	}
	// QueueUsage is read at each of the replica's own pings (every
	// 200 ms), which the writer's ping above may have come before: wait
	// for one. The listener stays stalled, so the usage stays above 0.
	waitFor(t, "the replica's queue usage above 0 while a listener is stalled", func() (bool, error) {
		st := replica.NotificationStats()
		return st.QueueUsage > 0, fmt.Errorf("queue usage %v", st.QueueUsage)
	})
}
