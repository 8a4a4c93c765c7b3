package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// FuzzParsePolicies feeds arbitrary bytes to the config parser: it never
// panics, and a configuration it accepts keeps every promise the server
// relies on: printable tenant names, no token hash or certificate name
// shared by two tenants, every tenant reachable by some credential, sane
// limits and policies for any scope.
//
//	go test ./server -run '^$' -fuzz '^FuzzParsePolicies$' -fuzztime 10s
func FuzzParsePolicies(f *testing.F) {
	for _, seed := range []string{
		"",
		"# only a comment\n",
		"defaults: { ttl: 24h, failure_ttl: 1h, lease: 30s, on_expired: restart, on_unknown: takeover, max_attempts: 0, max_ttl: 720h }\n" +
			"scopes:\n  - { match: \"build\", ttl: 60s }\n  - { match: \"/payments.v1.Payments/*\", ttl: 720h, on_unknown: hold }\n",
		"limits: { max_key_bytes: 255, max_scope_bytes: 255, max_fingerprint_bytes: 64, max_reason_bytes: 1024, " +
			"max_response_bytes: 1048576, min_lease: 1s, max_lease: 1h, max_wait: 30s }\n",
		"tenants:\n  - { name: payments, token_sha256: " + strings.Repeat("ab", 32) + ", scopes: [\"/payments.v1.*\", build] }\n" +
			"  - { name: ci, client_cert_names: [\"spiffe://example.org/ci\", ci-runner], scopes: [\"*\"], admin: true }\n",
		"tenants: [{ name: a, token_sha256: " + strings.Repeat("00", 32) + ", scopes: ['*'] }, { name: b, token_sha256: " + strings.Repeat("00", 32) + ", scopes: ['*'] }]",
		"rate_limit: { requests_per_second: 500, burst: 1000 }\nreaper: { interval: 10s, batch_size: 500, expired_retention: 24h }\n",
		"encryption: { active_key: a, keys: [{ id: a, env: IDEMCOORD_FUZZ_UNSET }] }\n",
		"tenants: [{ name: \"a\\x00\", token_sha256: " + strings.Repeat("01", 32) + ", scopes: ['*'] }]",
		"scopes: [{ match: '**a*b*', ttl: 1s }]",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := ParsePolicies(data)
		if err != nil {
			if p != nil {
				t.Fatal("an error with a configuration")
			}
			return
		}
		tokens, certs, names := map[string]bool{}, map[string]bool{}, map[string]bool{}
		for _, tn := range p.tenants {
			if tn.name == "" || !printableName(tn.name) || names[tn.name] {
				t.Fatalf("tenant name %q accepted", tn.name)
			}
			names[tn.name] = true
			if tn.token == nil && len(tn.certNames) == 0 {
				t.Fatalf("tenant %q accepted with no credential", tn.name)
			}
			if tn.token != nil {
				if len(tn.token) != sha256.Size || tokens[string(tn.token)] {
					t.Fatalf("tenant %q: token hash %x accepted", tn.name, tn.token)
				}
				tokens[string(tn.token)] = true
			}
			for _, cn := range tn.certNames {
				if cn == "" || !printableName(cn) || certs[cn] {
					t.Fatalf("tenant %q: certificate name %q accepted", tn.name, cn)
				}
				certs[cn] = true
			}
			if len(tn.scopes) == 0 {
				t.Fatalf("tenant %q accepted without scopes", tn.name)
			}
		}
		if p.AuthEnabled() != (len(p.tenants) > 0) {
			t.Fatal("AuthEnabled disagrees with the tenants")
		}
		l := p.Limits()
		if l.MaxKeyBytes <= 0 || l.MaxScopeBytes <= 0 || l.MinLease <= 0 || l.MaxLease < l.MinLease || l.MaxWait < 0 {
			t.Fatalf("limits accepted: %+v", l)
		}
		for _, scope := range []string{"", "build", "/payments.v1.Payments/Charge", string(data)} {
			pol := p.For(scope)
			if pol.TTL <= 0 || pol.TTL > pol.MaxTTL || pol.Lease <= 0 || pol.FailureTTL <= 0 || pol.MaxAttempts < 0 {
				t.Fatalf("policy of %q accepted: %+v", scope, pol)
			}
			if lbl := p.scopeLabel(scope); lbl != otherScope && !slices.ContainsFunc(p.scopes, func(s scopePolicy) bool {
				return s.match == lbl || s.match == scope
			}) {
				t.Fatalf("scope %q labelled %q, which the file does not name", scope, lbl)
			}
		}
	})
}

// fuzzTenants is the configuration FuzzAuthenticate authenticates against.
func fuzzTenants(t testing.TB) *Policies {
	sum := func(s string) string {
		h := sha256.Sum256([]byte(s))
		return hex.EncodeToString(h[:])
	}
	p, err := ParsePolicies([]byte(fmt.Sprintf(`tenants:
  - { name: payments, token_sha256: %s, scopes: ["*"] }
  - { name: builds, token_sha256: %s, client_cert_names: [builds], scopes: ["*"] }
  - { name: ci, client_cert_names: ["spiffe://example.org/ci"], scopes: ["*"] }
  - { name: ops, token_sha256: %s, scopes: ["*"], admin: true }
`, sum("pay-secret"), sum("build-secret"), sum("ops-secret"))))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// FuzzAuthenticate sends arbitrary authorization metadata (any number of
// values) and an arbitrary verified client certificate (common name and a
// URI SAN) to the authentication of the server. It never panics; a refusal
// is always UNAUTHENTICATED; a caller is authenticated only as the tenant
// its token hashes to or whose client_cert_names lists one of the
// certificate's names, never as the admin tenant by a certificate, and
// never as two tenants at once.
//
//	go test ./server -run '^$' -fuzz '^FuzzAuthenticate$' -fuzztime 10s
func FuzzAuthenticate(f *testing.F) {
	for _, seed := range []struct {
		auth       string
		cert       bool
		cn, uri    string
		extraValue string
	}{
		{"Bearer pay-secret", false, "", "", ""},
		{"bearer build-secret", true, "builds", "", ""},
		{"Bearer ops-secret", true, "stranger", "", ""},
		{"", true, "ops", "", ""},
		{"", true, "x", "spiffe://example.org/ci", ""},
		{"Basic cGF5LXNlY3JldA==", false, "", "", ""},
		{"Bearer ", false, "", "", "Bearer ops-secret"},
		{"Bearer pay-secret", true, "builds", "", ""},
	} {
		f.Add(seed.auth, seed.cert, seed.cn, seed.uri, seed.extraValue)
	}
	s := &Server{}
	pols := fuzzTenants(f)
	s.policies.Store(pols)
	f.Fuzz(func(t *testing.T, auth string, withCert bool, cn, uri, extra string) {
		ctx := context.Background()
		var md metadata.MD
		if auth != "" || extra != "" {
			md = metadata.MD{"authorization": []string{auth}}
			if extra != "" {
				md["authorization"] = append(md["authorization"], extra)
			}
			ctx = metadata.NewIncomingContext(ctx, md)
		}
		var certNames []string
		if withCert {
			cert := &x509.Certificate{Subject: pkix.Name{CommonName: cn}}
			if cn != "" {
				certNames = append(certNames, cn)
			}
			if u, err := url.Parse(uri); err == nil && uri != "" {
				cert.URIs = []*url.URL{u}
				certNames = append(certNames, u.String())
			}
			info := credentials.TLSInfo{}
			info.State.VerifiedChains = [][]*x509.Certificate{{cert}}
			ctx = peer.NewContext(ctx, &peer.Peer{AuthInfo: info})
		}
		out, err := s.authenticate(ctx)
		if err != nil {
			if status.Code(err) != codes.Unauthenticated {
				t.Fatalf("refused with %v, want UNAUTHENTICATED", err)
			}
			return
		}
		tn, ok := out.Value(tenantKey{}).(*tenant)
		if !ok {
			t.Fatal("authenticated without a tenant while auth is on")
		}
		byToken := false
		if vals := md.Get("authorization"); len(vals) > 0 {
			// The first value is the one that counts.
			token, found := strings.CutPrefix(strings.ToLower(vals[0][:min(len(vals[0]), 7)]), "bearer ")
			_ = token
			if found {
				sum := sha256.Sum256([]byte(vals[0][7:]))
				byToken = tn.token != nil && bytes.Equal(tn.token, sum[:])
			}
		}
		byCert := slices.ContainsFunc(certNames, func(n string) bool { return slices.Contains(tn.certNames, n) })
		if !byToken && !byCert {
			t.Fatalf("authenticated as %q by neither its token nor a listed certificate name (auth %q, cert %v)", tn.name, auth, certNames)
		}
		if tn.admin && !byToken {
			t.Fatalf("authenticated as the admin tenant without its token")
		}
	})
}
