// Command projects-demo serves the demo ProjectsService with idempotency
// through a running idemcoord coordinator:
//
//	projects-demo --listen 127.0.0.1:50061 --coordinator 127.0.0.1:50051
//
// It stops on SIGINT or SIGTERM, after finishing the calls in flight and
// the idempotency work they left in the background.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/examples/projects"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "projects-demo:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := flag.String("listen", "127.0.0.1:50061", "address to serve the demo on")
	coordinator := flag.String("coordinator", envOr("IDEMCOORD_ADDR", "127.0.0.1:50051"), "idemcoord address [IDEMCOORD_ADDR]")
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
	srv := projects.NewGRPCServer(idem, projects.NewService())
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		srv.GracefulStop()
	}()
	logger.Info("serving projects.v1.ProjectsService", "addr", lis.Addr().String(), "coordinator", *coordinator)
	if err := srv.Serve(lis); err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return idem.Shutdown(sctx)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
