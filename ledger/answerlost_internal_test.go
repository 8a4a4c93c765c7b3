package ledger

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// answerLosingProxy forwards connections to PostgreSQL. Once armed with
// markers, the first connection that sends messages holding them, in
// order, has the message with the last one forwarded and every later byte
// of PostgreSQL's answer held back, until cut closes that connection: the
// statement runs and commits, and its answer is lost, as when a network
// fails at that moment.
type answerLosingProxy struct {
	target string
	ln     net.Listener

	mu      sync.Mutex
	markers [][]byte
	seen    map[net.Conn]int // markers each connection has sent so far
	victim  []net.Conn       // the marked connection's two sides
	sent    chan struct{}    // closed once the marked message is forwarded
	gate    chan struct{}    // when not nil, the marked message waits for it to close
}

// newAnswerLosingProxy starts a proxy to the database of dbURL and returns
// it with the URL of that database through it.
func newAnswerLosingProxy(t *testing.T, dbURL string) (*answerLosingProxy, string) {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &answerLosingProxy{target: u.Host, ln: ln}
	u.Host = ln.Addr().String()
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.serve(c)
		}
	}()
	return p, u.String()
}

// arm makes the first connection to send messages holding markers, in
// order, lose the answer of the last; the channel it returns is closed
// once that message is forwarded.
func (p *answerLosingProxy) arm(markers ...string) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.markers, p.seen = nil, map[net.Conn]int{}
	for _, m := range markers {
		p.markers = append(p.markers, []byte(m))
	}
	p.sent, p.gate = make(chan struct{}), nil
	return p.sent
}

// armHeld is arm, except that the marked message is not forwarded before
// release is called: a statement the caller sends meanwhile runs only
// after what the test does before release.
func (p *answerLosingProxy) armHeld(markers ...string) (sent <-chan struct{}, release func()) {
	sent = p.arm(markers...)
	p.mu.Lock()
	defer p.mu.Unlock()
	gate := make(chan struct{})
	p.gate = gate
	return sent, sync.OnceFunc(func() { close(gate) })
}

// waitSent waits for the marked message to be forwarded (sent), for at
// most a minute, and fails the test if it is not: when answered closes or
// yields first, the call whose statement was to be marked ended without
// sending it.
func waitSent[T any](t *testing.T, sent <-chan struct{}, answered <-chan T, what string) {
	t.Helper()
	select {
	case <-sent:
	case a := <-answered:
		t.Fatalf("%s ended (%+v) before it sent the statement whose answer the test loses", what, a)
	case <-time.After(time.Minute):
		t.Fatalf("%s sent no statement with the marked text within a minute", what)
	}
}

// cut closes the connection whose answer is held back.
func (p *answerLosingProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.victim {
		_ = c.Close()
	}
}

func (p *answerLosingProxy) serve(client net.Conn) {
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	var held sync.Once
	hold := make(chan struct{})
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := server.Read(buf)
			if err != nil {
				_ = client.Close()
				return
			}
			select {
			case <-hold:
				continue // the answer is lost
			default:
			}
			if _, err := client.Write(buf[:n]); err != nil {
				_ = server.Close()
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := client.Read(buf)
		if err != nil {
			_ = server.Close()
			return
		}
		p.mu.Lock()
		var sent, gate chan struct{}
		if i := p.seen[client]; i < len(p.markers) && bytes.Contains(buf[:n], p.markers[i]) {
			p.seen[client] = i + 1
			if i+1 == len(p.markers) {
				p.markers, sent, gate = nil, p.sent, p.gate
				p.victim = []net.Conn{client, server}
				held.Do(func() { close(hold) })
			}
		}
		p.mu.Unlock()
		if gate != nil {
			<-gate
		}
		if _, err := server.Write(buf[:n]); err != nil {
			_ = client.Close()
			return
		}
		if sent != nil {
			close(sent)
		}
	}
}

// TestBatchAnswerLostTellsCallersUnavailable: a batch statement that
// commits but whose answer is lost (the connection cut after PostgreSQL
// ran it) tells each caller ErrUnavailable instead of running it again on
// its own. Run again, a Begin whose record an operator's Forget deleted in
// between created it a second time, undoing the Forget (one Begin taking
// effect twice; TestLinearizableReference found it now and then). The
// callers that retry with their own token find their acquisition, and a
// Complete's retry its completion.
func TestBatchAnswerLostTellsCallersUnavailable(t *testing.T) {
	t.Parallel()
	p, s, direct, _ := lostAnswerStores(t)
	ctx := context.Background()

	ev := statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	begins := func(keys ...string) []*beginReq {
		var batch []*beginReq
		for _, k := range keys {
			e := ev
			e.NewToken = newToken()
			id := Identity{Tenant: "t", Scope: "s", Key: k}
			batch = append(batch, &beginReq{ctx: ctx, p: &BeginParams{ID: id, Event: e}, ev: e, out: make(chan beginRes, 1)})
		}
		return batch
	}

	t.Run("Begin", func(t *testing.T) {
		skipWithoutBatching(t, s)
		batch := begins("lost-answer-a", "lost-answer-b")
		sent := p.arm("lost-answer-")
		done := make(chan struct{})
		go func() { s.runBeginBatch(ctx, batch); close(done) }()
		waitSent(t, sent, done, "the batch of Begins")
		waitForRecord(t, direct, batch[0].p.ID, "the batch's record", anyRecord)
		// An operator forgets a while the batch's answer is on its way.
		if _, err := direct.Forget(ctx, &ForgetParams{ID: batch[0].p.ID}); err != nil {
			t.Fatal(err)
		}
		p.cut()
		<-done
		for _, r := range batch {
			if out := <-r.out; !errors.Is(out.err, ErrUnavailable) {
				t.Fatalf("%s, its batch's answer lost: %+v, want ErrUnavailable (not sent to run again, which re-creates a forgotten record)", r.p.ID.Key, out)
			}
		}
		if _, _, err := direct.Lookup(ctx, batch[0].p.ID); !errors.Is(err, statemachine.ErrNotFound) {
			t.Fatalf("the forgotten record after the batch's callers were answered: %v, want not found", err)
		}
		// b's caller retries with its token: the acquisition is its own.
		b := batch[1]
		res, err := s.begin(ctx, b.p, &b.ev)
		if err != nil || res.Outcome != statemachine.OutcomeAcquired || res.Record.LeaseToken != b.ev.NewToken {
			t.Fatalf("b's retry with its token: %+v %v, want its own acquisition", res, err)
		}
	})

	t.Run("Complete", func(t *testing.T) {
		skipWithoutBatching(t, s)
		var batch []*completeReq
		for _, r := range begins("lost-completion-a", "lost-completion-b") {
			res, err := s.begin(ctx, r.p, &r.ev)
			if err != nil || res.Outcome != statemachine.OutcomeAcquired {
				t.Fatalf("Begin %s: %+v %v", r.p.ID.Key, res, err)
			}
			fin := statemachine.Event{Kind: statemachine.EventComplete, Token: r.ev.NewToken,
				Response: &statemachine.Response{StatusCode: 200, Body: []byte("done")}}
			stored, err := s.responseArgs(r.p.ID, fin.Response, nil)
			if err != nil {
				t.Fatal(err)
			}
			batch = append(batch, &completeReq{ctx: ctx, id: r.p.ID, ev: fin, response: stored, out: make(chan completeRes, 1)})
		}
		sent := p.arm("lost-completion-")
		done := make(chan struct{})
		go func() { s.runCompleteBatch(ctx, batch); close(done) }()
		waitSent(t, sent, done, "the batch of Completes")
		waitForRecord(t, direct, batch[1].id, "the batch's completion", completed)
		p.cut()
		<-done
		for _, r := range batch {
			if out := <-r.out; !errors.Is(out.err, ErrUnavailable) {
				t.Fatalf("%s, its batch's answer lost: %+v, want ErrUnavailable", r.id.Key, out)
			}
		}
		// The retry of a Complete is a repeat of its completion.
		r := batch[0]
		res, err := s.Finish(ctx, &FinishParams{ID: r.id, Event: r.ev})
		if err != nil || res.Record.State != statemachine.StateCompleted {
			t.Fatalf("%s: the retried Complete: %+v %v, want COMPLETED", r.id.Key, res, err)
		}
	})
}

// TestMayHaveCommitted: a statement's failure may hide a commit when its
// connection broke after it was sent or the server ended the session; not
// when PostgreSQL refused it, nor when it never left.
func TestMayHaveCommitted(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		may  bool
	}{
		{"connection broken while reading the answer", &net.OpError{Op: "read", Net: "tcp", Err: io.ErrUnexpectedEOF}, true},
		{"answer cut short", io.ErrUnexpectedEOF, true},
		{"backend terminated (FATAL)", &pgconn.PgError{Severity: "FATAL", Code: "57P01"}, true},
		{"refused by PostgreSQL (lock timeout)", &pgconn.PgError{Severity: "ERROR", Code: lockTimeoutCode}, false},
		{"refused by PostgreSQL (serialization)", &pgconn.PgError{Severity: "ERROR", Code: "40001"}, false},
		{"could not connect", &pgconn.ConnectError{}, false},
		{"never sent", neverSentError{}, false},
		{"connection closed while the answer was awaited", closedConnError{}, true},
		// What a Citus coordinator node answered when a worker was killed
		// during a Begin's commit there (TestCitusWorkerKill met it).
		{"a Citus worker failed during the commit", &pgconn.PgError{Severity: "ERROR", Code: "XX000",
			Message: "could not commit transaction for shard 102010 on at least one active node", Routine: citusPostCommitFailure}, true},
		// What a Citus worker answered, through a connection made to it
		// directly, when its postmaster was killed while the statement
		// waited on another node (TestCitusWorkerKillSpread met it).
		{"a Citus node's postmaster died under the statement", &pgconn.PgError{Severity: "ERROR", Code: "XX000",
			Message: citusPostmasterGone, Routine: "ProcessWaitEvents"}, true},
		// What a Citus coordinator node answered when its cached connection
		// to a worker had been terminated (TestCitusNotifyOverflowOnWorker
		// met it in a CI rehearsal).
		{"a Citus node's connection to a worker failed", &pgconn.PgError{Severity: "ERROR", Code: "XX000",
			Message: citusEssentialConnFailed + ": 127.0.0.1:42683", Routine: "MarkRemoteTransactionFailed"}, true},
		{"another internal error", &pgconn.PgError{Severity: "ERROR", Code: "XX000", Routine: "elog_finish"}, false},
	} {
		if got := mayHaveCommitted(c.err); got != c.may {
			t.Errorf("%s: may have committed %v, want %v", c.name, got, c.may)
		}
		// classify marks the lost answers among its ErrUnavailable.
		if got := answerLost(classify(c.err)); got != c.may {
			t.Errorf("%s classified: %v, answer lost %v, want %v", c.name, classify(c.err), got, c.may)
		}
		if c.may && !errors.Is(classify(c.err), ErrUnavailable) {
			t.Errorf("%s classified: %v, want ErrUnavailable", c.name, classify(c.err))
		}
	}
}

// neverSentError is an error pgconn reports as failing before anything was
// sent (pgconn.SafeToRetry).
type neverSentError struct{}

func (neverSentError) Error() string     { return "failed before sending" }
func (neverSentError) SafeToRetry() bool { return true }

// closedConnError is pgconn's "conn closed", which it calls safe to retry even
// when the connection broke while an answer was awaited.
type closedConnError struct{}

func (closedConnError) Error() string     { return "conn closed" }
func (closedConnError) SafeToRetry() bool { return true }
func (closedConnError) Unwrap() error     { return pgconn.ErrConnClosed }

// TestWaitingBeginLostAnswerThenForgotten: a waiting Begin's re-read
// creates the key (its holder's record was forgotten) and its answer is
// lost; an operator then forgets the new record too. The waiter must not
// create the key again with the same token (one call taking effect twice,
// as TestLinearizableReference saw): after the lost answer its re-reads
// write nothing, and finding no acquisition of its own it answers
// ErrUnavailable, the lost answer's. Before, it waited on and, woken by
// another caller's Begin and Forget of the key, created it a second time.
func TestWaitingBeginLostAnswerThenForgotten(t *testing.T) {
	t.Parallel()
	p, s, direct, conn := lostAnswerStores(t)
	if s.sql.begin(newRecord{}, "", nil, time.Second).local != "" {
		t.Skip("the Begin's statement runs in a transaction here: an answer lost before its COMMIT commits nothing")
	}
	ctx := context.Background()

	id := Identity{Tenant: "t", Scope: "s", Key: "waited-lost-answer"}
	ev := statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	if res, err := direct.Begin(ctx, &BeginParams{ID: id, Event: ev}); err != nil || res.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("holder: %+v %v", res, err)
	}
	type answer struct {
		res *Result
		err error
	}
	waiter := make(chan answer, 1)
	go func() {
		// A wait far longer than the test's steps under any load: it
		// must not run out before the holder is forgotten.
		res, err := s.BeginWait(ctx, &BeginParams{ID: id, Event: ev}, 5*time.Minute)
		waiter <- answer{res, err}
	}()
	waitWatched(t, conn, id)
	// The waiter's next statement waits in the proxy until the holder's
	// record is forgotten, so it creates the key, whatever woke the
	// waiter (the Forget's notification, or a poll while the listener
	// lags under load); that statement's answer is held back.
	sent, release := p.armHeld(id.Key)
	defer release()
	if _, err := direct.Forget(ctx, &ForgetParams{ID: id}); err != nil {
		t.Fatal(err)
	}
	release()
	waitSent(t, sent, waiter, "the waiting Begin")
	created := waitForRecord(t, direct, id, "the waiter's record", anyRecord)
	if _, err := direct.Forget(ctx, &ForgetParams{ID: id}); err != nil {
		t.Fatal(err)
	}
	p.cut()
	// Other callers come and go on the key, and wake the waiter.
	for {
		select {
		case a := <-waiter:
			if !errors.Is(a.err, ErrUnavailable) {
				t.Fatalf("the waiter after its lost answer and the Forget: %+v %v, want ErrUnavailable", a.res, a.err)
			}
			if rec, _, err := direct.Lookup(ctx, id); err == nil && rec.LeaseToken == created.LeaseToken {
				t.Fatalf("the forgotten acquisition %s was created again", created.LeaseToken)
			}
			return
		case <-time.After(100 * time.Millisecond):
			comeAndGo(t, direct, id)
		}
	}
}

// TestWaitingRunTxLostCommitThenForgotten: a waiting RunTx takes the key
// over, runs fn, and its commit's answer is lost; an operator then forgets
// the record. The RunTx must not run fn again (its next tries write
// nothing, and finding no result of its own it answers ErrUnavailable).
// Before, woken by another caller's Begin and Forget of the key, it ran fn
// a second time: two charges for one call.
func TestWaitingRunTxLostCommitThenForgotten(t *testing.T) {
	t.Parallel()
	p, s, direct, conn := lostAnswerStores(t)
	ctx := context.Background()
	if _, err := conn.Exec(ctx, `CREATE TABLE charges (key text)`); err != nil {
		t.Fatal(err)
	}

	id := Identity{Tenant: DefaultTenant, Scope: "charge", Key: "runtx-lost-ack"}
	ev := statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	holder, err := direct.Begin(ctx, &BeginParams{ID: id, Event: ev})
	if err != nil || holder.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("holder: %+v %v", holder, err)
	}
	type answer struct {
		replayed bool
		err      error
	}
	var runs atomic.Int32
	ran := make(chan answer, 1)
	go func() {
		_, replayed, err := s.RunTx(ctx, id, TxOptions{Wait: 5 * time.Minute}, func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error) {
			runs.Add(1)
			_, err := tx.Exec(ctx, `INSERT INTO charges VALUES ($1)`, id.Key)
			return &statemachine.Response{StatusCode: 200}, err
		})
		ran <- answer{replayed, err}
	}()
	waitWatched(t, conn, id)
	// The RunTx takes the key over, runs fn and commits; the commit's
	// answer is held back.
	sent := p.arm(id.Key, "commit\x00") // the COMMIT, a simple query
	if _, err := direct.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: holder.Record.LeaseToken, FailureKind: statemachine.FailureRetryable}}); err != nil {
		t.Fatal(err)
	}
	waitSent(t, sent, ran, "the waiting RunTx")
	waitForRecord(t, direct, id, "the RunTx's commit", completed)
	if _, err := direct.Forget(ctx, &ForgetParams{ID: id}); err != nil {
		t.Fatal(err)
	}
	p.cut()
	for {
		select {
		case a := <-ran:
			var charges int
			if err := conn.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&charges); err != nil {
				t.Fatal(err)
			}
			if runs.Load() != 1 || charges != 1 {
				t.Fatalf("fn ran %d times, %d charges (answer: replayed %v, %v); want once", runs.Load(), charges, a.replayed, a.err)
			}
			if !errors.Is(a.err, ErrUnavailable) {
				t.Fatalf("the RunTx after its lost commit and the Forget: replayed %v, %v; want ErrUnavailable", a.replayed, a.err)
			}
			return
		case <-time.After(100 * time.Millisecond):
			comeAndGo(t, direct, id)
		}
	}
}

// lostAnswerStores opens two stores on a fresh database, one through an
// answerLosingProxy (returned too) and one direct, and a plain connection
// to the database; all end with t.
func lostAnswerStores(t *testing.T) (p *answerLosingProxy, proxied, direct *Store, conn *pgx.Conn) {
	t.Helper()
	dbURL := pgtest.NewDatabase(t)
	p, through := newAnswerLosingProxy(t, dbURL)
	ctx := context.Background()
	var err error
	if proxied, err = Open(ctx, through, WithReplayCache(0)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxied.Close)
	if direct, err = Open(ctx, dbURL, WithReplayCache(0)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(direct.Close)
	if conn, err = pgx.Connect(ctx, dbURL); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(ctx) })
	return p, proxied, direct, conn
}

// waitWatched waits until a waiting call has marked the record id watched
// (see Store.Watch): it is then waiting.
func waitWatched(t *testing.T, conn *pgx.Conn, id Identity) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var watched bool
		if err := conn.QueryRow(context.Background(), `SELECT watched FROM idempotency_records WHERE key = $1`, id.Key).Scan(&watched); err != nil {
			t.Fatal(err)
		}
		if watched {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no call ever waited on %s", id.Key)
		}
	}
}

// comeAndGo is another caller's Begin of id and an operator's Forget of
// it: changes that wake the calls waiting on id.
func comeAndGo(t *testing.T, direct *Store, id Identity) {
	t.Helper()
	ev := statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	if _, err := direct.Begin(context.Background(), &BeginParams{ID: id, Event: ev}); err != nil {
		t.Fatal(err)
	}
	if _, err := direct.Forget(context.Background(), &ForgetParams{ID: id}); err != nil {
		t.Fatal(err)
	}
}

// waitForRecord waits until the record id, read through direct, is there
// and want says it is what the test waits for (what), and returns it.
func waitForRecord(t *testing.T, direct *Store, id Identity, what string, want func(statemachine.Record) bool) statemachine.Record {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		rec, _, err := direct.Lookup(context.Background(), id)
		if err != nil && !errors.Is(err, statemachine.ErrNotFound) {
			t.Fatalf("%s (%s): %v", what, id.Key, err)
		}
		if err == nil && want(rec) {
			return rec
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s (%s) never showed: %+v %v", what, id.Key, rec, err)
		}
	}
}

// anyRecord and completed are what waitForRecord waits for: the record
// there, and there COMPLETED.
func anyRecord(statemachine.Record) bool     { return true }
func completed(rec statemachine.Record) bool { return rec.State == statemachine.StateCompleted }

// TestWaitingRunTxLostAnswerBeforeCommit: a waiting RunTx's try loses the
// answer of a statement inside its transaction (the connection cut), which
// cannot have committed anything: the RunTx waits on and, when the holder
// completes, replays its result. Before, the try counted as a lost commit
// (as on FATAL 57P01 when the database stops mid-try), and the next try
// that found the key still held ended the wait with ErrUnavailable
// (TestRunTxWaiterOutlastsAnOutage failed so now and then).
func TestWaitingRunTxLostAnswerBeforeCommit(t *testing.T) {
	t.Parallel()
	p, s, direct, conn := lostAnswerStores(t)
	ctx := context.Background()

	id := Identity{Tenant: DefaultTenant, Scope: "charge", Key: "runtx-lost-before-commit"}
	ev := statemachine.Event{Kind: statemachine.EventBegin, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}
	holder, err := direct.Begin(ctx, &BeginParams{ID: id, Event: ev})
	if err != nil || holder.Outcome != statemachine.OutcomeAcquired {
		t.Fatalf("holder: %+v %v", holder, err)
	}
	type answer struct {
		resp     *statemachine.Response
		replayed bool
		err      error
	}
	var runs atomic.Int32
	ran := make(chan answer, 1)
	go func() {
		resp, replayed, err := s.RunTx(ctx, id, TxOptions{Wait: 5 * time.Minute}, func(context.Context, pgx.Tx) (*statemachine.Response, error) {
			runs.Add(1)
			return &statemachine.Response{StatusCode: 200}, nil
		})
		ran <- answer{resp, replayed, err}
	}()
	waitWatched(t, conn, id)
	// A change that leaves the key held wakes the RunTx, whose next try
	// reads it in a transaction.
	const nudgeSQL = `UPDATE idempotency_records
		SET expires_at = (coalesce(expires_at, $2) AT TIME ZONE 'UTC' + interval '1 day') AT TIME ZONE 'UTC'
		WHERE key = $1`
	nudge := func() {
		t.Helper()
		if _, err := conn.Exec(ctx, nudgeSQL, id.Key, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	sent := p.arm(id.Key) // the try's first statement naming the key, inside its transaction
	// The nudge runs beside the test: a try that a poll started before the
	// arm sends the key first in its SELECT ... FOR UPDATE, whose answer is
	// then the one lost, and the nudge waits for that row lock until the
	// cut ends the try's session (the test hung so in CI when it waited
	// for the nudge before cutting).
	nudged := make(chan error, 1)
	go func() {
		_, err := conn.Exec(ctx, nudgeSQL, id.Key, time.Now())
		nudged <- err
	}()
	waitSent(t, sent, ran, "the waiting RunTx")
	p.cut()
	select {
	case err := <-nudged:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the nudge still waits a minute after the try's connection was cut")
	}
	// The next try finds the key still held: the RunTx waits on.
	nudge()
	select {
	case a := <-ran:
		t.Fatalf("the RunTx, after a try lost an answer before its commit, with the key still held: replayed %v, %v; want it to wait on", a.replayed, a.err)
	case <-time.After(3 * time.Second):
	}
	if _, err := direct.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventComplete,
		Token: holder.Record.LeaseToken, Response: &statemachine.Response{Body: []byte("done")}}}); err != nil {
		t.Fatal(err)
	}
	select {
	case a := <-ran:
		if a.err != nil || !a.replayed || a.resp == nil || string(a.resp.Body) != "done" || runs.Load() != 0 {
			t.Fatalf("the RunTx: %v, replayed %v, %v, fn ran %d times; want the holder's result replayed", a.resp, a.replayed, a.err, runs.Load())
		}
	case <-time.After(time.Minute):
		t.Fatal("the RunTx did not answer within a minute of the holder's completion")
	}
}
