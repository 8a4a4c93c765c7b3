package ledger_test

import (
	"context"
	"crypto/md5" //nolint:gosec // the test computes the trigger's md5 payload, a non-cryptographic hash
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestNotifiesOnlyWhatSomeoneCanCareAbout listens on the records channel
// beside a store and checks which changes are announced: the end of an
// attempt nobody waits for is not (a Complete then commits without the
// database-wide notification lock), the end of a watched one is, and every
// change of a COMPLETED record (which replay caches hold) is. A sentinel
// notification after each step shows what came before it.
func TestNotifiesOnlyWhatSomeoneCanCareAbout(t *testing.T) {
	t.Parallel()
	s, _, url := newClockedStore(t)
	ledger.SkipWithoutNotifications(t, s)
	ledger.SkipOnCitus(t, s, "this test listens on the coordinator node, and there a record's change notifies on the worker that holds it "+
		"(TestCitusReplayCacheForgetOnEveryWorker checks notifications there)")
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "LISTEN idemcoord_records"); err != nil {
		t.Fatal(err)
	}
	other, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(ctx)
	// announced returns the record payloads notified before a sentinel
	// sent now.
	announced := func() []string {
		t.Helper()
		if _, err := other.Exec(ctx, "SELECT pg_notify('idemcoord_records', 'sentinel')"); err != nil {
			t.Fatal(err)
		}
		var got []string
		for {
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			n, err := conn.WaitForNotification(wctx)
			cancel()
			if err != nil {
				t.Fatalf("waiting for the sentinel: %v", err)
			}
			switch {
			case n.Payload == "sentinel":
				return got
			case strings.HasPrefix(n.Payload, "ping"): // the store's own liveness pings
			default:
				got = append(got, n.Payload)
			}
		}
	}
	hash := func(id ledger.Identity) string {
		sum := md5.Sum([]byte(id.Tenant + "\x1f" + id.Scope + "\x1f" + id.Key)) //nolint:gosec // the test computes the trigger's md5 payload, a non-cryptographic hash
		return hex.EncodeToString(sum[:])
	}

	quiet := ledger.Identity{Tenant: "t", Scope: "s", Key: "nobody-waits"}
	completeID(t, s, quiet, beginID(t, s, quiet, time.Hour, time.Hour))
	if got := announced(); len(got) != 0 {
		t.Fatalf("a pair nobody waited for notified %v", got)
	}

	watched := ledger.Identity{Tenant: "t", Scope: "s", Key: "waited-for"}
	tok := beginID(t, s, watched, time.Hour, time.Hour)
	if held, err := s.Watch(ctx, watched); err != nil || !held {
		t.Fatalf("Watch of a held record: %v %v", held, err)
	}
	if got := announced(); len(got) != 0 {
		t.Fatalf("Watch itself notified %v", got)
	}
	completeID(t, s, watched, tok)
	if got := announced(); len(got) != 1 || got[0] != hash(watched) {
		t.Fatalf("the Complete of a watched record notified %v, want [%s]", got, hash(watched))
	}
	// Watch of a record that is not held marks nothing and says so.
	if held, err := s.Watch(ctx, watched); err != nil || held {
		t.Fatalf("Watch of a COMPLETED record: %v %v", held, err)
	}

	// A COMPLETED record may be in a replay cache: forgetting it notifies.
	if _, err := s.Forget(ctx, &ledger.ForgetParams{ID: quiet}); err != nil {
		t.Fatal(err)
	}
	if got := announced(); len(got) != 1 || got[0] != hash(quiet) {
		t.Fatalf("Forget of a COMPLETED record notified %v, want [%s]", got, hash(quiet))
	}
	// A Heartbeat never notifies, watched or not.
	hb := ledger.Identity{Tenant: "t", Scope: "s", Key: "heartbeat"}
	tok = beginID(t, s, hb, time.Hour, time.Hour)
	if _, err := s.Watch(ctx, hb); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Finish(ctx, &ledger.FinishParams{ID: hb, Event: statemachine.Event{
		Kind: statemachine.EventHeartbeat, Token: tok, Lease: time.Hour}}); err != nil {
		t.Fatal(err)
	}
	if got := announced(); len(got) != 0 {
		t.Fatalf("a Heartbeat notified %v", got)
	}
}
