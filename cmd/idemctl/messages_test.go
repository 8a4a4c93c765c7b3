package main

import (
	"strings"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestUsageErrorMessages: each command-line mistake exits 2 with its own
// message (not merely some error), followed by the pointer to help.
func TestUsageErrorMessages(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{nil, "no command"},
		{[]string{"frobnicate"}, `unknown command "frobnicate"`},
		{[]string{"lookup", "only-scope"}, "lookup wants SCOPE KEY, got 1 argument(s)"},
		{[]string{"lookup", "s", "k", "extra"}, "lookup wants SCOPE KEY, got 3 argument(s)"},
		{[]string{"list", "--state", "bogus"}, `unknown state "bogus" (want one of in_progress, completed, failed_retryable, failed_replayable, expired, unknown)`},
		{[]string{"list", "--state", "unspecified"}, `unknown state "unspecified" (want one of in_progress, completed, failed_retryable, failed_replayable, expired, unknown)`},
		{[]string{"list", "--limit", "-1"}, "--limit must be 0 (all) or more, got -1"},
		{[]string{"list", "--output", "yaml"}, `--output must be table or json, got "yaml"`},
		{[]string{"resolve", "s", "k"}, "resolve needs --as completed or --as retryable"},
		{[]string{"resolve", "s", "k", "--as", "done"}, `--as must be completed or retryable, got "done"`},
		{[]string{"resolve", "s", "k", "--as", "retryable", "--body-file", "x"},
			"--as retryable stores no response: drop --body-file, --schema-version, --content-type and --status-code"},
		{[]string{"resolve", "s", "k", "--as", "completed", "--status-code", "two"}, `--status-code must be a 32-bit integer, got "two"`},
		{[]string{"forget", "s", "k", "--no-such-flag"}, "forget: flag provided but not defined: -no-such-flag"},
	} {
		r := idemctl(t, "127.0.0.1:1", nil, "", tc.args...)
		want := "idemctl: " + tc.msg + "\nrun 'idemctl help' for usage\n"
		if r.code != 2 || !strings.HasPrefix(r.stderr, want) || r.stdout != "" {
			t.Errorf("idemctl %q: exit %d, stdout %q, stderr %q; want exit 2 and %q", tc.args, r.code, r.stdout, r.stderr, want)
		}
	}
	r := idemctl(t, "127.0.0.1:1", nil, "", "resolve", "s", "k", "--as", "completed", "--body-file", "/nonexistent/body")
	if want := "idemctl: read the body: open /nonexistent/body: no such file or directory\n"; r.code != 1 || r.stderr != want {
		t.Errorf("missing body file: exit %d, stderr %q; want exit 1 and %q", r.code, r.stderr, want)
	}
}

// wantLeaseLost fails unless err is FAILED_PRECONDITION with reason
// LEASE_LOST (a token that does not hold the lease).
func wantLeaseLost(t *testing.T, err error) {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.FailedPrecondition {
		t.Fatalf("error %v, want FAILED_PRECONDITION", err)
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetReason() == "LEASE_LOST" {
			return
		}
	}
	t.Fatalf("error %v: no ErrorInfo LEASE_LOST", err)
}
