package clients_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// httpSetup configures an httpFixture.
type httpSetup struct {
	coord      *coordtest.Coordinator // nil: a new one
	config     string
	serverOpts []server.Option // for a new coordinator
	clientOpts []clients.Option
	opts       []clients.HTTPOption
	// handler answers the guarded requests; n counts its runs from 1.
	handler func(w http.ResponseWriter, r *http.Request, n int32)
}

// httpFixture is a real coordinator, a Client of it, and an HTTP service
// on 127.0.0.1:0 behind the middleware (and, outside it, a recovery that
// records a re-panicked value and answers 500).
type httpFixture struct {
	coord    *coordtest.Coordinator
	idem     *clients.Client
	url      string
	runs     atomic.Int32
	panicked atomic.Value
}

func startHTTP(t *testing.T, s httpSetup) *httpFixture {
	t.Helper()
	f := &httpFixture{coord: s.coord}
	if f.coord == nil {
		f.coord = coordtest.Start(t, coordtest.Options{Config: s.config, ServerOptions: s.serverOpts})
	}
	logger := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	f.idem = clients.New(f.coord.Dial(t), fixtureOptions(append([]clients.Option{clients.WithLogger(logger)}, s.clientOpts...)...)...)
	h := s.handler
	if h == nil {
		h = createProject
	}
	app := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h(w, r, f.runs.Add(1)) })
	// One scope for every route, unless a test says otherwise
	// (TestHTTPDefaultScopeIsTheOperation).
	opts := append([]clients.HTTPOption{clients.WithHTTPScope(clients.DefaultHTTPScope)}, s.opts...)
	guarded := clients.HTTPMiddleware(f.idem, opts...)(app)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if p := recover(); p != nil {
				f.panicked.Store(fmt.Sprint(p))
				http.Error(w, "internal error", http.StatusInternalServerError)
			}
		}()
		guarded.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		srv.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := f.idem.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	f.url = srv.URL
	return f
}

// createProject is the default handler: a new project per run, 201 with
// its Location, a header that is not replayed, and a JSON body.
func createProject(w http.ResponseWriter, r *http.Request, n int32) {
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/projects/prj_%d", n))
	w.Header().Set("X-Run", strconv.Itoa(int(n)))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":"prj_%d","request":%q}`, n, body)
}

// httpResp is what the service answered.
type httpResp struct {
	status int
	header http.Header
	body   string
}

func (r httpResp) String() string { return fmt.Sprintf("HTTP %d %v %s", r.status, r.header, r.body) }

// send sends a request; key "" sends no Idempotency-Key, and extra headers
// come as "Name: value".
func (f *httpFixture) send(t *testing.T, method, path, key, body string, headers ...string) httpResp {
	t.Helper()
	req, err := http.NewRequest(method, f.url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ": ")
		req.Header.Add(name, value)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return httpResp{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

func (f *httpFixture) post(t *testing.T, key, body string) httpResp {
	t.Helper()
	return f.send(t, http.MethodPost, "/projects", key, body)
}

// problem decodes an application/problem+json answer and checks its
// status and type.
func wantProblem(t *testing.T, r httpResp, status int, typ string) map[string]any {
	t.Helper()
	if r.status != status || r.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("got %v, want %d application/problem+json", r, status)
	}
	var p map[string]any
	if err := json.Unmarshal([]byte(r.body), &p); err != nil {
		t.Fatalf("problem body %q: %v", r.body, err)
	}
	if p["type"] != typ || p["status"] != float64(status) || p["title"] == "" {
		t.Fatalf("problem %v, want type %s status %d", p, typ, status)
	}
	if r.header.Get("Idempotency-Result") != "" {
		t.Fatalf("a problem answer says Idempotency-Result %q", r.header.Get("Idempotency-Result"))
	}
	return p
}

// record reads the middleware's record of key.
func (f *httpFixture) record(t *testing.T, key string) (*idempotencyv1.Record, codes.Code) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := f.idem.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: clients.DefaultHTTPScope, Key: key})
	if err != nil {
		return nil, status.Code(err)
	}
	return res.GetRecord(), codes.OK
}

// Concurrent duplicate POSTs run the handler once; every one gets the same
// status, Location and body bytes; one says created, the others replayed.
func TestHTTPConcurrentDuplicatesRunOnce(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	f := startHTTP(t, httpSetup{handler: func(w http.ResponseWriter, r *http.Request, n int32) {
		<-release // every duplicate is in flight before the first answers
		createProject(w, r, n)
	}})
	const dup = 20
	replies := make([]httpResp, dup)
	var wg sync.WaitGroup
	for i := range dup {
		wg.Go(func() { replies[i] = f.post(t, "ghost-1", `{"name":"Flower Shop"}`) })
	}
	eventually(t, "the first request to run the handler", func() bool { return f.runs.Load() == 1 })
	close(release)
	wg.Wait()
	if n := f.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times", n)
	}
	results := map[string]int{}
	for i, r := range replies {
		if r.status != http.StatusCreated || r.body != replies[0].body || r.header.Get("Location") != "/projects/prj_1" ||
			r.header.Get("Idempotency-Key") != "ghost-1" {
			t.Fatalf("reply %d: %v (reply 0: %v)", i, r, replies[0])
		}
		results[r.header.Get("Idempotency-Result")]++
	}
	if results["created"] != 1 || results["replayed"] != dup-1 {
		t.Fatalf("Idempotency-Result: %v", results)
	}
	if r := f.post(t, "ghost-1", `{"name":"Flower Shop"}`); r.body != replies[0].body || r.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("later retry: %v", r)
	}
}

// The replay carries the stored status, the allow-listed headers and the
// body byte for byte, and nothing else the handler set; a key sent as a
// structured-field string is the same key.
func TestHTTPReplayHeadersExact(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{
		opts: []clients.HTTPOption{clients.WithHTTPReplayHeaders("x-api-version", "Link")},
		handler: func(w http.ResponseWriter, r *http.Request, n int32) {
			h := w.Header()
			h.Set("Content-Type", "application/vnd.demo+json; charset=utf-8")
			h.Set("Location", "/projects/prj_1")
			h.Set("X-Api-Version", "2026-11-01")
			h.Add("Link", `</projects/prj_1/members>; rel="members"`)
			h.Add("Link", `</projects/prj_1/billing>; rel="billing"`)
			h.Set("Set-Cookie", "session=abc")
			h.Set("X-Run", strconv.Itoa(int(n)))
			w.WriteHeader(http.StatusAccepted)
			_, _ = w.Write([]byte("\x00\xffbinary\r\n body"))
			h.Set("X-After-Write", "ignored") // too late for anyone
		},
	})
	first := f.post(t, "hdr-1", "x")
	if first.status != http.StatusAccepted || first.header.Get("Set-Cookie") != "session=abc" ||
		first.header.Get("Idempotency-Result") != "created" || first.header.Get("Idempotency-Key") != "hdr-1" {
		t.Fatalf("first: %v", first)
	}
	replay := f.send(t, http.MethodPost, "/projects", `"hdr-1"`, "x")
	if replay.status != first.status || replay.body != first.body {
		t.Fatalf("replay %v, first %v", replay, first)
	}
	var names []string
	for name := range replay.header {
		names = append(names, name)
	}
	slices.Sort(names)
	want := []string{"Content-Length", "Content-Type", "Date", "Idempotency-Expires", "Idempotency-Key", "Idempotency-Result", "Idempotent-Replayed", "Link", "Location", "X-Api-Version"}
	if !slices.Equal(names, want) {
		t.Fatalf("replayed headers %v, want %v", names, want)
	}
	for _, name := range []string{"Content-Type", "Location", "X-Api-Version", "Link"} {
		if !slices.Equal(replay.header.Values(name), first.header.Values(name)) {
			t.Fatalf("%s: replayed %q, first %q", name, replay.header.Values(name), first.header.Values(name))
		}
	}
	if replay.header.Get("Idempotency-Result") != "replayed" || replay.header.Get("Idempotency-Key") != `"hdr-1"` ||
		replay.header.Get("Content-Length") != strconv.Itoa(len(first.body)) {
		t.Fatalf("replay: %v", replay)
	}
	if f.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", f.runs.Load())
	}
}

// The same key with another body, path or method is 422 and changes
// nothing; a fingerprint function can ignore what varies between retries.
func TestHTTPChangedRequest(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{})
	first := f.post(t, "k1", `{"name":"Flower Shop"}`)
	if first.status != http.StatusCreated {
		t.Fatalf("first: %v", first)
	}
	for _, r := range []httpResp{
		f.post(t, "k1", `{"name":"Flower Shop!"}`),
		f.send(t, http.MethodPost, "/projects?dry_run=1", "k1", `{"name":"Flower Shop"}`),
		f.send(t, http.MethodPatch, "/projects", "k1", `{"name":"Flower Shop"}`),
	} {
		p := wantProblem(t, r, http.StatusUnprocessableEntity, clients.ProblemKeyReused)
		if r.header.Get("Idempotency-Key") != "k1" || p["detail"] == "" {
			t.Fatalf("422: %v", r)
		}
	}
	if r := f.post(t, "k1", `{"name":"Flower Shop"}`); r.body != first.body || r.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("the original request after the 422s: %v", r)
	}
	if f.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", f.runs.Load())
	}

	// The body's "sent_at" changes between retries: a fingerprint of the
	// name alone makes them one request.
	g := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPFingerprintFunc(
		func(r *http.Request, body []byte) ([]byte, error) {
			var req struct{ Name string }
			if err := json.Unmarshal(body, &req); err != nil {
				return nil, err
			}
			return []byte(r.URL.Path + "\n" + req.Name), nil
		})}})
	a := g.post(t, "k2", `{"name":"Flower Shop","sent_at":1}`)
	b := g.post(t, "k2", `{"name":"Flower Shop","sent_at":2}`)
	if a.status != http.StatusCreated || b.body != a.body || b.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("with a fingerprint function: %v then %v", a, b)
	}
	if !strings.Contains(a.body, `sent_at\":1`) {
		t.Fatalf("the handler did not get the body: %v", a)
	}
	wantProblem(t, g.post(t, "k3", `not json`), http.StatusBadRequest, "about:blank")
}

// While the first request runs, a duplicate waits WithHTTPWait and then
// gets 409 with Retry-After; after the first ends, a retry gets its result.
func TestHTTPInProgressConflict(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	f := startHTTP(t, httpSetup{
		opts: []clients.HTTPOption{clients.WithHTTPWait(200 * time.Millisecond)},
		handler: func(w http.ResponseWriter, r *http.Request, n int32) {
			<-release
			createProject(w, r, n)
		},
	})
	first := make(chan httpResp, 1)
	go func() { first <- f.post(t, "slow", "{}") }()
	eventually(t, "the first request to run", func() bool { return f.runs.Load() == 1 })
	r := f.post(t, "slow", "{}")
	wantProblem(t, r, http.StatusConflict, clients.ProblemInProgress)
	if s, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || s < 1 {
		t.Fatalf("Retry-After %q", r.header.Get("Retry-After"))
	}
	if r.header.Get("Idempotency-Key") != "slow" {
		t.Fatalf("409 without the key: %v", r)
	}
	close(release)
	a := <-first
	if b := f.post(t, "slow", "{}"); a.status != http.StatusCreated || b.body != a.body || b.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("first %v, retry %v", a, b)
	}
}

// Keys: missing (pass through, or 400 when required), invalid (400, no
// record), bare and quoted; unguarded methods pass through.
func TestHTTPKeys(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{})
	if r := f.post(t, "", "{}"); r.status != http.StatusCreated || r.header.Get("Idempotency-Result") != "" {
		t.Fatalf("no key, not required: %v", r)
	}
	for _, key := range []string{`""`, `"a\b"`, `"unterminated`, `"a"b`, `"é"`, strings.Repeat("k", 256),
		`"` + strings.Repeat("k", 256) + `"`} {
		wantProblem(t, f.post(t, key, "{}"), http.StatusBadRequest, clients.ProblemKeyInvalid)
	}
	r := f.send(t, http.MethodPost, "/projects", "", "{}", "Idempotency-Key: a", "Idempotency-Key: b")
	wantProblem(t, r, http.StatusBadRequest, clients.ProblemKeyInvalid)
	if n := f.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1 (the request without a key)", n)
	}
	// 255 bytes is allowed; a quoted key with escapes is its content.
	long := strings.Repeat("k", 255)
	if r := f.post(t, long, "{}"); r.status != http.StatusCreated {
		t.Fatalf("255-byte key: %v", r)
	}
	if r := f.post(t, `"q\"uote\\d"`, "{}"); r.status != http.StatusCreated {
		t.Fatalf("quoted key: %v", r)
	}
	if rec, c := f.record(t, `q"uote\d`); c != codes.OK || rec.GetState() != idempotencyv1.State_STATE_COMPLETED {
		t.Fatalf("record of the quoted key: %v %v", rec, c)
	}
	// GET and PUT are not guarded by default: the handler runs each time.
	before := f.runs.Load()
	for range 2 {
		if r := f.send(t, http.MethodPut, "/projects/prj_1", "put-1", "{}"); r.header.Get("Idempotency-Result") != "" {
			t.Fatalf("PUT: %v", r)
		}
	}
	if f.runs.Load() != before+2 {
		t.Fatalf("PUT did not pass through")
	}

	g := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPRequireKey(),
		clients.WithHTTPMethods(http.MethodPost, http.MethodPut)}})
	wantProblem(t, g.post(t, "", "{}"), http.StatusBadRequest, clients.ProblemKeyMissing)
	a := g.send(t, http.MethodPut, "/projects/prj_1", "put-1", "{}")
	b := g.send(t, http.MethodPut, "/projects/prj_1", "put-1", "{}")
	if b.body != a.body || b.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("PUT guarded: %v then %v", a, b)
	}
	if r := g.send(t, http.MethodPatch, "/projects/prj_1", "", "{}"); r.status != http.StatusCreated {
		t.Fatalf("PATCH is no longer guarded: %v", r)
	}
	if g.runs.Load() != 2 {
		t.Fatalf("handler ran %d times", g.runs.Load())
	}
}

// Handler outcomes are recorded by status, as the interceptor records gRPC
// codes.
func TestHTTPStatusClassification(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var seen []string // "attempt previous" per run
	f := startHTTP(t, httpSetup{handler: func(w http.ResponseWriter, r *http.Request, n int32) {
		attempt, previous, ok := clients.AttemptFrom(r.Context())
		mu.Lock()
		seen = append(seen, fmt.Sprintf("%d %v %v", attempt, previous, ok))
		mu.Unlock()
		code, _ := strconv.Atoi(r.URL.Query().Get("status"))
		if code == 0 {
			panic("handler bug")
		}
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(code)
		fmt.Fprintf(w, "run %d answered %d", n, code)
	}})
	type want struct {
		state   idempotencyv1.State // UNSPECIFIED: no record
		created bool                // the first answer says created
	}
	for status, w := range map[int]want{
		200: {idempotencyv1.State_STATE_COMPLETED, true},
		201: {idempotencyv1.State_STATE_COMPLETED, true},
		303: {idempotencyv1.State_STATE_COMPLETED, true},
		404: {idempotencyv1.State_STATE_FAILED_REPLAYABLE, true},
		409: {idempotencyv1.State_STATE_FAILED_REPLAYABLE, true},
		422: {idempotencyv1.State_STATE_FAILED_REPLAYABLE, true},
		400: {},
		401: {},
		403: {},
		429: {},
		500: {idempotencyv1.State_STATE_UNKNOWN, false},
		502: {idempotencyv1.State_STATE_UNKNOWN, false},
		503: {idempotencyv1.State_STATE_FAILED_RETRYABLE, false},
	} {
		key := fmt.Sprintf("status-%d", status)
		path := fmt.Sprintf("/projects?status=%d", status)
		first := f.send(t, http.MethodPost, path, key, "{}")
		if first.status != status || (first.header.Get("Idempotency-Result") == "created") != w.created {
			t.Fatalf("%d: first answer %v", status, first)
		}
		rec, c := f.record(t, key)
		if w.state == idempotencyv1.State_STATE_UNSPECIFIED {
			if c != codes.NotFound {
				t.Fatalf("%d left a record: %v", status, rec)
			}
		} else if c != codes.OK || rec.GetState() != w.state {
			t.Fatalf("%d: record %v (%v), want %v", status, rec, c, w.state)
		}
		before := f.runs.Load()
		again := f.send(t, http.MethodPost, path, key, "{}")
		if w.created {
			if again.status != status || again.body != first.body || again.header.Get("Idempotency-Result") != "replayed" ||
				f.runs.Load() != before {
				t.Fatalf("%d: retry %v, first %v", status, again, first)
			}
		} else if f.runs.Load() != before+1 {
			t.Fatalf("%d: the retry did not run the handler: %v", status, again)
		}
	}
	mu.Lock()
	// The retry after a 500 runs as attempt 2 after UNKNOWN; after a 503 as
	// attempt 2 after FAILED_RETRYABLE; after a 400 as a new key.
	for _, s := range []string{"2 STATE_UNKNOWN true", "2 STATE_FAILED_RETRYABLE true", "1 STATE_UNSPECIFIED true"} {
		if !slices.Contains(seen, s) {
			t.Fatalf("no run saw %q: %q", s, seen)
		}
	}
	mu.Unlock()

	// A panic: recorded UNKNOWN, and the panic goes on.
	r := f.send(t, http.MethodPost, "/projects", "panic-1", "{}")
	if r.status != http.StatusInternalServerError || f.panicked.Load() != "handler bug" {
		t.Fatalf("panic: %v, recovered %v", r, f.panicked.Load())
	}
	if rec, c := f.record(t, "panic-1"); c != codes.OK || rec.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("after a panic: %v %v", rec, c)
	}
}

// A key held UNKNOWN for an operator answers 409 with its own problem type.
func TestHTTPHeldUnknown(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{config: "scopes:\n  - { match: \"http\", on_unknown: hold }\n",
		handler: func(w http.ResponseWriter, r *http.Request, n int32) { w.WriteHeader(http.StatusInternalServerError) }})
	if r := f.post(t, "held", "{}"); r.status != http.StatusInternalServerError {
		t.Fatalf("first: %v", r)
	}
	wantProblem(t, f.post(t, "held", "{}"), http.StatusConflict, clients.ProblemOutcomeUnknown)
	if f.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", f.runs.Load())
	}
}

// Two end users who send the same key never share a record.
func TestHTTPPrincipal(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPPrincipal(func(r *http.Request) (string, error) {
		u := r.Header.Get("X-User-Id")
		if u == "" {
			return "", fmt.Errorf("no user")
		}
		return u, nil
	})}})
	a := f.send(t, http.MethodPost, "/projects", "same", "{}", "X-User-Id: u1")
	b := f.send(t, http.MethodPost, "/projects", "same", "{}", "X-User-Id: u2")
	a2 := f.send(t, http.MethodPost, "/projects", "same", "{}", "X-User-Id: u1")
	if a.body == b.body || a2.body != a.body || a2.header.Get("Idempotency-Result") != "replayed" || f.runs.Load() != 2 {
		t.Fatalf("u1 %v, u2 %v, u1 again %v", a, b, a2)
	}
	if rec, c := f.record(t, clients.FoldPrincipal("u2", "same")); c != codes.OK || rec.GetState() != idempotencyv1.State_STATE_COMPLETED {
		t.Fatalf("u2's record: %v %v", rec, c)
	}
	wantProblem(t, f.post(t, "same", "{}"), http.StatusBadRequest, "about:blank")
}

// With the coordinator down, a request with a key answers 503 and the
// handler does not run; WithHTTPFailOpen runs it unprotected instead.
func TestHTTPCoordinatorDown(t *testing.T) {
	t.Parallel()
	fast := []clients.Option{clients.WithMaxAttempts(2)}
	f := startHTTP(t, httpSetup{clientOpts: fast})
	open := startHTTP(t, httpSetup{clientOpts: fast, opts: []clients.HTTPOption{clients.WithHTTPFailOpen()}})
	f.coord.Stop()
	open.coord.Stop()
	r := f.post(t, "down-1", "{}")
	wantProblem(t, r, http.StatusServiceUnavailable, clients.ProblemUnavailable)
	if r.header.Get("Retry-After") == "" || f.runs.Load() != 0 {
		t.Fatalf("503 %v; handler runs %d", r, f.runs.Load())
	}
	if r := f.post(t, "", "{}"); r.status != http.StatusCreated {
		t.Fatalf("without a key the coordinator is not needed: %v", r)
	}
	if r := open.post(t, "down-1", "{}"); r.status != http.StatusCreated || r.header.Get("Idempotency-Result") != "" || open.runs.Load() != 1 {
		t.Fatalf("fail open: %v", r)
	}
}

// A body over the limit is 413 and the handler does not run.
func TestHTTPBodyTooLarge(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPMaxBodyBytes(1000)}})
	wantProblem(t, f.post(t, "big", strings.Repeat("x", 1001)), http.StatusRequestEntityTooLarge, clients.ProblemBodyTooLarge)
	if r := f.post(t, "big", strings.Repeat("x", 1000)); r.status != http.StatusCreated || f.runs.Load() != 1 {
		t.Fatalf("1000 bytes: %v", r)
	}
}

func TestParseIdempotencyKey(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"abc": "abc", " abc\t": "abc", `"abc"`: "abc", `"a\"b"`: `a"b`, `"a\\b"`: `a\b`, `"a b"`: "a b",
		"8e03978e-40d5-43e8-bc93-6894a57f9324": "8e03978e-40d5-43e8-bc93-6894a57f9324", "ünï": "ünï", `"`: `"`,
	} {
		if got, err := clients.ParseIdempotencyKey(in); err != nil || got != want {
			t.Errorf("%q: %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "  ", `""`, `"a\nb"`, `"a\tb"`, `"ab`, `"a"b"`, `"a"x`, "a\x01b", "\xff", strings.Repeat("k", 256)} {
		if got, err := clients.ParseIdempotencyKey(in); err == nil {
			t.Errorf("%q accepted as %q", in, got)
		}
	}
}

func FuzzParseIdempotencyKey(f *testing.F) {
	for _, s := range []string{"abc", `"a\"b"`, `"`, `""`, "\xff", `"\`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		key, err := clients.ParseIdempotencyKey(in)
		if err != nil {
			return
		}
		if key == "" || len(key) > 255 || !utf8.ValidString(key) || strings.ContainsFunc(key, unicode.IsControl) {
			t.Fatalf("%q parsed as invalid key %q", in, key)
		}
	})
}

// Fail-open opens only on transport failures: the coordinator's refusal
// (bad credentials here) or its rate limit never runs the handler.
func TestHTTPFailOpenOnlyOnTransportFailure(t *testing.T) {
	t.Parallel()
	refused := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPFailOpen()},
		config: "tenants:\n  - { name: a, token_sha256: 0000000000000000000000000000000000000000000000000000000000000000, scopes: [\"*\"] }\n"})
	wantProblem(t, refused.post(t, "k", "{}"), http.StatusInternalServerError, clients.ProblemInternal)
	limited := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPFailOpen()},
		clientOpts: []clients.Option{clients.WithMaxAttempts(1)},
		config:     "rate_limit: { requests_per_second: 0.001, burst: 2 }\n"})
	if r := limited.post(t, "k1", "{}"); r.status != http.StatusCreated {
		t.Fatalf("first request within the burst: %v", r)
	}
	// The burst is spent by Begin and Complete; the next Begin is refused.
	r := limited.post(t, "k2", "{}")
	wantProblem(t, r, http.StatusServiceUnavailable, clients.ProblemUnavailable)
	if refused.runs.Load() != 0 || limited.runs.Load() != 1 {
		t.Fatalf("handler runs: refused %d, limited %d", refused.runs.Load(), limited.runs.Load())
	}
}

// A handler that runs longer than the lease keeps the key: the middleware
// heartbeats, and a duplicate meanwhile gets 409, not a second run.
func TestHTTPHeartbeatsWhileHandlerRuns(t *testing.T) {
	t.Parallel()
	var f *httpFixture
	leaseExpiry := func() time.Time {
		rec, _ := f.record(t, "long")
		return rec.GetLeaseExpiresAt().AsTime()
	}
	extended, proceed := make(chan struct{}), make(chan struct{})
	f = startHTTP(t, httpSetup{
		clientOpts: []clients.Option{clients.WithLease(time.Second)},
		opts:       []clients.HTTPOption{clients.WithHTTPWait(0)},
		handler: func(w http.ResponseWriter, r *http.Request, n int32) {
			first := leaseExpiry()
			deadline := time.Now().Add(45 * time.Second)
			for !leaseExpiry().After(first.Add(time.Second)) { // past the first lease: extended twice at least
				if time.Now().After(deadline) || r.Context().Err() != nil {
					w.WriteHeader(http.StatusInternalServerError)
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
			close(extended)
			<-proceed
			createProject(w, r, n)
		},
	})
	done := make(chan httpResp, 1)
	go func() { done <- f.post(t, "long", "{}") }()
	<-extended
	wantProblem(t, f.post(t, "long", "{}"), http.StatusConflict, clients.ProblemInProgress)
	close(proceed)
	if r := <-done; r.status != http.StatusCreated || r.header.Get("Idempotency-Result") != "created" {
		t.Fatalf("long request: %v", r)
	}
	if rec, c := f.record(t, "long"); c != codes.OK || rec.GetState() != idempotencyv1.State_STATE_COMPLETED || rec.GetAttempt() != 1 {
		t.Fatalf("record %v %v", rec, c)
	}
}

// Inside an HTTP handler, LeaseFrom gives the lease (key as stored, after
// principal folding) and MarkSideEffect turns every response that is not
// stored into UNKNOWN, while stored ones stay stored.
func TestHTTPLeaseFromAndMarkSideEffect(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	leases := map[string]clients.Lease{} // by the X-Case header
	f := startHTTP(t, httpSetup{
		opts: []clients.HTTPOption{clients.WithHTTPPrincipal(func(r *http.Request) (string, error) { return "u1", nil })},
		handler: func(w http.ResponseWriter, r *http.Request, n int32) {
			l, ok := clients.LeaseFrom(r.Context())
			if ok {
				mu.Lock()
				leases[r.Header.Get("X-Case")] = l
				mu.Unlock()
			}
			if r.URL.Query().Get("mark") == "1" {
				clients.MarkSideEffect(r.Context())
			}
			code, _ := strconv.Atoi(r.URL.Query().Get("status"))
			w.WriteHeader(code)
			fmt.Fprintf(w, "run %d", n)
		},
	})
	for _, c := range []struct {
		mark   bool
		status int
		want   idempotencyv1.State // UNSPECIFIED: no record
	}{
		{false, 400, idempotencyv1.State_STATE_UNSPECIFIED},
		{true, 400, idempotencyv1.State_STATE_UNKNOWN},
		{false, 503, idempotencyv1.State_STATE_FAILED_RETRYABLE},
		{true, 503, idempotencyv1.State_STATE_UNKNOWN},
		{true, 500, idempotencyv1.State_STATE_UNKNOWN},
		{true, 201, idempotencyv1.State_STATE_COMPLETED},
		{true, 422, idempotencyv1.State_STATE_FAILED_REPLAYABLE},
	} {
		name := fmt.Sprintf("mark=%v status=%d", c.mark, c.status)
		key := fmt.Sprintf("mark-%v-%d", c.mark, c.status)
		mark := "0"
		if c.mark {
			mark = "1"
		}
		r := f.send(t, http.MethodPost, "/projects?mark="+mark+"&status="+strconv.Itoa(c.status), key, "{}", "X-Case: "+name)
		if r.status != c.status {
			t.Fatalf("%s: %v", name, r)
		}
		rec, code := f.record(t, clients.FoldPrincipal("u1", key))
		if c.want == idempotencyv1.State_STATE_UNSPECIFIED {
			if code != codes.NotFound {
				t.Fatalf("%s left a record: %v", name, rec)
			}
		} else if code != codes.OK || rec.GetState() != c.want {
			t.Fatalf("%s: record %v (%v), want %v", name, rec, code, c.want)
		}
		mu.Lock()
		l, ok := leases[name]
		mu.Unlock()
		if !ok || l.Scope != clients.DefaultHTTPScope || l.Key != clients.FoldPrincipal("u1", key) || l.Token == "" ||
			l.Generation != 1 || l.Attempt != 1 || l.Previous != idempotencyv1.State_STATE_UNSPECIFIED || l.Uncertain {
			t.Fatalf("%s: LeaseFrom = %+v, %v", name, l, ok)
		}
		if c.want != idempotencyv1.State_STATE_UNSPECIFIED && rec.GetAttempt() != l.Attempt {
			t.Fatalf("%s: lease attempt %d, record %v", name, l.Attempt, rec)
		}
	}
	// The retry after a marked failure runs as an uncertain attempt.
	f.send(t, http.MethodPost, "/projects?mark=1&status=400", "mark-true-400", "{}", "X-Case: retry")
	mu.Lock()
	l := leases["retry"]
	mu.Unlock()
	if l.Attempt != 2 || l.Previous != idempotencyv1.State_STATE_UNKNOWN || !l.Uncertain {
		t.Fatalf("retry after a marked 400: %+v", l)
	}
	// Without a key the handler runs unprotected: no lease.
	f.send(t, http.MethodPost, "/projects?mark=1&status=201", "", "{}", "X-Case: no key")
	mu.Lock()
	_, ok := leases["no key"]
	mu.Unlock()
	if ok {
		t.Fatal("LeaseFrom answered ok without a key")
	}
}

// An HTTP client that times out while the middleware's Begin is in flight
// (the coordinator acquired the key; its answer never arrived) leaves no
// trace: the handler does not run, the record is gone again, and a retry
// with the key runs the handler at once.
func TestHTTPClientTimesOutDuringBegin(t *testing.T) {
	t.Parallel()
	lost := &lostAcquisitions{}
	lost.armed.Store(true)
	f := startHTTP(t, httpSetup{serverOpts: []server.Option{lost.option()}})
	req, err := http.NewRequest(http.MethodPost, f.url+"/projects", strings.NewReader(`{"name":"a"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", "gave-up")
	if resp, err := (&http.Client{Timeout: time.Second}).Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("got HTTP %d, want the client to time out", resp.StatusCode)
	}
	within(t, 10*time.Second, "the Begin answer kept back", func() bool { return lost.held.Load() == 1 })
	lost.armed.Store(false)
	within(t, 10*time.Second, "the abandoned acquisition released (record absent)", func() bool {
		_, code := f.record(t, "gave-up")
		return code == codes.NotFound
	})
	if r := f.post(t, "gave-up", `{"name":"a"}`); r.status != http.StatusCreated || r.header.Get("Idempotency-Result") != "created" {
		t.Fatalf("retry: %v, want 201 created", r)
	}
	if n := f.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

// A handler that returns without writing anything after its request's
// context ended (the client went away) is not taken for a 200: nothing is
// stored, the attempt is recorded FAILED_RETRYABLE (UNKNOWN after
// MarkSideEffect), and the retry runs the handler again.
func TestHTTPHandlerSilentAfterClientLeftIsNotStored(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		mark   bool
		want   idempotencyv1.State
		before idempotencyv1.State
	}{
		{"nothing done", false, idempotencyv1.State_STATE_FAILED_RETRYABLE, idempotencyv1.State_STATE_FAILED_RETRYABLE},
		{"after MarkSideEffect", true, idempotencyv1.State_STATE_UNKNOWN, idempotencyv1.State_STATE_UNKNOWN},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var seen attemptSeen
			f := startHTTP(t, httpSetup{handler: func(w http.ResponseWriter, r *http.Request, n int32) {
				seen.record(r.Context())
				if n == 1 {
					if tc.mark {
						clients.MarkSideEffect(r.Context())
					}
					<-r.Context().Done() // the client is gone: return without a word
					return
				}
				createProject(w, r, n)
			}})
			req, err := http.NewRequest(http.MethodPost, f.url+"/projects", strings.NewReader(`{"name":"a"}`))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Idempotency-Key", "silent")
			if resp, err := (&http.Client{Timeout: 500 * time.Millisecond}).Do(req); err == nil {
				resp.Body.Close()
				t.Fatalf("got HTTP %d, want the client to time out", resp.StatusCode)
			}
			var rec *idempotencyv1.Record
			within(t, 10*time.Second, "the attempt ended", func() bool {
				var code codes.Code
				rec, code = f.record(t, "silent")
				return code == codes.OK && rec.GetState() != idempotencyv1.State_STATE_IN_PROGRESS
			})
			if rec.GetState() != tc.want || rec.GetResponse() != nil {
				t.Fatalf("record %v, want %v with no stored response", rec, tc.want)
			}
			if r := f.post(t, "silent", `{"name":"a"}`); r.status != http.StatusCreated || r.header.Get("Idempotency-Result") != "created" {
				t.Fatalf("retry: %v, want the handler's 201, created", r)
			}
			want := []string{"1 STATE_UNSPECIFIED true", "2 " + tc.before.String() + " true"}
			if got := seen.get(); !equalStrings(got, want) {
				t.Fatalf("AttemptFrom saw %v, want %v", got, want)
			}
		})
	}
}

// When the lease is lost while the handler runs (another attempt took the
// key over) and the handler has written nothing, the answer is 503
// application/problem+json with Retry-After and a problem type ending in
// /lease-lost: never a 2xx, never "Idempotency-Result: created".
func TestHTTPLeaseLostWithNothingWrittenAnswers503(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{FakeClock: true})
	started := make(chan struct{})
	f := startHTTP(t, httpSetup{coord: coord, clientOpts: []clients.Option{clients.WithLease(time.Second)},
		handler: func(w http.ResponseWriter, r *http.Request, n int32) {
			close(started)
			<-r.Context().Done() // cancelled when the lease is lost
		}})
	answer := make(chan httpResp, 1)
	go func() { answer <- f.post(t, "taken", `{"name":"a"}`) }()
	<-started
	// Let the lease run out and take the key over; a heartbeat landing
	// between the two revives the lease, so repeat until the takeover wins.
	eventually(t, "a takeover", func() bool {
		coord.Clock.Advance(2 * time.Second)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := f.idem.Begin(ctx, &idempotencyv1.BeginRequest{Scope: clients.DefaultHTTPScope, Key: "taken", AttemptId: "successor"})
		if err != nil {
			t.Fatal(err)
		}
		return res.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED
	})
	r := <-answer
	p := wantProblem(t, r, http.StatusServiceUnavailable, clients.ProblemLeaseLost)
	if !strings.HasSuffix(p["type"].(string), "/lease-lost") || r.header.Get("Retry-After") == "" {
		t.Fatalf("problem %v, Retry-After %q; want a type ending /lease-lost and Retry-After", p, r.header.Get("Retry-After"))
	}
}

// TestHTTPDefaultScopeIsTheOperation: without WithHTTPScope a record's
// scope is the request's method and path ("POST /projects", without the
// query), prefixed by WithHTTPService's name; a key sent to another route
// runs on its own there.
func TestHTTPDefaultScopeIsTheOperation(t *testing.T) {
	t.Parallel()
	scopeOf := func(t *testing.T, f *httpFixture, scope, key string) idempotencyv1.State {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := f.idem.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: scope, Key: key})
		if status.Code(err) == codes.NotFound {
			return idempotencyv1.State_STATE_UNSPECIFIED
		}
		if err != nil {
			t.Fatal(err)
		}
		return res.GetRecord().GetState()
	}
	t.Run("operation", func(t *testing.T) {
		t.Parallel()
		f := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPScope(""), clients.WithoutHTTPPrincipal()}})
		a := f.send(t, http.MethodPost, "/projects?draft=1", "op-1", "x")
		b := f.send(t, http.MethodPost, "/teams", "op-1", "x")
		if a.header.Get("Idempotency-Result") != "created" || b.header.Get("Idempotency-Result") != "created" || f.runs.Load() != 2 {
			t.Fatalf("answers %v, %v; %d runs, want both created by their own run", a, b, f.runs.Load())
		}
		for _, scope := range []string{"POST /projects", "POST /teams"} {
			if got := scopeOf(t, f, scope, "op-1"); got != idempotencyv1.State_STATE_COMPLETED {
				t.Errorf("record in %q: %v, want COMPLETED", scope, got)
			}
		}
		if got := scopeOf(t, f, clients.DefaultHTTPScope, "op-1"); got != idempotencyv1.State_STATE_UNSPECIFIED {
			t.Errorf("record in %q: %v, want none", clients.DefaultHTTPScope, got)
		}
	})
	t.Run("service", func(t *testing.T) {
		t.Parallel()
		f := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPScope(""), clients.WithHTTPService("billing"), clients.WithoutHTTPPrincipal()}})
		f.send(t, http.MethodPost, "/projects", "svc-1", "x")
		if got := scopeOf(t, f, "billing POST /projects", "svc-1"); got != idempotencyv1.State_STATE_COMPLETED {
			t.Errorf("record in billing POST /projects: %v, want COMPLETED", got)
		}
	})
}

// TestHTTPOperationScopeBounded: a scope that would pass the coordinator's
// 255 bytes is cut and hashed, never cutting a UTF-8 sequence.
func TestHTTPOperationScopeBounded(t *testing.T) {
	t.Parallel()
	if got := clients.HTTPOperationScope("", "POST", "/orders"); got != "POST /orders" {
		t.Errorf("got %q", got)
	}
	if got := clients.HTTPOperationScope("payments", "POST", "/orders"); got != "payments POST /orders" {
		t.Errorf("got %q", got)
	}
	long := clients.HTTPOperationScope("", "POST", "/"+strings.Repeat("a", 300))
	other := clients.HTTPOperationScope("", "POST", "/"+strings.Repeat("a", 299)+"b")
	// The same vector as the Node and Python tests'.
	if len(long) > 255 || !strings.HasPrefix(long, "POST /aaa") || long == other || !utf8.ValidString(long) ||
		!strings.HasSuffix(long, "a~Kp-qwHhV0wj3-SyZ0O5Xk4eZHUE1-0MDl5n_zy6niBg") {
		t.Errorf("long scope %q (%d bytes), other %q", long, len(long), other)
	}
	if got := clients.HTTPOperationScope(strings.Repeat("é", 100), "POST", "/x"); !utf8.ValidString(got) || len(got) > 255 {
		t.Errorf("scope %q is not valid UTF-8 within 255 bytes", got)
	}
}
