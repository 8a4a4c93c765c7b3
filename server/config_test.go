package server_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/server"
)

// TestConfigRejectsUnknownKeys: a misspelt key anywhere in the file (top
// level, defaults, a scope entry, limits, reaper, tenants, rate limit) is an
// error naming the key, never silently ignored; the same file without the
// typo loads.
func TestConfigRejectsUnknownKeys(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ bad, good, field string }{
		{"defualts: { ttl: 1h }\n", "defaults: { ttl: 1h }\n", "defualts"}, //nolint:misspell // the typo is the test
		{"defaults: { tll: 1h }\n", "defaults: { ttl: 1h }\n", "tll"},
		{"scopes:\n  - { match: build, ttl: 1h, leese: 5s }\n", "scopes:\n  - { match: build, ttl: 1h, lease: 5s }\n", "leese"},
		{"scopes:\n  - { match: build, on_unkown: hold }\n", "scopes:\n  - { match: build, on_unknown: hold }\n", "on_unkown"}, //nolint:misspell // the typo is the test
		{"limits: { max_key_byte: 10 }\n", "limits: { max_key_bytes: 10 }\n", "max_key_byte"},
		{"reaper: { intervall: 1s }\n", "reaper: { interval: 1s }\n", "intervall"},
		{"tenants:\n  - { name: a, token_sha256: " + strings.Repeat("ab", 32) + ", scope: [\"*\"] }\n",
			"tenants:\n  - { name: a, token_sha256: " + strings.Repeat("ab", 32) + ", scopes: [\"*\"] }\n", "scope"},
		{"rate_limit: { requests_per_sec: 5, burst: 5 }\n", "rate_limit: { requests_per_second: 5, burst: 5 }\n", "requests_per_sec"},
	} {
		_, err := server.ParsePolicies([]byte(tc.bad))
		if err == nil {
			t.Errorf("accepted %q", tc.bad)
			continue
		}
		if !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%q: error %q does not name %q", tc.bad, err, tc.field)
		}
		if _, err := server.ParsePolicies([]byte(tc.good)); err != nil {
			t.Errorf("the corrected file %q: %v", tc.good, err)
		}
	}
	// The same through the file the binary loads.
	path := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(path, []byte("scopes:\n  - { match: build, ttl: 1h }\nunknown_section: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := server.LoadPolicies(path); err == nil || !strings.Contains(err.Error(), "unknown_section") {
		t.Fatalf("LoadPolicies with an unknown key: %v", err)
	}
}

// TestFirstMatchingPolicyWins: the first matching scope entry wins, and `*`
// matches any run of bytes, `/` included; a real call stores the ttl of
// the entry that won.
func TestFirstMatchingPolicyWins(t *testing.T) {
	t.Parallel()
	p, err := server.ParsePolicies([]byte(`
scopes:
  - { match: "/payments.v1.Payments/*", ttl: 720h }
  - { match: "/payments.v1.*", ttl: 1h }
  - { match: "*", ttl: 2h }
`))
	if err != nil {
		t.Fatal(err)
	}
	for scope, want := range map[string]time.Duration{
		"/payments.v1.Payments/Charge":   720 * time.Hour,
		"/payments.v1.Refunds/Refund":    time.Hour,
		"/payments.v1.Payments/a/b":      720 * time.Hour,
		"build":                          2 * time.Hour,
		"/payments.v2.Payments/Charge":   2 * time.Hour,
		"/payments.v1.Payments/Charge/x": 720 * time.Hour,
	} {
		if got := p.For(scope).TTL; got != want {
			t.Errorf("scope %q: ttl %v, want %v (first matching entry)", scope, got, want)
		}
	}

	// Of three entries that all match, the first decides, both in the
	// resolved policy and in the ttl a real call stores.
	const cfg = "scopes:\n" +
		"  - { match: \"/payments.v1.*\", ttl: 60s }\n" +
		"  - { match: \"/payments.v1.Payments/Charge\", ttl: 300s }\n" +
		"  - { match: \"*\", ttl: 7s }\n"
	if p, err = server.ParsePolicies([]byte(cfg)); err != nil {
		t.Fatal(err)
	}
	for scope, want := range map[string]time.Duration{
		"/payments.v1.Payments/Charge": 60 * time.Second, // matches all three: the first wins
		"/payments.v1.Other":           60 * time.Second,
		"build":                        7 * time.Second,
	} {
		if got := p.For(scope).TTL; got != want {
			t.Errorf("For(%q).TTL = %v, want %v", scope, got, want)
		}
	}
	e := newEnv(t, envOptions{config: cfg})
	b := e.mustBegin("/payments.v1.Payments/Charge", "k", acquired)
	rec := e.mustComplete("/payments.v1.Payments/Charge", "k", b.GetLeaseToken(), nil).GetRecord()
	if ttl := rec.GetExpiresAt().AsTime().Sub(rec.GetUpdatedAt().AsTime()); ttl != 60*time.Second {
		t.Fatalf("stored ttl = %v, want the first matching entry's 60s", ttl)
	}
}
