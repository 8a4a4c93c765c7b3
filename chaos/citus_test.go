package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// requireCitusRun skips t unless the Citus fault tests are asked for:
// IDEMCOORD_TEST_CITUS=1 (`make test-citus`) or IDEMCOORD_CHAOS=long
// (`make chaos`). They start a cluster of three PostgreSQL servers, too
// much for every `go test ./...`.
func requireCitusRun(t *testing.T) {
	t.Helper()
	if os.Getenv(pgtest.CitusEnv) != "1" && !long() {
		t.Skipf("a Citus fault test: runs under %s=1 (make test-citus) or IDEMCOORD_CHAOS=long (make chaos)", pgtest.CitusEnv)
	}
	pgtest.RequireCitus(t)
}

// TestCitusWorkerKill runs a load of Begin/Complete pairs through a real
// coordinator on a Citus cluster of two workers, kills one worker's
// postmaster with SIGKILL (its server processes die with it), keeps the
// load going for a few seconds and starts the worker again (crash
// recovery). Meanwhile probes Begin and Complete fresh keys of each worker.
// It checks the workload's promises (see workload: no acknowledged
// Complete lost, no double lease, no INTERNAL answer, no half-written
// row), that every probe of the running worker's keys succeeded while the
// other was down, and that the killed worker's keys answered UNAVAILABLE,
// never INTERNAL, and work again after the restart.
//
// The nodes are durable (fsync, synchronous_commit, full_page_writes on):
// an acknowledged Complete must survive the worker's crash.
func TestCitusWorkerKill(t *testing.T) { runCitusWorkerKill(t, false) }

// TestCitusWorkerKillSpread is TestCitusWorkerKill with the coordinator's
// connections spread over every node (a multi-host URL with
// load_balance_hosts=random): the killed worker also held some of the
// pool's connections, and the running worker's keys must still not fail,
// except with UNAVAILABLE on those connections in the moment after the
// kill (see spreadKillGrace).
func TestCitusWorkerKillSpread(t *testing.T) { runCitusWorkerKill(t, true) }

// spreadKillGrace is how long after a worker's kill a call of the running
// worker's keys may still answer UNAVAILABLE with the spread URL: a call
// on one of the pool's connections to the killed node itself fails once
// its statement is sent there (whether the other worker committed it is
// unknown). pgxpool pings a connection idle for over a second before
// handing it out, so after a second every connection to the dead node has
// been used and dropped, or pinged and dropped.
const spreadKillGrace = time.Second

func runCitusWorkerKill(t *testing.T, spread bool) {
	requireCitusRun(t)
	var verdict string
	lastWords(t, func() string { return verdict })
	rng := rand.New(rand.NewPCG(seed(t), 3))
	cc := pgtest.StartCitusCluster(t, pgtest.ClusterOptions{Durable: true})
	ctx := context.Background()
	if err := cc.CreateDatabase(ctx, "idemcoord"); err != nil {
		t.Fatal(err)
	}
	dbURL := cc.URL("idemcoord")
	if err := ledger.Migrate(ctx, dbURL); err != nil {
		t.Fatal(err)
	}
	coordURL, name := dbURL, "citus-worker-kill"
	if spread {
		coordURL, name = cc.SpreadURL("idemcoord"), "citus-worker-kill-spread"
	}
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: coordURL,
		ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})
	client := idempotencyv1.NewCoordinatorClient(dial(t, c.Addr))

	victim := rng.IntN(len(cc.Workers))
	byWorker := citusKeysByWorker(t, dbURL, cc, 4000)
	downKeys, upKeys := byWorker[victim], byWorker[1-victim]

	w := newWorkload(t, client, workloadOptions{
		slots: 16, lease: time.Second, callTimeout: 3 * time.Second, dieChance: 0.05, slowChance: 0.03})
	w.start(8, rng.Uint64())
	up := newProbe(client, "up", upKeys)
	down := newProbe(client, "down", downKeys)
	up.start()
	down.start()

	time.Sleep(time.Duration(1500+rng.IntN(1000)) * time.Millisecond)
	killedAt := time.Now()
	if err := cc.Workers[victim].Kill(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Duration(3000+rng.IntN(1500)) * time.Millisecond)
	restartAt := time.Now()
	if err := cc.Workers[victim].Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond)
	up.stop()
	down.stop()
	w.stop()
	r := w.verify(dbURL)

	// The running worker's keys: every probe that started after the kill
	// and ended before the restart succeeded.
	upOK, upFailed := up.during(killedAt, restartAt)
	throughDeadNode := 0
	for _, f := range upFailed {
		if spread && f.code == codes.Unavailable && f.start.Before(killedAt.Add(spreadKillGrace)) {
			throughDeadNode++
			continue
		}
		t.Errorf("a key of the running worker failed while the other was down: %s", f)
	}
	if len(upOK) == 0 {
		t.Errorf("no probe of the running worker's keys ran while the other was down")
	}
	// The killed worker's keys: UNAVAILABLE while it was down, never
	// INTERNAL, and served again after the restart.
	downOK, downFailed := down.during(killedAt, restartAt)
	unavailable := 0
	for _, f := range downFailed {
		if f.code == codes.Unavailable {
			unavailable++
		} else {
			t.Errorf("a key of the killed worker answered %s, want UNAVAILABLE", f)
		}
	}
	if unavailable == 0 {
		t.Errorf("no probe of the killed worker's keys answered UNAVAILABLE while it was down (%d succeeded)", len(downOK))
	}
	for _, p := range []*probe{up, down} {
		for _, f := range p.all() {
			if f.code == codes.Internal || f.code == codes.Unknown {
				t.Errorf("probe answered %s", f)
			}
		}
	}
	afterOK, _ := down.during(restartAt, time.Now())
	if len(afterOK) == 0 {
		t.Errorf("no probe of the killed worker's keys succeeded after its restart")
	}
	if r.unavailable == 0 {
		t.Errorf("no workload call failed UNAVAILABLE: the kill missed the load")
	}
	verdict = fmt.Sprintf("lost=%d internal=%d up_ok_while_down=%d up_failed_while_down=%d (through the killed node: %d) down_unavailable=%d",
		r.lost, r.internal, len(upOK), len(upFailed), throughDeadNode, unavailable)
	t.Logf("chaos: %s: ops=%d acked=%d checked=%d lost=%d double_lease=%d unavailable=%d internal=%d bad_rows=%d down_for=%v up_ok_while_down=%d up_failed_while_down=%d down_unavailable=%d down_ok_after_restart=%d",
		name, r.ops, r.acked, r.checked, r.lost, r.doubleLease, r.unavailable, r.internal, r.badRows,
		restartAt.Sub(killedAt).Round(100*time.Millisecond), len(upOK), len(upFailed), unavailable, len(afterOK))
	t.Logf("chaos: %s: detail %v", name, r)
}

// citusKeysByWorker returns, for each of cc's workers, n keys whose shard
// it holds.
func citusKeysByWorker(t *testing.T, dbURL string, cc *pgtest.CitusCluster, n int) [][]string {
	t.Helper()
	conn := sqlConn(t, dbURL)
	ports := map[int]int{} // port → index in cc.Workers
	for i, wk := range cc.Workers {
		var port int
		if err := conn.QueryRow(context.Background(), `SELECT nodeport FROM pg_dist_node WHERE nodeport = $1`,
			portOf(t, wk.URL("x"))).Scan(&port); err != nil {
			t.Fatalf("worker %d is not in pg_dist_node: %v", i, err)
		}
		ports[port] = i
	}
	candidates := make([]string, 4*n)
	for i := range candidates {
		candidates[i] = fmt.Sprintf("probe-%d", i)
	}
	rows, _ := conn.Query(context.Background(), `SELECT k, p.nodeport FROM unnest($1::text[]) AS k,
		LATERAL (SELECT nodeport FROM pg_dist_shard_placement
			WHERE shardid = get_shard_id_for_distribution_column('idempotency_records', k)) AS p`, candidates)
	type placed struct {
		Key  string
		Port int
	}
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[placed])
	if err != nil {
		t.Fatal(err)
	}
	out := make([][]string, len(cc.Workers))
	for _, p := range all {
		i, ok := ports[p.Port]
		if !ok {
			t.Fatalf("key %s is placed on port %d, no worker of the cluster", p.Key, p.Port)
		}
		if len(out[i]) < n {
			out[i] = append(out[i], p.Key)
		}
	}
	for i, keys := range out {
		if len(keys) < n {
			t.Fatalf("worker %d holds only %d of %d candidate keys", i, len(keys), len(candidates))
		}
	}
	return out
}

func portOf(t *testing.T, dbURL string) int {
	t.Helper()
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	return int(cfg.Port)
}

// probe Begins and Completes fresh keys of one worker, one pair at a time,
// and records when each pair ran and how it ended.
type probe struct {
	client idempotencyv1.CoordinatorClient
	name   string
	keys   []string

	stopped chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	pairs   []probePair
}

type probePair struct {
	key        string
	start, end time.Time
	method     string // the call that failed, or ""
	code       codes.Code
	err        error
}

func (p probePair) String() string {
	return fmt.Sprintf("%s of %s at %s (%v): %v", p.method, p.key, p.start.Format(time.StampMilli), p.end.Sub(p.start).Round(time.Millisecond), p.err)
}

func newProbe(client idempotencyv1.CoordinatorClient, name string, keys []string) *probe {
	return &probe{client: client, name: name, keys: keys, stopped: make(chan struct{})}
}

func (p *probe) start() {
	p.wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-p.stopped:
				return
			default:
			}
			if i == len(p.keys) {
				return // out of fresh keys
			}
			key := p.keys[i]
			pp := probePair{key: key, start: time.Now()}
			pp.method, pp.err = p.pair(key)
			pp.end, pp.code = time.Now(), status.Code(pp.err)
			p.mu.Lock()
			p.pairs = append(p.pairs, pp)
			p.mu.Unlock()
			if pp.err != nil {
				time.Sleep(50 * time.Millisecond)
			}
		}
	})
}

// pair runs Begin then Complete on key, each under a 3 s deadline.
func (p *probe) pair(key string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	b, err := p.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "probe", Key: key, Lease: durationpb.New(time.Minute)})
	if err != nil {
		return "Begin", err
	}
	if b.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		return "Begin", fmt.Errorf("answered %v for a fresh key", b.GetOutcome())
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel2()
	_, err = p.client.Complete(ctx2, &idempotencyv1.CompleteRequest{Scope: "probe", Key: key, LeaseToken: b.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("probe")}})
	if err != nil {
		return "Complete", err
	}
	return "", nil
}

func (p *probe) stop() {
	close(p.stopped)
	p.wg.Wait()
}

func (p *probe) all() []probePair {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]probePair(nil), p.pairs...)
}

// during returns the pairs that started at or after from and ended before
// to, split into those that succeeded and those that failed.
func (p *probe) during(from, to time.Time) (ok, failed []probePair) {
	for _, pp := range p.all() {
		if pp.start.Before(from) || !pp.end.Before(to) {
			continue
		}
		if pp.err == nil {
			ok = append(ok, pp)
		} else {
			failed = append(failed, pp)
		}
	}
	return ok, failed
}
