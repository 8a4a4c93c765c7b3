package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestCitusDatabasesCarryDistributedTables migrates a template on a Citus
// cluster, with a table distributed over the workers, and checks that each
// test database cloned from it is a working distributed database of its
// own: rows written through the coordinator node land in shards on both
// workers, and another clone does not see them.
func TestCitusDatabasesCarryDistributedTables(t *testing.T) {
	cc := StartCitusCluster(t, ClusterOptions{})
	env := &environment{template: "pgtest_template_" + randomSuffix(), nodes: cc.nodeURLs("postgres")}
	env.base = mustParseURL(t, cc.URL("postgres"))
	err := env.makeTemplate(func(ctx context.Context, databaseURL string) error {
		conn, err := pgx.Connect(ctx, databaseURL)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, "CREATE TABLE widgets (name text PRIMARY KEY); SELECT create_distributed_table('widgets', 'name')")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := env.tearDown(); err != nil {
			t.Errorf("tear down: %v", err)
		}
		for _, node := range cc.nodes() {
			conn, err := pgx.Connect(context.Background(), node.URL("postgres"))
			if err != nil {
				t.Fatal(err)
			}
			var n int
			err = conn.QueryRow(context.Background(), "SELECT count(*) FROM pg_database WHERE datname = $1", env.template).Scan(&n)
			conn.Close(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Errorf("the template is still on node %s after tear down", node.URL("postgres"))
			}
		}
	})

	start := time.Now()
	a := env.newDatabase(t)
	t.Logf("one database cloned on 3 nodes in %v", time.Since(start))
	b := env.newDatabase(t)

	connA := connect(t, a)
	if _, err := connA.Exec(t.Context(), "INSERT INTO widgets SELECT 'w' || g FROM generate_series(1, 100) g"); err != nil {
		t.Fatalf("insert through the coordinator node: %v", err)
	}
	// The rows each worker's placements hold, read on the worker itself.
	rows, _ := connA.Query(t.Context(), `SELECT nodeport, sum(result::bigint)::bigint
		FROM run_command_on_placements('widgets', 'SELECT count(*) FROM %s') GROUP BY nodeport ORDER BY nodeport`)
	type placement struct{ Port, Rows int64 }
	perNode, err := pgx.CollectRows(rows, pgx.RowToStructByPos[placement])
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, p := range perNode {
		total += p.Rows
		if p.Rows == 0 {
			t.Errorf("worker on port %d holds no rows: %v", p.Port, perNode)
		}
	}
	if len(perNode) != len(cc.Workers) || total != 100 {
		t.Errorf("rows per worker = %v, want 100 rows over %d workers", perNode, len(cc.Workers))
	}

	var inB int
	if err := connect(t, b).QueryRow(t.Context(), "SELECT count(*) FROM widgets").Scan(&inB); err != nil {
		t.Fatalf("query the other database: %v", err)
	}
	if inB != 0 {
		t.Errorf("the other test's database sees %d rows, want 0", inB)
	}
}

// TestRequireCitusSkipsOrFailsUnderCI points pgtest at a PostgreSQL
// without Citus (its pg_config names empty directories): RequireCitus
// skips a test, and fails it under CI=true, naming the build script.
func TestRequireCitusSkipsOrFailsUnderCI(t *testing.T) {
	realBins, err := findBinaries()
	if err != nil {
		t.Skip(err)
	}
	bin := t.TempDir()
	for _, p := range []string{"initdb", "postgres"} {
		if err := os.Symlink(filepath.Join(realBins, p), filepath.Join(bin, p)); err != nil {
			t.Fatal(err)
		}
	}
	empty := t.TempDir()
	script := "#!/bin/sh\necho " + empty + "\n"
	if err := os.WriteFile(filepath.Join(bin, "pg_config"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PG_BIN", bin)
	for _, ci := range []string{"", "true"} {
		t.Setenv("CI", ci)
		r := &citusRecorder{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			RequireCitus(r)
		}()
		<-done
		if ci == "true" && (!r.failed || r.skipped) || ci == "" && (r.failed || !r.skipped) {
			t.Errorf("CI=%q: failed=%v skipped=%v", ci, r.failed, r.skipped)
		}
		if !strings.Contains(r.msg, "citus/build.sh") {
			t.Errorf("CI=%q: message %q does not say how to install Citus", ci, r.msg)
		}
	}
}

// citusRecorder records how RequireCitus ends a test.
type citusRecorder struct {
	testing.TB
	failed, skipped bool
	msg             string
}

func (r *citusRecorder) Helper() {}

func (r *citusRecorder) Fatalf(format string, args ...any) {
	r.failed, r.msg = true, fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func (r *citusRecorder) Skipf(format string, args ...any) {
	r.skipped, r.msg = true, fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func mustParseURL(t *testing.T, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// TestWaitForLockWaitersSeesWaitsOnWorkers: on Citus a statement sent
// through the coordinator node waits for a row lock on the worker that
// holds the row; WaitForLockWaiters names the coordinator node's session
// that waits, and WaitForBackendsDone sees it finish.
func TestWaitForLockWaitersSeesWaitsOnWorkers(t *testing.T) {
	cc := StartCitusCluster(t, ClusterOptions{})
	ctx := t.Context()
	if err := cc.CreateDatabase(ctx, "locks"); err != nil {
		t.Fatal(err)
	}
	holder, waiter, observer := connect(t, cc.URL("locks")), connect(t, cc.URL("locks")), connect(t, cc.URL("locks"))
	if _, err := holder.Exec(ctx, "CREATE TABLE widgets (name text PRIMARY KEY, n int); SELECT create_distributed_table('widgets', 'name'); INSERT INTO widgets VALUES ('w', 0)"); err != nil {
		t.Fatal(err)
	}
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE widgets SET n = 1 WHERE name = 'w'"); err != nil {
		t.Fatal(err)
	}
	var waiterPID int32
	if err := waiter.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&waiterPID); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := waiter.Exec(ctx, "UPDATE widgets SET n = 2 WHERE name = 'w'")
		done <- err
	}()
	pids := WaitForLockWaiters(t, observer)
	if len(pids) != 1 || pids[0] != waiterPID {
		t.Errorf("lock waiters = %v, want the waiting session's PID on the coordinator node, %d", pids, waiterPID)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	WaitForBackendsDone(t, observer, pids)
	if err := <-done; err != nil {
		t.Fatalf("the waiting update: %v", err)
	}
}
