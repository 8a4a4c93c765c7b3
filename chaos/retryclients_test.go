package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/examples/projects"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	"github.com/idemcoord/idemcoord/examples/projectshttp"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// retryLease is the lease of every record in TestRetryingClients: short, so
// that the wait for abandoned leases to lapse keeps the test bounded.
const retryLease = 2 * time.Second

// TestRetryingClients drives the two demo services (examples/projectshttp
// behind clients.HTTPMiddleware, examples/projects behind
// clients.UnaryServerInterceptor, built by the demos' own NewHandler and
// NewGRPCServer as their commands build them; only the coordinator
// connection reconnects faster than the commands' default, as every chaos
// test's does) with real third-party retrying clients, through toxiproxy
// (latency and jitter, connections reset, black holes that close after a
// while, requests sliced into small writes) both between the clients and
// the demos and between the demos and the coordinator:
//
//   - go-retryablehttp (Go) against the HTTP demo;
//   - grpc-go's own service-config retryPolicy (UNAVAILABLE and ABORTED,
//     honouring the interceptor's pushback) against the gRPC demo;
//   - axios with axios-retry (Node, chaos/testdata/retryclients/node)
//     against the HTTP demo;
//   - requests with urllib3's Retry (Python, Debian's python3-requests)
//     against the HTTP demo.
//
// Each client creates 400 projects (100 in the short run), eight at a
// time, one Idempotency-Key per project that its retries reuse; 40% of the
// first sends have a time-out so short (0.5-6 ms for gRPC, 2-30 ms for
// HTTP) that the client often gives up during the demo's Begin, and a send
// that got no answer is sent once more with a normal time-out. The
// coordinator holds UNKNOWN records for an operator (on_unknown: hold), so
// a key stranded by a caller that gave up stays visible. Then, with the
// faults off and every lease lapsed, each key's record is read (Lookup),
// and every operation is sent once more (a replay). Per client, the test requires:
//
//   - side effects: at most one project per key, and exactly one for every
//     key whose client was answered a success;
//   - replays: every success answer for a key equals the first one byte for
//     byte (status and body);
//   - stranded: no key left IN_PROGRESS, UNKNOWN or uncertain whose handler
//     never ran (docs/giving-up.md).
func TestRetryingClients(t *testing.T) {
	tp := startToxiproxy(t)
	// A hung control API (see toxiproxy) also holds back the new
	// connections through the proxy it hangs on, until the restart: keep
	// that well under a lease, or the stall, longer than the test's faults
	// are meant to be, would leave records to lapse to UNKNOWN.
	tp.callTimeout = retryLease / 2
	nodeExe, nodeDir := retryNodeClient(t)
	pyScript := retryPythonClient(t)
	s := seed(t)
	rng := rand.New(rand.NewPCG(s, 22))
	var verdict string
	lastWords(t, func() string { return verdict })

	c := coordtest.Start(t, coordtest.Options{
		Config:        fmt.Sprintf("defaults: { lease: %s, on_unknown: hold }\n", retryLease),
		ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})

	// The demos, each with its own coordinator connection through a proxy.
	store := projectshttp.NewStore()
	httpIdem := clients.New(dial(t, tp.proxy("httpdemo-coordinator", c.Addr)), clients.WithLogger(errorLogger(t)))
	httpDemo := serveHTTP(t, projectshttp.NewHandler(httpIdem, store))
	svc := projects.NewService()
	grpcIdem := clients.New(dial(t, tp.proxy("grpcdemo-coordinator", c.Addr)), clients.WithLogger(errorLogger(t)))
	grpcDemo := serveGRPC(t, projects.NewGRPCServer(grpcIdem, svc))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = errors.Join(httpIdem.Shutdown(ctx), grpcIdem.Shutdown(ctx))
	})

	httpEffects := func() map[string]int {
		n := map[string]int{}
		for _, p := range store.Projects() {
			n[p.Name]++
		}
		return n
	}
	grpcEffects := func() map[string]int {
		n := map[string]int{}
		for _, p := range svc.Projects() {
			n[p.GetName()]++
		}
		return n
	}
	const httpScope = "http"
	const grpcScope = "/projects.v1.ProjectsService/CreateProject"
	opsPerClient := byMode(100, 400)
	rcs := []*retryClient{
		{name: "go-retryablehttp", scope: httpScope, effects: httpEffects, short: msRange(2, 30)},
		{name: "grpc-go-retrypolicy", scope: grpcScope, effects: grpcEffects, short: usRange(500, 6000)},
		{name: "node-axios-retry", scope: httpScope, effects: httpEffects, short: msRange(2, 30)},
		{name: "python-requests-urllib3", scope: httpScope, effects: httpEffects, short: msRange(2, 30)},
	}
	planDir := t.TempDir()
	var clientProxies []string
	for _, rc := range rcs {
		rc.user = "user-" + rc.name
		upstream := httpDemo
		if rc.scope == grpcScope {
			upstream = grpcDemo
		}
		addr := tp.proxy(rc.name, upstream)
		clientProxies = append(clientProxies, rc.name)
		rc.ops = planOps(rng, rc, opsPerClient)
		switch rc.name {
		case "go-retryablehttp":
			rc.run = retryablehttpClient("http://"+addr+"/projects", rc.user)
		case "grpc-go-retrypolicy":
			rc.run = grpcRetryPolicyClient(t, addr, rc.user)
		case "node-axios-retry":
			rc.run = scriptClient(planDir, rc, "http://"+addr+"/projects", nodeDir, nodeExe, filepath.Join(nodeDir, "client.js"))
		case "python-requests-urllib3":
			rc.run = scriptClient(planDir, rc, "http://"+addr+"/projects", filepath.Dir(pyScript), python3, pyScript)
		}
	}

	// Under faults: every client at once.
	start := time.Now()
	faults := startRetryFaults(t, tp, rng.Uint64(), clientProxies, []string{"httpdemo-coordinator", "grpcdemo-coordinator"})
	ctx, cancel := context.WithTimeout(context.Background(), byMode(90*time.Second, 150*time.Second))
	defer cancel()
	runAll(t, ctx, rcs, "faults")
	counts := faults.stop()
	// A reset that times out restarts toxiproxy, which leaves no toxics.
	if err := tp.reset(); err != nil {
		t.Fatalf("toxiproxy reset: %v", err)
	}
	underFaults := time.Since(start)

	// Every lease of an abandoned attempt lapses, and the background
	// Complete/Fail retries of the demos (up to one lease) end.
	time.Sleep(retryLease + time.Second)
	coordConn := dial(t, c.Addr)
	coord := idempotencyv1.NewCoordinatorClient(coordConn)
	planned := map[[2]string]bool{}
	for _, rc := range rcs {
		rc.effectsAtCheck = rc.effects()
		rc.records = lookupAll(t, coord, rc)
		for _, op := range rc.ops {
			planned[[2]string{rc.scope, clients.FoldPrincipal(rc.user, op.Key)}] = true
		}
	}
	// Every held record, whoever's: none may belong to a key no client sent.
	held, unplanned := heldRecords(t, idempotencyv1.NewAdminClient(coordConn), planned)
	t.Logf("chaos: %s: held records (ListRecords IN_PROGRESS, UNKNOWN) %d, of keys no client sent %d", t.Name(), held, len(unplanned))
	if len(unplanned) > 0 {
		t.Errorf("%d held record(s) of keys no client sent, the first: %v", len(unplanned), unplanned[:min(4, len(unplanned))])
	}

	// Without faults: every operation once more.
	runAll(t, ctx, rcs, "replay")

	failed := false
	var summary []string
	for _, rc := range rcs {
		r := rc.verify()
		line := fmt.Sprintf("client=%s ops=%d side_effects_per_key=%s mismatched_replays=%d stranded=%d",
			rc.name, len(rc.ops), r.effectsPerKey(), r.mismatched, r.stranded)
		summary = append(summary, line)
		t.Logf("chaos: %s: %s", t.Name(), line)
		t.Logf("chaos: %s: client=%s detail answered_under_faults=%d answered=%d keys_by_effects=%v answered_not_once=%d held_after_effect=%d answers_under_faults=%v client_retries_under_faults=%d answers_replay=%v",
			t.Name(), rc.name, r.answeredUnderFaults, r.answered, r.byEffects, r.answeredNotOnce, r.heldAfterEffect,
			r.answersFaults, r.retries, r.answersReplay)
		if offending := r.offending(); len(offending) > 0 {
			failed = true
			t.Errorf("client %s: %d key(s) with more than one side effect, %d answered a success without exactly one, %d mismatched replay(s), %d stranded; the first of each:\n  %s",
				rc.name, r.double, r.answeredNotOnce, r.mismatched, r.stranded, strings.Join(offending, "\n  "))
		}
	}
	t.Logf("chaos: %s: faults %s for %.1fs over %d proxies (seed %d)", t.Name(), faultCounts(counts, tp.restartCount()), underFaults.Seconds(), len(rcs)+2, s)
	if failed {
		verdict = strings.Join(summary, "; ")
	}
}

// retryOp is one logical operation: a project to create under one
// Idempotency-Key, and the time-out of its first send under faults.
type retryOp struct {
	Key       string        `json:"key"`
	Name      string        `json:"name"`
	Timeout   time.Duration `json:"-"`
	TimeoutMS int64         `json:"timeout_ms"`
}

// answer is what one send of an operation got after the client's retries.
type answer struct {
	Status int    `json:"status"` // HTTP status; 0 when no answer came
	Code   string `json:"code"`   // gRPC status code (gRPC only)
	Body   []byte `json:"body"`   // HTTP body, or the gRPC response's deterministic encoding
	Result string `json:"result"` // the Idempotency-Result header
	Error  string `json:"error"`
	// Retries is how many times the client's retry logic resent the
	// request within this send, as far as the client tells.
	Retries int `json:"retries"`
}

func (a answer) ok() bool {
	if a.Code != "" {
		return a.Code == codes.OK.String()
	}
	return a.Status/100 == 2
}

func (a answer) label() string {
	switch {
	case a.Code != "":
		return a.Code
	case a.Status != 0:
		return fmt.Sprint(a.Status)
	}
	return "no-answer"
}

// retryClient is one retrying client, its operations and what it got.
type retryClient struct {
	name, user, scope string
	short             func(*rand.Rand) time.Duration
	effects           func() map[string]int // project name → projects made
	run               func(ctx context.Context, phase string, ops []retryOp) ([][]answer, error)
	ops               []retryOp

	sends          map[string][][]answer // phase → op → sends
	effectsAtCheck map[string]int
	records        []*idempotencyv1.Record // by op; nil when absent
}

const normalTimeout = 3 * time.Second

func msRange(lo, hi int) func(*rand.Rand) time.Duration {
	return func(r *rand.Rand) time.Duration { return time.Duration(lo+r.IntN(hi-lo+1)) * time.Millisecond }
}

func usRange(lo, hi int) func(*rand.Rand) time.Duration {
	return func(r *rand.Rand) time.Duration { return time.Duration(lo+r.IntN(hi-lo+1)) * time.Microsecond }
}

// planOps makes n operations: a UUIDv4 key and a unique project name each;
// 40% get a short first time-out.
func planOps(rng *rand.Rand, rc *retryClient, n int) []retryOp {
	ops := make([]retryOp, n)
	for i := range ops {
		var u [16]byte
		for j := range u {
			u[j] = byte(rng.Uint32())
		}
		u[6], u[8] = u[6]&0x0f|0x40, u[8]&0x3f|0x80
		op := retryOp{Key: fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]),
			Name: fmt.Sprintf("%s-%03d", rc.name, i), Timeout: normalTimeout}
		if rng.Float64() < 0.4 {
			op.Timeout = rc.short(rng)
		}
		op.TimeoutMS = max(1, op.Timeout.Milliseconds())
		ops[i] = op
	}
	return ops
}

// runAll runs phase of every client at once.
func runAll(t *testing.T, ctx context.Context, rcs []*retryClient, phase string) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(rcs))
	for i, rc := range rcs {
		wg.Go(func() {
			got, err := rc.run(ctx, phase, rc.ops)
			if err == nil && len(got) != len(rc.ops) {
				err = fmt.Errorf("%d answers for %d operations", len(got), len(rc.ops))
			}
			if rc.sends == nil {
				rc.sends = map[string][][]answer{}
			}
			rc.sends[phase], errs[i] = got, err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("client %s, %s: %v", rcs[i].name, phase, err)
		}
	}
}

// lookupAll reads the record of every operation of rc.
func lookupAll(t *testing.T, coord idempotencyv1.CoordinatorClient, rc *retryClient) []*idempotencyv1.Record {
	t.Helper()
	out := make([]*idempotencyv1.Record, len(rc.ops))
	for i, op := range rc.ops {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		res, err := coord.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: rc.scope, Key: clients.FoldPrincipal(rc.user, op.Key)})
		cancel()
		switch status.Code(err) {
		case codes.OK:
			out[i] = res.GetRecord()
		case codes.NotFound:
		default:
			t.Fatalf("Lookup %s %s: %v", rc.scope, op.Key, err)
		}
	}
	return out
}

// heldRecords lists every record IN_PROGRESS or UNKNOWN and returns how
// many there are and those whose (scope, key) is not in planned.
func heldRecords(t *testing.T, admin idempotencyv1.AdminClient, planned map[[2]string]bool) (int, []string) {
	t.Helper()
	n := 0
	var unplanned []string
	for _, st := range []idempotencyv1.State{idempotencyv1.State_STATE_IN_PROGRESS, idempotencyv1.State_STATE_UNKNOWN} {
		for token := ""; ; {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			res, err := admin.ListRecords(ctx, &idempotencyv1.ListRecordsRequest{State: st, PageSize: 1000, PageToken: token})
			cancel()
			if err != nil {
				t.Fatalf("ListRecords %s: %v", st, err)
			}
			for _, r := range res.GetRecords() {
				n++
				if !planned[[2]string{r.GetScope(), r.GetKey()}] {
					unplanned = append(unplanned, fmt.Sprintf("%s %s %s", r.GetScope(), r.GetKey(), r.GetState()))
				}
			}
			if token = res.GetNextPageToken(); token == "" {
				break
			}
		}
	}
	return n, unplanned
}

// retryReport is what verify found for one client.
type retryReport struct {
	answeredUnderFaults, answered int
	byEffects                     map[int]int // side effects → keys
	minEffects, maxEffects        int         // over keys answered a success or with a side effect
	double, answeredNotOnce       int
	mismatched                    int
	stranded, heldAfterEffect     int
	answersFaults, answersReplay  map[string]int
	retries                       int
	// offenders are the first few offending keys of each kind (double,
	// notOnce, mismatch, stranded), described.
	offenders map[string][]string
}

// offenderKinds orders the kinds of offenders in a report.
var offenderKinds = []string{"double", "notOnce", "mismatch", "stranded"}

func (r *retryReport) offending() []string {
	var out []string
	for _, k := range offenderKinds {
		out = append(out, r.offenders[k]...)
	}
	return out
}

func (r *retryReport) effectsPerKey() string {
	if r.minEffects == r.maxEffects {
		return fmt.Sprint(r.minEffects)
	}
	return fmt.Sprintf("%d..%d", r.minEffects, r.maxEffects)
}

func (rc *retryClient) verify() *retryReport {
	r := &retryReport{byEffects: map[int]int{}, answersFaults: map[string]int{}, answersReplay: map[string]int{},
		minEffects: 1, maxEffects: 1}
	final := rc.effects()
	r.offenders = map[string][]string{}
	offend := func(kind, format string, args ...any) {
		if len(r.offenders[kind]) < 4 {
			r.offenders[kind] = append(r.offenders[kind], fmt.Sprintf(format, args...))
		}
	}
	for i, op := range rc.ops {
		under, replay := rc.sends["faults"][i], rc.sends["replay"][i]
		var all []answer
		for _, a := range under {
			r.answersFaults[a.label()]++
			r.retries += a.Retries
		}
		for _, a := range replay {
			r.answersReplay[a.label()]++
		}
		all = append(append(all, under...), replay...)
		n := final[op.Name]
		r.byEffects[n]++
		var first *answer
		answeredHere := false
		for j := range all {
			a := &all[j]
			if !a.ok() {
				continue
			}
			if j < len(under) {
				answeredHere = true
			}
			if first == nil {
				first = a
				continue
			}
			if a.label() != first.label() || !bytes.Equal(a.Body, first.Body) {
				r.mismatched++
				offend("mismatch", "mismatched replay: key=%s name=%s first=%s %q later=%s %q (%s)", op.Key, op.Name,
					first.label(), first.Body, a.label(), a.Body, a.Result)
			}
		}
		if answeredHere {
			r.answeredUnderFaults++
		}
		if first != nil || n > 0 {
			r.minEffects, r.maxEffects = min(r.minEffects, n), max(r.maxEffects, n)
		}
		if first != nil {
			r.answered++
			if n != 1 {
				r.answeredNotOnce++
				offend("notOnce", "answered %s but %d side effects: key=%s name=%s", first.label(), n, op.Key, op.Name)
			}
		}
		if n > 1 {
			r.double++
			offend("double", "%d side effects: key=%s name=%s answers=%s", n, op.Key, op.Name, labels(all))
		}
		rec := rc.records[i]
		held := rec != nil && (rec.GetState() == idempotencyv1.State_STATE_IN_PROGRESS ||
			rec.GetState() == idempotencyv1.State_STATE_UNKNOWN || rec.GetUncertain())
		if !held {
			continue
		}
		if rc.effectsAtCheck[op.Name] == 0 {
			r.stranded++
			offend("stranded", "stranded: key=%s name=%s state=%s uncertain=%t attempt=%d, handler never ran; first send timeout %v; answers under faults %s, replay %s",
				op.Key, op.Name, rec.GetState(), rec.GetUncertain(), rec.GetAttempt(), op.Timeout, labels(under), labels(replay))
		} else {
			r.heldAfterEffect++
		}
	}
	return r
}

func labels(as []answer) string {
	var out []string
	for _, a := range as {
		l := a.label()
		if a.Result != "" {
			l += "(" + a.Result + ")"
		}
		out = append(out, l)
	}
	return "[" + strings.Join(out, " ") + "]"
}

// retryablehttpClient sends operations with go-retryablehttp: connection
// errors, time-outs, 429 and 5xx are retried (its default policy, Retry-After
// honoured), the same request with the same Idempotency-Key each time.
func retryablehttpClient(url, user string) func(context.Context, string, []retryOp) ([][]answer, error) {
	transport := http.DefaultTransport.(*http.Transport).Clone()
	send := func(ctx context.Context, op retryOp, timeout time.Duration) answer {
		rc := retryablehttp.NewClient()
		rc.HTTPClient = &http.Client{Transport: transport, Timeout: timeout}
		rc.RetryMax = 4
		rc.RetryWaitMin, rc.RetryWaitMax = 10*time.Millisecond, 200*time.Millisecond
		rc.Logger = nil
		rc.ErrorHandler = retryablehttp.PassthroughErrorHandler
		retries := 0
		rc.RequestLogHook = func(_ retryablehttp.Logger, _ *http.Request, attempt int) { retries = attempt }
		body, _ := json.Marshal(map[string]string{"name": op.Name, "prompt": "from go-retryablehttp"})
		req, err := retryablehttp.NewRequestWithContext(ctx, http.MethodPost, url, body)
		if err != nil {
			return answer{Error: err.Error()}
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(clients.HTTPKeyHeader, op.Key)
		req.Header.Set(projectshttp.UserHeader, user)
		resp, err := rc.Do(req)
		if err != nil {
			return answer{Error: err.Error(), Retries: retries}
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return answer{Error: fmt.Sprintf("reading the body of a %d: %v", resp.StatusCode, err), Retries: retries}
		}
		return answer{Status: resp.StatusCode, Body: b, Result: resp.Header.Get(clients.HTTPResultHeader), Retries: retries}
	}
	return goClient(send, func(a answer) bool { return a.Status == 0 })
}

// grpcRetryServiceConfig is grpc-go's own retry: UNAVAILABLE (a connection
// cut) and ABORTED (the interceptor's "another attempt in progress", whose
// grpc-retry-pushback-ms it honours), the same call with the same metadata
// each time.
const grpcRetryServiceConfig = `{"methodConfig": [{
  "name": [{"service": "projects.v1.ProjectsService"}],
  "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.2s",
    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]}}]}`

// grpcRetryPolicyClient sends operations as CreateProject calls with
// grpc-go's service-config retryPolicy.
func grpcRetryPolicyClient(t *testing.T, addr, user string) func(context.Context, string, []retryOp) ([][]answer, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(grpcRetryServiceConfig), grpc.WithStatsHandler(attemptCounter{}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	api := projectsv1.NewProjectsServiceClient(conn)
	send := func(ctx context.Context, op retryOp, timeout time.Duration) answer {
		ctx = metadata.AppendToOutgoingContext(ctx, "idempotency-key", op.Key, projects.UserMetadataKey, user)
		var attempts atomic.Int32
		ctx = context.WithValue(ctx, attemptsKey{}, &attempts)
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		var header metadata.MD
		resp, err := api.CreateProject(ctx, &projectsv1.CreateProjectRequest{Name: op.Name, Prompt: "from grpc-go"},
			grpc.Header(&header))
		a := answer{Code: status.Code(err).String(), Retries: max(0, int(attempts.Load())-1)}
		if v := header.Get(clients.ResultHeader); len(v) > 0 {
			a.Result = v[0]
		}
		if err != nil {
			a.Error = err.Error()
			return a
		}
		a.Body, _ = proto.MarshalOptions{Deterministic: true}.Marshal(resp)
		return a
	}
	return goClient(send, func(a answer) bool {
		return a.Code == codes.DeadlineExceeded.String() || a.Code == codes.Unavailable.String()
	})
}

// attemptCounter counts the attempts grpc-go makes of a call (its retries
// and transparent retries included) in the counter the call's context
// carries.
type attemptCounter struct{}

type attemptsKey struct{}

func (attemptCounter) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (attemptCounter) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if b, ok := s.(*stats.Begin); ok && b.IsClient() {
		if n, ok := ctx.Value(attemptsKey{}).(*atomic.Int32); ok {
			n.Add(1)
		}
	}
}
func (attemptCounter) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (attemptCounter) HandleConn(context.Context, stats.ConnStats)                       {}

// goClient runs the operations of an in-process client from 8 goroutines:
// under faults each operation is sent with its own time-out and, when that
// got no answer (noAnswer), once more with the normal one; in the replay
// once with the normal one.
func goClient(send func(context.Context, retryOp, time.Duration) answer, noAnswer func(answer) bool) func(context.Context, string, []retryOp) ([][]answer, error) {
	return func(ctx context.Context, phase string, ops []retryOp) ([][]answer, error) {
		out := make([][]answer, len(ops))
		next := make(chan int)
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for i := range next {
					op := ops[i]
					if phase != "faults" {
						out[i] = []answer{send(ctx, op, normalTimeout)}
						continue
					}
					a := send(ctx, op, op.Timeout)
					out[i] = []answer{a}
					if noAnswer(a) {
						out[i] = append(out[i], send(ctx, op, normalTimeout))
					}
				}
			})
		}
		for i := range ops {
			next <- i
		}
		close(next)
		wg.Wait()
		return out, ctx.Err()
	}
}

// scriptClient runs the operations of rc with a script (Node or Python):
// it writes the plan the script reads and parses the JSON line the script
// prints per operation.
func scriptClient(planDir string, rc *retryClient, url, dir, exe string, args ...string) func(context.Context, string, []retryOp) ([][]answer, error) {
	return func(ctx context.Context, phase string, ops []retryOp) ([][]answer, error) {
		plan, err := json.Marshal(map[string]any{"url": url, "user": rc.user, "concurrency": 8, "retries": 4,
			"normal_timeout_ms": normalTimeout.Milliseconds(), "ops": ops})
		if err != nil {
			return nil, err
		}
		planFile := filepath.Join(planDir, rc.name+".json")
		if err := os.WriteFile(planFile, plan, 0o644); err != nil {
			return nil, err
		}
		cmd := exec.CommandContext(ctx, exe, append(args, planFile, phase)...)
		cmd.Dir = dir
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			return nil, err
		}
		out := make([][]answer, len(ops))
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		seen := 0
		var parseErr error
		for sc.Scan() {
			var line struct {
				I     int      `json:"i"`
				Sends []answer `json:"sends"`
			}
			if err := json.Unmarshal(sc.Bytes(), &line); err != nil || line.I < 0 || line.I >= len(ops) || len(line.Sends) == 0 {
				parseErr = errors.Join(parseErr, fmt.Errorf("bad line %q: %v", sc.Bytes(), err))
				continue
			}
			out[line.I] = line.Sends
			seen++
		}
		if err := cmd.Wait(); err != nil {
			return nil, fmt.Errorf("%s: %v\n%s", strings.Join(cmd.Args, " "), err, tail(stderr.String(), 4096))
		}
		if parseErr != nil || seen != len(ops) {
			return nil, fmt.Errorf("%s: %d of %d operations reported: %v\n%s", strings.Join(cmd.Args, " "), seen, len(ops), parseErr, tail(stderr.String(), 4096))
		}
		return out, nil
	}
}

// python3 is the interpreter of the Python client: Debian's, with Debian's
// python3-requests.
const python3 = "/usr/bin/python3"

// retryNodeClient returns node and the Node client's folder, or skips (fails
// under CI) naming what is missing.
func retryNodeClient(t *testing.T) (exe, dir string) {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("testdata", "retryclients", "node"))
	if err != nil {
		t.Fatal(err)
	}
	exe, err = exec.LookPath("node")
	if err != nil {
		missingToolf(t, "no `node` on PATH; install Node.js (Debian: apt-get install nodejs npm), then `npm ci --prefix chaos/testdata/retryclients/node`")
	}
	for _, m := range []string{"axios", "axios-retry"} {
		if _, err := os.Stat(filepath.Join(dir, "node_modules", m, "package.json")); err != nil {
			missingToolf(t, "chaos/testdata/retryclients/node/node_modules/%s is missing; install it with `npm ci --prefix chaos/testdata/retryclients/node`", m)
		}
	}
	return exe, dir
}

// retryPythonClient returns the Python client's script, or skips (fails
// under CI) naming what is missing.
func retryPythonClient(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat(python3); err != nil {
		missingToolf(t, "no %s; install it with `apt-get install python3 python3-requests`", python3)
	}
	if out, err := exec.Command(python3, "-c", "import requests, urllib3.util.retry").CombinedOutput(); err != nil {
		missingToolf(t, "%s cannot import requests (%s); install it with `apt-get install python3-requests`", python3, bytes.TrimSpace(out))
	}
	script, err := filepath.Abs(filepath.Join("testdata", "retryclients", "client.py"))
	if err != nil {
		t.Fatal(err)
	}
	return script
}

// serveHTTP serves h on a loopback port until the test ends and returns
// the address.
func serveHTTP(t *testing.T, h http.Handler) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	})
	return lis.Addr().String()
}

// serveGRPC serves srv on a loopback port until the test ends and returns
// the address.
func serveGRPC(t *testing.T, srv *grpc.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// retryFaults injects faults through toxiproxy until stop: a steady
// latency with jitter on every proxy and small slices on the requests to
// the demos, and, from three goroutines, every 50-250 ms one short fault on
// a random proxy: connections reset (reset_peer), a black hole that closes
// the connection after 50-300 ms (timeout), or a latency spike of 20-100 ms.
// A control call that times out restarts toxiproxy (see toxiproxy), which
// cuts every connection through it and sets the steady toxics again; the
// test counts those restarts as faults (toxiproxy_restart).
type retryFaults struct {
	tp    *toxiproxy
	stopc chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	count map[string]int
}

func startRetryFaults(t *testing.T, tp *toxiproxy, seed uint64, clientProxies, coordinatorProxies []string) *retryFaults {
	t.Helper()
	var steady []proxyToxic
	for _, p := range coordinatorProxies {
		steady = append(steady,
			proxyToxic{p, toxic{Name: "lag-up", Type: "latency", Stream: "upstream", Toxicity: 1, Attributes: map[string]int64{"latency": 1, "jitter": 1}}},
			proxyToxic{p, toxic{Name: "lag-down", Type: "latency", Stream: "downstream", Toxicity: 1, Attributes: map[string]int64{"latency": 2, "jitter": 2}}})
	}
	for _, p := range clientProxies {
		steady = append(steady,
			proxyToxic{p, toxic{Name: "lag-down", Type: "latency", Stream: "downstream", Toxicity: 1, Attributes: map[string]int64{"latency": 1, "jitter": 1}}},
			proxyToxic{p, toxic{Name: "slices", Type: "slicer", Stream: "upstream", Toxicity: 0.5,
				Attributes: map[string]int64{"average_size": 48, "size_variation": 32, "delay": 200}}})
	}
	// The steady toxics are set again after a restart of toxiproxy until
	// stop.
	if err := tp.setSteady(steady); err != nil {
		t.Fatalf("toxiproxy: %v", err)
	}
	f := &retryFaults{tp: tp, stopc: make(chan struct{}), count: map[string]int{}}
	all := append(append([]string(nil), clientProxies...), coordinatorProxies...)
	for g := range 3 {
		rng := rand.New(rand.NewPCG(seed, uint64(g)))
		f.wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-f.stopc:
					return
				case <-time.After(time.Duration(50+rng.IntN(200)) * time.Millisecond):
				}
				proxy := all[rng.IntN(len(all))]
				stream := [2]string{"upstream", "downstream"}[rng.IntN(2)]
				tx := toxic{Name: fmt.Sprintf("fault-%d-%d", g, n), Stream: stream}
				var window time.Duration
				switch x := rng.Float64(); {
				case x < 0.45:
					tx.Type, tx.Toxicity = "reset_peer", 0.5
					tx.Attributes = map[string]int64{"timeout": 0}
					window = time.Duration(20+rng.IntN(60)) * time.Millisecond
				case x < 0.7:
					ms := 50 + rng.IntN(250)
					tx.Type, tx.Toxicity = "timeout", 0.5
					tx.Attributes = map[string]int64{"timeout": int64(ms)}
					window = time.Duration(ms) * time.Millisecond
				default:
					tx.Type, tx.Toxicity = "latency", 1
					tx.Attributes = map[string]int64{"latency": int64(20 + rng.IntN(80)), "jitter": 20}
					window = time.Duration(100+rng.IntN(300)) * time.Millisecond
				}
				// A control call that times out restarts toxiproxy
				// (errToxiproxyRestarted): the toxic is gone with the
				// old server, and the faults carry on. Another proxy's
				// call may restart it while this toxic is on: then its
				// removal finds it gone (404) under a new generation.
				gen := tp.generation()
				if err := tp.add(proxy, tx); errors.Is(err, errToxiproxyRestarted) {
					continue
				} else if err != nil {
					t.Errorf("toxiproxy: %v", err)
					return
				}
				time.Sleep(window)
				if err := tp.remove(proxy, tx.Name); err != nil && !errors.Is(err, errToxiproxyRestarted) && tp.generation() == gen {
					t.Errorf("toxiproxy: %v", err)
					return
				}
				f.mu.Lock()
				f.count[tx.Type]++
				f.mu.Unlock()
			}
		})
	}
	return f
}

// stop ends the faults (the steady toxics stay until a reset, but are no
// longer set again after a restart of toxiproxy) and returns how many of
// each kind were injected.
func (f *retryFaults) stop() map[string]int {
	close(f.stopc)
	f.wg.Wait()
	f.tp.mu.Lock()
	f.tp.steady = nil
	f.tp.mu.Unlock()
	return f.count
}

// faultCounts formats counts (and toxiproxy's restarts, which cut every
// connection through the proxies, a fault of their own) as kind=n, the
// kinds sorted.
func faultCounts(counts map[string]int, restarts int) string {
	kinds := make([]string, 0, len(counts))
	for k := range counts {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	var parts []string
	for _, k := range kinds {
		parts = append(parts, fmt.Sprintf("%s=%d", k, counts[k]))
	}
	parts = append(parts, fmt.Sprintf("toxiproxy_restart=%d", restarts))
	return strings.Join(parts, " ")
}
