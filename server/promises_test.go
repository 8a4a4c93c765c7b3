package server_test

import (
	"strings"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/server"
)

// TestConfigRejectsUnknownKeys: README promises that a misspelt setting is
// an error, never silently ignored, at the top level, in defaults and in a
// scope entry.
func TestConfigRejectsUnknownKeys(t *testing.T) {
	t.Parallel()
	for _, cfg := range []string{
		"defualts: { ttl: 1h }\n",
		"defaults: { tll: 1h }\n",
		"scopes:\n  - { match: build, on_unkown: hold }\n",
		"reaper: { intervall: 1s }\n",
	} {
		_, err := server.ParsePolicies([]byte(cfg))
		if err == nil {
			t.Errorf("config %q accepted; want an error naming the unknown key", cfg)
			continue
		}
		if !strings.Contains(err.Error(), "not found") && !strings.Contains(err.Error(), "unknown") {
			t.Errorf("config %q: error %q does not say the key is unknown", cfg, err)
		}
	}
}

// TestFirstMatchingPolicyWins: README promises that the first matching
// scope entry wins, and that `*` matches any run of bytes, `/` included.
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
}
