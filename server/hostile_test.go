package server_test

import (
	"crypto/rand"
	"encoding/base64"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// randomText returns n bytes of random base64 text, which the database
// cannot compress.
func randomText(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)[:n]
}

// TestKeyLimitFitsTheIndex refuses limits under which a key could not be
// stored, stores a key at the largest limit accepted, and answers a key
// past the limit INVALID_ARGUMENT (never INTERNAL), writing nothing.
func TestKeyLimitFitsTheIndex(t *testing.T) {
	t.Parallel()
	for _, cfg := range []string{
		"limits: {max_key_bytes: 4096}",
		"limits: {max_scope_bytes: 2400, max_key_bytes: 255}",
		"limits: {max_key_bytes: 2300}\ntenants: [{name: " + strings.Repeat("t", 300) + ", token_sha256: " +
			strings.Repeat("ab", 32) + ", scopes: ['*']}]",
	} {
		_, err := server.ParsePolicies([]byte(cfg))
		if err == nil || !strings.Contains(err.Error(), "max_key_bytes") {
			t.Errorf("config %q: %v, want it refused naming max_key_bytes", cfg, err)
		}
	}

	// The largest max_key_bytes the default scope limit and tenant allow.
	maxKey := ledger.MaxIdentityBytes - 255 - len(server.DefaultTenant)
	env := newEnv(t, envOptions{config: "limits: {max_key_bytes: " + strconv.Itoa(maxKey) + "}"})
	scope := randomText(255)
	key := randomText(maxKey)
	resp := env.mustBegin(scope, key, idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if _, err := env.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: scope, Key: key,
		LeaseToken: resp.GetLeaseToken()}); err != nil {
		t.Fatalf("Complete of the longest key: %v", err)
	}
	env.mustBegin(scope, key, idempotencyv1.Outcome_OUTCOME_REPLAY)

	_, err := env.begin(scope, randomText(maxKey+1))
	wantCode(t, err, codes.InvalidArgument, "")
	if n := env.rowCount(); n != 1 {
		t.Fatalf("%d records after a refused key, want 1", n)
	}
}
