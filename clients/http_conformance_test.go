package clients_test

import (
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/clients"
)

// httpOptions, conformanceStep and httpScenario are the parts of
// clients/testdata/http_conformance.json, the suite that every HTTP
// middleware (Go, Express, Fastify, ASGI, WSGI) runs; its "about" says what
// each field means.
type httpOptions struct {
	WaitMS             *int     `json:"wait_ms"`
	RequireKey         bool     `json:"require_key"`
	Methods            []string `json:"methods"`
	ReplayHeaders      []string `json:"replay_headers"`
	ReplayableStatuses []int    `json:"replayable_statuses"`
	MaxBodyBytes       int64    `json:"max_body_bytes"`
	PrincipalHeader    string   `json:"principal_header"`
	Service            string   `json:"service"`
	KeyFromJSONField   string   `json:"key_from_json_field"`
}

type conformanceStep struct {
	conformanceStepBase
	Request *struct {
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
}

func (st conformanceStep) checksState() bool { return st.Request == nil }

type httpScenario = conformanceScenario[httpOptions, conformanceStep]

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
	var calls sync.Map
	conformanceRunner[httpOptions, conformanceStep]{
		path:     "testdata/http_conformance.json",
		scope:    "POST /items", // the default scope of the suite's requests
		logLevel: slog.LevelWarn,
		serve: func(t *testing.T, idem *clients.Client, sc httpScenario) func(int, string, conformanceStep) (string, error) {
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
			if o.Service != "" {
				opts = append(opts, clients.WithHTTPService(o.Service))
			}
			if f := o.KeyFromJSONField; f != "" {
				opts = append(opts, clients.WithHTTPKeyFunc(func(_ *http.Request, body []byte) (string, error) {
					// A body that is not a JSON object has no key.
					var fields map[string]any
					_ = json.Unmarshal(body, &fields)
					k, _ := fields[f].(string)
					return k, nil
				}))
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
			return func(_ int, key string, st conformanceStep) (string, error) { return conformanceSend(srv.URL, key, st) }
		},
		handlerCalls: func(key string) int {
			n, _ := calls.LoadOrStore(key, new(int64))
			mu.Lock()
			got := *n.(*int64)
			mu.Unlock()
			return int(got)
		},
		countsError: func(i int, got map[string]int) error {
			return errors.New("step " + strconv.Itoa(i) + ": Idempotency-Result counts " + fmtCounts(got))
		},
	}.run(t)
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
	req, err := http.NewRequest(rq.Method, base+rq.Path, strings.NewReader(fill(rq.Body)))
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
