// Command provisiond runs the provisioning demo (package
// github.com/idemcoord/idemcoord/examples/provisioning): POST /orders on
// -listen, guarded by the coordinator at -coordinator, calling the
// upstreams at -upstream (cmd/fakeupstreams serves fake ones).
//
//	go run ./examples/provisioning/cmd/fakeupstreams -listen 127.0.0.1:8081 &
//	go run ./examples/provisioning/cmd/provisiond -listen 127.0.0.1:8080 -coordinator 127.0.0.1:50051 -upstream http://127.0.0.1:8081
//	curl -i -X POST localhost:8080/orders -H 'Idempotency-Key: order-1'
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

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/examples/provisioning"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "provisiond:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := flag.String("listen", "127.0.0.1:8080", "HTTP listen address")
	coordinator := flag.String("coordinator", "127.0.0.1:50051", "the idemcoord coordinator's gRPC address (plaintext)")
	upstream := flag.String("upstream", "http://127.0.0.1:8081", "base URL of the upstreams")
	lease := flag.Duration("lease", 0, "the lease each attempt asks for (0: the coordinator's policy); a crashed attempt's key is taken over once it lapses")
	without := flag.Bool("without-checkpoints", false, "record no checkpoints: after a crash start again from the first step")
	pause := flag.Duration("chaos-pause", 0, "for fault tests: sleep up to this long before and after each upstream call")
	flag.Parse()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	conn, err := grpc.NewClient(*coordinator, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	copts := []clients.Option{clients.WithLogger(logger)}
	if *lease > 0 {
		copts = append(copts, clients.WithLease(*lease))
	}
	idem := clients.New(conn, copts...)
	o := provisioning.Options{WithoutCheckpoints: *without, Logger: logger}
	if *pause > 0 {
		o.Pause = func() { time.Sleep(rand.N(*pause)) } //nolint:gosec // a demo's random pause, not a secret
	}
	srv := &http.Server{
		Handler:           provisioning.Handler(idem, provisioning.Upstream{Base: *upstream, Client: &http.Client{Timeout: 10 * time.Second}}, o),
		ReadHeaderTimeout: 10 * time.Second,
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	fmt.Println("listening on", ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return idem.Shutdown(sctx)
}
