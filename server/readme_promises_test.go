package server_test

// Tests of README promises that no other test pinned down (issue 19, item 6):
// each fails when the promised behaviour is broken.

import (
	"context"
	"io"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// TestUnknownConfigKeysAreRejected: a misspelt key anywhere in the file is
// an error naming the key, never silently ignored; the same file without
// the typo loads.
func TestUnknownConfigKeysAreRejected(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ bad, good, field string }{
		{"defualts: { ttl: 1h }\n", "defaults: { ttl: 1h }\n", "defualts"},
		{"defaults: { tll: 1h }\n", "defaults: { ttl: 1h }\n", "tll"},
		{"scopes:\n  - { match: build, ttl: 1h, leese: 5s }\n", "scopes:\n  - { match: build, ttl: 1h, lease: 5s }\n", "leese"},
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

// TestFirstMatchingPolicyWinsInStoredTTL: of two scope entries that both match, the
// first in the file decides, both in the resolved policy and in the ttl a
// real call stores.
func TestFirstMatchingPolicyWinsInStoredTTL(t *testing.T) {
	t.Parallel()
	const cfg = "scopes:\n" +
		"  - { match: \"/payments.v1.*\", ttl: 60s }\n" +
		"  - { match: \"/payments.v1.Payments/Charge\", ttl: 300s }\n" +
		"  - { match: \"*\", ttl: 7s }\n"
	p, err := server.ParsePolicies([]byte(cfg))
	if err != nil {
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

// TestScopeLabelCap: of 205 scopes the config file names, the first 200
// seen get their own label, every later one is counted under "other", and a
// scope seen before the cap keeps its label after it.
func TestScopeLabelCap(t *testing.T) {
	t.Parallel()
	var cfg strings.Builder
	cfg.WriteString("scopes:\n")
	for i := range 205 {
		cfg.WriteString("  - { match: s" + strconv.Itoa(i) + " }\n")
	}
	e := newEnv(t, envOptions{config: cfg.String()})
	for i := range 205 {
		e.mustBegin("s"+strconv.Itoa(i), "k", acquired)
	}
	e.mustBegin("s0", "k", inProgress) // known before the cap: still its own label

	rec := httptest.NewRecorder()
	e.coord.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	labels := map[string]bool{}
	re := regexp.MustCompile(`(?m)^idempotency_begin_total\{outcome="[a-z_]+",scope="([^"]*)"\} `)
	for _, m := range re.FindAllStringSubmatch(string(body), -1) {
		labels[m[1]] = true
	}
	if !labels["other"] {
		t.Fatalf("no scope=\"other\" after 205 scopes")
	}
	if len(labels) != 201 {
		t.Fatalf("%d distinct scope labels, want 200 and \"other\"", len(labels))
	}
	for _, line := range []string{
		`idempotency_begin_total{outcome="acquired",scope="other"} 5`,
		`idempotency_begin_total{outcome="acquired",scope="s199"} 1`,
		`idempotency_begin_total{outcome="in_progress",scope="s0"} 1`,
	} {
		if !strings.Contains(string(body), "\n"+line+"\n") {
			t.Errorf("/metrics lacks %s", line)
		}
	}
	if labels["s200"] {
		t.Errorf("the 201st scope got its own label")
	}
}

// TestEncryptionBoundToRecord copies one record's sealed body, metadata and
// key id onto another record with SQL: the copy does not decrypt (DATA_LOSS,
// RECORD_UNREADABLE), it is never replayed as the other record's response.
func TestEncryptionBoundToRecord(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	k := writeKey(t, dir, "k")
	c := coordtest.Start(t, coordtest.Options{Config: "encryption:\n  active_key: k\n  keys:\n    - { id: k, file: " + k + " }\n"})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	store := func(key, body string) {
		t.Helper()
		b, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "pay", Key: key, LeaseToken: b.GetLeaseToken(),
			Response: &idempotencyv1.StoredResponse{Body: []byte(body), Metadata: map[string]string{"m": body}}}); err != nil {
			t.Fatal(err)
		}
	}
	store("alice", "alice's receipt")
	store("bob", "bob's receipt")

	conn, err := pgxConnect(c.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	tag, err := conn.Exec(context.Background(), `UPDATE idempotency_records b
		SET body = a.body, metadata = a.metadata, enc_key_id = a.enc_key_id
		FROM idempotency_records a WHERE a.key = 'alice' AND b.key = 'bob'`)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("copying the ciphertext: %v %v", tag, err)
	}
	c.Restart() // no replay cache in the way: the row is read from the table
	client = idempotencyv1.NewCoordinatorClient(c.Dial(t))
	r, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: "bob"})
	if err == nil {
		t.Fatalf("a ciphertext copied from another record decrypted: %v", r.GetRecord().GetResponse())
	}
	wantCode(t, err, codes.DataLoss, "RECORD_UNREADABLE")
	// The original still replays.
	r, err = client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: "alice"})
	if err != nil || string(r.GetRecord().GetResponse().GetBody()) != "alice's receipt" {
		t.Fatalf("alice: %v %v", r, err)
	}
}
