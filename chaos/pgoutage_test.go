package chaos

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// TestPostgresOutageUnderLoad stops PostgreSQL (fast shutdown) and kills it
// (SIGKILL, then crash recovery) under a load of Begin/Complete pairs, and
// starts it again each time. Meanwhile every call fails UNAVAILABLE within
// its deadline (never INTERNAL, never a hang), gRPC health goes NOT_SERVING
// and back to SERVING, and service resumes by itself; afterwards the
// workload's promises hold (see workload), no acknowledged write lost
// across the crash included.
//
// The cluster is durable (fsync, synchronous_commit and full_page_writes
// on) because the test kills PostgreSQL: an acknowledged write must survive
// a crash as it would in production.
func TestPostgresOutageUnderLoad(t *testing.T) {
	rng := rand.New(rand.NewPCG(seed(t), 2))
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{Durable: true})
	dbURL := cluster.URL("postgres")
	if err := ledger.Migrate(context.Background(), dbURL); err != nil {
		t.Fatal(err)
	}
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: dbURL,
		ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})
	conn := dial(t, c.Addr)
	health := newHealthLog(healthpb.NewHealthClient(conn))
	defer health.stop()

	w := newWorkload(t, idempotencyv1.NewCoordinatorClient(conn), workloadOptions{
		slots: 12, lease: time.Second, callTimeout: 3 * time.Second, dieChance: 0.05, slowChance: 0.03})
	w.start(6, rng.Uint64())

	type outage struct {
		how      string
		down, up time.Time
	}
	faults := byMode([]string{"stop", "kill"}, []string{"stop", "kill", "stop", "kill", "kill", "stop", "kill", "kill"})
	var outages []*outage
	for _, how := range faults {
		time.Sleep(time.Duration(700+rng.IntN(800)) * time.Millisecond)
		o := &outage{how: how, down: time.Now()}
		var err error
		if how == "stop" {
			err = cluster.Stop()
		} else {
			err = cluster.Kill()
		}
		if err != nil {
			t.Fatal(err)
		}
		// Long enough for the health check (every 100 ms) to notice.
		time.Sleep(time.Duration(600+rng.IntN(600)) * time.Millisecond)
		if err := cluster.Start(); err != nil {
			t.Fatal(err)
		}
		o.up = time.Now()
		outages = append(outages, o)
	}
	time.Sleep(1500 * time.Millisecond)
	w.stop()

	// Health: NOT_SERVING during every outage, SERVING again after it.
	var maxResume time.Duration
	for i, o := range outages {
		next := time.Now()
		if i+1 < len(outages) {
			next = outages[i+1].down
		}
		if !health.saw(healthpb.HealthCheckResponse_NOT_SERVING, o.down, o.up.Add(500*time.Millisecond)) {
			t.Errorf("outage %d (%s): health never said NOT_SERVING", i, o.how)
		}
		if !health.saw(healthpb.HealthCheckResponse_SERVING, o.up, next) {
			t.Errorf("outage %d (%s): health never said SERVING again after the database came back", i, o.how)
		}
		d, ok := w.recoveredAfter(o.up)
		if !ok || (i+1 < len(outages) && o.up.Add(d).After(next)) {
			t.Errorf("outage %d (%s): no call succeeded after the database came back", i, o.how)
		}
		maxResume = max(maxResume, d)
	}
	r := w.verify(dbURL)
	if r.deadline > 0 {
		t.Errorf("%d calls ran into their deadline instead of failing UNAVAILABLE", r.deadline)
	}
	if r.unavailable == 0 {
		t.Errorf("no call failed UNAVAILABLE: the outages missed the load")
	}
	t.Logf("chaos: pg-outage: ops=%d faults=%d acked=%d checked=%d lost=%d double_lease=%d unavailable=%d deadline_exceeded=%d internal=%d max_call=%v (deadline %v) health_transitions=%d max_resume=%v bad_rows=%d",
		r.ops, len(outages), r.acked, r.checked, r.lost, r.doubleLease, r.unavailable, r.deadline, r.internal,
		r.maxLatency.Round(time.Millisecond), w.callTimeout, health.transitions(), maxResume.Round(time.Millisecond), r.badRows)
	t.Logf("chaos: pg-outage: detail %v", r)
}

// healthLog polls gRPC health every 20 ms and keeps every change of status.
type healthLog struct {
	mu      sync.Mutex
	changes []healthChange
	cancel  context.CancelFunc
	done    chan struct{}
}

type healthChange struct {
	at     time.Time
	status healthpb.HealthCheckResponse_ServingStatus
}

func newHealthLog(client healthpb.HealthClient) *healthLog {
	ctx, cancel := context.WithCancel(context.Background())
	h := &healthLog{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(h.done)
		for ctx.Err() == nil {
			cctx, ccancel := context.WithTimeout(ctx, time.Second)
			r, err := client.Check(cctx, &healthpb.HealthCheckRequest{Service: "idempotency.v1.Coordinator"})
			ccancel()
			st := r.GetStatus()
			if err != nil {
				st = healthpb.HealthCheckResponse_UNKNOWN
			}
			h.mu.Lock()
			if n := len(h.changes); n == 0 || h.changes[n-1].status != st {
				h.changes = append(h.changes, healthChange{time.Now(), st})
			}
			h.mu.Unlock()
			time.Sleep(20 * time.Millisecond)
		}
	}()
	return h
}

func (h *healthLog) stop() {
	h.cancel()
	<-h.done
}

// saw reports whether the status was st at some time in [from, to].
func (h *healthLog) saw(st healthpb.HealthCheckResponse_ServingStatus, from, to time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, c := range h.changes {
		end := to
		if i+1 < len(h.changes) {
			end = h.changes[i+1].at
		}
		if c.status == st && !c.at.After(to) && !end.Before(from) {
			return true
		}
	}
	return false
}

func (h *healthLog) transitions() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.changes) - 1
}
