package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// CitusEnv is the environment variable that puts Main in Citus mode: set
// to 1, Main runs the test binary's tests on a Citus cluster (a coordinator
// node and two workers) instead of a single PostgreSQL.
const CitusEnv = "IDEMCOORD_TEST_CITUS"

// citusWorkers is how many workers a Citus cluster that pgtest starts has.
const citusWorkers = 2

// citusMode reports whether Main runs on Citus (CitusEnv=1).
func citusMode() bool { return os.Getenv(CitusEnv) == "1" }

// A CitusCluster is a Citus cluster that a test owns: a coordinator node
// and workers, each a Cluster (so a test may stop or kill one node), with
// the citus library preloaded on each. Its databases are made with
// CreateDatabase, which creates the extension on every node and registers
// the workers with the coordinator node.
type CitusCluster struct {
	Coordinator *Cluster
	Workers     []*Cluster
}

// StartCitusCluster starts a Citus cluster for t (a coordinator node and
// two workers; opts applies to each node) and stops and deletes it when
// t's cleanup runs. Without Citus installed it skips t, or fails it when
// CI=true.
func StartCitusCluster(t testing.TB, opts ClusterOptions) *CitusCluster {
	t.Helper()
	RequireCitus(t)
	cc, err := startCitusCluster(opts)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		for _, n := range cc.nodes() {
			if t.Failed() {
				t.Logf("pgtest: end of the server log %s:\n%s", n.logPath, n.logTail())
			}
		}
		if err := cc.destroy(); err != nil {
			t.Errorf("pgtest: %v", err)
		}
	})
	return cc
}

// RequireCitus skips t when the Citus extension is not installed in the
// PostgreSQL that pgtest would start, or fails it when CI=true.
func RequireCitus(t testing.TB) {
	t.Helper()
	if err := citusInstalled(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("pgtest: %v", err)
		}
		t.Skipf("pgtest: %v", err)
	}
}

// citusInstalled reports why Citus cannot be used, or nil.
func citusInstalled() error {
	bin, err := findBinaries()
	if err != nil {
		return err
	}
	dir := func(flag string) string {
		out, err := exec.Command(filepath.Join(bin, "pg_config"), flag).Output()
		if err != nil {
			return ""
		}
		return strings.TrimSpace(string(out))
	}
	lib, share := dir("--pkglibdir"), dir("--sharedir")
	if lib == "" || share == "" {
		return fmt.Errorf("no pg_config in %s to find the citus extension with", bin)
	}
	for _, f := range []string{filepath.Join(lib, "citus.so"), filepath.Join(share, "extension", "citus.control")} {
		if _, err := os.Stat(f); err != nil {
			return fmt.Errorf("the citus extension is not installed in the PostgreSQL at %s (no %s): "+
				"build and install it with ../shared/citus/build.sh (as root; .ci/run does)", bin, f)
		}
	}
	return nil
}

// citusSettings are the server settings of every node of a Citus cluster.
var citusSettings = []string{"shared_preload_libraries=citus"}

// startCitusCluster starts the coordinator node and the workers. On error
// it leaves nothing behind.
func startCitusCluster(opts ClusterOptions) (_ *CitusCluster, err error) {
	if err := citusInstalled(); err != nil {
		return nil, err
	}
	opts.Settings = append(append([]string(nil), citusSettings...), opts.Settings...)
	cc := &CitusCluster{}
	defer func() {
		if err != nil {
			_ = cc.destroy()
		}
	}()
	// One at a time: initdb and start-up are CPU-bound and the machine
	// may be small.
	for i := 0; i <= citusWorkers; i++ {
		c, err := startCluster(opts)
		if err != nil {
			return nil, err
		}
		if i == 0 {
			cc.Coordinator = c
		} else {
			cc.Workers = append(cc.Workers, c)
		}
	}
	return cc, nil
}

// nodes returns the coordinator node, then the workers.
func (cc *CitusCluster) nodes() []*Cluster {
	var ns []*Cluster
	if cc.Coordinator != nil {
		ns = append(ns, cc.Coordinator)
	}
	return append(ns, cc.Workers...)
}

// nodeURLs returns the URL of database dbname on each node, the
// coordinator node's first.
func (cc *CitusCluster) nodeURLs(dbname string) []string {
	var urls []string
	for _, n := range cc.nodes() {
		urls = append(urls, n.URL(dbname))
	}
	return urls
}

// URL returns the URL of database dbname on the coordinator node: the one
// that applications connect to.
func (cc *CitusCluster) URL(dbname string) string { return cc.Coordinator.URL(dbname) }

// SpreadURL returns the URL of database dbname that lists every node's
// host and port, the coordinator node's first (where migrations go), with
// load_balance_hosts=random: the coordinator's pool spreads its
// connections over the nodes.
func (cc *CitusCluster) SpreadURL(dbname string) string {
	u, err := url.Parse(cc.URL(dbname))
	if err != nil {
		panic(fmt.Sprintf("pgtest: the coordinator node's URL does not parse: %v", err))
	}
	var hosts []string
	for _, n := range cc.nodes() {
		nu, err := url.Parse(n.URL(dbname))
		if err != nil {
			panic(fmt.Sprintf("pgtest: a node's URL does not parse: %v", err))
		}
		hosts = append(hosts, nu.Host)
	}
	u.Host = strings.Join(hosts, ",")
	q := u.Query()
	q.Set("load_balance_hosts", "random")
	u.RawQuery = q.Encode()
	return u.String()
}

// CreateDatabase creates database dbname on every node, creates the citus
// extension in each, and registers the coordinator node and the workers
// in the coordinator node's copy, so that tables there can be distributed.
func (cc *CitusCluster) CreateDatabase(ctx context.Context, dbname string) error {
	return createCitusDatabase(ctx, cc.nodeURLs("postgres"), dbname)
}

// destroy stops and deletes every node.
func (cc *CitusCluster) destroy() error {
	var errs []error
	for _, n := range cc.nodes() {
		errs = append(errs, n.destroy())
	}
	return errors.Join(errs...)
}

// createCitusDatabase creates database dbname on each node that nodes
// names (a URL of any database there, the coordinator node's first),
// creates the citus extension in each copy and registers the coordinator
// node and the workers in the coordinator node's copy. Citus connects to
// a worker's database of the same name as the coordinator node's, with
// the same user.
func createCitusDatabase(ctx context.Context, nodes []string, dbname string) error {
	ident := pgx.Identifier{dbname}.Sanitize()
	for _, n := range nodes {
		if err := execOn(ctx, n, "CREATE DATABASE "+ident); err != nil {
			return fmt.Errorf("create database %s on %s: %w", dbname, hostPort(n), err)
		}
		if err := execOn(ctx, withDatabase(n, dbname), "CREATE EXTENSION citus"); err != nil {
			return fmt.Errorf("create extension citus on %s: %w", hostPort(n), err)
		}
	}
	coordinator := withDatabase(nodes[0], dbname)
	host, port := splitHostPort(nodes[0])
	if err := execOn(ctx, coordinator, "SELECT citus_set_coordinator_host($1, $2)", host, port); err != nil {
		return fmt.Errorf("register the coordinator node: %w", err)
	}
	for _, w := range nodes[1:] {
		host, port := splitHostPort(w)
		if err := execOn(ctx, coordinator, "SELECT citus_add_node($1, $2)", host, port); err != nil {
			return fmt.Errorf("register worker %s: %w", hostPort(w), err)
		}
	}
	return nil
}

// citusNodes returns, for the coordinator node at base (a URL of a
// database with the citus extension), the URL of the same database on
// each of its primary nodes, the coordinator node's (base) first. A
// worker's URL is base with the host and port that the coordinator node
// knows it by.
func citusNodes(ctx context.Context, base *url.URL) ([]string, error) {
	conn, err := pgx.Connect(ctx, base.String())
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, _ := conn.Query(ctx, `SELECT nodename, nodeport FROM pg_dist_node
		WHERE noderole = 'primary' AND groupid <> 0 ORDER BY nodeid`)
	type node struct {
		Name string
		Port int
	}
	workers, err := pgx.CollectRows(rows, pgx.RowToStructByPos[node])
	if err != nil {
		return nil, fmt.Errorf("list the workers (is %s a Citus coordinator node with the citus extension?): %w", base.Redacted(), err)
	}
	if len(workers) == 0 {
		return nil, fmt.Errorf("%s is a Citus coordinator node without workers", base.Redacted())
	}
	nodes := []string{base.String()}
	for _, w := range workers {
		u := *base
		u.Host = net.JoinHostPort(w.Name, strconv.Itoa(w.Port))
		nodes = append(nodes, u.String())
	}
	return nodes, nil
}

// execOn runs one statement on a fresh connection to the database at
// dbURL.
func execOn(ctx context.Context, dbURL, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql, args...)
	return err
}

// withDatabase returns dbURL with its database replaced by dbname.
func withDatabase(dbURL, dbname string) string {
	u, err := url.Parse(dbURL)
	if err != nil {
		return dbURL
	}
	u.Path, u.RawPath = "/"+dbname, ""
	return u.String()
}

// hostPort returns the host:port of dbURL, for messages.
func hostPort(dbURL string) string {
	u, err := url.Parse(dbURL)
	if err != nil {
		return "?"
	}
	return u.Host
}

// splitHostPort returns the host and port of dbURL (port 5432 when the URL
// names none).
func splitHostPort(dbURL string) (string, int) {
	u, err := url.Parse(dbURL)
	if err != nil {
		return "", 0
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		port = 5432
	}
	return u.Hostname(), port
}
