package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
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
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
)

// TestTLSBinary runs the real binary with TLS, client certificates, tenants
// and a metrics token: a client certificate named after the admin tenant
// (which lists no certificate names) gets nothing; one its tenant lists
// works; idemctl reaches it with --tls-ca and a token and says so when it
// tries plaintext; /metrics wants the token.
func TestTLSBinary(t *testing.T) {
	ca := testkit.NewCA(t)
	serverCert, serverKey, _ := ca.Issue("server", "idemcoord", "127.0.0.1")
	_, _, asAdmin := ca.Issue("as-admin", "ops")
	_, _, ciCert := ca.Issue("ci", "ci-runner")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "idemcoord.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`tenants:
  - { name: ops, token_sha256: %s, scopes: ["*"], admin: true }
  - { name: ci, client_cert_names: [ci-runner], scopes: ["build"] }
`, tokenHash("ops-secret"))), 0o600); err != nil {
		t.Fatal(err)
	}
	metricsToken := filepath.Join(dir, "metrics-token")
	if err := os.WriteFile(metricsToken, []byte("scrape-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	pool := ca.Pool()
	creds := func(certs ...tls.Certificate) credentials.TransportCredentials {
		return credentials.NewTLS(&tls.Config{RootCAs: pool, Certificates: certs, MinVersion: tls.VersionTLS12})
	}
	grpcAddr, httpAddr := coordtest.FreeAddr(t), coordtest.FreeAddr(t)
	p := startBinaryWith(t, creds(), coordtest.BuildBinary(t), pgtest.NewDatabase(t), grpcAddr, httpAddr,
		"--config", cfg, "--tls-cert", serverCert, "--tls-key", serverKey, "--tls-client-ca", ca.File(),
		"--metrics-token-file", metricsToken)
	defer p.stop()
	dial := func(c credentials.TransportCredentials) *grpc.ClientConn {
		conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(c))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	adminConn := dial(creds(asAdmin))
	_, err := idempotencyv1.NewAdminClient(adminConn).ListRecords(ctx, &idempotencyv1.ListRecordsRequest{})
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("a certificate named after the admin tenant: %v, want UNAUTHENTICATED", err)
	}
	_, err = idempotencyv1.NewCoordinatorClient(adminConn).Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("a certificate named after the admin tenant, Begin: %v, want UNAUTHENTICATED", err)
	}
	b, err := idempotencyv1.NewCoordinatorClient(dial(creds(ciCert))).Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil || b.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("a listed client certificate: %v %v", b, err)
	}
	_, err = idempotencyv1.NewAdminClient(adminConn).ListRecords(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer ops-secret"),
		&idempotencyv1.ListRecordsRequest{})
	if err != nil {
		t.Fatalf("the admin token beside an unlisted certificate: %v", err)
	}

	// idemctl, as a program.
	ctl := filepath.Join(t.TempDir(), "idemctl")
	if out, err := exec.Command("go", "build", "-o", ctl, "../idemctl").CombinedOutput(); err != nil {
		t.Fatalf("go build idemctl: %v\n%s", err, out)
	}
	runCtl := func(args ...string) (int, string) {
		cmd := exec.Command(ctl, append([]string{"--addr", grpcAddr, "--token", "ops-secret"}, args...)...)
		cmd.Env = os.Environ()
		out, _ := cmd.CombinedOutput()
		return cmd.ProcessState.ExitCode(), string(out)
	}
	if code, out := runCtl("--tls-ca", ca.File(), "lookup", "build", "never"); code != 1 || !strings.Contains(out, "NOT_FOUND") {
		t.Fatalf("idemctl over TLS: exit %d\n%s", code, out)
	}
	if code, out := runCtl("list"); code != 1 || !strings.Contains(out, "speaks TLS") {
		t.Fatalf("idemctl in plaintext against TLS: exit %d\n%s", code, out)
	}

	// With --tls-cert the HTTP listener serves HTTPS too.
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}}
	scrape := func(auth string) (int, string) {
		req, err := http.NewRequest(http.MethodGet, "https://"+httpAddr+"/metrics", nil)
		if err != nil {
			t.Fatal(err)
		}
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := scrape("Bearer scrape-secret"); code != 200 || !strings.Contains(body, "idempotency_config_reload_failures_total 0") {
		t.Fatalf("/metrics with the token: %d\n%s", code, body)
	}
	if code, _ := scrape(""); code != 401 {
		t.Fatalf("/metrics without the token: %d, want 401", code)
	}
}
