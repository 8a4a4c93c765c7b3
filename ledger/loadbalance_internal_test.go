package ledger

import (
	"crypto/sha256"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// pairsOn runs Begin then Complete of n new keys from callers goroutines
// at once, so that the pool opens many connections.
func pairsOn(t *testing.T, s *Store, prefix string, callers, n int) {
	t.Helper()
	ctx := t.Context()
	var wg sync.WaitGroup
	errs := make([]error, callers)
	for w := range callers {
		wg.Go(func() {
			for i := range n {
				id := Identity{Tenant: "t", Scope: "s", Key: fmt.Sprintf("%s-%d-%d", prefix, w, i)}
				res, err := s.Begin(ctx, &BeginParams{ID: id, Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
				if err == nil && res.Outcome != statemachine.OutcomeAcquired {
					err = fmt.Errorf("Begin %s: outcome %v", id.Key, res.Outcome)
				}
				if err == nil {
					_, err = s.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventComplete,
						Token: res.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("ok")}}})
				}
				if err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// withQuery returns dbURL with name=value added to its query.
func withQuery(t *testing.T, dbURL, name, value string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set(name, value)
	u.RawQuery = q.Encode()
	return u.String()
}

// TestCitusLoadBalanceHosts opens a store on a URL that lists the Citus
// coordinator node and both workers with load_balance_hosts=random: the
// pool's connections land on more than one node (each connection's
// server port, and pg_stat_activity of each node), and Begin and Complete
// of many keys work through them (a worker with metadata routes any
// key's statement), and the console's sessions (a table of the
// coordinator node) too.
func TestCitusLoadBalanceHosts(t *testing.T) {
	cc := pgtest.StartCitusCluster(t, pgtest.ClusterOptions{})
	ctx := t.Context()
	if err := cc.CreateDatabase(ctx, "idemcoord"); err != nil {
		t.Fatal(err)
	}
	if err := Migrate(ctx, cc.URL("idemcoord")); err != nil {
		t.Fatal(err)
	}
	nodes := append([]*pgtest.Cluster{cc.Coordinator}, cc.Workers...)
	spread := cc.SpreadURL("idemcoord")
	if err := Migrate(ctx, spread); err != nil {
		t.Fatalf("migrate through the multi-host URL: %v", err)
	}
	s, err := Open(ctx, spread)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	pairsOn(t, s, "spread", 24, 20)

	perPort := map[uint16]int{}
	conns := s.pool.AcquireAllIdle(ctx)
	for _, c := range conns {
		var port int
		if err := c.QueryRow(ctx, "SELECT inet_server_port()").Scan(&port); err != nil {
			t.Fatal(err)
		}
		perPort[uint16(port)]++
		c.Release()
	}
	if len(perPort) < 2 {
		t.Errorf("the pool's %d idle connections are on %d node(s) (by server port: %v), want more than one", len(conns), len(perPort), perPort)
	}
	// pg_stat_activity of each node agrees: it has at least the pool's
	// connections that reached it (and the notifier's).
	after := appConns(t, nodes)
	for i, n := range nodes {
		u, _ := url.Parse(n.URL("idemcoord"))
		var port int
		_, _ = fmt.Sscan(u.Port(), &port)
		if after[i] < perPort[uint16(port)] {
			t.Errorf("node %s: %d idemcoord connections in pg_stat_activity, fewer than the pool's %d there", u.Host, after[i], perPort[uint16(port)])
		}
	}
	// The console's sessions live in a table of the coordinator node
	// only: they go to the URL's first host, never to a worker.
	sessions := NewSessions(s)
	for i := range 20 {
		id, tok := sha256.Sum256(fmt.Appendf(nil, "id%d", i)), sha256.Sum256(fmt.Appendf(nil, "tok%d", i))
		if _, err := sessions.Create(ctx, &CreateSessionParams{IDSHA256: id[:], Tenant: "t", TokenSHA256: tok[:], Credential: []byte("c"),
			IdleTimeout: time.Hour, MaxLifetime: time.Hour}); err != nil {
			t.Fatalf("create console session %d: %v", i, err)
		}
	}
	t.Logf("pool connections by server port %v; idemcoord connections per node %v", perPort, after)
}

// appConns returns how many client connections named idemcoord each node
// has to database idemcoord (pg_stat_activity).
func appConns(t *testing.T, nodes []*pgtest.Cluster) []int {
	t.Helper()
	ctx := t.Context()
	var counts []int
	for _, n := range nodes {
		conn, err := pgx.Connect(ctx, n.URL("idemcoord"))
		if err != nil {
			t.Fatal(err)
		}
		var count int
		err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = 'idemcoord' AND application_name = 'idemcoord' AND backend_type = 'client backend'`).Scan(&count)
		_ = conn.Close(ctx)
		if err != nil {
			t.Fatal(err)
		}
		counts = append(counts, count)
	}
	return counts
}

// TestLoadBalanceHostsOneHost: load_balance_hosts=random on a URL of one
// host changes nothing (and the parameter does not reach the server,
// which would refuse it).
func TestLoadBalanceHostsOneHost(t *testing.T) {
	t.Parallel()
	dbURL := withQuery(t, pgtest.NewDatabase(t), "load_balance_hosts", "random")
	s, err := Open(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	pairsOn(t, s, "one", 4, 10)
	if err := Migrate(t.Context(), dbURL); err != nil {
		t.Fatalf("migrate with load_balance_hosts in the URL: %v", err)
	}
}

// TestLoadBalanceHostsBadValue: a value libpq does not know is refused at
// start-up, naming the parameter and the value.
func TestLoadBalanceHostsBadValue(t *testing.T) {
	t.Parallel()
	dbURL := withQuery(t, pgtest.NewDatabase(t), "load_balance_hosts", "banana")
	s, err := Open(t.Context(), dbURL)
	if err == nil {
		s.Close()
		t.Fatal("Open accepted load_balance_hosts=banana")
	}
	if want := `invalid load_balance_hosts value: "banana"`; !strings.Contains(err.Error(), want) {
		t.Errorf("Open: %v, want an error saying %s", err, want)
	}
}
