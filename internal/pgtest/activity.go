package pgtest

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// activityTimeout bounds how long WaitForLockWaiters and WaitForBackendsDone
// wait before they fail the test.
const activityTimeout = 10 * time.Second

// lockWaitersSQL lists the backends of the current database that wait on
// a lock.
const lockWaitersSQL = `SELECT pid FROM pg_stat_activity
	WHERE wait_event_type = 'Lock' AND datname = current_database()`

// citusLockWaitersSQL does so on Citus, where a statement sent through the
// coordinator node waits on the worker that holds the row: every node's
// backends that wait on a lock, named by the process ID, on the
// coordinator node, of the session they work for (a global PID is the
// node's id times 10^10 plus the process ID there).
const citusLockWaitersSQL = `SELECT DISTINCT (global_pid % 10000000000)::int4 FROM citus_stat_activity
	WHERE wait_event_type = 'Lock' AND datname = current_database()
		AND global_pid / 10000000000 = citus_backend_gpid() / 10000000000`

// WaitForLockWaiters waits until at least one backend of conn's database
// waits on a lock, and returns the process IDs of those that do. On Citus
// (conn's database has the citus extension) it also sees waits on the
// workers, and returns the process IDs of the coordinator node's sessions
// they work for. It fails the test after 10 s.
func WaitForLockWaiters(t testing.TB, conn *pgx.Conn) []int32 {
	t.Helper()
	query := lockWaitersSQL
	var citus bool
	if err := conn.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')`).Scan(&citus); err != nil {
		t.Fatal(err)
	}
	if citus {
		query = citusLockWaitersSQL
	}
	for deadline := time.Now().Add(activityTimeout); ; {
		rows, err := conn.Query(context.Background(), query)
		if err != nil {
			t.Fatal(err)
		}
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			t.Fatal(err)
		}
		if len(pids) > 0 {
			return pids
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgtest: no statement waits for a lock after %v", activityTimeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// WaitForBackendsDone waits until none of the backends pids runs a
// statement or holds a transaction open (each is idle or gone). What a
// statement of theirs committed is visible once it returns: a backend
// reports itself idle only after its commit. It fails the test after 10 s.
func WaitForBackendsDone(t testing.TB, conn *pgx.Conn, pids []int32) {
	t.Helper()
	for deadline := time.Now().Add(activityTimeout); ; {
		var busy int
		if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE pid = ANY($1) AND state <> 'idle'`, pids).Scan(&busy); err != nil {
			t.Fatal(err)
		}
		if busy == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgtest: %d of the backends %v still busy after %v", busy, pids, activityTimeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
