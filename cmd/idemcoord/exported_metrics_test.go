package main

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// exportedMetricsFile lists every sample name, with its label names, that
// the binary's /metrics shows once each kind of call has happened. The deploy package's tests check
// that every metric the Prometheus alerts and the Grafana dashboard name
// is in it.
const exportedMetricsFile = "../../deploy/testdata/exported-metrics.txt"

// TestExportedMetricsList runs the binary, makes every domain counter
// count (acquire, in progress, replay, fingerprint mismatch, lapsed lease
// and takeover, lost lease, found expired, Fail UNKNOWN, archive), scrapes
// /metrics and compares the sample names with deploy/testdata/
// exported-metrics.txt. IDEMCOORD_UPDATE_METRICS=1 rewrites the file.
func TestExportedMetricsList(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("defaults: { unknown_retention: 1s }\nreaper: { interval: 1s }\nscopes:\n  - { match: s }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	httpAddr := coordtest.FreeAddr(t)
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), httpAddr, "--config", cfg)
	defer p.stop()
	conn, err := grpc.NewClient(p.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := idempotencyv1.NewCoordinatorClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	begin := func(key string, mod func(*idempotencyv1.BeginRequest)) *idempotencyv1.BeginResponse {
		t.Helper()
		req := &idempotencyv1.BeginRequest{Scope: "s", Key: key}
		if mod != nil {
			mod(req)
		}
		r, err := c.Begin(ctx, req)
		if err != nil && key != "mismatch" {
			t.Fatalf("Begin %s: %v", key, err)
		}
		return r
	}
	complete := func(key, token string) error {
		_, err := c.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "s", Key: key, LeaseToken: token})
		return err
	}

	b := begin("replay", nil)
	begin("replay", nil) // in progress
	if err := complete("replay", b.GetLeaseToken()); err != nil {
		t.Fatal(err)
	}
	begin("replay", nil)
	begin("mismatch", func(r *idempotencyv1.BeginRequest) { r.Fingerprint = []byte("a") })
	begin("mismatch", func(r *idempotencyv1.BeginRequest) { r.Fingerprint = []byte("b") })
	lapsed := begin("lapsed", func(r *idempotencyv1.BeginRequest) { r.Lease = durationpb.New(time.Second) })
	b = begin("expired", func(r *idempotencyv1.BeginRequest) { r.Ttl = durationpb.New(time.Second) })
	if err := complete("expired", b.GetLeaseToken()); err != nil {
		t.Fatal(err)
	}
	b = begin("unknown", nil)
	if _, err := c.Fail(ctx, &idempotencyv1.FailRequest{Scope: "s", Key: "unknown", LeaseToken: b.GetLeaseToken(),
		Kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1200 * time.Millisecond)
	begin("lapsed", nil)  // takes over the lapsed lease
	begin("expired", nil) // finds it expired
	if err := complete("lapsed", lapsed.GetLeaseToken()); err == nil {
		t.Fatal("Complete with the lapsed token succeeded")
	}

	// Wait for the reaper to archive the UNKNOWN record (1 s retention).
	var names []string
	deadline := time.Now().Add(30 * time.Second)
	for {
		names = scrapeNames(t, httpAddr)
		if slices.Contains(names, "idempotency_archived_total{scope}") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no idempotency_archived_total after 30s\n%s", p.logs)
		}
		time.Sleep(200 * time.Millisecond)
	}
	want := "# Sample names (and their labels) on idemcoord's /metrics once every kind of call has happened.\n" +
		"# Written by TestExportedMetricsList (cmd/idemcoord) with IDEMCOORD_UPDATE_METRICS=1.\n" +
		strings.Join(names, "\n") + "\n"
	if os.Getenv("IDEMCOORD_UPDATE_METRICS") == "1" {
		if err := os.WriteFile(exportedMetricsFile, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	got, err := os.ReadFile(exportedMetricsFile)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Errorf("%s is stale: run IDEMCOORD_UPDATE_METRICS=1 go test -run '^TestExportedMetricsList$' ./cmd/idemcoord/ and commit it; /metrics shows:\n%s", exportedMetricsFile, want)
	}
}

// scrapeNames returns the sorted sample names /metrics shows, each with
// its label names (`name{a,b}`), without the Go runtime's and the
// process's (which depend on the platform).
func scrapeNames(t *testing.T, httpAddr string) []string {
	t.Helper()
	body := scrapeMetrics(t, httpAddr)
	labels := map[string]map[string]bool{}
	name := regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*`)
	label := regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="`)
	for l := range strings.SplitSeq(body, "\n") {
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		n := name.FindString(l)
		if strings.HasPrefix(n, "go_") || strings.HasPrefix(n, "process_") {
			continue
		}
		if labels[n] == nil {
			labels[n] = map[string]bool{}
		}
		if set, _, ok := strings.Cut(strings.TrimPrefix(l, n), "}"); ok {
			for _, m := range label.FindAllStringSubmatch(set, -1) {
				labels[n][m[1]] = true
			}
		}
	}
	out := make([]string, 0, len(labels))
	for n, ls := range labels {
		names := slices.Sorted(maps.Keys(ls))
		out = append(out, n+"{"+strings.Join(names, ",")+"}")
	}
	slices.Sort(out)
	return out
}
