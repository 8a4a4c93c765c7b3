package main

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
)

func TestMain(m *testing.M) {
	os.Exit(pgtest.Main(m, ledger.Migrate))
}

func buildBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "idemcoord")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestServeAndGracefulShutdown runs the real binary: it migrates a fresh
// database, serves health, the API and /readyz, keeps a completed record
// across a restart, and exits 0 on SIGTERM.
func TestServeAndGracefulShutdown(t *testing.T) {
	bin := buildBinary(t)
	dbURL := pgtest.NewDatabase(t)
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)

	start := func() (*exec.Cmd, *bytes.Buffer) {
		cmd := exec.Command(bin, "--listen", grpcAddr, "--http-listen", httpAddr)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL)
		var logs bytes.Buffer
		cmd.Stdout, cmd.Stderr = &logs, &logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill() })
		return cmd, &logs
	}
	stop := func(cmd *exec.Cmd, logs *bytes.Buffer) {
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("exit after SIGTERM: %v\n%s", err, logs)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("no exit 30s after SIGTERM\n%s", logs)
		}
	}

	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := idempotencyv1.NewCoordinatorClient(conn)
	waitServing := func(logs *bytes.Buffer) {
		t.Helper()
		h := healthpb.NewHealthClient(conn)
		deadline := time.Now().Add(60 * time.Second)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			r, err := h.Check(ctx, &healthpb.HealthCheckRequest{})
			cancel()
			if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("not serving after 60s: %v\n%s", err, logs)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	cmd, logs := start()
	waitServing(logs)
	resp, err := http.Get("http://" + httpAddr + "/readyz")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/readyz: %v %v", resp, err)
	}
	resp.Body.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	body := []byte("result " + strconv.Itoa(os.Getpid()))
	if _, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "build", Key: "k", LeaseToken: b.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: body}}); err != nil {
		t.Fatal(err)
	}
	stop(cmd, logs)

	cmd, logs = start()
	waitServing(logs)
	r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || !bytes.Equal(r.GetRecord().GetResponse().GetBody(), body) {
		t.Fatalf("after restart: %v, %v", r, err)
	}
	stop(cmd, logs)
}

func TestRefusesNonLoopbackWithoutAuth(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("IDEMCOORD_INSECURE_ALLOW_NO_AUTH", "")
	_, err := parseFlags([]string{"--database-url", "postgres://x", "--listen", "0.0.0.0:50051"})
	if err == nil || !strings.Contains(err.Error(), "--insecure-allow-no-auth") {
		t.Fatalf("err = %v", err)
	}
	if _, err := parseFlags([]string{"--database-url", "postgres://x", "--listen", "0.0.0.0:50051", "--insecure-allow-no-auth"}); err != nil {
		t.Fatal(err)
	}
	for _, addr := range []string{"127.0.0.1:1", "[::1]:1", "localhost:1"} {
		if _, err := parseFlags([]string{"--database-url", "postgres://x", "--listen", addr}); err != nil {
			t.Fatalf("%s: %v", addr, err)
		}
	}
	if _, err := parseFlags([]string{"--listen", "127.0.0.1:1"}); err == nil {
		t.Fatal("no database URL accepted")
	}
}
