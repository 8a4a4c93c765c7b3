package server_test

import (
	"context"
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
)

// TestWaitingBeginLostReplyAcquiresOnce loses the answer of a waiting
// Begin's takeover after PostgreSQL committed it, and checks that the
// waiter acquires the key once: its next re-read must find the lost
// acquisition its own, not wait for it to lapse and take the key again
// (which burned an attempt, and was seen by the reference linearizability
// test as one call acting twice).
//
// The lost answer is real: the cluster is made to wait for a synchronous
// standby that does not exist, so the takeover's commit is written locally
// and then waits; the backend is terminated while it waits, which keeps
// the commit and drops the answer (PostgreSQL: "the transaction has
// already committed locally").
func TestWaitingBeginLostReplyAcquiresOnce(t *testing.T) {
	t.Parallel()
	w := loseWaitersTakeover(t)
	w.exec(`SELECT pg_terminate_backend($1)`, w.pid)
	w.exec(`ALTER SYSTEM RESET synchronous_standby_names`)
	w.exec(`SELECT pg_reload_conf()`)

	b := w.answer()
	if b.err != nil {
		t.Fatalf("B's Begin: %v", b.err)
	}
	if b.r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || b.r.GetRecord().GetAttempt() != 2 {
		t.Fatalf("B's Begin answered %v attempt %d, want ACQUIRED attempt 2 (its lost takeover, not a second one)",
			b.r.GetOutcome(), b.r.GetRecord().GetAttempt())
	}
	if r := w.lookup(); r.GetState() != idempotencyv1.State_STATE_IN_PROGRESS || r.GetAttempt() != 2 {
		t.Fatalf("the record is %v attempt %d, want IN_PROGRESS attempt 2", r.GetState(), r.GetAttempt())
	}
	if _, err := w.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: b.r.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("done")}}); err != nil {
		t.Fatalf("B completes with the token it was given: %v", err)
	}
}

// TestWaitingBeginLostAcquisitionLapsed loses the waiting Begin's takeover
// as above, but PostgreSQL then crashes (the takeover survives: it was
// flushed before the standby wait) and stays down until the takeover's
// lease has run out. The waiter, finding its own acquisition lapsed, must
// not hand it over (its lease is gone) nor take the key again: it answers
// UNAVAILABLE, and the key reads UNKNOWN at attempt 2.
func TestWaitingBeginLostAcquisitionLapsed(t *testing.T) {
	t.Parallel()
	w := loseWaitersTakeover(t)
	w.exec(`ALTER SYSTEM RESET synchronous_standby_names`) // for the restart
	if err := w.cluster.Kill(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // B's 2 s lease runs out on the coordinator's clock (not a synchronization)
	if err := w.cluster.Start(); err != nil {
		t.Fatal(err)
	}
	b := w.answer()
	if status.Code(b.err) != codes.Unavailable {
		t.Fatalf("B's Begin answered %v, %v; want UNAVAILABLE (its own acquisition lapsed before it could be handed over)", b.r, b.err)
	}
	if r := w.lookup(); r.GetState() != idempotencyv1.State_STATE_UNKNOWN || r.GetAttempt() != 2 {
		t.Fatalf("the record is %v attempt %d, want UNKNOWN attempt 2", r.GetState(), r.GetAttempt())
	}
}

// lostTakeover is a key held by A whose waiter B took it over while every
// commit waited for a synchronous standby that does not exist: B's takeover
// is committed locally, its backend (pid) still waits.
type lostTakeover struct {
	t       *testing.T
	cluster *pgtest.Cluster
	admin   *pgx.Conn
	client  idempotencyv1.CoordinatorClient
	pid     int
	done    chan beginAnswer
}

type beginAnswer struct {
	r   *idempotencyv1.BeginResponse
	err error
}

func loseWaitersTakeover(t *testing.T) *lostTakeover {
	t.Helper()
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	dbURL := cluster.URL("postgres")
	if err := ledger.Migrate(ctx(t), dbURL); err != nil {
		t.Fatal(err)
	}
	// No reaper: the only commit that can wait below is B's takeover.
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: dbURL, Config: "reaper: { interval: 0s }"})
	w := &lostTakeover{t: t, cluster: cluster, client: idempotencyv1.NewCoordinatorClient(c.Dial(t)), done: make(chan beginAnswer, 1)}
	w.connect()

	// A holds the key for 10 s (the time the test has to turn the
	// standby wait on); B waits for it without an attempt_id.
	a, err := w.client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Lease: durationpb.New(10 * time.Second)})
	if err != nil || a.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("A's Begin: %v, %v", a, err)
	}
	go func() {
		bctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		r, err := w.client.Begin(bctx, &idempotencyv1.BeginRequest{Scope: "s", Key: "k",
			Lease: durationpb.New(2 * time.Second), Wait: durationpb.New(29 * time.Second)})
		w.done <- beginAnswer{r, err}
	}()
	w.until("watched by the waiting Begin", `SELECT count(*) FROM idempotency_records WHERE key = 'k' AND watched`)

	// From now on every commit waits for a standby that never comes.
	w.exec(`ALTER SYSTEM SET synchronous_standby_names = 'nobody'`)
	w.exec(`SELECT pg_reload_conf()`)
	// When A's lease runs out, B's takeover commits locally and waits.
	w.pid = w.until("a commit waiting for the synchronous standby",
		`SELECT coalesce(max(pid), 0) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	return w
}

func (w *lostTakeover) connect() {
	w.t.Helper()
	admin, err := pgx.Connect(ctx(w.t), w.cluster.URL("postgres"))
	if err != nil {
		w.t.Fatal(err)
	}
	w.admin = admin
	w.t.Cleanup(func() { admin.Close(context.Background()) })
}

func (w *lostTakeover) exec(sql string, args ...any) {
	w.t.Helper()
	if _, err := w.admin.Exec(ctx(w.t), sql, args...); err != nil {
		w.t.Fatalf("%s: %v", sql, err)
	}
}

// until polls a count on the database until it is not 0: generous, never
// a timing assertion.
func (w *lostTakeover) until(what, sql string, args ...any) int {
	w.t.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		var n int
		err := w.admin.QueryRow(ctx(w.t), sql, args...).Scan(&n)
		if err == nil && n != 0 {
			return n
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("after a minute, still not %s (%v)", what, err)
		}
	}
}

// answer is B's answer.
func (w *lostTakeover) answer() beginAnswer {
	w.t.Helper()
	select {
	case b := <-w.done:
		return b
	case <-time.After(90 * time.Second):
		w.t.Fatal("the waiting Begin did not answer within 90 s")
	}
	panic("unreachable")
}

// lookup reads the key, retrying on UNAVAILABLE as a caller would (a pooled
// connection may still be a terminated one, or the database restarting).
func (w *lostTakeover) lookup() *idempotencyv1.Record {
	w.t.Helper()
	var (
		l   *idempotencyv1.LookupResponse
		err error
	)
	for range 300 {
		if l, err = w.client.Lookup(ctx(w.t), &idempotencyv1.LookupRequest{Scope: "s", Key: "k"}); status.Code(err) != codes.Unavailable {
			break
		}
		time.Sleep(100 * time.Millisecond) // retry pacing, not a synchronization
	}
	if err != nil {
		w.t.Fatal(err)
	}
	return l.GetRecord()
}
