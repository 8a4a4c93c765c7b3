package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
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
//   - the per-key histories of a second set of callers (every call of the
//     API and reaper passes, on a coordinator whose test clock moves while
//     the calls are in flight, as in TestLinearizableReference) are
//     linearizable with respect to the reference model (refmodel_test.go),
//     and every key read back after the failover agrees with them;
//   - calls in the gap failed UNAVAILABLE only (never INTERNAL, never past
//     their deadline);
//   - the coordinator serves again after the promotion; the test logs how
//     long after the kill.
//
// TestFailoverAsyncStandbyIsCaught is its negative control.
func TestFailoverSynchronousStandby(t *testing.T) {
	rng := rand.New(rand.NewPCG(seed(t), 14))
	f := startFailoverPair(t, true, rng.Uint64())

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
	f.runReference(t, byMode(30, 120), func(round int) {
		if round != byMode(15, 60) {
			return
		}
		// Once a few of the round's calls were answered, so that others
		// are in flight.
		f.run.h.waitRoundCalls(1 + rng.IntN(10))
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
	lin, unanswered := f.checkReference(t)
	if r.unavailable == 0 && unanswered == 0 {
		// The gap can be shorter than 200 ms: the workload's calls may
		// all fall outside it, the reference run's in-flight ones not all.
		t.Errorf("no call failed UNAVAILABLE and no reference call went unanswered: the failover missed the load")
	}
	t.Logf("chaos: failover: kill -9 of the primary, pg_ctl promote of the synchronous standby took %v; served again %v after the kill",
		promotedAt.Sub(killedAt).Round(time.Millisecond), resumed.Round(time.Millisecond))
	t.Logf("chaos: failover: workload ops=%d acked=%d checked=%d lost=%d double_lease=%d unavailable=%d deadline_exceeded=%d internal=%d bad_rows=%d",
		r.ops, r.acked, r.checked, r.lost, r.doubleLease, r.unavailable, r.deadline, r.internal, r.badRows)
	t.Logf("chaos: failover: %s", lin)
}

// TestFailoverAsyncStandbyIsCaught is the negative control of
// TestFailoverSynchronousStandby: with asynchronous replication and the
// standby stalled (stopped) while the primary acknowledges writes, the
// promoted standby lacks them, and the reference model's checker must say
// so, for the history of the probe key alone too (a Begin acknowledged by
// the primary, then looked up on the promoted standby). It shows the
// failover test able to fail.
func TestFailoverAsyncStandbyIsCaught(t *testing.T) {
	rng := rand.New(rand.NewPCG(seed(t), 15))
	f := startFailoverPair(t, false, rng.Uint64())
	probe := [2]string{"free", "probe"}
	// The probe caller makes its calls itself, beside the random clients.
	pc := f.run.newClient(len(f.run.clients), rand.New(rand.NewPCG(rng.Uint64(), 99)))
	var acquired, notFound, lost bool
	f.runReference(t, 12, func(round int) {
		switch round {
		case 4:
			// Stall the standby: the primary goes on acknowledging.
			if err := f.standby.Stop(); err != nil {
				t.Fatal(err)
			}
		case 8:
			// A write acknowledged by the primary alone.
			for try := 0; try < 100 && !acquired; try++ {
				in := pc.newCall(rkBegin, probe)
				in.attemptID, in.ttl, in.lease = "probe", time.Hour, time.Hour
				a := pc.call(in)
				acquired = !a.unknown && a.err == "" && a.outcome == roAcquired
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
			for range 100 {
				if a := pc.call(pc.newCall(rkLookup, probe)); !a.unknown {
					notFound = a.err == "NOT_FOUND"
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	})
	if !acquired {
		t.Fatalf("the probe Begin was never acknowledged as acquired")
	}
	if !lost || !notFound {
		t.Fatalf("the promoted standby has the probe record (row gone: %v, Lookup NOT_FOUND: %v): the standby was not behind, the control proves nothing", lost, notFound)
	}
	// Not the verbose check of the other tests: that one searches every
	// key's history to the end, and refuting a long one takes minutes.
	// This one stops at the first key whose history has no linearization.
	ops := f.run.h.operations()
	if res := porcupine.CheckOperationsTimeout(refModel(), ops, 3*time.Minute); res != porcupine.Illegal {
		t.Fatalf("the checker answered %s for a history in which an acknowledged write was lost by an asynchronous failover; want Illegal", res)
	}
	var probeOps []porcupine.Operation
	for _, op := range ops {
		if in := op.Input.(refCall); in.scope == probe[0] && in.key == probe[1] {
			probeOps = append(probeOps, op)
		}
	}
	if res := porcupine.CheckOperationsTimeout(refModel(), probeOps, time.Minute); res != porcupine.Illegal {
		t.Fatalf("the checker answered %s for the probe key's history (%d calls), in which its acknowledged Begin was lost; want Illegal", res, len(probeOps))
	}
	t.Logf("chaos: failover negative control: async standby stalled, acknowledged probe lost, checker result Illegal (ops=%d, probe key ops=%d)", len(ops), len(probeOps))
}

// failoverPair is a primary and its standby, and the coordinator of the
// reference callers.
type failoverPair struct {
	primary, standby *pgtest.Cluster
	// current is the URL of the primary in charge.
	current string
	coord   *coordtest.Coordinator
	run     *refRunner
}

// startFailoverPair starts a primary and a streaming standby (synchronous
// or not), migrated, and the reference callers' coordinator, with a test
// clock, on the multi-host URL of both; the callers draw from seed.
func startFailoverPair(t *testing.T, synchronous bool, seed uint64) *failoverPair {
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
	f.startRefCallers(t, f.multiHostURL(refCallersApp), seed)
	return f
}

// refCallersApp is the application_name of the reference callers'
// coordinator, whose open transactions end a round.
const refCallersApp = "idemcoord-lin"

// startRefCallers starts the coordinator of the reference callers on
// databaseURL, with a test clock and refConfig, and the callers, whose
// random choices are drawn from seed. Its records' times are those of the
// test clock (in January 2026), so its reaper passes leave alone the
// records another coordinator on the same database writes on the real
// clock (in the future for it), and no other coordinator runs a reaper.
func (f *failoverPair) startRefCallers(t *testing.T, databaseURL string, seed uint64) {
	t.Helper()
	f.coord = coordtest.Start(t, coordtest.Options{DatabaseURL: databaseURL, FakeClock: true,
		Config: refConfig, ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})
	f.run = newRefRunner(t, f.coord, seed)
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

// runReference runs rounds of random calls from the reference callers, as
// TestLinearizableReference does (refRunner.round: the clock moves and the
// reaper runs while the calls are in flight), calling fault(round) beside
// a round's calls; a round ends when the primary in charge shows no
// transaction of the callers' coordinator open. Then every key is read
// back. The history is f.run.h.
func (f *failoverPair) runReference(t *testing.T, rounds int, fault func(round int)) {
	t.Helper()
	for round := range rounds {
		f.run.round(func() { fault(round) }, func() { waitNoOpenTransactionsOf(t, f.current, refCallersApp) })
	}
	f.run.clients[0].readBack()
	f.run.h.endRound()
}

// checkReference checks the reference callers' history against the
// reference model, fails the test when it is not linearizable, and
// returns a line that sums it up.
func (f *failoverPair) checkReference(t *testing.T) (summary string, unanswered int) {
	t.Helper()
	ops, res, info := f.run.h.check()
	st := f.run.h.stats()
	if res != porcupine.Ok {
		path := writeRefVisualization(t, info)
		logRefViolation(t, ops, info)
		t.Errorf("the histories are not linearizable against the reference model (result %s); porcupine's visualization: %s", res, path)
	}
	for _, v := range st.violations {
		t.Errorf("violation: %s", v)
	}
	return fmt.Sprintf("reference linearizability ops=%d unanswered=%d keys=%d reaper passes=%d result=%s", len(ops), st.unknown, st.keys, f.run.reaps, res), st.unknown
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
