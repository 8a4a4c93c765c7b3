package server_test

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"sync/atomic"
	"testing"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// benchCoordinator starts a coordinator that logs at info level, as the
// binary does by default, into a discarding text handler.
func benchCoordinator(b *testing.B) idempotencyv1.CoordinatorClient {
	b.Helper()
	logger := slog.New(slog.NewTextHandler(discard{}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	c := coordtest.Start(b, coordtest.Options{ServerOptions: []server.Option{server.WithLogger(logger)}})
	return idempotencyv1.NewCoordinatorClient(c.Dial(b))
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// BenchmarkReplay is a Begin that replays a COMPLETED record from the
// replay cache: the server's own path (gRPC, interceptors, validation,
// metrics, conversion) with no database round trip. Run with -benchmem
// (and -memprofile) to see the allocations per call:
// go test -run '^$' -bench Replay -benchmem ./server
func BenchmarkReplay(b *testing.B) {
	client := benchCoordinator(b)
	ctx := context.Background()
	const keys = 64
	for i := range keys {
		key := fmt.Sprintf("k%d", i)
		r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "bench", Key: key})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "bench", Key: key, LeaseToken: r.GetLeaseToken(),
			Response: &idempotencyv1.StoredResponse{Body: make([]byte, 150)}}); err != nil {
			b.Fatal(err)
		}
	}
	var n atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := n.Add(1)
			r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "bench", Key: fmt.Sprintf("k%d", i%keys)})
			if err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY {
				b.Fatalf("Begin: %v, outcome %v", err, r.GetOutcome())
			}
		}
	})
}

// BenchmarkPair is a Begin on a new key and its Complete, from parallel
// callers: go test -run '^$' -bench Pair -benchmem ./server
func BenchmarkPair(b *testing.B) {
	client := benchCoordinator(b)
	ctx := context.Background()
	var n atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			key := fmt.Sprintf("p%d", n.Add(1))
			r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "bench", Key: key})
			if err != nil {
				b.Fatal(err)
			}
			if _, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "bench", Key: key, LeaseToken: r.GetLeaseToken(),
				Response: &idempotencyv1.StoredResponse{Body: make([]byte, 150)}}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkPairAt64 is BenchmarkPair from 64 concurrent callers (32 per
// CPU on two), where concurrent calls share statements and commits, as in
// make bench's 64-caller row through the generated stub. Profile the
// coordinator's side with GOGC=400 (the binary's default):
// GOGC=400 go test -run '^$' -bench PairAt64 -cpuprofile cpu.out ./server
func BenchmarkPairAt64(b *testing.B) {
	b.SetParallelism(64 / max(1, runtime.GOMAXPROCS(0)))
	BenchmarkPair(b)
}
