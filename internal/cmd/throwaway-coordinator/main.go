// Command throwaway-coordinator runs a throwaway idemcoord coordinator for the test
// suites of the Node and Python client libraries (clients/node,
// clients/python), which start it when IDEMCOORD_ADDR is not set:
//
//	go run ./internal/cmd/throwaway-coordinator
//
// It starts a fresh PostgreSQL cluster (internal/pgtest, fsync off), builds
// the coordinator binary from cmd/idemcoord (or runs the one -bin names)
// with auth on for one tenant whose random token it makes, and once the
// coordinator is ready prints one JSON line on stdout:
//
//	{"addr":"127.0.0.1:PORT","token":"..."}
//
// It stops the coordinator and deletes the cluster when its standard input
// closes (the test process exited) or on SIGINT or SIGTERM. If it is killed,
// pgtest's watchdog deletes the cluster.
package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/internal/pgtest"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdin, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "throwaway-coordinator:", err)
		os.Exit(1)
	}
}

// run serves until stdin closes or ctx ends, having written the JSON line
// to stdout.
func run(ctx context.Context, args []string, stdin io.Reader, stdout io.Writer) error {
	fs := flag.NewFlagSet("throwaway-coordinator", flag.ContinueOnError)
	bin := fs.String("bin", "", "coordinator binary (default: build cmd/idemcoord)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "idemcoord-throwaway-coordinator-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	if *bin == "" {
		*bin = filepath.Join(dir, "idemcoord")
		build := exec.CommandContext(ctx, "go", "build", "-o", *bin, "github.com/idemcoord/idemcoord/cmd/idemcoord")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("go build: %w", err)
		}
	}

	cluster, err := pgtest.Launch(pgtest.ClusterOptions{})
	if err != nil {
		return err
	}
	defer cluster.Close()
	if err := createDatabase(ctx, cluster.URL("postgres")); err != nil {
		return err
	}

	var raw [24]byte
	_, _ = rand.Read(raw[:])
	token := hex.EncodeToString(raw[:])
	sum := sha256.Sum256([]byte(token))
	config := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(config, []byte("tenants:\n  - name: clients-test\n    token_sha256: "+
		hex.EncodeToString(sum[:])+"\n    scopes: [\"*\"]\n"), 0o600); err != nil {
		return err
	}

	addr, httpAddr := freeAddr(), freeAddr()
	cmd := exec.Command(*bin, "--listen", addr, "--http-listen", httpAddr,
		"--database-url", cluster.URL("idemcoord"), "--config", config, "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited: //nolint:errcheck // after SIGTERM the exit status is an error by design
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited //nolint:errcheck // killed: the exit status is an error by design
		}
	}()
	if err := waitReady(ctx, httpAddr, exited); err != nil {
		return err
	}
	line, _ := json.Marshal(map[string]string{"addr": addr, "token": token})
	if _, err := fmt.Fprintln(stdout, string(line)); err != nil {
		return err
	}

	stdinClosed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		close(stdinClosed)
	}()
	select {
	case <-ctx.Done():
	case <-stdinClosed:
	case err := <-exited:
		exited <- err
		return fmt.Errorf("the coordinator exited: %v", err)
	}
	return nil
}

func createDatabase(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, "CREATE DATABASE idemcoord")
	return err
}

func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// waitReady polls /readyz until the coordinator answers 200.
func waitReady(ctx context.Context, httpAddr string, exited chan error) error {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		resp, err := http.Get("http://" + httpAddr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-exited:
			exited <- err
			return fmt.Errorf("the coordinator exited before it was ready: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	return errors.New("the coordinator was not ready within 2 minutes")
}
