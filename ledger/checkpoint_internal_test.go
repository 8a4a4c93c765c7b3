package ledger

import (
	"bytes"
	"context"
	"crypto/rand"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestCheckpointSealingFollowsTheRow: a checkpoint recorded in clear
// (encryption off) is kept, and sealed, by the conversion of legacy rows;
// after a key rotation, the next write of the record seals it again under
// the row's new key, so a keyring without the old key still reads it.
func TestCheckpointSealingFollowsTheRow(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	newKey := func() []byte {
		k := make([]byte, KeySize)
		_, _ = rand.Read(k)
		return k
	}
	k1, k2 := newKey(), newKey()
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
	ring := func(active string, keys map[string][]byte) *Keyring {
		t.Helper()
		r, err := NewKeyring(active, keys)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	id := Identity{Tenant: "t", Scope: "s", Key: "k"}
	secret := []byte("ch_3MtwBwLkdIwHu7ix")
	want := func(s *Store, when string) {
		t.Helper()
		rec, _, err := s.Lookup(ctx, id)
		if err != nil || rec.Checkpoint == nil || rec.Checkpoint.Phase != "charged" || !bytes.Equal(rec.Checkpoint.Data, secret) {
			t.Fatalf("%s: %+v %v", when, rec.Checkpoint, err)
		}
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	stored := func() (data []byte, keyID string) {
		t.Helper()
		if err := conn.QueryRow(ctx, `SELECT checkpoint_data, enc_key_id FROM idempotency_records`).Scan(&data, &keyID); err != nil {
			t.Fatal(err)
		}
		return data, keyID
	}

	plain := open(nil)
	res, err := plain.Begin(ctx, &BeginParams{ID: id, Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	token := res.Record.LeaseToken
	if _, err := plain.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventHeartbeat, Token: token,
		Lease: time.Hour, Checkpoint: &statemachine.Checkpoint{Phase: "charged", Data: secret}}}); err != nil {
		t.Fatal(err)
	}
	if data, _ := stored(); !bytes.Equal(data, secret) {
		t.Fatalf("encryption off: stored %q", data)
	}

	accepting := open(ring("k1", map[string][]byte{"k1": k1}).AcceptingLegacyRows())
	want(accepting, "legacy row, accepted")
	if n, _, err := accepting.ConvertLegacyRows(ctx, 10); err != nil || n != 1 {
		t.Fatalf("ConvertLegacyRows: %d %v", n, err)
	}
	if data, keyID := stored(); bytes.Contains(data, secret) || keyID != "k1" {
		t.Fatalf("converted: stored %q under %q", data, keyID)
	}
	want(open(ring("k1", map[string][]byte{"k1": k1})), "converted, strict keyring")

	// Rotation: k2 active, k1 still known; a Heartbeat rewrites the row.
	rotated := open(ring("k2", map[string][]byte{"k1": k1, "k2": k2}))
	if _, err := rotated.Finish(ctx, &FinishParams{ID: id, Event: statemachine.Event{Kind: statemachine.EventHeartbeat,
		Token: token, Lease: time.Hour}}); err != nil {
		t.Fatal(err)
	}
	if data, keyID := stored(); bytes.Contains(data, secret) || keyID != "k2" {
		t.Fatalf("after the rotation: stored %q under %q", data, keyID)
	}
	want(open(ring("k2", map[string][]byte{"k2": k2})), "k2 only")
}
