package main

import (
	"regexp"
	"strconv"
	"testing"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/server"
)

// TestGCPercent checks the binary's garbage-collector target on /metrics
// (go_gc_gogc_percent): defaultGCPercent when GOGC is not set, and the
// operator's GOGC when it is.
func TestGCPercent(t *testing.T) {
	bin, dbURL := coordtest.BuildBinary(t), pgtest.NewDatabase(t)
	for _, tc := range []struct{ gogc, want string }{{"", "400"}, {"150", "150"}} {
		t.Run("GOGC="+tc.gogc, func(t *testing.T) {
			t.Setenv("GOGC", tc.gogc)
			grpcAddr, httpAddr := coordtest.FreeAddr(t), coordtest.FreeAddr(t)
			p := launch(t, bin, []string{"DATABASE_URL=" + dbURL}, "--listen", grpcAddr, "--http-listen", httpAddr)
			waitFor(t, "SERVING", p, func() bool { return serving(grpcAddr, insecure.NewCredentials()) })
			if got := runtimeMetric(t, httpAddr, "go_gc_gogc_percent"); got != tc.want {
				t.Fatalf("go_gc_gogc_percent = %q with GOGC=%q, want %s", got, tc.gogc, tc.want)
			}
		})
	}
}

// TestMemoryLimit checks the binary's Go memory limit on /metrics
// (go_gc_gomemlimit_bytes): 256 MiB plus twice the HTTP listener's budgets
// of buffered bodies (the API's, here 8 MiB, and the 1 MiB of other
// requests) and the gRPC listener's of request messages (the API's, here
// 20 MiB, and 16 open calls of health or reflection) when GOMEMLIMIT is
// not set, and the operator's GOMEMLIMIT when it is.
func TestMemoryLimit(t *testing.T) {
	bin, dbURL := coordtest.BuildBinary(t), pgtest.NewDatabase(t)
	for _, tc := range []struct {
		gomemlimit string
		want       float64
	}{{"", 256<<20 + 2*(8<<20+1<<20+20<<20+16*server.GRPCBufferedCallBytes)}, {"1GiB", 1 << 30}} {
		t.Run("GOMEMLIMIT="+tc.gomemlimit, func(t *testing.T) {
			t.Setenv("GOMEMLIMIT", tc.gomemlimit)
			grpcAddr, httpAddr := coordtest.FreeAddr(t), coordtest.FreeAddr(t)
			p := launch(t, bin, []string{"DATABASE_URL=" + dbURL, "IDEMCOORD_HTTP_MAX_BUFFERED_BYTES=" + strconv.Itoa(8<<20),
				"IDEMCOORD_GRPC_MAX_BUFFERED_BYTES=" + strconv.Itoa(20<<20)}, "--listen", grpcAddr, "--http-listen", httpAddr)
			waitFor(t, "SERVING", p, func() bool { return serving(grpcAddr, insecure.NewCredentials()) })
			got := runtimeMetric(t, httpAddr, "go_gc_gomemlimit_bytes")
			if v, err := strconv.ParseFloat(got, 64); err != nil || v != tc.want {
				t.Fatalf("go_gc_gomemlimit_bytes = %s with GOMEMLIMIT=%q, want %.0f", got, tc.gomemlimit, tc.want)
			}
		})
	}
}

// runtimeMetric reads the unlabelled metric name from the binary's
// /metrics.
func runtimeMetric(t *testing.T, httpAddr, name string) string {
	t.Helper()
	b := scrapeMetrics(t, httpAddr)
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindStringSubmatch(b)
	if m == nil {
		t.Fatalf("no %s on /metrics:\n%s", name, b)
	}
	return m[1]
}
