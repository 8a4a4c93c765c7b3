package clients_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
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

// httpConformance is clients/testdata/http_conformance.json, the suite that
// every HTTP middleware (Go, Express, Fastify, ASGI, WSGI) runs; its
// "about" says what each field means.
type httpConformance struct {
	ClientLeaseMS int `json:"client_lease_ms"`
	Scenarios     []struct {
		Name    string            `json:"name"`
		Skip    map[string]string `json:"skip"`
		HoldKey bool              `json:"hold_key"`
		Options struct {
			WaitMS             *int     `json:"wait_ms"`
			RequireKey         bool     `json:"require_key"`
			Methods            []string `json:"methods"`
			ReplayHeaders      []string `json:"replay_headers"`
			ReplayableStatuses []int    `json:"replayable_statuses"`
			MaxBodyBytes       int64    `json:"max_body_bytes"`
			PrincipalHeader    string   `json:"principal_header"`
		} `json:"options"`
		Steps        []conformanceStep `json:"steps"`
		State        string            `json:"state"`
		HandlerCalls *int              `json:"handler_calls"`
	} `json:"scenarios"`
}

type conformanceStep struct {
	Background   bool            `json:"background"`
	StartAfterMS int             `json:"start_after_ms"`
	TimeoutMS    int             `json:"timeout_ms"`
	Repeat       int             `json:"repeat"`
	ReleaseHold  bool            `json:"release_hold"`
	SettleMS     int             `json:"settle_ms"`
	State        string          `json:"state"`
	Handler      json.RawMessage `json:"handler"`
	Request      *struct {
		Method  string            `json:"method"`
		Path    string            `json:"path"`
		Headers map[string]string `json:"headers"`
		Body    string            `json:"body"`
	} `json:"request"`
	Expect struct {
		GaveUp        bool              `json:"gave_up"`
		Status        int               `json:"status"`
		Headers       map[string]string `json:"headers"`
		AbsentHeaders []string          `json:"absent_headers"`
		HeaderPresent []string          `json:"header_present"`
		Body          *string           `json:"body"`
		Problem       string            `json:"problem"`
	} `json:"expect"`
	ExpectCounts map[string]int `json:"expect_counts"`
}

// conformanceAction is what the suite's handler does (X-Conformance).
type conformanceAction struct {
	SleepMS         int               `json:"sleep_ms"`
	Mark            bool              `json:"mark"`
	Throw           bool              `json:"throw"`
	UntilDisconnect bool              `json:"until_disconnect"`
	EchoLease       bool              `json:"echo_lease"`
	Status          int               `json:"status"`
	Headers         map[string]string `json:"headers"`
	Body            string            `json:"body"`
}

// conformanceHandler is the suite's handler; calls counts its runs by
// X-Scenario.
func conformanceHandler(calls *sync.Map) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := calls.LoadOrStore(r.Header.Get("X-Scenario"), new(int64))
		mu.Lock()
		*n.(*int64)++
		mu.Unlock()
		var a conformanceAction
		_ = json.Unmarshal([]byte(r.Header.Get("X-Conformance")), &a)
		_, _ = io.ReadAll(r.Body)
		if a.SleepMS > 0 {
			time.Sleep(time.Duration(a.SleepMS) * time.Millisecond)
		}
		if a.Mark {
			clients.MarkSideEffect(r.Context())
		}
		if a.Throw {
			panic("the conformance handler throws")
		}
		if a.UntilDisconnect {
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
			return
		}
		if a.EchoLease {
			l, _ := clients.LeaseFrom(r.Context())
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"attempt":`+strconv.Itoa(int(l.Attempt))+`,"previous":"`+l.Previous.String()+`"}`)
			return
		}
		for k, v := range a.Headers {
			w.Header().Set(k, v)
		}
		w.WriteHeader(max(a.Status, 200))
		_, _ = io.WriteString(w, a.Body)
	})
}

var mu sync.Mutex

// TestHTTPConformance runs the shared HTTP suite against HTTPMiddleware.
func TestHTTPConformance(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("testdata/http_conformance.json")
	if err != nil {
		t.Fatal(err)
	}
	var suite httpConformance
	if err := json.Unmarshal(raw, &suite); err != nil {
		t.Fatal(err)
	}
	coord := coordtest.Start(t, coordtest.Options{})
	logger := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	idem := clients.New(coord.Dial(t), clients.WithLogger(logger),
		clients.WithLease(time.Duration(suite.ClientLeaseMS)*time.Millisecond))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = idem.Shutdown(ctx)
	})
	var calls sync.Map
	for _, sc := range suite.Scenarios {
		t.Run(sc.Name, func(t *testing.T) {
			if why := sc.Skip["go"]; why != "" {
				t.Skip(why)
			}
			t.Parallel()
			var opts []clients.HTTPOption
			o := sc.Options
			if o.WaitMS != nil {
				opts = append(opts, clients.WithHTTPWait(time.Duration(*o.WaitMS)*time.Millisecond))
			}
			if o.RequireKey {
				opts = append(opts, clients.WithHTTPRequireKey())
			}
			if o.Methods != nil {
				opts = append(opts, clients.WithHTTPMethods(o.Methods...))
			}
			if o.ReplayHeaders != nil {
				opts = append(opts, clients.WithHTTPReplayHeaders(o.ReplayHeaders...))
			}
			if o.ReplayableStatuses != nil {
				opts = append(opts, clients.WithHTTPReplayableStatuses(o.ReplayableStatuses...))
			}
			if o.MaxBodyBytes > 0 {
				opts = append(opts, clients.WithHTTPMaxBodyBytes(o.MaxBodyBytes))
			}
			if h := o.PrincipalHeader; h != "" {
				opts = append(opts, clients.WithHTTPPrincipal(func(r *http.Request) (string, error) { return r.Header.Get(h), nil }))
			}
			guarded := clients.HTTPMiddleware(idem, opts...)(conformanceHandler(&calls))
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				defer func() {
					if p := recover(); p != nil {
						http.Error(w, "internal error", http.StatusInternalServerError)
					}
				}()
				guarded.ServeHTTP(w, r)
			}))
			t.Cleanup(srv.Close)
			var b [12]byte
			_, _ = rand.Read(b[:])
			key := "conf-" + hex.EncodeToString(b[:])
			lookup := func() string {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				res, err := idem.Lookup(ctx, &idempotencyv1.LookupRequest{Scope: clients.DefaultHTTPScope, Key: key})
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
				res, err := idem.Begin(context.Background(), &idempotencyv1.BeginRequest{Scope: clients.DefaultHTTPScope, Key: key, AttemptId: "holder"})
				if err != nil || res.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
					t.Fatalf("hold: %v %v", res, err)
				}
				holdToken = res.GetLeaseToken()
			}
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for i, st := range sc.Steps {
				switch {
				case st.ReleaseHold:
					time.Sleep(time.Duration(st.SettleMS) * time.Millisecond)
					if _, err := idem.Fail(context.Background(), &idempotencyv1.FailRequest{Scope: clients.DefaultHTTPScope, Key: key,
						LeaseToken: holdToken, Kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED, Reason: "released"}); err != nil {
						t.Fatalf("step %d: release: %v", i, err)
					}
					continue
				case st.Request == nil:
					wantState(st.State)
					continue
				}
				run := func() {
					time.Sleep(time.Duration(st.StartAfterMS) * time.Millisecond)
					n := max(st.Repeat, 1)
					results := make(chan string, n)
					var inner sync.WaitGroup
					for range n {
						inner.Go(func() {
							res, err := conformanceSend(srv.URL, key, st)
							if err != nil {
								errs <- err
								return
							}
							results <- res
						})
					}
					inner.Wait()
					close(results)
					if st.ExpectCounts != nil {
						got := map[string]int{}
						for r := range results {
							got[r]++
						}
						for k, v := range st.ExpectCounts {
							if got[k] != v {
								errs <- errors.New("step " + strconv.Itoa(i) + ": Idempotency-Result counts " + fmtCounts(got))
							}
						}
					}
				}
				if st.Background {
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
				n, _ := calls.LoadOrStore(key, new(int64))
				mu.Lock()
				got := *n.(*int64)
				mu.Unlock()
				if got != int64(*sc.HandlerCalls) {
					t.Errorf("handler ran %d times, want %d", got, *sc.HandlerCalls)
				}
			}
		})
	}
}

func fmtCounts(m map[string]int) string {
	b, _ := json.Marshal(m)
	return string(b)
}

// conformanceSend sends a step's request and checks the answer; it returns
// the answer's Idempotency-Result.
func conformanceSend(base, key string, st conformanceStep) (string, error) {
	fill := func(s string) string { return strings.ReplaceAll(s, "{key}", key) }
	rq := st.Request
	req, err := http.NewRequest(rq.Method, base+rq.Path, strings.NewReader(rq.Body))
	if err != nil {
		return "", err
	}
	for k, v := range rq.Headers {
		req.Header.Set(k, fill(v))
	}
	req.Header.Set("X-Scenario", key)
	req.Header.Set("X-Conformance", string(st.Handler))
	c := &http.Client{}
	if st.TimeoutMS > 0 {
		c.Timeout = time.Duration(st.TimeoutMS) * time.Millisecond
	}
	resp, err := c.Do(req)
	e := st.Expect
	if e.GaveUp {
		if err == nil {
			resp.Body.Close()
			return "", errors.New("got HTTP " + resp.Status + ", want the client to give up")
		}
		return "", nil
	}
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	fail := func(what string) (string, error) {
		return "", errors.New(rq.Method + " " + rq.Path + ": " + what + "; got HTTP " + resp.Status + " " + fmtHeader(resp.Header) + " " + string(body))
	}
	if resp.StatusCode != e.Status {
		return fail("want status " + strconv.Itoa(e.Status))
	}
	for k, v := range e.Headers {
		if got := resp.Header.Get(k); got != fill(v) {
			return fail("want " + k + ": " + fill(v))
		}
	}
	for _, k := range e.AbsentHeaders {
		if _, ok := resp.Header[http.CanonicalHeaderKey(k)]; ok {
			return fail("want no " + k)
		}
	}
	for _, k := range e.HeaderPresent {
		if resp.Header.Get(k) == "" {
			return fail("want a " + k)
		}
	}
	if e.Body != nil && string(body) != *e.Body {
		return fail("want body " + *e.Body)
	}
	if e.Problem != "" {
		var p struct {
			Type   string `json:"type"`
			Status int    `json:"status"`
		}
		if resp.Header.Get("Content-Type") != "application/problem+json" || json.Unmarshal(body, &p) != nil ||
			p.Type != e.Problem || p.Status != e.Status {
			return fail("want problem " + e.Problem)
		}
	}
	return resp.Header.Get("Idempotency-Result"), nil
}

func fmtHeader(h http.Header) string {
	b, _ := json.Marshal(h)
	return string(b)
}
