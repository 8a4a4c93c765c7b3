package server_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// TestMetricsCountScriptedCalls runs a scripted sequence of calls and checks
// every domain metric of docs/operating.md, the per-state gauge and the gRPC server
// metrics on /metrics.
func TestMetricsCountScriptedCalls(t *testing.T) {
	t.Parallel()
	// Only scopes the policy file names get a label: "s" exactly, the
	// payments methods by their glob; "other" is not named.
	e := newEnv(t, envOptions{config: "scopes:\n  - { match: s }\n  - { match: \"/payments.v1.Payments/*\" }\n"})

	b := e.mustBegin("s", "k1", acquired)
	e.mustBegin("s", "k1", inProgress)
	e.mustComplete("s", "k1", b.GetLeaseToken(), sampleResponse())
	e.mustBegin("s", "k1", replay)

	e.mustBegin("s", "k2", acquired, withFingerprint("a"))
	_, err := e.begin("s", "k2", withFingerprint("b"))
	wantCode(t, err, codes.FailedPrecondition, "FINGERPRINT_MISMATCH")

	old := e.mustBegin("s", "k3", acquired, withLease(time.Second))
	e.clock.Advance(2 * time.Second)
	e.mustBegin("s", "k3", acquired) // takeover of a lapsed lease: enters UNKNOWN once
	_, err = e.complete("s", "k3", old.GetLeaseToken(), nil)
	wantCode(t, err, codes.FailedPrecondition, "LEASE_LOST")

	b = e.mustBegin("s", "k4", acquired)
	e.mustFail("s", "k4", b.GetLeaseToken(), idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, nil)

	b = e.mustBegin("other", "k5", acquired, withTTL(time.Second))
	e.mustComplete("other", "k5", b.GetLeaseToken(), nil)
	e.clock.Advance(2 * time.Second)
	e.mustBegin("other", "k5", acquired) // found expired

	e.mustBegin("s", "k6", acquired, withLease(time.Second))
	e.clock.Advance(2 * time.Second) // k6's lease lapses; k2, k3 and k5 are still held (30s leases)
	if err := e.coord.Server.ReapOnce(context.Background()); err != nil {
		t.Fatal(err)
	}

	e.mustBegin("/payments.v1.Payments/Charge", "k7", acquired)
	e.mustBegin("/payments.v1.Payments/Refund", "k7", acquired)
	e.mustBegin("customer-4711-private", "k7", acquired)

	rec := httptest.NewRecorder()
	e.coord.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	text := string(body)
	for _, unnamed := range []string{"customer-4711", "Charge", "Refund"} {
		if strings.Contains(text, unnamed) {
			t.Errorf("/metrics shows the scope %q, which the policy file does not name", unnamed)
		}
	}
	for _, line := range []string{
		`idempotency_begin_total{outcome="acquired",scope="/payments.v1.Payments/*"} 2`,
		`idempotency_begin_total{outcome="acquired",scope="s"} 6`,
		`idempotency_begin_total{outcome="acquired",scope="other"} 3`,
		`idempotency_begin_total{outcome="in_progress",scope="s"} 1`,
		`idempotency_begin_total{outcome="replay",scope="s"} 1`,
		`idempotency_replay_total{scope="s"} 1`,
		`idempotency_fingerprint_mismatch_total{scope="s"} 1`,
		`idempotency_lease_lost_total{scope="s"} 1`,
		`idempotency_unknown_state_total{scope="s"} 3`,
		`idempotency_expired_retry_total{scope="other"} 1`,
		`idempotency_records{state="completed"} 1`,
		`idempotency_records{state="in_progress"} 6`,
		`idempotency_records{state="unknown"} 2`,
		`idempotency_records{state="expired"} 0`,
		`grpc_server_handled_total{grpc_code="OK",grpc_method="Begin",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 13`,
		`grpc_server_handled_total{grpc_code="FailedPrecondition",grpc_method="Complete",grpc_service="idempotency.v1.Coordinator",grpc_type="unary"} 1`,
	} {
		if !strings.Contains(text, "\n"+line+"\n") {
			t.Errorf("/metrics lacks %s", line)
		}
	}
	if t.Failed() {
		for l := range strings.SplitSeq(text, "\n") {
			if strings.HasPrefix(l, "idempotency_") || strings.HasPrefix(l, "grpc_server_handled_total") {
				t.Log(l)
			}
		}
	}
}

// TestReaperDrainsBacklogWithoutWaiting checks that the reaper loop runs
// passes back to back while they leave work: with a one-hour interval and
// 2-row batches (40 rows a pass), only that loop can expire 300 records
// before the interval comes round.
func TestReaperDrainsBacklogWithoutWaiting(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: "reaper: { interval: 1h, batch_size: 2 }\n"})
	conn, err := pgxConnect(e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	const n = 300
	if _, err := conn.Exec(context.Background(), `INSERT INTO idempotency_records
		(tenant, scope, key, state, attempt, generation, lease_token, has_response, body, ttl_us, failure_ttl_us,
		 created_at, updated_at, expires_at)
		SELECT 'default', 's', 'k' || i, 2, 1, 1, 'tok', true, 'body', 1, 1, $1, $1, $1
		FROM generate_series(1, $2) AS i`, e.clock.Now(), n); err != nil {
		t.Fatal(err)
	}
	e.clock.Advance(time.Second)
	rctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.coord.Server.RunReaper(rctx)
	}()
	defer func() {
		cancel()
		<-done
	}()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var expired int
		if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_records WHERE state = 5`).Scan(&expired); err != nil {
			t.Fatal(err)
		}
		if expired == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 2 minutes the reaper had expired %d of %d records (one pass does 40; the next interval is an hour away)", expired, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestMetricsBehindToken: with a metrics token, /metrics answers 401 to a
// scrape without it or with another one, and serves the one that sends it;
// health endpoints stay open.
func TestMetricsBehindToken(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{ServerOptions: []server.Option{server.WithMetricsToken("scrape-secret")}})
	h := c.Server.HTTPHandler()
	get := func(path, auth string) int {
		req := httptest.NewRequest(http.MethodGet, path, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code == 200 && path == "/metrics" && !strings.Contains(rec.Body.String(), "idempotency_records") {
			t.Fatalf("/metrics served without the metrics")
		}
		return rec.Code
	}
	for auth, want := range map[string]int{
		"":                           401,
		"Bearer wrong":               401,
		"Basic c2NyYXBlLXNlY3JldA==": 401,
		"bearer":                     401,
		"Bearer scrape-secret":       200,
	} {
		if got := get("/metrics", auth); got != want {
			t.Errorf("/metrics with %q: %d, want %d", auth, got, want)
		}
	}
	if got := get("/healthz", ""); got != 200 {
		t.Errorf("/healthz without a token: %d", got)
	}
}

// TestScopeLabelCap: of 205 scopes the config file names, the first 200
// seen get their own label, every later one is counted under "other", and a
// scope seen before the cap keeps its label after it.
func TestScopeLabelCap(t *testing.T) {
	t.Parallel()
	var cfg strings.Builder
	cfg.WriteString("scopes:\n")
	for i := range 205 {
		cfg.WriteString("  - { match: s" + strconv.Itoa(i) + " }\n")
	}
	e := newEnv(t, envOptions{config: cfg.String()})
	for i := range 205 {
		e.mustBegin("s"+strconv.Itoa(i), "k", acquired)
	}
	e.mustBegin("s0", "k", inProgress) // known before the cap: still its own label

	rec := httptest.NewRecorder()
	e.coord.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	labels := map[string]bool{}
	re := regexp.MustCompile(`(?m)^idempotency_begin_total\{outcome="[a-z_]+",scope="([^"]*)"\} `)
	for _, m := range re.FindAllStringSubmatch(string(body), -1) {
		labels[m[1]] = true
	}
	if !labels["other"] {
		t.Fatalf("no scope=\"other\" after 205 scopes")
	}
	if len(labels) != 201 {
		t.Fatalf("%d distinct scope labels, want 200 and \"other\"", len(labels))
	}
	for _, line := range []string{
		`idempotency_begin_total{outcome="acquired",scope="other"} 5`,
		`idempotency_begin_total{outcome="acquired",scope="s199"} 1`,
		`idempotency_begin_total{outcome="in_progress",scope="s0"} 1`,
	} {
		if !strings.Contains(string(body), "\n"+line+"\n") {
			t.Errorf("/metrics lacks %s", line)
		}
	}
	if labels["s200"] {
		t.Errorf("the 201st scope got its own label")
	}
}

// TestMetricsReportDatabaseAndReaper: /metrics tells whether the database
// answers the health check (what gRPC health and /readyz report) and when
// the reaper last caught up, which the deploy/prometheus alerts watch.
func TestMetricsReportDatabaseAndReaper(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	deadline := time.Now().Add(10 * time.Second)
	for !e.coord.Server.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("the server never became ready")
		}
		time.Sleep(10 * time.Millisecond)
	}
	before := time.Now()
	if err := e.coord.Server.ReapOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	e.coord.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	text := string(body)
	if !strings.Contains(text, "\nidempotency_database_reachable 1\n") {
		t.Error("/metrics lacks idempotency_database_reachable 1 while the database answers")
	}
	var caughtUp float64
	for l := range strings.SplitSeq(text, "\n") {
		if v, ok := strings.CutPrefix(l, "idempotency_reaper_caught_up_timestamp_seconds "); ok {
			caughtUp, _ = strconv.ParseFloat(v, 64)
		}
	}
	if caughtUp < float64(before.Unix()) {
		t.Errorf("idempotency_reaper_caught_up_timestamp_seconds = %v after a pass that left no work, want at least %d", caughtUp, before.Unix())
	}
}
