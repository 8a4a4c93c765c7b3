package server_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/server"
)

// TestAdminConn calls Admin in process: the server's own authentication
// applies (token or a verified certificate given as the peer), each caller
// acts within its tenant, and the tenant comes back in TenantHeader.
func TestAdminConn(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{FakeClock: true, Config: fmt.Sprintf(`
tenants:
  - { name: ops,      token_sha256: %s, scopes: ["*"], admin: true, client_cert_names: [ops] }
  - { name: payments, token_sha256: %s, scopes: ["*"] }
`, sha("ops-secret"), sha("pay-secret"))})
	coord := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	admin := idempotencyv1.NewAdminClient(c.Server.AdminConn())
	if _, err := coord.Begin(withToken("ops-secret"), &idempotencyv1.BeginRequest{Scope: "a/b", Key: "k", Lease: durationpb.New(time.Second)}); err != nil {
		t.Fatal(err)
	}
	if _, err := coord.Begin(withToken("pay-secret"), &idempotencyv1.BeginRequest{Scope: "a/b", Key: "theirs"}); err != nil {
		t.Fatal(err)
	}
	c.Clock.Advance(2 * time.Second)

	var hdr metadata.MD
	resp, err := admin.ListRecords(withToken("ops-secret"), &idempotencyv1.ListRecordsRequest{}, grpc.Header(&hdr))
	if err != nil || len(resp.GetRecords()) != 1 || resp.GetRecords()[0].GetKey() != "k" || resp.GetRecords()[0].GetState() != stUnknown {
		t.Fatalf("ops lists %v, %v; want its one UNKNOWN record", resp, err)
	}
	if got := hdr.Get(server.TenantHeader); len(got) != 1 || got[0] != "ops" {
		t.Fatalf("tenant header %q, want ops", got)
	}
	_, err = admin.ListRecords(context.Background(), &idempotencyv1.ListRecordsRequest{})
	wantCode(t, err, codes.Unauthenticated, "")
	_, err = admin.ListRecords(withToken("wrong"), &idempotencyv1.ListRecordsRequest{})
	wantCode(t, err, codes.Unauthenticated, "")
	_, err = admin.CountRecords(withToken("pay-secret"), &idempotencyv1.CountRecordsRequest{})
	wantCode(t, err, codes.PermissionDenied, "")
	_, err = admin.Resolve(withToken("ops-secret"), &idempotencyv1.ResolveRequest{Scope: "a/b", Key: "theirs",
		Resolution: idempotencyv1.Resolution_RESOLUTION_RETRYABLE})
	wantCode(t, err, codes.NotFound, "")
	// Bad input is refused as over the network.
	_, err = admin.ListRecords(withToken("ops-secret"), &idempotencyv1.ListRecordsRequest{PageSize: -1})
	wantCode(t, err, codes.InvalidArgument, "")

	// A verified client certificate given as the peer authenticates the
	// tenant that lists its common name in client_cert_names.
	ca := testkit.NewCA(t)
	cert, err := x509.ParseCertificate(issue(ca, "ops", "", false).Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	certCtx := peer.NewContext(context.Background(), &peer.Peer{Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)},
		AuthInfo: credentials.TLSInfo{State: tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{{cert, ca.Cert()}}}}})
	hdr = nil
	r, err := admin.Resolve(certCtx, &idempotencyv1.ResolveRequest{Scope: "a/b", Key: "k",
		Resolution: idempotencyv1.Resolution_RESOLUTION_COMPLETED,
		Response:   &idempotencyv1.StoredResponse{Body: []byte("done")}}, grpc.Header(&hdr))
	if err != nil || r.GetRecord().GetState() != stCompleted {
		t.Fatalf("Resolve with a certificate: %v %v", r, err)
	}
	if got := hdr.Get(server.TenantHeader); len(got) != 1 || got[0] != "ops" {
		t.Fatalf("tenant header %q, want ops", got)
	}
	// The counter totals the console charts saw both acquisitions and the
	// lapsed lease that Resolve wrote down.
	if tot := c.Server.CounterTotals(); tot.Acquired != 2 || tot.Replayed != 0 || tot.UnknownEntered != 1 {
		t.Errorf("CounterTotals = %+v, want 2 acquired, 1 entered UNKNOWN", tot)
	}
	// Only Admin is served.
	err = c.Server.AdminConn().Invoke(withToken("ops-secret"), "/idempotency.v1.Coordinator/Lookup",
		&idempotencyv1.LookupRequest{Scope: "a/b", Key: "k"}, &idempotencyv1.LookupResponse{})
	wantCode(t, err, codes.Unimplemented, "")
}
