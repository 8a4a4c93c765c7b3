package ledger

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// citusStore starts a Citus cluster, migrates a database on it and opens
// a Store there; conn is a connection to its coordinator node.
func citusStore(t *testing.T, opts ...Option) (*pgtest.CitusCluster, *Store, *pgx.Conn) {
	t.Helper()
	cc := pgtest.StartCitusCluster(t, pgtest.ClusterOptions{})
	ctx := t.Context()
	if err := cc.CreateDatabase(ctx, "idemcoord"); err != nil {
		t.Fatal(err)
	}
	url := cc.URL("idemcoord")
	if err := Migrate(ctx, url); err != nil {
		t.Fatal(err)
	}
	s, err := Open(ctx, url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return cc, s, conn
}

// distributedTransactions counts the two-phase commits the coordinator
// node has recorded and not yet cleaned up (the migrations' among them).
func distributedTransactions(t *testing.T, conn *pgx.Conn) int {
	t.Helper()
	var n int
	if err := conn.QueryRow(t.Context(), `SELECT count(*) FROM pg_dist_transaction`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestCitusHotPathIsSingleShard: on Citus, Open picks the Citus
// statements; Begin and Complete (alone and many at once) work, each a
// router statement on its key's shard with no intermediate results, and
// none of them is a two-phase commit.
func TestCitusHotPathIsSingleShard(t *testing.T) {
	_, s, conn := citusStore(t)
	ctx := t.Context()
	before := distributedTransactions(t, conn)
	id := Identity{Tenant: "t", Scope: "s", Key: "explained"}
	now := time.Now()
	for name, q := range map[string]query{
		"begin":                       s.sql.begin(newRecord{id: id, token: "tok", ttl: time.Hour, lease: time.Minute}, "", nil, time.Second),
		"begin with the clock":        s.sql.begin(newRecord{id: id, token: "tok", ttl: time.Hour, lease: time.Minute}, "", &now, time.Second),
		"completeHeld":                s.sql.completeHeld(id, "tok", storedResponse{}, nil),
		"completeHeld with the clock": s.sql.completeHeld(id, "tok", storedResponse{}, &now),
	} {
		rows, err := conn.Query(ctx, "EXPLAIN "+q.sql, q.args...)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		plan := strings.Join(lines, "\n")
		if !strings.Contains(plan, "Task Count: 1") || strings.Contains(plan, "Subplan") {
			t.Errorf("%s is not a router statement on one shard:\n%s", name, plan)
		}
	}

	// Begin, Complete, replay, for keys on every shard, concurrently.
	const n = 40
	errs := make(chan error, n)
	for i := range n {
		go func() {
			errs <- func() error {
				id := Identity{Tenant: "t", Scope: "s", Key: fmt.Sprint("k", i)}
				ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
				res, err := s.Begin(ctx, &BeginParams{ID: id, Event: ev})
				if err != nil || res.Outcome != statemachine.OutcomeAcquired {
					return fmt.Errorf("Begin %v: %v %v", id, res, err)
				}
				before := res.Now
				fin, err := s.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventComplete,
					Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("done")}}})
				if err != nil || fin.Record.State != statemachine.StateCompleted {
					return fmt.Errorf("Complete %v: %v %v", id, fin, err)
				}
				if got := fin.Record.ExpiresAt.Sub(fin.Record.UpdatedAt); got != time.Hour || fin.Record.UpdatedAt.Before(before) {
					return fmt.Errorf("Complete %v: updated %v (Begin at %v), expires %v after", id, fin.Record.UpdatedAt, before, got)
				}
				res, err = s.Begin(ctx, &BeginParams{ID: id, Event: ev})
				if err != nil || res.Outcome != statemachine.OutcomeReplay || string(res.Record.Response.Body) != "done" {
					return fmt.Errorf("Begin again %v: %v %v", id, res, err)
				}
				return nil
			}()
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	if got := distributedTransactions(t, conn); got > before {
		t.Errorf("%d two-phase commits on the hot path, want none", got-before)
	}

	// A Begin of a key another transaction is creating waits no longer
	// than its lock_timeout, which must reach the worker.
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	held := Identity{Tenant: "t", Scope: "s", Key: "being-created"}
	q := s.sql.begin(newRecord{id: held, token: "other", ttl: time.Hour, lease: time.Minute}, "", nil, time.Second)
	if _, err := tx.Exec(ctx, q.sql, q.args...); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute, NewToken: "mine"}
	waitCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if _, _, _, _, err := s.insertOrReadOnce(waitCtx, held, &ev, 200*time.Millisecond); !isLockTimeout(err) {
		t.Errorf("Begin of a key being created elsewhere: %v after %v, want a lock timeout", err, time.Since(start))
	} else if waited := time.Since(start); waited > 5*time.Second {
		t.Errorf("Begin of a key being created elsewhere waited %v, lock_timeout 200ms", waited)
	}
}

// TestCitusWorkerDown: with one worker stopped, the keys it holds answer
// ErrUnavailable and the other worker's keys keep working.
func TestCitusWorkerDown(t *testing.T) {
	cc, s, conn := citusStore(t)
	ctx := t.Context()
	// Which worker holds which key.
	down := cc.Workers[0]
	var downPort int
	if err := conn.QueryRow(ctx, `SELECT nodeport FROM pg_dist_node WHERE noderole = 'primary' AND groupid > 0
		ORDER BY nodeport LIMIT 1`).Scan(&downPort); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(down.URL("x"), fmt.Sprint(":", downPort, "/")) {
		down = cc.Workers[1]
	}
	var onDown, onUp []Identity
	for i := 0; len(onDown) < 3 || len(onUp) < 3; i++ {
		id := Identity{Tenant: "t", Scope: "s", Key: fmt.Sprint("key", i)}
		var port int
		if err := conn.QueryRow(ctx, `SELECT nodeport FROM pg_dist_shard_placement
			WHERE shardid = get_shard_id_for_distribution_column('idempotency_records', $1::text)`, id.Key).Scan(&port); err != nil {
			t.Fatal(err)
		}
		if port == downPort {
			onDown = append(onDown, id)
		} else {
			onUp = append(onUp, id)
		}
	}
	if err := down.Stop(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := down.Start(); err != nil {
			t.Error(err)
		}
	}()
	ev := statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
	call := func(id Identity) error {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		res, err := s.Begin(ctx, &BeginParams{ID: id, Event: ev})
		if err != nil {
			return err
		}
		_, err = s.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventComplete,
			Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("done")}}})
		return err
	}
	for _, id := range onUp {
		if err := call(id); err != nil {
			t.Errorf("key %s on the running worker: %v", id.Key, err)
		}
	}
	for _, id := range onDown {
		if err := call(id); !errors.Is(err, ErrUnavailable) {
			t.Errorf("key %s on the stopped worker: %v, want ErrUnavailable", id.Key, err)
		}
	}
}

// TestCitusReaperAndGauge: on Citus the reaper's passes (stale leases,
// expiry, deletion, archiving, archive pruning) run on every shard, and
// the records gauge counts without the planner's statistics.
func TestCitusReaperAndGauge(t *testing.T) {
	var clock atomic.Int64
	clock.Store(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro())
	at := func() time.Time { return time.UnixMicro(clock.Load()).UTC() }
	_, s, _ := citusStore(t, WithClock(at))
	ctx := t.Context()
	advance := func(d time.Duration) { clock.Add(d.Microseconds()) }

	const n = 30
	for i := range n {
		id := Identity{Tenant: "t", Scope: fmt.Sprint("scope", i%2), Key: fmt.Sprint("k", i)}
		res, err := s.Begin(ctx, &BeginParams{ID: id, Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			if _, err := s.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventComplete,
				Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("done")}}}); err != nil {
				t.Fatal(err)
			}
		}
	}
	s.exactCountBytes = 0 // the estimate path
	counts, err := s.StateCounts(ctx)
	if err != nil || counts.Counts[statemachine.StateInProgress] != n/2 || counts.Counts[statemachine.StateUnknown] != 0 {
		t.Fatalf("StateCounts: %+v %v, want %d IN_PROGRESS", counts, err, n/2)
	}

	advance(2 * time.Hour)
	counts, err = s.StateCounts(ctx)
	if err != nil || counts.Counts[statemachine.StateInProgress] != 0 || counts.Counts[statemachine.StateUnknown] != n/2 {
		t.Fatalf("StateCounts after the leases: %+v %v, want %d UNKNOWN", counts, err, n/2)
	}
	res, err := s.Reap(ctx, &ReapParams{BatchSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	if res.Unknown != n/2 || len(res.UnknownScopes) != n/2 || res.Expired != n/2 || res.Deleted != n/2 {
		t.Fatalf("Reap: %+v, want %d unknown (with their scopes), expired and deleted", res, n/2)
	}
	for _, sc := range res.UnknownScopes {
		if sc != "scope1" {
			t.Fatalf("Reap: unknown scopes %v, want scope1 only", res.UnknownScopes)
		}
	}
	advance(2 * time.Hour)
	res, err = s.Reap(ctx, &ReapParams{UnknownRetention: time.Hour, ScopeRetention: []ScopeRetention{{Glob: "scope*", Retention: time.Hour}}})
	if err != nil || res.Archived != n/2 || len(res.ArchivedScopes) != n/2 {
		t.Fatalf("Reap archiving: %+v %v, want %d archived", res, err, n/2)
	}
	advance(2 * time.Hour)
	res, err = s.Reap(ctx, &ReapParams{ArchiveRetention: time.Hour})
	if err != nil || res.ArchivePruned != n/2 {
		t.Fatalf("Reap pruning the archive: %+v %v, want %d pruned", res, err, n/2)
	}
	total, err := s.CountByState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for st, c := range total {
		if c != 0 {
			t.Errorf("after reaping, %d records %v", c, st)
		}
	}
	// With the database's clock.
	s.clock = nil
	if _, err := s.Reap(ctx, &ReapParams{UnknownRetention: time.Hour, ArchiveRetention: time.Hour}); err != nil {
		t.Fatalf("Reap with the database's clock: %v", err)
	}
}
