package server_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"google.golang.org/protobuf/types/known/durationpb"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// randomText returns n bytes of random base64 text, which the database
// cannot compress.
func randomText(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)[:n]
}

// TestKeyLimitFitsTheIndex refuses limits under which a key could not be
// stored, stores a key at the largest limit accepted, and answers a key
// past the limit INVALID_ARGUMENT (never INTERNAL), writing nothing.
func TestKeyLimitFitsTheIndex(t *testing.T) {
	t.Parallel()
	for _, cfg := range []string{
		"limits: {max_key_bytes: 4096}",
		"limits: {max_scope_bytes: 2400, max_key_bytes: 255}",
		"limits: {max_key_bytes: 2300}\ntenants: [{name: " + strings.Repeat("t", 300) + ", token_sha256: " +
			strings.Repeat("ab", 32) + ", scopes: ['*']}]",
	} {
		_, err := server.ParsePolicies([]byte(cfg))
		if err == nil || !strings.Contains(err.Error(), "max_key_bytes") {
			t.Errorf("config %q: %v, want it refused naming max_key_bytes", cfg, err)
		}
	}

	// The largest max_key_bytes the default scope limit and tenant allow.
	maxKey := ledger.MaxIdentityBytes - 255 - len(ledger.DefaultTenant)
	env := newEnv(t, envOptions{config: "limits: {max_key_bytes: " + strconv.Itoa(maxKey) + "}"})
	scope := randomText(255)
	key := randomText(maxKey)
	resp := env.mustBegin(scope, key, idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if _, err := env.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: scope, Key: key,
		LeaseToken: resp.GetLeaseToken()}); err != nil {
		t.Fatalf("Complete of the longest key: %v", err)
	}
	env.mustBegin(scope, key, idempotencyv1.Outcome_OUTCOME_REPLAY)

	_, err := env.begin(scope, randomText(maxKey+1))
	wantCode(t, err, codes.InvalidArgument, "")
	if n := env.rowCount(); n != 1 {
		t.Fatalf("%d records after a refused key, want 1", n)
	}
}

// TestStoredBytesBoundedByResponseLimit stores a response at the size
// limit whose metadata is made of the characters JSON escapes six-fold:
// what the database holds stays within the limit (plus a few bytes), and
// the replay returns the metadata unchanged.
func TestStoredBytesBoundedByResponseLimit(t *testing.T) {
	t.Parallel()
	env := newEnv(t, envOptions{})
	limit := server.DefaultLimits().MaxResponseBytes
	meta := map[string]string{"html": strings.Repeat("<&>", (limit-64)/3), "ctl": "\x01\x1f\u2028"}
	stored := &idempotencyv1.StoredResponse{SchemaVersion: "v1", Metadata: meta}
	if n := proto.Size(stored); n > limit {
		t.Fatalf("test response is %d bytes, over the limit %d", n, limit)
	}
	resp := env.mustBegin("s", "k", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if _, err := env.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k",
		LeaseToken: resp.GetLeaseToken(), Response: stored}); err != nil {
		t.Fatal(err)
	}
	conn, err := pgxConnect(env.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	var n int
	if err := conn.QueryRow(t.Context(), `SELECT coalesce(octet_length(body), 0) + coalesce(octet_length(metadata), 0)
		+ octet_length(schema_version) + octet_length(content_type) FROM idempotency_records`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n > limit+64 {
		t.Fatalf("a response within the %d-byte limit is stored as %d bytes", limit, n)
	}
	replay := env.mustBegin("s", "k", idempotencyv1.Outcome_OUTCOME_REPLAY)
	if !proto.Equal(replay.GetRecord().GetResponse(), stored) {
		t.Fatal("the replayed response differs from the stored one")
	}
}

// TestWaitersDoNotReadOnHeartbeats holds a key while 20 Begins wait on it,
// heartbeats it twenty times, then completes it, and counts the database
// reads of Begin (the replay cache's misses: every Begin that is not a
// cached replay reads the database). Each waiter reads when it starts,
// perhaps once more when it learns the listener is up, and once after the
// Complete (a machine slow enough to delay the listener's pings may add a
// round of polling: one more); a Heartbeat changes nothing a waiter waits
// for, so it adds no read.
func TestWaitersDoNotReadOnHeartbeats(t *testing.T) {
	skipOnCitus(t, "there is no replay cache, whose misses count the reads here, and no change listener")
	t.Parallel()
	env := newEnv(t, envOptions{})
	store := env.coord.Store
	holder := env.mustBegin("s", "k", idempotencyv1.Outcome_OUTCOME_ACQUIRED, withLease(time.Hour))
	const waiters, heartbeats = 20, 20
	before := store.CacheStats().Misses
	answers := make(chan *idempotencyv1.BeginResponse, waiters)
	for range waiters {
		go func() {
			c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			resp, err := env.client.Begin(c, &idempotencyv1.BeginRequest{Scope: "s", Key: "k",
				Wait: durationpb.New(30 * time.Second)})
			if err != nil {
				t.Error(err)
			}
			answers <- resp
		}()
	}
	// Every waiter has read once and waits.
	for store.CacheStats().Misses-before < waiters {
		time.Sleep(10 * time.Millisecond)
	}
	for range heartbeats {
		if _, err := env.client.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "s", Key: "k",
			LeaseToken: holder.GetLeaseToken(), Lease: durationpb.New(time.Hour)}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := env.client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k",
		LeaseToken: holder.GetLeaseToken()}); err != nil {
		t.Fatal(err)
	}
	for range waiters {
		if resp := <-answers; resp.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY {
			t.Fatalf("a waiter was answered %v, want the replay", resp.GetOutcome())
		}
	}
	reads := store.CacheStats().Misses - before
	if reads > 4*waiters {
		t.Fatalf("%d waiters read the database %d times over %d Heartbeats, want at most %d", waiters, reads, heartbeats, 4*waiters)
	}
	t.Logf("%d waiters, %d Heartbeats: %d reads", waiters, heartbeats, reads)
}

// TestMaxConcurrentStreamsBoundsWaiters runs a coordinator that allows two
// calls in flight per connection: with two Begins waiting on a held key, a
// third call on the same connection waits for a slot (its deadline runs
// out) instead of adding to the load, while another connection has
// slots of its own.
func TestMaxConcurrentStreamsBoundsWaiters(t *testing.T) {
	skipOnCitus(t, "there is no replay cache, whose misses count the reads here, and no change listener")
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{ServerOptions: []server.Option{
		server.WithGRPCOptions(grpc.MaxConcurrentStreams(2))}})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	holder, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	before := c.Store.CacheStats().Misses
	answers := make(chan error, 2)
	for range 2 {
		go func() {
			_, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Wait: durationpb.New(15 * time.Second)})
			answers <- err
		}()
	}
	for c.Store.CacheStats().Misses-before < 2 {
		time.Sleep(10 * time.Millisecond)
	}
	short, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	_, err = client.Lookup(short, &idempotencyv1.LookupRequest{Scope: "s", Key: "k"})
	wantCode(t, err, codes.DeadlineExceeded, "")
	// Another connection has slots of its own.
	other := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	if _, err := other.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: holder.GetLeaseToken()}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-answers; err != nil {
			t.Fatal(err)
		}
	}
}

// TestWaiterOutlastsAnOutage: a Begin waits on a held key while the
// database stops. Waiters poll while the listener is down, and a poll
// that finds the database unreachable keeps waiting on what the last read
// found; when the database is back and the key completes, the waiter gets
// the replay, not UNAVAILABLE.
func TestWaiterOutlastsAnOutage(t *testing.T) {
	skipOnCitus(t, "there is no replay cache, whose misses count the reads here, and no change listener")
	t.Parallel()
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	url := cluster.URL("postgres")
	if err := ledger.Migrate(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: url})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	holder, err := client.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Lease: durationpb.New(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("never %s", what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// With the listener up, a new waiter reads, then reads once more at
	// once (the subscription's first wake-up): after two reads its first
	// one has finished.
	waitFor("listening", func() bool { return !c.Store.NotificationStats().Polling })
	before := c.Store.CacheStats().Misses
	answer := make(chan error, 1)
	go func() {
		w, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		resp, err := client.Begin(w, &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Wait: durationpb.New(30 * time.Second)})
		if err == nil && resp.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY {
			err = fmt.Errorf("outcome %v, want the replay", resp.GetOutcome())
		}
		answer <- err
	}()
	waitFor("waiting", func() bool { return c.Store.CacheStats().Misses >= before+2 })
	if err := cluster.Stop(); err != nil {
		t.Fatal(err)
	}
	// The waiter re-reads (polls) at least twice while the database is down.
	down := c.Store.CacheStats().Misses
	waitFor("polled during the outage", func() bool {
		select {
		case err := <-answer:
			t.Fatalf("the waiter answered during the outage: %v", err)
		default:
		}
		return c.Store.CacheStats().Misses >= down+2
	})
	if err := cluster.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor("back", func() bool { return c.Server.Ready() })
	if _, err := client.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: holder.GetLeaseToken()}); err != nil {
		t.Fatal(err)
	}
	if err := <-answer; err != nil {
		t.Fatalf("the waiter: %v", err)
	}
}

// TestStoredLimitsFitOneMessage refuses limits under which a record's
// answer (its response and its checkpoint) could not travel in one gRPC
// message, naming both limits, and accepts the largest that fit.
func TestStoredLimitsFitOneMessage(t *testing.T) {
	t.Parallel()
	for _, cfg := range []string{
		"limits: {max_checkpoint_bytes: 8388608}",
		"limits: {max_response_bytes: 4194304}",
		"limits: {max_response_bytes: 3145728, max_checkpoint_bytes: 1048576}",
	} {
		_, err := server.ParsePolicies([]byte(cfg))
		if err == nil || !strings.Contains(err.Error(), "max_response_bytes") || !strings.Contains(err.Error(), "max_checkpoint_bytes") {
			t.Errorf("config %q: %v, want it refused naming max_response_bytes and max_checkpoint_bytes", cfg, err)
		}
	}
	if _, err := server.ParsePolicies([]byte("limits: {max_response_bytes: 3145728, max_checkpoint_bytes: 983040}")); err != nil {
		t.Errorf("limits that fit one message with room to spare: %v", err)
	}
}
