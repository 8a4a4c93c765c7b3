package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
)

// BenchmarkCitusCPUPerPair runs Begin/Complete pairs of new keys through an
// in-process coordinator for a few seconds at 64 and at 256 callers, once
// on a single durable PostgreSQL (with batching, and without, as on
// Citus) and once on a durable Citus cluster (a coordinator node and two
// workers), and reports each server's CPU
// seconds per 1000 pairs (its postmaster and children, from /proc) and
// the pairs per second; then the same for replays of 1024 COMPLETED keys.
// A figure, not a check; the machine's other load
// moves it:
//
//	IDEMCOORD_TEST_CITUS=1 go test -run '^$' -bench BenchmarkCitusCPUPerPair -benchtime 1x ./bench/
func BenchmarkCitusCPUPerPair(b *testing.B) {
	pgtest.RequireCitus(b)
	ctx := context.Background()
	pg := pgtest.StartCluster(b, pgtest.ClusterOptions{Durable: true})
	pgURL := pg.URL("postgres")
	cc := pgtest.StartCitusCluster(b, pgtest.ClusterOptions{Durable: true})
	if err := cc.CreateDatabase(ctx, "idemcoord"); err != nil {
		b.Fatal(err)
	}
	citusURL := cc.URL("idemcoord")
	for _, u := range []string{pgURL, citusURL} {
		if err := ledger.Migrate(ctx, u); err != nil {
			b.Fatal(err)
		}
	}
	type node struct {
		name string
		pid  func() int
	}
	setups := []struct {
		name  string
		url   string
		opts  []ledger.Option
		nodes []node
	}{
		{"postgres", pgURL, nil, []node{{"postgres", pg.PostmasterPID}}},
		// Without batching, as on Citus: what batching saves.
		{"postgres-unbatched", pgURL, []ledger.Option{ledger.WithoutBatching()}, []node{{"postgres", pg.PostmasterPID}}},
		{"citus", citusURL, nil, []node{{"coordinator-node", cc.Coordinator.PostmasterPID},
			{"worker1", cc.Workers[0].PostmasterPID}, {"worker2", cc.Workers[1].PostmasterPID}}},
	}
	const cell = 4 * time.Second
	for _, st := range setups {
		c := coordtest.Start(b, coordtest.Options{DatabaseURL: st.url, StoreOptions: st.opts})
		conn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		client := idempotencyv1.NewCoordinatorClient(conn)
		for _, callers := range []int{64, 256} {
			b.Run(fmt.Sprintf("%s/callers=%d", st.name, callers), func(b *testing.B) {
				runPairs(b, client, callers, time.Second, fmt.Sprint(st.name, callers, "w")) // warm-up
				before := make([]float64, len(st.nodes))
				for i, n := range st.nodes {
					before[i] = treeCPU(n.pid())
				}
				start := time.Now()
				pairs := runPairs(b, client, callers, cell, fmt.Sprint(st.name, callers))
				took := time.Since(start)
				b.ReportMetric(float64(pairs)/took.Seconds(), "pairs/s")
				for i, n := range st.nodes {
					cpu := treeCPU(n.pid()) - before[i]
					b.ReportMetric(cpu/float64(pairs)*1000, n.name+"-cpu-s/1000pairs")
				}
			})
		}
		// Replays of COMPLETED keys (the replay cache answers them once
		// notifications are trusted on every node).
		keys := make([]string, 1024)
		for i := range keys {
			keys[i] = fmt.Sprintf("replay-%s-%d", st.name, i)
			r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "bench", Key: keys[i], Lease: durationpb.New(time.Minute)})
			if err == nil {
				_, err = client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "bench", Key: keys[i], LeaseToken: r.GetLeaseToken(),
					Response: &idempotencyv1.StoredResponse{Body: []byte("ok")}})
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		for _, callers := range []int{64, 256} {
			b.Run(fmt.Sprintf("%s/replays/callers=%d", st.name, callers), func(b *testing.B) {
				runReplays(b, client, callers, time.Second, keys) // warm-up
				before := make([]float64, len(st.nodes))
				for i, n := range st.nodes {
					before[i] = treeCPU(n.pid())
				}
				start := time.Now()
				replays := runReplays(b, client, callers, cell, keys)
				took := time.Since(start)
				b.ReportMetric(float64(replays)/took.Seconds(), "replays/s")
				for i, n := range st.nodes {
					cpu := treeCPU(n.pid()) - before[i]
					b.ReportMetric(cpu/float64(replays)*1000, n.name+"-cpu-s/1000replays")
				}
			})
		}
		_ = conn.Close()
		c.Stop()
	}
}

// runPairs runs Begin then Complete of new keys from callers goroutines
// for d and returns how many pairs completed.
func runPairs(b *testing.B, client idempotencyv1.CoordinatorClient, callers int, d time.Duration, prefix string) int64 {
	var done atomic.Int64
	var failed atomic.Value
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	for w := range callers {
		wg.Go(func() {
			for i := 0; time.Now().Before(deadline); i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				key := fmt.Sprintf("%s-%d-%d", prefix, w, i)
				r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "bench", Key: key, Lease: durationpb.New(time.Minute)})
				if err == nil {
					_, err = client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "bench", Key: key, LeaseToken: r.GetLeaseToken(),
						Response: &idempotencyv1.StoredResponse{Body: []byte("ok")}})
				}
				cancel()
				if err != nil {
					failed.Store(err)
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	if err, ok := failed.Load().(error); ok {
		b.Fatalf("a pair failed: %v", err)
	}
	return done.Load()
}

// runReplays Begins keys (COMPLETED) from callers goroutines for d, each
// answer a replay, and returns how many there were.
func runReplays(b *testing.B, client idempotencyv1.CoordinatorClient, callers int, d time.Duration, keys []string) int64 {
	var done atomic.Int64
	var failed atomic.Value
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	for w := range callers {
		wg.Go(func() {
			for i := w; time.Now().Before(deadline); i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "bench", Key: keys[i%len(keys)], Lease: durationpb.New(time.Minute)})
				cancel()
				if err == nil && r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY {
					err = fmt.Errorf("Begin of a COMPLETED key answered %v", r.GetOutcome())
				}
				if err != nil {
					failed.Store(err)
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	if err, ok := failed.Load().(error); ok {
		b.Fatalf("a replay failed: %v", err)
	}
	return done.Load()
}
