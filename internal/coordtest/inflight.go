package coordtest

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"testing"
	"time"
)

// InFlight is the number of calls of the Coordinator method (for instance
// "Begin") the server has started and not yet answered, read from its
// gRPC server metrics. Tests wait on it instead of sleeping, for instance
// until a Begin with wait is really waiting.
func (c *Coordinator) InFlight(method string) int {
	rec := httptest.NewRecorder()
	c.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	text := rec.Body.String()
	sum := func(metric string) int {
		re := regexp.MustCompile(`(?m)^` + metric + `\{[^}]*grpc_method="` + regexp.QuoteMeta(method) +
			`"[^}]*grpc_service="idempotency\.v1\.Coordinator"[^}]*\} (\d+)$`)
		n := 0
		for _, m := range re.FindAllStringSubmatch(text, -1) {
			v, _ := strconv.Atoi(m[1])
			n += v
		}
		return n
	}
	return sum("grpc_server_started_total") - sum("grpc_server_handled_total")
}

// WaitInFlight polls InFlight until n calls of method are in flight,
// failing t after a generous minute.
func (c *Coordinator) WaitInFlight(t testing.TB, method string, n int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for c.InFlight(method) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d %s calls in flight after a minute, want %d", c.InFlight(method), method, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
