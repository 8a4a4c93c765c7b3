package notifier

import (
	"context"
	"os"
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
	connects := n.connects.Load()
	lagging := time.Now().Add(-20 * time.Second).UnixNano()
	n.lastSeen.Store(lagging)
	n.connectedAt.Store(lagging)
	n.checkLag(time.Now())
	if n.Fresh(freshness) || !n.Polling() {
		t.Fatalf("a listener 20 s behind: fresh=%v polling=%v", n.Fresh(freshness), n.Polling())
	}
	waitFor("reconnected", func() bool { return n.connects.Load() > connects && n.lastSeen.Load() > lagging })
	waitFor("trusted notifications again", func() bool { return n.Fresh(freshness) && !n.Polling() })
}
