package server_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// TestReloadRefusesWhatTakesARestart: Server.Reload is all-or-nothing: an
// unreadable, empty, comment-only or invalid file, one that turns auth off
// or on or changes the encryption keys, and one a caller's check refuses
// (the exposure check) leave the configuration in force and count in
// idempotency_config_reload_failures_total; a valid file is put in force.
func TestReloadRefusesWhatTakesARestart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key := writeKey(t, dir, "k1")
	enc := "encryption: { active_key: k1, keys: [{ id: k1, file: " + key + " }] }\n"
	tenants := fmt.Sprintf("tenants:\n  - { name: a, token_sha256: %s, scopes: [\"*\"] }\n", sha("a-secret"))
	c := coordtest.Start(t, coordtest.Options{Config: tenants + enc})
	path := filepath.Join(dir, "config.yaml")
	reload := func(content string, checks ...func(*server.Policies) error) error {
		t.Helper()
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := c.Server.Reload(path, checks...)
		return err
	}
	failures := func() string {
		rec := httptest.NewRecorder()
		c.Server.HTTPHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		for l := range strings.SplitSeq(rec.Body.String(), "\n") {
			if v, ok := strings.CutPrefix(l, "idempotency_config_reload_failures_total "); ok {
				return v
			}
		}
		return "absent"
	}
	exposed := errors.New("exposure check refused")
	n := 0
	for name, tc := range map[string]struct {
		content string
		check   func(*server.Policies) error
		want    string
	}{
		"empty":            {"", nil, "is empty"},
		"only comments":    {"# nothing\n", nil, "is empty"},
		"invalid":          {tenants + enc + "limits: { max_key_bytes: -1 }\n", nil, "max_key_bytes"},
		"auth off":         {"scopes: [{ match: build }]\n" + enc, nil, "turning auth off takes a restart"},
		"encryption off":   {tenants, nil, "encryption"},
		"another key":      {tenants + "encryption: { active_key: k2, keys: [{ id: k2, file: " + key + " }] }\n", nil, "encryption"},
		"legacy switch":    {tenants + "encryption: { active_key: k1, accept_legacy_rows: true, keys: [{ id: k1, file: " + key + " }] }\n", nil, "encryption"},
		"check refuses it": {tenants + enc, func(*server.Policies) error { return exposed }, "exposure check refused"},
	} {
		err := reload(tc.content, tc.check)
		n++
		if !errors.Is(err, server.ErrReloadRefused) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want a refusal saying %q", name, err, tc.want)
		}
	}
	if _, err := c.Server.Reload(filepath.Join(dir, "missing.yaml")); !errors.Is(err, server.ErrReloadRefused) {
		t.Errorf("missing file: %v", err)
	}
	n++
	if got := failures(); got != fmt.Sprint(n) {
		t.Fatalf("idempotency_config_reload_failures_total = %s, want %d", got, n)
	}
	if err := reload(tenants + enc + "scopes: [{ match: build, ttl: 60s }]\n"); err != nil {
		t.Fatalf("a valid reload: %v", err)
	}
	if got := failures(); got != fmt.Sprint(n) {
		t.Fatalf("a valid reload counted as a failure: %s", got)
	}

	// Auth cannot be turned on by a reload either.
	open := coordtest.Start(t, coordtest.Options{})
	if err := os.WriteFile(path, []byte(tenants), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := open.Server.Reload(path); err == nil || !strings.Contains(err.Error(), "turning auth on takes a restart") {
		t.Fatalf("auth on by reload: %v", err)
	}
}
