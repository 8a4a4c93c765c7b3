package server

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"testing"
)

// A reload revokes the console sessions of exactly the tokens it takes
// from their tenant: removed, or moved to another tenant; not the tokens
// it keeps or adds, nor certificate-only tenants.
func TestRevokedTokens(t *testing.T) {
	hash := func(token string) string {
		s := sha256.Sum256([]byte(token))
		return hex.EncodeToString(s[:])
	}
	parse := func(tenants ...[2]string) *Policies {
		t.Helper()
		cfg := "tenants:\n"
		for _, tn := range tenants {
			if tn[1] == "" {
				cfg += fmt.Sprintf("  - { name: %s, client_cert_names: [%s], scopes: [\"*\"] }\n", tn[0], tn[0])
			} else {
				cfg += fmt.Sprintf("  - { name: %s, token_sha256: %s, scopes: [\"*\"] }\n", tn[0], hash(tn[1]))
			}
		}
		p, err := ParsePolicies([]byte(cfg))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	cur := parse([2]string{"ops", "t-ops"}, [2]string{"pay", "t-pay"}, [2]string{"web", "t-web"}, [2]string{"cert", ""})
	next := parse([2]string{"ops", "t-ops"}, [2]string{"web", "t-pay"}, [2]string{"new", "t-new"}, [2]string{"cert", ""})
	var got []string
	for _, h := range revokedTokens(cur, next) {
		got = append(got, hex.EncodeToString(h))
	}
	slices.Sort(got)
	want := []string{hash("t-pay"), hash("t-web")}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("revoked %v, want t-pay (moved to web) and t-web (removed): %v", got, want)
	}
	if got := revokedTokens(cur, cur); len(got) != 0 {
		t.Fatalf("an unchanged config revokes %d tokens", len(got))
	}
}
