package server_test

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/server"
)

func sha(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

func authConfig() string {
	return fmt.Sprintf(`
tenants:
  - { name: payments, token_sha256: %s, scopes: ["/payments.v1.*", "build"] }
  - { name: builds,   token_sha256: %s, scopes: ["build"], client_cert_names: ["builds"] }
  - { name: ci, client_cert_names: ["spiffe://example.org/ci"], scopes: ["*"] }
  - { name: ops, token_sha256: %s, scopes: ["*"], admin: true }
`, sha("pay-secret"), sha("build-secret"), sha("ops-secret"))
}

func withToken(token string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token)
}

func TestTenantsAreIsolated(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: authConfig()})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	env := &testEnv{t: t, coord: c, dbURL: c.DatabaseURL, client: client}

	pay, builds := withToken("pay-secret"), withToken("build-secret")
	a, err := client.Begin(pay, &idempotencyv1.BeginRequest{Scope: "build", Key: "same"})
	if err != nil || a.GetOutcome() != acquired {
		t.Fatalf("tenant payments: %v, %v", a, err)
	}
	if _, err := client.Complete(pay, &idempotencyv1.CompleteRequest{Scope: "build", Key: "same", LeaseToken: a.GetLeaseToken(),
		Response: sampleResponse()}); err != nil {
		t.Fatal(err)
	}
	// The same scope and key is a different record for another tenant.
	_, err = client.Lookup(builds, &idempotencyv1.LookupRequest{Scope: "build", Key: "same"})
	wantCode(t, err, codes.NotFound, "")
	b, err := client.Begin(builds, &idempotencyv1.BeginRequest{Scope: "build", Key: "same"})
	if err != nil || b.GetOutcome() != acquired {
		t.Fatalf("tenant builds: %v, %v", b, err)
	}
	// Another tenant's token is LEASE_LOST on its own record, never a
	// way into the other one.
	_, err = client.Complete(builds, &idempotencyv1.CompleteRequest{Scope: "build", Key: "same", LeaseToken: a.GetLeaseToken()})
	wantCode(t, err, codes.FailedPrecondition, "LEASE_LOST")
	// Nor is a checkpoint: with the other tenant's token it is LEASE_LOST
	// on its own record (NOT_FOUND where it has none), and writes nothing.
	_, err = client.Heartbeat(builds, &idempotencyv1.HeartbeatRequest{Scope: "build", Key: "same", LeaseToken: a.GetLeaseToken(),
		Checkpoint: &idempotencyv1.Checkpoint{Phase: "evil", Data: []byte("x")}})
	wantCode(t, err, codes.FailedPrecondition, "LEASE_LOST")
	p, err := client.Begin(pay, &idempotencyv1.BeginRequest{Scope: "build", Key: "held"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = client.Heartbeat(builds, &idempotencyv1.HeartbeatRequest{Scope: "build", Key: "held", LeaseToken: p.GetLeaseToken(),
		Checkpoint: &idempotencyv1.Checkpoint{Phase: "evil", Data: []byte("x")}})
	wantCode(t, err, codes.NotFound, "")
	for _, key := range []string{"same", "held"} {
		for _, cctx := range []context.Context{pay, builds} {
			if l, err := client.Lookup(cctx, &idempotencyv1.LookupRequest{Scope: "build", Key: key}); l.GetRecord().GetCheckpoint() != nil {
				t.Fatalf("%s: a checkpoint with another tenant's token was recorded: %v (%v)", key, l.GetRecord(), err)
			}
		}
	}
	r, err := client.Begin(pay, &idempotencyv1.BeginRequest{Scope: "build", Key: "same"})
	if err != nil || r.GetOutcome() != replay {
		t.Fatalf("tenant payments after tenant builds: %v, %v", r, err)
	}

	rows := env.rowCount()
	// No credentials, a bad token, a wrong scheme: UNAUTHENTICATED, nothing written.
	for name, cctx := range map[string]context.Context{
		"none":      context.Background(),
		"bad token": withToken("wrong"),
		"basic":     metadata.AppendToOutgoingContext(context.Background(), "authorization", "Basic cGF5LXNlY3JldA=="),
	} {
		_, err := client.Begin(cctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "new-" + name})
		wantCode(t, err, codes.Unauthenticated, "")
	}
	// A scope outside the tenant's list: PERMISSION_DENIED, nothing written.
	_, err = client.Begin(builds, &idempotencyv1.BeginRequest{Scope: "/payments.v1.Payments/Charge", Key: "k"})
	wantCode(t, err, codes.PermissionDenied, "")
	_, err = client.Lookup(builds, &idempotencyv1.LookupRequest{Scope: "deploy", Key: "k"})
	wantCode(t, err, codes.PermissionDenied, "")
	if _, err := client.Begin(pay, &idempotencyv1.BeginRequest{Scope: "/payments.v1.Payments/Charge", Key: "k"}); err != nil {
		t.Fatalf("glob scope: %v", err)
	}
	if got := env.rowCount(); got != rows+1 {
		t.Fatalf("rows = %d, want %d: a refused call wrote", got, rows+1)
	}
	// Health needs no credentials.
	if _, err := healthpb.NewHealthClient(c.Dial(t)).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("health without credentials: %v", err)
	}
}

func TestRateLimitPerTenant(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{Config: authConfig() + "rate_limit: { requests_per_second: 1, burst: 3 }\n"})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	var limited int
	for i := range 6 {
		_, err := client.Begin(withToken("pay-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: fmt.Sprint(i)})
		switch err {
		case nil:
		default:
			wantCode(t, err, codes.ResourceExhausted, "")
			limited++
		}
	}
	if limited == 0 {
		t.Fatal("6 calls at once with burst 3 were never limited")
	}
	// Another tenant has its own bucket.
	if _, err := client.Begin(withToken("build-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: "x"}); err != nil {
		t.Fatalf("other tenant limited: %v", err)
	}
}

func TestBadTenantConfigIsRefused(t *testing.T) {
	for _, cfg := range []string{
		"tenants: [{ name: a, token_sha256: abc, scopes: ['*'] }]",
		"tenants: [{ name: a, token_sha256: " + sha("x") + " }]",
		"tenants: [{ token_sha256: " + sha("x") + ", scopes: ['*'] }]",
		"tenants: [{ name: a, token_sha256: " + sha("x") + ", scopes: ['*'] }, { name: a, token_sha256: " + sha("y") + ", scopes: ['*'] }]",
		// Two tenants behind one token: the token would select either.
		"tenants: [{ name: a, token_sha256: " + sha("x") + ", scopes: ['*'] }, { name: b, token_sha256: " + strings.ToUpper(sha("x")) + ", scopes: ['*'] }]",
		// One certificate name for two tenants, or twice in one.
		"tenants: [{ name: a, client_cert_names: [c], scopes: ['*'] }, { name: b, client_cert_names: [c], scopes: ['*'] }]",
		"tenants: [{ name: a, client_cert_names: [c, c], scopes: ['*'] }]",
		"tenants: [{ name: a, client_cert_names: [''], scopes: ['*'] }]",
		// Non-printable names.
		"tenants: [{ name: \"a\\x00b\", token_sha256: " + sha("x") + ", scopes: ['*'] }]",
		"tenants: [{ name: \"ops\\n\", token_sha256: " + sha("x") + ", scopes: ['*'] }]",
		"tenants: [{ name: \"a\\u0085\", token_sha256: " + sha("x") + ", scopes: ['*'] }]",
		"tenants: [{ name: a, client_cert_names: [\"c\\td\"], scopes: ['*'] }]",
		// A tenant nobody could authenticate as.
		"tenants: [{ name: a, scopes: ['*'] }]",
		"rate_limit: { requests_per_second: 0 }",
	} {
		if _, err := server.ParsePolicies([]byte(cfg)); err == nil {
			t.Errorf("accepted %s", cfg)
		}
	}
}

// issue is a certificate of ca for cn, with uri as a URI name when set: a
// server certificate for 127.0.0.1 when server is set, else a client one.
func issue(ca *testkit.CA, cn, uri string, server bool) tls.Certificate {
	if server {
		_, _, pair := ca.Issue(cn, cn, "127.0.0.1")
		return pair
	}
	if uri != "" {
		_, _, pair := ca.IssueClientURI(cn, cn, uri)
		return pair
	}
	_, _, pair := ca.Issue(cn, cn)
	return pair
}

// TestClientCertificateNamesTenant: a verified certificate selects a tenant
// only through that tenant's client_cert_names, never by the tenant's name
// (the attack: a certificate whose CN is the admin tenant's name, "ops",
// or a token-only tenant's, "payments"); a certificate naming no tenant
// leaves the token to decide.
func TestClientCertificateNamesTenant(t *testing.T) {
	t.Parallel()
	ca := testkit.NewCA(t)
	pool := ca.Pool()
	serverTLS := &tls.Config{Certificates: []tls.Certificate{issue(ca, "idemcoord", "", true)},
		ClientCAs: pool, ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS12}
	c := coordtest.Start(t, coordtest.Options{Config: authConfig(),
		ServerOptions: []server.Option{server.WithGRPCOptions(grpc.Creds(credentials.NewTLS(serverTLS)))}})

	dial := func(certs ...tls.Certificate) *grpc.ClientConn {
		conn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(credentials.NewTLS(
			&tls.Config{RootCAs: pool, Certificates: certs, MinVersion: tls.VersionTLS12})))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	coord := func(conn *grpc.ClientConn) idempotencyv1.CoordinatorClient {
		return idempotencyv1.NewCoordinatorClient(conn)
	}
	byCN := coord(dial(issue(ca, "builds", "", false)))
	byURI := coord(dial(issue(ca, "someone", "spiffe://example.org/ci", false)))
	stranger := coord(dial(issue(ca, "stranger", "", false)))
	tokenOnly := coord(dial())
	asAdminConn := dial(issue(ca, "ops", "", false))
	asAdmin, asPayments := coord(asAdminConn), coord(dial(issue(ca, "payments", "spiffe://payments", false)))

	if _, err := byCN.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"}); err != nil {
		t.Fatalf("certificate CN builds: %v", err)
	}
	_, err := byCN.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "deploy", Key: "k"})
	wantCode(t, err, codes.PermissionDenied, "")
	r, err := byURI.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil || r.GetOutcome() != acquired {
		t.Fatalf("certificate URI SAN tenant: %v %v (a separate tenant must acquire its own record)", r, err)
	}
	_, err = stranger.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	wantCode(t, err, codes.Unauthenticated, "")
	r, err = tokenOnly.Begin(withToken("build-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil || r.GetOutcome() != inProgress {
		t.Fatalf("token over TLS, same tenant as the CN: %v %v", r, err)
	}

	// A certificate named after the admin tenant or a token-only tenant is
	// no credential at all: neither tenant lists a certificate name.
	_, err = asAdmin.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	wantCode(t, err, codes.Unauthenticated, "")
	_, err = idempotencyv1.NewAdminClient(asAdminConn).ListRecords(context.Background(), &idempotencyv1.ListRecordsRequest{})
	wantCode(t, err, codes.Unauthenticated, "")
	_, err = idempotencyv1.NewAdminClient(asAdminConn).Forget(context.Background(), &idempotencyv1.ForgetRequest{Scope: "build", Key: "k"})
	wantCode(t, err, codes.Unauthenticated, "")
	_, err = asPayments.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	wantCode(t, err, codes.Unauthenticated, "")

	// A verified certificate that names no tenant does not spoil a valid
	// token: the token authenticates on its own.
	r, err = stranger.Begin(withToken("build-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil || r.GetOutcome() != inProgress {
		t.Fatalf("stranger certificate + builds token: %v %v", r, err)
	}
	if _, err := idempotencyv1.NewAdminClient(asAdminConn).ListRecords(withToken("ops-secret"), &idempotencyv1.ListRecordsRequest{}); err != nil {
		t.Fatalf("admin token over a connection with an unlisted certificate: %v", err)
	}
	// Certificate and token of different tenants, or a bad token next to a
	// good certificate: refused.
	_, err = byCN.Begin(withToken("pay-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	wantCode(t, err, codes.Unauthenticated, "")
	_, err = byCN.Begin(withToken("wrong"), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	wantCode(t, err, codes.Unauthenticated, "")
	r, err = byCN.Begin(withToken("build-secret"), &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil || r.GetOutcome() != inProgress {
		t.Fatalf("certificate and token of the same tenant: %v %v", r, err)
	}
}
