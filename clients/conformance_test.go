package clients_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// conformanceSuite is one of the shared suites in clients/testdata
// (http_conformance.json, grpc_conformance.json); its "about" says what each
// field means. O is the suite's options, S its step.
type conformanceSuite[O any, S conformanceStepper] struct {
	ClientLeaseMS int                         `json:"client_lease_ms"`
	Scenarios     []conformanceScenario[O, S] `json:"scenarios"`
}

type conformanceScenario[O any, S conformanceStepper] struct {
	Name         string            `json:"name"`
	Skip         map[string]string `json:"skip"`
	HoldKey      bool              `json:"hold_key"`
	Scope        string            `json:"scope"` // of the stack's records, when not the runner's
	Key          string            `json:"key"`   // of the record the state is read from, when not the run's key
	Options      O                 `json:"options"`
	Steps        []S               `json:"steps"`
	State        string            `json:"state"`
	HandlerCalls *int              `json:"handler_calls"`
}

// conformanceStepBase is what the steps of both suites have.
type conformanceStepBase struct {
	Background   bool            `json:"background"`
	StartAfterMS int             `json:"start_after_ms"`
	TimeoutMS    int             `json:"timeout_ms"`
	Repeat       int             `json:"repeat"`
	ReleaseHold  bool            `json:"release_hold"`
	SettleMS     int             `json:"settle_ms"`
	State        string          `json:"state"`
	Handler      json.RawMessage `json:"handler"`
	ExpectCounts map[string]int  `json:"expect_counts"`
}

func (b conformanceStepBase) base() conformanceStepBase { return b }

// conformanceStepper is a suite's step: its conformanceStepBase, and
// whether it only checks the record's state (makes no call).
type conformanceStepper interface {
	base() conformanceStepBase
	checksState() bool
}

// conformanceRunner runs a suite against one Go stack.
type conformanceRunner[O any, S conformanceStepper] struct {
	path     string     // the suite's file
	scope    string     // the scope the stack records its keys in, unless the scenario says
	logLevel slog.Level // of the client's logger
	// serve starts the stack for a scenario; send makes step i's call with
	// key and returns its idempotency-result.
	serve        func(t *testing.T, idem *clients.Client, sc conformanceScenario[O, S]) (send func(i int, key string, st S) (string, error))
	handlerCalls func(key string) int                  // how often the handler ran for key
	countsError  func(i int, got map[string]int) error // step i's idempotency-result counts were not as expected
}

func (r conformanceRunner[O, S]) run(t *testing.T) {
	raw, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	var suite conformanceSuite[O, S]
	if err := json.Unmarshal(raw, &suite); err != nil {
		t.Fatal(err)
	}
	coord := coordtest.Start(t, coordtest.Options{})
	logger := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: r.logLevel}))
	idem := clients.New(coord.Dial(t), fixtureOptions(clients.WithLogger(logger),
		clients.WithLease(time.Duration(suite.ClientLeaseMS)*time.Millisecond))...)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = idem.Shutdown(ctx)
	})
	for _, sc := range suite.Scenarios {
		t.Run(sc.Name, func(t *testing.T) {
			if why := sc.Skip["go"]; why != "" {
				t.Skip(why)
			}
			t.Parallel()
			send := r.serve(t, idem, sc)
			r.scenario(t, idem, sc, send)
		})
	}
}

func (r conformanceRunner[O, S]) scenario(t *testing.T, idem *clients.Client, sc conformanceScenario[O, S],
	send func(i int, key string, st S) (string, error)) {
	var b [12]byte
	_, _ = rand.Read(b[:])
	key := "conf-" + hex.EncodeToString(b[:])
	recordKey := key
	if sc.Key != "" {
		recordKey = strings.ReplaceAll(sc.Key, "{key}", key)
	}
	scope := r.scope
	if sc.Scope != "" {
		scope = sc.Scope
	}
	lookup := func() string {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := idem.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: scope, Key: recordKey})
		if status.Code(err) == codes.NotFound {
			return "absent"
		}
		if err != nil {
			t.Fatal(err)
		}
		return res.GetRecord().GetState().String()
	}
	wantState := func(want string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for got := lookup(); got != want; got = lookup() {
			if time.Now().After(deadline) {
				t.Fatalf("state %s, want %s", got, want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	var holdToken string
	if sc.HoldKey {
		res, err := idem.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: scope, Key: key, AttemptId: "holder"})
		if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
			t.Fatalf("hold: %v %v", res, err)
		}
		holdToken = res.GetLeaseToken()
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i, st := range sc.Steps {
		b := st.base()
		switch {
		case b.ReleaseHold:
			time.Sleep(time.Duration(b.SettleMS) * time.Millisecond)
			if _, err := idem.Fail(context.Background(), &idempotencyv1.FailRequest{Scope: scope, Key: key,
				LeaseToken: holdToken, Kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, Reason: "released"}); err != nil {
				t.Fatalf("step %d: release: %v", i, err)
			}
			continue
		case st.checksState():
			wantState(b.State)
			continue
		}
		run := func() {
			time.Sleep(time.Duration(b.StartAfterMS) * time.Millisecond)
			n := max(b.Repeat, 1)
			results := make(chan string, n)
			var inner sync.WaitGroup
			for range n {
				inner.Go(func() {
					res, err := send(i, key, st)
					if err != nil {
						errs <- err
						return
					}
					results <- res
				})
			}
			inner.Wait()
			close(results)
			if b.ExpectCounts != nil {
				got := map[string]int{}
				for res := range results {
					got[res]++
				}
				for k, v := range b.ExpectCounts {
					if got[k] != v {
						errs <- r.countsError(i, got)
					}
				}
			}
		}
		if b.Background {
			wg.Go(run)
		} else {
			run()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if sc.State != "" {
		wantState(sc.State)
	}
	if sc.HandlerCalls != nil {
		if got := r.handlerCalls(key); got != *sc.HandlerCalls {
			t.Errorf("handler ran %d times, want %d", got, *sc.HandlerCalls)
		}
	}
}
