package main

import (
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"net"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/server"
)

// TestTLSCoordinator runs idemctl against a coordinator that serves TLS
// and verifies client certificates: with the CA (flag or environment) and
// a token, with a client certificate its tenant lists, with a server name
// other than the address; and the mistakes: plaintext to a TLS server, TLS
// to a plaintext one, a wrong CA, plaintext to a non-loopback address.
func TestTLSCoordinator(t *testing.T) {
	t.Parallel()
	ca := testkit.NewCA(t)
	_, _, serverPair := ca.Issue("server", "idemcoord", "127.0.0.1", "coord.internal")
	_, _, namedOnly := ca.Issue("named", "idemcoord", "coord.internal")
	cliCert, cliKey, _ := ca.Issue("client", "ops-cli")
	strangerCert, strangerKey, _ := ca.Issue("stranger", "ops")
	pool := ca.Pool()
	sum := sha256.Sum256([]byte("ops-secret"))
	config := fmt.Sprintf("tenants:\n  - { name: ops, token_sha256: %s, client_cert_names: [ops-cli], scopes: [\"*\"], admin: true }\n",
		hex.EncodeToString(sum[:]))
	start := func(pair tls.Certificate) *coordtest.Coordinator {
		creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{pair}, ClientCAs: pool,
			ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS12})
		return coordtest.Start(t, coordtest.Options{Config: config,
			ServerOptions: []server.Option{server.WithGRPCOptions(grpc.Creds(creds))}})
	}
	c := start(serverPair)
	caFile := ca.File()
	want := func(what string, r result, code int, stderr string) {
		t.Helper()
		if r.code != code || !strings.Contains(r.stderr, stderr) {
			t.Fatalf("%s: exit %d, stderr %q; want exit %d and %q", what, r.code, r.stderr, code, stderr)
		}
	}

	want("CA flag and token", idemctl(t, c.Addr, nil, "", "--tls-ca", caFile, "--token", "ops-secret", "list"), 0, "")
	want("CA and token from the environment", idemctl(t, c.Addr,
		map[string]string{"IDEMCOORD_TLS_CA": caFile, "IDEMCOORD_TOKEN": "ops-secret"}, "", "list"), 0, "")
	want("client certificate, no token", idemctl(t, c.Addr, nil, "", "--tls-ca", caFile,
		"--tls-cert", cliCert, "--tls-key", cliKey, "forget", "s", "k"), 1, "NOT_FOUND")
	want("client certificate from the environment", idemctl(t, c.Addr, map[string]string{"IDEMCOORD_TLS_CA": caFile,
		"IDEMCOORD_TLS_CERT": cliCert, "IDEMCOORD_TLS_KEY": cliKey}, "", "list"), 0, "")
	want("a certificate named after the tenant, not listed", idemctl(t, c.Addr, nil, "", "--tls-ca", caFile,
		"--tls-cert", strangerCert, "--tls-key", strangerKey, "list"), 1, "UNAUTHENTICATED")
	want("plaintext to a TLS coordinator", idemctl(t, c.Addr, nil, "", "--token", "ops-secret", "list"), 1, "speaks TLS")
	want("system roots only", idemctl(t, c.Addr, nil, "", "--tls", "--token", "ops-secret", "list"), 1, "UNAVAILABLE")
	want("cert without key", idemctl(t, c.Addr, nil, "", "--tls-cert", cliCert, "list"), 2, "go together")

	// A certificate for a DNS name only: the address does not verify, the
	// server name does.
	named := start(namedOnly)
	want("address not in the certificate", idemctl(t, named.Addr, nil, "", "--tls-ca", caFile, "--token", "ops-secret", "list"), 1, "UNAVAILABLE")
	want("--tls-server-name", idemctl(t, named.Addr, nil, "", "--tls-ca", caFile, "--tls-server-name", "coord.internal",
		"--token", "ops-secret", "list"), 0, "")
	want("IDEMCOORD_TLS_SERVER_NAME", idemctl(t, named.Addr, map[string]string{"IDEMCOORD_TLS_CA": caFile,
		"IDEMCOORD_TLS_SERVER_NAME": "coord.internal", "IDEMCOORD_TOKEN": "ops-secret"}, "", "list"), 0, "")

	// TLS to a plaintext coordinator.
	plain := coordtest.Start(t, coordtest.Options{})
	want("TLS to a plaintext coordinator", idemctl(t, plain.Addr, nil, "", "--tls-ca", caFile, "list"), 1, "does not speak TLS")

	// Plaintext leaves loopback only with --insecure (refused before any
	// connection is made).
	want("plaintext to the network", idemctl(t, plain.Addr, nil, "", "--addr", "192.0.2.1:50051", "--token", "x", "list"), 2, "not a loopback address")
	want("plaintext to a host name", idemctl(t, plain.Addr, nil, "", "--addr", "coord.example:50051", "list"), 2, "--insecure")
	for _, addr := range []string{"localhost:" + portOf(plain.Addr), "[::1]:1"} {
		if r := idemctl(t, plain.Addr, nil, "", "--addr", addr, "list"); r.code == 2 {
			t.Fatalf("%s refused as non-loopback: %+v", addr, r)
		}
	}
}

func portOf(addr string) string {
	_, port, _ := net.SplitHostPort(addr)
	return port
}
