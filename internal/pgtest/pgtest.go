package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// environment is what Main sets up for NewDatabase.
type environment struct {
	base     *url.URL // a database on the server; NewDatabase swaps the path
	template string   // migrated database that NewDatabase clones
	cluster  *Cluster // nil when TEST_DATABASE_URL names the server
	// On Citus (CitusEnv=1): a URL of a database on each node, the
	// coordinator node's (base) first; nil on a single PostgreSQL. Each
	// node holds its own copy of the template and of every test's
	// database, under the same name.
	nodes []string
	citus *CitusCluster // nil unless Main started a Citus cluster
}

// current is the environment of the running Main. It is package state
// because NewDatabase, called from tests, has nothing else to reach Main by.
var current atomic.Pointer[environment]

const (
	migrateTimeout = 5 * time.Minute
	adminTimeout   = time.Minute
	// dropTimeout bounds dropping a test's database on one node. On a busy
	// machine Citus's maintenance daemon can take long to leave a database
	// being dropped (each try waits 5 s in the server before 55006).
	dropTimeout = 3 * time.Minute
)

// Main prepares PostgreSQL for a test binary, runs its tests and cleans up;
// it returns the exit code for os.Exit:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, ledger.Migrate)) }
//
// It uses the server that TEST_DATABASE_URL names (a postgres:// URL of any
// database there, as a role that may create databases) or else starts a
// throwaway cluster for this binary.
//
// With IDEMCOORD_TEST_CITUS=1 (CitusEnv) the tests run on Citus: Main
// starts a throwaway Citus cluster (a coordinator node and two workers),
// or uses the one whose coordinator node TEST_DATABASE_URL names (a
// database there with the citus extension; the workers are those it
// registers, reached as the same user). The template exists on every
// node, with the extension and the workers registered, and is migrated
// through the coordinator node; each test's database is cloned from it on
// every node, which carries the distributed tables' metadata and shards.
// Without Citus installed, Main fails. It creates a template database, runs
// migrate on it once and closes every connection to it, then runs the
// tests. At the end it drops the template (TEST_DATABASE_URL) or stops and
// deletes the cluster. If the test binary dies before that, a watchdog
// process stops and deletes the cluster.
//
// When setup fails, Main reports why on standard error and returns 1
// without running the tests.
func Main(m *testing.M, migrate func(ctx context.Context, databaseURL string) error) (code int) {
	env, err := setUp(migrate)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
		return 1
	}
	current.Store(env)
	defer func() {
		current.Store(nil)
		if err := env.tearDown(); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
	}()
	return m.Run()
}

// setUp starts or connects to the server and migrates the template.
func setUp(migrate func(ctx context.Context, databaseURL string) error) (_ *environment, err error) {
	env := &environment{template: "pgtest_template_" + randomSuffix()}
	if raw := os.Getenv("TEST_DATABASE_URL"); raw != "" {
		u, err := url.Parse(raw)
		if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
			return nil, errors.New("TEST_DATABASE_URL must be a postgres:// URL")
		}
		env.base = u
		if citusMode() {
			ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
			env.nodes, err = citusNodes(ctx, u)
			cancel()
			if err != nil {
				return nil, err
			}
		}
	} else if citusMode() {
		cc, err := startCitusCluster(ClusterOptions{})
		if err != nil {
			return nil, err
		}
		env.citus = cc
		env.base, _ = url.Parse(cc.URL("postgres"))
		env.nodes = cc.nodeURLs("postgres")
	} else {
		c, err := startCluster(ClusterOptions{})
		if err != nil {
			return nil, err
		}
		env.cluster = c
		env.base, _ = url.Parse(c.URL("postgres"))
	}
	defer func() {
		if err != nil {
			_ = env.tearDown()
		}
	}()
	if err := env.makeTemplate(migrate); err != nil {
		return nil, err
	}
	return env, nil
}

// makeTemplate creates the template database (on every node), migrates it
// and closes it to connections, so that newDatabase can clone it.
func (env *environment) makeTemplate(migrate func(ctx context.Context, databaseURL string) error) (err error) {
	ctx, cancel := context.WithTimeout(context.Background(), migrateTimeout)
	defer cancel()
	tmpl := pgx.Identifier{env.template}.Sanitize()
	if env.nodes != nil {
		err = createCitusDatabase(ctx, env.nodes, env.template)
	} else {
		err = env.exec(ctx, "CREATE DATABASE "+tmpl)
	}
	if err != nil {
		return fmt.Errorf("create template database: %w", err)
	}
	if err := migrate(ctx, env.url(env.template)); err != nil {
		return fmt.Errorf("migrate template database: %w", err)
	}
	// CREATE DATABASE … TEMPLATE fails while anyone is connected to the
	// template: forbid new connections, then end any that migrate left
	// (and, on Citus, the extension's maintenance daemon, which then
	// stays away).
	for _, node := range env.nodeURLs() {
		if err := execOn(ctx, node, "ALTER DATABASE "+tmpl+" WITH ALLOW_CONNECTIONS false"); err != nil {
			return fmt.Errorf("close template database on %s: %w", hostPort(node), err)
		}
		if err := execOn(ctx, node, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", env.template); err != nil {
			return fmt.Errorf("close connections to template database on %s: %w", hostPort(node), err)
		}
	}
	return nil
}

// tearDown stops the cluster, or drops the template from the server named
// by TEST_DATABASE_URL.
func (env *environment) tearDown() error {
	if env.cluster != nil {
		return env.cluster.destroy()
	}
	if env.citus != nil {
		return env.citus.destroy()
	}
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()
	if err := env.dropDatabase(ctx, env.template); err != nil {
		return fmt.Errorf("drop template database: %w", err)
	}
	return nil
}

// nodeURLs returns a URL of a database on each node: the base alone on a
// single PostgreSQL.
func (env *environment) nodeURLs() []string {
	if env.nodes != nil {
		return env.nodes
	}
	return []string{env.base.String()}
}

// dropDatabase drops database dbname on every node, the coordinator
// node's copy first.
func (env *environment) dropDatabase(ctx context.Context, dbname string) error {
	var errs []error
	for _, node := range env.nodeURLs() {
		nctx, cancel := context.WithTimeout(ctx, dropTimeout)
		for attempt := 1; ; attempt++ {
			err := execOn(nctx, node, "DROP DATABASE IF EXISTS "+pgx.Identifier{dbname}.Sanitize()+" WITH (FORCE)")
			// 55006 object_in_use: on Citus, FORCE does not end the
			// extension's maintenance daemon, which leaves the database
			// on its own when it is dropped, but not at once.
			var pgErr *pgconn.PgError
			if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55006" || nctx.Err() != nil {
				if err != nil {
					errs = append(errs, fmt.Errorf("on %s: %w (still connected: %s)", hostPort(node), err, holders(node, dbname)))
				}
				break
			}
			time.Sleep(min(time.Duration(attempt)*10*time.Millisecond, time.Second))
		}
		cancel()
	}
	return errors.Join(errs...)
}

// holders names the sessions connected to database dbname on node, for the
// message of a drop that failed.
func holders(node, dbname string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, node)
	if err != nil {
		return "unknown: " + err.Error()
	}
	defer func() { _ = conn.Close(context.Background()) }()
	var who string
	err = conn.QueryRow(ctx, `SELECT coalesce(string_agg(format('%s/%s/%s', backend_type, application_name, state), ', '), 'none')
		FROM pg_stat_activity WHERE datname = $1`, dbname).Scan(&who)
	if err != nil {
		return "unknown: " + err.Error()
	}
	return who
}

// url returns the URL of database dbname on the environment's server.
func (env *environment) url(dbname string) string {
	u := *env.base
	u.Path, u.RawPath = "/"+dbname, ""
	return u.String()
}

// exec runs one statement on a fresh connection to the base database.
func (env *environment) exec(ctx context.Context, sql string, args ...any) error {
	return execOn(ctx, env.base.String(), sql, args...)
}

// NewDatabase creates a database for t, cloned from the template that Main
// migrated, and returns its postgres:// URL. It is safe to call from
// parallel tests. When t's cleanup runs the database is dropped, or, if t
// failed, kept and its URL logged (a cluster that Main started is still
// deleted when the test binary ends). NewDatabase fails t when Main is not
// running.
func NewDatabase(t testing.TB) string {
	t.Helper()
	env := current.Load()
	if env == nil {
		t.Fatal("pgtest: NewDatabase needs pgtest.Main; add to the package's tests: " +
			"func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, migrate)) }")
	}
	return env.newDatabase(t)
}

// newDatabase clones the template for t (on every node), as NewDatabase
// promises.
func (env *environment) newDatabase(t testing.TB) string {
	t.Helper()
	name := databaseName(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()
	create := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize() + " TEMPLATE " + pgx.Identifier{env.template}.Sanitize()
	// On Citus the workers' copies first, so that the coordinator node's
	// copy never names a worker database that does not exist yet.
	nodes := env.nodeURLs()
	for _, node := range slices.Backward(nodes) {
		for attempt := 1; ; attempt++ {
			err := execOn(ctx, node, create)
			if err == nil {
				break
			}
			// 55006 object_in_use: "source database is being accessed by
			// other users"; no one should be, but a straggler may not have
			// gone yet.
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "55006" || attempt == 20 {
				t.Fatalf("pgtest: create database %s on %s: %v", name, hostPort(node), err)
			}
			time.Sleep(time.Duration(attempt) * 10 * time.Millisecond)
		}
	}
	dbURL := env.url(name)
	t.Cleanup(func() {
		if t.Failed() {
			if env.cluster != nil || env.citus != nil {
				t.Logf("pgtest: kept the database of the failed test until the test binary exits (set TEST_DATABASE_URL to keep it longer): %s", dbURL)
			} else {
				t.Logf("pgtest: kept the database of the failed test: %s", dbURL)
			}
			return
		}
		// dropDatabase bounds each node's drop (dropTimeout).
		if err := env.dropDatabase(context.Background(), name); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})
	return dbURL
}

// databaseName makes a unique database name that starts with the test's
// name, so that a kept database is easy to trace back.
func databaseName(testName string) string {
	var b strings.Builder
	b.WriteString("pgtest_")
	for _, r := range strings.ToLower(testName) {
		if b.Len() >= 46 { // leave room for the suffix within PostgreSQL's 63 bytes
			break
		}
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	b.WriteByte('_')
	b.WriteString(randomSuffix())
	return b.String()
}

// randomSuffix returns 16 random hex digits.
func randomSuffix() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
