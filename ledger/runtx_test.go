package ledger_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// chargesTable is the business table of these tests: one row per charge,
// unique by key.
const chargesTable = `CREATE TABLE IF NOT EXISTS charges (key text PRIMARY KEY, amount bigint NOT NULL, token text NOT NULL)`

// txDB is a fresh migrated database with a charges table and a store on it.
type txDB struct {
	url   string
	store *ledger.Store
	conn  *pgx.Conn
}

func newTxDB(t *testing.T, opts ...ledger.Option) *txDB {
	t.Helper()
	url := pgtest.NewDatabase(t)
	return openTxDB(t, url, opts...)
}

func openTxDB(t *testing.T, url string, opts ...ledger.Option) *txDB {
	t.Helper()
	s, err := ledger.Open(context.Background(), url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if _, err := conn.Exec(context.Background(), chargesTable); err != nil {
		t.Fatal(err)
	}
	return &txDB{url: url, store: s, conn: conn}
}

// count runs a count(*) query.
func (db *txDB) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := db.conn.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (db *txDB) charges(t *testing.T, key string) int {
	return db.count(t, `SELECT count(*) FROM charges WHERE key = $1`, key)
}

func (db *txDB) records(t *testing.T, key string) int {
	return db.count(t, `SELECT count(*) FROM idempotency_records WHERE key = $1`, key)
}

// charge is a RunTx function that writes one charge row and answers with
// a body no other call can produce.
func charge(key string, calls *atomic.Int32) func(context.Context, pgx.Tx) (*statemachine.Response, error) {
	return func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		calls.Add(1)
		token := rand.Text()
		if _, err := tx.Exec(ctx, `INSERT INTO charges (key, amount, token) VALUES ($1, 100, $2)`, key, token); err != nil {
			return nil, err
		}
		return &statemachine.Response{SchemaVersion: "charge/1", ContentType: "application/json", StatusCode: 201,
			Body: []byte(`{"token":"` + token + `"}`), Metadata: map[string]string{"charge-key": key}}, nil
	}
}

var chargeID = ledger.Identity{Scope: "charge", Key: "order-1"}

// TestRunTxConcurrentDuplicatesRunOnce: 50 concurrent RunTx on one key run
// fn once, leave one business row, and all get the same response.
func TestRunTxConcurrentDuplicatesRunOnce(t *testing.T) {
	t.Parallel()
	db := newTxDB(t)
	var calls atomic.Int32
	fn := charge(chargeID.Key, &calls)
	slow := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		time.Sleep(20 * time.Millisecond) // let the duplicates pile up on the lock
		return fn(ctx, tx)
	}
	const n = 50
	resps := make([]*statemachine.Response, n)
	replays := make([]bool, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			resps[i], replays[i], errs[i] = db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{Wait: time.Minute}, slow)
		})
	}
	close(start)
	wg.Wait()
	fresh := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if !replays[i] {
			fresh++
		}
		if !resps[i].Equal(resps[0]) {
			t.Fatalf("call %d got %+v, call 0 got %+v", i, resps[i], resps[0])
		}
	}
	if calls.Load() != 1 || fresh != 1 {
		t.Fatalf("fn ran %d times, %d calls not replayed; want 1 and 1", calls.Load(), fresh)
	}
	if got := db.charges(t, chargeID.Key); got != 1 {
		t.Fatalf("%d charge rows", got)
	}
	rec, _, err := db.store.Lookup(context.Background(), ledger.Identity{Tenant: ledger.DefaultTenant, Scope: chargeID.Scope, Key: chargeID.Key})
	if err != nil || rec.State != statemachine.StateCompleted || !rec.Response.Equal(resps[0]) {
		t.Fatalf("stored record %+v, %v", rec, err)
	}

	// The same on an existing record that may run again (FAILED_RETRYABLE
	// over gRPC): the row lock decides.
	id := ledger.Identity{Tenant: ledger.DefaultTenant, Scope: "charge", Key: "retried"}
	token := beginID(t, db.store, id, time.Minute, time.Hour)
	if _, err := db.store.Finish(context.Background(), &ledger.FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: token, FailureKind: statemachine.FailureRetryable}}); err != nil {
		t.Fatal(err)
	}
	calls.Store(0)
	fn = charge(id.Key, &calls)
	start = make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			resps[i], replays[i], errs[i] = db.store.RunTx(context.Background(), id, ledger.TxOptions{Wait: time.Minute}, slow)
		})
	}
	close(start)
	wg.Wait()
	for i := range n {
		if errs[i] != nil || !resps[i].Equal(resps[0]) {
			t.Fatalf("takeover, call %d: %+v %v", i, resps[i], errs[i])
		}
	}
	if calls.Load() != 1 || db.charges(t, id.Key) != 1 {
		t.Fatalf("takeover by 50 at once: fn ran %d times, %d charge rows", calls.Load(), db.charges(t, id.Key))
	}
}

// TestRunTxErrorOrPanicRollsBack: an error or a panic in fn leaves neither
// the business row nor a record, and the key runs again afterwards.
func TestRunTxErrorOrPanicRollsBack(t *testing.T) {
	t.Parallel()
	db := newTxDB(t)
	var calls atomic.Int32
	ok := charge(chargeID.Key, &calls)
	declined := errors.New("card declined by the bank's timeout")
	failing := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		if _, err := ok(ctx, tx); err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("charging: %w", declined)
	}
	_, _, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{}, failing)
	if !errors.Is(err, declined) {
		t.Fatalf("RunTx returned %v, want fn's error", err)
	}
	if db.charges(t, chargeID.Key) != 0 || db.records(t, chargeID.Key) != 0 {
		t.Fatal("an error in fn left a charge row or a record")
	}

	panicking := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		if _, err := ok(ctx, tx); err != nil {
			return nil, err
		}
		panic("boom")
	}
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("recovered %v, want fn's panic", r)
			}
		}()
		_, _, _ = db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{}, panicking)
	}()
	if db.charges(t, chargeID.Key) != 0 || db.records(t, chargeID.Key) != 0 {
		t.Fatal("a panic in fn left a charge row or a record")
	}

	// fn may not end the transaction itself.
	committing := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		if _, err := ok(ctx, tx); err != nil {
			return nil, err
		}
		return nil, tx.Commit(ctx)
	}
	if _, _, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{}, committing); err == nil {
		t.Fatal("fn committed RunTx's transaction")
	}
	if db.charges(t, chargeID.Key) != 0 || db.records(t, chargeID.Key) != 0 {
		t.Fatal("a commit in fn left a charge row or a record")
	}

	// A caller that goes away while fn runs: rolled back.
	cctx, cancel := context.WithCancel(context.Background())
	cancelled := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		if _, err := ok(ctx, tx); err != nil {
			return nil, err
		}
		cancel()
		<-ctx.Done()
		return &statemachine.Response{Body: []byte("too late")}, nil
	}
	if _, _, err := db.store.RunTx(cctx, chargeID, ledger.TxOptions{}, cancelled); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled caller: %v, want context.Canceled", err)
	}
	if db.charges(t, chargeID.Key) != 0 || db.records(t, chargeID.Key) != 0 {
		t.Fatal("a cancelled caller left a charge row or a record")
	}

	calls.Store(0)
	resp, replayed, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{}, ok)
	if err != nil || replayed || calls.Load() != 1 || db.charges(t, chargeID.Key) != 1 {
		t.Fatalf("the retry after the failures: %v %v %v, %d calls", resp, replayed, err, calls.Load())
	}
}

// TestRunTxReplayableError: a *ReplayableError is stored FAILED_REPLAYABLE
// with fn's writes and replays with the same error type.
func TestRunTxReplayableError(t *testing.T) {
	t.Parallel()
	db := newTxDB(t)
	var calls atomic.Int32
	rejection := &statemachine.Response{StatusCode: 422, ContentType: "application/problem+json", Body: []byte(`{"title":"insufficient funds"}`)}
	fn := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		calls.Add(1)
		return nil, fmt.Errorf("rejected: %w", &ledger.ReplayableError{Response: rejection})
	}
	for i, wantReplay := range []bool{false, true} {
		resp, replayed, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{}, fn)
		var re *ledger.ReplayableError
		if !errors.As(err, &re) || !re.Response.Equal(rejection) || !resp.Equal(rejection) || replayed != wantReplay {
			t.Fatalf("call %d: %+v %v %v", i, resp, replayed, err)
		}
	}
	if calls.Load() != 1 {
		t.Fatalf("fn ran %d times", calls.Load())
	}
	rec, _, err := db.store.Lookup(context.Background(), ledger.Identity{Tenant: ledger.DefaultTenant, Scope: chargeID.Scope, Key: chargeID.Key})
	if err != nil || rec.State != statemachine.StateFailedReplayable {
		t.Fatalf("stored %v, %v", rec.State, err)
	}
}

// TestRunTxFingerprintAndBadInput: a changed request is refused without
// calling fn, and bad input is refused without writing anything.
func TestRunTxFingerprintAndBadInput(t *testing.T) {
	t.Parallel()
	db := newTxDB(t)
	var calls atomic.Int32
	fn := charge(chargeID.Key, &calls)
	if _, _, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{Fingerprint: []byte("A")}, fn); err != nil {
		t.Fatal(err)
	}
	if _, _, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{Fingerprint: []byte("B")}, fn); !errors.Is(err, statemachine.ErrFingerprintMismatch) {
		t.Fatalf("another fingerprint: %v", err)
	}
	if _, replayed, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{}, fn); err != nil || !replayed {
		t.Fatalf("no fingerprint: %v %v", replayed, err)
	}
	if calls.Load() != 1 {
		t.Fatalf("fn ran %d times", calls.Load())
	}

	for name, c := range map[string]struct {
		id   ledger.Identity
		opts ledger.TxOptions
	}{
		"empty key":        {ledger.Identity{Scope: "s"}, ledger.TxOptions{}},
		"empty scope":      {ledger.Identity{Key: "k"}, ledger.TxOptions{}},
		"control in key":   {ledger.Identity{Scope: "s", Key: "k\n"}, ledger.TxOptions{}},
		"invalid UTF-8":    {ledger.Identity{Scope: "s", Key: "k\xff"}, ledger.TxOptions{}},
		"long key":         {ledger.Identity{Scope: "s", Key: strings.Repeat("k", 256)}, ledger.TxOptions{}},
		"long tenant":      {ledger.Identity{Tenant: strings.Repeat("t", 256), Scope: "s", Key: "k"}, ledger.TxOptions{}},
		"long fingerprint": {ledger.Identity{Scope: "s", Key: "k"}, ledger.TxOptions{Fingerprint: make([]byte, 65)}},
		"negative TTL":     {ledger.Identity{Scope: "s", Key: "k"}, ledger.TxOptions{TTL: -time.Second}},
	} {
		if _, _, err := db.store.RunTx(context.Background(), c.id, c.opts, fn); !errors.Is(err, ledger.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, _, err := db.store.RunTx(context.Background(), ledger.Identity{Scope: "s", Key: "k"}, ledger.TxOptions{}, nil); !errors.Is(err, ledger.ErrInvalidArgument) {
		t.Errorf("nil fn: %v", err)
	}
	if calls.Load() != 1 || db.count(t, `SELECT count(*) FROM idempotency_records`) != 1 {
		t.Fatalf("bad input ran fn or wrote a record")
	}

	// A response too large to replay over gRPC rolls fn's writes back.
	big := ledger.Identity{Scope: "s", Key: "big"}
	huge := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		if _, err := charge(big.Key, &calls)(ctx, tx); err != nil {
			return nil, err
		}
		return &statemachine.Response{Body: make([]byte, ledger.MaxTxResponseBytes), ContentType: "x"}, nil
	}
	if _, _, err := db.store.RunTx(context.Background(), big, ledger.TxOptions{}, huge); !errors.Is(err, ledger.ErrInvalidArgument) {
		t.Fatalf("oversized response: %v", err)
	}
	if db.charges(t, big.Key) != 0 || db.records(t, big.Key) != 0 {
		t.Fatal("an oversized response left a charge row or a record")
	}
}

// waitForLockWaiters waits until n sessions wait on a lock.
func waitForLockWaiters(t *testing.T, db *txDB, n int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	// pgtest's sees the waits on Citus workers too.
	for len(pgtest.WaitForLockWaiters(t, db.conn)) < n {
		if time.Now().After(deadline) {
			t.Fatalf("no %d sessions waiting on a lock", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRunTxDuplicateWaitsThenInProgress: a duplicate waits on the running
// attempt's lock up to Wait, then answers ErrInProgress; one still waiting
// when the first commits replays.
func TestRunTxDuplicateWaitsThenInProgress(t *testing.T) {
	t.Parallel()
	db := newTxDB(t)
	var calls atomic.Int32
	fn := charge(chargeID.Key, &calls)
	release := make(chan struct{})
	running := make(chan struct{})
	type result struct {
		resp     *statemachine.Response
		replayed bool
		err      error
	}
	first := make(chan result, 1)
	go func() {
		resp, replayed, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
			close(running)
			<-release
			return fn(ctx, tx)
		})
		first <- result{resp, replayed, err}
	}()
	<-running
	// The first attempt runs until this returns: only the wait can end it.
	if _, _, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{Wait: 50 * time.Millisecond}, fn); !errors.Is(err, ledger.ErrInProgress) {
		t.Fatalf("duplicate while the first runs: %v, want ErrInProgress", err)
	}
	if _, _, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{Wait: -1}, fn); !errors.Is(err, ledger.ErrInProgress) {
		t.Fatalf("duplicate that does not wait: %v, want ErrInProgress", err)
	}
	second := make(chan result, 1)
	go func() {
		resp, replayed, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{Wait: time.Minute}, fn)
		second <- result{resp, replayed, err}
	}()
	waitForLockWaiters(t, db, 1)
	close(release)
	a, b := <-first, <-second
	if a.err != nil || a.replayed || b.err != nil || !b.replayed || !a.resp.Equal(b.resp) || calls.Load() != 1 {
		t.Fatalf("first %+v, waiting duplicate %+v, %d calls", a, b, calls.Load())
	}
}

// TestRunTxRespectsRecordsOfTheCoordinator: records written by Begin,
// Complete and Fail (the coordinator's calls) are honoured: a live lease is
// waited for, UNKNOWN is never taken over, FAILED_RETRYABLE and an expired
// record run again.
func TestRunTxRespectsRecordsOfTheCoordinator(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	clock := coordtest.NewClock()
	db := openTxDB(t, url, ledger.WithClock(clock.Now))
	s := db.store
	ctx := context.Background()
	id := ledger.Identity{Tenant: ledger.DefaultTenant, Scope: "charge", Key: "held"}
	var calls atomic.Int32
	fn := charge(id.Key, &calls)

	// A live lease: wait, then ErrInProgress.
	token := beginID(t, s, id, time.Minute, time.Hour)
	if _, _, err := s.RunTx(ctx, id, ledger.TxOptions{Wait: 20 * time.Millisecond}, fn); !errors.Is(err, ledger.ErrInProgress) || errors.Is(err, ledger.ErrUnknownHeld) {
		t.Fatalf("key held over gRPC: %v, want ErrInProgress", err)
	}
	// A waiting RunTx wakes on the holder's Complete and replays it.
	done := make(chan error, 1)
	var got *statemachine.Response
	go func() {
		var replayed bool
		var err error
		got, replayed, err = s.RunTx(ctx, id, ledger.TxOptions{Wait: time.Minute}, fn)
		if err == nil && !replayed {
			err = errors.New("not replayed")
		}
		done <- err
	}()
	completeID(t, s, id, token)
	if err := <-done; err != nil || string(got.Body) != "done" {
		t.Fatalf("RunTx waiting for the holder: %v %+v", err, got)
	}

	// UNKNOWN (a lapsed lease): held until an operator resolves it.
	id.Key = "lapsed"
	beginID(t, s, id, time.Second, time.Hour)
	clock.Advance(2 * time.Second)
	// At once: an UNKNOWN record waits for an operator, not for an attempt.
	short, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if _, _, err := s.RunTx(short, id, ledger.TxOptions{Wait: time.Hour}, fn); !errors.Is(err, ledger.ErrUnknownHeld) || !errors.Is(err, ledger.ErrInProgress) {
		t.Fatalf("UNKNOWN key: %v, want ErrUnknownHeld", err)
	}
	if _, err := s.Resolve(ctx, &ledger.ResolveParams{ID: id, As: statemachine.StateFailedRetryable}); err != nil {
		t.Fatal(err)
	}
	// Resolved as retryable: RunTx runs.
	fn = charge(id.Key, &calls)
	if _, replayed, err := s.RunTx(ctx, id, ledger.TxOptions{}, fn); err != nil || replayed {
		t.Fatalf("after Resolve: %v %v", replayed, err)
	}

	// Uncertain: a takeover of the lapsed lease that then failed
	// RETRYABLE leaves the generation uncertain: held until an operator
	// resolves it.
	id.Key = "uncertain"
	beginID(t, s, id, time.Second, time.Hour)
	clock.Advance(2 * time.Second)
	token = beginID(t, s, id, time.Minute, time.Hour)
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: token, FailureKind: statemachine.FailureRetryable}}); err != nil {
		t.Fatal(err)
	}
	if rec, _, err := s.Lookup(ctx, id); err != nil || rec.State != statemachine.StateFailedRetryable || !rec.Uncertain {
		t.Fatalf("setup: %+v %v", rec, err)
	}
	if _, _, err := s.RunTx(ctx, id, ledger.TxOptions{}, fn); !errors.Is(err, ledger.ErrUnknownHeld) {
		t.Fatalf("uncertain FAILED_RETRYABLE: %v, want ErrUnknownHeld", err)
	}
	if _, err := s.Resolve(ctx, &ledger.ResolveParams{ID: id, As: statemachine.StateFailedRetryable}); err != nil {
		t.Fatal(err)
	}
	fn = charge(id.Key, &calls)
	if _, replayed, err := s.RunTx(ctx, id, ledger.TxOptions{}, fn); err != nil || replayed {
		t.Fatalf("after Resolve: %v %v", replayed, err)
	}

	// Fail UNKNOWN, then the holder's late Complete: held, then replayed.
	id.Key = "failed-unknown"
	token = beginID(t, s, id, time.Minute, time.Hour)
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: token, FailureKind: statemachine.FailureUnknown}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.RunTx(ctx, id, ledger.TxOptions{}, fn); !errors.Is(err, ledger.ErrUnknownHeld) {
		t.Fatalf("after Fail UNKNOWN: %v, want ErrUnknownHeld", err)
	}
	completeID(t, s, id, token)
	before := calls.Load()
	if resp, replayed, err := s.RunTx(ctx, id, ledger.TxOptions{}, fn); err != nil || !replayed || string(resp.Body) != "done" || calls.Load() != before {
		t.Fatalf("after the late Complete: %+v %v %v", resp, replayed, err)
	}

	// FAILED_RETRYABLE over gRPC: RunTx takes over.
	id.Key = "retryable"
	token = beginID(t, s, id, time.Minute, time.Hour)
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: token, FailureKind: statemachine.FailureRetryable}}); err != nil {
		t.Fatal(err)
	}
	fn = charge(id.Key, &calls)
	if _, replayed, err := s.RunTx(ctx, id, ledger.TxOptions{}, fn); err != nil || replayed {
		t.Fatalf("after Fail RETRYABLE: %v %v", replayed, err)
	}
	rec, _, err := s.Lookup(ctx, id)
	if err != nil || rec.State != statemachine.StateCompleted || rec.Attempt != 2 {
		t.Fatalf("record after the takeover: %+v %v", rec, err)
	}

	// Expired: a new generation runs fn again.
	before = calls.Load()
	clock.Advance(25 * time.Hour)
	if _, replayed, err := s.RunTx(ctx, id, ledger.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		calls.Add(1)
		return &statemachine.Response{Body: []byte("again")}, nil
	}); err != nil || replayed || calls.Load() != before+1 {
		t.Fatalf("expired key: %v %v", replayed, err)
	}
	if rec, _, err = s.Lookup(ctx, id); err != nil || rec.Generation != 2 || string(rec.Response.Body) != "again" {
		t.Fatalf("record after the restart: %+v %v", rec, err)
	}
}

// The killed-process test runs RunTx in a child process (this test binary
// again) whose fn signals on stdout and then blocks until it is killed.
const runTxChildEnv = "IDEMCOORD_RUNTX_CHILD_DATABASE_URL"

func init() { //nolint:gochecknoinits // the child must take over before TestMain and the tests run
	url := os.Getenv(runTxChildEnv)
	if url == "" {
		return
	}
	// The child: never returns.
	s, err := ledger.Open(context.Background(), url)
	if err != nil {
		fmt.Println("open:", err)
		os.Exit(2)
	}
	_, _, err = s.RunTx(context.Background(), chargeID, ledger.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (key, amount, token) VALUES ($1, 100, 'child')`, chargeID.Key); err != nil {
			return nil, err
		}
		fmt.Println("fn done")
		select {} // killed here, between fn and the commit
	})
	fmt.Println("RunTx returned:", err)
	os.Exit(2)
}

// TestRunTxProcessKilledBetweenFnAndCommit: a process killed (SIGKILL)
// after fn wrote and before the commit leaves nothing, and a retry runs fn
// once.
func TestRunTxProcessKilledBetweenFnAndCommit(t *testing.T) {
	t.Parallel()
	db := newTxDB(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), runTxChildEnv+"="+db.url)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "fn done\n" {
		_ = cmd.Process.Kill()
		t.Fatalf("child said %q, %v", line, err)
	}
	// The child's transaction is open and holds the key.
	if db.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'`) != 1 {
		t.Fatal("the child's transaction is not open")
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()

	// The server notices the dead client and rolls back; a retry waits for
	// that on the key's lock, then runs once.
	var calls atomic.Int32
	resp, replayed, err := db.store.RunTx(context.Background(), chargeID, ledger.TxOptions{Wait: time.Minute}, charge(chargeID.Key, &calls))
	if err != nil || replayed || calls.Load() != 1 {
		t.Fatalf("retry after the kill: %v %v %v, %d calls", resp, replayed, err, calls.Load())
	}
	var token string
	if err := db.conn.QueryRow(context.Background(), `SELECT token FROM charges WHERE key = $1`, chargeID.Key).Scan(&token); err != nil || token == "child" {
		t.Fatalf("charge row %q, %v: the killed child's write survived", token, err)
	}
	if db.charges(t, chargeID.Key) != 1 || db.records(t, chargeID.Key) != 1 {
		t.Fatal("not exactly one charge and one record")
	}
}

// TestRunTxInteroperatesWithTheCoordinator: a key completed by RunTx replays
// byte for byte through a gRPC Begin on a real coordinator on the same
// database (with encryption on), and a key completed over gRPC replays
// through RunTx; a key held over gRPC is waited for.
func TestRunTxInteroperatesWithTheCoordinator(t *testing.T) {
	t.Parallel()
	keyFile := filepath.Join(t.TempDir(), "k1")
	key := make([]byte, ledger.KeySize)
	_, _ = rand.Read(key)
	if err := os.WriteFile(keyFile, []byte(base64.StdEncoding.EncodeToString(key)), 0o600); err != nil {
		t.Fatal(err)
	}
	coord := coordtest.Start(t, coordtest.Options{Config: "encryption: { active_key: k1, keys: [{ id: k1, file: " + keyFile + " }] }\n"})
	keyring, err := ledger.NewKeyring("k1", map[string][]byte{"k1": key})
	if err != nil {
		t.Fatal(err)
	}
	db := openTxDB(t, coord.DatabaseURL, ledger.WithKeyring(keyring))
	client := idempotencyv1.NewCoordinatorClient(coord.Dial(t))
	ctx := context.Background()
	fp := []byte("sha256 of the request")

	// RunTx first, gRPC replays.
	want := &statemachine.Response{SchemaVersion: "payments.v1.ChargeResponse/3", ContentType: "application/x-protobuf",
		StatusCode: 0, Body: []byte{0x0a, 0x03, 0xff, 0x00, 0x01}, Metadata: map[string]string{"x-charge": "ch_1", "empty": ""}}
	id := ledger.Identity{Scope: "/payments.v1.Payments/Charge", Key: "from-runtx"}
	if _, _, err := db.store.RunTx(ctx, id, ledger.TxOptions{Fingerprint: fp}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		return want, nil
	}); err != nil {
		t.Fatal(err)
	}
	var body []byte
	if err := db.conn.QueryRow(ctx, `SELECT body FROM idempotency_records WHERE key = $1`, id.Key).Scan(&body); err != nil || bytes.Contains(body, want.Body) {
		t.Fatalf("stored body %x (%v): not encrypted", body, err)
	}
	for range 2 { // the second may come from the replay cache
		res, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: id.Scope, Key: id.Key, Fingerprint: fp})
		if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY {
			t.Fatalf("gRPC Begin on a RunTx key: %v %v", res, err)
		}
		if r := res.GetRecord().GetResponse(); !proto.Equal(r, &idempotencyv1.StoredResponse{SchemaVersion: want.SchemaVersion,
			ContentType: want.ContentType, StatusCode: want.StatusCode, Body: want.Body, Metadata: want.Metadata}) {
			t.Fatalf("gRPC replay %v, stored %+v", r, want)
		}
	}
	if _, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: id.Scope, Key: id.Key, Fingerprint: []byte("other")}); err == nil {
		t.Fatal("gRPC Begin with another fingerprint replayed")
	}

	// A FAILED_REPLAYABLE outcome of RunTx replays over gRPC too.
	id.Key = "rejected-by-runtx"
	rejection := &statemachine.Response{StatusCode: 422, Body: []byte("no funds")}
	if _, _, err := db.store.RunTx(ctx, id, ledger.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		return nil, &ledger.ReplayableError{Response: rejection}
	}); err == nil {
		t.Fatal("want the ReplayableError")
	}
	res, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: id.Scope, Key: id.Key})
	if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || res.GetRecord().GetState() != idempotencyv1.State_STATE_FAILED_REPLAYABLE ||
		res.GetRecord().GetResponse().GetStatusCode() != 422 || string(res.GetRecord().GetResponse().GetBody()) != "no funds" {
		t.Fatalf("gRPC Begin on a rejected RunTx key: %v %v", res, err)
	}

	// gRPC first, RunTx replays; while the gRPC caller holds the key,
	// RunTx waits.
	id.Key = "from-grpc"
	res, err = client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: id.Scope, Key: id.Key, Fingerprint: fp, Lease: durationpb.New(time.Minute)})
	if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("gRPC Begin: %v %v", res, err)
	}
	var calls atomic.Int32
	never := func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
		calls.Add(1)
		return &statemachine.Response{Body: []byte("must not run")}, nil
	}
	if _, _, err := db.store.RunTx(ctx, id, ledger.TxOptions{Fingerprint: fp, Wait: 20 * time.Millisecond}, never); !errors.Is(err, ledger.ErrInProgress) {
		t.Fatalf("RunTx on a key held over gRPC: %v", err)
	}
	grpcResp := &idempotencyv1.StoredResponse{SchemaVersion: "v/1", ContentType: "text/plain", StatusCode: 200,
		Body: []byte("made over gRPC \x00\xfe"), Metadata: map[string]string{"a": "b"}}
	if _, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: id.Scope, Key: id.Key, LeaseToken: res.GetLeaseToken(), Response: grpcResp}); err != nil {
		t.Fatal(err)
	}
	got, replayed, err := db.store.RunTx(ctx, id, ledger.TxOptions{Fingerprint: fp}, never)
	if err != nil || !replayed || calls.Load() != 0 || !got.Equal(&statemachine.Response{SchemaVersion: grpcResp.GetSchemaVersion(),
		ContentType: grpcResp.GetContentType(), StatusCode: grpcResp.GetStatusCode(), Body: grpcResp.GetBody(), Metadata: grpcResp.GetMetadata()}) {
		t.Fatalf("RunTx on a gRPC-completed key: %+v %v %v, %d calls", got, replayed, err, calls.Load())
	}

	// A gRPC Begin that arrives while RunTx runs fn waits for its commit
	// and replays it.
	id.Key = "concurrent"
	release, running := make(chan struct{}), make(chan struct{})
	runDone := make(chan error, 1)
	go func() {
		_, _, err := db.store.RunTx(ctx, id, ledger.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
			close(running)
			<-release
			return &statemachine.Response{Body: []byte("made in the transaction")}, nil
		})
		runDone <- err
	}()
	<-running
	beginDone := make(chan *idempotencyv1.BeginResponse, 1)
	go func() {
		res, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: id.Scope, Key: id.Key, Wait: durationpb.New(20 * time.Second)})
		if err != nil {
			t.Error(err)
		}
		beginDone <- res
	}()
	waitForLockWaiters(t, db, 1)
	close(release)
	if err := <-runDone; err != nil {
		t.Fatal(err)
	}
	if res := <-beginDone; res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || string(res.GetRecord().GetResponse().GetBody()) != "made in the transaction" {
		t.Fatalf("gRPC Begin during RunTx: %v", res)
	}
}

// BenchmarkRunTx measures RunTx on a new key (fn writes one row) and on a
// completed key (a replay): go test -run '^$' -bench RunTx ./ledger
func BenchmarkRunTx(b *testing.B) {
	url := pgtest.NewDatabase(b)
	s, err := ledger.Open(context.Background(), url)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(s.Close)
	if _, _, err := s.RunTx(context.Background(), ledger.Identity{Scope: "setup", Key: "table"}, ledger.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
			_, err := tx.Exec(ctx, chargesTable)
			return nil, err
		}); err != nil {
		b.Fatal(err)
	}
	fn := func(key string) func(context.Context, pgx.Tx) (*statemachine.Response, error) {
		return func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
			_, err := tx.Exec(ctx, `INSERT INTO charges (key, amount, token) VALUES ($1, 1, '')`, key)
			return &statemachine.Response{StatusCode: 201, Body: make([]byte, 100)}, err
		}
	}
	b.Run("new key", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			key := fmt.Sprintf("new-%d", i)
			if _, _, err := s.RunTx(context.Background(), ledger.Identity{Scope: "bench", Key: key}, ledger.TxOptions{}, fn(key)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("replay", func(b *testing.B) {
		id := ledger.Identity{Scope: "bench", Key: "replayed"}
		if _, _, err := s.RunTx(context.Background(), id, ledger.TxOptions{}, fn(id.Key)); err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if _, replayed, err := s.RunTx(context.Background(), id, ledger.TxOptions{}, fn(id.Key)); err != nil || !replayed {
				b.Fatal(replayed, err)
			}
		}
	})
}
