package ledger

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// roundFixture opens a batching store on a fresh database and returns it
// with a direct connection to that database.
func roundFixture(t *testing.T) (*Store, *pgx.Conn) {
	t.Helper()
	url := pgtest.NewDatabase(t)
	s, err := Open(context.Background(), url, WithReplayCache(0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	skipWithoutBatching(t, s)
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return s, conn
}

var roundBegin = statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}

// newBeginReq is a queued Begin of key in tenant t, scope s.
func newBeginReq(ctx context.Context, key string) *beginReq {
	e := roundBegin
	e.NewToken = newToken()
	id := Identity{Tenant: "t", Scope: "s", Key: key}
	return &beginReq{ctx: ctx, p: &BeginParams{ID: id, Event: e}, ev: e, out: make(chan beginRes, 1)}
}

// heldCompleteReq acquires key on its own and returns a queued Complete of
// it by its holder.
func heldCompleteReq(t *testing.T, s *Store, key string) *completeReq {
	t.Helper()
	ctx := context.Background()
	b := newBeginReq(ctx, key)
	res, err := s.begin(ctx, b.p, &b.ev)
	if err != nil || res.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("Begin %s: %+v %v", key, res, err)
	}
	fin := statemachine.Event{Kind: statemachine.EventComplete, Token: b.ev.NewToken,
		Response: &statemachine.Response{StatusCode: 200, Body: []byte("done " + key)}}
	stored, err := s.responseArgs(b.p.ID, fin.Response, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &completeReq{ctx: ctx, id: b.p.ID, ev: fin, response: stored, out: make(chan completeRes, 1)}
}

// xmins returns the transaction that last wrote each of keys' records.
func xmins(t *testing.T, conn *pgx.Conn, keys ...string) map[string]string {
	t.Helper()
	rows, err := conn.Query(context.Background(), `SELECT key, xmin::text FROM idempotency_records WHERE tenant = 't' AND scope = 's' AND key = ANY($1)`, keys)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for rows.Next() {
		var k, x string
		if err := rows.Scan(&k, &x); err != nil {
			t.Fatal(err)
		}
		out[k] = x
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestRoundWritesBeginsAndCompletesInOneTransaction: a round that holds
// Begins and Completes writes them all in one transaction (one commit, one
// WAL flush), and answers each caller with its own result.
func TestRoundWritesBeginsAndCompletesInOneTransaction(t *testing.T) {
	t.Parallel()
	s, conn := roundFixture(t)
	ctx := context.Background()
	var round []writeReq
	var completes []*completeReq
	for i := range 3 {
		c := heldCompleteReq(t, s, fmt.Sprintf("held-%d", i))
		completes = append(completes, c)
		round = append(round, c)
	}
	var begins []*beginReq
	for i := range 4 {
		b := newBeginReq(ctx, fmt.Sprintf("new-%d", i))
		begins = append(begins, b)
		round = append(round, b)
	}
	s.runRound(ctx, round)
	keys := []string{}
	for _, c := range completes {
		out := <-c.out
		if out.err != nil || out.res == nil || out.res.Record.State != statemachine.StateCompleted ||
			string(out.res.Record.Response.Body) != "done "+c.id.Key {
			t.Fatalf("Complete of %s in the round: %+v, want its completion", c.id.Key, out)
		}
		keys = append(keys, c.id.Key)
	}
	for _, b := range begins {
		out := <-b.out
		if out.err != nil || !out.inserted || out.rec.LeaseToken != b.ev.NewToken {
			t.Fatalf("Begin of %s in the round: %+v, want its own acquisition", b.p.ID.Key, out)
		}
		keys = append(keys, b.p.ID.Key)
	}
	xs := xmins(t, conn, keys...)
	if len(xs) != len(keys) {
		t.Fatalf("records of the round: %v, want %d", xs, len(keys))
	}
	for k, x := range xs {
		if x != xs[keys[0]] {
			t.Fatalf("the round's records were written by different transactions: %v (%s differs)", xs, k)
		}
	}
}

// TestRoundRefusedRunsEveryCallerOnItsOwn: when PostgreSQL refuses the
// Begins' statement of a round, the Completes written before it in the
// same transaction are rolled back with it, and every caller of the round
// is sent to run on its own, where each gets its own answer.
func TestRoundRefusedRunsEveryCallerOnItsOwn(t *testing.T) {
	t.Parallel()
	s, _ := roundFixture(t)
	ctx := context.Background()
	c := heldCompleteReq(t, s, "held")
	// A key longer than the index can hold (past the Store's own check)
	// makes the Begins' statement fail for all.
	huge := newBeginReq(ctx, randomKey(4000))
	fine := newBeginReq(ctx, "fine")
	s.runRound(ctx, []writeReq{huge, c, fine})
	if out := <-c.out; out.err != nil || out.res != nil {
		t.Fatalf("the Complete of a refused round: %+v, want to run on its own", out)
	}
	for _, b := range []*beginReq{huge, fine} {
		if out := <-b.out; out.err != nil || out.found {
			t.Fatalf("a Begin of a refused round: %+v, want to run on its own", out)
		}
	}
	if rec, _, err := s.Lookup(ctx, c.id); err != nil || rec.State != statemachine.StateInProgress {
		t.Fatalf("the record the refused round was to complete: %+v %v, want still IN_PROGRESS", rec, err)
	}
	// On its own, the Complete completes.
	res, err := s.Finish(ctx, &FinishParams{ID: c.id, Event: c.ev})
	if err != nil || res.Record.State != statemachine.StateCompleted {
		t.Fatalf("the Complete run on its own: %+v %v", res, err)
	}
}

// TestRoundAnswerLostTellsEveryCallerUnavailable: a round whose answer is
// lost may have committed, so neither its Begins nor its Completes run
// again on their own; each caller is told ErrUnavailable.
func TestRoundAnswerLostTellsEveryCallerUnavailable(t *testing.T) {
	t.Parallel()
	p, s, direct, _ := lostAnswerStores(t)
	skipWithoutBatching(t, s)
	ctx := context.Background()
	c := heldCompleteReq(t, s, "round-lost-held")
	b := newBeginReq(ctx, "round-lost-new")
	sent := p.arm("round-lost-new")
	done := make(chan struct{})
	go func() { s.runRound(ctx, []writeReq{c, b}); close(done) }()
	waitSent(t, sent, done, "the round")
	waitForRecord(t, direct, b.p.ID, "the round's new record", anyRecord)
	p.cut()
	<-done
	if out := <-c.out; !errors.Is(out.err, ErrUnavailable) {
		t.Fatalf("the Complete of a round whose answer was lost: %+v, want ErrUnavailable", out)
	}
	if out := <-b.out; !errors.Is(out.err, ErrUnavailable) {
		t.Fatalf("the Begin of a round whose answer was lost: %+v, want ErrUnavailable", out)
	}
	if rec := waitForRecord(t, direct, c.id, "the completion", completed); rec.State != statemachine.StateCompleted {
		t.Fatalf("the round committed, but its completion reads %v", rec.State)
	}
}

// TestCrossedRoundsDoNotWaitOnEachOther: two rounds at once, each
// completing the key the other begins (a repeated Begin of a key whose
// holder is completing it, through another replica). Were the Completes
// written first, each round would hold its completed row and wait, in its
// Begins, for the other's: both would be refused after the lock wait and
// every caller sent to run alone. The Begins go first, so both rounds
// commit. Another transaction holds both rows (FOR UPDATE) until both
// rounds wait, so that they run at once.
func TestCrossedRoundsDoNotWaitOnEachOther(t *testing.T) {
	t.Parallel()
	s, conn := roundFixture(t)
	ctx := context.Background()
	other, err := Open(ctx, conn.Config().ConnString(), WithReplayCache(0))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	c1, c2 := heldCompleteReq(t, s, "crossed-1"), heldCompleteReq(t, other, "crossed-2")
	b2, b1 := newBeginReq(ctx, "crossed-2"), newBeginReq(ctx, "crossed-1")

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM idempotency_records WHERE key IN ('crossed-1', 'crossed-2') FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{}, 2)
	go func() { s.runRound(ctx, []writeReq{c1, b2}); done <- struct{}{} }()
	go func() { other.runRound(ctx, []writeReq{c2, b1}); done <- struct{}{} }()
	// Both rounds wait on the held rows, then the rows are released.
	waitLocked, err := pgx.Connect(ctx, conn.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = waitLocked.Close(ctx) }()
	deadline := time.Now().Add(time.Minute)
	for {
		var n int
		if err := waitLocked.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of the two rounds wait on the held rows after a minute", n)
		}
		time.Sleep(2 * time.Millisecond)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	<-done
	<-done
	for _, c := range []*completeReq{c1, c2} {
		if out := <-c.out; out.err != nil || out.res == nil || out.res.Record.State != statemachine.StateCompleted {
			t.Errorf("the Complete of %s in its round: %+v, want its completion from the round (not sent to run alone)", c.id.Key, out)
		}
	}
	for _, b := range []*beginReq{b1, b2} {
		if out := <-b.out; out.err != nil || !out.found {
			t.Errorf("the Begin of %s in its round: %+v, want the record the round read (not sent to run alone)", b.p.ID.Key, out)
		}
	}
}
