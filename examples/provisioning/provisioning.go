// Package provisioning is a multi-step operation that survives crashes by
// recovery points: POST /orders charges the customer, provisions a machine
// and sends a receipt, three calls to upstreams that act each time they are
// called, behind clients.HTTPMiddleware. After each step the handler records
// a checkpoint (clients.Checkpoint) with what the steps so far returned; an
// attempt that takes the key over after a crash resumes after the last
// checkpoint (clients.CheckpointFrom) instead of starting again.
//
// Only the step after the last checkpoint is uncertain after a crash (the
// dead attempt may have called its upstream and died before recording it):
// a resuming attempt asks that one upstream whether the step happened
// (Upstream.Find) before running it. Without checkpoints the handler would
// have to ask about every step, and an upstream that cannot be asked would
// leave the key to an operator.
package provisioning

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sync"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Steps are the operation's steps, in order; each is also the phase of the
// checkpoint recorded after it and the path of its upstream.
var Steps = [...]string{"charge", "provision", "receipt"}

// Result is what the steps returned: the ids the upstreams gave. It is the
// data of every checkpoint and, complete, the answer of POST /orders.
type Result struct {
	Order   string `json:"order"`
	Charge  string `json:"charge,omitempty"`
	Machine string `json:"machine,omitempty"`
	Receipt string `json:"receipt,omitempty"`
}

func (r *Result) set(step, id string) {
	switch step {
	case "charge":
		r.Charge = id
	case "provision":
		r.Machine = id
	case "receipt":
		r.Receipt = id
	}
}

// Upstream calls the upstreams at a base URL (see NewUpstream): POST
// /{step}?order=O runs the step for order O and answers its id; GET
// /{step}?order=O answers the id of the step already run for O, or 404.
type Upstream struct {
	Base   string
	Client *http.Client
}

// Do runs step for order and returns the id the upstream gives it.
func (u Upstream) Do(ctx context.Context, step, order string) (string, error) {
	id, found, err := u.call(ctx, http.MethodPost, step, order)
	if err == nil && !found {
		err = fmt.Errorf("upstream %s: no id in the answer", step)
	}
	return id, err
}

// Find reports the id of step if it already ran for order.
func (u Upstream) Find(ctx context.Context, step, order string) (id string, found bool, err error) {
	return u.call(ctx, http.MethodGet, step, order)
}

func (u Upstream) call(ctx context.Context, method, step, order string) (string, bool, error) {
	req, err := http.NewRequestWithContext(ctx, method, u.Base+"/"+step+"?order="+url.QueryEscape(order), nil)
	if err != nil {
		return "", false, err
	}
	client := u.Client
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", false, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return "", false, err
	}
	switch {
	case resp.StatusCode == http.StatusNotFound && method == http.MethodGet:
		return "", false, nil
	case resp.StatusCode != http.StatusOK:
		return "", false, fmt.Errorf("upstream %s %s: HTTP %d %s", method, step, resp.StatusCode, bytes.TrimSpace(body))
	}
	var v struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(body, &v); err != nil || v.ID == "" {
		return "", false, fmt.Errorf("upstream %s %s: answer %q", method, step, body)
	}
	return v.ID, true, nil
}

// Options configure Handler.
type Options struct {
	// WithoutCheckpoints makes the handler record no checkpoint: after a
	// crash it starts again from the first step, asking only that step's
	// upstream whether it ran. It shows what the checkpoints buy.
	WithoutCheckpoints bool
	// Pause, when set, runs before and after each upstream call (fault
	// tests use it to widen the windows a crash can hit).
	Pause func()
	// Logger gets the handler's errors; nil discards them.
	Logger *slog.Logger
}

// Handler is the service: POST /orders (Idempotency-Key required; the key
// is the order) through clients.HTTPMiddleware on idem, calling the
// upstreams at up.
func Handler(idem *clients.Client, up Upstream, o Options) http.Handler {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Pause == nil {
		o.Pause = func() {}
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", &orders{up: up, o: o})
	return clients.HTTPMiddleware(idem, clients.WithHTTPService("provisioning"), clients.WithoutHTTPPrincipal(),
		clients.WithHTTPRequireKey())(mux)
}

type orders struct {
	up Upstream
	o  Options
}

func (h *orders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	res := Result{Order: r.Header.Get(clients.HTTPKeyHeader)}
	next := 0 // the first step this attempt has to make sure of
	if phase, data, ok := clients.CheckpointFrom(ctx); ok {
		if err := json.Unmarshal(data, &res); err != nil {
			h.fail(w, http.StatusInternalServerError, "checkpoint data", err)
			return
		}
		next = stepAfter(phase)
	}
	// An earlier attempt that died (its lease lapsed: UNKNOWN) may have run
	// the step after its last checkpoint without recording it.
	_, previous, _ := clients.AttemptFrom(ctx)
	uncertain := previous == idempotencyv1.State_STATE_UNKNOWN || previous == idempotencyv1.State_STATE_IN_PROGRESS
	for i := next; i < len(Steps); i++ {
		step := Steps[i]
		id, found := "", false
		if uncertain && i == next {
			var err error
			if id, found, err = h.up.Find(ctx, step, res.Order); err != nil {
				// Nothing ran in this attempt: 503 ends it RETRYABLE.
				h.fail(w, http.StatusServiceUnavailable, "asking upstream "+step, err)
				return
			}
		}
		if !found {
			clients.MarkSideEffect(ctx)
			h.o.Pause()
			var err error
			if id, err = h.up.Do(ctx, step, res.Order); err != nil {
				// After MarkSideEffect: the step may have run; UNKNOWN.
				h.fail(w, http.StatusBadGateway, "upstream "+step, err)
				return
			}
			h.o.Pause()
		}
		res.set(step, id)
		if h.o.WithoutCheckpoints {
			continue
		}
		data, _ := json.Marshal(res)
		if err := clients.Checkpoint(ctx, step, data); err != nil {
			if errors.Is(err, clients.ErrLeaseLost) {
				// Another attempt holds the order now; it resumes from
				// the last checkpoint it finds.
				h.fail(w, http.StatusServiceUnavailable, "checkpoint "+step, err)
				return
			}
			h.fail(w, http.StatusBadGateway, "checkpoint "+step, err)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(res)
}

func (h *orders) fail(w http.ResponseWriter, status int, what string, err error) {
	h.o.Logger.Warn("provisioning: "+what, "err", err)
	http.Error(w, what+": "+err.Error(), status)
}

// stepAfter is the index of the step after phase (len(Steps) after the last).
func stepAfter(phase string) int {
	for i, s := range Steps {
		if s == phase {
			return i + 1
		}
	}
	return 0
}

// Upstreams is a fake of the three upstreams for tests and for trying the
// example: each POST acts (it counts one effect and makes a new id), as a
// card network or a cloud API does when called twice.
type Upstreams struct {
	mu      sync.Mutex
	effects map[string]int
	ids     map[string]string
	seq     int
}

// NewUpstreams returns empty fake upstreams; serve them with their
// ServeHTTP.
func NewUpstreams() *Upstreams {
	return &Upstreams{effects: map[string]int{}, ids: map[string]string{}}
}

// Effects reports how many times step ran for order.
func (u *Upstreams) Effects(step, order string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.effects[step+"\n"+order]
}

// ServeHTTP serves POST and GET /{step}?order=O.
func (u *Upstreams) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	step, order := r.URL.Path[1:], r.URL.Query().Get("order")
	if stepAfter(step) == 0 || order == "" {
		http.Error(w, "want /charge, /provision or /receipt with ?order=", http.StatusNotFound)
		return
	}
	if r.Method != http.MethodPost && r.Method != http.MethodGet {
		http.Error(w, "POST or GET", http.StatusMethodNotAllowed)
		return
	}
	k := step + "\n" + order
	u.mu.Lock()
	id, ok := u.ids[k]
	if r.Method == http.MethodPost {
		u.seq++
		id, ok = fmt.Sprintf("%s-%d", step, u.seq), true
		u.ids[k] = id
		u.effects[k]++
	}
	u.mu.Unlock()
	if !ok {
		http.Error(w, "not run for this order", http.StatusNotFound)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]string{"id": id})
}
