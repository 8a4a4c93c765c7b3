package server_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/server"
)

// archiveOne makes key a lapsed lease and lets the reaper archive it (the
// config's unknown_retention is 1h).
func (e *testEnv) archiveOne(scope, key string) {
	e.t.Helper()
	e.mustBegin(scope, key, acquired, withLease(time.Second))
	e.clock.Advance(2 * time.Hour)
	if err := e.coord.Server.ReapOnce(context.Background()); err != nil {
		e.t.Fatal(err)
	}
}

// metric returns the line of /metrics that starts with prefix, or "".
func (e *testEnv) metric(prefix string) string {
	e.t.Helper()
	rec := httptest.NewRecorder()
	e.coord.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	for l := range strings.SplitSeq(string(body), "\n") {
		if strings.HasPrefix(l, prefix) {
			return l
		}
	}
	return ""
}

// TestReaperPrunesArchive: the reaper deletes an archived record once it is
// older than reaper.archive_retention (counted from archived_at), keeps a
// younger one, and counts what it deleted in
// idempotency_archive_pruned_total.
func TestReaperPrunesArchive(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: "defaults: { unknown_retention: 1h }\nscopes: [{ match: s }]\n" +
		"reaper: { archive_retention: 48h }\n"})
	admin := e.admin()
	e.archiveOne("s", "old")   // archived at 2h
	e.archiveOne("s", "young") // archived at 4h
	archived := &idempotencyv1.ListRecordsRequest{Archived: true}
	if got, want := listKeys(t, admin, archived), []string{"s old UNKNOWN", "s young UNKNOWN"}; !slices.Equal(got, want) {
		t.Fatalf("archive: %q, want %q", got, want)
	}
	e.clock.Advance(47 * time.Hour) // 51h: old was archived 49h ago, young 47h ago
	if err := e.coord.Server.ReapOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := listKeys(t, admin, archived), []string{"s young UNKNOWN"}; !slices.Equal(got, want) {
		t.Fatalf("archive after the retention of one: %q, want %q", got, want)
	}
	if got := e.metric("idempotency_archive_pruned_total{"); got != `idempotency_archive_pruned_total{scope="s"} 1` {
		t.Fatalf("counter: %q", got)
	}
}

// TestReaperKeepsArchiveForever: with reaper.archive_retention 0s, no
// archived record is ever deleted.
func TestReaperKeepsArchiveForever(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: "defaults: { unknown_retention: 1h }\nreaper: { archive_retention: 0s }\n"})
	e.archiveOne("s", "a")
	e.archiveOne("s", "b")
	e.clock.Advance(10 * 365 * 24 * time.Hour)
	if err := e.coord.Server.ReapOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	got := listKeys(t, e.admin(), &idempotencyv1.ListRecordsRequest{Archived: true})
	if want := []string{"s a UNKNOWN", "s b UNKNOWN"}; !slices.Equal(got, want) {
		t.Fatalf("archive after ten years: %q, want %q", got, want)
	}
	if got := e.metric("idempotency_archive_pruned_total{"); got != "" {
		t.Fatalf("counter: %q, want none", got)
	}
}

// TestArchiveRetentionConfig: reaper.archive_retention defaults to 90 days,
// 0s keeps the archive, and a negative value refuses the file with an error
// that names the key.
func TestArchiveRetentionConfig(t *testing.T) {
	t.Parallel()
	if got := server.DefaultPolicies().Reaper().ArchiveRetention; got != 2160*time.Hour {
		t.Errorf("default archive retention %v, want 2160h", got)
	}
	for text, want := range map[string]time.Duration{
		"reaper: { interval: 10s }":           2160 * time.Hour,
		"reaper: { archive_retention: 0s }":   0,
		"reaper: { archive_retention: 720h }": 720 * time.Hour,
	} {
		p, err := server.ParsePolicies([]byte(text))
		if err != nil {
			t.Errorf("%s: %v", text, err)
		} else if got := p.Reaper().ArchiveRetention; got != want {
			t.Errorf("%s: archive retention %v, want %v", text, got, want)
		}
	}
	_, err := server.ParsePolicies([]byte("reaper: { archive_retention: -1h }"))
	if err == nil || !strings.Contains(err.Error(), "archive_retention -1h0m0s: must not be negative") {
		t.Fatalf("a negative archive_retention: %v", err)
	}
}
