package chaos

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// TestFailoverPgAutoFailover is the long form of
// TestFailoverSynchronousStandby (IDEMCOORD_CHAOS=long, `make chaos`): a
// pg_auto_failover formation (scripts/run-ha.sh: a monitor and three data
// nodes, number_sync_standbys = 1) under the same load and checks, with
// pg_auto_failover's own failover (pg_autoctl perform failover) run
// several times, each promoting another node.
func TestFailoverPgAutoFailover(t *testing.T) {
	if !long() {
		t.Skip("long form only: IDEMCOORD_CHAOS=long (make chaos)")
	}
	if _, err := exec.LookPath("pg_autoctl"); err != nil {
		t.Skip("no pg_autoctl (Debian: postgresql-15-auto-failover, pg-auto-failover-cli; .ci/run installs them)")
	}
	ha := startHACluster(t)
	rng := rand.New(rand.NewPCG(seed(t), 16))
	if err := ledger.Migrate(context.Background(), ha.url); err != nil {
		t.Fatal(err)
	}
	cw := coordtest.Start(t, coordtest.Options{DatabaseURL: ha.url,
		ServerOptions: []server.Option{server.WithLogger(errorLogger(t))}})
	w := newWorkload(t, idempotencyv1.NewCoordinatorClient(dial(t, cw.Addr)), workloadOptions{
		slots: 12, lease: time.Second, callTimeout: 3 * time.Second, dieChance: 0.05, slowChance: 0.03})
	w.start(8, rng.Uint64())

	f := &failoverPair{current: ha.url}
	f.startRefCallers(t, ha.url+"&application_name="+refCallersApp, rng.Uint64())
	// Each failover runs while rounds of calls go on (a round waits for
	// the database to show its transactions ended, so rounds slow down
	// in the gap); the next one starts after it is done.
	var failovers []time.Duration
	var lastDone time.Time
	var done chan error
	f.runReference(t, 160, func(round int) {
		switch round % 40 {
		case 10:
			done = make(chan error, 1)
			go func() {
				start := time.Now()
				err := ha.runErr("failover")
				lastDone = time.Now()
				failovers = append(failovers, lastDone.Sub(start))
				done <- err
			}()
		case 39:
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
	})
	for end := time.Now().Add(time.Minute); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if _, ok := w.recoveredAfter(lastDone); ok {
			break
		}
	}
	time.Sleep(500 * time.Millisecond)
	w.stop()

	r := w.verify(ha.url)
	if r.deadline > 0 {
		t.Errorf("%d calls ran into their deadline instead of failing UNAVAILABLE", r.deadline)
	}
	lin, _ := f.checkReference(t)
	t.Logf("chaos: pg_auto_failover: %d failovers (pg_autoctl perform failover took %v)", len(failovers), failovers)
	t.Logf("chaos: pg_auto_failover: workload ops=%d acked=%d checked=%d lost=%d double_lease=%d unavailable=%d deadline_exceeded=%d internal=%d bad_rows=%d",
		r.ops, r.acked, r.checked, r.lost, r.doubleLease, r.unavailable, r.deadline, r.internal, r.badRows)
	t.Logf("chaos: pg_auto_failover: %s", lin)
}

// haCluster is a pg_auto_failover formation run by scripts/run-ha.sh.
type haCluster struct {
	dir  string
	port int
	url  string // multi-host URL of the data nodes
}

func (ha *haCluster) env() []string {
	return append(os.Environ(), "IDEMCOORD_HA_DIR="+ha.dir, "IDEMCOORD_HA_PORT="+strconv.Itoa(ha.port))
}

// runErr runs scripts/run-ha.sh with args against the formation.
func (ha *haCluster) runErr(args ...string) error {
	cmd := exec.Command("../scripts/run-ha.sh", args...)
	cmd.Env = ha.env()
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("run-ha.sh %v: %w\n%s", args, err, out)
	}
	return nil
}

// startHACluster starts a formation in a temporary directory on four free
// ports, and stops it when the test ends.
func startHACluster(t *testing.T) *haCluster {
	t.Helper()
	dir, err := os.MkdirTemp("", "idemcoord-ha-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ha := &haCluster{dir: dir, port: freePortRun(t, 4)}
	cmd := exec.Command("../scripts/run-ha.sh", "cluster")
	cmd.Env = ha.env()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var lines []string
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			mu.Lock()
			lines = append(lines, line)
			mu.Unlock()
			if _, url, ok := strings.Cut(line, "cluster ready: DATABASE_URL="); ok {
				ready <- url
			}
		}
		close(ready)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	select {
	case url, ok := <-ready:
		if !ok {
			mu.Lock()
			defer mu.Unlock()
			t.Fatalf("run-ha.sh cluster ended before the cluster was ready:\n%s", strings.Join(lines, "\n"))
		}
		ha.url = url
	case <-time.After(5 * time.Minute):
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("the pg_auto_failover formation is not ready after 5 minutes:\n%s", strings.Join(lines, "\n"))
	}
	return ha
}

// freePortRun returns the first of n consecutive free loopback ports.
func freePortRun(t *testing.T, n int) int {
	t.Helper()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		ok := base+n < 65536
		for p := base + 1; ok && p < base+n; p++ {
			if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p)); err != nil {
				ok = false
			} else {
				_ = l.Close()
			}
		}
		if ok {
			return base
		}
	}
	t.Fatal("no run of free ports")
	return 0
}
