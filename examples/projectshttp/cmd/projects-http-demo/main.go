// Command projects-http-demo serves the demo HTTP API (examples/projectshttp)
// with idempotency through a running idemcoord coordinator:
//
//	projects-http-demo --listen 127.0.0.1:8080 --coordinator 127.0.0.1:50051
//
// It stops on SIGINT or SIGTERM, after finishing the requests in flight and
// the idempotency work they left in the background.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/examples/projectshttp"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "projects-http-demo:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := flag.String("listen", "127.0.0.1:8080", "address to serve the demo on")
	coordinator := flag.String("coordinator", envOr("IDEMCOORD_ADDR", "127.0.0.1:50051"), "idemcoord gRPC address [IDEMCOORD_ADDR]")
	token := flag.String("token", os.Getenv("IDEMCOORD_TOKEN"), "bearer token for a coordinator with auth on [IDEMCOORD_TOKEN]")
	flag.Parse()
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))

	conn, err := grpc.NewClient(*coordinator, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	idem := clients.New(conn, clients.WithLogger(logger), clients.WithToken(*token))

	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: projectshttp.NewHandler(idem, projectshttp.NewStore()), ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger.Info("serving the demo HTTP API", "addr", lis.Addr().String(), "coordinator", *coordinator)
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(lis) }()
	select {
	case err := <-serveErr:
		return err
	case <-ctx.Done():
	}
	// Finish the requests in flight, then the Complete/Fail calls they
	// left to retry in the background.
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return errors.Join(srv.Shutdown(sctx), idem.Shutdown(sctx))
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
