package ledger_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// TestBeginGivenUpOnAHeldKeyWritesNothing: Begins of a key another
// transaction holds (a RunTx running fn, on a new key) wait within their
// callers' contexts, and a caller that gives up meanwhile does not acquire
// the key afterwards: never once its deadline has passed, and not later
// than ledger's bound on one lock wait (500 ms) after a cancel. When the
// holder rolls back after that, the key is left absent, as if those Begins
// never were. (A late acquisition would strand the key: its caller is
// gone, and the Go client's release of it has already run.)
//
// Before, the Begin's statement went on waiting after its caller had gone
// (in a batch worker, or detached from the caller as a commit is) and
// inserted the key once the holder rolled back.
func TestBeginGivenUpOnAHeldKeyWritesNothing(t *testing.T) {
	t.Parallel()
	for _, mode := range []struct {
		name string
		opts []ledger.Option
	}{{"batched", nil}, {"single", []ledger.Option{ledger.WithoutBatching()}}} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			db := newTxDB(t, mode.opts...)
			id := ledger.Identity{Tenant: ledger.DefaultTenant, Scope: "charge", Key: "held"}
			rollBack := holdNewKey(t, db, id)

			begin := func(ctx context.Context) error {
				_, err := db.store.Begin(ctx, &ledger.BeginParams{ID: id, Event: statemachine.Event{TTL: time.Hour, FailureTTL: time.Hour, Lease: time.Minute}})
				return err
			}
			deadline, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			if err := begin(deadline); !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Begin of the held key with a 300 ms deadline: %v, want context.DeadlineExceeded", err)
			}
			cancelled, cancelNow := context.WithCancel(context.Background())
			time.AfterFunc(300*time.Millisecond, cancelNow)
			if err := begin(cancelled); !errors.Is(err, context.Canceled) {
				t.Fatalf("Begin of the held key cancelled after 300 ms: %v, want context.Canceled", err)
			}

			time.Sleep(time.Second) // past the bound after the cancel (not a synchronization)
			rollBack()
			// A Begin's statement that outlived its caller would insert the
			// key as soon as the holder is gone; give it every chance.
			time.Sleep(time.Second)
			if n := db.records(t, id.Key); n != 0 {
				t.Fatalf("%d records of the key after every Begin of it gave up and its holder rolled back; want none", n)
			}
		})
	}
}
