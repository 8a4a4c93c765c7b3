package server_test

import (
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// TestCheckpointAcrossKeyRotation: checkpoints sealed under k1 stay
// readable after k2 becomes the active key, through a takeover, a Fail
// RETRYABLE, a Complete and a plain Heartbeat written under k2, each of
// which seals the row (its checkpoint too) again under k2, so k1 can go.
func TestCheckpointAcrossKeyRotation(t *testing.T) {
	dir := t.TempDir()
	k1, k2 := writeKey(t, dir, "k1"), writeKey(t, dir, "k2")
	config := func(active string, keys ...string) string {
		cfg := "encryption:\n  active_key: " + active + "\n  keys:\n"
		for _, k := range keys {
			file := k1
			if k == "k2" {
				file = k2
			}
			cfg += "    - { id: " + k + ", file: " + file + " }\n"
		}
		return cfg
	}
	c := coordtest.Start(t, coordtest.Options{Config: config("k1", "k1"), FakeClock: true})
	e := &testEnv{t: t, coord: c, clock: c.Clock, dbURL: c.DatabaseURL, client: idempotencyv1.NewCoordinatorClient(c.Dial(t))}
	keys := []string{"takeover", "retryable", "complete", "heartbeat"}
	tokens := map[string]string{}
	for _, k := range keys {
		b := e.mustBegin("s", k, acq, withLease(time.Minute))
		tokens[k] = b.GetLeaseToken()
		if _, err := e.heartbeat("s", k, b.GetLeaseToken(), "charged", []byte("secret-"+k)); err != nil {
			t.Fatal(err)
		}
	}
	at := e.clock.Now()

	c.RestartWithConfig(config("k2", "k1", "k2"))
	e.clock.Advance(time.Second)
	if _, err := e.fail("s", "retryable", tokens["retryable"], idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "complete", LeaseToken: tokens["complete"],
		Response: &idempotencyv1.StoredResponse{Body: []byte("ok")}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "heartbeat", LeaseToken: tokens["heartbeat"],
		Lease: durationpb.New(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	e.clock.Advance(2 * time.Minute)
	next := e.mustBegin("s", "takeover", acq)
	wantCheckpoint(t, "takeover under k2", next.GetRecord(), "charged", []byte("secret-takeover"), at)
	for _, k := range keys {
		wantCheckpoint(t, k+" under k1 and k2", e.mustLookup("s", k), "charged", []byte("secret-"+k), at)
	}
	// Every record was written under k2: without k1 each reads, checkpoint and all.
	c.RestartWithConfig(config("k2", "k2"))
	for _, k := range keys {
		if _, _, keyID := storedRow(t, c.DatabaseURL, k); keyID != "k2" {
			t.Errorf("%s: sealed under %q after a write under k2", k, keyID)
		}
		wantCheckpoint(t, k+" under k2 only", e.mustLookup("s", k), "charged", []byte("secret-"+k), at)
	}
}
