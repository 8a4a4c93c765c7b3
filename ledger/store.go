package ledger

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemcoord/idemcoord/ledger/internal/coalescer"
	"github.com/idemcoord/idemcoord/ledger/internal/keyring"
	"github.com/idemcoord/idemcoord/ledger/internal/notifier"
	"github.com/idemcoord/idemcoord/ledger/internal/replaycache"
	"github.com/idemcoord/idemcoord/statemachine"
)

// Store keeps idempotency records in PostgreSQL. It is safe for concurrent
// use by many goroutines and by many replicas sharing one database.
type Store struct {
	pool *pgxpool.Pool
	// first is pool, or with load_balance_hosts=random a small pool on
	// the URL's first host (the Citus coordinator node): its local tables
	// (the console's sessions) and the notifier's pings of the first
	// host's listener go there.
	first *pgxpool.Pool
	// sql are the statements it runs, in its database's dialect.
	sql      *statements
	dialect  dialect
	clock    func() time.Time
	logger   *slog.Logger
	notifier *notifier.Notifier
	keyring  *keyring.Ring // nil: records in clear

	// exactCountBytes: below this table size StateCounts counts exactly.
	exactCountBytes int64

	// writes coalesces concurrent Begins and Completes into rounds, each
	// one transaction (nil when batching is off; see runRound).
	writes *coalescer.Coalescer[writeReq]
	// held remembers keys whose Begins met another transaction's lock,
	// which batches then leave to run on their own.
	held heldKeys

	// releases counts the releases of acquisitions whose Begin's caller
	// had gone (see releaseGone); Close waits for them.
	releases       sync.WaitGroup
	releasesMu     sync.Mutex
	releasesClosed bool

	// cache serves replays without a round trip (nil when off).
	// clockOffset is the database clock minus the local clock (ns), as
	// last seen, for judging cached expiry.
	cache       *replaycache.Cache
	clockOffset atomic.Int64
}

// Option configures a Store.
type Option func(*options)

type options struct {
	clock    func() time.Time
	logger   *slog.Logger
	maxConns int32
	keyring  *Keyring
	noBatch  bool
	workers  int
	cacheMax int64
	// notifyURL, if set, is where the change listener connects;
	// noNotify turns the listener off (see WithoutNotifications).
	notifyURL string
	noNotify  bool
	// notifyQueueLimit, when set, is the session's
	// idemcoord.notify_queue_limit (tests lower it).
	notifyQueueLimit string
}

// WithNotifyDatabaseURL makes the change listener (one connection that
// LISTENs) connect to url instead of the database URL given to Open: to
// reach PostgreSQL directly when the other connections go through a
// transaction-pooling PgBouncer, where LISTEN does not work. url may be
// multi-host, like the database URL.
func WithNotifyDatabaseURL(url string) Option {
	return func(o *options) { o.notifyURL = url }
}

// WithoutNotifications runs without the change listener: no LISTEN
// connection and no replay cache (every Begin reads the database), and
// subscribers (waiting Begins) are woken every second to read again, as
// they are whenever notifications cannot be trusted, instead of by a
// notification. For a database reached only through a transaction-pooling
// PgBouncer.
func WithoutNotifications() Option {
	return func(o *options) { o.noNotify = true }
}

// WithClock makes the Store take "now" from clock instead of the database's
// clock. Tests use it to move time without sleeping; production leaves the
// database as the one clock of every replica.
func WithClock(clock func() time.Time) Option {
	return func(o *options) { o.clock = clock }
}

// WithLogger sets the logger for background work (the change listener).
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.logger = l }
}

// WithKeyring seals every record's sensitive columns (the response's body
// and metadata, the failure reason) at rest with the keyring's active key,
// stores fingerprints as keyed hashes, and opens rows written under any of
// its keys. A row that does not open, or that is in clear (unless the
// keyring accepts legacy rows), fails ErrUnreadable. Without it, records
// are stored in clear, and sealed rows cannot be read (ErrUnknownKey).
// With it, Complete always takes the locked path (two statements in a
// transaction instead of one), since the seal binds counters it reads.
func WithKeyring(k *Keyring) Option {
	return func(o *options) { o.keyring = k }
}

// WithReplayCache sets the memory budget of the replay cache, which serves
// Begins on COMPLETED and FAILED_REPLAYABLE records without a database
// round trip (default 32 MiB; 0 turns it off). A record changed, expired or
// forgotten stops being served within a second on every replica.
func WithReplayCache(maxBytes int64) Option {
	return func(o *options) { o.cacheMax = maxBytes }
}

// WithoutBatching makes every Begin and Complete its own statement instead
// of coalescing concurrent ones (for comparison in benchmarks).
func WithoutBatching() Option {
	return func(o *options) { o.noBatch = true }
}

// WithBatchWorkers sets how many coalesced rounds run at once (default
// DefaultBatchWorkers; less than 1 means the default). A round takes every
// Begin and Complete queued when it starts and writes them in one
// transaction, so fewer workers make larger rounds: fewer commits and less
// database CPU per call when PostgreSQL is the bottleneck, at the price of
// a call waiting for the round ahead of it.
func WithBatchWorkers(n int) Option {
	return func(o *options) { o.workers = n }
}

// WithMaxConns sets the connection pool size when the database URL does not
// set pool_max_conns. The default is 32.
func WithMaxConns(n int32) Option {
	return func(o *options) { o.maxConns = n }
}

// Open connects to the database at databaseURL (which must already be
// migrated, see Migrate). It does not fail when the database is down: calls
// then fail with ErrUnavailable until it comes back.
func Open(ctx context.Context, databaseURL string, opts ...Option) (*Store, error) {
	o := options{logger: slog.New(slog.DiscardHandler), maxConns: 32, cacheMax: 32 << 20}
	for _, opt := range opts {
		opt(&o)
	}
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("ledger: parse database URL: %w", err)
	}
	if cfg.ConnConfig.RuntimeParams == nil {
		cfg.ConnConfig.RuntimeParams = map[string]string{}
	}
	// An acknowledged write must be durable whatever the server's default.
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "on"
	if !hasParam(databaseURL, "application_name") {
		cfg.ConnConfig.RuntimeParams["application_name"] = "idemcoord"
	}
	cfg.ConnConfig.OnPgError = closeOnReadOnly(cfg.ConnConfig.OnPgError)
	// load_balance_hosts=random spreads the pool's connections over a
	// multi-host URL's hosts (on Citus, nodes with metadata route any
	// key's statements); the notifier's connection stays on the first.
	balanced, err := balanceHosts(cfg)
	if err != nil {
		return nil, fmt.Errorf("ledger: database URL: %w", err)
	}
	if o.notifyQueueLimit != "" {
		cfg.ConnConfig.RuntimeParams["idemcoord.notify_queue_limit"] = o.notifyQueueLimit
	}
	if !hasParam(databaseURL, "pool_max_conns") {
		cfg.MaxConns = o.maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("ledger: create pool: %w", err)
	}
	d, err := detectDialect(ctx, pool)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("ledger: find out what database this is: %w", classify(err))
	}
	s := &Store{pool: pool, sql: statementsFor(d), dialect: d, clock: o.clock, logger: o.logger, keyring: ringOf(o.keyring), exactCountBytes: exactCountBytes}
	if d == citus {
		// Each Begin and Complete runs its own statement, routed to its
		// key's shard: a batch of keys of several shards would be a
		// two-phase commit. Changes notify on the worker that holds the
		// record: the notifier listens on every node (citusNodes).
		o.noBatch = true
		o.logger.Info("ledger: the database is Citus (records distributed): batching is off; change notifications are listened for on every node")
	} else {
		o.logger.Info("ledger: the database is PostgreSQL")
	}
	listenCfg := cfg.ConnConfig.Copy()
	if o.notifyURL != "" {
		ncfg, err := pgx.ParseConfig(o.notifyURL)
		if err != nil {
			pool.Close()
			return nil, fmt.Errorf("ledger: parse notify database URL: %w", err)
		}
		for _, p := range []string{"synchronous_commit", "application_name", "idemcoord.notify_queue_limit"} {
			if v, ok := cfg.ConnConfig.RuntimeParams[p]; ok {
				ncfg.RuntimeParams[p] = v
			}
		}
		ncfg.OnPgError = closeOnReadOnly(ncfg.OnPgError)
		listenCfg = ncfg
	}
	s.first = pool
	if balanced {
		if s.first, err = firstHostPool(ctx, cfg); err != nil {
			pool.Close()
			return nil, fmt.Errorf("ledger: create pool: %w", err)
		}
	}
	ncfg := notifier.Config{Statements: s.sql.notifier, ConnConfig: listenCfg, Pings: s.first, Logger: o.logger}
	if d == citus {
		ncfg.Nodes = func(ctx context.Context) ([]*pgx.ConnConfig, error) { return citusNodes(ctx, pool, listenCfg) }
	}
	if o.noNotify {
		// No listener: the notifier never trusts notifications, so
		// subscribers poll, and there is no replay cache (it learns of
		// changes only from notifications) and no ping.
		ncfg.NoListen = true
		o.cacheMax = 0
	}
	if !o.noBatch {
		workers := o.workers
		if workers < 1 {
			workers = DefaultBatchWorkers
		}
		s.writes = coalescer.New(workers, 2*batchMax, batchTimeout, s.runRound, rejectWrite)
	}
	if o.cacheMax > 0 {
		s.cache = replaycache.New(o.cacheMax, func() bool { return s.notifier.Fresh(replaycache.Freshness) })
		ncfg.OnPayload = s.cache.Invalidate
		ncfg.OnLost = s.cache.InvalidateAll
	}
	// The listener and its pings run from the start: the pings measure the
	// listener's delay and carry the count of changes not notified, which
	// the replay cache and waiting Begins rely on.
	s.notifier = notifier.New(ncfg)
	s.notifier.Start()
	return s, nil
}

// Close stops the batch workers and the change listener and closes every
// connection. Every call queued for a batch, or in a batch statement that
// Close interrupts, returns ErrUnavailable (a Begin or Complete whose
// statement was interrupted may have committed, as ErrUnavailable allows);
// calls made after Close return ErrUnavailable too. Close waits for calls
// on their own connection to finish.
func (s *Store) Close() {
	if s.writes != nil {
		s.writes.Close()
	}
	s.waitReleases()
	s.notifier.Close()
	if s.first != s.pool {
		s.first.Close()
	}
	s.pool.Close()
}

// Ping checks that the database answers.
func (s *Store) Ping(ctx context.Context) error {
	return classify(s.pool.Ping(ctx))
}

// Identity names one record.
type Identity struct {
	Tenant string
	Scope  string
	Key    string
}

// DefaultTenant is the tenant of every caller of a coordinator with auth
// disabled, and the tenant RunTx uses when Identity.Tenant is empty.
const DefaultTenant = "default"

// BeginParams are the inputs of Begin. Event.Kind is set by Begin, and
// Event.NewToken too unless the caller set one (NewLeaseToken): a caller
// that repeats a Begin after a lost answer passes the same token again, so
// that the repeat finds the acquisition the lost one may have committed
// and answers it, instead of acquiring a second time.
type BeginParams struct {
	ID     Identity
	Event  statemachine.Event
	Policy statemachine.Policy
}

// FinishParams are the inputs of Complete, Fail and Heartbeat; Event.Kind
// says which.
type FinishParams struct {
	ID    Identity
	Event statemachine.Event
	// Policy is the scope's policy in force: a Fail ABANDONED of a restart
	// restores the expired generation as its on_expired allows (see
	// statemachine.Next).
	Policy statemachine.Policy
}

// Result is a decision that was applied (committed, when it wrote).
type Result struct {
	statemachine.Decision
	// Now is the time the decision was taken at.
	Now time.Time
}

// now returns the injected time (truncated to the database's microsecond
// precision) or nil, which makes queries use the database clock.
func (s *Store) now() *time.Time {
	if s.clock == nil {
		return nil
	}
	t := s.clock().UTC().Truncate(time.Microsecond)
	return &t
}

// storedDurations returns ev with its TTLs and lease at the precision a
// record keeps them (PostgreSQL stores microseconds): a finer part is
// rounded up, so a lease or TTL is never shorter than asked for, a 1 ns TTL
// is not stored as none, and the record a call answers is the one stored.
func storedDurations(ev statemachine.Event) statemachine.Event {
	for _, d := range []*time.Duration{&ev.TTL, &ev.FailureTTL, &ev.Lease} {
		if r := *d % time.Microsecond; r > 0 {
			*d += time.Microsecond - r
		}
	}
	return ev
}

// NewLeaseToken returns a fresh lease token for BeginParams.Event.NewToken.
func NewLeaseToken() string { return newToken() }

// newToken returns a fresh opaque lease token.
func newToken() string {
	var b [18]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return "lt1." + base64.RawURLEncoding.EncodeToString(b[:])
}

// Begin applies a Begin event. An identity longer than MaxIdentityBytes is
// refused with ErrIdentityTooLong. A new key takes one round trip (an INSERT …
// ON CONFLICT DO NOTHING that also reads the existing row); a decision that
// changes an existing record is taken again under its row lock.
//
// A key whose row another transaction is inserting or changing (a RunTx
// running fn, for instance) delays only Begins of that key: they wait for
// it within ctx, each on its own connection, while the Begins batched with
// them go on. A Begin whose ctx has ended before its write is sent writes
// nothing; one whose ctx ends while it waits for such a key does not
// acquire it afterwards (after a cancel without a deadline, not later than
// 500 ms after it).
//
// A Begin whose caller is gone never leaves an acquisition behind. Its
// write is never cancelled once sent (see commitTimeout), so when ctx ends
// while the write is in flight, Begin returns ctx's error at once and the
// write may still acquire the key afterwards; and ctx may end just after
// the write acquired it. Either way nobody will act on that acquisition,
// nor end it (a client's release of its attempt may have run already and
// found nothing), so the Store ends it itself, with Fail ABANDONED (reason
// ReleaseReason): the key is then as if that Begin never was. It does so
// only while the acquisition is as this Begin made it: a repeated Begin of
// the same attempt_id that took it up meanwhile (a retry whose caller is
// still there) keeps it. When ctx ended after the acquisition was made,
// Begin releases it before it returns ctx's error; when its write was still
// in flight, as soon as the write has committed.
func (s *Store) Begin(ctx context.Context, p *BeginParams) (*Result, error) {
	if err := checkIdentity(p.ID); err != nil {
		return nil, err
	}
	ev := storedDurations(p.Event)
	ev.Kind = statemachine.EventBegin
	res, err := s.begin(ctx, p, &ev)
	if err == nil && ctx.Err() != nil && madeBy(res, ev.NewToken) {
		s.releaseGone(ctx, p, res.Record)
		return nil, ctx.Err()
	}
	return res, err
}

// begin is Begin with ev's kind set; it chooses ev's new token unless the
// caller did, and only when the Begin may acquire (a replay from the
// cache needs none), and leaves it in *ev, so the caller can tell an
// acquisition this call wrote from a holder's renewed one.
func (s *Store) begin(ctx context.Context, p *BeginParams, evp *statemachine.Event) (*Result, error) {
	var seq uint64
	if s.cache != nil {
		if res, ok := s.beginCached(p, *evp); ok {
			s.cache.Hit()
			return res, res.Err
		}
		s.cache.Miss()
		seq = s.cache.Snapshot()
	}
	if evp.NewToken == "" {
		evp.NewToken = newToken()
	}
	ev := *evp
	// The stored form of the caller's fingerprint for a new key, worked
	// out once: the statement creates the key with it, and the decision
	// on the key it created is taken with it.
	fresh := s.beginEvent(p.ID, nil, ev)
	rec, inserted, now, found, err := s.beginRead(ctx, p, fresh)
	if err != nil {
		return nil, err
	}
	if s.clock == nil {
		s.clockOffset.Store(int64(time.Until(now)))
	}
	if inserted {
		d := decideStored(nil, fresh, p.Policy, now)
		d.Record = rec
		return &Result{Decision: d, Now: now}, nil
	}
	if found {
		res, decided, err := s.answerRead(p, ev, rec, now)
		if err != nil {
			return nil, err
		}
		if decided {
			if s.cache != nil && res.Outcome == statemachine.OutcomeReplay {
				s.cache.Put(recordHash(p.ID), res.Record, seq)
			}
			return res, nil
		}
	}
	res, err := s.lockedWith(ctx, p.ID, ev, p.Policy, lockedHooks{late: func(res *Result) {
		if madeBy(res, ev.NewToken) {
			s.releaseGone(ctx, p, res.Record)
		}
	}})
	// On Citus a replay is decided here (the insert of an existing key
	// reads nothing): cache it as a read would.
	if err == nil && res != nil && s.cache != nil && res.Outcome == statemachine.OutcomeReplay {
		s.cache.Put(recordHash(p.ID), res.Record, seq)
	}
	return res, err
}

// ownAcquisition answers a Begin that finds its own acquisition (its lease
// token; tokens are unique), committed by a statement whose answer was
// lost: an earlier Begin of the same caller that passed this token too
// (see batchFailed and BeginWait). It is answered as it was made, without
// a second write; once its lease has run out it can no longer be handed
// over, and the caller is told what it would have been told of the lost
// answer (ErrLostAcquisition).
func ownAcquisition(rec statemachine.Record, now time.Time) (*Result, error) {
	if eff := statemachine.Effective(rec, now); eff.State != statemachine.StateInProgress {
		return nil, ErrLostAcquisition
	}
	return &Result{Decision: statemachine.Decision{Outcome: statemachine.OutcomeAcquired, Record: rec, Exists: true,
		PreviousState: rec.AcquiredFrom}, Now: now}, nil
}

// beginWithoutWrite decides the Begin p (with ev, its kind and token set)
// from the record as it is, writing nothing: the caller's own acquisition
// (ev's token), or a decision that needs no write (the key held, a replay,
// a refusal). ok is false when the Begin would have to write: create the
// key, take it over or renew it.
func (s *Store) beginWithoutWrite(ctx context.Context, p *BeginParams, ev statemachine.Event) (res *Result, ok bool, err error) {
	rec, now, err := s.Lookup(ctx, p.ID)
	if errors.Is(err, statemachine.ErrNotFound) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	return s.answerRead(p, ev, rec, now)
}

// answerRead decides the Begin p (with ev, its kind and token set) from
// rec, its record as read at now without the row lock, when that needs no
// write: the caller's own acquisition (ev's token; see ownAcquisition), a
// refusal (err), or a decision that writes nothing (the key held, a
// replay). decided is false when the Begin would have to write, which
// only a decision under the row lock may do.
func (s *Store) answerRead(p *BeginParams, ev statemachine.Event, rec statemachine.Record, now time.Time) (res *Result, decided bool, err error) {
	if rec.LeaseToken == ev.NewToken {
		res, err := ownAcquisition(rec, now)
		return res, true, err
	}
	res, decided = s.decideWithoutWrite(p, ev, rec, now)
	if decided && res.Err != nil {
		return nil, true, res.Err
	}
	return res, decided, nil
}

// decideWithoutWrite is the decision of the Begin p (with ev) on rec, a
// record read without its row lock at now; decided is false when the
// decision would write.
func (s *Store) decideWithoutWrite(p *BeginParams, ev statemachine.Event, rec statemachine.Record, now time.Time) (res *Result, decided bool) {
	d := s.decide(p.ID, &rec, ev, p.Policy, now)
	if d.Write != statemachine.WriteNone {
		return nil, false
	}
	return &Result{Decision: d, Now: now}, true
}

// beginCached answers a Begin from the replay cache when the cached record
// decides it without a write and is not about to expire.
func (s *Store) beginCached(p *BeginParams, ev statemachine.Event) (*Result, bool) {
	rec, ok := s.cache.Get(recordHash(p.ID))
	if !ok {
		return nil, false
	}
	now := time.Now().Add(time.Duration(s.clockOffset.Load()))
	if s.clock != nil {
		now = *s.now()
	}
	if !now.Add(replaycache.ExpiryMargin).Before(rec.ExpiresAt) {
		return nil, false
	}
	return s.decideWithoutWrite(p, ev, rec, now)
}

// decide is the decision of ev on cur (nil: no record), the record id as
// read at now. Every path decides through it (a Begin's read, the replay
// cache, the locked decision, RunTx), so all decide alike: the event in
// the record's stored form (beginEvent), then decideStored, the one call
// of statemachine.Next.
func (s *Store) decide(id Identity, cur *statemachine.Record, ev statemachine.Event, pol statemachine.Policy, now time.Time) statemachine.Decision {
	return decideStored(cur, s.beginEvent(id, cur, ev), pol, now)
}

// decideStored is decide for an event already in cur's stored form
// (beginEvent).
func decideStored(cur *statemachine.Record, ev statemachine.Event, pol statemachine.Policy, now time.Time) statemachine.Decision {
	return statemachine.Next(cur, ev, pol, now)
}

// beginEvent returns the Begin event ev, which carries the caller's
// fingerprint, with the fingerprint in the stored form of record id (cur
// nil: a new record): the one place that works the stored form out, for
// the statement that creates a key and for every decision. Other events
// are returned as they are.
func (s *Store) beginEvent(id Identity, cur *statemachine.Record, ev statemachine.Event) statemachine.Event {
	if ev.Kind != statemachine.EventBegin || s.keyring == nil {
		return ev
	}
	var stored []byte
	if cur != nil {
		stored = cur.Fingerprint
	}
	ev.Fingerprint = s.keyring.FingerprintFor(keyring.ID(id), stored, ev.Fingerprint)
	return ev
}

// singleLockWait bounds each statement of a Begin on its own that waits on
// another transaction's insert or change of its key (a RunTx running fn):
// the wait goes on in statements of at most this, and of no more than what
// is left of the caller's deadline, until the key is free or the caller's
// context ends. The statement commits by itself and is never cancelled
// (see commitTimeout), so these bounds are what keep a caller that gave up
// from acquiring the key afterwards: past its deadline never, after a
// cancel at most singleLockWait later.
const singleLockWait = 500 * time.Millisecond

// beginRead creates the key with ev's token, or reads its record: in a
// batch with concurrent Begins when batching is on, else on its own. A
// caller whose context has ended writes nothing: a queued request is
// dropped before its batch's statement runs, and the statement on its own
// does not start. A write that creates the key after its caller has gone
// is released (see Begin).
func (s *Store) beginRead(ctx context.Context, p *BeginParams, ev statemachine.Event) (rec statemachine.Record, inserted bool, now time.Time, found bool, err error) {
	if s.writes != nil {
		r := &beginReq{ctx: ctx, p: p, ev: ev, out: make(chan beginRes, 1)}
		if !s.writes.Submit(ctx, r) {
			return rec, false, now, false, submitErr(ctx)
		}
		var out beginRes
		select {
		case out = <-r.out:
		case <-ctx.Done():
			// The batch may be running r's write: if it creates the key,
			// it does so for a caller that has gone.
			go func() {
				if out := <-r.out; out.err == nil && out.inserted {
					s.releaseGone(ctx, p, out.rec)
				}
			}()
			return rec, false, now, false, ctx.Err()
		}
		if out.err != nil || out.found {
			return out.rec, out.inserted, out.now, out.found, out.err
		}
	}
	for first := true; ; first = false {
		// The first statement waits no longer than a batch would, so a
		// held key is soon remembered (s.held) and later Begins of it
		// leave their batches at once.
		lockWait := singleLockWait
		if first {
			lockWait = batchLockWait
		}
		if dl, ok := ctx.Deadline(); ok {
			lockWait = min(lockWait, time.Until(dl))
		}
		if err := ctx.Err(); err != nil || lockWait <= 0 {
			if err == nil {
				err = context.DeadlineExceeded
			}
			return rec, false, now, false, err
		}
		rec, inserted, now, found, err = s.insertOrRead(ctx, p.ID, &ev, lockWait, func(rec statemachine.Record) {
			s.releaseGone(ctx, p, rec)
		})
		if !isLockTimeout(err) {
			return rec, inserted, now, found, classify(err)
		}
		s.held.mark(p.ID, time.Now())
	}
}

// submitErr explains why a request could not be queued.
func submitErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return errStoreClosed
}

// Finish applies a Complete, Fail or Heartbeat (p.Event.Kind) under the
// record's row lock. An identity longer than MaxIdentityBytes is refused
// with ErrIdentityTooLong.
//
// A Complete by the holder of the lease takes one statement (without a
// keyring); anything else (a stale token, a repeat, a record that ended,
// and every Complete when responses are encrypted) takes the locked path,
// which decides with statemachine.
func (s *Store) Finish(ctx context.Context, p *FinishParams) (*Result, error) {
	if err := checkIdentity(p.ID); err != nil {
		return nil, err
	}
	ev := storedDurations(p.Event)
	// With a keyring the response is sealed bound to the record's
	// generation and attempt, which only the locked path reads first.
	if p.Event.Kind == statemachine.EventComplete && s.keyring == nil {
		res, err := s.completeHeld(ctx, p.ID, ev)
		if err != nil || res != nil {
			return res, err
		}
	}
	return s.locked(ctx, p.ID, ev, p.Policy)
}

// completeHeld applies a Complete to a record its token holds, or returns
// (nil, nil) when the record is not held by that token.
func (s *Store) completeHeld(ctx context.Context, id Identity, ev statemachine.Event) (*Result, error) {
	resp := ev.Response
	if resp == nil {
		resp = &statemachine.Response{}
	}
	stored, err := s.responseArgs(id, resp, nil)
	if err != nil {
		return nil, err
	}
	if s.writes != nil {
		r := &completeReq{ctx: ctx, id: id, ev: ev, response: stored, out: make(chan completeRes, 1)}
		if !s.writes.Submit(ctx, r) {
			return nil, submitErr(ctx)
		}
		select {
		case out := <-r.out:
			return out.res, out.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	res, err := s.completeHeldOne(ctx, id, ev.Token, stored)
	return res, classify(err)
}

// completeHeldOne runs the completeHeld statement for one record, with
// its response in stored form. It returns (nil, nil) when the token does
// not hold it. The statement commits by itself and is never cancelled by
// ctx (see commitTimeout).
func (s *Store) completeHeldOne(ctx context.Context, id Identity, token string, stored storedResponse) (*Result, error) {
	q := s.sql.completeHeld(id, token, stored, s.now())
	return detached(ctx, func(cctx context.Context) (*Result, error) {
		rec, now, err := s.scanFullRecordNow(s.pool.QueryRow(cctx, q.sql, q.args...), id)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		return &Result{Decision: statemachine.Decision{Write: statemachine.WriteUpdate, Record: rec, Exists: true}, Now: now}, nil
	})
}

// Lookup returns the record as in effect now, or statemachine.ErrNotFound.
func (s *Store) Lookup(ctx context.Context, id Identity) (statemachine.Record, time.Time, error) {
	q := s.sql.read(id, s.now())
	rec, now, err := s.scanFullRecordNow(s.pool.QueryRow(ctx, q.sql, q.args...), id)
	if errors.Is(err, pgx.ErrNoRows) {
		return statemachine.Record{}, time.Time{}, statemachine.ErrNotFound
	}
	if err != nil {
		return statemachine.Record{}, time.Time{}, classify(err)
	}
	return statemachine.Effective(rec, now), now, nil
}

// maxRaceRetries bounds how often a locked decision restarts because the row
// appeared or vanished between two statements.
const maxRaceRetries = 8

// locked takes the decision for ev under the row lock and applies it in the
// same transaction.
func (s *Store) locked(ctx context.Context, id Identity, ev statemachine.Event, pol statemachine.Policy) (*Result, error) {
	return s.lockedWith(ctx, id, ev, pol, lockedHooks{})
}

// lockedHooks are the optional parts of a locked decision.
type lockedHooks struct {
	// only, when set, is asked under the row lock about the record as
	// stored (nil: none); when it answers false, nothing is decided or
	// written, and the answer is (nil, nil).
	only func(cur *statemachine.Record) bool
	// late, when set, is called with the applied result when ctx ended
	// during the COMMIT and the commit then succeeded (the caller was
	// answered ctx's error).
	late func(*Result)
}

// lockedWith is locked with hooks. id has been checked (checkIdentity) by
// the exported method that leads here, once.
func (s *Store) lockedWith(ctx context.Context, id Identity, ev statemachine.Event, pol statemachine.Policy, h lockedHooks) (*Result, error) {
	for range maxRaceRetries {
		res, retry, err := s.lockedOnce(ctx, id, ev, pol, h)
		switch {
		case err != nil:
			return nil, classify(err)
		case res != nil && res.Err != nil:
			return nil, res.Err
		case !retry:
			return res, nil
		}
	}
	return nil, fmt.Errorf("%w: record %q changed too often under contention", ErrUnavailable, id.Key)
}

func (s *Store) lockedOnce(ctx context.Context, id Identity, ev statemachine.Event, pol statemachine.Policy, h lockedHooks) (res *Result, retry bool, err error) {
	// applied is the decision written, once fn has written it; late reads
	// it rather than the results, which the return below overwrites.
	var applied *Result
	var late func()
	if h.late != nil {
		late = func() {
			if applied != nil {
				h.late(applied)
			}
		}
	}
	err = withTxThen(ctx, s.pool, func(tx pgx.Tx) error {
		q := s.sql.lock(id, s.now())
		cur, now, err := s.scanFullRecordNow(tx.QueryRow(ctx, q.sql, q.args...), id)
		var curp *statemachine.Record
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			if now, err = s.txNow(ctx, tx); err != nil {
				return err
			}
		case err != nil:
			return err
		default:
			curp = &cur
		}
		if h.only != nil && !h.only(curp) {
			return nil // nothing to write; committing releases the lock
		}
		d := s.decide(id, curp, ev, pol, now)
		res = &Result{Decision: d, Now: now}
		if d.Err != nil {
			return nil //nolint:nilerr // a refusal writes nothing; committing releases the lock (res carries it)
		}
		switch d.Write {
		case statemachine.WriteInsert:
			cols, err := s.recordArgs(id, d.Record)
			if err != nil {
				return err
			}
			q := s.sql.insert(id, cols)
			tag, err := tx.Exec(ctx, q.sql, q.args...)
			if err != nil {
				return err
			}
			if tag.RowsAffected() == 0 {
				retry = true // another Begin created it meanwhile
			}
		case statemachine.WriteUpdate:
			cols, err := s.recordArgs(id, d.Record)
			if err != nil {
				return err
			}
			q := s.sql.update(id, cols)
			if _, err := tx.Exec(ctx, q.sql, q.args...); err != nil {
				return err
			}
		case statemachine.WriteDelete:
			q := s.sql.remove(id)
			if _, err := tx.Exec(ctx, q.sql, q.args...); err != nil {
				return err
			}
		}
		if !retry {
			applied = res
		}
		return nil
	}, late)
	if err != nil {
		return nil, false, err
	}
	return res, retry, nil
}

// txNow reads "now" inside tx when there is no row to read it with.
func (s *Store) txNow(ctx context.Context, tx pgx.Tx) (time.Time, error) {
	if n := s.now(); n != nil {
		return *n, nil
	}
	var now time.Time
	q := s.sql.clock()
	err := tx.QueryRow(ctx, q.sql, q.args...).Scan(&now)
	return now, err
}

// withTx runs fn in a transaction and commits it. On error it rolls back
// under context.WithoutCancel, so a cancelled call still releases its locks
// at once. The COMMIT itself is never cancelled by ctx (see commitTimeout):
// when ctx ends during it, withTx returns ctx's error and the commit goes
// on by itself.
func withTx(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) error) error {
	return withTxThen(ctx, pool, fn, nil)
}

// withTxThen is withTx, except that when ctx ends during the COMMIT and the
// commit then succeeds, late (if not nil) is called once it has.
func withTxThen(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) error, late func()) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return err
	}
	if err := ctx.Err(); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return err
	}
	var committedLate func(struct{}, error)
	if late != nil {
		committedLate = func(_ struct{}, err error) {
			if err == nil {
				late()
			}
		}
	}
	_, err = detachedThen(ctx, func(cctx context.Context) (struct{}, error) {
		return struct{}{}, tx.Commit(cctx)
	}, committedLate)
	return err
}

// hasParam reports whether a URL or DSN sets the named parameter.
func hasParam(databaseURL, name string) bool {
	return strings.Contains(databaseURL, name+"=")
}

// CountByState counts records by the state in effect now: an IN_PROGRESS
// record past its lease counts as UNKNOWN, a terminal record past
// expires_at as EXPIRED. It scans the whole table; call it sparingly (see
// StateCounts, which does not).
func (s *Store) CountByState(ctx context.Context) (map[statemachine.State]int64, error) {
	q := s.sql.countByState(s.now())
	rows, err := s.pool.Query(ctx, q.sql, q.args...)
	if err != nil {
		return nil, classify(err)
	}
	defer rows.Close()
	out := map[statemachine.State]int64{}
	for rows.Next() {
		var st int16
		var n int64
		if err := rows.Scan(&st, &n); err != nil {
			return nil, classify(err)
		}
		out[statemachine.State(st)] = n
	}
	return out, classify(rows.Err())
}

// detectDialect finds out what database pool reaches: Citus when it has
// the citus extension and the records table is distributed, PostgreSQL
// otherwise (a Citus database migrated before the extension existed keeps
// a local records table, which the PostgreSQL statements serve).
func detectDialect(ctx context.Context, pool *pgxpool.Pool) (dialect, error) {
	var installed, distributed bool
	if err := pool.QueryRow(ctx, citusInstalledSQL).Scan(&installed); err != nil || !installed {
		return postgreSQL, err
	}
	if err := pool.QueryRow(ctx, citusDistributedSQL).Scan(&distributed); err != nil || !distributed {
		return postgreSQL, err
	}
	return citus, nil
}

// citusNodes lists the Citus cluster's primary nodes other than the
// coordinator node (the workers, active ones) as connection
// configurations: base with each node's host and port. Record changes
// notify on the node that holds the record.
func citusNodes(ctx context.Context, pool *pgxpool.Pool, base *pgx.ConnConfig) ([]*pgx.ConnConfig, error) {
	rows, err := pool.Query(ctx, citusNodesSQL)
	if err != nil {
		return nil, err
	}
	type node struct {
		Host string
		Port int32
	}
	nodes, err := pgx.CollectRows(rows, pgx.RowToStructByPos[node])
	if err != nil {
		return nil, err
	}
	confs := make([]*pgx.ConnConfig, 0, len(nodes))
	for _, nd := range nodes {
		c := base.Copy()
		c.Host, c.Port, c.Fallbacks = nd.Host, uint16(nd.Port), nil
		if c.TLSConfig != nil {
			c.TLSConfig = c.TLSConfig.Clone()
			c.TLSConfig.ServerName = nd.Host
		}
		confs = append(confs, c)
	}
	return confs, nil
}
