package chaos

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// waitNoOpenTransactions waits until the database shows no statement or
// transaction of the coordinator in progress: a call that went unanswered
// because its connection was cut may still commit until then.
func waitNoOpenTransactions(t *testing.T, dbURL string) {
	t.Helper()
	waitNoOpenTransactionsOf(t, dbURL, "idemcoord")
}

// waitNoOpenTransactionsOf is waitNoOpenTransactions for the coordinator
// whose connections carry application_name app.
func waitNoOpenTransactionsOf(t *testing.T, dbURL, app string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		n, err := openTransactions(dbURL, app)
		if err == nil && n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the coordinator still has %d statements or transactions open after 30s (%v)", n, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitNoCitusTransactions waits until the Citus worker at dbURL shows no
// statement or transaction in progress on a connection from a Citus
// coordinator node: a single-shard statement commits on the worker, which
// may still be at it after the coordinator node's backend ended.
func waitNoCitusTransactions(t *testing.T, dbURL string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		n, err := countActivity(dbURL, `application_name LIKE 'citus_internal%' AND state IS DISTINCT FROM 'idle'`)
		if err == nil && n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the worker %s still has %d statements or transactions of a coordinator node open after 30s (%v)", hostOf(dbURL), n, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func hostOf(dbURL string) string {
	u, err := url.Parse(dbURL)
	if err != nil {
		return "?"
	}
	return u.Host
}

func openTransactions(dbURL, app string) (int, error) {
	return countActivity(dbURL, `application_name = $1 AND state IS DISTINCT FROM 'idle'`, app)
}

// countActivity counts the rows of pg_stat_activity that match where, on a
// connection of its own.
func countActivity(dbURL, where string, args ...any) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return -1, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE `+where, args...).Scan(&n)
	return n, err
}

// waitCutBackendsGone waits until PostgreSQL runs no more backends for the
// coordinator than the proxy has connections open. A backend whose
// connection was cut may still hold a statement the coordinator sent just
// before the cut, unread in its socket buffer while pg_stat_activity shows
// it idle; it runs that statement, if at all, before it exits, so only
// then has every unanswered call of the round taken effect or not.
func waitCutBackendsGone(t *testing.T, dbURL string, proxy *Proxy) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		n, err := coordinatorBackends(dbURL)
		if err == nil && n <= proxy.Links() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("PostgreSQL still runs %d backends for the coordinator, %d connections through the proxy, after 30s (%v)", n, proxy.Links(), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func coordinatorBackends(dbURL string) (int, error) {
	return countActivity(dbURL, `application_name = 'idemcoord'`)
}
