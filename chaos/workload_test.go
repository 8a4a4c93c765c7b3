package chaos

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// workload runs Begin/Complete pairs from several goroutines on a pool of
// contended keys while a test injects faults, records what every call
// answered, and afterwards checks what callers were promised:
//   - every acknowledged Complete reads back COMPLETED with exactly its body;
//   - every replay carried the body the record finally holds;
//   - no key had two lease tokens proven valid over overlapping windows;
//   - every key whose holder died reads UNKNOWN once its lease ran out, is
//     taken over (ACQUIRED, previous_state UNKNOWN), and the dead holder's
//     token is fenced off (LEASE_LOST);
//   - every acquisition and the record after the run carry a checkpoint
//     that a holder of the key sent, and one whenever some holder's
//     checkpoint was acknowledged before that Begin started (a holder that
//     heartbeats records the step "step", and some holders record one
//     before they die);
//   - every stored row is a consistent state (checked with SQL);
//   - no call was answered INTERNAL or took longer than its deadline.
//
// The body a holder stores is "<key>|<token>", so a row whose body does not
// name its own lease token is a half-written record.
type workload struct {
	t      *testing.T
	client idempotencyv1.CoordinatorClient
	scope  string
	// lease is the lease every Begin asks for.
	lease time.Duration
	// callTimeout is every call's deadline.
	callTimeout time.Duration
	// retryBudget is how long a caller retries a call answered UNAVAILABLE
	// (or DEADLINE_EXCEEDED) before it gives up, as the Go client would.
	retryBudget time.Duration
	// dieChance is the share of holders that die after acquiring (no
	// Complete, no Heartbeat); slowChance the share that outlive their
	// lease before completing; heartbeatChance the share that heartbeat
	// once while working.
	dieChance, slowChance, heartbeatChance float64

	slots   []atomic.Int64 // current generation of each key slot
	stopped atomic.Bool
	wg      sync.WaitGroup

	mu         sync.Mutex
	holds      []*hold
	replays    []replay
	calls      map[string]map[codes.Code]int // method → code → count
	ops        int
	okTimes    []time.Time // when each successful call returned (for recovery times)
	maxLatency time.Duration
	overdue    int // calls that took longer than their deadline plus slack
	violations []string
}

// hold is one acquisition: a lease token with the window in which it was
// proven valid.
type hold struct {
	key, token string
	prev       idempotencyv1.State
	// beganAt is when the first try of the Begin that acquired started.
	beganAt time.Time
	// acquiredAt is when the Begin that acquired returned: the token was
	// valid at some moment before it.
	acquiredAt time.Time
	// provenAt is the start of the latest call (Heartbeat, or the first try
	// of an acknowledged Complete) whose success proves the token valid at
	// some moment after it; zero when nothing proved it after acquisition.
	provenAt time.Time
	died     bool // the holder died holding it
	acked    bool // a Complete with it was acknowledged
	lost     bool // a call with it was answered LEASE_LOST
	unsure   bool // its Complete never got an answer
	retried  bool // its Complete was acknowledged only after a retry
	body     []byte
	// found is the checkpoint the acquiring Begin returned (nil: none).
	found *idempotencyv1.Checkpoint
	// ckSent: the holder sent a checkpoint naming its token; ckAckedAt is
	// when the coordinator acknowledged it (zero: not acknowledged).
	ckSent    bool
	ckAckedAt time.Time
}

type replay struct {
	key  string
	body []byte
}

// workloadOptions tunes a workload; zero fields take the defaults.
type workloadOptions struct {
	scope       string
	slots       int
	lease       time.Duration
	callTimeout time.Duration
	retryBudget time.Duration
	dieChance   float64
	slowChance  float64
}

func newWorkload(t *testing.T, client idempotencyv1.CoordinatorClient, o workloadOptions) *workload {
	if o.scope == "" {
		o.scope = "chaos"
	}
	if o.slots == 0 {
		o.slots = 16
	}
	if o.lease == 0 {
		o.lease = time.Second
	}
	if o.callTimeout == 0 {
		o.callTimeout = 2 * time.Second
	}
	if o.retryBudget == 0 {
		o.retryBudget = 20 * time.Second
	}
	return &workload{t: t, client: client, scope: o.scope, lease: o.lease, callTimeout: o.callTimeout,
		retryBudget: o.retryBudget, dieChance: o.dieChance, slowChance: o.slowChance, heartbeatChance: 0.3,
		slots: make([]atomic.Int64, o.slots), calls: map[string]map[codes.Code]int{}}
}

// start runs n workers until stop.
func (w *workload) start(n int, seed uint64) {
	for i := range n {
		w.wg.Go(func() {
			w.worker(i, rand.New(rand.NewPCG(seed, uint64(i))))
		})
	}
}

// stop asks the workers to end and waits for them; a holder still retrying
// its Complete finishes first.
func (w *workload) stop() {
	w.stopped.Store(true)
	w.wg.Wait()
}

func (w *workload) violatef(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.violations) < 50 {
		w.violations = append(w.violations, fmt.Sprintf(format, args...))
	}
}

// ambiguous reports whether err leaves the call's effect unknown, so a
// caller retries it.
func ambiguous(err error) bool {
	c := status.Code(err)
	return c == codes.Unavailable || c == codes.DeadlineExceeded
}

// call runs one RPC under the workload's deadline, counts its answer and
// flags INTERNAL, UNKNOWN and overdue answers.
func (w *workload) call(method string, fn func(ctx context.Context) error) (start time.Time, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), w.callTimeout)
	defer cancel()
	start = time.Now()
	err = fn(ctx)
	took := time.Since(start)
	c := status.Code(err)
	w.mu.Lock()
	w.ops++
	if w.calls[method] == nil {
		w.calls[method] = map[codes.Code]int{}
	}
	w.calls[method][c]++
	w.maxLatency = max(w.maxLatency, took)
	if took > w.callTimeout+250*time.Millisecond {
		w.overdue++
	}
	if err == nil {
		w.okTimes = append(w.okTimes, time.Now())
	}
	w.mu.Unlock()
	if c == codes.Internal || c == codes.Unknown {
		w.violatef("%s answered %v", method, err)
	}
	return start, err
}

// retry repeats fn while its answer is ambiguous, for up to the retry
// budget (and, when stoppable, only until the workload stops). It returns
// the start of the first try, the number of tries and the last answer.
func (w *workload) retry(method string, stoppable bool, fn func(ctx context.Context) error) (first time.Time, tries int, err error) {
	deadline := time.Now().Add(w.retryBudget)
	for try := 0; ; try++ {
		start, err := w.call(method, fn)
		if try == 0 {
			first = start
		}
		if !ambiguous(err) || time.Now().After(deadline) || (stoppable && w.stopped.Load()) {
			return first, try + 1, err
		}
		time.Sleep(time.Duration(20+try*10%100) * time.Millisecond)
	}
}

func (w *workload) key(slot int, gen int64) string { return fmt.Sprintf("slot%02d-gen%d", slot, gen) }

func bodyFor(key, token string) []byte { return []byte(key + "|" + token) }

func (w *workload) worker(id int, rng *rand.Rand) {
	for seq := 0; !w.stopped.Load(); seq++ {
		slot := rng.IntN(len(w.slots))
		gen := w.slots[slot].Load()
		key := w.key(slot, gen)
		var resp *idempotencyv1.BeginResponse
		attemptID := fmt.Sprintf("w%d-%d", id, seq)
		began, _, err := w.retry("Begin", true, func(ctx context.Context) error {
			var err error
			resp, err = w.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: w.scope, Key: key,
				Lease: durationpb.New(w.lease), AttemptId: attemptID})
			return err
		})
		acquiredAt := time.Now()
		switch {
		case err != nil:
			if !ambiguous(err) {
				w.violatef("Begin %s: %v", key, err)
			}
			time.Sleep(time.Duration(10+rng.IntN(40)) * time.Millisecond)
		case resp.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED:
			w.work(&hold{key: key, token: resp.GetLeaseToken(), prev: resp.GetPreviousState(), beganAt: began, acquiredAt: acquiredAt,
				found: resp.GetRecord().GetCheckpoint()}, rng)
		case resp.GetOutcome() == idempotencyv1.Outcome_OUTCOME_REPLAY:
			w.mu.Lock()
			w.replays = append(w.replays, replay{key: key, body: resp.GetRecord().GetResponse().GetBody()})
			w.mu.Unlock()
			w.slots[slot].CompareAndSwap(gen, gen+1)
		case resp.GetOutcome() == idempotencyv1.Outcome_OUTCOME_IN_PROGRESS:
			time.Sleep(time.Duration(10+rng.IntN(40)) * time.Millisecond)
		default:
			w.violatef("Begin %s answered %v", key, resp)
		}
	}
}

// work plays a holder: it dies, or works (perhaps past its lease, perhaps
// heartbeating) and completes.
func (w *workload) work(h *hold, rng *rand.Rand) {
	w.mu.Lock()
	w.holds = append(w.holds, h)
	w.mu.Unlock()
	if h.token == "" {
		w.violatef("Begin %s acquired without a token", h.key)
		return
	}
	if rng.Float64() < w.dieChance {
		if rng.IntN(2) == 0 {
			// It finished a step, recorded it, and died.
			_, _ = w.checkpoint(h)
		}
		h.died = true
		return
	}
	work := time.Duration(rng.IntN(30)) * time.Millisecond
	if rng.Float64() < w.slowChance {
		work = w.lease + time.Duration(100+rng.IntN(400))*time.Millisecond
	} else if rng.Float64() < w.heartbeatChance {
		time.Sleep(work / 2)
		start, err := w.checkpoint(h)
		switch {
		case err == nil:
			h.provenAt = start
		case reasonOf(err) == "LEASE_LOST":
			h.lost = true
			return
		case !ambiguous(err):
			w.violatef("Heartbeat %s: %v", h.key, err)
		}
	}
	time.Sleep(work)
	body := bodyFor(h.key, h.token)
	var resp *idempotencyv1.CompleteResponse
	first, tries, err := w.retry("Complete", false, func(ctx context.Context) error {
		var err error
		resp, err = w.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: w.scope, Key: h.key,
			LeaseToken: h.token, Response: &idempotencyv1.StoredResponse{Body: body}})
		return err
	})
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case err == nil:
		h.acked, h.body, h.provenAt, h.retried = true, body, first, tries > 1
		if r := resp.GetRecord(); r.GetState() != idempotencyv1.State_STATE_COMPLETED || !bytes.Equal(r.GetResponse().GetBody(), body) {
			w.violations = append(w.violations, fmt.Sprintf("Complete %s acknowledged with record %v", h.key, r))
		}
	case reasonOf(err) == "LEASE_LOST":
		h.lost = true
	case ambiguous(err):
		h.unsure = true
	default:
		w.violations = append(w.violations, fmt.Sprintf("Complete %s: %v", h.key, err))
	}
}

// checkpoint records the step h finished with a Heartbeat (its data names
// the key and the token) and returns the call's start and answer.
func (w *workload) checkpoint(h *hold) (time.Time, error) {
	h.ckSent = true
	start, err := w.call("Heartbeat", func(ctx context.Context) error {
		_, err := w.client.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: w.scope, Key: h.key,
			LeaseToken: h.token, Lease: durationpb.New(w.lease),
			Checkpoint: &idempotencyv1.Checkpoint{Phase: "step", Data: bodyFor(h.key, h.token)}})
		return err
	})
	if err == nil {
		h.ckAckedAt = time.Now()
	}
	return start, err
}

// checkCheckpoints checks the checkpoint every acquisition (holds) and
// every key's record after the run (final) carried: one a holder of the
// key sent (never another key's, never the acquisition's own), and one at
// all whenever a holder's checkpoint of the key was acknowledged before
// the Begin started (or, for final, at all).
func (w *workload) checkCheckpoints(holds []*hold, final map[string]*idempotencyv1.Record, r *results) {
	byKey := map[string][]*hold{}
	for _, h := range holds {
		byKey[h.key] = append(byKey[h.key], h)
		if !h.ckAckedAt.IsZero() {
			r.checkpoints++
		}
	}
	// sent reports whether c is the checkpoint that a holder of key
	// (other than the token not) sent.
	sent := func(key string, c *idempotencyv1.Checkpoint, not string) bool {
		for _, g := range byKey[key] {
			if g.ckSent && g.token != not && c.GetPhase() == "step" && bytes.Equal(c.GetData(), bodyFor(key, g.token)) {
				return true
			}
		}
		return false
	}
	ackedBefore := func(key string, t time.Time) bool {
		for _, g := range byKey[key] {
			if !g.ckAckedAt.IsZero() && g.ckAckedAt.Before(t) {
				return true
			}
		}
		return false
	}
	for _, h := range holds {
		switch {
		case h.found != nil && !sent(h.key, h.found, h.token):
			w.violatef("the Begin that acquired %s (token %s) returned checkpoint %v, which no other holder of the key sent", h.key, h.token, h.found)
		case h.found == nil && ackedBefore(h.key, h.beganAt):
			w.violatef("the Begin that acquired %s from %v returned no checkpoint, though one was acknowledged before it started", h.key, h.prev)
		case h.found != nil:
			r.resumed++
		}
	}
	for key, rec := range final {
		c := rec.GetCheckpoint()
		switch {
		case c != nil && !sent(key, c, ""):
			w.violatef("%s ended with checkpoint %v, which no holder of the key sent", key, c)
		case c == nil && ackedBefore(key, time.Now()):
			w.violatef("%s ended without a checkpoint, though one was acknowledged", key)
		}
	}
}

func reasonOf(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// lookup reads a record, retrying while the answer is ambiguous.
func (w *workload) lookup(key string) (*idempotencyv1.Record, error) {
	var resp *idempotencyv1.LookupResponse
	_, _, err := w.retry("Lookup", false, func(ctx context.Context) error {
		var err error
		resp, err = w.client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: w.scope, Key: key})
		return err
	})
	return resp.GetRecord(), err
}

// results are a workload's figures after verify.
type results struct {
	ops, acked, ackedAfterRetry, unanswered        int
	checked, lost, doubleLease, replays            int
	died, diedThenUnknown, unknown, takenOver      int
	takenOverInLoad, fenced                        int
	checkpoints, resumed                           int
	rows, badRows, unavailable, deadline, internal int
	maxLatency                                     time.Duration
	overdue                                        int
}

func (r results) String() string {
	return fmt.Sprintf("ops=%d acked=%d (after a retry %d) unanswered_completes=%d checked=%d lost=%d double_lease=%d replays=%d died=%d died_then_unknown=%d unknown_at_end=%d taken_over=%d (in load %d) fenced=%d checkpoints=%d resumed_from_checkpoint=%d rows=%d bad_rows=%d unavailable=%d deadline_exceeded=%d internal=%d max_call=%v overdue=%d",
		r.ops, r.acked, r.ackedAfterRetry, r.unanswered, r.checked, r.lost, r.doubleLease, r.replays, r.died, r.diedThenUnknown, r.unknown, r.takenOver+r.takenOverInLoad,
		r.takenOverInLoad, r.fenced, r.checkpoints, r.resumed, r.rows, r.badRows, r.unavailable, r.deadline, r.internal, r.maxLatency.Round(time.Millisecond), r.overdue)
}

// verify checks the promises after stop, with the service up. dbURL
// reaches the database directly, for the SQL checks. It reports every
// violation as a test error and returns the figures.
func (w *workload) verify(dbURL string) results {
	t := w.t
	t.Helper()
	var r results

	// Let every lease run out: nobody works any more.
	time.Sleep(w.lease + 300*time.Millisecond)

	final := map[string]*idempotencyv1.Record{} // key → record after the run
	byKey := map[string][]*hold{}
	w.mu.Lock()
	holds := append([]*hold(nil), w.holds...)
	replays := append([]replay(nil), w.replays...)
	w.mu.Unlock()
	for _, h := range holds {
		byKey[h.key] = append(byKey[h.key], h)
		if h.died {
			r.died++
		}
		if h.prev == idempotencyv1.State_STATE_UNKNOWN {
			r.takenOverInLoad++
		}
	}
	// Every key that has a row, including those only a lost Begin reply
	// created.
	keys := w.storedKeys(dbURL)
	for k := range byKey {
		keys[k] = true
	}

	// Keys left UNKNOWN (a dead holder, a lost Begin reply, an unanswered
	// Complete) are taken over now, and their old tokens must be fenced.
	for key := range keys {
		rec, err := w.lookup(key)
		if err != nil {
			w.violatef("Lookup %s after the run: %v", key, err)
			continue
		}
		switch rec.GetState() {
		case idempotencyv1.State_STATE_COMPLETED:
		case idempotencyv1.State_STATE_UNKNOWN:
			r.unknown++
			w.takeOver(key, &r)
			if rec, err = w.lookup(key); err != nil {
				w.violatef("Lookup %s after takeover: %v", key, err)
				continue
			}
		default:
			w.violatef("%s is %v after every lease ran out, want COMPLETED or UNKNOWN", key, rec.GetState())
		}
		final[key] = rec
	}

	// Acknowledged writes.
	for _, h := range holds {
		if h.unsure {
			r.unanswered++
		}
		if !h.acked {
			continue
		}
		r.acked++
		if h.retried {
			r.ackedAfterRetry++
		}
		rec := final[h.key]
		if rec.GetState() != idempotencyv1.State_STATE_COMPLETED || !bytes.Equal(rec.GetResponse().GetBody(), h.body) {
			r.lost++
			w.violatef("acknowledged Complete of %s (body %q) lost: record now %v", h.key, h.body, rec)
			continue
		}
		r.checked++
	}
	// Replays carried what the record holds.
	for _, rp := range replays {
		r.replays++
		if got := final[rp.key].GetResponse().GetBody(); !bytes.Equal(got, rp.body) {
			w.violatef("replay of %s carried %q, the record holds %q", rp.key, rp.body, got)
		}
	}
	w.mu.Lock()
	holds = append([]*hold(nil), w.holds...) // with the takeovers
	w.mu.Unlock()
	w.checkCheckpoints(holds, final, &r)
	doubles := doubleLeases(holds)
	for _, d := range doubles {
		t.Error(d)
	}
	r.doubleLease = len(doubles)
	w.checkDeadHolders(holds, &r)

	r.rows, r.badRows = checkRows(t, dbURL, w.scope, true)

	w.mu.Lock()
	r.ops = w.ops
	for _, byCode := range w.calls {
		r.unavailable += byCode[codes.Unavailable]
		r.deadline += byCode[codes.DeadlineExceeded]
		r.internal += byCode[codes.Internal] + byCode[codes.Unknown]
	}
	r.maxLatency, r.overdue = w.maxLatency, w.overdue
	violations := w.violations
	w.mu.Unlock()
	for _, v := range violations {
		t.Error("violation: " + v)
	}
	if r.lost > 0 || r.doubleLease > 0 || r.badRows > 0 || r.internal > 0 || r.overdue > 0 {
		t.Errorf("results: %v", r)
	}
	return r
}

// takeOver acquires an UNKNOWN key, which must answer ACQUIRED with
// previous_state UNKNOWN, and completes it.
func (w *workload) takeOver(key string, r *results) {
	var resp *idempotencyv1.BeginResponse
	began, _, err := w.retry("Begin", false, func(ctx context.Context) error {
		var err error
		resp, err = w.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: w.scope, Key: key, Lease: durationpb.New(w.lease)})
		return err
	})
	if err != nil || resp.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || resp.GetPreviousState() != idempotencyv1.State_STATE_UNKNOWN {
		w.violatef("takeover of UNKNOWN %s: %v, %v", key, resp, err)
		return
	}
	h := &hold{key: key, token: resp.GetLeaseToken(), prev: resp.GetPreviousState(), beganAt: began, acquiredAt: time.Now(),
		found: resp.GetRecord().GetCheckpoint()}
	w.mu.Lock()
	w.holds = append(w.holds, h)
	w.mu.Unlock()
	body := bodyFor(key, h.token)
	first, _, err := w.retry("Complete", false, func(ctx context.Context) error {
		_, err := w.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: w.scope, Key: key, LeaseToken: h.token,
			Response: &idempotencyv1.StoredResponse{Body: body}})
		return err
	})
	if err != nil {
		w.violatef("Complete after takeover of %s: %v", key, err)
		return
	}
	w.mu.Lock()
	h.acked, h.body, h.provenAt = true, body, first
	w.mu.Unlock()
	r.takenOver++
}

// checkDeadHolders checks that the next acquisition of every key whose
// holder died (or lost its lease) found it UNKNOWN, and that the old token
// is now refused with LEASE_LOST: a late worker never overwrites its
// successor's result.
func (w *workload) checkDeadHolders(holds []*hold, r *results) {
	byKey := map[string][]*hold{}
	for _, h := range holds {
		byKey[h.key] = append(byKey[h.key], h)
	}
	for _, hs := range byKey {
		sort.Slice(hs, func(i, j int) bool { return hs[i].acquiredAt.Before(hs[j].acquiredAt) })
		for i, h := range hs {
			if !h.died && !h.lost {
				continue
			}
			if h.died {
				if i+1 == len(hs) {
					w.violatef("the key %s of a dead holder was never acquired again", h.key)
				} else if next := hs[i+1]; next.prev != idempotencyv1.State_STATE_UNKNOWN {
					w.violatef("the key %s of a dead holder was next acquired from %v, want UNKNOWN", h.key, next.prev)
				} else {
					r.diedThenUnknown++
				}
			}
			_, _, err := w.retry("Complete", false, func(ctx context.Context) error {
				_, err := w.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: w.scope, Key: h.key, LeaseToken: h.token,
					Response: &idempotencyv1.StoredResponse{Body: []byte("late")}})
				return err
			})
			if reasonOf(err) != "LEASE_LOST" {
				w.violatef("the superseded token of %s answered %v, want LEASE_LOST", h.key, err)
				continue
			}
			r.fenced++
		}
	}
}

// storedKeys lists the keys of the workload's scope that have a row.
func (w *workload) storedKeys(dbURL string) map[string]bool {
	conn := sqlConn(w.t, dbURL)
	rows, err := conn.Query(context.Background(), `SELECT key FROM idempotency_records WHERE scope = $1`, w.scope)
	if err != nil {
		w.t.Fatal(err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		w.t.Fatal(err)
	}
	out := map[string]bool{}
	for _, k := range keys {
		out[k] = true
	}
	return out
}

// doubleLeases lists pairs of different tokens of one key that were both
// proven valid over overlapping windows. A token is valid from its
// acquisition until the next acquisition of the key, one unbroken stretch;
// it was valid at some moment up to acquiredAt and at some moment from
// provenAt on, so it was valid all through [acquiredAt, provenAt]. Two such
// windows of one key that overlap mean two tokens were valid at once.
func doubleLeases(holds []*hold) []string {
	byKey := map[string][]*hold{}
	for _, h := range holds {
		if !h.provenAt.IsZero() && h.provenAt.After(h.acquiredAt) {
			byKey[h.key] = append(byKey[h.key], h)
		}
	}
	var out []string
	for key, hs := range byKey {
		sort.Slice(hs, func(i, j int) bool { return hs[i].acquiredAt.Before(hs[j].acquiredAt) })
		for i := range hs {
			for j := i + 1; j < len(hs); j++ {
				a, b := hs[i], hs[j]
				if a.token != b.token && b.acquiredAt.Before(a.provenAt) {
					out = append(out, fmt.Sprintf("double lease on %s: token %s valid over [%v, %v], token %s over [%v, %v]", key,
						a.token, a.acquiredAt.Format(time.StampMicro), a.provenAt.Format(time.StampMicro),
						b.token, b.acquiredAt.Format(time.StampMicro), b.provenAt.Format(time.StampMicro)))
				}
			}
		}
	}
	return out
}

// checkRows reads every row of scope with SQL and counts those that are not
// a consistent state: an IN_PROGRESS row without a lease or token, a
// COMPLETED row without a response or expiry, and so on. With bodyNamesToken
// (workloads that store "<key>|<token>"), a COMPLETED row's body must name
// the row's own key and lease token.
func checkRows(t *testing.T, dbURL, scope string, bodyNamesToken bool) (rows, bad int) {
	conn := sqlConn(t, dbURL)
	rs, err := conn.Query(context.Background(), `SELECT key, state, lease_token, has_response, body,
		lease_expires_at IS NOT NULL, expires_at IS NOT NULL, ended_by
		FROM idempotency_records WHERE scope = $1`, scope)
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	for rs.Next() {
		var (
			key, token            string
			state, endedBy        int16
			hasResponse, hasLease bool
			hasExpiry             bool
			body                  []byte
		)
		if err := rs.Scan(&key, &state, &token, &hasResponse, &body, &hasLease, &hasExpiry, &endedBy); err != nil {
			t.Fatal(err)
		}
		rows++
		var why []string
		check := func(ok bool, what string) {
			if !ok {
				why = append(why, what)
			}
		}
		switch state {
		case 1: // IN_PROGRESS
			check(hasLease && token != "", "held without a lease or token")
			check(!hasResponse && !hasExpiry && endedBy == 0, "held but carries an ending")
		case 2: // COMPLETED
			check(hasResponse && body != nil, "no response")
			check(hasExpiry && !hasLease, "no expiry, or a lease")
			check(endedBy == 5 || endedBy == 6, "not ended by Complete or Resolve")
			if bodyNamesToken && endedBy == 5 {
				check(bytes.Equal(body, bodyFor(key, token)), fmt.Sprintf("body %q does not name its token %q", body, token))
			}
		case 3: // FAILED_RETRYABLE
			check(hasExpiry && !hasLease, "no expiry, or a lease")
		case 4: // FAILED_REPLAYABLE
			check(hasResponse && hasExpiry && !hasLease, "no response or expiry, or a lease")
		case 5: // EXPIRED
			check(!hasResponse && body == nil, "keeps a response")
		case 6: // UNKNOWN
			check(!hasLease && !hasExpiry, "has a lease or an expiry")
		default:
			why = append(why, "state out of range")
		}
		if len(why) > 0 {
			bad++
			t.Errorf("half-written row %s/%s (state %d): %s", scope, key, state, strings.Join(why, "; "))
		}
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	return rows, bad
}

// recoveredAfter returns how long after t0 the first call succeeded.
func (w *workload) recoveredAfter(t0 time.Time) (time.Duration, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, ok := range w.okTimes {
		if ok.After(t0) {
			return ok.Sub(t0), true
		}
	}
	return 0, false
}
