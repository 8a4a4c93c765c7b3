package clients_test

import (
	"bytes"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemcoord/idemcoord/clients"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// HTTPMiddleware, like the interceptor, warns once at construction when
// whom keys belong to was not decided (neither WithHTTPPrincipal nor
// WithoutHTTPPrincipal), and never per request.
func TestHTTPPrincipalIsADecision(t *testing.T) {
	t.Parallel()
	coord := coordtest.Start(t, coordtest.Options{})
	conn := coord.Dial(t)
	const warning = "idempotency: HTTPMiddleware built without WithHTTPPrincipal or WithoutHTTPPrincipal: " +
		"two end users who send the same idempotency key and request share one record"
	for _, tc := range []struct {
		name string
		opts []clients.HTTPOption
		warn bool
	}{
		{"neither", nil, true},
		{"WithoutHTTPPrincipal", []clients.HTTPOption{clients.WithoutHTTPPrincipal()}, false},
		{"WithHTTPPrincipal", []clients.HTTPOption{clients.WithHTTPPrincipal(func(*http.Request) (string, error) { return "u", nil })}, false},
	} {
		var buf bytes.Buffer
		c := clients.New(conn, clients.WithLogger(slog.New(slog.NewTextHandler(&buf, nil))))
		h := clients.HTTPMiddleware(c, tc.opts...)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
		}))
		if got := strings.Count(buf.String(), warning); got != map[bool]int{true: 1, false: 0}[tc.warn] {
			t.Errorf("%s: %d warnings at construction, want warn=%v: %q", tc.name, got, tc.warn, buf.String())
		}
		if tc.warn && !strings.Contains(buf.String(), "level=WARN") {
			t.Errorf("%s: not logged as a warning: %q", tc.name, buf.String())
		}
		before := buf.String()
		for range 2 {
			req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("{}"))
			req.Header.Set(clients.HTTPKeyHeader, "k-"+tc.name)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			if rec.Code != http.StatusCreated {
				t.Fatalf("%s: %d %s", tc.name, rec.Code, rec.Body)
			}
		}
		if strings.Contains(strings.TrimPrefix(buf.String(), before), "WithHTTPPrincipal") {
			t.Errorf("%s: warned again while serving: %q", tc.name, buf.String())
		}
		if err := c.Shutdown(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
}
