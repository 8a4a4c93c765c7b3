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
// A line "stop" on its standard input stops the coordinator (SIGTERM, as
// an operator's restart does) and prints {"state":"stopped"}; a line
// "start" starts it again on the same address and database and, once it is
// ready, prints {"state":"serving"}: how the client suites test a
// coordinator restart.
//
// It stops the coordinator and deletes the cluster when its standard input
// closes (the test process exited) or on SIGINT or SIGTERM. If it is killed,
// pgtest's watchdog deletes the cluster.
package main

import (
	"bufio"
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
	"strings"
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

	c := &coordinator{bin: *bin, addr: freeAddr(), httpAddr: freeAddr(),
		args: []string{"--database-url", cluster.URL("idemcoord"), "--config", config, "--log-level", "warn"}}
	if err := c.start(ctx); err != nil {
		return err
	}
	defer c.stop()
	line, _ := json.Marshal(map[string]string{"addr": c.addr, "token": token})
	if _, err := fmt.Fprintln(stdout, string(line)); err != nil {
		return err
	}

	commands, done := make(chan string), make(chan struct{})
	defer close(done)
	go func() {
		defer close(commands)
		lines := bufio.NewScanner(stdin)
		for lines.Scan() {
			select {
			case commands <- strings.TrimSpace(lines.Text()):
			case <-done:
				return
			}
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case cmd, ok := <-commands:
			if !ok {
				return nil
			}
			if err := c.command(ctx, cmd, stdout); err != nil {
				return err
			}
		case err := <-c.exited:
			c.cmd, c.exited = nil, nil
			return fmt.Errorf("the coordinator exited: %v", err)
		}
	}
}

// coordinator is the coordinator process, started and stopped on the same
// addresses and database.
type coordinator struct {
	bin, addr, httpAddr string
	args                []string
	cmd                 *exec.Cmd
	exited              chan error // receives once when the running process exits; nil while stopped
}

func (c *coordinator) start(ctx context.Context) error {
	cmd := exec.Command(c.bin, append([]string{"--listen", c.addr, "--http-listen", c.httpAddr}, c.args...)...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	c.cmd, c.exited = cmd, exited
	if err := waitReady(ctx, c.httpAddr, exited); err != nil {
		c.stop()
		return err
	}
	return nil
}

// stop ends the running process (SIGTERM, then SIGKILL after 30 s), if any.
func (c *coordinator) stop() {
	if c.cmd == nil {
		return
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.exited: //nolint:errcheck // after SIGTERM the exit status is an error by design
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.exited //nolint:errcheck // killed: the exit status is an error by design
	}
	c.cmd, c.exited = nil, nil
}

// command carries out one line of stdin ("stop" or "start") and says so on stdout.
func (c *coordinator) command(ctx context.Context, cmd string, stdout io.Writer) error {
	var state string
	switch cmd {
	case "stop":
		c.stop()
		state = "stopped"
	case "start":
		if c.cmd == nil {
			if err := c.start(ctx); err != nil {
				return err
			}
		}
		state = "serving"
	case "":
		return nil
	default:
		return fmt.Errorf("unknown command %q on stdin (want stop or start)", cmd)
	}
	line, _ := json.Marshal(map[string]string{"state": state})
	_, err := fmt.Fprintln(stdout, string(line))
	return err
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
