package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// TestFailoverSynchronousStandby kills the primary (SIGKILL) of a primary
// and synchronous standby pair under load and promotes the standby
// ("pg_ctl promote"), with two coordinators on the multi-host URL
// (target_session_attrs=read-write) that are never restarted. Then:
//   - every acknowledged Complete replays byte-for-byte, and the other
//     promises of workload hold (see workload.verify);
//   - the per-key histories of a second set of callers (Begin, Complete,
//     Fail, Heartbeat, Lookup on a coordinator with a test clock) are
//     linearizable (porcupine, the model of TestLinearizable);
//   - calls in the gap failed UNAVAILABLE only (never INTERNAL, never past
//     their deadline);
//   - the coordinator serves again after the promotion; the test logs how
//     long after the kill.
//
// TestFailoverAsyncStandbyIsCaught is its negative control.
func TestFailoverSynchronousStandby(t *testing.T) {
	f := startFailoverPair(t, true)
	rng := rand.New(rand.NewPCG(seed(t), 14))

	// Coordinator W serves a Begin/Complete workload on the real clock.
	cw := coordtest.Start(t, coordtest.Options{DatabaseURL: f.multiHostURL("idemcoord"),
		ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})
	w := newWorkload(t, idempotencyv1.NewCoordinatorClient(dial(t, cw.Addr)), workloadOptions{
		slots: 12, lease: time.Second, callTimeout: 3 * time.Second, dieChance: 0.05, slowChance: 0.03})
	w.start(byMode(6, 16), rng.Uint64())

	// A Begin that waits on a held key across the failover: the listener
	// reconnects to the new primary and wakes it, and it sees the
	// holder's Complete made there.
	wc := idempotencyv1.NewCoordinatorClient(dial(t, cw.Addr))
	held, err := wc.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "wait", Key: "k",
		Lease: durationpb.New(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	type answer struct {
		r   *idempotencyv1.BeginResponse
		err error
	}
	waited := make(chan answer, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r, err := wc.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "wait", Key: "k", Wait: durationpb.New(30 * time.Second)})
		waited <- answer{r, err}
	}()

	var killedAt, promotedAt time.Time
	lin := f.runLinearizable(t, rng, byMode(30, 120), func(round int) {
		if round != byMode(15, 60) {
			return
		}
		time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond)
		killedAt = time.Now()
		f.failover(t)
		promotedAt = time.Now()
	})
	for try := 0; ; try++ {
		_, err := wc.Complete(context.Background(), &idempotencyv1.CompleteRequest{Scope: "wait", Key: "k",
			LeaseToken: held.GetLeaseToken(), Response: &idempotencyv1.StoredResponse{Body: []byte("after failover")}})
		if err == nil {
			break
		}
		if !ambiguous(err) || try == 200 {
			t.Fatalf("Complete of the waited-on key after the failover: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if a := <-waited; a.err != nil || a.r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY ||
		string(a.r.GetRecord().GetResponse().GetBody()) != "after failover" {
		t.Errorf("a Begin waiting across the failover answered %v, %v; want the replay of the Complete made after it", a.r, a.err)
	}
	// Keep the load on until a call succeeded after the promotion (a
	// minute at most: a condition, not a measure).
	for end := time.Now().Add(time.Minute); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if _, ok := w.recoveredAfter(promotedAt); ok {
			break
		}
	}
	time.Sleep(500 * time.Millisecond)
	w.stop()

	resumed, ok := w.recoveredAfter(promotedAt)
	if !ok {
		t.Errorf("no call succeeded after the promotion")
	}
	resumed += promotedAt.Sub(killedAt)
	r := w.verify(f.current)
	if r.deadline > 0 {
		t.Errorf("%d calls ran into their deadline instead of failing UNAVAILABLE", r.deadline)
	}
	if r.unavailable == 0 {
		t.Errorf("no call failed UNAVAILABLE: the failover missed the load")
	}
	if lin.res != porcupine.Ok {
		path := writeVisualization(t, lin.info)
		t.Errorf("histories are not linearizable across the failover (result %s); porcupine's visualization: %s", lin.res, path)
	}
	for _, v := range lin.st.violations {
		t.Errorf("violation: %s", v)
	}
	t.Logf("chaos: failover: kill -9 of the primary, pg_ctl promote of the synchronous standby took %v; served again %v after the kill",
		promotedAt.Sub(killedAt).Round(time.Millisecond), resumed.Round(time.Millisecond))
	t.Logf("chaos: failover: workload ops=%d acked=%d checked=%d lost=%d double_lease=%d unavailable=%d deadline_exceeded=%d internal=%d bad_rows=%d",
		r.ops, r.acked, r.checked, r.lost, r.doubleLease, r.unavailable, r.deadline, r.internal, r.badRows)
	t.Logf("chaos: failover: linearizability ops=%d unanswered=%d keys=%d result=%s", lin.ops, lin.st.unknown, lin.st.keys, lin.res)
}

// TestFailoverAsyncStandbyIsCaught is the negative control of
// TestFailoverSynchronousStandby: with asynchronous replication and the
// standby stalled (stopped) while the primary acknowledges writes, the
// promoted standby lacks them, and the linearizability checker must say
// so. It shows the failover test able to fail.
func TestFailoverAsyncStandbyIsCaught(t *testing.T) {
	f := startFailoverPair(t, false)
	rng := rand.New(rand.NewPCG(seed(t), 15))
	probe := [2]string{"free", "probe"}
	// The probe caller runs its calls itself, beside the random clients.
	pc := &linClient{id: len(f.clients), h: f.h, client: f.clients[0].client, rng: rand.New(rand.NewPCG(rng.Uint64(), 99)),
		tokens: map[string][]string{}, attempts: map[string]string{}}
	var lost bool
	lin := f.runLinearizable(t, rng, 12, func(round int) {
		switch round {
		case 4:
			// Stall the standby: the primary goes on acknowledging.
			if err := f.standby.Stop(); err != nil {
				t.Fatal(err)
			}
		case 8:
			// A write acknowledged by the primary alone.
			for try := 0; try < 100 && !f.answered(pc, probe, opBegin); try++ {
				pc.do(f.coord.Clock.Now(), probe, 0)
			}
			if err := f.primary.Kill(); err != nil {
				t.Fatal(err)
			}
			if err := f.standby.Start(); err != nil {
				t.Fatal(err)
			}
			if err := f.standby.Promote(); err != nil {
				t.Fatal(err)
			}
			f.current = f.standby.URL("postgres")
		case 10:
			lost = !f.hasRow(t, probe)
			for try := 0; try < 100 && !f.answered(pc, probe, opLookup); try++ {
				pc.do(f.coord.Clock.Now(), probe, 16)
				time.Sleep(20 * time.Millisecond)
			}
		}
	})
	if !lost {
		t.Fatalf("the promoted standby has the probe record: the standby was not behind, the control proves nothing")
	}
	if lin.res == porcupine.Ok {
		t.Fatalf("the checker accepted a history in which an acknowledged write was lost by an asynchronous failover")
	}
	t.Logf("chaos: failover negative control: async standby stalled, acknowledged probe lost, checker result %s (ops=%d)", lin.res, lin.ops)
}

// failoverPair is a primary and its standby, and the coordinator of the
// linearizability callers.
type failoverPair struct {
	primary, standby *pgtest.Cluster
	// current is the URL of the primary in charge.
	current string
	coord   *coordtest.Coordinator
	clients []*linClient
	h       *linHistory
}

// startFailoverPair starts a primary and a streaming standby (synchronous
// or not), migrated, and a coordinator with a test clock on the multi-host
// URL of both.
func startFailoverPair(t *testing.T, synchronous bool) *failoverPair {
	t.Helper()
	f := &failoverPair{primary: pgtest.StartCluster(t, pgtest.ClusterOptions{})}
	f.current = f.primary.URL("postgres")
	if err := ledger.Migrate(context.Background(), f.current); err != nil {
		t.Fatal(err)
	}
	f.standby = f.primary.StartStandby(t)
	conn := sqlConn(t, f.current)
	if synchronous {
		for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = '*'`, `SELECT pg_reload_conf()`} {
			if _, err := conn.Exec(context.Background(), q); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := map[bool]string{true: "sync", false: "async"}[synchronous]
	for end := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		var n int
		err := conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_replication WHERE sync_state = $1 AND state = 'streaming'`, want).Scan(&n)
		if err == nil && n == 1 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("the standby does not stream (%s) after a minute: %v", want, err)
		}
	}
	f.startLinCallers(t, f.multiHostURL("idemcoord-lin"))
	return f
}

// startLinCallers starts the coordinator of the linearizability callers,
// with a test clock, on databaseURL, and the callers.
func (f *failoverPair) startLinCallers(t *testing.T, databaseURL string) {
	t.Helper()
	f.coord = coordtest.Start(t, coordtest.Options{DatabaseURL: databaseURL, FakeClock: true,
		Config: linConfig, ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})
	client := idempotencyv1.NewCoordinatorClient(dial(t, f.coord.Addr))
	f.h = &linHistory{start: time.Now()}
	s := rand.Uint64()
	for i := range 4 {
		f.clients = append(f.clients, &linClient{id: i, h: f.h, client: client, rng: rand.New(rand.NewPCG(s, uint64(10+i))),
			tokens: map[string][]string{}, attempts: map[string]string{}})
	}
}

// multiHostURL is the URL naming both servers, primary first, that only
// connects to the one that takes writes; app names the connections.
func (f *failoverPair) multiHostURL(app string) string {
	host := func(c *pgtest.Cluster) string {
		u, _ := url.Parse(c.URL("postgres"))
		return u.Host
	}
	return fmt.Sprintf("postgres://postgres@%s,%s/postgres?sslmode=disable&target_session_attrs=read-write&application_name=%s",
		host(f.primary), host(f.standby), app)
}

// failover kills the primary and promotes the standby.
func (f *failoverPair) failover(t *testing.T) {
	t.Helper()
	if err := f.primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := f.standby.Promote(); err != nil {
		t.Fatal(err)
	}
	f.current = f.standby.URL("postgres")
}

type linResult struct {
	ops  int
	res  porcupine.CheckResult
	info porcupine.LinearizationInfo
	st   linStats
}

// runLinearizable runs rounds of random calls from the linearizability
// clients, as TestLinearizable does, calling fault(round) while a round's
// calls are in flight, and checks the histories.
func (f *failoverPair) runLinearizable(t *testing.T, rng *rand.Rand, rounds int, fault func(round int)) linResult {
	t.Helper()
	for round := range rounds {
		now := f.coord.Clock.Now()
		var wg sync.WaitGroup
		for _, cl := range f.clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 5 {
					cl.step(now)
				}
			}()
		}
		fault(round)
		wg.Wait()
		waitNoOpenTransactionsOf(t, f.current, "idemcoord-lin")
		f.h.endRound()
		f.coord.Clock.Advance(time.Duration(rng.IntN(1200)) * time.Millisecond)
	}
	ops := f.h.operations()
	res, info := porcupine.CheckOperationsVerbose(linModel(), ops, 2*time.Minute)
	return linResult{ops: len(ops), res: res, info: info, st: f.h.stats()}
}

// answered reports whether cl's history has an answered call op of k.
func (f *failoverPair) answered(cl *linClient, k [2]string, op linOp) bool {
	for _, o := range f.h.operations() {
		in, out := o.Input.(linInput), o.Output.(linOutput)
		if in.client == cl.id && in.op == op && in.scope == k[0] && in.key == k[1] && !out.unknown {
			return true
		}
	}
	return false
}

// hasRow reports whether the primary in charge stores record k.
func (f *failoverPair) hasRow(t *testing.T, k [2]string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, f.current)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var ok bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM idempotency_records WHERE scope = $1 AND key = $2)`, k[0], k[1]).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}
