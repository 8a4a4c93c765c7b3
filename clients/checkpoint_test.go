package clients_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/ledger"
)

// checkpointSeen is what CheckpointFrom answered, as "phase=data" or
// "none".
func checkpointSeen(ctx context.Context) string {
	phase, data, ok := clients.CheckpointFrom(ctx)
	if !ok {
		return "none"
	}
	return phase + "=" + string(data)
}

func lookupCheckpoint(t *testing.T, c *clients.Client, scope, key string) (*idempotencyv1.Record, string) {
	t.Helper()
	res, err := c.Lookup(testCtx(t), &idempotencyv1.LookupRequest{Scope: scope, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	cp := res.GetRecord().GetCheckpoint()
	if cp == nil {
		return res.GetRecord(), "none"
	}
	return res.GetRecord(), cp.GetPhase() + "=" + string(cp.GetData())
}

// Checkpoint inside Once: the first attempt records a step and fails
// RETRYABLE; the second resumes after it (CheckpointFrom), records the
// next step and fails with an error of the ABANDONED class, which the
// library ends RETRYABLE instead (the coordinator refuses to abandon an
// attempt that recorded a checkpoint); the third resumes after that step
// and completes. The completed record keeps the last checkpoint.
func TestCheckpointInOnce(t *testing.T) {
	t.Parallel()
	_, c := newClient(t, coordtest.Options{})
	ctx := testCtx(t)
	var seen []string
	run := func(fn func(ctx context.Context) (*idempotencyv1.StoredResponse, error)) error {
		_, err := c.Once(ctx, "deploy", "ck", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
			seen = append(seen, checkpointSeen(ctx))
			return fn(ctx)
		})
		return err
	}
	err := run(func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		if err := clients.Checkpoint(ctx, "reserved", []byte("r_1")); err != nil {
			return nil, err
		}
		if got := checkpointSeen(ctx); got != "reserved=r_1" {
			t.Errorf("CheckpointFrom after Checkpoint: %s", got)
		}
		return nil, status.Error(codes.Unavailable, "bank unreachable")
	})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("first Once: %v", err)
	}
	err = run(func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		if err := clients.Checkpoint(ctx, "charged", []byte("ch_1")); err != nil {
			return nil, err
		}
		return nil, status.Error(codes.InvalidArgument, "the shipping address is gone")
	})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("second Once: %v", err)
	}
	if rec, cp := lookupCheckpoint(t, c, "deploy", "ck"); rec.GetState() != idempotencyv1.State_STATE_FAILED_RETRYABLE || cp != "charged=ch_1" {
		t.Fatalf("after an ABANDONED-class error past a checkpoint: %v %s, want FAILED_RETRYABLE charged=ch_1", rec.GetState(), cp)
	}
	if err := run(func(context.Context) (*idempotencyv1.StoredResponse, error) { return stored("shipped"), nil }); err != nil {
		t.Fatalf("third Once: %v", err)
	}
	if want := []string{"none", "reserved=r_1", "charged=ch_1"}; len(seen) != 3 || seen[0] != want[0] || seen[1] != want[1] || seen[2] != want[2] {
		t.Fatalf("attempts saw %v, want %v", seen, want)
	}
	if rec, cp := lookupCheckpoint(t, c, "deploy", "ck"); rec.GetState() != idempotencyv1.State_STATE_COMPLETED || cp != "charged=ch_1" {
		t.Fatalf("completed: %v %s", rec.GetState(), cp)
	}
}

// Outside an attempt Checkpoint sends nothing and says so, and
// CheckpointFrom has nothing; bad input is the coordinator's
// INVALID_ARGUMENT.
func TestCheckpointOutsideAnAttempt(t *testing.T) {
	t.Parallel()
	_, c := newClient(t, coordtest.Options{})
	if err := clients.Checkpoint(testCtx(t), "p", nil); !errors.Is(err, clients.ErrNoAttempt) {
		t.Fatalf("Checkpoint outside an attempt: %v, want ErrNoAttempt", err)
	}
	if got := checkpointSeen(testCtx(t)); got != "none" {
		t.Fatalf("CheckpointFrom outside an attempt: %s", got)
	}
	_, err := c.Once(testCtx(t), "deploy", "bad", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		if err := clients.Checkpoint(ctx, "", nil); status.Code(err) != codes.InvalidArgument || errors.Is(err, clients.ErrLeaseLost) {
			t.Errorf("empty phase: %v, want INVALID_ARGUMENT", err)
		}
		if got := checkpointSeen(ctx); got != "none" {
			t.Errorf("CheckpointFrom after a refused Checkpoint: %s", got)
		}
		return stored("ok"), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Checkpoint of an attempt whose key was taken over answers ErrLeaseLost,
// with the coordinator's LEASE_LOST status, and records nothing.
func TestCheckpointLeaseLost(t *testing.T) {
	t.Parallel()
	coord, c := newClient(t, coordtest.Options{FakeClock: true}, clients.WithLease(time.Second))
	ctx := testCtx(t)
	started, taken := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := c.Once(ctx, "deploy", "lost", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
			close(started)
			<-taken
			// Not ctx, which the lost lease may have cancelled already.
			done <- clients.Checkpoint(context.WithoutCancel(ctx), "charged", []byte("late"))
			return nil, status.Error(codes.Unavailable, "gave up")
		})
		_ = err
	}()
	<-started
	eventually(t, "a takeover", func() bool {
		coord.Clock.Advance(2 * time.Second)
		res, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "deploy", Key: "lost", AttemptId: "successor"})
		if err != nil {
			t.Fatal(err)
		}
		return res.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED
	})
	close(taken)
	err := <-done
	if !errors.Is(err, clients.ErrLeaseLost) || status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("Checkpoint after a takeover: %v, want ErrLeaseLost with FAILED_PRECONDITION", err)
	}
	if _, cp := lookupCheckpoint(t, c, "deploy", "lost"); cp != "none" {
		t.Fatalf("a fenced Checkpoint was recorded: %s", cp)
	}
}

// Checkpoint in a handler under the interceptor: run 1 records a step and
// fails with INVALID_ARGUMENT (the ABANDONED class, ended RETRYABLE after
// the checkpoint); run 2 resumes after it.
func TestCheckpointUnderInterceptor(t *testing.T) {
	t.Parallel()
	seen := make(chan string, 2)
	f := start(t, setup{
		interceptor: []clients.InterceptorOption{clients.WithoutPrincipal()},
		charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			seen <- checkpointSeen(ctx)
			if n == 1 {
				if err := clients.Checkpoint(ctx, "charged", []byte("ch_1")); err != nil {
					return nil, err
				}
				return nil, status.Error(codes.InvalidArgument, "address rejected after the charge")
			}
			return bookCharge(ctx, req, n)
		},
	})
	wantCode(t, f.charge(t, "order-1", chargeReq(100)).err, codes.InvalidArgument)
	if rec := f.mustState(t, "order-1", idempotencyv1.State_STATE_FAILED_RETRYABLE); rec.GetCheckpoint().GetPhase() != "charged" {
		t.Fatalf("record after run 1: %v", rec)
	}
	if r := f.charge(t, "order-1", chargeReq(100)); r.err != nil {
		t.Fatal(r.err)
	}
	if a, b := <-seen, <-seen; a != "none" || b != "charged=ch_1" {
		t.Fatalf("runs saw %s, %s", a, b)
	}
}

// Checkpoint in a handler under HTTPMiddleware (r.Context()): run 1
// records a step and answers 503 (RETRYABLE); run 2 resumes after it.
func TestCheckpointUnderHTTPMiddleware(t *testing.T) {
	t.Parallel()
	seen := make(chan string, 2)
	f := startHTTP(t, httpSetup{handler: func(w http.ResponseWriter, r *http.Request, n int32) {
		seen <- checkpointSeen(r.Context())
		if n == 1 {
			if err := clients.Checkpoint(r.Context(), "reserved", []byte("r_1")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			http.Error(w, "try later", http.StatusServiceUnavailable)
			return
		}
		createProject(w, r, n)
	}})
	if r := f.send(t, http.MethodPost, "/projects", "k-1", `{}`); r.status != http.StatusServiceUnavailable {
		t.Fatalf("run 1: %v", r)
	}
	if r := f.send(t, http.MethodPost, "/projects", "k-1", `{}`); r.status != http.StatusCreated {
		t.Fatalf("run 2: %v", r)
	}
	if a, b := <-seen, <-seen; a != "none" || b != "reserved=r_1" {
		t.Fatalf("runs saw %s, %s", a, b)
	}
}

// A checkpoint recorded in the handler's own transaction
// (ledger.Store.CheckpointTx on the coordinator's database) commits with
// the step's row; when the handler then fails with an error of the
// ABANDONED class, the coordinator refuses the ABANDONED
// (CHECKPOINT_RECORDED) and the interceptor ends the attempt RETRYABLE,
// so the next run resumes after the step.
func TestCheckpointTxUnderInterceptor(t *testing.T) {
	t.Parallel()
	seen := make(chan string, 2)
	var f *fixture
	f = start(t, setup{
		interceptor: []clients.InterceptorOption{clients.WithoutPrincipal()},
		charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			seen <- checkpointSeen(ctx)
			if n > 1 {
				return bookCharge(ctx, req, n)
			}
			lease, _ := clients.LeaseFrom(ctx)
			conn, err := pgx.Connect(ctx, f.coord.DatabaseURL)
			if err != nil {
				return nil, err
			}
			defer conn.Close(context.Background())
			tx, err := conn.Begin(ctx)
			if err != nil {
				return nil, err
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			if _, err := tx.Exec(ctx, `CREATE TABLE charges_done (id text)`); err != nil {
				return nil, err
			}
			if _, err := f.coord.Store.CheckpointTx(ctx, tx, &ledger.CheckpointParams{
				ID:    ledger.Identity{Tenant: ledger.DefaultTenant, Scope: lease.Scope, Key: lease.Key},
				Token: lease.Token, Phase: "charged", Data: []byte("ch_tx")}); err != nil {
				return nil, err
			}
			if err := tx.Commit(ctx); err != nil {
				return nil, err
			}
			return nil, status.Error(codes.InvalidArgument, "address rejected after the charge")
		},
	})
	wantCode(t, f.charge(t, "order-tx", chargeReq(100)).err, codes.InvalidArgument)
	if rec := f.mustState(t, "order-tx", idempotencyv1.State_STATE_FAILED_RETRYABLE); rec.GetCheckpoint().GetPhase() != "charged" {
		t.Fatalf("record after run 1: %v", rec)
	}
	if r := f.charge(t, "order-tx", chargeReq(100)); r.err != nil {
		t.Fatal(r.err)
	}
	if a, b := <-seen, <-seen; a != "none" || b != "charged=ch_tx" {
		t.Fatalf("runs saw %s, %s", a, b)
	}
}

// An attempt whose checkpoint the library did not send (CheckpointTx in
// the function's own transaction) fails with an error of the ABANDONED
// class while the coordinator is down: the ABANDONED the library keeps
// trying in the background is refused CHECKPOINT_RECORDED once the
// coordinator is back, and the library ends the attempt RETRYABLE instead,
// as it does when the coordinator answers at once (not left to lapse).
func TestCheckpointTxThenAbandonWhileCoordinatorDown(t *testing.T) {
	t.Parallel()
	coord, c := newClient(t, coordtest.Options{})
	ctx := testCtx(t)
	_, err := c.Once(ctx, "deploy", "down", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		lease, _ := clients.LeaseFrom(ctx)
		conn, err := pgx.Connect(ctx, coord.DatabaseURL)
		if err != nil {
			return nil, err
		}
		defer conn.Close(context.Background())
		tx, err := conn.Begin(ctx)
		if err != nil {
			return nil, err
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		if _, err := coord.Store.CheckpointTx(ctx, tx, &ledger.CheckpointParams{
			ID:    ledger.Identity{Tenant: ledger.DefaultTenant, Scope: lease.Scope, Key: lease.Key},
			Token: lease.Token, Phase: "charged", Data: []byte("ch_tx")}); err != nil {
			return nil, err
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, err
		}
		coord.Stop()
		return nil, status.Error(codes.InvalidArgument, "address rejected after the charge")
	})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Once: %v", err)
	}
	coord.Restart()
	if err := c.Shutdown(ctx); err != nil { // waits for the background ending
		t.Fatal(err)
	}
	if rec, cp := lookupCheckpoint(t, c, "deploy", "down"); rec.GetState() != idempotencyv1.State_STATE_FAILED_RETRYABLE || cp != "charged=ch_tx" {
		t.Fatalf("after the coordinator came back: %v %s, want FAILED_RETRYABLE charged=ch_tx", rec.GetState(), cp)
	}
}

// heldAnswerConn holds back the answer of the first Heartbeat whose
// checkpoint phase is phase until release is closed (the coordinator has
// written it by then: written is closed).
type heldAnswerConn struct {
	grpc.ClientConnInterface
	phase            string
	once             sync.Once
	written, release chan struct{}
}

func (c *heldAnswerConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	err := c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
	if hb, ok := args.(*idempotencyv1.HeartbeatRequest); ok && hb.GetCheckpoint().GetPhase() == c.phase {
		held := false
		c.once.Do(func() { held = true })
		if held {
			close(c.written)
			<-c.release
		}
	}
	return err
}

// Two Checkpoint calls of one attempt at once, the first answered only
// after the second: CheckpointFrom returns the one the coordinator wrote
// last, as Lookup shows it, not the one answered last.
func TestConcurrentCheckpointsKeepTheLastWritten(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{})
	conn := &heldAnswerConn{ClientConnInterface: coord.Dial(t), phase: "first", written: make(chan struct{}), release: make(chan struct{})}
	// Unbatched (no fixtureOptions), so that each Heartbeat is its own
	// call the wrapper sees.
	c := clients.New(conn)
	t.Cleanup(func() { _ = c.Shutdown(context.Background()) })
	ctx := testCtx(t)
	var seen string
	_, err := c.Once(ctx, "deploy", "concurrent-steps", nil, func(ctx context.Context) (*idempotencyv1.StoredResponse, error) {
		first := make(chan error, 1)
		go func() { first <- clients.Checkpoint(ctx, "first", []byte("1")) }()
		select {
		case <-conn.written:
		case err := <-first:
			return nil, fmt.Errorf("the first Checkpoint ended (%v) before its answer was held", err)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		if err := clients.Checkpoint(ctx, "second", []byte("2")); err != nil {
			return nil, err
		}
		close(conn.release)
		if err := <-first; err != nil {
			return nil, err
		}
		seen = checkpointSeen(ctx)
		return stored("done"), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, cp := lookupCheckpoint(t, c, "deploy", "concurrent-steps"); cp != "second=2" {
		t.Fatalf("the coordinator holds %s, want second=2", cp)
	}
	if seen != "second=2" {
		t.Fatalf("CheckpointFrom after both answers: %s, want second=2 (the one written last)", seen)
	}
}
