package chaos

import (
	"math/rand/v2"
	"net/url"
	"testing"
	"time"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/server"
)

// TestConnectionCutsUnderLoad puts a proxy between the coordinator and
// PostgreSQL that resets connections at random while a load of
// Begin/Complete pairs runs (and, every few hundred milliseconds, all of
// them at once), so cuts land mid-transaction: before a statement reaches
// the server, or after it ran (a COMMIT included) but before the answer got
// back. No acknowledged write may be lost and no record half written (the
// rows are checked with SQL), besides the workload's other promises.
func TestConnectionCutsUnderLoad(t *testing.T) {
	s := seed(t)
	rng := rand.New(rand.NewPCG(s, 3))
	dbURL := pgtest.NewDatabase(t)
	proxy, proxiedURL := newDatabaseProxy(t, dbURL, s)
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: proxiedURL,
		ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})

	w := newWorkload(t, idempotencyv1.NewCoordinatorClient(dial(t, c.Addr)), workloadOptions{
		slots: 12, lease: time.Second, dieChance: 0.05, slowChance: 0.03})
	w.start(6, rng.Uint64())
	proxy.SetCutChance(0.02)
	end := time.Now().Add(byMode(4*time.Second, 60*time.Second))
	cutAlls := 0
	for time.Now().Before(end) {
		time.Sleep(time.Duration(200+rng.IntN(600)) * time.Millisecond)
		proxy.CutAll()
		cutAlls++
	}
	proxy.SetCutChance(0)
	w.stop()
	r := w.verify(dbURL)
	if proxy.Cuts() < 10 {
		t.Errorf("only %d connections cut", proxy.Cuts())
	}
	t.Logf("chaos: proxy-cuts: ops=%d faults=%d acked=%d checked=%d lost=%d double_lease=%d rows=%d bad_rows=%d unavailable=%d internal=%d connections=%d",
		r.ops, proxy.Cuts(), r.acked, r.checked, r.lost, r.doubleLease, r.rows, r.badRows, r.unavailable, r.internal, proxy.Accepted())
	t.Logf("chaos: proxy-cuts: detail %v cut_all=%d", r, cutAlls)
}

// newDatabaseProxy starts a Proxy in front of the server of dbURL and
// returns it with dbURL rewritten to go through it.
func newDatabaseProxy(t *testing.T, dbURL string, seed uint64) (*Proxy, string) {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewProxy(u.Host, seed)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	u.Host = p.Addr()
	return p, u.String()
}
