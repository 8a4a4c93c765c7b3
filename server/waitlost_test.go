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
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	dbURL := cluster.URL("postgres")
	if err := ledger.Migrate(ctx(t), dbURL); err != nil {
		t.Fatal(err)
	}
	// No reaper: the only commit that can wait below is B's takeover.
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: dbURL, Config: "reaper: { interval: 0s }"})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	admin, err := pgx.Connect(ctx(t), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := admin.Exec(ctx(t), sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// until polls a condition on the database: generous, never a timing
	// assertion.
	until := func(what, sql string, args ...any) int {
		t.Helper()
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
			var n int
			err := admin.QueryRow(ctx(t), sql, args...).Scan(&n)
			if err == nil && n != 0 {
				return n
			}
			if time.Now().After(deadline) {
				t.Fatalf("after a minute, still not %s (%v)", what, err)
			}
		}
	}

	// A holds the key for 10 s (the time the test has to turn the
	// standby wait on); B waits for it without an attempt_id.
	a, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Lease: durationpb.New(10 * time.Second)})
	if err != nil || a.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("A's Begin: %v, %v", a, err)
	}
	type answer struct {
		r   *idempotencyv1.BeginResponse
		err error
	}
	done := make(chan answer, 1)
	go func() {
		r, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k",
			Lease: durationpb.New(2 * time.Second), Wait: durationpb.New(19 * time.Second)})
		done <- answer{r, err}
	}()
	until("watched by the waiting Begin", `SELECT count(*) FROM idempotency_records WHERE key = 'k' AND watched`)

	// From now on every commit waits for a standby that never comes.
	exec(`ALTER SYSTEM SET synchronous_standby_names = 'nobody'`)
	exec(`SELECT pg_reload_conf()`)
	// When A's lease runs out, B's takeover commits locally and waits.
	pid := until("a commit waiting for the synchronous standby",
		`SELECT coalesce(max(pid), 0) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	exec(`SELECT pg_terminate_backend($1)`, pid)
	exec(`ALTER SYSTEM RESET synchronous_standby_names`)
	exec(`SELECT pg_reload_conf()`)

	var b answer
	select {
	case b = <-done:
	case <-time.After(time.Minute):
		t.Fatal("the waiting Begin did not answer within a minute")
	}
	if b.err != nil {
		t.Fatalf("B's Begin: %v", b.err)
	}
	if b.r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || b.r.GetRecord().GetAttempt() != 2 {
		t.Fatalf("B's Begin answered %v attempt %d, want ACQUIRED attempt 2 (its lost takeover, not a second one)",
			b.r.GetOutcome(), b.r.GetRecord().GetAttempt())
	}
	// A pooled connection may still be the terminated one: a read is
	// retried on UNAVAILABLE, as a caller would.
	var l *idempotencyv1.LookupResponse
	for range 50 {
		if l, err = client.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "s", Key: "k"}); status.Code(err) != codes.Unavailable {
			break
		}
		time.Sleep(100 * time.Millisecond) // retry pacing, not a synchronization
	}
	if err != nil {
		t.Fatal(err)
	}
	if r := l.GetRecord(); r.GetState() != idempotencyv1.State_STATE_IN_PROGRESS || r.GetAttempt() != 2 {
		t.Fatalf("the record is %v attempt %d, want IN_PROGRESS attempt 2", r.GetState(), r.GetAttempt())
	}
	if _, err := client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: b.r.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("done")}}); err != nil {
		t.Fatalf("B completes with the token it was given: %v", err)
	}
}
