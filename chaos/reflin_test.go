package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// refConfig is the coordinator's policy in TestLinearizableReference; the
// model's policies (refPolicies) say the same. failure_ttl and the
// reaper's retention are short, so records expire and expired rows are
// deleted during the run: the "hold" keys cycle instead of answering
// KEY_EXPIRED for the rest of the run.
const refConfig = `
defaults: { failure_ttl: 3s }
reaper: { interval: 0s, expired_retention: 2s }
scopes:
  - { match: "hold", on_unknown: hold, max_attempts: 3, on_expired: reject, failure_ttl: 1s }
  - { match: "cap", max_attempts: 2 }
`

const refRetention = 2 * time.Second

var refPolicies = map[string]refPolicy{
	"free": {failureTTL: 3 * time.Second},
	"hold": {hold: true, maxAttempts: 3, reject: true, failureTTL: time.Second},
	"cap":  {maxAttempts: 2, failureTTL: 3 * time.Second},
}

var refKeys = [][2]string{{"free", "a"}, {"free", "b"}, {"hold", "a"}, {"hold", "b"}, {"cap", "a"}}

// refMinLostReplies is the least number of calls per run that must be shown
// to have taken effect although their caller got no answer (the commit
// done, reply lost window); fewer means the faults missed the commits.
const refMinLostReplies = 10

// TestLinearizableReference records per-key histories of every call of the
// API — Begin with and without wait and with repeated attempt_ids,
// Complete, Fail of every kind, Heartbeat with and without a checkpoint
// (some with a token a takeover fenced off, some out of bounds, some
// followed by the holder's Fail ABANDONED), Lookup, Admin Resolve and
// Forget — and of reaper passes, from concurrent clients while a proxy cuts
// the coordinator's database connections at random and PostgreSQL is killed
// and restarted, and checks with porcupine that every key's history is
// linearizable with respect to the reference model of refmodel_test.go,
// which is written from the state table of docs/concepts.md and shares no
// code with statemachine.
//
// The coordinator runs in-process on a fake clock that moves during the
// rounds, so leases lapse and records expire while calls are in flight: a
// call acted at one of the clock readings seen between its start and its
// answer (or the end of its round, when unanswered), and the model tries
// each. At the end every key is read back with faults off. The test fails
// unless every row of the state table (refTableRows) was exercised and at
// least refMinLostReplies unanswered calls are shown to have taken effect;
// it logs the coverage of each row, and of the checkpoint's rules
// (refCheckpointRows) on a line of their own.
func TestLinearizableReference(t *testing.T) {
	v := newRefVerdict(t)
	s := seed(t)
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	dbURL := cluster.URL("postgres")
	runLinearizableReference(t, s, v, refDatabase{url: dbURL, name: "postgres",
		kill: func(int) error {
			if err := cluster.Kill(); err != nil {
				return err
			}
			return cluster.Start()
		},
		settle: func() { waitNoOpenTransactions(t, dbURL) }})
}

// TestCitusLinearizableReference is TestLinearizableReference with the
// records on a Citus cluster of two workers: the proxy cuts the
// coordinator's connections to the Citus coordinator node, and a kill
// round kills one worker (SIGKILL) and starts it again, the two in turn
// (the reference keys live on both: checked).
// It runs a fixed number of rounds, 80 (make test-citus) or 200
// (make chaos), and checks the histories without requiring the state
// table's coverage: covering it took 450 rounds, ten minutes, in one run.
func TestCitusLinearizableReference(t *testing.T) {
	requireCitusRun(t)
	v := newRefVerdict(t)
	s := seed(t)
	cc := pgtest.StartCitusCluster(t, pgtest.ClusterOptions{})
	if err := cc.CreateDatabase(context.Background(), "idemcoord"); err != nil {
		t.Fatal(err)
	}
	dbURL := cc.URL("idemcoord")
	if err := ledger.Migrate(context.Background(), dbURL); err != nil {
		t.Fatal(err)
	}
	// The worker kills hit calls only if the keys live on both workers.
	var workers int
	if err := sqlConn(t, dbURL).QueryRow(context.Background(), `SELECT count(DISTINCT nodeport) FROM pg_dist_shard_placement
		WHERE shardid IN (SELECT get_shard_id_for_distribution_column('idempotency_records', k) FROM unnest($1::text[]) AS k)`,
		refKeyNames()).Scan(&workers); err != nil {
		t.Fatal(err)
	}
	if workers != len(cc.Workers) {
		t.Fatalf("the reference keys %v live on %d of the %d workers", refKeyNames(), workers, len(cc.Workers))
	}
	kills := 0
	runLinearizableReference(t, s, v, refDatabase{url: dbURL, name: "citus",
		// A round takes about a second on Citus, three times as long as on
		// PostgreSQL: the short run is 80 rounds, about two minutes.
		rounds: byMode(80, 200),
		kill: func(int) error {
			w := cc.Workers[kills%len(cc.Workers)]
			kills++
			if err := w.Kill(); err != nil {
				return err
			}
			return w.Start()
		},
		settle: func() {
			waitNoOpenTransactions(t, dbURL)
			for _, w := range cc.Workers {
				waitNoCitusTransactions(t, w.URL("idemcoord"))
			}
		}})
}

// refKeyNames returns the distinct keys of refKeys.
func refKeyNames() []string {
	var names []string
	for _, k := range refKeys {
		if !slices.Contains(names, k[1]) {
			names = append(names, k[1])
		}
	}
	return names
}

// refDatabase is the database a reference run uses: its URL (migrated by
// the run), how a kill round kills and restarts it, and how a round waits
// until no transaction of the coordinator is open on it. rounds, when not
// zero, fixes the number of rounds, and the run then checks the histories
// without requiring that every row of the state table was exercised.
type refDatabase struct {
	url, name string
	kill      func(round int) error
	settle    func()
	rounds    int
}

// refVerdict is what a reference run found wrong, and after how many
// rounds; newRefVerdict registers it before the database starts, so that on
// failure it is printed after the database's logs, as the run's last line.
type refVerdict struct {
	what   []string
	rounds int
}

func newRefVerdict(t *testing.T) *refVerdict {
	v := &refVerdict{}
	lastWords(t, func() string {
		return fmt.Sprintf("after %d rounds: %s", v.rounds, strings.Join(v.what, "; "))
	})
	return v
}

func runLinearizableReference(t *testing.T, s uint64, v *refVerdict, db refDatabase) {
	dbURL := db.url
	if err := ledger.Migrate(context.Background(), dbURL); err != nil {
		t.Fatal(err)
	}
	proxy, proxiedURL := newDatabaseProxy(t, dbURL, s)
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: proxiedURL, FakeClock: true, Config: refConfig,
		ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})
	run := newRefRunner(t, c, s)
	h := run.h

	// The run goes on until every row of the table was exercised and the
	// lost-reply window was hit often enough (checked every 50 rounds from
	// minRounds on), or maxRounds, when it fails.
	minRounds, maxRounds := byMode(150, 1500), byMode(800, 3000)
	if db.rounds > 0 {
		minRounds, maxRounds = db.rounds, db.rounds
	}
	killRounds := map[int]bool{minRounds / 3: true, 2 * minRounds / 3: true}
	if long() {
		for r := 10; r < maxRounds; r += 50 {
			killRounds[r] = true
		}
	}
	proxy.SetCutChance(0.03)
	pgKills := 0
	var (
		ops       []porcupine.Operation
		res       porcupine.CheckResult
		info      porcupine.LinearizationInfo
		rows      map[string]int
		lost      int
		missing   []string
		checkTime time.Duration
	)
	check := func() bool {
		startCheck := time.Now()
		ops, res, info = h.check()
		took := time.Since(startCheck)
		checkTime += took
		t.Logf("chaos: reference: checked %d calls after %d rounds in %v: %s", len(ops), v.rounds, took.Round(time.Millisecond), res)
		if res != porcupine.Ok {
			return true
		}
		var lins [][]porcupine.Operation
		for _, p := range info.PartialLinearizationsOperations() {
			if len(p) > 0 {
				lins = append(lins, p[0])
			}
		}
		rows, lost, _ = refCoverage(lins)
		missing = missing[:0]
		for _, r := range refTableRows {
			if rows[r] == 0 {
				missing = append(missing, r)
			}
		}
		return len(missing) == 0 && lost >= refMinLostReplies
	}
	for round := range maxRounds {
		run.round(nil, func() {
			if round%7 == 3 {
				proxy.CutAll()
			}
			if killRounds[round] {
				if err := db.kill(round); err != nil {
					t.Fatal(err)
				}
				pgKills++
			}
			db.settle()
			waitCutBackendsGone(t, dbURL, proxy)
		})
		v.rounds = round + 1
		if v.rounds >= minRounds && v.rounds%50 == 0 {
			if check() {
				break
			}
			t.Logf("chaos: reference: after %d rounds: %d rows not yet exercised (%s), %d lost replies shown", v.rounds, len(missing), strings.Join(missing, "; "), lost)
		}
	}
	proxy.SetCutChance(0)
	run.clients[0].readBack()
	h.endRound()
	check()

	st := h.stats()
	t.Logf("chaos: reference linearizability (%s): rounds=%d ops=%d faults=%d (connection cuts %d, postgres kills %d) reaper passes=%d unanswered=%d keys=%d result=%s check_time=%v",
		db.name, v.rounds, len(ops), proxy.Cuts()+int64(pgKills), proxy.Cuts(), pgKills, run.reaps, st.unknown, st.keys, res, checkTime.Round(time.Millisecond))
	t.Logf("chaos: reference linearizability: by call %v", st.byOp)
	for _, bad := range st.violations {
		v.what = append(v.what, "violation: "+bad)
		t.Errorf("violation: %s", bad)
	}
	if res == porcupine.Unknown {
		// Not a violation found: the checker ran out of time (refCheckTimeout)
		// before it found a linearization or proved there is none.
		v.what = append(v.what, fmt.Sprintf("the checker gave up after %v on a history of %d calls (result Unknown): not checked", refCheckTimeout, len(ops)))
		t.Fatalf("porcupine gave up after %v on a history of %d calls (result Unknown, check time %v in all): the history was not checked",
			refCheckTimeout, len(ops), checkTime.Round(time.Millisecond))
	}
	if res != porcupine.Ok {
		path := writeRefVisualization(t, info)
		logRefViolation(t, ops, info)
		v.what = append(v.what, fmt.Sprintf("histories are not linearizable against the reference model (result %s; details above)", res))
		t.Fatalf("histories are not linearizable against the reference model (result %s); porcupine's visualization: %s", res, path)
	}
	var hit, extra []string
	for _, r := range refTableRows {
		if rows[r] > 0 {
			hit = append(hit, fmt.Sprintf("%s=%d", r, rows[r]))
		}
	}
	for r, n := range rows {
		if !contains(refTableRows, r) {
			extra = append(extra, fmt.Sprintf("%s=%d", r, n))
		}
	}
	sort.Strings(extra)
	t.Logf("chaos: reference coverage: %d/%d table rows exercised: %s", len(refTableRows)-len(missing), len(refTableRows), strings.Join(hit, ", "))
	t.Logf("chaos: reference coverage: other rows: %s", strings.Join(extra, ", "))
	var cks []string
	for _, r := range refCheckpointRows {
		cks = append(cks, fmt.Sprintf("%s=%d", r, rows[r]))
	}
	t.Logf("chaos: reference checkpoint coverage: %s", strings.Join(cks, ", "))
	t.Logf("chaos: reference: unanswered calls shown to have taken effect (commit done, reply lost): %d (minimum %d)", lost, refMinLostReplies)
	if db.rounds > 0 {
		// A fixed number of rounds, too few to be sure of covering the
		// table: the histories were checked, the coverage is a figure.
		t.Logf("chaos: reference: a short run of %d rounds: coverage not required (missing rows: %s)", db.rounds, strings.Join(missing, "; "))
		return
	}
	if len(missing) > 0 {
		v.what = append(v.what, "rows of the state table never exercised: "+strings.Join(missing, "; "))
		t.Errorf("rows of the state table never exercised in %d rounds: %s", v.rounds, strings.Join(missing, "; "))
	}
	if lost < refMinLostReplies {
		v.what = append(v.what, fmt.Sprintf("only %d lost replies shown, want %d", lost, refMinLostReplies))
		t.Errorf("only %d unanswered calls were shown to have taken effect, want at least %d: the faults missed the commits", lost, refMinLostReplies)
	}
}

// refRunner drives rounds of random calls from refClients at one
// coordinator on a test clock, with the clock moving and the coordinator's
// reaper making passes while the calls are in flight, and records them in
// a refHistory. TestLinearizableReference and the failover tests use it.
type refRunner struct {
	h       *refHistory
	c       *coordtest.Coordinator
	conn    *grpc.ClientConn
	clients []*refClient
	rng     *rand.Rand // the clock's steps and the reaper's passes
	reaps   int
}

// newRefRunner returns a runner of four clients of c, which must run with
// FakeClock and refConfig; its random choices are drawn from seed.
func newRefRunner(t *testing.T, c *coordtest.Coordinator, seed uint64) *refRunner {
	t.Helper()
	r := &refRunner{c: c, conn: dial(t, c.Addr), rng: rand.New(rand.NewPCG(seed, 5)),
		h: &refHistory{start: time.Now(), clock: c.Clock, nows: []time.Time{c.Clock.Now()}}}
	for i := range 4 {
		r.clients = append(r.clients, r.newClient(i, rand.New(rand.NewPCG(seed, uint64(20+i)))))
	}
	return r
}

// newClient returns a client of the runner's coordinator that records its
// calls in the runner's history; it makes no call unless told.
func (r *refRunner) newClient(id int, rng *rand.Rand) *refClient {
	return &refClient{id: id, h: r.h, client: idempotencyv1.NewCoordinatorClient(r.conn), admin: idempotencyv1.NewAdminClient(r.conn),
		rng: rng, tokens: map[string][]string{}, attempts: map[string]refAttempt{}, lastEnd: map[string]refCall{}}
}

// round runs one round. Each client makes five random calls while the
// clock moves in steps of up to 250 ms and, one step in four, the reaper
// makes a pass instead; during, when not nil, runs beside the calls (a
// fault, or calls of its own), and the round waits for it too. The clock
// stands still once the clients' calls are done, so that a call of during
// that outlasts them, or one that went unanswered, is not tried by the
// checker at every reading of a long fault. Then settle runs: it may
// inject faults of its own and must return once every unanswered call of
// the round took effect or never will. The round is closed, and the clock
// moves on, by up to 300 ms, or one round in fifteen by over 3 s, so that
// every lease of the round lapses while its holder still holds it.
func (r *refRunner) round(during, settle func()) {
	var calls sync.WaitGroup
	for _, cl := range r.clients {
		calls.Go(func() {
			for range 5 {
				cl.step()
			}
		})
	}
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() { calls.Wait(); close(done) }()
	go func() {
		defer close(stopped)
		for {
			select {
			case <-done:
				return
			case <-time.After(time.Duration(r.rng.IntN(8)) * time.Millisecond):
			}
			if r.rng.IntN(4) == 0 {
				r.h.reap(r.c.Server, refRetention)
				r.reaps++
			} else {
				r.h.advance(time.Duration(1+r.rng.IntN(250_000)) * time.Microsecond)
			}
		}
	}()
	func() {
		// Deferred, so that a t.Fatal in during still waits for the
		// round's calls.
		defer func() { <-stopped }()
		if during != nil {
			during()
		}
	}()
	settle()
	r.h.endRound()
	if r.rng.IntN(15) == 0 {
		r.h.advance(3*time.Second + time.Duration(r.rng.IntN(1000_000))*time.Microsecond)
	} else {
		r.h.advance(time.Duration(r.rng.IntN(300_000)) * time.Microsecond)
	}
}

func contains(xs []string, x string) bool {
	return slices.Contains(xs, x)
}

func writeRefVisualization(t *testing.T, info porcupine.LinearizationInfo) string {
	dir, err := os.MkdirTemp("", "idemcoord-reference-")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "history.html")
	if err := porcupine.VisualizePath(refModel(), info, path); err != nil {
		t.Fatalf("write visualization: %v", err)
	}
	return path
}

// refHistory collects the calls of every client and the clock readings.
type refHistory struct {
	start time.Time
	clock *coordtest.Clock

	mu         sync.Mutex
	nows       []time.Time // every reading the clock has had, in order
	others     [][2]string // keys called that are not in refKeys
	roundCalls int         // calls recorded in the current round
	ops        []porcupine.Operation
	pending    []refPending
	nextID     atomic.Int64
	byOp       map[string]int
	unknown    int
	violations []string
}

type refPending struct{ op, firstNow int }

func (h *refHistory) since() int64 { return int64(time.Since(h.start)) }

// advance moves the coordinator's clock and notes the new reading.
func (h *refHistory) advance(d time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.clock.Advance(d)
	h.nows = append(h.nows, h.clock.Now())
}

// mark returns the index of the current clock reading.
func (h *refHistory) mark() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.nows) - 1
}

// reap runs one reaper pass at the current reading (the clock does not
// move during it) and records it as one call per key: those of refKeys and
// any other key called so far.
func (h *refHistory) reap(srv *server.Server, retention time.Duration) {
	i := h.mark()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	call := h.since()
	err := srv.ReapOnce(ctx)
	ret := h.since()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, k := range h.keysLocked() {
		in := refCall{id: int(h.nextID.Add(1)), client: -1, kind: rkReap, scope: k[0], key: k[1],
			nows: []time.Time{h.nows[i]}, retention: retention}
		h.addLocked(in, refAnswer{unknown: err != nil}, call, ret, -1)
	}
}

// keys returns refKeys and every other key called so far.
func (h *refHistory) keys() [][2]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.keysLocked()
}

func (h *refHistory) keysLocked() [][2]string {
	return append(append([][2]string(nil), refKeys...), h.others...)
}

func (h *refHistory) add(in refCall, out refAnswer, call, ret int64, firstNow int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.addLocked(in, out, call, ret, firstNow)
}

func (h *refHistory) addLocked(in refCall, out refAnswer, call, ret int64, firstNow int) {
	if h.byOp == nil {
		h.byOp = map[string]int{}
	}
	h.byOp[rkNames[in.kind]]++
	if in.kind != rkReap {
		h.roundCalls++
	}
	if k := [2]string{in.scope, in.key}; !slices.Contains(refKeys, k) && !slices.Contains(h.others, k) {
		h.others = append(h.others, k)
	}
	if out.unknown {
		if in.kind != rkReap {
			h.unknown++
		}
		if in.kind == rkLookup {
			return // an unanswered read constrains nothing
		}
		// firstNow < 0 (the reaper): its reading stays its reading.
		h.pending = append(h.pending, refPending{op: len(h.ops), firstNow: firstNow})
	}
	in.start, in.end = call, ret
	h.ops = append(h.ops, porcupine.Operation{ClientId: in.client + 1, Input: in, Call: call, Output: out, Return: ret})
}

// endRound closes the round: its unanswered calls took effect, if at all,
// by now, at any clock reading since they started.
func (h *refHistory) endRound() {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.since()
	for _, p := range h.pending {
		op := &h.ops[p.op]
		op.Return = now
		in := op.Input.(refCall)
		in.end = now
		if p.firstNow >= 0 {
			in.nows = append([]time.Time(nil), h.nows[p.firstNow:]...)
		}
		op.Input = in
	}
	h.pending = h.pending[:0]
	h.roundCalls = 0
}

func (h *refHistory) operations() []porcupine.Operation {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]porcupine.Operation(nil), h.ops...)
}

// waitRoundCalls waits until n calls of the current round (reaper passes
// aside) have been recorded; a round of refRunner has 20.
func (h *refHistory) waitRoundCalls(n int) {
	for {
		h.mu.Lock()
		got := h.roundCalls
		h.mu.Unlock()
		if got >= n {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// refCheckTimeout bounds one check of a history: porcupine answers Unknown
// when it runs out. A check of 1500 rounds takes seconds (under -race).
const refCheckTimeout = 5 * time.Minute

// check checks the history recorded so far against refModel.
func (h *refHistory) check() ([]porcupine.Operation, porcupine.CheckResult, porcupine.LinearizationInfo) {
	ops := h.operations()
	res, info := porcupine.CheckOperationsVerbose(refModel(), ops, refCheckTimeout)
	return ops, res, info
}

// refStats sums up a history.
type refStats struct {
	unknown, keys int
	violations    []string // calls answered what no caller may get (INTERNAL, …)
	byOp          map[string]int
}

func (h *refHistory) stats() refStats {
	h.mu.Lock()
	defer h.mu.Unlock()
	keys := map[string]bool{}
	for _, op := range h.ops {
		in := op.Input.(refCall)
		keys[in.scope+"/"+in.key] = true
	}
	return refStats{unknown: h.unknown, violations: h.violations, keys: len(keys), byOp: h.byOp}
}

// refAttempt is a logical attempt of a client on a key: a Begin retried
// with its attempt_id repeats the same request.
type refAttempt struct {
	id         string
	fp         string
	ttl, lease time.Duration
}

// refClient is one caller: it remembers the tokens, attempts and ending
// calls it made per key, and makes random calls, mostly sensible ones.
type refClient struct {
	id       int
	h        *refHistory
	client   idempotencyv1.CoordinatorClient
	admin    idempotencyv1.AdminClient
	rng      *rand.Rand
	tokens   map[string][]string
	attempts map[string]refAttempt
	lastEnd  map[string]refCall // the latest Complete or Fail sent per key
	held     string             // the key this client acquired last
	// heldUntil is when held's lease runs out by this client's clock
	// (zero once the client ended or left it).
	heldUntil time.Time
	retry     *refCall // an unanswered Begin to retry next
	abandon   string   // a key to Fail ABANDONED next
	// stepThenAbandon is a key to record a checkpoint on next, and then
	// to Fail ABANDONED (which the checkpoint forbids).
	stepThenAbandon string
	seq             int
}

func (cl *refClient) pick(xs ...string) string { return xs[cl.rng.IntN(len(xs))] }

func (cl *refClient) token(id string) string {
	ts := cl.tokens[id]
	switch n := cl.rng.IntN(12); {
	case len(ts) == 0 || n == 0:
		return "lt1.bogus"
	case n == 1:
		return ts[cl.rng.IntN(len(ts))]
	}
	return ts[len(ts)-1]
}

// response returns a random response, or none.
func (cl *refClient) response(none bool) *idempotencyv1.StoredResponse {
	if none && cl.rng.IntN(4) == 0 {
		return nil
	}
	return &idempotencyv1.StoredResponse{SchemaVersion: cl.pick("v1", "v2"), Body: []byte(cl.pick("x", "y", "")),
		StatusCode: int32(cl.rng.IntN(3)), Metadata: map[string]string{"m": cl.pick("1", "2")}}
}

func canonicalOf(r *idempotencyv1.StoredResponse) string {
	if r == nil {
		return ""
	}
	return canonicalResponse(r.GetSchemaVersion(), r.GetContentType(), string(r.GetBody()), r.GetStatusCode(), r.GetMetadata())
}

func setResponse(in *refCall, r *idempotencyv1.StoredResponse) {
	in.resp, in.hasResp, in.msg = canonicalOf(r), r != nil, r
}

// step makes one random call and records it.
func (cl *refClient) step() {
	k := refKeys[cl.rng.IntN(len(refKeys))]
	if cl.held != "" && cl.rng.IntN(3) > 0 {
		// Mostly sensible: go on with the key this client acquired last.
		k = [2]string(strings.SplitN(cl.held, "/", 2))
	}
	id := k[0] + "/" + k[1]
	in := cl.newCall(rkBegin, k) // the kind is chosen below
	n := cl.rng.IntN(100)
	switch {
	case cl.retry != nil:
		// A Begin that went unanswered is retried with its attempt_id,
		// as the Go client does.
		in.kind, in.scope, in.key, in.pol = rkBegin, cl.retry.scope, cl.retry.key, cl.retry.pol
		in.attemptID, in.fp, in.ttl, in.lease, in.wait, in.accept = cl.retry.attemptID, cl.retry.fp, cl.retry.ttl, cl.retry.lease, cl.retry.wait, cl.retry.accept
		cl.retry = nil
		cl.call(in)
		return
	case cl.stepThenAbandon != "":
		k := strings.SplitN(cl.stepThenAbandon, "/", 2)
		in.scope, in.key, in.pol = k[0], k[1], refPolicies[k[0]]
		in.kind, in.token, in.lease = rkHeartbeat, cl.tokens[cl.stepThenAbandon][len(cl.tokens[cl.stepThenAbandon])-1], time.Second
		in.hasCk, in.ckPhase, in.ckData = true, "step", cl.pick("1", "2")
		cl.abandon, cl.stepThenAbandon = cl.stepThenAbandon, ""
		cl.call(in)
		return
	case cl.abandon != "":
		// The attempt after a retryable failure gives up at once (a
		// request the caller finds invalid): Fail ABANDONED.
		k := strings.SplitN(cl.abandon, "/", 2)
		in.scope, in.key, in.pol = k[0], k[1], refPolicies[k[0]]
		in.kind, in.failKind, in.token = rkFail, rfAbandoned, cl.tokens[cl.abandon][len(cl.tokens[cl.abandon])-1]
		cl.abandon = ""
		cl.call(in)
		return
	}
	if id == cl.held && !cl.heldUntil.IsZero() && time.Now().After(cl.heldUntil) && cl.rng.IntN(2) == 0 {
		// The holder comes back after its lease ran out (the record is
		// UNKNOWN unless another attempt took it over) and heartbeats,
		// half the time recording the step it finished. Left to chance,
		// these rows came up a few times in 800 rounds, and a run now and
		// then ended without one.
		in.kind, in.token, in.lease = rkHeartbeat, cl.tokens[id][len(cl.tokens[id])-1], time.Duration(1+cl.rng.IntN(3))*time.Second
		if cl.rng.IntN(2) == 0 {
			cl.checkpoint(&in)
		}
		cl.heldUntil = time.Time{}
		cl.call(in)
		return
	}
	if n >= 64 && n < 72 {
		if last, ok := cl.lastEnd[id]; ok {
			// Repeat the latest ending call, as a client retrying it.
			in.kind, in.token, in.failKind, in.resp, in.hasResp, in.msg, in.reason = last.kind, last.token, last.failKind, last.resp, last.hasResp, last.msg, last.reason
			cl.call(in)
			return
		}
		n = 50
	}
	switch {
	case n < 32:
		in.kind = rkBegin
		a, ok := cl.attempts[id]
		if !ok || cl.rng.IntN(2) > 0 {
			cl.seq++
			a = refAttempt{id: fmt.Sprintf("c%d-%d", cl.id, cl.seq), fp: cl.pick("", "f1", "f1", "f1", "f2"),
				ttl: time.Duration(2+cl.rng.IntN(7)) * time.Second, lease: time.Duration(1+cl.rng.IntN(3)) * time.Second}
			if cl.rng.IntN(6) == 0 {
				a.id = ""
			}
			cl.attempts[id] = a
		}
		in.attemptID, in.fp, in.ttl, in.lease = a.id, a.fp, a.ttl, a.lease
		if cl.rng.IntN(5) == 0 {
			in.wait = time.Duration(50+cl.rng.IntN(200)) * time.Millisecond
		}
		if cl.rng.IntN(6) == 0 {
			in.accept = []string{cl.pick("v1", "v2")}
		}
	case n < 44:
		in.kind = rkComplete
		in.token = cl.token(id)
		setResponse(&in, cl.response(true))
	case n < 64:
		in.kind = rkFail
		in.token = cl.token(id)
		in.failKind = 1 + cl.rng.IntN(4)
		in.reason = cl.pick("", "boom")
		if in.failKind == rfReplayable {
			setResponse(&in, cl.response(false))
		}
	case n < 80:
		in.kind = rkHeartbeat
		in.token = cl.token(id)
		in.lease = time.Duration(1+cl.rng.IntN(3)) * time.Second
		if cl.rng.IntN(2) == 0 {
			// A holder records the step it finished; one in four of
			// those uses an older token of the key, which a takeover
			// has fenced off.
			cl.checkpoint(&in)
			if ts := cl.tokens[id]; len(ts) > 1 && cl.rng.IntN(4) == 0 {
				in.token = ts[cl.rng.IntN(len(ts)-1)]
			}
		}
	case n < 86:
		in.kind = rkLookup
	case n < 96:
		in.kind = rkResolve
		in.resolveAs = 1 + cl.rng.IntN(2)
		if in.resolveAs == rrCompleted {
			setResponse(&in, cl.response(true))
		}
	default:
		in.kind = rkForget
	}
	cl.call(in)
}

// checkpoint puts a random checkpoint into the Heartbeat in: mostly a
// step of a few bytes, one in fifty with data at the 64 KiB limit, one in
// fifty with a phase of 128 bytes, and four in fifty break a limit (the
// coordinator must refuse them and write nothing).
func (cl *refClient) checkpoint(in *refCall) {
	in.hasCk = true
	in.ckPhase = cl.pick("charge", "provision", "receipt", "p")
	in.ckData = cl.pick("", "1", "2", "ab\x00\xff")
	switch cl.rng.IntN(50) {
	case 0:
		in.ckData = strings.Repeat("d", 64<<10)
	case 1:
		in.ckPhase, in.ckBad = "", true
	case 2:
		in.ckPhase, in.ckBad = strings.Repeat("p", 129), true
	case 3:
		in.ckPhase, in.ckBad = "line\nbreak", true
	case 4:
		in.ckData, in.ckBad = strings.Repeat("d", 64<<10+1), true
	case 5:
		in.ckPhase = strings.Repeat("p", 128)
	}
}

// newCall returns a call of kind on key k = {scope, key}, for the caller
// to fill in.
func (cl *refClient) newCall(kind refKind, k [2]string) refCall {
	return refCall{id: int(cl.h.nextID.Add(1)), client: cl.id, kind: kind, scope: k[0], key: k[1], pol: refPolicies[k[0]]}
}

// call sends in, records it with its answer, remembers what the client
// learnt, and returns the answer.
func (cl *refClient) call(in refCall) refAnswer {
	id := in.scope + "/" + in.key
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	first := cl.h.mark()
	call := cl.h.since()
	var (
		out refAnswer
		err error
		rec *idempotencyv1.Record
	)
	resp := func() *idempotencyv1.StoredResponse { return in.msg }
	switch in.kind {
	case rkBegin:
		req := &idempotencyv1.BeginRequest{Scope: in.scope, Key: in.key, Fingerprint: []byte(in.fp), AttemptId: in.attemptID,
			Ttl: durationpb.New(in.ttl), Lease: durationpb.New(in.lease), AcceptSchemaVersions: in.accept}
		if in.wait > 0 {
			req.Wait = durationpb.New(in.wait)
		}
		var r *idempotencyv1.BeginResponse
		r, err = cl.client.Begin(ctx, req)
		rec = r.GetRecord()
		out.outcome, out.token, out.prev = int(r.GetOutcome()), r.GetLeaseToken(), int(r.GetPreviousState())
		if err == nil && out.outcome == roAcquired {
			if ts := cl.tokens[id]; len(ts) == 0 || ts[len(ts)-1] != out.token {
				cl.tokens[id] = append(ts, out.token)
			}
			cl.held, cl.heldUntil = id, time.Now().Add(in.lease+100*time.Millisecond)
			switch {
			case out.prev == rsFailedRetryable && cl.rng.IntN(2) == 0:
				cl.abandon = id
			case cl.rng.IntN(6) == 0:
				cl.stepThenAbandon = id
			}
		}
	case rkComplete:
		var r *idempotencyv1.CompleteResponse
		r, err = cl.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: in.scope, Key: in.key, LeaseToken: in.token, Response: resp()})
		rec = r.GetRecord()
		cl.lastEnd[id] = in
	case rkFail:
		var r *idempotencyv1.FailResponse
		r, err = cl.client.Fail(ctx, &idempotencyv1.FailRequest{Scope: in.scope, Key: in.key, LeaseToken: in.token,
			Kind: idempotencyv1.FailureKind(in.failKind), Response: resp(), Reason: in.reason})
		rec = r.GetRecord()
		cl.lastEnd[id] = in
	case rkHeartbeat:
		var r *idempotencyv1.HeartbeatResponse
		req := &idempotencyv1.HeartbeatRequest{Scope: in.scope, Key: in.key, LeaseToken: in.token, Lease: durationpb.New(in.lease)}
		if in.hasCk {
			req.Checkpoint = &idempotencyv1.Checkpoint{Phase: in.ckPhase, Data: []byte(in.ckData)}
		}
		r, err = cl.client.Heartbeat(ctx, req)
		rec = r.GetRecord()
	case rkLookup:
		var r *idempotencyv1.LookupResponse
		r, err = cl.client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: in.scope, Key: in.key})
		rec = r.GetRecord()
	case rkResolve:
		var r *idempotencyv1.ResolveResponse
		r, err = cl.admin.Resolve(ctx, &idempotencyv1.ResolveRequest{Scope: in.scope, Key: in.key,
			Resolution: idempotencyv1.Resolution(in.resolveAs), Response: resp()})
		rec = r.GetRecord()
	case rkForget:
		var r *idempotencyv1.ForgetResponse
		r, err = cl.admin.Forget(ctx, &idempotencyv1.ForgetRequest{Scope: in.scope, Key: in.key})
		rec = r.GetRecord()
	}
	ret := cl.h.since()
	last := cl.h.mark()
	in.nows = append([]time.Time(nil), cl.h.readings(first, last)...)
	switch c := status.Code(err); c {
	case codes.OK:
		out.rec = refViewFromProto(rec)
	case codes.Unavailable, codes.DeadlineExceeded:
		out = refAnswer{unknown: true}
		if in.kind == rkBegin && in.attemptID != "" && cl.rng.IntN(2) == 0 {
			cl.retry = &in
		}
	case codes.NotFound:
		out = refAnswer{err: "NOT_FOUND"}
	case codes.FailedPrecondition:
		out = refAnswer{err: reasonOf(err)}
	case codes.InvalidArgument:
		// Only a checkpoint out of bounds is bad input here: the model
		// takes any other call answered so as wrong.
		out = refAnswer{err: "INVALID_ARGUMENT"}
	default:
		cl.h.mu.Lock()
		cl.h.violations = append(cl.h.violations, fmt.Sprintf("%s answered %v", describeRefCall(in, refAnswer{unknown: true}), err))
		cl.h.mu.Unlock()
		out = refAnswer{unknown: true}
	}
	cl.h.add(in, out, call, ret, first)
	return out
}

func (h *refHistory) readings(first, last int) []time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.nows[first : last+1]
}

// readBack looks every key of the history up once the faults stopped,
// retrying until it gets an answer, so the history ends with what the
// database holds.
func (cl *refClient) readBack() {
	for _, k := range cl.h.keys() {
		for range 100 {
			if !cl.call(cl.newCall(rkLookup, k)).unknown {
				break
			}
			time.Sleep(50 * time.Millisecond) // retry pacing after an outage, not a synchronization
		}
	}
}

// refViewFromProto is what the model compares of an answered record.
// Record.uncertain is read by name, so the test runs against an API
// without it and checks it once it exists.
func refViewFromProto(r *idempotencyv1.Record) *refView {
	if r == nil {
		return nil
	}
	us := func(t *timestamppb.Timestamp) int64 {
		if t == nil {
			return 0
		}
		return t.AsTime().UnixMicro()
	}
	v := &refView{state: int(r.GetState()), fp: string(r.GetFingerprint()), attempt: r.GetAttempt(), gen: r.GetGeneration(),
		reason: r.GetFailureReason(), lease: us(r.GetLeaseExpiresAt()), expires: us(r.GetExpiresAt())}
	if resp := r.GetResponse(); resp != nil {
		v.resp, v.hasResp = canonicalOf(resp), true
	}
	if c := r.GetCheckpoint(); c != nil {
		v.ck = refCheckpoint{set: true, phase: c.GetPhase(), data: string(c.GetData()), at: us(c.GetAt())}
	}
	m := r.ProtoReflect()
	if f := m.Descriptor().Fields().ByName(protoreflect.Name("uncertain")); f != nil {
		v.hasUncertain, v.uncertain = true, m.Get(f).Bool()
	}
	return v
}

// logRefViolation logs, for each key whose history has no linearization,
// the end of the longest partial linearization with the model's states, and
// the calls that could not follow it.
func logRefViolation(t *testing.T, ops []porcupine.Operation, info porcupine.LinearizationInfo) {
	byKey := map[string][]porcupine.Operation{}
	for _, op := range ops {
		in := op.Input.(refCall)
		byKey[in.scope+"/"+in.key] = append(byKey[in.scope+"/"+in.key], op)
	}
	for _, lins := range info.PartialLinearizationsOperations() {
		var longest []porcupine.Operation
		for _, l := range lins {
			if len(l) > len(longest) {
				longest = l
			}
		}
		if len(longest) == 0 {
			continue
		}
		in := longest[0].Input.(refCall)
		all := byKey[in.scope+"/"+in.key]
		if len(longest) == len(all) {
			continue
		}
		var b strings.Builder
		fmt.Fprintf(&b, "key %s/%s: %d of %d calls linearized; the last ones, with the states after them:\n", in.scope, in.key, len(longest), len(all))
		states := []refKey{{}}
		for i, op := range longest {
			var next []refKey
			for _, k := range states {
				for _, n := range refStep(k, op.Input.(refCall), op.Output.(refAnswer)) {
					if !slicesContains(next, n.k) {
						next = append(next, n.k)
					}
				}
			}
			states = next
			if i >= len(longest)-12 {
				fmt.Fprintf(&b, "  [%d-%d] %s\n", op.Call, op.Return, describeRefCall(op.Input.(refCall), op.Output.(refAnswer)))
				for _, k := range states {
					fmt.Fprintf(&b, "      -> %s\n", k)
				}
			}
		}
		done := map[int]bool{}
		for _, op := range longest {
			done[op.Input.(refCall).id] = true
		}
		var rest []porcupine.Operation
		for _, op := range all {
			if !done[op.Input.(refCall).id] {
				rest = append(rest, op)
			}
		}
		sort.Slice(rest, func(i, j int) bool { return rest[i].Return < rest[j].Return })
		b.WriteString("  calls that could not follow (earliest answers first):\n")
		for _, op := range rest[:min(6, len(rest))] {
			fmt.Fprintf(&b, "  [%d-%d] %s\n", op.Call, op.Return, describeRefCall(op.Input.(refCall), op.Output.(refAnswer)))
		}
		t.Log(b.String())
	}
}

func slicesContains(xs []refKey, x refKey) bool {
	return slices.Contains(xs, x)
}
