package ledger

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/idemcoord/idemcoord/statemachine"
)

// Batch sizes and worker counts of the coalesced write paths.
const (
	// DefaultBatchWorkers is how many batches of Begins, and how many of
	// Completes, run at once by default; see WithBatchWorkers.
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

// runBeginBatch runs one batch of Begins and answers each request.
func (s *Store) runBeginBatch(ctx context.Context, batch []*beginReq) {
	live := liveBatch(batch, func(r *beginReq) context.Context { return r.ctx },
		func(r *beginReq) Identity { return r.p.ID },
		func(r *beginReq, err error) { r.out <- beginRes{err: err} })
	// A key another transaction was just seen holding waits on its own,
	// not in the batch.
	now := time.Now()
	unheld := live[:0]
	for _, r := range live {
		if s.held.held(r.p.ID, now) {
			r.out <- beginRes{}
			continue
		}
		unheld = append(unheld, r)
	}
	live = unheld
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
		if err != nil && s.begins.Closing() {
			err = errStoreClosed
		}
		r.out <- beginRes{rec: rec, now: now, inserted: inserted, found: found, err: classify(err)}
		return
	}
	// One row per record: a later request of the same record is answered
	// from the same row (or, if the row is not its own creation, decides
	// on the single-record path).
	recs := make([]newRecord, 0, len(live))
	for i, r := range live {
		if i > 0 && live[i-1].p.ID == r.p.ID {
			continue
		}
		recs = append(recs, newRecordOf(r.p.ID, r.ev))
	}
	type row struct {
		rec      statemachine.Record
		now      time.Time
		inserted bool
		err      error // the row could not be read
	}
	found := make(map[Identity]row, len(recs))
	q := s.sql.beginBatch(recs, s.newRowKeyID(), s.now(), batchLockWait)
	rows, err := s.pool.Query(ctx, q.sql, q.args...)
	if err == nil {
		for rows.Next() {
			var id Identity
			var rw row
			dest, fin := s.scanTargets(&rw.rec, &id)
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
	}
	if err != nil {
		failed := s.batchFailed("begin", len(live), err, s.begins.Closing())
		for _, r := range live {
			r.out <- beginRes{err: failed}
		}
		return
	}
	for _, r := range live {
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

// runCompleteBatch runs one batch of Completes and answers each request. A
// batch holds at most one request per record; the others decide on the
// locked path, after this batch commits.
func (s *Store) runCompleteBatch(ctx context.Context, batch []*completeReq) {
	sorted := liveBatch(batch, func(r *completeReq) context.Context { return r.ctx },
		func(r *completeReq) Identity { return r.id },
		func(r *completeReq, err error) { r.out <- completeRes{err: err} })
	live := sorted[:0]
	for i, r := range sorted {
		if i > 0 && sorted[i-1].id == r.id {
			// A second Complete of the same record in this batch: let it
			// decide on its own, after this batch commits.
			r.out <- completeRes{}
			continue
		}
		live = append(live, r)
	}
	switch len(live) {
	case 0:
		return
	case 1:
		r := live[0]
		res, err := s.completeHeldOne(ctx, r.id, r.ev.Token, r.response)
		if err != nil && s.completes.Closing() {
			err = errStoreClosed
		}
		r.out <- completeRes{res: res, err: classify(err)}
		return
	}
	n := len(live)
	cs := make([]heldCompletion, n)
	for i, r := range live {
		cs[i] = heldCompletion{id: r.id, token: r.ev.Token, response: r.response}
	}
	type row struct {
		res *Result
		err error // the row was written but cannot be read back
	}
	done := make(map[Identity]row, n)
	q := s.sql.completeBatch(cs, s.now())
	rows, err := s.pool.Query(ctx, q.sql, q.args...)
	if err == nil {
		for rows.Next() {
			var id Identity
			var rec statemachine.Record
			var now time.Time
			dest, fin := s.scanTargets(&rec, &id)
			if err = rows.Scan(append(append([]any{&id.Tenant, &id.Scope, &id.Key}, dest...), &now)...); err != nil {
				break
			}
			if ferr := fin(); ferr != nil {
				done[id] = row{err: ferr}
				continue
			}
			done[id] = row{res: &Result{Decision: statemachine.Decision{Write: statemachine.WriteUpdate, Record: rec, Exists: true}, Now: now.UTC()}}
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	if err != nil {
		failed := s.batchFailed("complete", n, err, s.completes.Closing())
		for _, r := range live {
			r.out <- completeRes{err: failed}
		}
		return
	}
	for _, r := range live {
		d := done[r.id]
		r.out <- completeRes(d)
	}
}
