package server_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

func writeKey(t *testing.T, dir, name string) string {
	t.Helper()
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// storedRow reads a record's raw columns with SQL.
func storedRow(t *testing.T, url, key string) (body, metadata []byte, keyID string) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if err := conn.QueryRow(context.Background(), `SELECT body, metadata, enc_key_id FROM idempotency_records WHERE key = $1`,
		key).Scan(&body, &metadata, &keyID); err != nil {
		t.Fatal(err)
	}
	return body, metadata, keyID
}

// TestEncryptionAtRestAndRotation stores responses encrypted, checks the
// table holds no plaintext, rotates the key, and replays old and new rows.
func TestEncryptionAtRestAndRotation(t *testing.T) {
	dir := t.TempDir()
	k1, k2 := writeKey(t, dir, "k1"), writeKey(t, dir, "k2")
	t.Setenv("IDEMCOORD_TEST_KEY2", mustRead(t, k2))
	config := func(active string, keys ...string) string {
		cfg := "encryption:\n  active_key: " + active + "\n  keys:\n"
		for _, k := range keys {
			switch k {
			case "k1":
				cfg += "    - { id: k1, file: " + k1 + " }\n"
			case "k2":
				cfg += "    - { id: k2, env: IDEMCOORD_TEST_KEY2 }\n"
			}
		}
		return cfg
	}
	c := coordtest.Start(t, coordtest.Options{Config: config("k1", "k1")})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	secret := &idempotencyv1.StoredResponse{Body: []byte("card 4111-1111-1111-1111"), StatusCode: 200,
		SchemaVersion: "payments.v1.ChargeResponse/1", Metadata: map[string]string{"x-holder": "Ada Lovelace"}}

	store := func(key string) {
		t.Helper()
		b, err := client.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.Complete(context.Background(), &idempotencyv1.CompleteRequest{Scope: "pay", Key: key,
			LeaseToken: b.GetLeaseToken(), Response: secret}); err != nil {
			t.Fatal(err)
		}
	}
	replays := func(key string) {
		t.Helper()
		r, err := client.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
		if err != nil || r.GetOutcome() != replay || !proto.Equal(r.GetRecord().GetResponse(), secret) {
			t.Fatalf("%s: %v %v", key, r, err)
		}
	}
	inClear := func(key, wantKeyID string) {
		t.Helper()
		body, meta, keyID := storedRow(t, c.DatabaseURL, key)
		if keyID != wantKeyID {
			t.Fatalf("%s: enc_key_id %q, want %q", key, keyID, wantKeyID)
		}
		for _, plain := range []string{"4111", "Ada Lovelace", "x-holder"} {
			if bytes.Contains(body, []byte(plain)) || bytes.Contains(meta, []byte(plain)) {
				t.Fatalf("%s: %q readable in the table", key, plain)
			}
		}
	}

	store("old")
	inClear("old", "k1")
	replays("old")

	// Rotate: k2 active, k1 still listed for old rows.
	c.RestartWithConfig(config("k2", "k1", "k2"))
	store("new")
	inClear("new", "k2")
	replays("old")
	replays("new")

	// Without k1 the old row cannot be read: the error is not a replay of
	// garbage.
	c.RestartWithConfig(config("k2", "k2"))
	replays("new")
	_, err := client.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: "pay", Key: "old"})
	wantCode(t, err, codes.DataLoss, "RECORD_UNREADABLE")
}

func mustRead(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestBadEncryptionConfigIsRefused(t *testing.T) {
	dir := t.TempDir()
	short := filepath.Join(dir, "short")
	if err := os.WriteFile(short, []byte(base64.StdEncoding.EncodeToString([]byte("too short"))), 0o600); err != nil {
		t.Fatal(err)
	}
	good := writeKey(t, dir, "good")
	for _, cfg := range []string{
		fmt.Sprintf("encryption: { active_key: a, keys: [{ id: a, file: %s }] }", short),
		fmt.Sprintf("encryption: { active_key: b, keys: [{ id: a, file: %s }] }", good),
		fmt.Sprintf("encryption: { active_key: a, keys: [{ id: a, file: %s, env: X }] }", good),
		"encryption: { active_key: a, keys: [{ id: a, env: IDEMCOORD_SURELY_UNSET }] }",
		fmt.Sprintf("encryption: { active_key: a, keys: [{ id: a, file: %s/missing }] }", dir),
	} {
		if _, err := server.ParsePolicies([]byte(cfg)); err == nil {
			t.Errorf("accepted %s", cfg)
		}
	}
}
