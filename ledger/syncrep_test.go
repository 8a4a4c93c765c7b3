package ledger_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// startSyncPair starts a primary with a synchronous standby (every COMMIT
// waits until the standby has the transaction) and migrates it.
func startSyncPair(t *testing.T) (primary, standby *pgtest.Cluster) {
	t.Helper()
	primary = pgtest.StartCluster(t, pgtest.ClusterOptions{})
	url := primary.URL("postgres")
	if err := ledger.Migrate(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	standby = primary.StartStandby(t)
	conn := connect(t, url)
	for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = '*'`, `SELECT pg_reload_conf()`} {
		if _, err := conn.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the standby to stream synchronously", func() (bool, error) {
		var n int
		err := conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'`).Scan(&n)
		return n == 1, err
	})
	return primary, standby
}

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// waitFor polls cond until it holds, for up to a minute.
func waitFor(t *testing.T, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		ok, err := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited a minute for %s (last error: %v)", what, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCommitNotCancelledWhileWaitingForStandby cancels callers whose
// writes wait for a synchronous standby that is down: every kind of commit
// (a Begin's INSERT, a holder's one-statement Complete, a transaction's
// COMMIT, Forget's DELETE) must keep waiting for the standby instead of
// turning into a query cancel, which would make PostgreSQL commit on the
// primary only, where other callers read it and a failover loses it. So the
// writes stay invisible on the primary until the standby is back, and then
// they are on both.
//
// The Begin, whose caller is gone by the time its INSERT commits, is then
// released by the Store (see Store.Begin): its record is on both, and then
// gone from both.
//
// Before commits ran under context.WithoutCancel, each write became visible
// on the primary right after its caller's cancel, with the standby down.
func TestCommitNotCancelledWhileWaitingForStandby(t *testing.T) {
	primary, standby := startSyncPair(t)
	url := primary.URL("postgres")
	// Without batching, every path runs on its caller's context; without
	// notifications, no ping of the listener commits beside the writes.
	var logs testkit.LogBuffer
	store, err := ledger.Open(context.Background(), url, ledger.WithoutBatching(), ledger.WithoutNotifications(),
		ledger.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	id := func(key string) ledger.Identity { return ledger.Identity{Tenant: "t", Scope: "s", Key: key} }
	begin := func(ctx context.Context, key string) (*ledger.Result, error) {
		return store.Begin(ctx, &ledger.BeginParams{ID: id(key), Event: statemachine.Event{
			TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
	}
	ctx := context.Background()
	held := map[string]string{}
	for _, key := range []string{"complete", "heartbeat", "forget"} {
		res, err := begin(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		held[key] = res.Record.LeaseToken
	}

	writes := []struct {
		name string
		call func(context.Context) error
		// visible is the SQL condition that holds once the write is in;
		// after, when set, the one that holds once what follows it is done
		// too (released, for the Begin).
		visible, after string
	}{
		{"Begin", func(c context.Context) error { _, err := begin(c, "begin"); return err },
			`EXISTS (SELECT 1 FROM idempotency_records WHERE key = 'begin')`,
			`NOT EXISTS (SELECT 1 FROM idempotency_records WHERE key = 'begin')`},
		{"Complete", func(c context.Context) error {
			_, err := store.Finish(c, &ledger.FinishParams{ID: id("complete"), Event: statemachine.Event{
				Kind: statemachine.EventComplete, Token: held["complete"], Response: &statemachine.Response{Body: []byte("x")}}})
			return err
		}, `EXISTS (SELECT 1 FROM idempotency_records WHERE key = 'complete' AND state = 2)`, ""},
		{"Heartbeat", func(c context.Context) error {
			_, err := store.Finish(c, &ledger.FinishParams{ID: id("heartbeat"), Event: statemachine.Event{
				Kind: statemachine.EventHeartbeat, Token: held["heartbeat"], Lease: time.Hour}})
			return err
		}, `EXISTS (SELECT 1 FROM idempotency_records WHERE key = 'heartbeat' AND lease_expires_at > now() + interval '30 minutes')`, ""},
		{"Forget", func(c context.Context) error {
			_, err := store.Forget(c, &ledger.ForgetParams{ID: id("forget")})
			return err
		}, `NOT EXISTS (SELECT 1 FROM idempotency_records WHERE key = 'forget')`, ""},
	}

	if err := standby.Stop(); err != nil {
		t.Fatal(err)
	}
	check := connect(t, url)
	// waiting counts the writes in their commit: waiting for the standby,
	// or for the lock that orders committing transactions which notify
	// (taken before the commit record is written, and held until the
	// standby answers).
	waiting := func() (int, error) {
		var n, syncRep int
		err := check.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE wait_event = 'SyncRep') FROM pg_stat_activity
			WHERE application_name = 'idemcoord' AND (wait_event = 'SyncRep' OR wait_event_type = 'Lock')`).Scan(&n, &syncRep)
		if syncRep == 0 {
			return 0, err
		}
		return n, err
	}
	var wg sync.WaitGroup
	cancels := make([]context.CancelFunc, len(writes))
	errs := make([]error, len(writes))
	for i, w := range writes {
		cctx, cancel := context.WithCancel(ctx)
		cancels[i] = cancel
		wg.Go(func() {
			errs[i] = w.call(cctx)
		})
	}
	waitFor(t, "every write to wait for the standby", func() (bool, error) {
		n, err := waiting()
		return n == len(writes), err
	})
	for _, cancel := range cancels {
		cancel()
	}
	wg.Wait()
	for i, w := range writes {
		if errs[i] == nil {
			t.Errorf("%s acknowledged while its commit waits for a standby that is down", w.name)
		}
	}
	holds := func(cond string) bool {
		var ok bool
		if err := check.QueryRow(ctx, `SELECT `+cond).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	isVisible := func(w int) bool { return holds(writes[w].visible) }
	// A cancel request, had one been sent, lands within milliseconds; give
	// it plenty of time. (A slow machine can only make this pass wrongly,
	// never fail wrongly.)
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		for i, w := range writes {
			if isVisible(i) {
				t.Fatalf("%s: committed on the primary only, with the standby down, after its caller was cancelled", w.name)
			}
		}
		if n, err := waiting(); err != nil || n != len(writes) {
			t.Fatalf("%d commits still wait for the standby (%v), want %d", n, err, len(writes))
		}
	}

	if err := standby.Start(); err != nil {
		t.Fatal(err)
	}
	onStandby := connect(t, standby.URL("postgres"))
	for _, w := range writes {
		cond := w.visible
		if w.after != "" {
			cond = w.after
		}
		waitFor(t, fmt.Sprintf("%s to commit once the standby is back", w.name), func() (bool, error) {
			var ok bool
			err := onStandby.QueryRow(ctx, `SELECT `+cond).Scan(&ok)
			return ok && holds(cond), err
		})
	}
	// The Begin's record is gone because it was committed and then
	// released, not because it never was. The release logs after its
	// commit, which the wait above may have seen first (CI did once).
	msg := "released an acquisition whose Begin's caller had gone"
	waitFor(t, fmt.Sprintf("the Store's log to say %q", msg), func() (bool, error) {
		return strings.Contains(logs.String(), msg), nil
	})
}
