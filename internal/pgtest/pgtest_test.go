package pgtest

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) {
	if os.Getenv(tiedHelperEnv) != "" {
		os.Exit(runTiedHelper())
	}
	os.Exit(Main(m, func(ctx context.Context, databaseURL string) error {
		conn, err := pgx.Connect(ctx, databaseURL)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, "CREATE TABLE widgets (name text PRIMARY KEY)")
		return err
	}))
}

func connect(t *testing.T, databaseURL string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), databaseURL)
	if err != nil {
		t.Fatalf("connect to %s: %v", databaseURL, err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func TestNewDatabaseGivesEachTestItsOwnMigratedDatabase(t *testing.T) {
	urls := make(chan string, 2)
	for _, name := range []string{"a", "b"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dbURL := NewDatabase(t)
			urls <- dbURL
			conn := connect(t, dbURL)
			if _, err := conn.Exec(t.Context(), "INSERT INTO widgets VALUES ($1)", name); err != nil {
				t.Fatalf("insert into the migrated table: %v", err)
			}
			rows, _ := conn.Query(t.Context(), "SELECT name FROM widgets")
			names, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if len(names) != 1 || names[0] != name {
				t.Errorf("widgets = %q, want only %q", names, name)
			}
		})
	}
	t.Cleanup(func() {
		close(urls)
		a, b := <-urls, <-urls
		if a == b {
			t.Errorf("both tests got %s", a)
		}
	})
}

func TestNewDatabaseDropsTheDatabaseOfAPassedTest(t *testing.T) {
	var dbURL string
	t.Run("inner", func(t *testing.T) { dbURL = NewDatabase(t) })
	if _, err := pgx.Connect(t.Context(), dbURL); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("connect to the dropped database: err = %v, want \"does not exist\"", err)
	}
}

// fatalRecorder stands in for a testing.TB to observe Fatal.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Fatal(args ...any) {
	r.msg = fmt.Sprint(args...)
	runtime.Goexit()
}

// Not parallel: it hides Main's environment while it runs.
func TestNewDatabaseWithoutMainFails(t *testing.T) {
	saved := current.Swap(nil)
	defer current.Store(saved)
	r := &fatalRecorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		NewDatabase(r)
		t.Error("NewDatabase returned without Main")
	}()
	<-done
	if !strings.Contains(r.msg, "pgtest.Main") {
		t.Errorf("Fatal message = %q, want it to name pgtest.Main", r.msg)
	}
}

func TestClusterKeepsDataAcrossStopStartAndKill(t *testing.T) {
	t.Parallel()
	c := StartCluster(t, ClusterOptions{Durable: true})
	dbURL := c.URL("postgres")

	exec := func(sql string) error {
		conn, err := pgx.Connect(t.Context(), dbURL)
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		_, err = conn.Exec(t.Context(), sql)
		return err
	}
	count := func() int {
		conn := connect(t, dbURL)
		var n int
		if err := conn.QueryRow(t.Context(), "SELECT count(*) FROM kept").Scan(&n); err != nil {
			t.Fatalf("count rows after restart: %v", err)
		}
		return n
	}

	if err := exec("CREATE TABLE kept (n int); INSERT INTO kept VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if err := c.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if err := exec("SELECT 1"); err == nil {
		t.Fatal("the stopped cluster accepts connections")
	}
	if err := c.Start(); err != nil {
		t.Fatalf("Start: %v", err)
	}
	if c.URL("postgres") != dbURL {
		t.Errorf("URL after Start = %s, want %s", c.URL("postgres"), dbURL)
	}
	if n := count(); n != 1 {
		t.Errorf("rows after Stop and Start = %d, want 1", n)
	}

	if err := exec("INSERT INTO kept VALUES (2)"); err != nil {
		t.Fatal(err)
	}
	if err := c.Kill(); err != nil {
		t.Fatalf("Kill: %v", err)
	}
	if err := exec("SELECT 1"); err == nil {
		t.Fatal("the killed cluster accepts connections")
	}
	if err := c.Start(); err != nil {
		t.Fatalf("Start after Kill: %v", err)
	}
	if n := count(); n != 2 {
		t.Errorf("rows after Kill and Start = %d, want 2", n)
	}
}

// go test -run '^$' -bench NewDatabase ./internal/pgtest/
func BenchmarkNewDatabase(b *testing.B) {
	for b.Loop() {
		NewDatabase(b)
	}
}

// go test -run '^$' -bench StartCluster -benchtime 5x ./internal/pgtest/
func BenchmarkStartCluster(b *testing.B) {
	for b.Loop() {
		c, err := startCluster(ClusterOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if err := c.destroy(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestClusterKeepsAcknowledgedCommitsAcrossKill checks that a cluster
// that is not durable (fsync off) still keeps every commit it answered
// through a kill of PostgreSQL's processes, for a session that asked for
// nothing: the kernel's page cache holds what a commit wrote, as long as
// the commit wrote its WAL before answering (synchronous_commit on). With
// synchronous_commit off the last commits before the kill were lost,
// answered ones included, on a Citus worker too, whose sessions the
// coordinator node opens with the worker's defaults.
func TestClusterKeepsAcknowledgedCommitsAcrossKill(t *testing.T) {
	t.Parallel()
	c := StartCluster(t, ClusterOptions{})
	dbURL := c.URL("postgres")
	conn := connect(t, dbURL)
	if _, err := conn.Exec(t.Context(), "CREATE TABLE kept (n int)"); err != nil {
		t.Fatal(err)
	}
	const rows = 200
	for n := range rows {
		if _, err := conn.Exec(t.Context(), "INSERT INTO kept VALUES ($1)", n); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Kill(); err != nil {
		t.Fatalf("Kill: %v", err)
	}
	if err := c.Start(); err != nil {
		t.Fatalf("Start after Kill: %v", err)
	}
	var n int
	if err := connect(t, dbURL).QueryRow(t.Context(), "SELECT count(*) FROM kept").Scan(&n); err != nil {
		t.Fatalf("count rows after restart: %v", err)
	}
	if n != rows {
		t.Errorf("rows after Kill and Start = %d, want the %d whose commits were answered", n, rows)
	}
}
