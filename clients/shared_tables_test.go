package clients

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// sharedTables is clients/testdata/shared_tables.json: the tables the Node
// and Python libraries load instead of copying them.
type sharedTables struct {
	Comment           string            `json:"comment"`
	ErrorInfoDomain   string            `json:"error_info_domain"`
	ProblemTypes      map[string]string `json:"problem_types"`
	HTTPHeaders       map[string]string `json:"http_headers"`
	FailureKindByCode map[string]string `json:"failure_kind_by_code"`
	Release           struct {
		Reason    string `json:"reason"`
		TimeoutMS int64  `json:"timeout_ms"`
	} `json:"release"`
	TimingsMS map[string]int64 `json:"timings_ms"`
}

func readSharedTables(t *testing.T, path string) sharedTables {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var st sharedTables
	if err := dec.Decode(&st); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return st
}

func equalMaps[V comparable](t *testing.T, what string, got, want map[string]V) {
	t.Helper()
	for k, w := range want {
		if g, ok := got[k]; !ok || g != w {
			t.Errorf("%s[%q] = %v (present %v), Go has %v", what, k, g, ok, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s has %q = %v, which Go does not", what, k, g)
		}
	}
}

// TestSharedTablesAreGos holds clients/testdata/shared_tables.json, which
// the Node and Python libraries load, against the Go client's constants:
// a table changed in one language and not the other fails here.
func TestSharedTablesAreGos(t *testing.T) {
	st := readSharedTables(t, filepath.Join("testdata", "shared_tables.json"))
	if st.ErrorInfoDomain != ErrorDomain {
		t.Errorf("error_info_domain = %q, Go's ErrorDomain is %q", st.ErrorInfoDomain, ErrorDomain)
	}
	equalMaps(t, "problem_types", st.ProblemTypes, map[string]string{
		"key_missing":        ProblemKeyMissing,
		"key_invalid":        ProblemKeyInvalid,
		"key_reused":         ProblemKeyReused,
		"key_expired":        ProblemKeyExpired,
		"attempts_exhausted": ProblemAttemptsExhausted,
		"in_progress":        ProblemInProgress,
		"outcome_unknown":    ProblemOutcomeUnknown,
		"body_too_large":     ProblemBodyTooLarge,
		"unavailable":        ProblemUnavailable,
		"lease_lost":         ProblemLeaseLost,
		"internal":           ProblemInternal,
	})
	equalMaps(t, "http_headers", st.HTTPHeaders, map[string]string{
		"key":      HTTPKeyHeader,
		"result":   HTTPResultHeader,
		"replayed": HTTPReplayedHeader,
		"expires":  HTTPExpiresHeader,
	})
	goKinds := defaultFailureKinds()
	seen := map[codes.Code]bool{}
	for name, kind := range st.FailureKindByCode {
		var c codes.Code
		if err := c.UnmarshalJSON([]byte(`"` + name + `"`)); err != nil {
			t.Errorf("failure_kind_by_code: %q is not a gRPC code name: %v", name, err)
			continue
		}
		if _, ok := idempotencyv1.FailureKind_value[kind]; !ok {
			t.Errorf("failure_kind_by_code[%q] = %q, not an idempotency.v1.FailureKind", name, kind)
		}
		seen[c] = true
		if want, ok := goKinds[c]; !ok || want.String() != kind {
			t.Errorf("failure_kind_by_code[%q] = %q, Go's table has %v (present %v)", name, kind, want, ok)
		}
	}
	for c, kind := range goKinds {
		if !seen[c] {
			t.Errorf("failure_kind_by_code lacks %v (Go: %v)", c, kind)
		}
	}
	if st.Release.Reason != ReleaseReason {
		t.Errorf("release.reason = %q, Go's ReleaseReason is %q", st.Release.Reason, ReleaseReason)
	}
	if got := time.Duration(st.Release.TimeoutMS) * time.Millisecond; got != releaseTimeout {
		t.Errorf("release.timeout_ms = %v, Go's releaseTimeout is %v", got, releaseTimeout)
	}
	equalMaps(t, "timings_ms", st.TimingsMS, map[string]int64{
		"default_lease":  defaultLease.Milliseconds(),
		"min_heartbeat":  minHeartbeat.Milliseconds(),
		"finish_timeout": finishTimeout.Milliseconds(),
		"max_begin_wait": maxBeginWait.Milliseconds(),
	})
}

// TestSharedTablesNodeCopy: the Node package ships a copy of the shared
// tables (`make generate` writes it); it must be the file itself.
func TestSharedTablesNodeCopy(t *testing.T) {
	want, err := os.ReadFile(filepath.Join("testdata", "shared_tables.json"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join("node", "shared_tables.json"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Error("clients/node/shared_tables.json differs from clients/testdata/shared_tables.json: run `make generate`")
	}
}
