package projectshttp_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/examples/projectshttp"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

func TestMain(m *testing.M) { os.Exit(coordtest.Main(m)) }

// demo is the demo API, served as NewHandler wires it, in front of a real
// coordinator.
type demo struct {
	store *projectshttp.Store
	idem  *clients.Client
	url   string
}

func startDemo(t *testing.T) *demo {
	t.Helper()
	// An auth-on coordinator, as in production: the service authenticates
	// with its tenant's token (clients.WithToken).
	const token = "demo-service-token"
	sum := sha256.Sum256([]byte(token))
	coord := coordtest.Start(t, coordtest.Options{Config: "tenants:\n  - { name: demo, token_sha256: " +
		hex.EncodeToString(sum[:]) + ", scopes: [\"*\"] }\n"})
	idem := clients.New(coord.Dial(t), clients.WithToken(token))
	store := projectshttp.NewStore()
	srv := httptest.NewServer(projectshttp.NewHandler(idem, store))
	t.Cleanup(func() {
		srv.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := idem.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return &demo{store: store, idem: idem, url: srv.URL}
}

type reply struct {
	status int
	header http.Header
	body   string
}

// post sends a JSON body as user with an Idempotency-Key ("" sends none)
// and extra headers given as "Name: value".
func (d *demo) post(t *testing.T, path, user, key, body string, headers ...string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, d.url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(projectshttp.UserHeader, user)
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ": ")
		req.Header.Set(name, value)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// The ghost-project story over HTTP: the "Create" button is clicked twice
// at once and the request retried later with the name typed differently
// and the prompt reworded, all with the key the form was rendered with:
// one project. Another user with the same key gets their own.
func TestGhostProjectOverHTTP(t *testing.T) {
	t.Parallel()
	d := startDemo(t)
	const key = "form-7c1e5a0e"
	var clicks [2]reply
	var wg sync.WaitGroup
	for i := range clicks {
		wg.Go(func() {
			clicks[i] = d.post(t, "/projects", "u1", key, `{"name":"Flower Shop","prompt":"a shop that sells flowers"}`)
		})
	}
	wg.Wait()
	retry := d.post(t, "/projects", "u1", key, `{"name":" flower  shop ","prompt":"flowers!"}`)
	results := map[string]int{}
	for _, r := range append(clicks[:], retry) {
		if r.status != http.StatusCreated || r.body != clicks[0].body || r.header.Get("Location") != "/projects/prj_1" {
			t.Fatalf("answer %v, first %v", r, clicks[0])
		}
		results[r.header.Get("Idempotency-Result")]++
	}
	if results["created"] != 1 || results["replayed"] != 2 || retry.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("Idempotency-Result: %v", results)
	}
	if got := d.store.Projects(); len(got) != 1 || got[0].Prompt != "a shop that sells flowers" {
		t.Fatalf("projects after one user's retries: %v", got)
	}

	other := d.post(t, "/projects", "u2", key, `{"name":"Flower Shop"}`)
	var p projectshttp.Project
	if err := json.Unmarshal([]byte(other.body), &p); err != nil || other.status != http.StatusCreated || p.Owner != "u2" || p.ID != "prj_2" {
		t.Fatalf("second user: %v", other)
	}
	if got := d.store.Projects(); len(got) != 2 {
		t.Fatalf("projects after two users: %v", got)
	}
	// The record is found under the folded key.
	rec, err := d.idem.Lookup(context.Background(), &idempotencyv1.LookupRequest{Scope: clients.HTTPOperationScope("", "POST", "/projects"),
		Key: clients.FoldPrincipal("u1", key)})
	if err != nil || rec.GetRecord().GetState() != idempotencyv1.State_STATE_COMPLETED || rec.GetRecord().GetResponse().GetStatusCode() != 201 {
		t.Fatalf("Lookup: %v, %v", rec, err)
	}

	// The same key for another project is a client bug: 422, nothing made.
	r := d.post(t, "/projects", "u1", key, `{"name":"Tea Room"}`)
	if r.status != http.StatusUnprocessableEntity || r.header.Get("Content-Type") != "application/problem+json" ||
		!strings.Contains(r.body, clients.ProblemKeyReused) {
		t.Fatalf("same key, other project: %v", r)
	}
	if got := d.store.Projects(); len(got) != 2 {
		t.Fatalf("projects after the 422: %v", got)
	}
}

// A charge needs a key; a declined charge (422) is stored and replayed, an
// accepted one is booked once; reads pass through.
func TestChargesOverHTTP(t *testing.T) {
	t.Parallel()
	d := startDemo(t)
	r := d.post(t, "/charges", "u1", "", `{"account_id":"acct_1","amount_cents":1250,"currency":"EUR"}`)
	if r.status != http.StatusBadRequest || !strings.Contains(r.body, clients.ProblemKeyMissing) {
		t.Fatalf("charge without a key: %v", r)
	}
	for range 3 {
		r = d.post(t, "/charges", "u1", "ch-1", `{"account_id":"acct_1","amount_cents":1250,"currency":"EUR"}`)
		if r.status != http.StatusCreated || r.header.Get("Location") != "/charges/ch_1" {
			t.Fatalf("charge: %v", r)
		}
	}
	declined := d.post(t, "/charges", "u1", "ch-2", `{"account_id":"acct_1","amount_cents":500000,"currency":"EUR"}`)
	again := d.post(t, "/charges", "u1", "ch-2", `{"account_id":"acct_1","amount_cents":500000,"currency":"EUR"}`)
	if declined.status != http.StatusUnprocessableEntity || again.status != declined.status || again.body != declined.body ||
		again.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("declined %v, retried %v", declined, again)
	}
	if got := d.store.Charges(); len(got) != 1 {
		t.Fatalf("charges: %v", got)
	}
	resp, err := http.Get(d.url + "/projects/prj_9")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("GET without a user: %d", resp.StatusCode)
	}
}

// The job-API case: a retried POST /exports replays the job id (one job is
// started) and carries its own request id; the stored record keeps the
// first request's. Answers tell when the key expires.
func TestExportReplaysJobWithFreshRequestID(t *testing.T) {
	t.Parallel()
	d := startDemo(t)
	first := d.post(t, "/exports", "u1", "exp-1", `{}`, "X-Request-Id: req-a")
	retry := d.post(t, "/exports", "u1", "exp-1", `{}`, "X-Request-Id: req-b")
	var a, b projectshttp.Job
	if json.Unmarshal([]byte(first.body), &a) != nil || json.Unmarshal([]byte(retry.body), &b) != nil {
		t.Fatalf("bodies %q, %q", first.body, retry.body)
	}
	if first.status != http.StatusAccepted || retry.status != http.StatusAccepted || a.ID != "job_1" || b.ID != a.ID ||
		a.RequestID != "req-a" || b.RequestID != "req-b" || retry.header.Get("Idempotency-Result") != "replayed" {
		t.Fatalf("first %v, retry %v", first, retry)
	}
	if d.store.Jobs() != 1 {
		t.Fatalf("%d jobs started, want 1", d.store.Jobs())
	}
	for _, r := range []reply{first, retry} {
		if _, err := http.ParseTime(r.header.Get("Idempotency-Expires")); err != nil {
			t.Fatalf("Idempotency-Expires of %v: %v", r, err)
		}
	}
	rec, err := d.idem.Lookup(context.Background(), &idempotencyv1.LookupRequest{Scope: clients.HTTPOperationScope("", "POST", "/exports"),
		Key: clients.FoldPrincipal("u1", "exp-1")})
	if err != nil || string(rec.GetRecord().GetResponse().GetBody()) != first.body {
		t.Fatalf("stored %q (%v), want the first answer %q", rec.GetRecord().GetResponse().GetBody(), err, first.body)
	}
}
