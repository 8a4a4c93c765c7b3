package server_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// TestReadOnlyDatabaseAnswersUnavailable fences the database read-only, as
// an orchestrator does to a primary it demotes (default_transaction_read_only,
// SQLSTATE 25006 on every write), and checks that every RPC that writes
// answers UNAVAILABLE, never INTERNAL, and writes nothing; reads still answer.
// Once the fence is lifted, the same calls succeed without a restart.
func TestReadOnlyDatabaseAnswersUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	admin := idempotencyv1.NewAdminClient(e.coord.Dial(t))

	held := e.mustBegin("s", "held", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	done := e.mustBegin("s", "done", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if _, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "done",
		LeaseToken: done.GetLeaseToken(), Response: &idempotencyv1.StoredResponse{Body: []byte("x")}}); err != nil {
		t.Fatal(err)
	}
	e.mustBegin("s", "lapsed", idempotencyv1.Outcome_OUTCOME_ACQUIRED, withLease(time.Second))
	e.clock.Advance(2 * time.Second) // "lapsed" reads UNKNOWN: Resolve may end it
	rowsBefore := e.rowCount()

	fence := func(on bool) {
		t.Helper()
		conn, err := pgxConnect(e.dbURL)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		var db string
		if err := conn.QueryRow(ctx(t), `SELECT current_database()`).Scan(&db); err != nil {
			t.Fatal(err)
		}
		stmt := `ALTER DATABASE "` + db + `" RESET default_transaction_read_only`
		if on {
			stmt = `ALTER DATABASE "` + db + `" SET default_transaction_read_only = on`
		}
		if _, err := conn.Exec(ctx(t), `SET default_transaction_read_only = off`); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx(t), stmt); err != nil {
			t.Fatal(err)
		}
		// The setting applies to new sessions: end the coordinator's.
		if _, err := conn.Exec(ctx(t), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()`); err != nil {
			t.Fatal(err)
		}
	}

	writes := []struct {
		name string
		call func(context.Context) error
	}{
		{"Begin of a new key", func(c context.Context) error {
			_, err := e.client.Begin(c, &idempotencyv1.BeginRequest{Scope: "s", Key: "new"})
			return err
		}},
		{"Heartbeat", func(c context.Context) error {
			_, err := e.client.Heartbeat(c, &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "held",
				LeaseToken: held.GetLeaseToken(), Lease: durationpb.New(time.Minute)})
			return err
		}},
		{"Complete", func(c context.Context) error {
			_, err := e.client.Complete(c, &idempotencyv1.CompleteRequest{Scope: "s", Key: "held",
				LeaseToken: held.GetLeaseToken(), Response: &idempotencyv1.StoredResponse{Body: []byte("y")}})
			return err
		}},
		{"Fail", func(c context.Context) error {
			_, err := e.client.Fail(c, &idempotencyv1.FailRequest{Scope: "s", Key: "held",
				LeaseToken: held.GetLeaseToken(), Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE})
			return err
		}},
		{"Admin.Resolve", func(c context.Context) error {
			_, err := admin.Resolve(c, &idempotencyv1.ResolveRequest{Scope: "s", Key: "lapsed",
				Resolution: idempotencyv1.Resolution_RESOLUTION_RETRYABLE})
			return err
		}},
		{"Admin.Forget", func(c context.Context) error {
			_, err := admin.Forget(c, &idempotencyv1.ForgetRequest{Scope: "s", Key: "done"})
			return err
		}},
	}

	fence(true)
	// Twice each: the first call may meet a connection the fence ended,
	// the second meets a read-only session.
	for range 2 {
		for _, w := range writes {
			if err := w.call(ctx(t)); status.Code(err) != codes.Unavailable {
				t.Errorf("%s on a read-only database: %v, want UNAVAILABLE", w.name, err)
			}
		}
	}
	// A Begin of an ended key tries its insert first, so it fails too, unless
	// the replay cache answers it; Lookup is a read and is answered.
	r, err := e.client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "done"})
	if status.Code(err) != codes.Unavailable && (err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY ||
		string(r.GetRecord().GetResponse().GetBody()) != "x") {
		t.Errorf("Begin of a completed key on a read-only database: %v, %v; want UNAVAILABLE or its replay", r, err)
	}
	var lr *idempotencyv1.LookupResponse
	for try := 0; ; try++ {
		lr, err = e.client.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "s", Key: "done"})
		if status.Code(err) != codes.Unavailable || try == 100 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil || string(lr.GetRecord().GetResponse().GetBody()) != "x" {
		t.Errorf("Lookup on a read-only database: %v, %v; want the record", lr, err)
	}
	if n := e.rowCount(); n != rowsBefore {
		t.Errorf("%d records after the fenced writes, want %d", n, rowsBefore)
	}

	fence(false)
	// Back to normal without a restart: every write goes through (retried
	// while a pooled connection still holds a read-only session).
	for _, w := range writes {
		var err error
		for range 100 {
			if err = w.call(ctx(t)); status.Code(err) != codes.Unavailable {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		switch w.name {
		case "Fail":
			// The Complete before it ended the lease.
			if status.Code(err) != codes.FailedPrecondition {
				t.Errorf("%s after the fence: %v, want FAILED_PRECONDITION (already finished)", w.name, err)
			}
		default:
			if err != nil {
				t.Errorf("%s after the fence: %v", w.name, err)
			}
		}
	}
}
