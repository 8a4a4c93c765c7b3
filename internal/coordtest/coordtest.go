// Package coordtest starts a real idemcoord coordinator for tests: the
// gRPC server on a loopback port over a fresh PostgreSQL database from
// internal/pgtest, optionally with a clock the test moves by hand.
//
// A test binary that uses it calls Main from its TestMain.
package coordtest

import (
	"context"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// Main runs the tests of a package that starts coordinators; use it as
// `func TestMain(m *testing.M) { os.Exit(coordtest.Main(m)) }`.
func Main(m *testing.M) int { return pgtest.Main(m, ledger.Migrate) }

// Clock is a clock the test moves by hand.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock returns a clock set to a fixed instant.
func NewClock() *Clock { return &Clock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock forward by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// Options configure a Coordinator.
type Options struct {
	// Config is the YAML policy file's content (empty: defaults).
	Config string
	// FakeClock makes the coordinator take "now" from Coordinator.Clock
	// instead of the database's clock.
	FakeClock bool
	// DatabaseURL is a migrated database to use instead of a fresh one.
	DatabaseURL string
	// ServerOptions are passed to server.New after the defaults.
	ServerOptions []server.Option
	// StoreOptions are passed to ledger.Open after the defaults.
	StoreOptions []ledger.Option
}

// PgBouncerEnv names the environment variable that runs every coordinator
// a test starts through a PgBouncer in transaction pooling mode
// (pgtest.StartPgBouncer): "listen" keeps the LISTEN connection direct
// (ledger.WithNotifyDatabaseURL), "poll" turns notifications off
// (ledger.WithoutNotifications). Tests still read and write the database
// directly (Coordinator.DatabaseURL).
const PgBouncerEnv = "IDEMCOORD_TEST_PGBOUNCER"

// Coordinator is a running coordinator.
type Coordinator struct {
	// Addr is the gRPC address (host:port on 127.0.0.1).
	Addr string
	// DatabaseURL is its database.
	DatabaseURL string
	// storeURL is the URL the store connects to: DatabaseURL, or a
	// PgBouncer in front of it (PgBouncerEnv).
	storeURL  string
	storeOpts []ledger.Option
	// Clock is the clock it reads when Options.FakeClock is set.
	Clock *Clock
	// Server and Store are the running parts, nil while stopped.
	Server *server.Server
	Store  *ledger.Store

	t    testing.TB
	opts Options
}

// Start starts a coordinator and stops it when the test ends.
func Start(t testing.TB, opts Options) *Coordinator {
	t.Helper()
	c := &Coordinator{t: t, opts: opts, Clock: NewClock(), DatabaseURL: opts.DatabaseURL}
	if c.DatabaseURL == "" {
		c.DatabaseURL = pgtest.NewDatabase(t)
	}
	c.storeURL = c.DatabaseURL
	switch mode := os.Getenv(PgBouncerEnv); mode {
	case "":
	case "listen", "poll":
		c.storeURL = pgtest.StartPgBouncer(t, c.DatabaseURL)
		if mode == "listen" {
			c.storeOpts = append(c.storeOpts, ledger.WithNotifyDatabaseURL(c.DatabaseURL))
		} else {
			c.storeOpts = append(c.storeOpts, ledger.WithoutNotifications())
		}
	default:
		t.Fatalf("%s=%q: want listen or poll", PgBouncerEnv, mode)
	}
	c.start("127.0.0.1:0")
	t.Cleanup(c.Stop)
	return c
}

func (c *Coordinator) start(addr string) {
	t := c.t
	t.Helper()
	policies := server.DefaultPolicies()
	if c.opts.Config != "" {
		var err error
		if policies, err = server.ParsePolicies([]byte(c.opts.Config)); err != nil {
			t.Fatal(err)
		}
	}
	var sopts []ledger.Option
	if c.opts.FakeClock {
		sopts = append(sopts, ledger.WithClock(c.Clock.Now))
	}
	if k := policies.Keyring(); k != nil {
		sopts = append(sopts, ledger.WithKeyring(k))
	}
	sopts = append(append(sopts, c.storeOpts...), c.opts.StoreOptions...)
	store, err := ledger.Open(context.Background(), c.storeURL, sopts...)
	if err != nil {
		t.Fatal(err)
	}
	logger := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	srvOpts := append([]server.Option{server.WithPolicies(policies), server.WithLogger(logger),
		server.WithHealthInterval(100 * time.Millisecond)}, c.opts.ServerOptions...)
	srv, err := server.New(store, srvOpts...)
	if err != nil {
		t.Fatal(err)
	}
	var lis net.Listener
	for range 50 { // the old port may linger briefly after a restart
		if lis, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	c.Addr, c.Server, c.Store = lis.Addr().String(), srv, store
}

// Stop shuts the coordinator down gracefully. Stopping twice is harmless.
func (c *Coordinator) Stop() {
	if c.Server == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c.Server.Shutdown(ctx)
	c.Store.Close()
	c.Server, c.Store = nil, nil
}

// Restart starts the coordinator again on the same address and database.
func (c *Coordinator) Restart() {
	c.t.Helper()
	c.Stop()
	c.start(c.Addr)
}

// RestartWithConfig restarts the coordinator with another config (for
// instance a rotated encryption key).
func (c *Coordinator) RestartWithConfig(config string) {
	c.t.Helper()
	c.Stop()
	c.opts.Config = config
	c.start(c.Addr)
}

// Dial returns a client connection to the coordinator, closed when the test
// ends. It keeps working across Stop and Restart.
func (c *Coordinator) Dial(t testing.TB) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}
