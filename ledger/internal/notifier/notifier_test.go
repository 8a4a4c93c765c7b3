package notifier

import (
	"context"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// testStatements are PostgreSQL's statements of the notifier, as the
// ledger's statement layer writes them.
var testStatements = Statements{
	Listen:     `LISTEN ` + Channel,
	Dropped:    `SELECT dropped FROM idemcoord_notify_drops`,
	Ping:       `SELECT pg_notify($1, $2 || d.dropped), pg_notification_queue_usage() FROM idemcoord_notify_drops d`,
	QueueUsage: `SELECT pg_notification_queue_usage()`,
}

// TestMain gives each test a database with the one table the notifier
// reads (the ledger's migrations create it with the records trigger).
func TestMain(m *testing.M) {
	os.Exit(pgtest.Main(m, func(ctx context.Context, url string) error {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, `CREATE TABLE idemcoord_notify_drops (
	id      boolean PRIMARY KEY DEFAULT true CHECK (id),
	dropped bigint  NOT NULL DEFAULT 0);
INSERT INTO idemcoord_notify_drops DEFAULT VALUES`)
		return err
	}))
}

// start starts a notifier on a fresh database and closes it at the end.
func start(t *testing.T) *Notifier {
	t.Helper()
	url := pgtest.NewDatabase(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	n := New(Config{Statements: testStatements, ConnConfig: cfg, Pings: pool})
	n.Start()
	t.Cleanup(n.Close)
	return n
}

// TestListenerFallenBehindReconnects makes a notifier's own pings look
// 20 s late (as from a listener that stopped reading): it stops trusting
// notifications (not fresh: no replay cache; polling: waiters poll), and
// the listener reconnects, after which its pings come back and it trusts
// notifications again.
func TestListenerFallenBehindReconnects(t *testing.T) {
	t.Parallel()
	n := start(t)
	const freshness = 900 * time.Millisecond // the replay cache's
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("never %s: %+v", what, n.Stats())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitFor("trusted notifications", func() bool { return n.Fresh(freshness) && !n.Polling() })
	connects := n.main.connects.Load()
	lagging := time.Now().Add(-20 * time.Second).UnixNano()
	n.main.lastSeen.Store(lagging)
	n.main.connectedAt.Store(lagging)
	n.main.checkLag(time.Now())
	if n.Fresh(freshness) || !n.Polling() {
		t.Fatalf("a listener 20 s behind: fresh=%v polling=%v", n.Fresh(freshness), n.Polling())
	}
	waitFor("reconnected", func() bool { return n.main.connects.Load() > connects && n.main.lastSeen.Load() > lagging })
	waitFor("trusted notifications again", func() bool { return n.Fresh(freshness) && !n.Polling() })
}

// TestOtherNodes gives a notifier a second database as an other node
// (Config.Nodes), as a Citus worker would be: notifications sent there
// wake subscribers; notifications are trusted only while that node's
// pings come back too; a failing node list stops the trust; a node no
// longer listed is no longer listened on.
func TestOtherNodes(t *testing.T) {
	t.Parallel()
	mainURL, otherURL := pgtest.NewDatabase(t), pgtest.NewDatabase(t)
	pool, err := pgxpool.New(context.Background(), mainURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	mainCfg, err := pgx.ParseConfig(mainURL)
	if err != nil {
		t.Fatal(err)
	}
	otherCfg, err := pgx.ParseConfig(otherURL)
	if err != nil {
		t.Fatal(err)
	}
	type listing struct {
		nodes []*pgx.ConnConfig
		err   error
	}
	var current atomic.Pointer[listing]
	current.Store(&listing{nodes: []*pgx.ConnConfig{otherCfg}})
	n := New(Config{Statements: testStatements, ConnConfig: mainCfg, Pings: pool,
		Nodes: func(context.Context) ([]*pgx.ConnConfig, error) { l := current.Load(); return l.nodes, l.err }})
	n.Start()
	t.Cleanup(n.Close)
	const freshness = 900 * time.Millisecond
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("never %s: %+v", what, n.Stats())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitFor("trusted notifications on both nodes", func() bool { return n.Fresh(freshness) && !n.Polling() })
	if got := len(n.nodes()); got != 2 {
		t.Fatalf("%d nodes, want 2", got)
	}

	// A record change notified on the other node wakes its subscriber.
	h := RecordHash("t", "s", "k")
	ch, unsubscribe := n.Subscribe(h)
	defer unsubscribe()
	select { // the wake-up a new subscriber gets
	case <-ch:
	case <-time.After(10 * time.Second):
	}
	other, err := pgx.Connect(context.Background(), otherURL)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(context.Background())
	if _, err := other.Exec(context.Background(), `SELECT pg_notify($1, $2)`, Channel, h); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatal("a notification on the other node never woke the subscriber")
	}

	// The other node's listener frozen out: its connection ended and no
	// longer possible (the node's database refuses connections).
	if _, err := other.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()`); err != nil {
		t.Fatal(err)
	}
	current.Store(&listing{err: context.DeadlineExceeded})
	waitFor("distrust while the node list cannot be read", func() bool { return !n.Fresh(freshness) && n.Polling() })
	current.Store(&listing{nodes: []*pgx.ConnConfig{otherCfg}})
	waitFor("trust again", func() bool { return n.Fresh(freshness) && !n.Polling() })

	// A node no longer listed is dropped: its listener ends.
	current.Store(&listing{})
	waitFor("the removed node dropped", func() bool { return len(n.nodes()) == 1 })
	waitFor("no listener left on the removed node", func() bool {
		var listeners int
		err := other.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&listeners)
		return err == nil && listeners == 0
	})
	waitFor("trusted notifications on the main node alone", func() bool { return n.Fresh(freshness) && !n.Polling() })
}
