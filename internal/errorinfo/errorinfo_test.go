package errorinfo_test

import (
	"strings"
	"testing"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/errorinfo"
)

// TestReasonsRoundTrip: every ErrorReason but UNSPECIFIED has a wire name
// without the prefix that parses back to it; other names parse to
// UNSPECIFIED.
func TestReasonsRoundTrip(t *testing.T) {
	for n, name := range idempotencyv1.ErrorReason_name {
		r := idempotencyv1.ErrorReason(n)
		if r == idempotencyv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
			continue
		}
		wire := errorinfo.Reason(r)
		if wire != strings.TrimPrefix(name, "ERROR_REASON_") || wire == name {
			t.Errorf("Reason(%s) = %q", name, wire)
		}
		if got := errorinfo.Parse(wire); got != r {
			t.Errorf("Parse(%q) = %s, want %s", wire, got, name)
		}
		if ei := errorinfo.New(r); ei.GetReason() != wire || ei.GetDomain() != "idempotency.v1" {
			t.Errorf("New(%s) = %v", name, ei)
		}
	}
	if got := errorinfo.Reason(idempotencyv1.ErrorReason_ERROR_REASON_LEASE_LOST); got != "LEASE_LOST" {
		t.Errorf("Reason(LEASE_LOST) = %q", got)
	}
	for _, s := range []string{"", "UNSPECIFIED", "ERROR_REASON_LEASE_LOST", "lease_lost", "CARD_DECLINED"} {
		if got := errorinfo.Parse(s); got != idempotencyv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
			t.Errorf("Parse(%q) = %s, want UNSPECIFIED", s, got)
		}
	}
}
