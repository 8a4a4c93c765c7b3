package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

func tokenHash(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

// metricValue scrapes one unlabelled sample from /metrics (-1: absent).
func metricValue(t *testing.T, httpAddr, name string, header ...string) float64 {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+httpAddr+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(header) == 2 {
		req.Header.Set(header[0], header[1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %s\n%s", resp.Status, body)
	}
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindSubmatch(body)
	if m == nil {
		return -1
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestReloadNeverWidensAccess runs the binary on a non-loopback address
// with tenants, then damages its config file under it the ways a slow
// rewrite, a crash mid-write or a careless edit do: truncated to nothing
// (file watch), cut in the middle of a tenant (file watch), tenants
// deleted (SIGHUP), only comments (SIGHUP). Each reload is refused with an
// error log and idempotency_config_reload_failures_total, and the door
// stays shut: an unauthenticated Begin, an unauthenticated Admin Forget and
// one tenant replaying another's record all keep failing. A valid narrowing
// edit still reloads.
func TestReloadNeverWidensAccess(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "idemcoord.yaml")
	full := fmt.Sprintf(`scopes:
  - { match: "build", ttl: 60s }
tenants:
  - { name: payments, token_sha256: %s, scopes: ["*"] }
  - { name: builds, token_sha256: %s, scopes: ["*"] }
  - { name: ops, token_sha256: %s, scopes: ["*"], admin: true }
`, tokenHash("pay-secret"), tokenHash("build-secret"), tokenHash("ops-secret"))
	if err := os.WriteFile(cfg, []byte(full), 0o644); err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(coordtest.FreeAddr(t))
	httpAddr := coordtest.FreeAddr(t)
	// Listen on every interface: the exposure check applies.
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), "127.0.0.1:"+port, httpAddr,
		"--config", cfg, "--listen", "0.0.0.0:"+port)
	defer p.stop()
	conn, err := grpc.NewClient(p.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client, admin := idempotencyv1.NewCoordinatorClient(conn), idempotencyv1.NewAdminClient(conn)
	as := func(token string) context.Context {
		ctx := context.Background()
		if token != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
		}
		return ctx
	}
	b, err := client.Begin(as("pay-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: "charge-1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Complete(as("pay-secret"), &idempotencyv1.CompleteRequest{Scope: "build", Key: "charge-1",
		LeaseToken: b.GetLeaseToken(), Response: &idempotencyv1.StoredResponse{Body: []byte("payments' secret")}}); err != nil {
		t.Fatal(err)
	}
	doorShut := func(stage string) {
		t.Helper()
		wantDenied := func(what string, err error) {
			t.Helper()
			if c := status.Code(err); c != codes.Unauthenticated && c != codes.NotFound && c != codes.PermissionDenied {
				t.Fatalf("%s: %s: %v (want it refused)\n%s", stage, what, err, p.logs)
			}
		}
		_, err := client.Begin(as(""), &idempotencyv1.BeginRequest{Scope: "build", Key: "charge-1"})
		wantDenied("unauthenticated Begin", err)
		_, err = admin.Forget(as(""), &idempotencyv1.ForgetRequest{Scope: "build", Key: "charge-1"})
		wantDenied("unauthenticated Forget", err)
		_, err = client.Lookup(as("build-secret"), &idempotencyv1.LookupRequest{Scope: "build", Key: "charge-1"})
		wantDenied("another tenant's Lookup", err)
		r, err := client.Begin(as("pay-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: "charge-1"})
		if err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY {
			t.Fatalf("%s: the owner's replay: %v %v", stage, r, err)
		}
	}
	doorShut("at start")
	// refusals counts the logged refusals triggered by why whose reason
	// contains marker. A write is seen by the file watch, and may be seen
	// twice (truncate, then write); SIGHUP reloads once more: each stage
	// waits for a refusal of its own trigger and reason, counted from
	// before its action.
	refusals := func(why, marker string) int {
		n := 0
		for l := range strings.SplitSeq(p.logs.String(), "\n") {
			if strings.Contains(l, "config reload refused") && strings.Contains(l, why) && strings.Contains(l, marker) {
				n++
			}
		}
		return n
	}
	expectRefusal := func(stage, why, marker string, action func()) {
		t.Helper()
		before := refusals(why, marker)
		action()
		deadline := time.Now().Add(30 * time.Second)
		for refusals(why, marker) <= before {
			if time.Now().After(deadline) {
				t.Fatalf("%s: no refusal (%s, %q) logged\n%s", stage, why, marker, p.logs)
			}
			time.Sleep(50 * time.Millisecond)
		}
		doorShut(stage)
	}
	write := func(content string) {
		t.Helper()
		if err := os.WriteFile(cfg, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	hup := func() {
		t.Helper()
		if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
	}
	const byWatch, bySignal = `why="file changed"`, "why=SIGHUP"

	// Truncated in place to nothing (the file watch sees the write).
	expectRefusal("truncated to nothing", byWatch, "is empty", func() {
		if err := os.Truncate(cfg, 0); err != nil {
			t.Fatal(err)
		}
	})
	// Cut in the middle of the tenants, as a slow rewrite leaves it.
	cut := full[:strings.Index(full, "  - { name: builds")+len("  - { name: bui")]
	expectRefusal("cut mid-tenant", byWatch, "did not find expected", func() { write(cut) })
	// An operator deletes the tenants (renaming the new file over the old
	// one) and sends SIGHUP: auth would go off.
	expectRefusal("tenants deleted", bySignal, "turning auth off takes a restart", func() {
		if err := os.WriteFile(cfg+".new", []byte("scopes:\n  - { match: \"build\", ttl: 60s }\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(cfg+".new", cfg); err != nil {
			t.Fatal(err)
		}
		hup()
	})
	// Only comments left.
	expectRefusal("only comments", bySignal, "is empty", func() {
		write("# tenants: moved elsewhere\n")
		hup()
	})

	// A valid edit that narrows access still reloads: builds is removed.
	narrowed := strings.Replace(full, fmt.Sprintf("  - { name: builds, token_sha256: %s, scopes: [\"*\"] }\n", tokenHash("build-secret")), "", 1)
	write(narrowed)
	hup()
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := client.Begin(as("build-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: "b"})
		if status.Code(err) == codes.Unauthenticated {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the removed tenant still authenticates: %v\n%s", err, p.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
	doorShut("narrowed")
	// Every refusal was counted once, and only refusals were.
	deadline = time.Now().Add(30 * time.Second)
	for {
		got, logged := metricValue(t, httpAddr, "idempotency_config_reload_failures_total"), refusals("", "")
		if got == float64(logged) && logged >= 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("idempotency_config_reload_failures_total = %v, %d refusals logged\n%s", got, logged, p.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestMetricsTokenFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	if tok, err := readMetricsToken(write("ok", "  scrape-secret\n")); err != nil || tok != "scrape-secret" {
		t.Fatalf("token %q, %v", tok, err)
	}
	if _, err := readMetricsToken(write("empty", " \n")); err == nil {
		t.Fatal("an empty token file accepted: /metrics would be open to an empty bearer token")
	}
	if _, err := readMetricsToken(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("a missing token file accepted")
	}
}

// TestReloadKeepsHTTPListenExposureRule runs the reload check of the binary
// on a coordinator: a file without tenants is refused (and counted) while
// --http-listen is on a non-loopback address without
// --insecure-allow-no-auth, and accepted with it or on loopback.
func TestReloadKeepsHTTPListenExposureRule(t *testing.T) {
	ctx := context.Background()
	store, err := ledger.Open(ctx, pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	srv, err := server.New(store)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "idemcoord.yaml")
	if err := os.WriteFile(path, []byte("scopes:\n  - { match: \"build\", ttl: 60s }\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	flags := func(args ...string) *config {
		t.Helper()
		c, err := parseFlags(append([]string{"--database-url", "postgres://x", "--listen", "127.0.0.1:1"}, args...))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	t.Setenv("IDEMCOORD_INSECURE_ALLOW_NO_AUTH", "")
	if _, err := srv.Reload(path, reloadCheck(flags("--http-listen", "0.0.0.0:9090"))); !errors.Is(err, server.ErrReloadRefused) ||
		!strings.Contains(err.Error(), "--http-listen") {
		t.Fatalf("reload with --http-listen 0.0.0.0:9090 and no auth: %v, want refused", err)
	}
	rec := httptest.NewRecorder()
	srv.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if !strings.Contains(rec.Body.String(), "idempotency_config_reload_failures_total 1\n") {
		t.Fatalf("the refusal is not counted:\n%s", rec.Body.String())
	}
	for _, args := range [][]string{{"--http-listen", "0.0.0.0:9090", "--insecure-allow-no-auth"}, {"--http-listen", "127.0.0.1:9090"}} {
		if _, err := srv.Reload(path, reloadCheck(flags(args...))); err != nil {
			t.Fatalf("reload with %v: %v", args, err)
		}
	}
}

// TestReloadFollowsKubernetesVolumeUpdate: a ConfigMap or Secret mounted as
// a directory holds the file as a link through "..data", and Kubernetes
// updates it by swapping "..data" to a new directory; the file itself sees
// no event. The coordinator reloads all the same.
func TestReloadFollowsKubernetesVolumeUpdate(t *testing.T) {
	dir := t.TempDir()
	version := func(name, content string) {
		t.Helper()
		if err := os.Mkdir(filepath.Join(dir, name), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name, "config.yaml"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	version("..2026_11_25_01", "scopes:\n  - { match: build, ttl: 60s }\n")
	if err := os.Symlink("..2026_11_25_01", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..data/config.yaml", filepath.Join(dir, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), coordtest.FreeAddr(t),
		"--config", filepath.Join(dir, "config.yaml"))
	defer p.stop()

	// What the kubelet does: a new directory, a new link to it, renamed
	// over "..data".
	version("..2026_11_25_02", "scopes:\n  - { match: build, ttl: 120s }\n")
	if err := os.Symlink("..2026_11_25_02", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(p.logs.String(), `msg="config reloaded" why="file changed"`) {
		if time.Now().After(deadline) {
			t.Fatalf("no reload logged after the ..data swap\n%s", p.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
