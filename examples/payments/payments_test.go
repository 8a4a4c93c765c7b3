package payments_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/examples/payments"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, payments.Migrate)) }

func buildService(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "paymentsd")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/idemcoord/idemcoord/examples/payments/cmd/paymentsd").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// answer is an acknowledged HTTP answer.
type answer struct {
	status int
	body   string
	result string // Idempotency-Result
}

func post(client *http.Client, addr, key string, body []byte) (answer, error) {
	req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/charges", bytes.NewReader(body))
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

// requestFor is the one request sent under key i; every fifth is rejected
// (amount 0), which must replay as well.
func requestFor(i int) []byte {
	amount := 100 + i
	if i%5 == 4 {
		amount = 0
	}
	return fmt.Appendf(nil, `{"customer":"cust-%d","amount_cents":%d}`, i, amount)
}

// TestChargesSurviveSIGKILL kills the payments service with SIGKILL at
// random points while clients send every request twice at once and retry
// until answered. Afterwards each key has exactly one charge row and one
// receipt sent, every acknowledged answer replays identically, and no
// idempotency record is left IN_PROGRESS or UNKNOWN.
// IDEMCOORD_CHAOS=long runs more keys and kills (make chaos).
func TestChargesSurviveSIGKILL(t *testing.T) {
	keys, kills, parallel := 24, 6, 6
	if os.Getenv("IDEMCOORD_CHAOS") == "long" {
		keys, kills, parallel = 300, 60, 12
	}
	url := pgtest.NewDatabase(t)
	logFile, err := os.Create(filepath.Join(t.TempDir(), "paymentsd.log"))
	if err != nil {
		t.Fatal(err)
	}
	addr := coordtest.FreeAddr(t)
	// paymentsd runs as a process of its own, which the test kills.
	svc := &testkit.Service{Bin: buildService(t), Args: []string{"-listen", addr, "-rescue-after", "2s", "-chaos-pause", "30ms"},
		Env: []string{"DATABASE_URL=" + url}, Log: logFile}
	if err := svc.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Stop(syscall.SIGKILL) })

	prefix := fmt.Sprintf("k%d-", rand.Int64())
	keyOf := func(i int) string { return prefix + fmt.Sprint(i) }
	client := &http.Client{Timeout: time.Minute}
	var mu sync.Mutex
	acks := map[int][]answer{}
	giveUp := time.Now().Add(10 * time.Minute) // a safety net, not an assertion of speed

	work := make(chan int)
	var clients sync.WaitGroup
	for range parallel {
		clients.Go(func() {
			for i := range work {
				var dup sync.WaitGroup
				for range 2 { // the same request twice at once, each retried until answered
					dup.Go(func() {
						for time.Now().Before(giveUp) {
							a, err := post(client, addr, keyOf(i), requestFor(i))
							if err == nil && (a.status == http.StatusCreated || a.status == http.StatusUnprocessableEntity) {
								mu.Lock()
								acks[i] = append(acks[i], a)
								mu.Unlock()
								return
							}
							// Killed, restarting, or in progress: retry.
							time.Sleep(time.Duration(10+rand.IntN(40)) * time.Millisecond)
						}
						t.Errorf("key %d: no answer in 10 minutes", i)
					})
				}
				dup.Wait()
			}
		})
	}
	done := make(chan struct{})
	killer := svc.KillRepeatedly(kills, 20*time.Millisecond, 300*time.Millisecond, done)
	// Keys keep coming until every kill happened, so each lands under load.
	sent := 0
	for ; sent < keys || !killer.Through(); sent++ {
		work <- sent
	}
	keys = sent
	close(work)
	clients.Wait()
	close(done)
	killed, err := killer.Result()
	if err != nil {
		t.Fatal(err)
	}
	if t.Failed() {
		t.FailNow()
	}

	// Let River finish the receipts: stop the service gracefully, wait until
	// the jobs its killed predecessors left running count as stuck, and
	// start it again; its rescuer retries them at once.
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	query := func(sql string, args ...any) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	svc.Stop(syscall.SIGTERM)
	waitFor(t, "stuck jobs to age past the rescue time", func() bool {
		return query(`SELECT count(*) FROM river_job WHERE state = 'running' AND attempted_at > now() - interval '3 seconds'`) == 0
	})
	if err := svc.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "every receipt job to complete", func() bool {
		return query(`SELECT count(*) FROM river_job WHERE state <> 'completed'`) == 0
	})

	for i := range keys {
		key := keyOf(i)
		rejected := i%5 == 4
		wantCharges := 1
		if rejected {
			wantCharges = 0
		}
		if n := query(`SELECT count(*) FROM charges WHERE idempotency_key = $1`, key); n != wantCharges {
			t.Errorf("key %s: %d charge rows, want %d", key, n, wantCharges)
		}
		if n := query(`SELECT count(*) FROM receipts_sent r JOIN charges c ON c.id = r.charge_id WHERE c.idempotency_key = $1`, key); n != wantCharges {
			t.Errorf("key %s: %d receipts sent, want %d", key, n, wantCharges)
		}
		replay, err := post(client, addr, key, requestFor(i))
		if err != nil || replay.result != "replayed" {
			t.Fatalf("key %s: replay %+v, %v", key, replay, err)
		}
		if len(acks[i]) != 2 {
			t.Errorf("key %s: %d acknowledged answers, want 2", key, len(acks[i]))
		}
		for _, a := range acks[i] {
			if a.status != replay.status || a.body != replay.body {
				t.Errorf("key %s: acknowledged %d %q, replays %d %q", key, a.status, a.body, replay.status, replay.body)
			}
		}
	}
	if n := query(`SELECT count(*) FROM idempotency_records WHERE state IN (1, 6)`); n != 0 {
		t.Errorf("%d records IN_PROGRESS or UNKNOWN", n)
	}
	if n := query(`SELECT count(*) FROM receipts_sent`); n != query(`SELECT count(*) FROM charges`) {
		t.Errorf("%d receipts for %d charges", n, query(`SELECT count(*) FROM charges`))
	}
	redelivered := query(`SELECT count(*) FROM river_job WHERE attempt > 1`)
	var reasons string
	if err := conn.QueryRow(context.Background(), `SELECT coalesce(string_agg(DISTINCT left(e->>'error', 120), ' | '), '')
		FROM river_job, unnest(errors) AS e`).Scan(&reasons); err != nil {
		t.Fatal(err)
	}
	t.Logf("receipt job errors seen: %s", reasons)
	// Redeliveries of a message whose effect had already committed: the
	// inbox answered them with a replay.
	deduped := query(`SELECT count(*) FROM river_job j JOIN receipts_sent r ON r.message_id = j.args->>'message_id'
		WHERE j.attempt > 1 AND r.sent_at < j.attempted_at`)
	t.Logf("chaos: TestChargesSurviveSIGKILL: %d keys, %d SIGKILLs, %d receipt jobs delivered more than once, %d of them after their effect committed (the inbox replayed)",
		keys, killed, redelivered, deduped)
	if t.Failed() {
		t.Logf("paymentsd log:\n%s", svc.LogTail(4000))
	}
}

// waitFor polls cond until it holds, failing after a generous time.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
