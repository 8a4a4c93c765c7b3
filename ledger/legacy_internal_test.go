package ledger

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger/internal/keyring"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestLegacyRowsUpgrade is the upgrade an operator runs: records written
// in clear (encryption off) and records sealed in the v1 form (what
// versions before seal_version 2 wrote: body bound to the record only, raw
// fingerprint, reason in clear) are refused by a strict keyring, read by
// one that accepts legacy rows, converted by ConvertLegacyRows, and then
// read by the strict keyring with their fingerprints still matching. No
// record is lost.
func TestLegacyRowsUpgrade(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	key := make([]byte, KeySize)
	_, _ = rand.Read(key)
	ring, err := NewKeyring("k1", map[string][]byte{"k1": key})
	if err != nil {
		t.Fatal(err)
	}
	open := func(k *Keyring) *Store {
		t.Helper()
		var opts []Option
		if k != nil {
			opts = append(opts, WithKeyring(k))
		}
		s, err := Open(ctx, url, opts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		return s
	}
	fp := []byte("request 4111111111111111")
	resp := &statemachine.Response{Body: []byte("body of clear"), StatusCode: 201, SchemaVersion: "v", Metadata: map[string]string{"m": "1"}}
	pol := statemachine.Policy{}
	ev := statemachine.Event{Fingerprint: fp, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}
	id := func(k string) Identity { return Identity{Tenant: "t", Scope: "s", Key: k} }

	// Written with encryption off.
	plain := open(nil)
	res, err := plain.Begin(ctx, &BeginParams{ID: id("clear"), Event: ev, Policy: pol})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := plain.Finish(ctx, &FinishParams{ID: id("clear"), Event: statemachine.Event{Kind: statemachine.EventFail,
		Token: res.Record.LeaseToken, FailureKind: statemachine.FailureReplayable, Response: resp, Reason: "reason in clear"}}); err != nil {
		t.Fatal(err)
	}
	// Sealed in the v1 form, as the previous version wrote it.
	v1 := id("v1")
	seal := func(column string, plain []byte) []byte {
		block, err := aes.NewCipher(key)
		if err != nil {
			t.Fatal(err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			t.Fatal(err)
		}
		nonce := make([]byte, aead.NonceSize())
		_, _ = rand.Read(nonce)
		return aead.Seal(nonce, nonce, plain, keyring.LegacyAdditionalData(keyring.ID(v1), column))
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `INSERT INTO idempotency_records (tenant, scope, key, state, fingerprint, attempt, generation,
		lease_token, ended_by, has_response, status_code, body, metadata, failure_reason, ttl_us, failure_ttl_us,
		created_at, updated_at, expires_at, enc_key_id, seal_version)
		VALUES ('t', 's', 'v1', 2, $1, 1, 1, 'lt1.x', 5, true, 200, $2, $3, '', 3600000000, 3600000000, now(), now(),
		now() + interval '1 hour', 'k1', 0)`, fp, seal("body", []byte("body of v1")), seal("metadata", []byte(`{"m":"2"}`))); err != nil {
		t.Fatal(err)
	}

	strict := open(ring)
	for _, k := range []string{"clear", "v1"} {
		if _, _, err := strict.Lookup(ctx, id(k)); !errors.Is(err, ErrUnreadable) {
			t.Fatalf("%s before conversion, strict keyring: err = %v, want ErrUnreadable", k, err)
		}
	}
	if n, err := strict.CountLegacyRows(ctx); err != nil || n != 2 {
		t.Fatalf("CountLegacyRows = %d, %v; want 2", n, err)
	}
	if _, _, err := strict.ConvertLegacyRows(ctx, 10); err == nil {
		t.Fatal("a strict keyring converted legacy rows")
	}

	check := func(s *Store, when string) {
		t.Helper()
		for k, body := range map[string]string{"clear": "body of clear", "v1": "body of v1"} {
			r, err := s.Begin(ctx, &BeginParams{ID: id(k), Event: ev, Policy: pol})
			if err != nil || r.Outcome != statemachine.OutcomeReplay || string(r.Record.Response.Body) != body {
				t.Fatalf("%s: %s: %+v %v", when, k, r, err)
			}
			other := ev
			other.Fingerprint = []byte("another request")
			if _, err := s.Begin(ctx, &BeginParams{ID: id(k), Event: other, Policy: pol}); !errors.Is(err, statemachine.ErrFingerprintMismatch) {
				t.Fatalf("%s: %s: another fingerprint: %v", when, k, err)
			}
		}
		rec, _, err := s.Lookup(ctx, id("clear"))
		if err != nil || rec.FailureReason != "reason in clear" || rec.Response.Metadata["m"] != "1" {
			t.Fatalf("%s: clear: %+v %v", when, rec, err)
		}
	}
	accepting := open(ring.AcceptingLegacyRows())
	check(accepting, "legacy accepted")
	converted, skipped, err := accepting.ConvertLegacyRows(ctx, 1)
	if err != nil || converted != 2 || skipped != 0 {
		t.Fatalf("ConvertLegacyRows = %d, %d, %v; want 2 converted", converted, skipped, err)
	}
	if n, err := strict.CountLegacyRows(ctx); err != nil || n != 0 {
		t.Fatalf("after conversion CountLegacyRows = %d, %v", n, err)
	}
	check(strict, "converted, strict keyring")
	var storedFP []byte
	var reason string
	if err := conn.QueryRow(ctx, `SELECT fingerprint, failure_reason FROM idempotency_records WHERE key = 'clear'`).Scan(&storedFP, &reason); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(storedFP, fp) || reason == "reason in clear" {
		t.Fatalf("converted row still holds the raw fingerprint or the reason in clear: %x %q", storedFP, reason)
	}
}

// TestRunTxSealed: RunTx in a store with a keyring seals what it stores and
// keys the fingerprint as Begin does, so a RunTx and a gRPC Begin of the
// same key compare fingerprints alike, and the table holds neither the
// response nor the raw fingerprint.
func TestRunTxSealed(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	key := make([]byte, KeySize)
	_, _ = rand.Read(key)
	ring, err := NewKeyring("k1", map[string][]byte{"k1": key})
	if err != nil {
		t.Fatal(err)
	}
	s, err := Open(ctx, url, WithKeyring(ring))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	id := Identity{Tenant: "t", Scope: "s", Key: "order-1"}
	fp := []byte("request 4111111111111111")
	run := func(fp []byte) (*statemachine.Response, bool, error) {
		return s.RunTx(ctx, id, TxOptions{Fingerprint: fp}, func(context.Context, pgx.Tx) (*statemachine.Response, error) {
			return &statemachine.Response{Body: []byte("paid with 4111111111111111"), StatusCode: 201}, nil
		})
	}
	if _, replayed, err := run(fp); err != nil || replayed {
		t.Fatalf("first RunTx: %v %v", replayed, err)
	}
	if resp, replayed, err := run(fp); err != nil || !replayed || string(resp.Body) != "paid with 4111111111111111" {
		t.Fatalf("second RunTx: %v %v %v", resp, replayed, err)
	}
	if _, _, err := run([]byte("another request")); !errors.Is(err, statemachine.ErrFingerprintMismatch) {
		t.Fatalf("another fingerprint: %v", err)
	}
	res, err := s.Begin(ctx, &BeginParams{ID: id, Event: statemachine.Event{Fingerprint: fp, TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
	if err != nil || res.Outcome != statemachine.OutcomeReplay {
		t.Fatalf("Begin of the RunTx key with the same fingerprint: %+v %v", res, err)
	}
	var row string
	if err := s.pool.QueryRow(ctx, `SELECT r::text FROM idempotency_records r`).Scan(&row); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(row, "4111") || strings.Contains(row, hex.EncodeToString([]byte("4111"))) {
		t.Fatalf("stored in clear: %s", row)
	}
}
