package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// testCA issues certificates into files of a temporary directory.
type testCA struct {
	t    *testing.T
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	n    int64
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idemctl test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &testCA{t: t, dir: t.TempDir(), cert: cert, key: key, n: 1}
	ca.write("ca.pem", "CERTIFICATE", der)
	return ca
}

func (ca *testCA) write(name, typ string, der []byte) string {
	path := filepath.Join(ca.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		ca.t.Fatal(err)
	}
	return path
}

// issue writes a certificate and key named name; dnsOrIP are the server's
// names (none: a client certificate with common name cn).
func (ca *testCA) issue(name, cn string, dnsOrIP ...string) (certFile, keyFile string, pair tls.Certificate) {
	t := ca.t
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ca.n++
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(ca.n), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if len(dnsOrIP) > 0 {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		for _, n := range dnsOrIP {
			if ip := net.ParseIP(n); ip != nil {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			} else {
				tmpl.DNSNames = append(tmpl.DNSNames, n)
			}
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = ca.write(name+".pem", "CERTIFICATE", der), ca.write(name+"-key.pem", "EC PRIVATE KEY", kder)
	pair, err = tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile, pair
}

// TestTLSCoordinator runs idemctl against a coordinator that serves TLS
// and verifies client certificates: with the CA (flag or environment) and
// a token, with a client certificate its tenant lists, with a server name
// other than the address; and the mistakes: plaintext to a TLS server, TLS
// to a plaintext one, a wrong CA, plaintext to a non-loopback address.
func TestTLSCoordinator(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	_, _, serverPair := ca.issue("server", "idemcoord", "127.0.0.1", "coord.internal")
	_, _, namedOnly := ca.issue("named", "idemcoord", "coord.internal")
	cliCert, cliKey, _ := ca.issue("client", "ops-cli")
	strangerCert, strangerKey, _ := ca.issue("stranger", "ops")
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
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
	caFile := filepath.Join(ca.dir, "ca.pem")
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
