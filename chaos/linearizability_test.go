package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
	"github.com/idemcoord/idemcoord/statemachine"
)

// linConfig is the coordinator's policy in the linearizability test; the
// model's policies below must say the same.
const linConfig = `
scopes:
  - { match: "hold", on_unknown: hold, max_attempts: 3, on_expired: reject }
`

var linPolicies = map[string]statemachine.Policy{
	"free": {},
	"hold": {OnUnknown: statemachine.UnknownHold, MaxAttempts: 3, OnExpired: statemachine.ExpiredReject},
}

// TestLinearizable records per-key histories of Begin, Complete, Fail,
// Heartbeat and Lookup from concurrent clients while a proxy cuts the
// coordinator's database connections at random and PostgreSQL is killed
// and restarted, and checks with porcupine that every key's history is
// linearizable with respect to a model of the state table built on
// statemachine.Next.
//
// The coordinator runs in-process on a fake clock that moves only between
// rounds, when no call is in flight and the database shows no transaction
// of the coordinator open, so every call of a round happens at one known
// "now" and the model needs no other notion of time. A call answered
// UNAVAILABLE or DEADLINE_EXCEEDED may or may not have taken effect: the
// model accepts both, anywhere between its start and the end of its round
// (an unanswered Begin that acquired holds a token nobody knows until a
// Begin with the same attempt_id reveals it). On a violation the test fails
// and writes porcupine's visualization to a file whose path it logs.
func TestLinearizable(t *testing.T) {
	s := seed(t)
	rng := rand.New(rand.NewPCG(s, 4))
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	dbURL := cluster.URL("postgres")
	if err := ledger.Migrate(context.Background(), dbURL); err != nil {
		t.Fatal(err)
	}
	proxy, proxiedURL := newDatabaseProxy(t, dbURL, s)
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: proxiedURL, FakeClock: true, Config: linConfig,
		ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})
	client := idempotencyv1.NewCoordinatorClient(dial(t, c.Addr))

	rounds := byMode(100, 1000)
	killRounds := map[int]bool{rounds / 3: true, 2 * rounds / 3: true}
	if long() {
		for r := 10; r < rounds; r += 50 {
			killRounds[r] = true
		}
	}
	h := &linHistory{start: time.Now()}
	clients := make([]*linClient, 4)
	for i := range clients {
		clients[i] = &linClient{id: i, h: h, client: client, rng: rand.New(rand.NewPCG(s, uint64(10+i))),
			tokens: map[string][]string{}, attempts: map[string]string{}}
	}
	proxy.SetCutChance(0.02)
	pgKills := 0
	for round := range rounds {
		now := c.Clock.Now()
		var wg sync.WaitGroup
		for _, cl := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 5 {
					cl.step(now)
				}
			}()
		}
		if round%7 == 3 {
			time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
			proxy.CutAll()
		}
		if killRounds[round] {
			time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond)
			if err := cluster.Kill(); err != nil {
				t.Fatal(err)
			}
			pgKills++
			if err := cluster.Start(); err != nil {
				t.Fatal(err)
			}
		}
		wg.Wait()
		waitNoOpenTransactions(t, dbURL)
		h.endRound()
		c.Clock.Advance(time.Duration(rng.IntN(1200)) * time.Millisecond)
	}
	proxy.SetCutChance(0)

	ops := h.operations()
	startCheck := time.Now()
	res, info := porcupine.CheckOperationsVerbose(linModel(), ops, 2*time.Minute)
	checkTime := time.Since(startCheck)
	st := h.stats()
	t.Logf("chaos: linearizability: ops=%d faults=%d (connection cuts %d, postgres kills %d) unanswered=%d keys=%d result=%s check_time=%v",
		len(ops), proxy.Cuts()+int64(pgKills), proxy.Cuts(), pgKills, st.unknown, st.keys, res, checkTime.Round(time.Millisecond))
	t.Logf("chaos: linearizability: by call %v", st.byOp)
	for _, v := range st.violations {
		t.Errorf("violation: %s", v)
	}
	if st.unknown == 0 {
		t.Errorf("no call went unanswered: the faults missed the load")
	}
	if res != porcupine.Ok {
		path := writeVisualization(t, info)
		t.Fatalf("histories are not linearizable (result %s); porcupine's visualization: %s", res, path)
	}
}

// writeVisualization writes porcupine's HTML visualization of info to a
// file that outlives the test and returns its path.
func writeVisualization(t *testing.T, info porcupine.LinearizationInfo) string {
	dir, err := os.MkdirTemp("", "idemcoord-linearizability-")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "history.html")
	if err := porcupine.VisualizePath(linModel(), info, path); err != nil {
		t.Fatalf("write visualization: %v", err)
	}
	return path
}

// waitNoOpenTransactions waits until the database shows no statement or
// transaction of the coordinator in progress: a call that went unanswered
// because its connection was cut may still commit until then.
func waitNoOpenTransactions(t *testing.T, dbURL string) {
	t.Helper()
	waitNoOpenTransactionsOf(t, dbURL, "idemcoord")
}

// waitNoOpenTransactionsOf is waitNoOpenTransactions for the coordinator
// whose connections carry application_name app.
func waitNoOpenTransactionsOf(t *testing.T, dbURL, app string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		n, err := openTransactions(dbURL, app)
		if err == nil && n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the coordinator still has %d statements or transactions open after 30s (%v)", n, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func openTransactions(dbURL, app string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return -1, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE application_name = $1 AND state IS DISTINCT FROM 'idle'`, app).Scan(&n)
	return n, err
}

// linOp names a call.
type linOp uint8

const (
	opBegin linOp = iota
	opComplete
	opFail
	opHeartbeat
	opLookup
)

var linOpNames = [...]string{"Begin", "Complete", "Fail", "Heartbeat", "Lookup"}

// linInput is a call as the model sees it: the event it is, on which key,
// under which policy, at which "now".
type linInput struct {
	id     int // operation number: names the token an unanswered Begin may have issued
	client int
	op     linOp
	scope  string
	key    string
	now    time.Time
	policy statemachine.Policy
	ev     statemachine.Event
}

// linOutput is what the call answered.
type linOutput struct {
	unknown bool   // no answer: the call may or may not have taken effect
	err     string // "" for OK; NOT_FOUND, or the ErrorInfo reason of a refusal
	outcome statemachine.Outcome
	token   string
	prev    statemachine.State
	rec     *statemachine.Record // the record answered, nil when none
}

// linState is the model's state of one key: the stored record, if any.
type linState struct {
	exists bool
	rec    statemachine.Record
}

func (s linState) String() string {
	if !s.exists {
		return "(none)"
	}
	return recordView(s.rec) + " token=" + s.rec.LeaseToken + " attempt_id=" + s.rec.AttemptID
}

// placeholder is the token an unanswered Begin would have issued.
func placeholder(id int) string { return fmt.Sprintf("?%d", id) }

func isPlaceholder(tok string) bool { return len(tok) > 0 && tok[0] == '?' }

// linModel is the state table of one key as a porcupine model: each call
// steps the stored record with statemachine.Next at the call's "now", and
// the answer must be what Next decided. An unanswered call steps to both
// "applied" and "not applied".
func linModel() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
			byKey := map[string][]porcupine.Operation{}
			var order []string
			for _, op := range history {
				in := op.Input.(linInput)
				k := in.scope + "/" + in.key
				if _, ok := byKey[k]; !ok {
					order = append(order, k)
				}
				byKey[k] = append(byKey[k], op)
			}
			out := make([][]porcupine.Operation, 0, len(order))
			for _, k := range order {
				out = append(out, byKey[k])
			}
			return out
		},
		Init: func() []any { return []any{linState{}} },
		Step: func(state, input, output any) []any {
			return linStep(state.(linState), input.(linInput), output.(linOutput))
		},
		Equal: func(a, b any) bool { return a.(linState).String() == b.(linState).String() },
		DescribeOperation: func(input, output any) string {
			return describeCall(input.(linInput), output.(linOutput))
		},
		DescribeState: func(state any) string { return state.(linState).String() },
	}
	return nm.ToModel()
}

// linStep returns the states the key may be in after the call, none when
// the answer contradicts the model.
func linStep(st linState, in linInput, out linOutput) []any {
	var cur *statemachine.Record
	if st.exists {
		r := st.rec
		cur = &r
	}
	if in.op == opLookup {
		switch {
		case out.unknown:
			return []any{st}
		case cur == nil:
			if out.err == "NOT_FOUND" {
				return []any{st}
			}
		case out.err == "" && out.rec != nil && recordView(*out.rec) == recordView(statemachine.Effective(*cur, in.now)):
			return []any{st}
		}
		return nil
	}

	ev := in.ev
	if in.op == opBegin {
		ev.NewToken = placeholder(in.id)
	}
	d := statemachine.Next(cur, ev, in.policy, in.now)
	next := st
	switch d.Write {
	case statemachine.WriteInsert, statemachine.WriteUpdate:
		next = linState{exists: true, rec: d.Record}
	case statemachine.WriteDelete:
		next = linState{}
	}
	if out.unknown {
		if d.Err != nil || d.Write == statemachine.WriteNone {
			return []any{st}
		}
		return []any{st, next}
	}
	if d.Err != nil {
		if out.err == refusalReason(d.Err) {
			return []any{st}
		}
		return nil
	}
	if out.err != "" {
		return nil
	}
	answered := d.Record
	if in.op == opBegin {
		if out.outcome != d.Outcome {
			return nil
		}
		if d.Outcome == statemachine.OutcomeAcquired {
			if out.prev != d.PreviousState || out.token == "" {
				return nil
			}
			switch tok := d.Record.LeaseToken; {
			case isPlaceholder(tok):
				// This call's new token, or the one an unanswered Begin
				// with the same attempt_id got: now it is known.
				next.rec.LeaseToken = out.token
				answered.LeaseToken = out.token
			case tok != out.token:
				return nil
			}
		}
	}
	switch {
	case !d.Exists || (in.op == opFail && d.Write == statemachine.WriteDelete):
		if out.rec != nil {
			return nil
		}
	case out.rec == nil || recordView(*out.rec) != recordView(answered):
		return nil
	}
	return []any{next}
}

// refusalReason is the answer a refusal of statemachine.Next becomes.
func refusalReason(err error) string {
	switch err {
	case statemachine.ErrNotFound:
		return "NOT_FOUND"
	case statemachine.ErrFingerprintMismatch:
		return "FINGERPRINT_MISMATCH"
	case statemachine.ErrLeaseLost:
		return "LEASE_LOST"
	case statemachine.ErrAlreadyFinished:
		return "ALREADY_FINISHED"
	case statemachine.ErrAttemptsExhausted:
		return "ATTEMPTS_EXHAUSTED"
	case statemachine.ErrSchemaVersionNotAccepted:
		return "SCHEMA_VERSION_NOT_ACCEPTED"
	case statemachine.ErrKeyExpired:
		return "KEY_EXPIRED"
	}
	return "unexpected refusal: " + err.Error()
}

// recordView is what a caller sees of a record: everything the API
// returns (the response only for ended records), nothing of the token.
func recordView(r statemachine.Record) string {
	resp := "-"
	if r.State.Terminal() && r.Response != nil {
		resp = fmt.Sprintf("{v=%q type=%q body=%q code=%d md=%v}", r.Response.SchemaVersion, r.Response.ContentType,
			r.Response.Body, r.Response.StatusCode, r.Response.Metadata)
	}
	ts := func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format("15:04:05.000000")
	}
	return fmt.Sprintf("%v a%d g%d uncertain=%v fp=%q reason=%q created=%s updated=%s lease=%s expires=%s resp=%s",
		r.State, r.Attempt, r.Generation, r.Uncertain, r.Fingerprint, r.FailureReason, ts(r.CreatedAt), ts(r.UpdatedAt),
		ts(r.LeaseExpiresAt), ts(r.ExpiresAt), resp)
}

func describeCall(in linInput, out linOutput) string {
	var args string
	switch in.op {
	case opBegin:
		args = fmt.Sprintf("fp=%q aid=%q lease=%v ttl=%v accept=%v", in.ev.Fingerprint, in.ev.AttemptID, in.ev.Lease, in.ev.TTL, in.ev.AcceptSchemaVersions)
	case opComplete:
		args = fmt.Sprintf("tok=%.12s resp=%v", in.ev.Token, in.ev.Response)
	case opFail:
		args = fmt.Sprintf("tok=%.12s kind=%d resp=%v reason=%q", in.ev.Token, in.ev.FailureKind, in.ev.Response, in.ev.Reason)
	case opHeartbeat:
		args = fmt.Sprintf("tok=%.12s lease=%v", in.ev.Token, in.ev.Lease)
	}
	var res string
	switch {
	case out.unknown:
		res = "no answer"
	case out.err != "":
		res = out.err
	case in.op == opBegin:
		res = fmt.Sprintf("outcome=%d tok=%.12s prev=%v", out.outcome, out.token, out.prev)
	default:
		res = "OK"
	}
	if out.rec != nil {
		res += " " + recordView(*out.rec)
	}
	return fmt.Sprintf("c%d %s(%s/%s @%s %s) -> %s", in.client, linOpNames[in.op], in.scope, in.key,
		in.now.Format("15:04:05.000"), args, res)
}

// linHistory collects the calls of every client.
type linHistory struct {
	start time.Time

	mu         sync.Mutex
	ops        []porcupine.Operation
	pending    []int // unanswered calls of the current round
	nextID     atomic.Int64
	byOp       map[string]int
	unknown    int
	violations []string // calls answered what no caller may get (INTERNAL, …)
}

func (h *linHistory) since() int64 { return int64(time.Since(h.start)) }

func (h *linHistory) add(in linInput, out linOutput, call, ret int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.byOp == nil {
		h.byOp = map[string]int{}
	}
	h.byOp[linOpNames[in.op]]++
	if out.unknown {
		h.unknown++
		if in.op == opLookup {
			return // an unanswered read constrains nothing
		}
		h.pending = append(h.pending, len(h.ops))
	}
	h.ops = append(h.ops, porcupine.Operation{ClientId: in.client, Input: in, Call: call, Output: out, Return: ret})
}

// endRound closes the round: its unanswered calls took effect, if at all,
// by now.
func (h *linHistory) endRound() {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.since()
	for _, i := range h.pending {
		h.ops[i].Return = now
	}
	h.pending = h.pending[:0]
}

func (h *linHistory) operations() []porcupine.Operation {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]porcupine.Operation(nil), h.ops...)
}

type linStats struct {
	unknown, keys int
	violations    []string
	byOp          map[string]int
}

func (h *linHistory) stats() linStats {
	h.mu.Lock()
	defer h.mu.Unlock()
	keys := map[string]bool{}
	for _, op := range h.ops {
		in := op.Input.(linInput)
		keys[in.scope+"/"+in.key] = true
	}
	return linStats{unknown: h.unknown, violations: h.violations, keys: len(keys), byOp: h.byOp}
}

// linClient is one caller: it remembers the tokens and attempt ids it got
// per key and makes random calls, mostly sensible ones.
type linClient struct {
	id       int
	h        *linHistory
	client   idempotencyv1.CoordinatorClient
	rng      *rand.Rand
	tokens   map[string][]string // key → tokens it acquired, latest last
	attempts map[string]string   // key → its latest attempt_id
	seq      int
}

var linKeys = [][2]string{{"free", "a"}, {"free", "b"}, {"free", "c"}, {"hold", "a"}, {"hold", "b"}}

func (cl *linClient) pick(xs ...string) string { return xs[cl.rng.IntN(len(xs))] }

func (cl *linClient) token(id string) string {
	ts := cl.tokens[id]
	switch n := cl.rng.IntN(10); {
	case len(ts) == 0 || n == 0:
		return "lt1.bogus"
	case n == 1:
		return ts[cl.rng.IntN(len(ts))]
	}
	return ts[len(ts)-1]
}

func (cl *linClient) response() *idempotencyv1.StoredResponse {
	if cl.rng.IntN(4) == 0 {
		return nil
	}
	return &idempotencyv1.StoredResponse{SchemaVersion: cl.pick("v1", "v2"), Body: []byte(cl.pick("x", "y", "")),
		StatusCode: int32(cl.rng.IntN(3)), Metadata: map[string]string{"m": cl.pick("1", "2")}}
}

func responseOf(r *idempotencyv1.StoredResponse) *statemachine.Response {
	if r == nil {
		return nil
	}
	return &statemachine.Response{SchemaVersion: r.GetSchemaVersion(), ContentType: r.GetContentType(),
		Body: r.GetBody(), StatusCode: r.GetStatusCode(), Metadata: r.GetMetadata()}
}

// step makes one random call at now and records it.
func (cl *linClient) step(now time.Time) {
	cl.do(now, linKeys[cl.rng.IntN(len(linKeys))], cl.rng.IntN(20))
}

// do makes call n (0-7 Begin, 8-11 Complete, 12-13 Fail, 14-15
// Heartbeat, 16-19 Lookup) on key k = {scope, key} at now and records it.
func (cl *linClient) do(now time.Time, k [2]string, n int) {
	scope, key, id := k[0], k[1], k[0]+"/"+k[1]
	in := linInput{id: int(cl.h.nextID.Add(1)), client: cl.id, scope: scope, key: key, now: now, policy: linPolicies[scope]}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	call := cl.h.since()
	var (
		out linOutput
		err error
		rec *idempotencyv1.Record
	)
	switch {
	case n < 8:
		in.op = opBegin
		aid := cl.attempts[id]
		if aid == "" || cl.rng.IntN(3) > 0 {
			cl.seq++
			aid = fmt.Sprintf("c%d-%d", cl.id, cl.seq)
			if cl.rng.IntN(5) == 0 {
				aid = ""
			}
			cl.attempts[id] = aid
		}
		lease := time.Duration(1+cl.rng.IntN(3)) * time.Second
		ttl := time.Duration(2+cl.rng.IntN(7)) * time.Second
		in.ev = statemachine.Event{Kind: statemachine.EventBegin, Fingerprint: []byte(cl.pick("", "f1", "f1", "f2")),
			AttemptID: aid, TTL: ttl, FailureTTL: min(time.Hour, ttl), Lease: lease}
		if cl.rng.IntN(5) == 0 {
			in.ev.AcceptSchemaVersions = []string{cl.pick("v1", "v2")}
		}
		var r *idempotencyv1.BeginResponse
		r, err = cl.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: scope, Key: key, Fingerprint: in.ev.Fingerprint,
			AttemptId: aid, Ttl: durationpb.New(ttl), Lease: durationpb.New(lease), AcceptSchemaVersions: in.ev.AcceptSchemaVersions})
		rec = r.GetRecord()
		out.outcome, out.token, out.prev = statemachine.Outcome(r.GetOutcome()), r.GetLeaseToken(), statemachine.State(r.GetPreviousState())
		if err == nil && out.outcome == statemachine.OutcomeAcquired {
			if ts := cl.tokens[id]; len(ts) == 0 || ts[len(ts)-1] != out.token {
				cl.tokens[id] = append(ts, out.token)
			}
		}
	case n < 12:
		in.op = opComplete
		resp := cl.response()
		in.ev = statemachine.Event{Kind: statemachine.EventComplete, Token: cl.token(id), Response: responseOf(resp)}
		var r *idempotencyv1.CompleteResponse
		r, err = cl.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: scope, Key: key, LeaseToken: in.ev.Token, Response: resp})
		rec = r.GetRecord()
	case n < 14:
		in.op = opFail
		kind := statemachine.FailureKind(1 + cl.rng.IntN(4))
		resp := cl.response()
		if kind == statemachine.FailureReplayable && resp == nil {
			resp = &idempotencyv1.StoredResponse{}
		}
		in.ev = statemachine.Event{Kind: statemachine.EventFail, Token: cl.token(id), FailureKind: kind,
			Response: responseOf(resp), Reason: cl.pick("", "boom")}
		var r *idempotencyv1.FailResponse
		r, err = cl.client.Fail(ctx, &idempotencyv1.FailRequest{Scope: scope, Key: key, LeaseToken: in.ev.Token,
			Kind: idempotencyv1.FailureKind(kind), Response: resp, Reason: in.ev.Reason})
		rec = r.GetRecord()
	case n < 16:
		in.op = opHeartbeat
		lease := time.Duration(1+cl.rng.IntN(3)) * time.Second
		in.ev = statemachine.Event{Kind: statemachine.EventHeartbeat, Token: cl.token(id), Lease: lease}
		var r *idempotencyv1.HeartbeatResponse
		r, err = cl.client.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: scope, Key: key, LeaseToken: in.ev.Token,
			Lease: durationpb.New(lease)})
		rec = r.GetRecord()
	default:
		in.op = opLookup
		var r *idempotencyv1.LookupResponse
		r, err = cl.client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: scope, Key: key})
		rec = r.GetRecord()
	}
	ret := cl.h.since()
	switch c := status.Code(err); c {
	case codes.OK:
		out.rec = recordFromProto(rec)
	case codes.Unavailable, codes.DeadlineExceeded:
		out = linOutput{unknown: true}
	case codes.NotFound:
		out = linOutput{err: "NOT_FOUND"}
	case codes.FailedPrecondition:
		out = linOutput{err: reasonOf(err)}
	default:
		cl.h.mu.Lock()
		cl.h.violations = append(cl.h.violations, fmt.Sprintf("%s answered %v", describeCall(in, linOutput{unknown: true}), err))
		cl.h.mu.Unlock()
		out = linOutput{unknown: true}
	}
	cl.h.add(in, out, call, ret)
}

func recordFromProto(r *idempotencyv1.Record) *statemachine.Record {
	if r == nil {
		return nil
	}
	ts := func(t *timestamppb.Timestamp) time.Time {
		if t == nil {
			return time.Time{}
		}
		return t.AsTime().UTC()
	}
	rec := &statemachine.Record{State: statemachine.State(r.GetState()), Fingerprint: r.GetFingerprint(),
		Attempt: r.GetAttempt(), Generation: r.GetGeneration(), FailureReason: r.GetFailureReason(),
		CreatedAt: ts(r.GetCreatedAt()), UpdatedAt: ts(r.GetUpdatedAt()),
		LeaseExpiresAt: ts(r.GetLeaseExpiresAt()), ExpiresAt: ts(r.GetExpiresAt()), Response: responseOf(r.GetResponse()),
		Uncertain: r.GetUncertain()}
	return rec
}
