// Package projectshttp is idemcoord's demo HTTP service: a small JSON API
// whose POST /projects and POST /charges are side effects, made idempotent
// by clients.HTTPMiddleware (see NewHandler). It is the HTTP twin of
// examples/projects, and tells the same ghost-project story: a user whose
// "create Flower Shop" is sent twice (a double click, a proxy's retry, a
// mobile client on a bad network) gets one project, not a ghost second one.
//
// Its state lives in memory behind a mutex; "authentication" is the
// X-User-Id header, which is enough to show how the end user is folded into
// idempotency keys. Do not copy those two parts.
package projectshttp

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"

	"github.com/google/uuid"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// UserHeader is the demo's stand-in for authentication: the calling user's
// id.
const UserHeader = "X-User-Id"

// DefaultLimitCents is the amount above which a charge is declined.
const DefaultLimitCents = 100_000

// Project is a stored project.
type Project struct {
	ID     string `json:"id"`
	Owner  string `json:"owner"`
	Name   string `json:"name"`
	Prompt string `json:"prompt,omitempty"`
}

// Charge is a booked charge.
type Charge struct {
	ID          string `json:"id"`
	AccountID   string `json:"account_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// Job is an accepted export job: its id is the outcome of the request and
// is replayed; the request id belongs to each request, and a replay
// carries the replaying request's own (see IdempotencyOptions).
type Job struct {
	ID        string `json:"job_id"`
	RequestID string `json:"request_id"`
}

// RequestIDHeader is the request header a client may name its request with;
// without it the demo makes up a request id.
const RequestIDHeader = "X-Request-Id"

// Store keeps projects, charges and jobs in memory.
type Store struct {
	mu       sync.Mutex
	projects []Project
	charges  []Charge
	jobs     int
}

// NewStore returns an empty Store.
func NewStore() *Store { return &Store{} }

// Projects returns every stored project in creation order.
func (s *Store) Projects() []Project {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Project(nil), s.projects...)
}

// Jobs returns how many export jobs were started.
func (s *Store) Jobs() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.jobs
}

// Charges returns every booked charge in order.
func (s *Store) Charges() []Charge {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Charge(nil), s.charges...)
}

// NewHandler serves the demo API over store, with the demo's
// authentication and idempotency through idem:
//
//	POST /projects        {"name": "Flower Shop", "prompt": "…"} → 201, Location /projects/prj_N
//	POST /charges         {"account_id": "acct_1", "amount_cents": 1250, "currency": "EUR"} → 201, or 422 declined
//	POST /exports         {} → 202 {"job_id": "job_N", "request_id": "…"}
//	GET  /projects/{id}   → 200, or 404
//
// Every POST requires an Idempotency-Key.
func NewHandler(idem *clients.Client, store *Store) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /projects", store.createProject)
	mux.HandleFunc("POST /charges", store.charge)
	mux.HandleFunc("POST /exports", store.startExport)
	mux.HandleFunc("GET /projects/{id}", store.getProject)
	return Authenticate(clients.HTTPMiddleware(idem, IdempotencyOptions()...)(mux)) // the one line
}

// IdempotencyOptions are the middleware options of the demo:
//
//   - the end user is folded into every key, so two users who send the same
//     Idempotency-Key never share a record;
//   - every POST needs an Idempotency-Key (400 problem+json without one);
//   - POST /projects is fingerprinted on the normalized name only (see
//     clients.NormalizeName): a retry of the same intent may retype
//     " Flower  Shop " or reword the free-text prompt;
//   - a replayed POST /exports keeps its job id (the outcome) and carries
//     the replaying request's own request id (see refreshRequestID).
func IdempotencyOptions() []clients.HTTPOption {
	return []clients.HTTPOption{
		clients.WithHTTPPrincipal(func(r *http.Request) (string, error) { return UserFrom(r.Context()), nil }),
		clients.WithHTTPRequireKey(),
		clients.WithHTTPFingerprintFunc(fingerprint),
		clients.WithHTTPReplayHook(refreshRequestID),
	}
}

// refreshRequestID is the demo's replay hook: a replayed job answer gets
// the request id of the request it answers; the stored record keeps the
// first one. Other replays are answered as stored.
func refreshRequestID(r *http.Request, stored *idempotencyv1.StoredResponse) *idempotencyv1.StoredResponse {
	var job Job
	if r.URL.Path != "/exports" || json.Unmarshal(stored.GetBody(), &job) != nil {
		return nil
	}
	job.RequestID = requestID(r)
	body, err := json.Marshal(job)
	if err != nil {
		return nil
	}
	body = append(body, '\n')
	stored.Body = body
	return stored
}

// requestID is the request's X-Request-Id, or a new one.
func requestID(r *http.Request) string {
	if id := r.Header.Get(RequestIDHeader); id != "" {
		return id
	}
	return uuid.NewString()
}

func fingerprint(r *http.Request, body []byte) ([]byte, error) {
	if r.URL.Path != "/projects" {
		return clients.HTTPFingerprint(r, body), nil
	}
	var req struct{ Name string }
	if err := json.Unmarshal(body, &req); err != nil {
		return nil, fmt.Errorf("the body is not a JSON project: %w", err)
	}
	normalized, _ := json.Marshal(map[string]string{"name": clients.NormalizeName(req.Name)})
	return clients.HTTPFingerprint(r, normalized), nil
}

type userKey struct{}

// Authenticate is the demo's authentication middleware: it takes the user
// from the X-User-Id header and refuses requests without one.
func Authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user := r.Header.Get(UserHeader)
		if user == "" {
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "send your user id as X-User-Id"})
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), userKey{}, user)))
	})
}

// UserFrom returns the user that Authenticate found.
func UserFrom(ctx context.Context) string {
	u, _ := ctx.Value(userKey{}).(string)
	return u
}

func (s *Store) createProject(w http.ResponseWriter, r *http.Request) {
	var req struct{ Name, Prompt string }
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || strings.TrimSpace(req.Name) == "" {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "send {\"name\": …} with a name"})
		return
	}
	s.mu.Lock()
	p := Project{ID: fmt.Sprintf("prj_%d", len(s.projects)+1), Owner: UserFrom(r.Context()), Name: req.Name, Prompt: req.Prompt}
	s.projects = append(s.projects, p)
	s.mu.Unlock()
	w.Header().Set("Location", "/projects/"+p.ID)
	writeJSON(w, http.StatusCreated, p)
}

func (s *Store) charge(w http.ResponseWriter, r *http.Request) {
	var req Charge
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.AccountID == "" || req.AmountCents <= 0 {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "send account_id and a positive amount_cents"})
		return
	}
	if req.AmountCents > DefaultLimitCents {
		// A business answer: stored and replayed (422 is replayable).
		writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"error": "card declined: amount above the limit"})
		return
	}
	s.mu.Lock()
	req.ID = fmt.Sprintf("ch_%d", len(s.charges)+1)
	s.charges = append(s.charges, req)
	s.mu.Unlock()
	w.Header().Set("Location", "/charges/"+req.ID)
	writeJSON(w, http.StatusCreated, req)
}

func (s *Store) startExport(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.jobs++
	job := Job{ID: fmt.Sprintf("job_%d", s.jobs), RequestID: requestID(r)}
	s.mu.Unlock()
	writeJSON(w, http.StatusAccepted, job)
}

func (s *Store) getProject(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.projects {
		if p.ID == r.PathValue("id") {
			writeJSON(w, http.StatusOK, p)
			return
		}
	}
	writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such project"})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
