package server

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestClientOf: a client is the remote IP address, an IPv6 /64 network
// (an IPv4 address mapped into IPv6 is the IPv4 address), never the port.
func TestClientOf(t *testing.T) {
	for addr, want := range map[string]string{
		"192.0.2.1:1234":        "192.0.2.1",
		"192.0.2.1:5678":        "192.0.2.1",
		"[::ffff:192.0.2.1]:80": "192.0.2.1",
		"[2001:db8::1]:443":     "2001:db8::/64",
		"[2001:db8::ffff]:1":    "2001:db8::/64",
		"[2001:db8:0:1::1]:443": "2001:db8:0:1::/64",
		"[fe80::1%eth0]:1":      "fe80::/64",
		"not an address":        "not an address",
	} {
		if got := clientOf(addr); got != want {
			t.Errorf("clientOf(%q) = %q, want %q", addr, got, want)
		}
	}
}

// TestBodyBudgetShares: one client holds at most its share, all clients
// together at most the budget; bytes given back can be taken again.
func TestBodyBudgetShares(t *testing.T) {
	b := newBodyBudget(100, 40, 10)
	step := func(what string, err, want error) {
		t.Helper()
		if !errors.Is(err, want) || (want == nil && err != nil) {
			t.Fatalf("%s: %v, want %v", what, err, want)
		}
	}
	step("a takes its share", b.take("a", 40), nil)
	step("a takes a byte more", b.take("a", 1), errClientShare)
	step("b takes its share", b.take("b", 40), nil)
	step("c takes 20", b.take("c", 20), nil)
	step("c takes a byte past the budget", b.take("c", 1), errBodyBudget)
	b.give("a", 40)
	step("c takes a byte once a gave back", b.take("c", 1), nil)
	step("a takes again", b.take("a", 39), nil)
	b.give("a", 39)
	b.give("b", 40)
	b.give("c", 21)
	if b.used != 0 || len(b.held) != 0 {
		t.Fatalf("all given back: used %d, held %v", b.used, b.held)
	}
	// The default share: an eighth of the budget, at least one body's cost.
	if got := newBodyBudget(800, 0, 10).share; got != 100 {
		t.Fatalf("default share of 800 = %d, want 100", got)
	}
	if got := newBodyBudget(800, 0, 300).share; got != 300 {
		t.Fatalf("default share of 800 with a body cost of 300 = %d, want 300", got)
	}
	if got := newBodyBudget(800, 0, 900).share; got != 800 {
		t.Fatalf("default share of 800 with a body cost of 900 = %d, want 800", got)
	}
}

// TestBodyBudgetTakeWithin: a take that does not fit waits until bytes
// are given back, and fails with take's error once its wait passes or its
// context ends.
func TestBodyBudgetTakeWithin(t *testing.T) {
	b := newBodyBudget(100, 60, 10)
	if err := b.take("a", 60); err != nil {
		t.Fatal(err)
	}
	if err := b.takeWithin(context.Background(), "a", 1, 10*time.Millisecond); !errors.Is(err, errClientShare) {
		t.Fatalf("a past its share, waiting 10 ms: %v, want %v", err, errClientShare)
	}
	if err := b.takeWithin(context.Background(), "b", 40, time.Minute); err != nil {
		t.Fatalf("b within the budget: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := b.takeWithin(ctx, "c", 1, time.Minute); !errors.Is(err, errBodyBudget) {
		t.Fatalf("c past the budget, its context ended: %v, want %v", err, errBodyBudget)
	}
	done := make(chan error, 1)
	go func() { done <- b.takeWithin(context.Background(), "c", 30, time.Minute) }()
	select {
	case err := <-done:
		t.Fatalf("c took 30 bytes past the budget: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	b.give("a", 60)
	if err := <-done; err != nil {
		t.Fatalf("c once a gave back: %v", err)
	}
	if b.used != 70 || b.held["c"] != 30 {
		t.Fatalf("used %d, held %v; want 70, c 30", b.used, b.held)
	}
}
