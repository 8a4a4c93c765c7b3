package ledger_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// The ledger's hot paths, against the real PostgreSQL that pgtest gives
// tests:
//
//	go test -run '^$' -bench . -benchmem ./ledger
//	go test -run '^$' -bench BeginNewKey -cpuprofile cpu.out ./ledger && go tool pprof -top ledger.test cpu.out
//
// pgtest's cluster runs with fsync off (on /dev/shm when it can), so these
// figures are the ledger's own cost and its round trips, without the
// durable commit; `make bench` measures the whole coordinator against a
// durable server. Each benchmark has a serial form (one caller: the
// latency of a call) and a parallel one (GOMAXPROCS callers).

var benchResponse = &statemachine.Response{SchemaVersion: "bench.v1.Response/1",
	ContentType: "application/x-protobuf", Body: make([]byte, 100)}

// benchKeys hands out keys unique within the test binary.
var benchKeys atomic.Int64

func benchKey() string { return fmt.Sprintf("bench-%d", benchKeys.Add(1)) }

func benchStore(b *testing.B) *ledger.Store {
	b.Helper()
	s, err := ledger.Open(context.Background(), pgtest.NewDatabase(b))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(s.Close)
	return s
}

func benchBegin(s *ledger.Store, key string) (*ledger.Result, error) {
	return s.Begin(context.Background(), &ledger.BeginParams{
		ID: ledger.Identity{Tenant: "default", Scope: "bench", Key: key},
		Event: statemachine.Event{Fingerprint: []byte("0123456789abcdef0123456789abcdef"),
			TTL: 24 * time.Hour, FailureTTL: time.Hour, Lease: 30 * time.Second},
	})
}

func benchComplete(s *ledger.Store, key, token string) error {
	_, err := s.Finish(context.Background(), &ledger.FinishParams{
		ID:    ledger.Identity{Tenant: "default", Scope: "bench", Key: key},
		Event: statemachine.Event{Kind: statemachine.EventComplete, Token: token, Response: benchResponse},
	})
	return err
}

// acquire begins a new key and returns its lease token.
func acquire(s *ledger.Store, key string) (string, error) {
	res, err := benchBegin(s, key)
	if err != nil {
		return "", err
	}
	if res.Outcome != statemachine.OutcomeAcquired {
		return "", fmt.Errorf("Begin on new key %s: outcome %v", key, res.Outcome)
	}
	return res.Record.LeaseToken, nil
}

// runBoth runs op, which does one operation, as a serial and as a
// parallel sub-benchmark.
func runBoth(b *testing.B, op func() error) {
	b.Run("serial", func(b *testing.B) {
		for b.Loop() {
			if err := op(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := op(); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}

// BenchmarkBeginNewKey is a Begin that creates its record: one INSERT … ON
// CONFLICT DO NOTHING round trip.
func BenchmarkBeginNewKey(b *testing.B) {
	s := benchStore(b)
	runBoth(b, func() error {
		_, err := acquire(s, benchKey())
		return err
	})
}

// BenchmarkBeginReplay is a Begin on a COMPLETED key: it answers with the
// stored response.
func BenchmarkBeginReplay(b *testing.B) {
	s := benchStore(b)
	const keys = 64
	for i := range keys {
		key := fmt.Sprintf("replay-%d", i)
		token, err := acquire(s, key)
		if err == nil {
			err = benchComplete(s, key, token)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	var next atomic.Int64
	runBoth(b, func() error {
		res, err := benchBegin(s, fmt.Sprintf("replay-%d", next.Add(1)%keys))
		if err == nil && res.Outcome != statemachine.OutcomeReplay {
			err = fmt.Errorf("Begin on a completed key: outcome %v", res.Outcome)
		}
		return err
	})
}

// BenchmarkComplete is a Complete of an IN_PROGRESS record: a transaction
// that locks the row, decides and updates it. The Begin of each key runs
// outside the timer.
func BenchmarkComplete(b *testing.B) {
	s := benchStore(b)
	for b.Loop() {
		b.StopTimer()
		key := benchKey()
		token, err := acquire(s, key)
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if err := benchComplete(s, key, token); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPair is what a caller's idempotent call costs the ledger: a
// Begin on a new key, then its Complete.
func BenchmarkPair(b *testing.B) {
	s := benchStore(b)
	runBoth(b, func() error {
		key := benchKey()
		token, err := acquire(s, key)
		if err != nil {
			return err
		}
		return benchComplete(s, key, token)
	})
}
