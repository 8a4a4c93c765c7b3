package chaos

import (
	"context"
	"log/slog"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/internal/coordtest"
)

func TestMain(m *testing.M) {
	os.Exit(coordtest.Main(m))
}

// long reports whether the long fault runs are asked for
// (IDEMCOORD_CHAOS=long, as `make chaos` sets).
func long() bool { return os.Getenv("IDEMCOORD_CHAOS") == "long" }

// byMode returns short in the default run and long under IDEMCOORD_CHAOS=long.
func byMode[T any](short, longV T) T {
	if long() {
		return longV
	}
	return short
}

// seed returns IDEMCOORD_CHAOS_SEED when set, else a fresh seed, and logs
// it so that a failing run's random choices can be repeated (timing still
// varies from run to run).
func seed(t *testing.T) uint64 {
	t.Helper()
	s := uint64(time.Now().UnixNano())
	if v := os.Getenv("IDEMCOORD_CHAOS_SEED"); v != "" {
		var err error
		if s, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("IDEMCOORD_CHAOS_SEED=%q: %v", v, err)
		}
	}
	t.Logf("chaos: seed %d (repeat with IDEMCOORD_CHAOS_SEED=%d)", s, s)
	return s
}

// dial connects to a coordinator and reconnects quickly after it comes
// back: the default backoff would wait seconds after a restart.
func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 200 * time.Millisecond},
			MinConnectTimeout: time.Second,
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// errorLogger passes only ERROR records (an INTERNAL answer, a panic) of an
// in-process coordinator to the test log; the WARN record of every call
// failing during an outage would drown them.
func errorLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelError}))
}

type testLog struct{ t *testing.T }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Logf("coordinator: %s", p)
	return len(p), nil
}

// sqlConn connects to the database directly (not through a proxy), for
// checks of the stored rows.
func sqlConn(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect to %s: %v", url, err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// lastWords registers a cleanup that, when t has failed, logs what()
// once more. Registered before a test starts its clusters, it runs after
// their cleanups, which log the end of each server log: the end of the
// output, all that an excerpt of a CI log shows, then says what failed.
func lastWords(t *testing.T, what func() string) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("chaos: %s FAILED %s", t.Name(), what())
		}
	})
}
