package chaos

import (
	"context"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// TestKill9Coordinator kills the coordinator process with SIGKILL in the
// middle of a load of Begin/Complete pairs over real gRPC, restarts it on
// the same port, and checks the workload's promises (see workload): no
// acknowledged Complete lost, never two valid lease tokens for one key,
// keys whose holder died UNKNOWN after their lease and taken over.
//
// PostgreSQL is not faulted here, so its cluster runs non-durable
// (fsync off): what a killed coordinator could lose is what it had not yet
// committed, and PostgreSQL keeps everything committed as long as it runs.
func TestKill9Coordinator(t *testing.T) {
	rng := rand.New(rand.NewPCG(seed(t), 1))
	kills := byMode(2, 12)
	bin := coordtest.BuildBinary(t)
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{})
	dbURL := cluster.URL("postgres")
	p := &coordProc{t: t, bin: bin, dbURL: dbURL, addr: coordtest.FreeAddr(t), httpAddr: coordtest.FreeAddr(t),
		// The reaper marks stale leases UNKNOWN too, so takeovers find
		// both lapsed IN_PROGRESS rows and rows already marked UNKNOWN.
		config: writeFile(t, "idemcoord.yaml", "reaper: { interval: 300ms }\n")}
	p.start()

	w := newWorkload(t, idempotencyv1.NewCoordinatorClient(dial(t, p.addr)), workloadOptions{
		slots: 12, lease: time.Second, dieChance: 0.05, slowChance: 0.03})
	start := time.Now()
	w.start(8, rng.Uint64())
	var downtimes []time.Duration
	for range kills {
		time.Sleep(time.Duration(800+rng.IntN(1200)) * time.Millisecond)
		killedAt := time.Now()
		p.kill()
		time.Sleep(time.Duration(100+rng.IntN(400)) * time.Millisecond)
		p.start()
		time.Sleep(300 * time.Millisecond)
		if d, ok := w.recoveredAfter(killedAt); ok {
			downtimes = append(downtimes, d)
		}
	}
	time.Sleep(1500 * time.Millisecond)
	w.stop()
	loadTime := time.Since(start)
	r := w.verify(dbURL)
	t.Logf("chaos: kill9: ops=%d faults=%d acked=%d checked=%d lost=%d double_lease=%d died=%d died_then_unknown=%d taken_over=%d fenced=%d bad_rows=%d internal=%d load=%v max_downtime=%v",
		r.ops, kills, r.acked, r.checked, r.lost, r.doubleLease, r.died, r.diedThenUnknown, r.takenOver+r.takenOverInLoad, r.fenced,
		r.badRows, r.internal, loadTime.Round(100*time.Millisecond), maxDuration(downtimes).Round(time.Millisecond))
	t.Logf("chaos: kill9: detail %v", r)
	if r.diedThenUnknown != r.died {
		t.Errorf("%d holders died, the keys of %d were found UNKNOWN", r.died, r.diedThenUnknown)
	}
	if r.unavailable == 0 {
		t.Errorf("no call failed UNAVAILABLE: the kills missed the load")
	}
	if r.acked == 0 || r.died == 0 {
		t.Errorf("the load proved little: %d acknowledged Completes, %d dead holders", r.acked, r.died)
	}
	if len(downtimes) < kills {
		t.Errorf("service resumed after only %d of %d kills", len(downtimes), kills)
	}
}

func maxDuration(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// coordProc runs the idemcoord binary as a child process, on the same
// ports every time it starts.
type coordProc struct {
	t                       *testing.T
	bin, dbURL, config      string
	addr, httpAddr, logPath string
	cmd                     *exec.Cmd
	done                    chan struct{}
}

// start runs the binary and waits until gRPC health says SERVING.
func (p *coordProc) start() {
	t := p.t
	t.Helper()
	if p.logPath == "" {
		p.logPath = filepath.Join(t.TempDir(), "idemcoord.log")
		t.Cleanup(func() {
			p.kill()
			if t.Failed() {
				b, _ := os.ReadFile(p.logPath)
				if len(b) > 4<<10 {
					b = b[len(b)-4<<10:]
				}
				t.Logf("end of the coordinator's log %s:\n%s", p.logPath, b)
			}
		})
	}
	logf, err := os.OpenFile(p.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(p.bin, "--listen", p.addr, "--http-listen", p.httpAddr, "--config", p.config, "--log-level", "warn")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+p.dbURL)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Should the test binary die without its cleanup, so does the child
	// (and only then: the signal is tied to a thread kept for it).
	if err := coordtest.StartTied(t, cmd); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	p.cmd, p.done = cmd, done

	health := healthpb.NewHealthClient(dial(t, p.addr))
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		r, err := health.Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return
		}
		select {
		case <-done:
			t.Fatalf("the coordinator exited during start-up (log %s)", p.logPath)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the coordinator is not serving 30s after start: %v (log %s)", err, p.logPath)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *coordProc) kill() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
	p.cmd = nil
}
