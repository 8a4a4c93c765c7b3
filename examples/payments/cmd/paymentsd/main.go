// Command paymentsd runs the payments demo (package
// github.com/idemcoord/idemcoord/examples/payments): POST /charges on
// -listen, and the River worker that sends receipts, over the PostgreSQL
// database at DATABASE_URL, which it migrates at start-up.
//
//	DATABASE_URL=postgres://localhost/payments go run ./examples/payments/cmd/paymentsd -listen 127.0.0.1:8080
//	curl -i -X POST localhost:8080/charges -H 'Idempotency-Key: order-1' -d '{"customer":"ada","amount_cents":1250}'
//
// It prints "listening on ADDR" once it serves.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/idemcoord/idemcoord/examples/payments"
	"github.com/idemcoord/idemcoord/ledger"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "paymentsd:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := flag.String("listen", "127.0.0.1:8080", "HTTP listen address")
	rescueAfter := flag.Duration("rescue-after", time.Hour, "how long a receipt job may run before River takes it as stuck (its worker died) and retries it")
	pause := flag.Duration("chaos-pause", 0, "for fault tests: sleep up to this long inside each transaction, after its writes and before its commit")
	flag.Parse()
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		return errors.New("set DATABASE_URL")
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	if err := payments.Migrate(ctx, dbURL); err != nil {
		return err
	}
	// The idempotency records live in the service's own database.
	store, err := ledger.Open(ctx, dbURL, ledger.WithLogger(logger))
	if err != nil {
		return err
	}
	defer store.Close()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()

	var pauseFn func()
	if *pause > 0 {
		pauseFn = func() { time.Sleep(rand.N(*pause)) } //nolint:gosec // a demo's random pause, not a secret
	}
	riverClient, err := river.NewClient(riverpgxv5.New(pool), payments.RiverConfig(store, *rescueAfter, pauseFn, logger))
	if err != nil {
		return err
	}
	if err := riverClient.Start(ctx); err != nil {
		return err
	}
	svc := &payments.Service{Store: store, River: riverClient, Logger: logger, Pause: pauseFn}

	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: svc, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	fmt.Println("listening on", lis.Addr())
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdown)
	return riverClient.Stop(shutdown)
}
