package clients_test

import (
	"testing"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/errorinfo"
)

// TestReasonUnknownHeldIsTheEnumsName: the exported constant is the wire
// name of ERROR_REASON_UNKNOWN_HELD, so callers comparing strings agree
// with what the library sends.
func TestReasonUnknownHeldIsTheEnumsName(t *testing.T) {
	if want := errorinfo.Reason(idempotencyv1.ErrorReason_ERROR_REASON_UNKNOWN_HELD); clients.ReasonUnknownHeld != want {
		t.Fatalf("clients.ReasonUnknownHeld = %q, the enum's name is %q", clients.ReasonUnknownHeld, want)
	}
	if clients.ErrorDomain != "idempotency.v1" {
		t.Fatalf("clients.ErrorDomain = %q", clients.ErrorDomain)
	}
}
