package chaos

import (
	"context"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/crashfs"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
)

// TestPowerLoss puts PostgreSQL's data directory on crashfs, a FUSE layer
// that drops every write not yet fsynced when the test "crashes" the
// machine, runs a load of Begin/Complete pairs, kills PostgreSQL with
// SIGKILL in the middle of it, discards the unsynced writes, restarts
// PostgreSQL (crash recovery) and checks that every Complete the
// coordinator acknowledged is there, COMPLETED with its response.
//
// A negative control runs the same with fsync=off and must lose
// acknowledged records (or fail to start): otherwise the test could not
// tell a durable coordinator from one that only survives a process kill,
// which keeps the operating system's page cache.
//
// It needs FUSE (see crashfs.Available); where that is missing it skips,
// and fails under CI=true.
func TestPowerLoss(t *testing.T) {
	if err := crashfs.Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("crashfs cannot mount, so durability cannot be tested: %v", err)
		}
		t.Skipf("crashfs cannot mount here, so durability is not tested: %v", err)
	}
	t.Run("durable", func(t *testing.T) {
		r := powerLoss(t, nil)
		t.Logf("chaos: power loss (fsync on): %s", r)
		if r.acked == 0 {
			t.Fatal("no Complete was acknowledged before the crash")
		}
		if r.startErr != nil {
			t.Fatalf("PostgreSQL did not recover from the power loss: %v", r.startErr)
		}
		if r.lost > 0 {
			t.Fatalf("%d of %d acknowledged Completes lost by the power loss; first: %s", r.lost, r.acked, r.firstLost)
		}
		if r.fs.LostWrites == 0 {
			t.Errorf("the crash dropped no unsynced write: the load did not reach the disk layer")
		}
	})
	t.Run("fsync=off control", func(t *testing.T) {
		r := powerLoss(t, []string{"fsync=off"})
		t.Logf("chaos: power loss (fsync off, negative control): %s", r)
		if r.acked == 0 {
			t.Fatal("no Complete was acknowledged before the crash")
		}
		if r.startErr == nil && r.lost == 0 {
			t.Fatalf("with fsync=off all %d acknowledged Completes survived the power loss: the test cannot see lost unsynced writes", r.acked)
		}
	})
}

type powerLossResult struct {
	acked, lost int
	firstLost   string
	startErr    error
	fs          crashfs.Stats
}

func (r powerLossResult) String() string {
	return fmt.Sprintf("acknowledged=%d lost=%d (first: %s) restart_error=%v fs_writes=%d fs_syncs=%d writes_dropped=%d",
		r.acked, r.lost, r.firstLost, r.startErr, r.fs.Writes, r.fs.Syncs, r.fs.LostWrites)
}

func powerLoss(t *testing.T, settings []string) powerLossResult {
	dir := serverOwnedDir(t)
	backing, mnt := filepath.Join(dir, "backing"), filepath.Join(dir, "mnt")
	for _, d := range []string{backing, mnt} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		chownToServer(t, d)
	}
	fsys, err := crashfs.Mount(backing, mnt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := fsys.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
		}
	})
	cluster := pgtest.StartCluster(t, pgtest.ClusterOptions{Durable: true, DataDir: filepath.Join(mnt, "data"), Settings: settings})
	dbURL := cluster.URL("postgres")
	if err := ledger.Migrate(context.Background(), dbURL); err != nil {
		t.Fatal(err)
	}
	c := coordtest.Start(t, coordtest.Options{DatabaseURL: dbURL})
	client := idempotencyv1.NewCoordinatorClient(dial(t, c.Addr))

	// Load: pairs of Begin and Complete on fresh keys, each Complete
	// acknowledged noted.
	ctx, cancel := context.WithCancel(context.Background())
	var (
		mu    sync.Mutex
		acked []string
		count atomic.Int64
		wg    sync.WaitGroup
	)
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				key := fmt.Sprintf("w%d-%d", w, i)
				callCtx, callCancel := context.WithTimeout(ctx, 10*time.Second)
				b, err := client.Begin(callCtx, &idempotencyv1.BeginRequest{Scope: "powerloss", Key: key})
				if err == nil && b.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED {
					_, err = client.Complete(callCtx, &idempotencyv1.CompleteRequest{Scope: "powerloss", Key: key,
						LeaseToken: b.GetLeaseToken(), Response: &idempotencyv1.StoredResponse{Body: []byte(key)}})
					if err == nil {
						mu.Lock()
						acked = append(acked, key)
						mu.Unlock()
						count.Add(1)
					}
				}
				callCancel()
			}
		})
	}
	// Crash in the middle of the load, once enough was acknowledged.
	want := int64(byMode(300, 3000))
	deadline := time.Now().Add(5 * time.Minute)
	for count.Load() < want {
		if time.Now().After(deadline) {
			cancel()
			wg.Wait()
			t.Fatalf("only %d Completes acknowledged in 5 minutes", count.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := cluster.Kill(); err != nil {
		t.Fatal(err)
	}
	cancel()
	wg.Wait()
	if err := fsys.Crash(); err != nil {
		t.Fatal(err)
	}
	r := powerLossResult{acked: len(acked), fs: fsys.Stats()}
	// The crashed server's lock file is stale (and, without fsync, may be
	// empty, which PostgreSQL refuses): remove it, as an operator would.
	if err := os.Remove(filepath.Join(mnt, "data", "postmaster.pid")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if r.startErr = cluster.Start(); r.startErr != nil {
		r.lost = r.acked
		return r
	}
	c.Restart()
	for _, key := range acked {
		lctx, lcancel := context.WithTimeout(context.Background(), 30*time.Second)
		got, err := client.Lookup(lctx, &idempotencyv1.LookupRequest{Scope: "powerloss", Key: key}, grpc.WaitForReady(true))
		lcancel()
		rec := got.GetRecord()
		if err != nil || rec.GetState() != idempotencyv1.State_STATE_COMPLETED || string(rec.GetResponse().GetBody()) != key {
			if r.lost == 0 {
				r.firstLost = fmt.Sprintf("%s: %v %v (%v)", key, rec.GetState(), rec.GetResponse(), status.Code(err))
			}
			r.lost++
			if err != nil && status.Code(err) != codes.NotFound {
				// The database is gone as a whole (the control): the
				// rest will not be there either.
				r.lost = r.acked
				r.firstLost += fmt.Sprintf("; %v", err)
				break
			}
		}
	}
	return r
}

// serverOwnedDir returns a new directory that PostgreSQL's user can reach
// and own, removed when the test ends (after the file system on it is
// unmounted).
func serverOwnedDir(t *testing.T) string {
	dir, err := os.MkdirTemp("", "idemcoord-powerloss-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	chownToServer(t, dir)
	return dir
}

// chownToServer hands path to the "postgres" user when the test runs as
// root (pgtest then runs PostgreSQL as that user).
func chownToServer(t *testing.T, path string) {
	if os.Geteuid() != 0 {
		return
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(path, uid, gid); err != nil {
		t.Fatal(err)
	}
}
