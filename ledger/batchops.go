package ledger

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/statemachine"
)

// Batch sizes and worker counts of the coalesced write paths.
const (
	// DefaultBatchWorkers is how many coalesced rounds (each the Begins
	// and Completes queued when it starts, one transaction) run at once
	// by default; see WithBatchWorkers.
	DefaultBatchWorkers = 1
	batchMax            = 64
)

// batchTimeout bounds one batch statement. The statements commit by
// themselves and run apart from their callers' contexts, so a caller that
// gives up never cancels a commit; the bound is commitTimeout's, for the
// same reason.
const batchTimeout = commitTimeout

// batchLockWait bounds how long a batch of Begins waits on another
// transaction's insert or change of one of its keys (a RunTx running fn, a
// locked decision). The waits of a healthy coordinator last one commit;
// a longer one fails the statement, which writes nothing, and every caller
// of the batch runs on its own (see beginRead), where only a Begin of the
// held key waits, within its caller's deadline. So a held key never delays
// the Begins of other keys and tenants that shared its batch by more than
// this, nor holds a batch worker longer.
const batchLockWait = 200 * time.Millisecond

// errStoreClosed answers the requests a closing store will not run.
var errStoreClosed = fmt.Errorf("%w: the store is closed", ErrUnavailable)

// compareIdentity is the one global order in which every batch takes its
// row locks: by tenant, scope, then key, bytewise (the SQL statements
// order by the same columns under COLLATE "C", which compares bytes).
// Two batches that lock rows in one order cannot deadlock on each other.
func compareIdentity(a, b Identity) int {
	return cmp.Or(strings.Compare(a.Tenant, b.Tenant), strings.Compare(a.Scope, b.Scope), strings.Compare(a.Key, b.Key))
}

// beginReq is a Begin run in a batch.
type beginReq struct {
	ctx context.Context
	p   *BeginParams
	ev  statemachine.Event
	out chan beginRes
}

// beginRes is what the batch found: the key created with this request's
// token (inserted), or the existing record (found), or neither (the caller
// takes the single-record path). err is this request's own failure, such
// as its record being unreadable.
type beginRes struct {
	rec      statemachine.Record
	now      time.Time
	inserted bool
	found    bool
	err      error
}

// liveBatch drops the requests whose caller has gone (answering them with
// their context's error) and sorts the rest into the global lock order.
func liveBatch[T any](batch []T, ctxOf func(T) context.Context, idOf func(T) Identity, answer func(T, error)) []T {
	live := make([]T, 0, len(batch))
	for _, r := range batch {
		if err := ctxOf(r).Err(); err != nil {
			answer(r, err)
			continue
		}
		live = append(live, r)
	}
	slices.SortStableFunc(live, func(a, b T) int { return compareIdentity(idOf(a), idOf(b)) })
	return live
}

// batchFailed answers for a batch statement that failed as a whole: it
// returns the error to tell each caller, or nil to run each caller again
// on its own (retry), where it gets its own answer.
//
// Callers run again only when the statement certainly wrote nothing:
// PostgreSQL refused it, or it was never sent. A statement whose answer
// was lost (its connection broke after it was sent, the server ended the
// session, or its rows could not be read) may have committed
// (mayHaveCommitted), and running its callers again could repeat a write
// that was undone in between: a Begin would create again a record an
// operator's Forget had just deleted, one Begin taking effect twice
// (TestLinearizableReference found it). Its callers are told
// ErrUnavailable, as the caller of a single statement would be; a retry
// of the same attempt (attempt_id, or in process the same token) finds
// its own acquisition (see Store.Begin), and a Complete's its completion.
// When the store is closing, every caller is told ErrUnavailable. A batch
// that met a held key (batchLockWait) is no fault and is not logged as
// one.
func (s *Store) batchFailed(kind string, n int, err error, closing bool) error {
	if closing {
		return errStoreClosed
	}
	if mayHaveCommitted(err) {
		s.logger.Warn("batch statement's answer lost; its callers are told the coordinator is unavailable", "kind", kind, "callers", n, "err", err)
		return answerLostError{fmt.Errorf("%w: the answer of the statement that wrote this call's key was lost, so whether it took effect is unknown: %v",
			ErrUnavailable, err)}
	}
	level := slog.LevelWarn
	if isLockTimeout(err) {
		level = slog.LevelDebug
	}
	s.logger.Log(context.Background(), level, "batch statement failed; running its callers one by one", "kind", kind, "callers", n, "err", err)
	return nil
}

// writeReq is a call queued for a coalesced round: a *beginReq or a
// *completeReq.
type writeReq interface{ queuedWrite() }

func (*beginReq) queuedWrite()    {}
func (*completeReq) queuedWrite() {}

// runRound runs one coalesced round: whatever Begins and Completes were
// queued when it started. When it holds both, they are written in one
// transaction (one WAL flush, one round trip): the Begins' statement, then
// the Completes', pipelined with a single Sync, and every caller is
// answered only after that transaction committed. A round of one kind is
// that kind's batch.
//
// The Begins go first. A Begin of a key waits only for another
// transaction's uncommitted insert or change of that key, and while a
// round runs its Begins it holds no lock but those of the keys it inserts,
// which no Complete can name (a Complete's key exists, with the
// completing caller's token): so two rounds cannot wait on each other
// across kinds, as they could if each completed a key the other was
// beginning; within a kind both take their row locks in the global order
// (compareIdentity). The Begins' statement bounds lock waits for the rest
// of the transaction (batchLockWait), the Completes' included: a round
// that meets a held key is refused within that bound, which rolls back
// both statements, and every caller of the round then runs on its own, as
// a refused batch's callers do.
func (s *Store) runRound(ctx context.Context, batch []writeReq) {
	var begins []*beginReq
	var completes []*completeReq
	for _, r := range batch {
		switch r := r.(type) {
		case *beginReq:
			begins = append(begins, r)
		case *completeReq:
			completes = append(completes, r)
		}
	}
	bs, cs := s.liveBegins(begins), s.liveCompletes(completes)
	switch {
	case len(cs) == 0:
		s.beginBatch(ctx, bs)
	case len(bs) == 0:
		s.completeBatch(ctx, cs)
	default:
		s.mixedBatch(ctx, bs, cs)
	}
}

// runBeginBatch runs one batch of Begins and answers each request.
func (s *Store) runBeginBatch(ctx context.Context, batch []*beginReq) {
	s.beginBatch(ctx, s.liveBegins(batch))
}

// liveBegins answers the requests whose caller has gone, and those of keys
// another transaction was just seen holding (which wait on their own, not
// in a batch), and returns the rest in the global lock order.
func (s *Store) liveBegins(batch []*beginReq) []*beginReq {
	live := liveBatch(batch, func(r *beginReq) context.Context { return r.ctx },
		func(r *beginReq) Identity { return r.p.ID },
		func(r *beginReq, err error) { r.out <- beginRes{err: err} })
	now := time.Now()
	unheld := live[:0]
	for _, r := range live {
		if s.held.held(r.p.ID, now) {
			r.out <- beginRes{}
			continue
		}
		unheld = append(unheld, r)
	}
	return unheld
}

// closing reports whether the store's batch workers are stopping.
func (s *Store) closing() bool { return s.writes != nil && s.writes.Closing() }

// beginBatch writes live (from liveBegins) and answers each request.
func (s *Store) beginBatch(ctx context.Context, live []*beginReq) {
	switch len(live) {
	case 0:
		return
	case 1:
		// Alone: the single-record statement plans faster than unnest.
		r := live[0]
		rec, inserted, now, found, err := s.insertOrRead(ctx, r.p.ID, &r.ev, batchLockWait, nil)
		if isLockTimeout(err) {
			// Its key is held: it waits on its own, not in a worker.
			s.held.mark(r.p.ID, time.Now())
			r.out <- beginRes{}
			return
		}
		if err != nil && s.closing() {
			err = errStoreClosed
		}
		r.out <- beginRes{rec: rec, now: now, inserted: inserted, found: found, err: classify(err)}
		return
	}
	q := s.beginBatchQuery(live)
	rows, err := s.pool.Query(ctx, q.sql, q.args...)
	var found map[Identity]beginRow
	if err == nil {
		found, err = s.scanBeginRows(rows)
	}
	if err != nil {
		answerBegins(live, nil, s.batchFailed("begin", len(live), err, s.closing()))
		return
	}
	answerBegins(live, found, nil)
}

// beginBatchQuery is the batch statement of live's Begins: one row per
// record; a later request of the same record is answered from the same
// row (or, if the row is not its own creation, decides on the
// single-record path).
func (s *Store) beginBatchQuery(live []*beginReq) query {
	recs := make([]newRecord, 0, len(live))
	for i, r := range live {
		if i > 0 && live[i-1].p.ID == r.p.ID {
			continue
		}
		recs = append(recs, newRecordOf(r.p.ID, r.ev))
	}
	return s.sql.beginBatch(recs, s.newRowKeyID(), s.now(), batchLockWait)
}

// beginRow is what a batch of Begins found for one record.
type beginRow struct {
	rec      statemachine.Record
	now      time.Time
	inserted bool
	err      error // the row could not be read
}

// scanBeginRows reads the rows of a batch of Begins and closes them.
func (s *Store) scanBeginRows(rows pgx.Rows) (map[Identity]beginRow, error) {
	found := make(map[Identity]beginRow)
	var err error
	for rows.Next() {
		var id Identity
		var rw beginRow
		dest, fin := s.scanFullTargets(&rw.rec, &id)
		if err = rows.Scan(append(append([]any{&rw.inserted, &id.Tenant, &id.Scope, &id.Key}, dest...), &rw.now)...); err != nil {
			break
		}
		// A row that cannot be decoded fails its own callers only.
		rw.err = fin()
		rw.now = rw.now.UTC()
		found[id] = rw
	}
	rows.Close()
	if err == nil {
		err = rows.Err()
	}
	return found, err
}

// answerBegins answers every request of a batch of Begins: with failed
// when the batch failed as a whole (nil: run on its own), else from the
// rows it found.
func answerBegins(live []*beginReq, found map[Identity]beginRow, failed error) {
	for _, r := range live {
		if failed != nil || found == nil {
			r.out <- beginRes{err: failed}
			continue
		}
		rw, ok := found[r.p.ID]
		switch {
		case !ok:
			r.out <- beginRes{}
		case rw.err != nil:
			r.out <- beginRes{err: rw.err}
		case rw.inserted && rw.rec.LeaseToken != r.ev.NewToken:
			// Another Begin of the same new key in this batch created it.
			r.out <- beginRes{}
		default:
			r.out <- beginRes{rec: rw.rec, now: rw.now, inserted: rw.inserted, found: true}
		}
	}
}

// completeReq is a Complete by the holder of the lease, tried in a batch.
type completeReq struct {
	ctx      context.Context
	id       Identity
	ev       statemachine.Event
	response storedResponse
	out      chan completeRes
}

type completeRes struct {
	res *Result // nil: not held by that token; take the locked path
	err error
}

// runCompleteBatch runs one batch of Completes and answers each request.
func (s *Store) runCompleteBatch(ctx context.Context, batch []*completeReq) {
	s.completeBatch(ctx, s.liveCompletes(batch))
}

// liveCompletes answers the requests whose caller has gone, and every
// request of a record but the first (a batch holds at most one request
// per record; the others decide on the locked path, after this batch
// commits), and returns the rest in the global lock order.
func (s *Store) liveCompletes(batch []*completeReq) []*completeReq {
	sorted := liveBatch(batch, func(r *completeReq) context.Context { return r.ctx },
		func(r *completeReq) Identity { return r.id },
		func(r *completeReq, err error) { r.out <- completeRes{err: err} })
	live := sorted[:0]
	for i, r := range sorted {
		if i > 0 && sorted[i-1].id == r.id {
			r.out <- completeRes{}
			continue
		}
		live = append(live, r)
	}
	return live
}

// completeBatch writes live (from liveCompletes) and answers each request.
func (s *Store) completeBatch(ctx context.Context, live []*completeReq) {
	switch len(live) {
	case 0:
		return
	case 1:
		r := live[0]
		res, err := s.completeHeldOne(ctx, r.id, r.ev.Token, r.response)
		if err != nil && s.closing() {
			err = errStoreClosed
		}
		r.out <- completeRes{res: res, err: classify(err)}
		return
	}
	q := s.completeBatchQuery(live)
	rows, err := s.pool.Query(ctx, q.sql, q.args...)
	var done map[Identity]completeRes
	if err == nil {
		done, err = s.scanCompleteRows(rows)
	}
	if err != nil {
		answerCompletes(live, nil, s.batchFailed("complete", len(live), err, s.closing()))
		return
	}
	answerCompletes(live, done, nil)
}

// completeBatchQuery is the batch statement of live's Completes.
func (s *Store) completeBatchQuery(live []*completeReq) query {
	cs := make([]heldCompletion, len(live))
	for i, r := range live {
		cs[i] = heldCompletion{id: r.id, token: r.ev.Token, response: r.response}
	}
	return s.sql.completeBatch(cs, s.now())
}

// scanCompleteRows reads the rows of a batch of Completes and closes them:
// the answer of each record it completed (or the error of a row written
// but unreadable).
func (s *Store) scanCompleteRows(rows pgx.Rows) (map[Identity]completeRes, error) {
	done := make(map[Identity]completeRes)
	var err error
	for rows.Next() {
		var id Identity
		var rec statemachine.Record
		var now time.Time
		dest, fin := s.scanFullTargets(&rec, &id)
		if err = rows.Scan(append(append([]any{&id.Tenant, &id.Scope, &id.Key}, dest...), &now)...); err != nil {
			break
		}
		if ferr := fin(); ferr != nil {
			done[id] = completeRes{err: ferr}
			continue
		}
		done[id] = completeRes{res: &Result{Decision: statemachine.Decision{Write: statemachine.WriteUpdate, Record: rec, Exists: true}, Now: now.UTC()}}
	}
	rows.Close()
	if err == nil {
		err = rows.Err()
	}
	return done, err
}

// answerCompletes answers every request of a batch of Completes: with
// failed when the batch failed as a whole (nil: take the locked path),
// else from the records it completed (a record it did not complete is not
// held by that token: the locked path decides).
func answerCompletes(live []*completeReq, done map[Identity]completeRes, failed error) {
	for _, r := range live {
		if failed != nil || done == nil {
			r.out <- completeRes{err: failed}
			continue
		}
		r.out <- done[r.id]
	}
}

// mixedBatch writes a round's Begins (bs, from liveBegins) and Completes
// (cs, from liveCompletes) in one transaction and answers each request
// after it committed; see runRound.
func (s *Store) mixedBatch(ctx context.Context, bs []*beginReq, cs []*completeReq) {
	bq, cq := s.beginBatchQuery(bs), s.completeBatchQuery(cs)
	b := &pgx.Batch{}
	b.Queue(bq.sql, bq.args...)
	b.Queue(cq.sql, cq.args...)
	br := s.pool.SendBatch(ctx, b)
	var done map[Identity]completeRes
	var found map[Identity]beginRow
	rows, err := br.Query()
	if err == nil {
		found, err = s.scanBeginRows(rows)
	}
	if err == nil {
		if rows, err = br.Query(); err == nil {
			done, err = s.scanCompleteRows(rows)
		}
	}
	// The transaction commits at the batch's end: nothing is answered
	// from its rows before that.
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		failed := s.batchFailed("begin and complete", len(bs)+len(cs), err, s.closing())
		answerCompletes(cs, nil, failed)
		answerBegins(bs, nil, failed)
		return
	}
	answerCompletes(cs, done, nil)
	answerBegins(bs, found, nil)
}

// rejectWrite answers a queued call the closing store will not run.
func rejectWrite(r writeReq) {
	switch r := r.(type) {
	case *beginReq:
		r.out <- beginRes{err: errStoreClosed}
	case *completeReq:
		r.out <- completeRes{err: errStoreClosed}
	}
}
