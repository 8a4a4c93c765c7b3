// Package errorinfo turns the API's enum ErrorReason into the
// google.rpc.ErrorInfo details that the coordinator (server) and the Go
// client library (clients) send and read: the one place where a reason's
// wire name is derived from the enum.
//
// It imports only the generated API and genproto's errdetails; server and
// clients import it, so it must never import either (or ledger).
package errorinfo

import (
	"strings"

	"google.golang.org/genproto/googleapis/rpc/errdetails"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Domain is the domain of every google.rpc.ErrorInfo idemcoord sends.
const Domain = "idempotency.v1"

// prefix is what an ErrorReason value's name has and its wire name has not.
const prefix = "ERROR_REASON_"

// Reason is the ErrorInfo reason r is sent as: its name without the
// ERROR_REASON_ prefix (ERROR_REASON_LEASE_LOST is "LEASE_LOST").
func Reason(r idempotencyv1.ErrorReason) string {
	return strings.TrimPrefix(r.String(), prefix)
}

// Parse is the ErrorReason whose wire name is reason, or
// ERROR_REASON_UNSPECIFIED when no value has it.
func Parse(reason string) idempotencyv1.ErrorReason {
	if reason == "" || strings.HasPrefix(reason, prefix) {
		return idempotencyv1.ErrorReason_ERROR_REASON_UNSPECIFIED
	}
	return idempotencyv1.ErrorReason(idempotencyv1.ErrorReason_value[prefix+reason])
}

// New is the ErrorInfo of reason r in Domain.
func New(r idempotencyv1.ErrorReason) *errdetails.ErrorInfo {
	return &errdetails.ErrorInfo{Reason: Reason(r), Domain: Domain}
}
