package ledger

import (
	"context"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// TestListenerFallenBehindReconnects makes a store's own pings look 20 s
// late (as from a listener that stopped reading): the store stops serving
// its replay cache, its waiters poll, and the listener reconnects, after
// which its pings come back and it trusts notifications again.
func TestListenerFallenBehindReconnects(t *testing.T) {
	t.Parallel()
	s, err := Open(context.Background(), pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	n := s.notifier
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("never %s: %+v", what, s.NotificationStats())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitFor("trusted notifications", func() bool { return n.fresh(cacheFreshness) && !n.polling() })
	connects := n.connects.Load()
	lagging := time.Now().Add(-20 * time.Second).UnixNano()
	n.lastSeen.Store(lagging)
	n.connectedAt.Store(lagging)
	n.checkLag(time.Now())
	if n.fresh(cacheFreshness) || !n.polling() {
		t.Fatalf("a listener 20 s behind: fresh=%v polling=%v", n.fresh(cacheFreshness), n.polling())
	}
	waitFor("reconnected", func() bool { return n.connects.Load() > connects && n.lastSeen.Load() > lagging })
	waitFor("trusted notifications again", func() bool { return n.fresh(cacheFreshness) && !n.polling() })
}
