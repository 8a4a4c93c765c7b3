package provisioning_test

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/examples/provisioning"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
)

func TestMain(m *testing.M) { os.Exit(coordtest.Main(m)) }

type answer struct {
	status       int
	body, result string
}

func order(client *http.Client, addr, key string) (answer, error) {
	req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/orders", nil)
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, err
	}
	return answer{status: resp.StatusCode, body: string(b), result: resp.Header.Get("Idempotency-Result")}, nil
}

// TestStepsRunOnceAcrossSIGKILL kills the provisioning service with SIGKILL
// at random points while clients send orders and retry each until it is
// answered. With checkpoints, every order's three steps each ran exactly
// once by the upstreams' counts, every record ends COMPLETED with the last
// step as its checkpoint (none is left UNKNOWN for an operator), and every
// acknowledged answer equals the replay. The same run without checkpoints
// (the handler starts again from the first step after a crash, asking
// only that step's upstream) ends every order too, and reports how many
// steps ran twice: what the checkpoints buy. IDEMCOORD_CHAOS=long runs
// more orders and kills (make chaos).
func TestStepsRunOnceAcrossSIGKILL(t *testing.T) {
	keys, kills, parallel := 16, 6, 6
	if os.Getenv("IDEMCOORD_CHAOS") == "long" {
		keys, kills, parallel = 120, 40, 12
	}
	coord := coordtest.Start(t, coordtest.Options{})
	records := idempotencyv1.NewCoordinatorClient(coord.Dial(t))
	ups := provisioning.NewUpstreams()
	upSrv := httptest.NewServer(ups)
	t.Cleanup(upSrv.Close)
	bin := filepath.Join(t.TempDir(), "provisiond")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/idemcoord/idemcoord/examples/provisioning/cmd/provisiond").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	for _, withCheckpoints := range []bool{true, false} {
		name := map[bool]string{true: "with checkpoints", false: "without checkpoints"}[withCheckpoints]
		t.Run(name, func(t *testing.T) {
			logFile, err := os.Create(filepath.Join(t.TempDir(), "provisiond.log"))
			if err != nil {
				t.Fatal(err)
			}
			args := []string{"-coordinator", coord.Addr, "-upstream", upSrv.URL, "-lease", "1s", "-chaos-pause", "40ms"}
			if !withCheckpoints {
				args = append(args, "-without-checkpoints")
			}
			addr := coordtest.FreeAddr(t)
			// provisiond runs as a process of its own, which the test kills.
			svc := &testkit.Service{Bin: bin, Args: append([]string{"-listen", addr}, args...), Log: logFile}
			if err := svc.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { svc.Stop(syscall.SIGKILL) })
			prefix := fmt.Sprintf("order-%d-", rand.Int64())
			keyOf := func(i int) string { return prefix + fmt.Sprint(i) }
			client := &http.Client{Timeout: time.Minute}
			var mu sync.Mutex
			acks := map[int]answer{}
			giveUp := time.Now().Add(10 * time.Minute) // a safety net, not an assertion of speed

			work := make(chan int)
			var workers sync.WaitGroup
			for range parallel {
				workers.Go(func() {
					for i := range work {
						for time.Now().Before(giveUp) {
							a, err := order(client, addr, keyOf(i))
							if err == nil && a.status == http.StatusCreated {
								mu.Lock()
								acks[i] = a
								mu.Unlock()
								break
							}
							// Killed, restarting, in progress, or an attempt
							// that lost its lease: retry.
							time.Sleep(time.Duration(20+rand.IntN(60)) * time.Millisecond)
						}
					}
				})
			}
			stopKiller := make(chan struct{})
			killer := svc.KillRepeatedly(kills, 50*time.Millisecond, 400*time.Millisecond, stopKiller)
			// Orders keep coming until every kill happened, so each lands
			// under load.
			sent := 0
			for ; sent < keys || !killer.Through(); sent++ {
				work <- sent
			}
			close(work)
			workers.Wait()
			close(stopKiller)
			killed, err := killer.Result()
			if err != nil {
				t.Fatal(err)
			}
			if t.Failed() {
				t.FailNow()
			}

			scope := "provisioning POST /orders"
			twice, unanswered := 0, 0
			for i := range sent {
				key := keyOf(i)
				a, ok := acks[i]
				if !ok {
					unanswered++
					continue
				}
				for _, step := range provisioning.Steps {
					n := ups.Effects(step, key)
					if n != 1 && (withCheckpoints || step == provisioning.Steps[0]) {
						t.Errorf("%s: %s ran %d times, want once", key, step, n)
					}
					twice += max(n-1, 0)
				}
				res, err := records.Lookup(context.Background(), &idempotencyv1.LookupRequest{Scope: scope, Key: key})
				if err != nil {
					t.Fatalf("%s: Lookup: %v", key, err)
				}
				rec := res.GetRecord()
				if rec.GetState() != idempotencyv1.State_STATE_COMPLETED {
					t.Errorf("%s: record %v, want COMPLETED", key, rec.GetState())
				}
				if withCheckpoints && rec.GetCheckpoint().GetPhase() != provisioning.Steps[len(provisioning.Steps)-1] {
					t.Errorf("%s: completed record's checkpoint %v, want the last step's", key, rec.GetCheckpoint())
				}
				replay, err := order(client, addr, key)
				if err != nil || replay.result != "replayed" || replay.status != a.status || replay.body != a.body {
					t.Errorf("%s: acknowledged %+v, replay %+v %v", key, a, replay, err)
				}
			}
			if unanswered > 0 {
				t.Errorf("%d of %d orders unanswered in 10 minutes", unanswered, sent)
			}
			t.Logf("chaos: TestStepsRunOnceAcrossSIGKILL %s: %d orders, %d SIGKILLs, %d upstream steps ran more than once",
				name, sent, killed, twice)
			if t.Failed() {
				t.Logf("provisiond log (tail):\n%s", svc.LogTail(4000))
			}
		})
	}
}
