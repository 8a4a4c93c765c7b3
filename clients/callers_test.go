package clients_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/hashicorp/go-retryablehttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemcoord/idemcoord/clients"
	projectsv1 "github.com/idemcoord/idemcoord/examples/projects/gen/projects/v1"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// tenantConfig is a coordinator config with auth on: one tenant whose
// token is token, allowed every scope.
func tenantConfig(token string) string {
	sum := sha256.Sum256([]byte(token))
	return fmt.Sprintf("tenants:\n  - { name: svc, token_sha256: %s, scopes: [\"*\"] }\n", hex.EncodeToString(sum[:]))
}

// WithToken sends the bearer token on every call: against a coordinator
// with auth on, a Client without it is refused and one with it acquires,
// and the HTTP middleware built on it works end to end.
func TestWithTokenAuthenticates(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{Config: tenantConfig("s3cret")})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req := &idempotencyv1.BeginRequest{Scope: "build", Key: "k1"}
	if _, err := clients.New(coord.Dial(t), clients.WithMaxAttempts(1)).Begin(ctx, req); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("Begin without a token: %v, want UNAUTHENTICATED", err)
	}
	if _, err := clients.New(coord.Dial(t), clients.WithMaxAttempts(1), clients.WithToken("wrong")).Begin(ctx, req); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("Begin with a wrong token: %v, want UNAUTHENTICATED", err)
	}
	res, err := clients.New(coord.Dial(t), clients.WithToken("s3cret")).Begin(ctx, req)
	if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("Begin with the token: %v, %v", res, err)
	}
	f := startHTTP(t, httpSetup{coord: coord, clientOpts: []clients.Option{clients.WithToken("s3cret")}})
	if r := f.post(t, "tok-1", "x"); r.status != http.StatusCreated || r.header.Get("Idempotency-Result") != "created" {
		t.Fatalf("middleware with the token: %v", r)
	}
}

// retryCharge is a service config that makes grpc-go itself retry Charge
// on UNAVAILABLE.
const retryCharge = `{"methodConfig": [{
  "name": [{"service": "projects.v1.ProjectsService", "method": "Charge"}],
  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`

// UnaryClientInterceptor gives a call one UUIDv4 key that every retry
// grpc-go makes under its service-config retryPolicy repeats: the handler
// answers UNAVAILABLE the first time (recorded RETRYABLE by the server's
// interceptor), grpc-go retries, and the second run sees the same key and
// takes over the same record, which ends COMPLETED at attempt 2. Another
// logical call gets another key; WithIdempotencyKey sets one explicitly.
func TestClientInterceptorKeySurvivesGRPCRetries(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var recorded []string
	f := start(t, setup{
		dialOpts: []grpc.DialOption{
			grpc.WithUnaryInterceptor(clients.UnaryClientInterceptor()),
			grpc.WithDefaultServiceConfig(retryCharge),
		},
		interceptor: []clients.InterceptorOption{clients.WithoutPrincipal()},
		charge: func(ctx context.Context, req *projectsv1.ChargeRequest, n int32) (*projectsv1.ChargeResponse, error) {
			l, _ := clients.LeaseFrom(ctx)
			mu.Lock()
			recorded = append(recorded, l.Key)
			mu.Unlock()
			if n == 1 {
				return nil, status.Error(codes.Unavailable, "injected: try again")
			}
			return bookCharge(ctx, req, n)
		},
	})
	seen := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), recorded...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, err := f.api.Charge(ctx, chargeReq(100))
	if err != nil {
		t.Fatalf("Charge: %v", err)
	}
	keys := seen()
	if len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" {
		t.Fatalf("the handler saw keys %q, want one key on both attempts", keys)
	}
	if u, err := uuid.Parse(keys[0]); err != nil || u.Version() != 4 || u.String() != keys[0] {
		t.Fatalf("key %q is not a canonical UUIDv4 (%v)", keys[0], err)
	}
	rec := f.mustState(t, keys[0], idempotencyv1.State_STATE_COMPLETED)
	if rec.GetAttempt() != 2 {
		t.Fatalf("record attempt %d, want 2 (one record, taken over by the retry)", rec.GetAttempt())
	}
	stored := &projectsv1.ChargeResponse{}
	if err := proto.Unmarshal(rec.GetResponse().GetBody(), stored); err != nil || !proto.Equal(stored, resp) {
		t.Fatalf("stored %v (%v), answered %v", stored, err, resp)
	}

	if _, err := f.api.Charge(ctx, chargeReq(100)); err != nil {
		t.Fatal(err)
	}
	keys = seen()
	if len(keys) != 3 || keys[2] == keys[0] {
		t.Fatalf("a second logical call reused the key: %q", keys)
	}
	var r reply
	r.resp, r.err = f.api.Charge(clients.WithIdempotencyKey(ctx, "my-op-1"), chargeReq(100), grpc.Header(&r.header))
	keys = seen()
	if r.err != nil || keys[len(keys)-1] != "my-op-1" {
		t.Fatalf("WithIdempotencyKey: %v, keys %q", r.err, keys)
	}
	again, err := f.api.Charge(clients.WithIdempotencyKey(clients.WithIdempotencyKey(ctx, "other"), "my-op-1"), chargeReq(100))
	keys = seen()
	if err != nil || !proto.Equal(again, r.resp) || len(keys) != 4 {
		t.Fatalf("the same explicit key again: %v, %v (runs %d), want the replay of %v", again, err, len(keys), r.resp)
	}
}

// StampIdempotencyKey with go-retryablehttp: the key is stamped once, as an
// sf-string, before the retry loop; the first response is lost on its way
// back (a proxy answers 502 after the service stored it), the client
// retries with the same key and gets the replay: the side effect ran once.
func TestStampIdempotencyKeyWithRetryingHTTPClient(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{})
	upstream, _ := url.Parse(f.url)
	var proxied atomic.Int32
	var seenKeys sync.Map
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seenKeys.Store(r.Header.Get("Idempotency-Key"), true)
		out := r.Clone(r.Context())
		out.RequestURI, out.URL.Scheme, out.URL.Host = "", upstream.Scheme, upstream.Host
		resp, err := http.DefaultTransport.RoundTrip(out)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if proxied.Add(1) == 1 {
			http.Error(w, "injected: the answer was lost", http.StatusBadGateway)
			return
		}
		maps.Copy(w.Header(), resp.Header)
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(body)
	}))
	t.Cleanup(proxy.Close)

	client := retryablehttp.NewClient()
	client.RetryWaitMin, client.RetryWaitMax, client.RetryMax = 10*time.Millisecond, 50*time.Millisecond, 3
	client.Logger = nil
	req, err := retryablehttp.NewRequest(http.MethodPost, proxy.URL+"/projects", []byte(`{"name":"demo"}`))
	if err != nil {
		t.Fatal(err)
	}
	key := clients.StampIdempotencyKey(req.Request)
	if u, err := uuid.Parse(key); err != nil || u.Version() != 4 {
		t.Fatalf("stamped key %q is not a UUIDv4 (%v)", key, err)
	}
	if got := req.Header.Get("Idempotency-Key"); got != `"`+key+`"` {
		t.Fatalf("Idempotency-Key header %q, want the sf-string of %q", got, key)
	}
	if again := clients.StampIdempotencyKey(req.Request); again != key || req.Header.Get("Idempotency-Key") != `"`+key+`"` {
		t.Fatalf("a second stamp changed the key: %q", again)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("after a lost answer: %d %v, want the replayed 201", resp.StatusCode, resp.Header)
	}
	if n := proxied.Load(); n != 2 {
		t.Fatalf("the service got %d requests, want 2 (one retry)", n)
	}
	if n := f.runs.Load(); n != 1 {
		t.Fatalf("the side effect ran %d times, want once", n)
	}
	n := 0
	seenKeys.Range(func(any, any) bool { n++; return true })
	if n != 1 {
		t.Fatalf("the retries carried %d different keys", n)
	}
}

// A key the caller set is kept and returned, bare or as an sf-string.
func TestStampIdempotencyKeyKeepsAKey(t *testing.T) {
	t.Parallel()
	for value, want := range map[string]string{"mine-1": "mine-1", `"mine 2"`: "mine 2"} {
		req, _ := http.NewRequest(http.MethodPost, "http://example.invalid/", nil)
		req.Header.Set("Idempotency-Key", value)
		if got := clients.StampIdempotencyKey(req); got != want || req.Header.Get("Idempotency-Key") != value {
			t.Errorf("%q: got %q, header %q", value, got, req.Header.Get("Idempotency-Key"))
		}
	}
}

// jobAPI answers a new job: the job id is the outcome, the request id
// belongs to the request.
func jobAPI(w http.ResponseWriter, r *http.Request, n int32) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusAccepted)
	_ = json.NewEncoder(w).Encode(map[string]string{"jobId": fmt.Sprintf("job_%d", n), "requestId": r.Header.Get("X-Request-Id")})
}

// The HTTP replay hook refreshes the request id of a replay while the job
// id stays the stored one; the record keeps the bytes first stored.
func TestHTTPReplayHookRefreshesPerRequestFields(t *testing.T) {
	t.Parallel()
	hook := func(r *http.Request, stored *idempotencyv1.StoredResponse) *idempotencyv1.StoredResponse {
		var body map[string]string
		if json.Unmarshal(stored.GetBody(), &body) != nil {
			return nil
		}
		body["requestId"] = r.Header.Get("X-Request-Id")
		stored.Body, _ = json.Marshal(body)
		return stored
	}
	f := startHTTP(t, httpSetup{handler: jobAPI, opts: []clients.HTTPOption{clients.WithHTTPReplayHook(hook)}})
	first := f.send(t, http.MethodPost, "/jobs", "job-key", "{}", "X-Request-Id: req-1")
	second := f.send(t, http.MethodPost, "/jobs", "job-key", "{}", "X-Request-Id: req-2")
	var a, b map[string]string
	_ = json.Unmarshal([]byte(first.body), &a)
	_ = json.Unmarshal([]byte(second.body), &b)
	if a["jobId"] != "job_1" || a["requestId"] != "req-1" || b["jobId"] != "job_1" || b["requestId"] != "req-2" ||
		second.header.Get("Idempotency-Result") != "replayed" || second.status != http.StatusAccepted {
		t.Fatalf("first %v, replay %v", first, second)
	}
	rec, _ := f.record(t, "job-key")
	if got := string(rec.GetResponse().GetBody()); got != first.body {
		t.Fatalf("stored body %q changed; first answer was %q", got, first.body)
	}
	if f.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", f.runs.Load())
	}
}

// The interceptor's replay hook changes what a replay sends, never the
// stored record.
func TestReplayHookLeavesRecordUnchanged(t *testing.T) {
	t.Parallel()
	var hooked atomic.Int32
	f := start(t, setup{interceptor: []clients.InterceptorOption{clients.WithoutPrincipal(),
		clients.WithReplayHook(func(ctx context.Context, fullMethod string, resp proto.Message) proto.Message {
			hooked.Add(1)
			if fullMethod != chargeMethod {
				t.Errorf("hook got method %q", fullMethod)
			}
			resp.(*projectsv1.ChargeResponse).Currency = "replayed-" + resp.(*projectsv1.ChargeResponse).GetCurrency()
			return resp
		})}})
	first := f.charge(t, "hook-1", chargeReq(100))
	second := f.charge(t, "hook-1", chargeReq(100))
	if first.err != nil || second.err != nil || second.result() != "replayed" {
		t.Fatalf("first %v, second %v", first, second)
	}
	if second.resp.GetChargeId() != first.resp.GetChargeId() || second.resp.GetCurrency() != "replayed-"+first.resp.GetCurrency() {
		t.Fatalf("replay %v, first %v", second.resp, first.resp)
	}
	if hooked.Load() != 1 {
		t.Fatalf("hook ran %d times, want once (replays only)", hooked.Load())
	}
	rec := f.mustState(t, "hook-1", idempotencyv1.State_STATE_COMPLETED)
	want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(first.resp)
	if !bytes.Equal(rec.GetResponse().GetBody(), want) {
		t.Fatalf("stored body changed by the hook")
	}
}

// Created and replayed HTTP answers tell when the key stops being honoured:
// a replay the record's expires_at exactly, a created answer the moment it
// answered plus the scope's ttl; the interceptor the same in RFC 3339.
func TestExpiryIsTold(t *testing.T) {
	t.Parallel()
	const ttl = 90 * time.Minute
	config := "scopes:\n  - { match: http, ttl: 90m }\n  - { match: \"/projects.v1.*\", ttl: 90m }\n"
	t.Run("http", func(t *testing.T) {
		t.Parallel()
		f := startHTTP(t, httpSetup{config: config})
		before := time.Now().Truncate(time.Second)
		first := f.post(t, "exp-1", "x")
		after := time.Now()
		created, err := http.ParseTime(first.header.Get("Idempotency-Expires"))
		if err != nil || created.Before(before.Add(ttl)) || created.After(after.Add(ttl)) {
			t.Fatalf("created Idempotency-Expires %q (%v), want within [%v, %v]", first.header.Get("Idempotency-Expires"), err, before.Add(ttl), after.Add(ttl))
		}
		replay := f.post(t, "exp-1", "x")
		rec, _ := f.record(t, "exp-1")
		if want := rec.GetExpiresAt().AsTime().UTC().Format(http.TimeFormat); replay.header.Get("Idempotency-Expires") != want {
			t.Fatalf("replayed Idempotency-Expires %q, want the record's %q", replay.header.Get("Idempotency-Expires"), want)
		}
		if problem := f.post(t, "exp-1", "other body"); problem.header.Get("Idempotency-Expires") != "" {
			t.Fatalf("a problem answer tells an expiry: %v", problem)
		}
	})
	t.Run("grpc", func(t *testing.T) {
		t.Parallel()
		f := start(t, setup{config: config, interceptor: []clients.InterceptorOption{clients.WithoutPrincipal()}})
		before := time.Now().Truncate(time.Second)
		first := f.charge(t, "exp-1", chargeReq(100))
		after := time.Now()
		v := first.header.Get(clients.ExpiresHeader)
		created, err := time.Parse(time.RFC3339, strings.Join(v, ""))
		if len(v) != 1 || err != nil || created.Before(before.Add(ttl)) || created.After(after.Add(ttl)) {
			t.Fatalf("created idempotency-expires %q (%v)", v, err)
		}
		replay := f.charge(t, "exp-1", chargeReq(100))
		rec := f.mustState(t, "exp-1", idempotencyv1.State_STATE_COMPLETED)
		if got, want := replay.header.Get(clients.ExpiresHeader), rec.GetExpiresAt().AsTime().UTC().Format(time.RFC3339); len(got) != 1 || got[0] != want {
			t.Fatalf("replayed idempotency-expires %q, want the record's %q", got, want)
		}
	})
}

// A key reused with another request answers 422 by default and 409 with
// WithHTTPMismatchStatus(409); any other status is not taken (logged) and
// 422 stays.
func TestHTTPMismatchStatus(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{})
	for _, tc := range []struct {
		opts []clients.HTTPOption
		want int
	}{
		{nil, http.StatusUnprocessableEntity},
		{[]clients.HTTPOption{clients.WithHTTPMismatchStatus(http.StatusConflict)}, http.StatusConflict},
		{[]clients.HTTPOption{clients.WithHTTPMismatchStatus(http.StatusTeapot)}, http.StatusUnprocessableEntity},
		{[]clients.HTTPOption{clients.WithHTTPMismatchStatus(409), clients.WithHTTPMismatchStatus(500)}, http.StatusConflict},
	} {
		f := startHTTP(t, httpSetup{coord: coord, opts: append(tc.opts, clients.WithHTTPScope(fmt.Sprint("mm", tc.want, len(tc.opts))))})
		if r := f.post(t, "mm-1", "a"); r.status != http.StatusCreated {
			t.Fatalf("first: %v", r)
		}
		wantProblem(t, f.post(t, "mm-1", "b"), tc.want, clients.ProblemKeyReused)
	}
}

// The middleware's writer keeps the optional interfaces of the server's:
// a handler can Flush through it (the client reads the first part while
// the handler still runs) and io.Copy through its ReadFrom; everything
// written is stored and replayed.
func TestHTTPHandlerCanFlushThroughMiddleware(t *testing.T) {
	t.Parallel()
	proceed := make(chan struct{})
	f := startHTTP(t, httpSetup{handler: func(w http.ResponseWriter, r *http.Request, n int32) {
		_, isFlusher := w.(http.Flusher)
		_, isReaderFrom := w.(io.ReaderFrom)
		_, isHijacker := w.(http.Hijacker)
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprintf(w, "flusher=%v readerfrom=%v hijacker=%v\n", isFlusher, isReaderFrom, isHijacker)
		if err := http.NewResponseController(w).Flush(); err != nil {
			fmt.Fprintf(w, "flush: %v\n", err)
		}
		select {
		case <-proceed:
		case <-time.After(10 * time.Second):
		}
		_, _ = io.Copy(w, strings.NewReader("copied\n"))
	}})
	req, _ := http.NewRequest(http.MethodPost, f.url+"/stream", strings.NewReader("x"))
	req.Header.Set("Idempotency-Key", "flush-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line := make([]byte, len("flusher=true readerfrom=true hijacker=true\n"))
	if _, err := io.ReadFull(resp.Body, line); err != nil || string(line) != "flusher=true readerfrom=true hijacker=true\n" {
		t.Fatalf("first part %q (%v): not flushed, or the writer lost an interface", line, err)
	}
	close(proceed)
	rest, _ := io.ReadAll(resp.Body)
	whole := string(line) + string(rest)
	if whole != "flusher=true readerfrom=true hijacker=true\ncopied\n" {
		t.Fatalf("body %q", whole)
	}
	replay := f.send(t, http.MethodPost, "/stream", "flush-1", "x")
	if replay.body != whole || replay.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("replay %v, want %q", replay, whole)
	}
}

// A key of the wrong format for the scope's key_pattern is refused with 400
// before the handler runs.
func TestHTTPKeyPatternRefusesMalformedKey(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{config: "scopes: [{ match: http, key_pattern: uuid }]\n"})
	wantProblem(t, f.post(t, "not-a-uuid", "x"), http.StatusBadRequest, clients.ProblemKeyInvalid)
	if r := f.post(t, uuid.NewString(), "x"); r.status != http.StatusCreated {
		t.Fatalf("a UUID key: %v", r)
	}
	if f.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", f.runs.Load())
	}
}

// A handler that hijacks the connection answers what it likes there; the
// middleware cannot see it, so the attempt is recorded UNKNOWN, never
// stored as a success.
func TestHTTPHijackedIsRecordedUnknown(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{handler: func(w http.ResponseWriter, r *http.Request, n int32) {
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			http.Error(w, "cannot hijack: "+err.Error(), http.StatusInternalServerError)
			return
		}
		defer conn.Close()
		_, _ = buf.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
		_ = buf.Flush()
	}})
	if r := f.post(t, "hj-1", "x"); r.status != http.StatusOK || r.body != "hi" {
		t.Fatalf("hijacked answer: %v", r)
	}
	eventually(t, "the hijacked attempt is recorded UNKNOWN", func() bool {
		rec, code := f.record(t, "hj-1")
		return code == codes.OK && rec.GetState() == idempotencyv1.State_STATE_UNKNOWN
	})
}

// The client interceptor gives keys only to the methods WithClientKeyMethods
// names, makes them with WithClientKeyFunc, and keeps a key the call
// already carries.
func TestClientInterceptorOptions(t *testing.T) {
	t.Parallel()
	n := 0
	intercept := clients.UnaryClientInterceptor(
		clients.WithClientKeyMethods(chargeMethod),
		clients.WithClientKeyFunc(func() string { n++; return fmt.Sprint("k", n) }),
	)
	keyOf := func(ctx context.Context, method string) []string {
		var got []string
		err := intercept(ctx, method, nil, nil, nil, func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
			md, _ := metadata.FromOutgoingContext(ctx)
			got = md.Get(clients.MetadataKey)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	ctx := context.Background()
	if got := keyOf(ctx, chargeMethod); len(got) != 1 || got[0] != "k1" {
		t.Fatalf("Charge: %q", got)
	}
	if got := keyOf(ctx, chargeMethod); len(got) != 1 || got[0] != "k2" {
		t.Fatalf("a second Charge: %q", got)
	}
	if got := keyOf(ctx, getProjectMethod); len(got) != 0 {
		t.Fatalf("GetProject (not named) got a key: %q", got)
	}
	if got := keyOf(clients.WithIdempotencyKey(ctx, "mine"), chargeMethod); len(got) != 1 || got[0] != "mine" {
		t.Fatalf("a call with a key: %q", got)
	}
}
