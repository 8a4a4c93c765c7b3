package ledger

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/statemachine"
)

// Defaults and limits of RunTx.
const (
	// DefaultTxTTL is the retention of a RunTx result when TxOptions.TTL
	// is 0.
	DefaultTxTTL = 24 * time.Hour
	// DefaultTxWait is how long a duplicate RunTx waits for a running one
	// when TxOptions.Wait is 0.
	DefaultTxWait = 5 * time.Second
	// MaxNameBytes bounds the tenant, scope and key of RunTx, as the
	// coordinator bounds its callers'.
	MaxNameBytes = 255
	// MaxFingerprintBytes bounds TxOptions.Fingerprint, as the coordinator
	// bounds BeginRequest.fingerprint.
	MaxFingerprintBytes = 64
	// MaxTxResponseBytes bounds the response RunTx stores (body, metadata,
	// schema version and content type together), as the coordinator's
	// default max_response_bytes does, so a gRPC Begin can replay it.
	MaxTxResponseBytes = 1 << 20
)

// txLease is the lease written on the record RunTx holds while fn runs. No
// other session ever sees it: the record only commits once it is finished.
const txLease = time.Hour

// ErrInProgress is returned by RunTx when another attempt held the key for
// all of TxOptions.Wait: a RunTx still running fn, or a gRPC caller of the
// coordinator holding a live lease. Nothing was written; retry later.
var ErrInProgress = errors.New("another attempt holds the key")

// ErrUnknownHeld is returned by RunTx, without waiting, when the key's
// record is UNKNOWN or uncertain: an attempt over gRPC ended Fail UNKNOWN
// or lost its lease, and may have done its side effect (a later attempt
// that ended FAILED_RETRYABLE leaves the record uncertain). RunTx never
// takes such a key over (it cannot tell fn to check the outside world
// first), whatever the coordinator's on_unknown policy. After checking, an
// operator resolves the record (idemctl resolve: as retryable, RunTx runs
// again; as completed, it replays) or forgets it; a holder's late Complete
// also ends an UNKNOWN record. errors.Is(ErrUnknownHeld, ErrInProgress) is
// true.
var ErrUnknownHeld = fmt.Errorf("%w: the record is UNKNOWN or uncertain (an earlier attempt may have acted) and waits for an operator", ErrInProgress)

// ErrInvalidArgument wraps RunTx's refusals of its input (an empty or
// unprintable name, a fingerprint too long, a negative TTL, no function)
// and of a response of fn larger than MaxTxResponseBytes. Nothing is
// written: fn's writes are rolled back.
var ErrInvalidArgument = errors.New("invalid argument")

// ReplayableError is the error a RunTx function returns for an outcome that
// must replay although it is a failure: a business rejection such as an
// HTTP 422 or a declined card. RunTx stores Response as FAILED_REPLAYABLE in
// the same transaction (the function's writes commit with it), and every
// later RunTx on the key returns Response with a *ReplayableError, without
// calling its function. The function may wrap it (fmt.Errorf("…: %w", e)).
type ReplayableError struct {
	Response *statemachine.Response
}

// Error describes the stored failure.
func (e *ReplayableError) Error() string {
	if e == nil || e.Response == nil {
		return "replayable failure"
	}
	return "replayable failure (status " + strconv.Itoa(int(e.Response.StatusCode)) + ")"
}

// TxOptions are the options of RunTx.
type TxOptions struct {
	// Fingerprint is the caller's hash of its canonical request (0-64
	// bytes), as in Begin: a key first used with another non-empty
	// fingerprint fails statemachine.ErrFingerprintMismatch; empty skips
	// the check.
	Fingerprint []byte
	// TTL is how long the result is kept (and replayed) after it commits;
	// 0 means DefaultTxTTL. A FAILED_REPLAYABLE result is kept as long.
	TTL time.Duration
	// Wait is how long a duplicate waits for a running attempt before it
	// returns ErrInProgress; 0 means DefaultTxWait, a negative value does
	// not wait. As a waiting Begin's, the wait ends 50 ms before ctx's
	// deadline at the latest, so that ErrInProgress comes before the
	// deadline does.
	Wait time.Duration
}

// RunTx runs fn at most once per key, in one database transaction with the
// key's record: the effect of fn on the store's database (the business
// write, an outbox job) and the record commit together or not at all.
//
// The store must be opened on the database fn writes to, migrated with
// Migrate (the same schema the coordinator uses, so an idemcoord pointed at
// that database serves Lookup, Admin and gRPC Begin for these records).
//
// In one transaction RunTx creates the record or locks it (the database
// decides races: concurrent RunTx on one key queue on the primary key or on
// the row lock, up to opts.Wait), then:
//   - a COMPLETED record replays: RunTx returns its stored response with
//     replayed true, and fn is not called; a FAILED_REPLAYABLE record does
//     the same with a *ReplayableError (a finished record is first looked
//     for with a plain read, so a replay takes no lock);
//   - a new key, a FAILED_RETRYABLE record or an expired one (a new
//     generation) runs fn with the transaction. When fn returns a response,
//     it is stored COMPLETED and the transaction commits; RunTx returns it
//     with replayed false. When fn returns a *ReplayableError (possibly
//     wrapped), its response is stored FAILED_REPLAYABLE and committed, and
//     RunTx returns that response and fn's error. Any other error, or a
//     panic, rolls everything back (no record is left, the key may run
//     again) and RunTx returns fn's error as is (or re-panics);
//   - an IN_PROGRESS record under a live lease (a gRPC caller of the
//     coordinator holds it) is waited for, without a lock or connection
//     held, until it changes or opts.Wait runs out (ErrInProgress), in
//     the wait of Store.BeginWait: a database outage while waiting is the
//     answer only if it outlasts the wait, and a try whose commit's answer
//     was lost is recognised by the next (one lease token across tries),
//     which answers fn's committed outcome instead of replaying it;
//   - an UNKNOWN or uncertain record (an attempt over gRPC may have done
//     its side effect) is not taken over: RunTx returns ErrUnknownHeld at
//     once.
//
// A crash at any point leaves no record or a finished one: RunTx never
// leaves a record IN_PROGRESS or UNKNOWN. If the commit itself fails
// (ErrUnavailable), whether it happened is unknown: call RunTx again, which
// replays or runs fn.
//
// fn must do all its work through tx and must not commit or roll it back
// (tx refuses); it may use savepoints (tx.Begin). A function that rejects
// the request and must undo its own writes can do them in a savepoint.
// id.Tenant "" means DefaultTenant. The stored response is encrypted with
// the store's keyring, if it has one.
func (s *Store) RunTx(ctx context.Context, id Identity, opts TxOptions,
	fn func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error),
) (resp *statemachine.Response, replayed bool, err error) {
	if id.Tenant == "" {
		id.Tenant = DefaultTenant
	}
	if err := validateTx(id, opts); err != nil {
		return nil, false, err
	}
	if fn == nil {
		return nil, false, fmt.Errorf("%w: no function to run", ErrInvalidArgument)
	}
	ttl, wait := opts.TTL, opts.Wait
	if ttl == 0 {
		ttl = DefaultTxTTL
	}
	switch {
	case wait == 0:
		wait = DefaultTxWait
	case wait < 0:
		wait = 0
	}
	giveUp := waitEnd(ctx, time.Now(), wait)
	// One lease token for every try: a try whose commit's answer was lost
	// may have committed, and the next then finds that record its own.
	ev := storedDurations(statemachine.Event{Kind: statemachine.EventBegin, Fingerprint: opts.Fingerprint,
		TTL: ttl, FailureTTL: ttl, Lease: txLease, NewToken: newToken()})

	// A finished record replays from a plain read, as a Begin's does: it
	// changes only by expiry, Forget or an operator, and a duplicate of a
	// hot key then takes no lock.
	if out, ok, err := s.replayUnlocked(ctx, id, ev); err != nil {
		return nil, false, err
	} else if ok {
		return out.resp, out.replayed, out.err
	}

	// Held by someone who does not hold the row lock (a gRPC caller):
	// wait as a waiting Begin does.
	var out runTxResult
	var lost error // the error of a try whose commit's answer was lost
	held, err := s.waitWhileHeld(ctx, id, giveUp, func(ctx context.Context) (holding, error) {
		if lost != nil {
			// fn may have run and committed: write nothing now. A replay
			// (its own result, or another's) answers; anything else ends
			// the wait with the lost answer's ErrUnavailable, as running fn
			// again after an operator's Forget of its record would run it
			// twice (see BeginWait).
			o, ok, err := s.replayUnlocked(ctx, id, ev)
			switch {
			case err != nil:
				return holding{}, err
			case !ok:
				return holding{}, finalError{lost}
			}
			out = o
			return holding{}, nil
		}
		for races := 0; ; {
			o, err := s.runTxOnce(ctx, id, ev, giveUp, fn)
			if answerLost(err) {
				lost = err
			}
			if err != nil {
				return holding{}, err
			}
			if o.vanished {
				// The row was deleted between our insert and our lock.
				if races++; races >= maxRaceRetries {
					return holding{}, fmt.Errorf("%w: record %q changed too often under contention", ErrUnavailable, id.Key)
				}
				continue
			}
			out = o
			if o.done || o.unknown {
				return holding{}, nil
			}
			return holding{held: true, leaseLeft: o.leaseLeft, attempt: o.attempt}, nil
		}
	})
	switch {
	case err != nil:
		return nil, false, err
	case held:
		return nil, false, ErrInProgress
	case out.unknown:
		// An UNKNOWN record waits for an operator, not for an attempt
		// (as a waiting Begin under on_unknown: hold): answer at once.
		return nil, false, ErrUnknownHeld
	}
	return out.resp, out.replayed, out.err
}

// txPolicy is how RunTx decides on an existing record: it never takes over
// UNKNOWN (on_unknown: hold) and restarts an expired key (on_expired:
// restart).
var txPolicy = statemachine.Policy{OnUnknown: statemachine.UnknownHold}

// replayUnlocked reads the record without a lock or transaction and
// reports ok when that decides RunTx: a replay, or a refusal such as a
// fingerprint mismatch.
func (s *Store) replayUnlocked(ctx context.Context, id Identity, ev statemachine.Event) (out runTxResult, ok bool, err error) {
	q := s.sql.read(id, s.now())
	cur, now, err := s.scanFullRecordNow(s.pool.QueryRow(ctx, q.sql, q.args...), id)
	if errors.Is(err, pgx.ErrNoRows) {
		return out, false, nil
	}
	if err != nil {
		return out, false, classify(err)
	}
	if out, ok := ownTxResult(cur, now, ev.NewToken); ok {
		return out, true, nil
	}
	d := s.decide(id, &cur, ev, txPolicy, now)
	switch {
	case d.Err != nil:
		return runTxResult{err: d.Err}, true, nil //nolint:nilerr // the refusal is the caller's answer, not a failure of the try
	case d.Outcome == statemachine.OutcomeReplay:
		return replayOf(d.Record), true, nil
	}
	return out, false, nil
}

// ownTxResult answers a RunTx that finds its own record (its lease token;
// tokens are unique) ended by an earlier try whose answer was lost: fn ran
// in this call, and its outcome is answered as it was made, not replayed.
func ownTxResult(cur statemachine.Record, now time.Time, token string) (runTxResult, bool) {
	if cur.LeaseToken != token {
		return runTxResult{}, false
	}
	eff := statemachine.Effective(cur, now)
	if eff.State != statemachine.StateCompleted && eff.State != statemachine.StateFailedReplayable {
		return runTxResult{}, false
	}
	out := replayOf(eff)
	out.replayed = false
	return out, true
}

// replayOf is RunTx's answer for a replayed record.
func replayOf(rec statemachine.Record) runTxResult {
	out := runTxResult{done: true, resp: rec.Response, replayed: true}
	if rec.State == statemachine.StateFailedReplayable {
		out.err = &ReplayableError{Response: rec.Response}
	}
	return out
}

// runTxResult is what one transaction of RunTx came to.
type runTxResult struct {
	// done: resp, replayed and err are RunTx's answer.
	done     bool
	resp     *statemachine.Response
	replayed bool
	err      error
	// vanished: the record was deleted under us; try again.
	vanished bool
	// Otherwise a holder without the row lock keeps the key: unknown says
	// the record is UNKNOWN; leaseLeft is the time to its lease expiry,
	// attempt the holder's generation and attempt.
	unknown   bool
	leaseLeft time.Duration
	attempt   [2]int32
}

// runTxOnce makes one attempt of RunTx in one transaction. An error return
// is the database's failure (classified); fn's error comes in the result.
func (s *Store) runTxOnce(ctx context.Context, id Identity, ev statemachine.Event, giveUp time.Time,
	fn func(ctx context.Context, tx pgx.Tx) (*statemachine.Response, error),
) (out runTxResult, err error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return out, uncommitted(err)
	}
	committed := false
	defer func() {
		// Also on a panic in fn: the record and fn's writes go together.
		if !committed {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	dbErr := func(err error) (runTxResult, error) {
		if isLockTimeout(err) {
			// The running attempt kept its lock for all of Wait.
			return runTxResult{done: true, err: ErrInProgress}, nil
		}
		return runTxResult{}, uncommitted(err)
	}

	// Lock waits for this key end when Wait does; "now" is read after the
	// transaction started, not at its start.
	lockTimeout := max(time.Until(giveUp), time.Millisecond)
	var now time.Time
	q := s.sql.runTxStart(lockTimeout, s.now())
	if q.local != "" {
		if _, err := tx.Exec(ctx, q.local); err != nil {
			return dbErr(err)
		}
	}
	if err := tx.QueryRow(ctx, q.sql, q.args...).Scan(&now); err != nil {
		return dbErr(err)
	}
	now = now.UTC()

	// A new key: insert it held. A concurrent inserter of the same key
	// waits on the primary key until this transaction ends.
	d := s.decide(id, nil, ev, statemachine.Policy{}, now)
	cols, err := s.recordArgs(id, d.Record)
	if err != nil {
		return out, err
	}
	q = s.sql.insert(id, cols)
	tag, err := tx.Exec(ctx, q.sql, q.args...)
	if err != nil {
		return dbErr(err)
	}
	if tag.RowsAffected() == 0 {
		// The key exists: lock it and decide.
		q := s.sql.lockNow(id, s.now())
		cur, now, err := s.scanFullRecordNow(tx.QueryRow(ctx, q.sql, q.args...), id)
		if errors.Is(err, pgx.ErrNoRows) {
			return runTxResult{vanished: true}, nil
		}
		if err != nil {
			return dbErr(err)
		}
		if out, ok := ownTxResult(cur, now, ev.NewToken); ok {
			return out, nil
		}
		d = s.decide(id, &cur, ev, txPolicy, now)
		switch {
		case d.Err != nil:
			return runTxResult{done: true, err: d.Err}, nil
		case d.Outcome == statemachine.OutcomeReplay:
			return replayOf(d.Record), nil
		case d.Outcome == statemachine.OutcomeInProgress,
			d.Outcome == statemachine.OutcomeAcquired && (d.PreviousState == statemachine.StateUnknown || d.Write != statemachine.WriteUpdate):
			// A live lease, or an UNKNOWN record (or one whose generation
			// is uncertain): not ours to run. Nothing is written here.
			out = runTxResult{unknown: d.Record.State == statemachine.StateUnknown || d.PreviousState == statemachine.StateUnknown}
			if d.Record.State == statemachine.StateInProgress {
				out.leaseLeft = max(d.Record.LeaseExpiresAt.Sub(now), time.Nanosecond)
				out.attempt = [2]int32{d.Record.Generation, d.Record.Attempt}
			}
			return out, nil
		}
		// Acquired: a FAILED_RETRYABLE record taken over, or an expired
		// one restarted. The acquisition is written with the final state.
	}
	held := d.Record

	// Locks fn takes wait as long as the session says, not Wait.
	q = s.sql.runTxLockDefault()
	if _, err := tx.Exec(ctx, q.sql, q.args...); err != nil {
		return dbErr(err)
	}
	resp, fnErr := fn(ctx, ownedTx{tx})
	end := statemachine.Event{Kind: statemachine.EventComplete, Token: held.LeaseToken, Response: resp}
	var replayable *ReplayableError
	switch {
	case fnErr == nil:
		if resp == nil {
			resp = &statemachine.Response{}
		}
	case errors.As(fnErr, &replayable):
		resp = replayable.Response
		if resp == nil {
			resp = &statemachine.Response{}
		}
		end = statemachine.Event{Kind: statemachine.EventFail, Token: held.LeaseToken,
			FailureKind: statemachine.FailureReplayable, Response: resp}
	default:
		return runTxResult{done: true, err: fnErr}, nil
	}
	if n := responseSize(resp); n > MaxTxResponseBytes {
		// Rolled back with fn's writes: nothing is kept that cannot replay.
		return runTxResult{done: true, err: fmt.Errorf("%w: the response of fn is %d bytes, at most %d", ErrInvalidArgument, n, MaxTxResponseBytes)}, nil
	}

	q = s.sql.runTxClock(s.now())
	if err := tx.QueryRow(ctx, q.sql, q.args...).Scan(&now); err != nil {
		return dbErr(err)
	}
	d = s.decide(id, &held, end, statemachine.Policy{}, now.UTC())
	if d.Err != nil || d.Write != statemachine.WriteUpdate {
		return out, fmt.Errorf("ledger: RunTx: unexpected decision ending its own record: %v", d.Err)
	}
	if cols, err = s.recordArgs(id, d.Record); err != nil {
		return out, err
	}
	q = s.sql.update(id, cols)
	if _, err := tx.Exec(ctx, q.sql, q.args...); err != nil {
		return dbErr(err)
	}
	// A COMMIT is never cancelled by the caller: a cancelled commit may have
	// happened anyway, and the caller could not tell; and a cancelled wait
	// for a synchronous standby commits locally only (see commitTimeout).
	cctx, cancel := commitContext(ctx)
	err = tx.Commit(cctx)
	cancel()
	if err != nil {
		return out, classify(err)
	}
	committed = true
	return runTxResult{done: true, resp: resp, err: fnErr}, nil
}

// responseSize is the size of a response's content.
func responseSize(r *statemachine.Response) int {
	n := len(r.Body) + len(r.SchemaVersion) + len(r.ContentType)
	for k, v := range r.Metadata {
		n += len(k) + len(v)
	}
	return n
}

// errTxOwned is returned by the transaction RunTx hands to fn when fn tries
// to end it.
var errTxOwned = errors.New("ledger: RunTx commits or rolls back its transaction itself; return from fn instead")

// ownedTx is the transaction fn sees: everything but ending it.
type ownedTx struct{ pgx.Tx }

func (ownedTx) Commit(context.Context) error   { return errTxOwned }
func (ownedTx) Rollback(context.Context) error { return errTxOwned }

// validateTx checks RunTx's input as the coordinator checks a Begin's.
func validateTx(id Identity, opts TxOptions) error {
	for _, f := range []struct{ name, v string }{{"tenant", id.Tenant}, {"scope", id.Scope}, {"key", id.Key}} {
		if err := validName(f.v); err != nil {
			return fmt.Errorf("%w: %s %s", ErrInvalidArgument, f.name, err)
		}
	}
	switch {
	case len(opts.Fingerprint) > MaxFingerprintBytes:
		return fmt.Errorf("%w: fingerprint is %d bytes, at most %d", ErrInvalidArgument, len(opts.Fingerprint), MaxFingerprintBytes)
	case opts.TTL < 0:
		return fmt.Errorf("%w: negative TTL %v", ErrInvalidArgument, opts.TTL)
	}
	return nil
}

// validName checks a name is 1-MaxNameBytes bytes of UTF-8 without control
// characters.
func validName(v string) error {
	switch {
	case v == "":
		return errors.New("is empty")
	case len(v) > MaxNameBytes:
		return fmt.Errorf("is %d bytes, at most %d", len(v), MaxNameBytes)
	case !utf8.ValidString(v):
		return errors.New("is not valid UTF-8")
	}
	for _, r := range v {
		if unicode.Is(unicode.Cc, r) {
			return fmt.Errorf("contains the control character %U", r)
		}
	}
	return nil
}
