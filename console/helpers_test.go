package console_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemcoord/idemcoord/console"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/ledger"
)

func TestMain(m *testing.M) {
	os.Exit(coordtest.Main(m))
}

const (
	opsToken = "ops-secret"
	payToken = "pay-secret"
	// chargeScope is a scope as the interceptor writes it: with slashes.
	chargeScope = "/payments.v1.Payments/Charge"
)

func sha(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

// tenantsConfig has an admin tenant (ops) and a plain one (payments), each
// reachable by token and by a client certificate with its name as CN.
func tenantsConfig() string {
	return fmt.Sprintf(`
tenants:
  - { name: ops,      token_sha256: %s, scopes: ["*"], admin: true, client_cert_names: [ops] }
  - { name: payments, token_sha256: %s, scopes: ["*"], client_cert_names: [payments] }
`, sha(opsToken), sha(payToken))
}

// consoleEnv is a coordinator over its own database and a console in front
// of it, served over loopback HTTP.
type consoleEnv struct {
	t       *testing.T
	coord   *coordtest.Coordinator
	client  idempotencyv1.CoordinatorClient
	console *console.Console
	http    *httptest.Server
	log     *testkit.LogBuffer
}

func newConsoleEnv(t *testing.T, tlsServer bool) *consoleEnv {
	t.Helper()
	return newConsoleEnvOn(t, tlsServer, "")
}

// newConsoleEnvOn is newConsoleEnv over the database at databaseURL (a
// fresh one when empty): two of them on one database are two replicas.
func newConsoleEnvOn(t *testing.T, tlsServer bool, databaseURL string) *consoleEnv {
	t.Helper()
	c := coordtest.Start(t, coordtest.Options{FakeClock: true, Config: tenantsConfig(), DatabaseURL: databaseURL})
	e := &consoleEnv{t: t, coord: c, client: idempotencyv1.NewCoordinatorClient(c.Dial(t)), log: &testkit.LogBuffer{}}
	logger := slog.New(slog.NewTextHandler(e.log, nil))
	e.console = console.New(c.Server.AdminConn(), console.WithLogger(logger), console.WithSessions(ledgerSessions{c}), console.WithCounters(func() console.Counters {
		t := c.Server.CounterTotals()
		return console.Counters{Acquired: t.Acquired, Replayed: t.Replayed, InProgress: t.InProgress, UnknownEntered: t.UnknownEntered}
	}))
	mux := http.NewServeMux()
	mux.Handle(console.Prefix, e.console)
	if tlsServer {
		e.http = httptest.NewUnstartedServer(mux)
	} else {
		e.http = httptest.NewServer(mux)
	}
	t.Cleanup(func() { e.http.Close() })
	return e
}

// unknownRecord makes an UNKNOWN record of tenant token: acquired with a
// 1 s lease that then runs out.
func (e *consoleEnv) unknownRecord(token, scope, key string) {
	e.t.Helper()
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token)
	if _, err := e.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: scope, Key: key, Lease: durationpb.New(time.Second)}); err != nil {
		e.t.Fatal(err)
	}
	e.coord.Clock.Advance(2 * time.Second)
}

// lookup reads a record as tenant token.
func (e *consoleEnv) lookup(token, scope, key string) (*idempotencyv1.Record, error) {
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token)
	r, err := e.client.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: scope, Key: key})
	return r.GetRecord(), err
}

// browser is an HTTP client with cookies that does not follow redirects.
type browser struct {
	t   *testing.T
	c   *http.Client
	url string
}

func (e *consoleEnv) browser() *browser {
	jar, err := cookiejar.New(nil)
	if err != nil {
		e.t.Fatal(err)
	}
	c := *e.http.Client() // a copy: httptest shares one client, and each browser has its own cookies
	c.Jar = jar
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &browser{t: e.t, c: &c, url: e.http.URL}
}

// response is what a request got.
type response struct {
	code     int
	body     string
	location string
	header   http.Header
}

func (b *browser) do(req *http.Request) response {
	b.t.Helper()
	resp, err := b.c.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		b.t.Fatal(err)
	}
	return response{code: resp.StatusCode, body: string(body), location: resp.Header.Get("Location"), header: resp.Header}
}

func (b *browser) get(path string) response {
	b.t.Helper()
	req, err := http.NewRequest(http.MethodGet, b.url+path, nil)
	if err != nil {
		b.t.Fatal(err)
	}
	return b.do(req)
}

// post sends a URL-encoded form, with extra headers.
func (b *browser) post(path string, form url.Values, headers ...string) response {
	b.t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.url+path, strings.NewReader(form.Encode()))
	if err != nil {
		b.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	return b.do(req)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// csrf loads a console page and returns the CSRF token of its forms.
func (b *browser) csrf() string {
	b.t.Helper()
	r := b.get("/console/login")
	m := csrfField.FindStringSubmatch(r.body)
	if m == nil {
		b.t.Fatalf("no CSRF field in the login page: %d %s", r.code, r.body)
	}
	return m[1]
}

// login signs in with token and returns the answer.
func (b *browser) login(token string) response {
	b.t.Helper()
	return b.post("/console/login", url.Values{"csrf": {b.csrf()}, "token": {token}, "next": {"/console/"}})
}

func recordPath(scope, key string) string {
	return "/console/record?" + url.Values{"scope": {scope}, "key": {key}}.Encode()
}

// ledgerSessions keeps a test console's sessions in its coordinator's
// store, as the server binary does (there with cmd/idemcoord's adapter,
// which this mirrors: package main cannot be imported). It reads the
// store at each call, so it follows a restarted coordinator.
type ledgerSessions struct{ c *coordtest.Coordinator }

func (s ledgerSessions) CreateSession(ctx context.Context, n *console.NewSession) error {
	_, err := ledger.NewSessions(s.c.Store).Create(ctx, &ledger.CreateSessionParams{IDSHA256: n.IDSHA256, Tenant: n.Tenant,
		TokenSHA256: n.TokenSHA256, Credential: n.Credential, IdleTimeout: n.IdleTimeout, MaxLifetime: n.MaxLifetime})
	return err
}

func (s ledgerSessions) UseSession(ctx context.Context, idSHA256 []byte) (*console.Session, error) {
	got, err := ledger.NewSessions(s.c.Store).Touch(ctx, idSHA256)
	if errors.Is(err, ledger.ErrSessionNotFound) {
		return nil, console.ErrNoSession
	}
	if err != nil {
		return nil, err
	}
	return &console.Session{Tenant: got.Tenant, Credential: got.Credential}, nil
}

func (s ledgerSessions) DeleteSession(ctx context.Context, idSHA256 []byte) error {
	return ledger.NewSessions(s.c.Store).Delete(ctx, idSHA256)
}
