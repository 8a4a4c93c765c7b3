// Command grpcfloor measures the floor under the coordinator's unary path:
// what grpc-go itself costs for a pair of the coordinator's calls (Begin
// and Complete, from the generated stub) when the server answers each with
// a canned answer of the coordinator's size, with no interceptors, no
// validation and no database. It starts itself as the server (a separate
// process, as the coordinator is), drives it from callers in this process
// over one connection, and prints pairs/s and the CPU per pair of each
// side:
//
//	go run ./bench/grpcfloor -concurrency 64 -duration 6s -runs 3
//
// docs/performance.md compares these figures with the coordinator's.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/bench/internal/floor"
	"github.com/idemcoord/idemcoord/bench/internal/procstat"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// bodyBytes is the size of the stored response in the answers and in
// the callers' Completes.
const bodyBytes = 150

func main() {
	if len(os.Args) == 3 && os.Args[1] == "serve" {
		if err := floor.Serve(os.Args[2], bodyBytes); err != nil {
			fmt.Fprintln(os.Stderr, "grpcfloor:", err)
			os.Exit(1)
		}
		return
	}
	concurrency := flag.Int("concurrency", 64, "concurrent callers, each doing Begin then Complete on a new key")
	duration := flag.Duration("duration", 6*time.Second, "measured time of each run (after a 1 s warm-up)")
	runs := flag.Int("runs", 3, "runs, each against a fresh server process")
	flag.Parse()
	for range *runs {
		if err := run(*concurrency, *duration); err != nil {
			fmt.Fprintln(os.Stderr, "grpcfloor:", err)
			os.Exit(1)
		}
	}
}

// run starts a server process, drives it and prints one line of figures.
func run(concurrency int, duration time.Duration) error {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := lis.Addr().String()
	if err := lis.Close(); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	srv := exec.Command(self, "serve", addr)
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		return err
	}
	defer func() {
		_ = srv.Process.Kill()
		_ = srv.Wait()
	}()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	c := idempotencyv1.NewCoordinatorClient(conn)
	ctx := context.Background()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "bench", Key: "ready"}); err == nil {
			break
		} else if time.Now().After(deadline) {
			return fmt.Errorf("server not answering: %w", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var pairs atomic.Int64
	var measuring, stopping atomic.Bool
	errs := make(chan error, concurrency)
	var wg sync.WaitGroup
	for g := range concurrency {
		wg.Go(func() {
			for i := 0; !stopping.Load(); i++ {
				key := fmt.Sprintf("k%d-%d", g, i)
				r, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "bench", Key: key, Fingerprint: make([]byte, 32)})
				if err == nil {
					_, err = c.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "bench", Key: key, LeaseToken: r.GetLeaseToken(),
						Response: &idempotencyv1.StoredResponse{Body: make([]byte, bodyBytes)}})
				}
				if err != nil {
					errs <- err
					return
				}
				if measuring.Load() {
					pairs.Add(1)
				}
			}
		})
	}
	time.Sleep(time.Second)
	s0, c0, err := cpuOf(srv.Process.Pid)
	if err != nil {
		return err
	}
	measuring.Store(true)
	t0 := time.Now()
	time.Sleep(duration)
	measuring.Store(false)
	elapsed := time.Since(t0).Seconds()
	s1, c1, err := cpuOf(srv.Process.Pid)
	if err != nil {
		return err
	}
	stopping.Store(true)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	n := float64(pairs.Load())
	if n == 0 {
		return errors.New("no pairs in the measured window")
	}
	fmt.Printf("%d callers: %.0f pairs/s; CPU ms per pair: server %.4f, callers %.4f; CPUs busy %.2f\n",
		concurrency, n/elapsed, (s1-s0)*1000/n, (c1-c0)*1000/n, (s1-s0+c1-c0)/elapsed)
	return nil
}

// cpuOf is the CPU seconds used so far by the server process pid and by
// this process (the callers).
func cpuOf(pid int) (server, callers float64, err error) {
	st, err := procstat.Read(pid)
	if err != nil {
		return 0, 0, err
	}
	callers, err = procstat.SelfCPU()
	return st.CPU, callers, err
}
