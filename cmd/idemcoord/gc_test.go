package main

import (
	"io"
	"net/http"
	"regexp"
	"testing"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
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
			if got := gogcPercent(t, httpAddr); got != tc.want {
				t.Fatalf("go_gc_gogc_percent = %q with GOGC=%q, want %s", got, tc.gogc, tc.want)
			}
		})
	}
}

// gogcPercent reads go_gc_gogc_percent from the binary's /metrics.
func gogcPercent(t *testing.T, httpAddr string) string {
	t.Helper()
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go_gc_gogc_percent (\S+)$`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("no go_gc_gogc_percent on /metrics:\n%s", b)
	}
	return string(m[1])
}
