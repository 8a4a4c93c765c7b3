package server_test

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/server"
)

// httpAPI is the coordinator's HTTP handler served on a loopback port.
type httpAPI struct {
	t      *testing.T
	url    string
	client *http.Client
}

func newHTTPAPI(t *testing.T, c *coordtest.Coordinator) *httpAPI {
	t.Helper()
	srv := httptest.NewServer(guarded(c))
	t.Cleanup(srv.Close)
	return &httpAPI{t: t, url: srv.URL, client: &http.Client{Transport: coordtest.AnswerFirstTransport{}}}
}

// wantMetrics fails t unless /metrics has each of the lines want, and
// returns what it served.
func (a *httpAPI) wantMetrics(t *testing.T, want ...string) string {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, a.url+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	metrics := string(a.do(req).body)
	for _, w := range want {
		if !strings.Contains(metrics, w) {
			t.Errorf("/metrics lacks %s", w)
		}
	}
	return metrics
}

// guarded is c's HTTP handler as its listener serves it: behind the guard
// of Server.NewHTTPServer.
func guarded(c *coordtest.Coordinator) http.Handler {
	return c.Server.NewHTTPServer(c.Server.HTTPHandler()).Handler
}

// httpReply is what the HTTP API answered.
type httpReply struct {
	status int
	header http.Header
	body   []byte
}

// json decodes the body into a map.
func (r httpReply) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.body, &m); err != nil {
		t.Fatalf("body %q: %v", r.body, err)
	}
	return m
}

// connectError is a Connect protocol error body.
type connectError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Details []struct {
		Type  string `json:"type"`
		Value string `json:"value"`
		Debug struct {
			Reason string `json:"reason"`
			Domain string `json:"domain"`
		} `json:"debug"`
	} `json:"details"`
}

// wantError fails t unless r is a Connect error with the HTTP status, code
// and (when not empty) ErrorInfo reason given.
func (r httpReply) wantError(t *testing.T, status int, code, reason string) connectError {
	t.Helper()
	var e connectError
	if err := json.Unmarshal(r.body, &e); err != nil {
		t.Fatalf("error body %q: %v", r.body, err)
	}
	if r.status != status || e.Code != code {
		t.Fatalf("got HTTP %d %q (%s), want HTTP %d code %q", r.status, e.Code, r.body, status, code)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("error Content-Type = %q", ct)
	}
	if reason != "" {
		got := ""
		for _, d := range e.Details {
			if d.Type == "google.rpc.ErrorInfo" {
				if d.Debug.Domain != "idempotency.v1" {
					t.Fatalf("ErrorInfo domain %q in %s", d.Debug.Domain, r.body)
				}
				got = d.Debug.Reason
			}
		}
		if got != reason {
			t.Fatalf("ErrorInfo reason %q, want %q (%s)", got, reason, r.body)
		}
	}
	return e
}

// post sends body to /<method> with Content-Type application/json and the
// given extra headers ("Name: value").
func (a *httpAPI) post(method, body string, headers ...string) httpReply {
	a.t.Helper()
	req, err := http.NewRequest(http.MethodPost, a.url+"/"+method, strings.NewReader(body))
	if err != nil {
		a.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ": ")
		req.Header.Set(name, value)
	}
	return a.do(req)
}

func (a *httpAPI) do(req *http.Request) httpReply {
	a.t.Helper()
	resp, err := a.client.Do(req)
	if err != nil {
		a.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		a.t.Fatal(err)
	}
	return httpReply{status: resp.StatusCode, header: resp.Header, body: b}
}

const (
	httpBegin    = "idempotency.v1.Coordinator/Begin"
	httpComplete = "idempotency.v1.Coordinator/Complete"
	httpLookup   = "idempotency.v1.Coordinator/Lookup"
)

// The curl form of the README works as written: Begin, Complete, and a
// replay of the stored response, with no Connect header.
func TestHTTPBeginCompleteReplay(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{})
	api := newHTTPAPI(t, c)

	r := api.post(httpBegin, `{"scope":"build","key":"k"}`)
	if r.status != http.StatusOK {
		t.Fatalf("Begin: HTTP %d %s", r.status, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("Content-Type %q", ct)
	}
	m := r.json(t)
	token, _ := m["leaseToken"].(string)
	if m["outcome"] != "OUTCOME_ACQUIRED" || token == "" {
		t.Fatalf("Begin: %s", r.body)
	}
	r = api.post(httpComplete, `{"scope":"build","key":"k","leaseToken":"`+token+
		`","response":{"statusCode":201,"body":"aGVsbG8=","metadata":{"location":"/builds/7"}}}`)
	if r.status != http.StatusOK || r.json(t)["record"].(map[string]any)["state"] != "STATE_COMPLETED" {
		t.Fatalf("Complete: HTTP %d %s", r.status, r.body)
	}
	r = api.post(httpBegin, `{"scope":"build","key":"k"}`)
	m = r.json(t)
	rec, _ := m["record"].(map[string]any)
	resp, _ := rec["response"].(map[string]any)
	if m["outcome"] != "OUTCOME_REPLAY" || resp["body"] != "aGVsbG8=" || resp["statusCode"] != float64(201) ||
		resp["metadata"].(map[string]any)["location"] != "/builds/7" || m["leaseToken"] != "" {
		t.Fatalf("replay: %s", r.body)
	}
	// The gRPC API sees the same record.
	l, err := idempotencyv1.NewCoordinatorClient(c.Dial(t)).Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "build", Key: "k"})
	if err != nil || string(l.GetRecord().GetResponse().GetBody()) != "hello" {
		t.Fatalf("gRPC Lookup: %v %v", l, err)
	}
	// The explicit Connect header, and snake_case field names, work too.
	r = api.post(httpLookup, `{"scope":"build","key":"k"}`, "Connect-Protocol-Version: 1")
	if r.status != http.StatusOK || r.json(t)["record"].(map[string]any)["state"] != "STATE_COMPLETED" {
		t.Fatalf("Lookup with the Connect header: HTTP %d %s", r.status, r.body)
	}
	// Lookup (no side effects) may be a Connect GET; Begin may not.
	get := func(method string) httpReply {
		req, err := http.NewRequest(http.MethodGet, api.url+"/"+method+"?connect=v1&encoding=json&message="+
			url.QueryEscape(`{"scope":"build","key":"k"}`), nil)
		if err != nil {
			t.Fatal(err)
		}
		return api.do(req)
	}
	if r := get(httpLookup); r.status != http.StatusOK || r.json(t)["record"].(map[string]any)["state"] != "STATE_COMPLETED" {
		t.Fatalf("GET Lookup: HTTP %d %s", r.status, r.body)
	}
	if r := get(httpBegin); r.status != http.StatusMethodNotAllowed {
		t.Fatalf("GET Begin: HTTP %d %s", r.status, r.body)
	}
	// The Admin service is served too.
	r = api.post("idempotency.v1.Admin/ListRecords", `{"scopeGlob":"build"}`)
	if recs, _ := r.json(t)["records"].([]any); r.status != http.StatusOK || len(recs) != 1 {
		t.Fatalf("Admin ListRecords: HTTP %d %s", r.status, r.body)
	}
	r = api.post(httpComplete, `{"scope":"build","key":"k","lease_token":"`+token+
		`","response":{"status_code":201,"body":"aGVsbG8=","metadata":{"location":"/builds/7"}}}`)
	if r.status != http.StatusOK {
		t.Fatalf("repeated Complete, snake_case: HTTP %d %s", r.status, r.body)
	}
}

// Client mistakes over HTTP are the client's: bad JSON, unknown fields,
// wrong types and invalid fields answer invalid_argument (HTTP 400), never
// internal, and write nothing; a domain refusal carries its ErrorInfo
// reason.
func TestHTTPErrors(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{})
	env := &testEnv{t: t, coord: c, dbURL: c.DatabaseURL}
	api := newHTTPAPI(t, c)

	for name, body := range map[string]string{
		"not json":       `{"scope":`,
		"not an object":  `[1,2]`,
		"unknown field":  `{"scope":"build","key":"k","nope":1}`,
		"wrong type":     `{"scope":7,"key":"k"}`,
		"empty key":      `{"scope":"build","key":""}`,
		"empty body":     ``,
		"control char":   `{"scope":"build","key":"a\u0001b"}`,
		"bad duration":   `{"scope":"build","key":"k","wait":"forever"}`,
		"wait too long":  `{"scope":"build","key":"k","wait":"31s"}`,
		"invalid base64": `{"scope":"build","key":"k","fingerprint":"***"}`,
	} {
		t.Run(name, func(t *testing.T) {
			sub := &httpAPI{t: t, url: api.url, client: api.client}
			sub.post(httpBegin, body).wantError(t, http.StatusBadRequest, "invalid_argument", "")
		})
	}
	if n := env.rowCount(); n != 0 {
		t.Fatalf("%d rows written by refused calls", n)
	}

	b := api.post(httpBegin, `{"scope":"build","key":"fp","fingerprint":"YQ=="}`).json(t)
	if b["outcome"] != "OUTCOME_ACQUIRED" {
		t.Fatalf("Begin: %v", b)
	}
	api.post(httpBegin, `{"scope":"build","key":"fp","fingerprint":"Yg=="}`).
		wantError(t, http.StatusBadRequest, "failed_precondition", "FINGERPRINT_MISMATCH")
	api.post(httpComplete, `{"scope":"build","key":"fp","leaseToken":"not-the-token"}`).
		wantError(t, http.StatusBadRequest, "failed_precondition", "LEASE_LOST")
	api.post(httpLookup, `{"scope":"build","key":"absent"}`).wantError(t, http.StatusNotFound, "not_found", "")
	// A body over the HTTP limit is refused before it is buffered whole.
	big := `{"scope":"build","key":"k","fingerprint":"` + strings.Repeat("A", 17<<20) + `"}`
	if r := api.post(httpBegin, big); r.status != http.StatusRequestEntityTooLarge {
		t.Fatalf("a 17 MiB body: HTTP %d %s, want 413", r.status, r.body)
	}
	// The calls went through the gRPC server's interceptors: its metrics
	// counted them.
	api.wantMetrics(t,
		`grpc_server_handled_total{grpc_code="NotFound",grpc_method="Lookup",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 1`,
		`grpc_server_handled_total{grpc_code="FailedPrecondition",grpc_method="Complete",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 1`)
	// A POST of another content type (curl -d without -H) gets a hint.
	req, _ := http.NewRequest(http.MethodPost, api.url+"/"+httpBegin, strings.NewReader(`{"scope":"build","key":"k"}`))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if r := api.do(req); r.status != http.StatusUnsupportedMediaType || !strings.Contains(string(r.body), "application/json") {
		t.Fatalf("form-encoded POST: HTTP %d %s", r.status, r.body)
	}
	// A Host not served while auth is off is answered unread.
	if r := answerUnread(t, api, 100, "Content-Type: application/json", "Host: rebound.example"); r.status != http.StatusMisdirectedRequest {
		t.Fatalf("Host rebound.example: HTTP %d %s, want 421", r.status, r.body)
	}
	// Only the two API services are served: health stays gRPC only.
	if r := api.post("grpc.health.v1.Health/Check", `{}`); r.status != http.StatusNotFound {
		t.Fatalf("health over HTTP: %d %s", r.status, r.body)
	}
	// gRPC-Web works on the same path.
	var frame bytes.Buffer
	frame.Write([]byte{0, 0, 0, 0, 0})
	req, _ = http.NewRequest(http.MethodPost, api.url+"/"+httpLookup, &frame)
	req.Header.Set("Content-Type", "application/grpc-web+proto")
	if r := api.do(req); r.status != http.StatusOK || r.header.Get("Grpc-Status") != "3" {
		t.Fatalf("gRPC-Web Lookup with an empty request: HTTP %d grpc-status %q %s", r.status, r.header.Get("Grpc-Status"), r.body)
	}
}

// Auth over HTTP is the gRPC API's: no or a bad token is unauthenticated
// (HTTP 401), another tenant's record is not_found, a scope outside the
// tenant's list is permission_denied, and none of them writes.
func TestHTTPAuth(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: authConfig()})
	env := &testEnv{t: t, coord: c, dbURL: c.DatabaseURL}
	api := newHTTPAPI(t, c)
	pay, builds := "Authorization: Bearer pay-secret", "Authorization: Bearer build-secret"

	api.post(httpBegin, `{"scope":"build","key":"k"}`).wantError(t, http.StatusUnauthorized, "unauthenticated", "")
	api.post(httpBegin, `{"scope":"build","key":"k"}`, "Authorization: Bearer wrong").
		wantError(t, http.StatusUnauthorized, "unauthenticated", "")
	api.post("idempotency.v1.Admin/ListRecords", `{}`).wantError(t, http.StatusUnauthorized, "unauthenticated", "")
	if n := env.rowCount(); n != 0 {
		t.Fatalf("%d rows written without credentials", n)
	}
	m := api.post(httpBegin, `{"scope":"build","key":"k"}`, pay).json(t)
	if m["outcome"] != "OUTCOME_ACQUIRED" {
		t.Fatalf("payments Begin: %v", m)
	}
	api.post(httpLookup, `{"scope":"build","key":"k"}`, builds).wantError(t, http.StatusNotFound, "not_found", "")
	api.post(httpComplete, `{"scope":"build","key":"k","leaseToken":"`+m["leaseToken"].(string)+`"}`, builds).
		wantError(t, http.StatusNotFound, "not_found", "")
	api.post("idempotency.v1.Admin/Forget", `{"scope":"build","key":"k"}`, builds).
		wantError(t, http.StatusForbidden, "permission_denied", "")
	api.post(httpBegin, `{"scope":"/payments.v1.Payments/Charge","key":"k"}`, builds).
		wantError(t, http.StatusForbidden, "permission_denied", "")
	if n := env.rowCount(); n != 1 {
		t.Fatalf("%d rows, want 1", n)
	}
	if r := api.post(httpLookup, `{"scope":"build","key":"k"}`, pay); r.status != http.StatusOK {
		t.Fatalf("payments Lookup: HTTP %d %s", r.status, r.body)
	}
}

// With TLS on the HTTP listener, a client certificate names the tenant as
// it does over gRPC.
func TestHTTPClientCertificate(t *testing.T) {
	t.Parallel()
	ca := testkit.NewCA(t)
	pool := ca.Pool()
	serverTLS := &tls.Config{Certificates: []tls.Certificate{issue(ca, "idemcoord", "", true)},
		ClientCAs: pool, ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS12}
	c := coordtest.Start(t, coordtest.Options{Config: authConfig(),
		ServerOptions: []server.Option{server.WithGRPCOptions(grpc.Creds(credentials.NewTLS(serverTLS)))}})
	srv := httptest.NewUnstartedServer(guarded(c))
	srv.TLS = serverTLS.Clone()
	srv.StartTLS()
	t.Cleanup(srv.Close)
	client := func(certs ...tls.Certificate) *httpAPI {
		return &httpAPI{t: t, url: srv.URL, client: &http.Client{Transport: &http.Transport{
			TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: certs, MinVersion: tls.VersionTLS12}}}}
	}
	byCN := client(issue(ca, "builds", "", false))
	if r := byCN.post(httpBegin, `{"scope":"build","key":"k"}`); r.status != http.StatusOK || r.json(t)["outcome"] != "OUTCOME_ACQUIRED" {
		t.Fatalf("certificate CN builds: HTTP %d %s", r.status, r.body)
	}
	byCN.post(httpBegin, `{"scope":"deploy","key":"k"}`).wantError(t, http.StatusForbidden, "permission_denied", "")
	client(issue(ca, "stranger", "", false)).post(httpBegin, `{"scope":"build","key":"k"}`).
		wantError(t, http.StatusUnauthorized, "unauthenticated", "")
	// The token of the same tenant sees the record the certificate made.
	if r := client().post(httpBegin, `{"scope":"build","key":"k"}`, "Authorization: Bearer build-secret"); r.json(t)["outcome"] != "OUTCOME_IN_PROGRESS" {
		t.Fatalf("token over TLS: HTTP %d %s", r.status, r.body)
	}
}

// TestDuplicateAuthorizationRefused: a call with more than one
// authorization value, over gRPC (metadata) or HTTP (headers), is
// UNAUTHENTICATED whatever the values: neither valid then invalid, nor a
// tenant's token then an admin's, picks one of them.
func TestDuplicateAuthorizationRefused(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: authConfig()})
	admin := idempotencyv1.NewAdminClient(c.Dial(t))
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	api := newHTTPAPI(t, c)
	for name, tokens := range map[string][]string{
		"valid then invalid": {"pay-secret", "wrong"},
		"invalid then valid": {"wrong", "pay-secret"},
		"payments then ops":  {"pay-secret", "ops-secret"},
		"ops twice":          {"ops-secret", "ops-secret"},
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			for _, tok := range tokens {
				ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok) //nolint:fatcontext // each token is one more authorization header, as the test means
			}
			_, err := client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: "build", Key: "k"})
			wantCode(t, err, codes.Unauthenticated, "")
			_, err = admin.ListRecords(ctx, &idempotencyv1.ListRecordsRequest{})
			wantCode(t, err, codes.Unauthenticated, "")

			for path, body := range map[string]string{httpLookup: `{"scope":"build","key":"k"}`, "idempotency.v1.Admin/ListRecords": `{}`} {
				req, err := http.NewRequest(http.MethodPost, api.url+"/"+path, strings.NewReader(body))
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set("Content-Type", "application/json")
				for _, tok := range tokens {
					req.Header.Add("Authorization", "Bearer "+tok)
				}
				resp, err := api.client.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				httpReply{status: resp.StatusCode, header: resp.Header, body: b}.wantError(t, http.StatusUnauthorized, "unauthenticated", "")
			}
		})
	}
	// One value is still enough.
	if _, err := admin.ListRecords(withToken("ops-secret"), &idempotencyv1.ListRecordsRequest{}); err != nil {
		t.Fatalf("one ops token: %v", err)
	}
}

// TestHTTPCredentialsCheckedBeforeTheBody: while auth is on, an API
// request without valid credentials is refused unauthenticated from its
// headers, before its body is read, inflated or decoded: malformed JSON
// without a token is 401, not 400; a request that announces a body and
// sends none (or part of it) is answered at once and its connection
// closed, not held until the read timeout; a gRPC-Web request gets
// grpc-status 16. Each refusal of an API method is counted and logged as a
// refused gRPC call is. With a valid token the body is decoded as before
// (malformed JSON: invalid_argument), and nothing is written for any of
// them.
func TestHTTPCredentialsCheckedBeforeTheBody(t *testing.T) {
	t.Parallel()
	logs, withLogs := capturedLogs(slog.LevelInfo)
	c := coordtest.Start(t, coordtest.Options{Config: authConfig(), ServerOptions: []server.Option{withLogs}})
	env := &testEnv{t: t, coord: c, dbURL: c.DatabaseURL}
	api := newHTTPAPI(t, c)

	api.post(httpBegin, `{"scope":`).wantError(t, http.StatusUnauthorized, "unauthenticated", "")
	api.post(httpBegin, `{"scope":`, "Authorization: Bearer wrong").wantError(t, http.StatusUnauthorized, "unauthenticated", "")
	api.post(httpBegin, `{"scope":`, "Authorization: Bearer pay-secret").wantError(t, http.StatusBadRequest, "invalid_argument", "")

	req, _ := http.NewRequest(http.MethodPost, api.url+"/"+httpLookup, bytes.NewReader([]byte{0, 0, 0, 0, 0}))
	req.Header.Set("Content-Type", "application/grpc-web+proto")
	if r := api.do(req); r.status != http.StatusOK || r.header.Get("Grpc-Status") != "16" {
		t.Fatalf("gRPC-Web Lookup without credentials: HTTP %d grpc-status %q %s", r.status, r.header.Get("Grpc-Status"), r.body)
	}
	// A path that names no method is refused too, and makes no metric.
	api.post("idempotency.v1.Coordinator/NoSuchMethod", `{}`).wantError(t, http.StatusUnauthorized, "unauthenticated", "")

	// Bodies announced and not sent: over net/http's 256 KiB drain, and
	// under it with one byte sent.
	for _, announced := range []int{1 << 20, 100} {
		answerUnread(t, api, announced, "Content-Type: application/json").
			wantError(t, http.StatusUnauthorized, "unauthenticated", "")
	}
	// With credentials, an encoding refused is answered unread too.
	if r := answerUnread(t, api, 100, "Content-Type: application/json", "Authorization: Bearer pay-secret", "Content-Encoding: br"); r.status != http.StatusUnsupportedMediaType {
		t.Fatalf("Content-Encoding br: HTTP %d %s, want 415", r.status, r.body)
	}

	if n := env.rowCount(); n != 0 {
		t.Fatalf("%d rows written by refused calls", n)
	}
	metrics := api.wantMetrics(t,
		`grpc_server_handled_total{grpc_code="Unauthenticated",grpc_method="Begin",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 4`,
		`grpc_server_handled_total{grpc_code="Unauthenticated",grpc_method="Lookup",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 1`)
	if strings.Contains(metrics, "NoSuchMethod") {
		t.Error("/metrics has a series for a method the API does not have")
	}
	if n := strings.Count(logs.String(), `"grpc.method":"Begin","grpc.method_type":"unary","peer.address":"127.0.0.1:`); n < 4 {
		t.Errorf("%d call log lines of Begin, want a line for each of the 4 refused:\n%s", n, logs.String())
	}
	if n := strings.Count(logs.String(), `"grpc.code":"Unauthenticated"`); n != 5 {
		t.Errorf("%d call log lines with code Unauthenticated, want 5:\n%s", n, logs.String())
	}
}

// answerUnread sends a Begin whose headers (headers, and a Host unless
// they have one) announce a body of announced bytes, sends one byte of it,
// and returns the answer, which must come within 5 s, and after which the
// connection must be closed: the rest of the body is not waited for.
func answerUnread(t *testing.T, api *httpAPI, announced int, headers ...string) httpReply {
	t.Helper()
	host := strings.TrimPrefix(api.url, "http://")
	conn, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if !slices.ContainsFunc(headers, func(h string) bool { return strings.HasPrefix(h, "Host: ") }) {
		headers = append(headers, "Host: "+host)
	}
	fmt.Fprintf(conn, "POST /%s HTTP/1.1\r\n%s\r\nContent-Length: %d\r\n\r\n{",
		httpBegin, strings.Join(headers, "\r\n"), announced)
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("a request announcing a %d-byte body (%v) and sending 1 byte: no answer within 5 s (%v)", announced, headers, err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if _, err := br.ReadByte(); err != io.EOF {
		t.Fatalf("a request announcing a %d-byte body (%v), answered HTTP %d: the connection is still open 5 s later (%v); want it closed at once",
			announced, headers, resp.StatusCode, err)
	}
	return httpReply{status: resp.StatusCode, header: resp.Header, body: b}
}

// TestHTTPMalformedFramingIsInvalidArgument: client mistakes in the
// framing that the transcoder would answer as internal errors are
// invalid_argument: a gRPC-Web body cut inside a frame's header or
// message, and a Connect GET whose message is not base64 or whose base64
// parameter is neither 0 nor 1.
func TestHTTPMalformedFramingIsInvalidArgument(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{})
	srv := httptest.NewServer(guarded(c))
	t.Cleanup(srv.Close)
	msg := []byte(`{"scope":"build","key":"k"}`)
	frame := append([]byte{0, 0, 0, 0, byte(len(msg))}, msg...)
	for name, body := range map[string][]byte{
		"cut in the header":  frame[:2],
		"cut in the message": frame[:10],
		"a frame, then junk": append(append([]byte{}, frame...), 'z', 'z'),
		"two frames":         append(append([]byte{}, frame...), frame...),
	} {
		resp, err := srv.Client().Post(srv.URL+"/"+httpLookup, "application/grpc-web+json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		gs := resp.Header.Get("Grpc-Status")
		if gs == "" {
			gs = resp.Trailer.Get("Grpc-Status")
		}
		if resp.StatusCode != http.StatusOK || gs != "3" {
			t.Errorf("gRPC-Web %s: HTTP %d, grpc-status %q, want 3 (INVALID_ARGUMENT)", name, resp.StatusCode, gs)
		}
	}
	for name, query := range map[string]string{
		"message not base64": "connect=v1&encoding=json&base64=1&message=%21%21%21",
		"base64=2":           "connect=v1&encoding=json&base64=2&message=e30",
	} {
		resp, err := srv.Client().Get(srv.URL + "/" + httpLookup + "?" + query)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		httpReply{status: resp.StatusCode, header: resp.Header, body: b}.wantError(t, http.StatusBadRequest, "invalid_argument", "")
		t.Logf("Connect GET, %s: %s", name, b)
	}
	// Well-formed, they reach the API.
	resp, err := srv.Client().Post(srv.URL+"/"+httpLookup, "application/grpc-web+json", bytes.NewReader(frame))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if gs := resp.Header.Get("Grpc-Status") + resp.Trailer.Get("Grpc-Status"); gs != "5" {
		t.Errorf("well-formed gRPC-Web Lookup: grpc-status %q, want 5 (NOT_FOUND)", gs)
	}
}

// TestHTTPUndecodableBodyAnsweredOnce: a Begin whose JSON does not decode
// (an unknown field after a 1 MiB key) with a deadline of 1 ms is
// answered once, invalid_argument or deadline_exceeded: the transcoder
// answered the decode error from the body's reader while gRPC answered
// the expired call from its handler, both writing the answer's headers at
// once (under -race, a data race; in the coordinator, a crash).
func TestHTTPUndecodableBodyAnsweredOnce(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{})
	api := newHTTPAPI(t, c)
	body := `{"scope":"build","key":"` + strings.Repeat("k", 1<<20) + `","lease_tokn":"x"}`
	for range 10 {
		r := api.post(httpBegin, body, "Connect-Timeout-Ms: 1")
		var e connectError
		if err := json.Unmarshal(r.body, &e); err != nil || (e.Code != "invalid_argument" && e.Code != "deadline_exceeded") {
			t.Fatalf("HTTP %d %s, want invalid_argument or deadline_exceeded", r.status, r.body)
		}
	}
}

// TestHTTPGzipMembersAndTrailers: a gzip body of two members (as
// "cat a.gz b.gz" makes) is one body; bytes after the last member that are
// not gzip, short or long, answer 400 saying so (a short trailer was taken
// for a body cut short), and nothing is written.
func TestHTTPGzipMembersAndTrailers(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{})
	api := newHTTPAPI(t, c)
	member := func(s string) []byte {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		_, _ = zw.Write([]byte(s))
		_ = zw.Close()
		return b.Bytes()
	}
	send := func(body []byte) httpReply {
		req, err := http.NewRequest(http.MethodPost, api.url+"/"+httpBegin, bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Content-Encoding", "gzip")
		return api.do(req)
	}
	two := append(member(`{"scope":"build",`), member(`"key":"two-members"}`)...)
	if r := send(two); r.status != http.StatusOK || !strings.Contains(string(r.body), "OUTCOME_ACQUIRED") {
		t.Fatalf("two gzip members: HTTP %d %s, want the Begin acquired", r.status, r.body)
	}
	for _, junk := range []string{"x", "abc", strings.Repeat("junk", 10)} {
		r := send(append(member(`{"scope":"build","key":"junk"}`), junk...))
		if r.status != http.StatusBadRequest || !strings.Contains(string(r.body), "after the end of its gzip stream") {
			t.Errorf("%d bytes of junk after the gzip stream: HTTP %d %s, want 400 saying so", len(junk), r.status, r.body)
		}
	}
	if _, err := idempotencyv1.NewCoordinatorClient(c.Dial(t)).Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "build", Key: "junk"}); status.Code(err) != codes.NotFound {
		t.Fatalf("a refused body left a record: %v", err)
	}
}
