package ledger

import (
	"context"
	"testing"
	"time"
)

// A waiter that cannot trust notifications re-reads on a backoff: 50 ms,
// doubling, at most a second apart.
func TestNextPollBacksOff(t *testing.T) {
	want := []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond,
		400 * time.Millisecond, 800 * time.Millisecond, time.Second, time.Second}
	var d time.Duration
	for i, w := range want {
		d = nextPoll(d)
		if d != w {
			t.Fatalf("poll %d: %v, want %v", i+1, d, w)
		}
	}
}

// A wait ends at its length, or 50 ms before the caller's deadline if that
// comes first.
func TestWaitEnd(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	if got := waitEnd(context.Background(), now, time.Second); !got.Equal(now.Add(time.Second)) {
		t.Fatalf("no deadline: %v", got)
	}
	if got := waitEnd(context.Background(), now, -time.Second); !got.Equal(now) {
		t.Fatalf("negative wait: %v", got)
	}
	ctx, cancel := context.WithDeadline(context.Background(), now.Add(300*time.Millisecond))
	defer cancel()
	if got := waitEnd(ctx, now, time.Second); !got.Equal(now.Add(250 * time.Millisecond)) {
		t.Fatalf("deadline first: %v", got)
	}
	if got := waitEnd(ctx, now, 100*time.Millisecond); !got.Equal(now.Add(100 * time.Millisecond)) {
		t.Fatalf("wait first: %v", got)
	}
}

// A key whose Begin met a lock is remembered as held for heldMemory after
// the latest mark, and then forgotten.
func TestHeldKeysRemembersForAMoment(t *testing.T) {
	var h heldKeys
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	k, other := Identity{Tenant: "t", Scope: "s", Key: "k"}, Identity{Tenant: "u", Scope: "s", Key: "k"}
	if h.held(k, now) {
		t.Fatal("held before any mark")
	}
	h.mark(k, now)
	if !h.held(k, now.Add(heldMemory-time.Millisecond)) || h.held(other, now) {
		t.Fatal("the marked key (and only it) is held")
	}
	h.mark(k, now.Add(heldMemory/2))
	if !h.held(k, now.Add(heldMemory)) {
		t.Fatal("a new mark extends the memory")
	}
	if h.held(k, now.Add(2*heldMemory)) {
		t.Fatal("held after its memory ran out")
	}
	for i := range heldKeysPrune + 1 {
		h.mark(Identity{Tenant: "t", Scope: "s", Key: string(rune('a'+i%26)) + time.Duration(i).String()}, now)
	}
	h.mark(k, now.Add(heldMemory))
	if n := len(h.until); n != 1 {
		t.Fatalf("%d keys remembered after the others ran out, want 1", n)
	}
}
