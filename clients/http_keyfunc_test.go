package clients_test

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/idemcoord/idemcoord/clients"
)

// orderIDKey is a WithHTTPKeyFunc that takes the key from the JSON body's
// order_id; a body of "boom" makes it fail.
func orderIDKey(_ *http.Request, body []byte) (string, error) {
	if string(body) == "boom" {
		return "", errors.New("the order id cannot be read")
	}
	var v struct {
		OrderID string `json:"order_id"`
	}
	_ = json.Unmarshal(body, &v)
	return v.OrderID, nil
}

// A key taken from the payload is refused as a header's would be when it is
// not a key, and a failing key function answers 400: the handler runs for
// neither.
func TestHTTPKeyFuncRefusesBadKeys(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPKeyFunc(orderIDKey)}})
	long := strings.Repeat("k", 256)
	for _, tc := range []struct{ name, body, detail string }{
		{"too long", `{"order_id":"` + long + `"}`, "more than 255"},
		{"control character", `{"order_id":"a\nb"}`, "control character"},
		{"function fails", "boom", "the order id cannot be read"},
	} {
		r := f.send(t, http.MethodPost, "/projects", "", tc.body)
		p := wantProblem(t, r, http.StatusBadRequest, clients.ProblemKeyInvalid)
		if d, _ := p["detail"].(string); !strings.Contains(d, tc.detail) {
			t.Errorf("%s: detail %q, want it to say %q", tc.name, d, tc.detail)
		}
	}
	if n := f.runs.Load(); n != 0 {
		t.Fatalf("the handler ran %d times for refused keys", n)
	}
}

// With WithHTTPRequireKey, a request whose payload yields no key (and that
// sends no header) answers 400 ProblemKeyMissing; one whose payload yields a
// key runs, records under that key, and replays.
func TestHTTPKeyFuncWithRequiredKey(t *testing.T) {
	t.Parallel()
	f := startHTTP(t, httpSetup{opts: []clients.HTTPOption{clients.WithHTTPKeyFunc(orderIDKey), clients.WithHTTPRequireKey()}})
	wantProblem(t, f.send(t, http.MethodPost, "/projects", "", `{"name":"a"}`), http.StatusBadRequest, clients.ProblemKeyMissing)
	if n := f.runs.Load(); n != 0 {
		t.Fatalf("the handler ran %d times without a key", n)
	}
	first := f.send(t, http.MethodPost, "/projects", "", `{"order_id":"order-7","name":"a"}`)
	again := f.send(t, http.MethodPost, "/projects", "", `{"order_id":"order-7","name":"a"}`)
	if first.status != http.StatusCreated || again.status != http.StatusCreated || first.body != again.body ||
		again.header.Get("Idempotency-Result") != "replayed" || again.header.Get("Idempotency-Key") != "order-7" {
		t.Fatalf("first %v, again %v: want the second replayed under order-7", first, again)
	}
	if n := f.runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	if rec, code := f.record(t, "order-7"); code != codes.OK || rec.GetState().String() != "STATE_COMPLETED" {
		t.Fatalf("record of order-7: %v %v", rec, code)
	}
}

// The handler reads the whole body that the key function read, and a body
// over WithHTTPMaxBodyBytes answers 413 before the function is called.
func TestHTTPKeyFuncLeavesTheBodyToTheHandler(t *testing.T) {
	t.Parallel()
	var called bool
	keyFunc := func(r *http.Request, body []byte) (string, error) {
		called = true
		return orderIDKey(r, body)
	}
	f := startHTTP(t, httpSetup{
		opts: []clients.HTTPOption{clients.WithHTTPKeyFunc(keyFunc), clients.WithHTTPMaxBodyBytes(64)},
		handler: func(w http.ResponseWriter, r *http.Request, _ int32) {
			b, err := io.ReadAll(r.Body)
			if err != nil {
				t.Error(err)
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(append([]byte("got "), b...))
		},
	})
	body := `{"order_id":"o-1","n":1}`
	if r := f.send(t, http.MethodPost, "/projects", "", body); r.status != http.StatusCreated || r.body != "got "+body {
		t.Fatalf("got %v, want the handler to read the whole body", r)
	}
	called = false
	wantProblem(t, f.send(t, http.MethodPost, "/projects", "", `{"order_id":"o-2","pad":"`+strings.Repeat("x", 100)+`"}`),
		http.StatusRequestEntityTooLarge, clients.ProblemBodyTooLarge)
	if called {
		t.Fatal("the key function was called for a body over the limit")
	}
}
