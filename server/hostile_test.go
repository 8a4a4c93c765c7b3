package server_test

import (
	"crypto/rand"
	"encoding/base64"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

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

// TestStoredBytesBoundedByResponseLimit stores a response at the size
// limit whose metadata is made of the characters JSON escapes six-fold:
// what the database holds stays within the limit (plus a few bytes), and
// the replay returns the metadata unchanged.
func TestStoredBytesBoundedByResponseLimit(t *testing.T) {
	t.Parallel()
	env := newEnv(t, envOptions{})
	limit := server.DefaultLimits().MaxResponseBytes
	meta := map[string]string{"html": strings.Repeat("<&>", (limit-64)/3), "ctl": "\x01\x1f\u2028"}
	stored := &idempotencyv1.StoredResponse{SchemaVersion: "v1", Metadata: meta}
	if n := proto.Size(stored); n > limit {
		t.Fatalf("test response is %d bytes, over the limit %d", n, limit)
	}
	resp := env.mustBegin("s", "k", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if _, err := env.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k",
		LeaseToken: resp.GetLeaseToken(), Response: stored}); err != nil {
		t.Fatal(err)
	}
	conn, err := pgxConnect(env.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	var n int
	if err := conn.QueryRow(t.Context(), `SELECT coalesce(octet_length(body), 0) + coalesce(octet_length(metadata), 0)
		+ octet_length(schema_version) + octet_length(content_type) FROM idempotency_records`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n > limit+64 {
		t.Fatalf("a response within the %d-byte limit is stored as %d bytes", limit, n)
	}
	replay := env.mustBegin("s", "k", idempotencyv1.Outcome_OUTCOME_REPLAY)
	if !proto.Equal(replay.GetRecord().GetResponse(), stored) {
		t.Fatal("the replayed response differs from the stored one")
	}
}
