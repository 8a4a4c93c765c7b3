package replaycache_test

import (
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/ledger/internal/replaycache"
	"github.com/idemcoord/idemcoord/statemachine"
)

func completed() statemachine.Record {
	return statemachine.Record{State: statemachine.StateCompleted, Response: &statemachine.Response{Body: []byte("ok")},
		ExpiresAt: time.Now().Add(time.Hour)}
}

// TestReadOlderThanInvalidationIsNotCached: a record read before its
// invalidation is never inserted after it, and an invalidation evicts.
func TestReadOlderThanInvalidationIsNotCached(t *testing.T) {
	c := replaycache.New(1<<20, func() bool { return true })
	seq := c.Snapshot()
	c.Invalidate("a")
	c.Put("a", completed(), seq)
	if _, ok := c.Get("a"); ok {
		t.Fatal("a read older than the invalidation was cached")
	}
	c.Put("a", completed(), c.Snapshot())
	if _, ok := c.Get("a"); !ok {
		t.Fatal("a fresh read was not cached")
	}
	c.Invalidate("a")
	if _, ok := c.Get("a"); ok {
		t.Fatal("an invalidated record is still served")
	}
	seq = c.Snapshot()
	c.InvalidateAll()
	c.Put("b", completed(), seq)
	if _, ok := c.Get("b"); ok {
		t.Fatal("a read older than InvalidateAll was cached")
	}
}

// TestNotServedWhileNotFresh: nothing is served while notifications
// cannot be trusted.
func TestNotServedWhileNotFresh(t *testing.T) {
	fresh := true
	c := replaycache.New(1<<20, func() bool { return fresh })
	c.Put("a", completed(), c.Snapshot())
	fresh = false
	if _, ok := c.Get("a"); ok {
		t.Fatal("served while not fresh")
	}
	if st := c.Stats(); st.Bytes == 0 {
		t.Fatalf("stats %+v: the record should still take memory", st)
	}
}
