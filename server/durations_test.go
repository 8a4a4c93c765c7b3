package server_test

import (
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// TestDurationsKeptToTheMicrosecond: the record keeps durations in
// microseconds, so a finer part of a requested lease or TTL is rounded up,
// and the answer states what was stored. Before, a lease of 144 s + 1 ns was
// stored as 144 s (the Begin's answer and the request disagreed) and a TTL of
// 1 ns as none at all.
func TestDurationsKeptToTheMicrosecond(t *testing.T) {
	e := newEnv(t, envOptions{})
	now := e.clock.Now()
	b := e.mustBegin("s", "k", idempotencyv1.Outcome_OUTCOME_ACQUIRED, func(r *idempotencyv1.BeginRequest) {
		r.Lease = &durationpb.Duration{Seconds: 144, Nanos: 1}
		r.Ttl = &durationpb.Duration{Nanos: 1}
	})
	if got, want := b.GetRecord().GetLeaseExpiresAt().AsTime(), now.Add(144*time.Second+time.Microsecond); !got.Equal(want) {
		t.Errorf("lease expires at %v, want %v", got, want)
	}
	if got := b.GetTtl().AsDuration(); got != time.Microsecond {
		t.Errorf("answered ttl %v, want 1µs", got)
	}
	rec, err := e.client.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "s", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if !rec.GetRecord().GetLeaseExpiresAt().AsTime().Equal(b.GetRecord().GetLeaseExpiresAt().AsTime()) {
		t.Errorf("Lookup reads lease_expires_at %v, Begin answered %v", rec.GetRecord().GetLeaseExpiresAt().AsTime(), b.GetRecord().GetLeaseExpiresAt().AsTime())
	}

	h, err := e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k",
		LeaseToken: b.GetLeaseToken(), Lease: &durationpb.Duration{Seconds: 2, Nanos: 999_999_001}})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := h.GetRecord().GetLeaseExpiresAt().AsTime(), now.Add(3*time.Second); !got.Equal(want) {
		t.Errorf("after Heartbeat, lease expires at %v, want %v", got, want)
	}
}
