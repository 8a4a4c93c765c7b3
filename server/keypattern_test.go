package server_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/server"
)

// A scope's key_pattern refuses a key of another format with
// INVALID_ARGUMENT, ErrorInfo KEY_FORMAT and a field violation on key, and
// writes nothing; keys of the format, and keys of other scopes, pass. "uuid"
// takes the canonical form in any case; an RE2 pattern must match the whole
// key.
func TestKeyPatternRefusesMalformedKeys(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{config: `
scopes:
  - { match: "orders", key_pattern: uuid }
  - { match: "jobs", key_pattern: "job-[0-9]+" }
`})
	for _, tc := range []struct{ scope, key string }{
		{"orders", "not-a-uuid"},
		{"orders", "8e03978e-40d5-43e8-bc93-6894a57f9324x"},
		{"orders", "8e03978e40d543e8bc936894a57f9324"},
		{"orders", "{8e03978e-40d5-43e8-bc93-6894a57f9324}"},
		{"jobs", "job-12a"},
		{"jobs", "xjob-12"},
	} {
		_, err := e.begin(tc.scope, tc.key)
		st := wantCode(t, err, codes.InvalidArgument, "KEY_FORMAT")
		var onKey bool
		for _, d := range st.Details() {
			if br, ok := d.(*errdetails.BadRequest); ok {
				for _, v := range br.GetFieldViolations() {
					onKey = onKey || v.GetField() == "key"
				}
			}
		}
		if !onKey {
			t.Errorf("%s %q: no field violation on key: %v", tc.scope, tc.key, st.Details())
		}
	}
	if n := e.rowCount(); n != 0 {
		t.Fatalf("refused keys wrote %d records", n)
	}
	e.mustBegin("orders", "8E03978E-40D5-43E8-BC93-6894A57F9324", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	e.mustBegin("orders", "8e03978e-40d5-43e8-bc93-6894a57f9324", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	e.mustBegin("jobs", "job-12", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	e.mustBegin("other", "anything at all", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
}

// A key_pattern that is not RE2 refuses the file at load and at reload,
// naming the pattern; the old policy stays in force after a refused
// reload, and a reload can add a pattern.
func TestKeyPatternValidatedAtLoadAndReload(t *testing.T) {
	t.Parallel()
	bad := "scopes: [{ match: orders, key_pattern: \"(unclosed\" }]\n"
	if _, err := server.ParsePolicies([]byte(bad)); err == nil || !strings.Contains(err.Error(), "key_pattern") {
		t.Fatalf("ParsePolicies of a bad key_pattern: %v", err)
	}
	e := newEnv(t, envOptions{config: "scopes: [{ match: orders, ttl: 60s }]\n"})
	path := filepath.Join(t.TempDir(), "config.yaml")
	reload := func(content string) error {
		t.Helper()
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := e.coord.Server.Reload(path)
		return err
	}
	if err := reload(bad); err == nil || !strings.Contains(err.Error(), "key_pattern") {
		t.Fatalf("reload of a bad key_pattern: %v", err)
	}
	e.mustBegin("orders", "free-form-1", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if err := reload("scopes: [{ match: orders, ttl: 60s, key_pattern: uuid }]\n"); err != nil {
		t.Fatalf("reload: %v", err)
	}
	_, err := e.begin("orders", "free-form-2")
	wantCode(t, err, codes.InvalidArgument, "KEY_FORMAT")
	res := e.mustBegin("orders", "8e03978e-40d5-43e8-bc93-6894a57f9324", idempotencyv1.Outcome_OUTCOME_ACQUIRED)
	if got := res.GetTtl().AsDuration(); got != 60*time.Second {
		t.Fatalf("acquired Begin tells ttl %v, want the policy's 60s", got)
	}
}
