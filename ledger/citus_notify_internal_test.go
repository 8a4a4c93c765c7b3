package ledger

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// citusKeyPerWorker returns, for each worker of cc (in order), a key of
// prefix whose shard it holds.
func citusKeyPerWorker(t *testing.T, conn *pgx.Conn, cc *pgtest.CitusCluster, prefix string) []string {
	t.Helper()
	keys := make([]string, len(cc.Workers))
	found := 0
	for i := 0; found < len(keys); i++ {
		if i > 1000 {
			t.Fatalf("no key of every worker among 1000 candidates: %v", keys)
		}
		key := fmt.Sprint(prefix, i)
		var port int
		if err := conn.QueryRow(t.Context(), `SELECT nodeport FROM pg_dist_shard_placement
			WHERE shardid = get_shard_id_for_distribution_column('idempotency_records', $1::text)`, key).Scan(&port); err != nil {
			t.Fatal(err)
		}
		for w, c := range cc.Workers {
			if portOfURL(t, c.URL("x")) == port && keys[w] == "" {
				keys[w] = key
				found++
			}
		}
	}
	return keys
}

func portOfURL(t *testing.T, url string) int {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	return int(cfg.Port)
}

// cacheAndWaitFresh completes id on s and replays it until s serves it
// from its replay cache.
func cacheAndWaitFresh(t *testing.T, s *Store, id Identity, ev statemachine.Event) {
	t.Helper()
	ctx := t.Context()
	res, err := s.Begin(ctx, &BeginParams{ID: id, Event: ev})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventComplete,
		Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("x")}}}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		before := s.CacheStats().Hits
		r, err := s.Begin(ctx, &BeginParams{ID: id, Event: ev})
		if err != nil || r.Outcome != statemachine.OutcomeReplay {
			t.Fatalf("replay of %s: %+v %v", id.Key, r, err)
		}
		if s.CacheStats().Hits > before {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never served from the cache: %+v %+v", id.Key, s.CacheStats(), s.NotificationStats())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestCitusReplayCacheForgetOnEveryWorker: on Citus, replica A caches a
// record of each worker, replica B Forgets them: a second later A replays
// neither (each change notified on its worker, where A listens too).
func TestCitusReplayCacheForgetOnEveryWorker(t *testing.T) {
	cc, a, conn := citusStore(t)
	b, err := Open(t.Context(), cc.URL("idemcoord"))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if a.cache == nil {
		t.Fatal("no replay cache on Citus")
	}
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
	keys := citusKeyPerWorker(t, conn, cc, "forget")
	for _, key := range keys {
		cacheAndWaitFresh(t, a, Identity{Tenant: "t", Scope: "s", Key: key}, ev)
	}
	for _, key := range keys {
		if _, err := b.Forget(t.Context(), &ForgetParams{ID: Identity{Tenant: "t", Scope: "s", Key: key}}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(time.Second) // the promise: no replay more than 1 s after Forget returns
	for w, key := range keys {
		r, err := a.Begin(t.Context(), &BeginParams{ID: Identity{Tenant: "t", Scope: "s", Key: key}, Event: ev})
		if err != nil {
			t.Fatal(err)
		}
		if r.Outcome != statemachine.OutcomeAcquired || r.PreviousState != statemachine.StateNone {
			t.Errorf("%s (worker %d) 1 s after another replica forgot it: %v (previous %v)", key, w, r.Outcome, r.PreviousState)
		}
	}
}

// TestCitusReplayCacheListenerStoppedOnWorker freezes (SIGSTOP) a store's
// LISTEN backend on one worker, so no notification of that worker reaches
// it while its connection stays up, and deletes a cached record of that
// worker with SQL: the store must stop serving its cache and answer from
// the database. Run for each worker.
func TestCitusReplayCacheListenerStoppedOnWorker(t *testing.T) {
	cc, s, conn := citusStore(t)
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
	keys := citusKeyPerWorker(t, conn, cc, "frozen")
	for w, key := range keys {
		id := Identity{Tenant: "t", Scope: "s", Key: key}
		cacheAndWaitFresh(t, s, id, ev)
		wconn, err := pgx.Connect(t.Context(), cc.Workers[w].URL("idemcoord"))
		if err != nil {
			t.Fatal(err)
		}
		var pid int
		if err := wconn.QueryRow(t.Context(), `SELECT pid FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'idemcoord'
			AND (query ILIKE 'listen %' OR query = 'SELECT dropped FROM idemcoord_notify_drops')`).Scan(&pid); err != nil {
			t.Fatalf("the store's LISTEN backend on worker %d: %v", w, err)
		}
		_ = wconn.Close(context.Background())
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(t.Context(), `DELETE FROM idempotency_records WHERE key = $1`, key); err != nil {
			_ = syscall.Kill(pid, syscall.SIGCONT)
			t.Fatal(err)
		}
		// The cache may answer until its freshness lapses (900 ms); after
		// that, only the database does. A generous minute, polled.
		deadline := time.Now().Add(time.Minute)
		for {
			r, err := s.Begin(t.Context(), &BeginParams{ID: id, Event: ev})
			if err != nil {
				_ = syscall.Kill(pid, syscall.SIGCONT)
				t.Fatal(err)
			}
			if r.Outcome == statemachine.OutcomeAcquired && r.PreviousState == statemachine.StateNone {
				break
			}
			if r.Outcome != statemachine.OutcomeReplay || time.Now().After(deadline) {
				_ = syscall.Kill(pid, syscall.SIGCONT)
				t.Fatalf("worker %d's listener frozen: Begin of the deleted %s answered %v (cache %+v)", w, key, r.Outcome, s.CacheStats())
			}
			time.Sleep(50 * time.Millisecond)
		}
		if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCitusNotifyOverflowOnWorker: past the notification queue limit the
// records trigger counts a change in idemcoord_notify_drops instead of
// notifying it, on the worker where it runs. The table exists there (the
// listener creates it), so the write succeeds, and the store learns of
// the drop from that worker's pings: it polls and drops its cache.
func TestCitusNotifyOverflowOnWorker(t *testing.T) {
	cc, s, conn := citusStore(t)
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
	keys := citusKeyPerWorker(t, conn, cc, "overflow")
	cached := Identity{Tenant: "t", Scope: "s", Key: keys[0]}
	cacheAndWaitFresh(t, s, cached, ev)
	// Every change on worker 0 now goes over the limit.
	wconn, err := pgx.Connect(t.Context(), cc.Workers[0].URL("idemcoord"))
	if err != nil {
		t.Fatal(err)
	}
	defer wconn.Close(context.Background())
	// (The worker's new sessions read the setting: end the coordinator
	// node's cached connections to it.)
	for _, q := range []string{`SET citus.enable_ddl_propagation = off`,
		`ALTER DATABASE idemcoord SET idemcoord.notify_queue_limit = '0'`,
		`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE 'citus_internal%'`} {
		if _, err := wconn.Exec(t.Context(), q); err != nil {
			t.Fatal(err)
		}
	}
	dropped := s.NotificationStats().Dropped
	// Complete and Forget records (of either worker; a call that meets a
	// terminated connection fails UNAVAILABLE) until a Forget on worker 0
	// commits with its change counted instead of notified: the count is
	// written in the change's transaction.
	deadline := time.Now().Add(time.Minute)
	var failed []error
	for i := 0; ; i++ {
		id := Identity{Tenant: "t", Scope: "s", Key: fmt.Sprint(keys[0], "-", i)}
		res, err := s.Begin(t.Context(), &BeginParams{ID: id, Event: ev})
		if err == nil {
			_, err = s.Finish(t.Context(), &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventComplete,
				Token: res.Record.LeaseToken}})
		}
		if err == nil {
			// The deletion of a COMPLETED record is a change the trigger
			// announces.
			_, err = s.Forget(t.Context(), &ForgetParams{ID: id})
		}
		if err != nil {
			if !errors.Is(err, ErrUnavailable) || len(failed) > 5 {
				t.Fatalf("Begin/Complete/Forget of %s with worker 0 over its notification limit: %v (before: %v)", id.Key, err, failed)
			}
			failed = append(failed, err)
		}
		var n int64
		if err := wconn.QueryRow(t.Context(), `SELECT dropped FROM idemcoord_notify_drops`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			var setting string
			c2, err := pgx.Connect(t.Context(), cc.Workers[0].URL("idemcoord"))
			if err == nil {
				err = c2.QueryRow(t.Context(), `SELECT coalesce(current_setting('idemcoord.notify_queue_limit', true), '<none>') || ' ' || (SELECT string_agg(application_name || ':' || coalesce(query, ''), ' | ') FROM pg_stat_activity WHERE datname = current_database())`).Scan(&setting)
			}
			t.Fatalf("worker 0 never counted a change over its notification limit (%d keys; a new session there: %q %v)", i, setting, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The pings of worker 0 carry the new count: the store polls and no
	// longer serves its cache.
	for {
		st := s.NotificationStats()
		if st.Dropped > dropped && st.Polling {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the store never saw worker 0's drop: %+v (before %d)", st, dropped)
		}
		time.Sleep(20 * time.Millisecond)
	}
	before := s.CacheStats().Hits
	if r, err := s.Begin(t.Context(), &BeginParams{ID: cached, Event: ev}); err != nil || r.Outcome != statemachine.OutcomeReplay {
		t.Fatalf("replay of %s: %+v %v", cached.Key, r, err)
	}
	if s.CacheStats().Hits != before {
		t.Errorf("the cache answered while changes of worker 0 went un-notified")
	}
}
