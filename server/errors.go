package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/errorinfo"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// ErrorDomain is the domain of every google.rpc.ErrorInfo the server sends.
// Its reasons are the API's enum ErrorReason (idempotencyv1.ErrorReason),
// sent by name without the ERROR_REASON_ prefix (see internal/errorinfo).
const ErrorDomain = errorinfo.Domain

// invalidError is a request that failed validation.
type invalidError struct {
	violations []*errdetails.BadRequest_FieldViolation
	// reason, when set, is sent as an ErrorInfo reason too.
	reason idempotencyv1.ErrorReason
}

func (e *invalidError) Error() string {
	if len(e.violations) == 0 {
		return "invalid request"
	}
	v := e.violations[0]
	msg := fmt.Sprintf("invalid %s: %s", v.GetField(), v.GetDescription())
	if n := len(e.violations) - 1; n > 0 {
		msg += fmt.Sprintf(" (and %d more)", n)
	}
	return msg
}

// refusals maps the statemachine's refusals to FAILED_PRECONDITION reasons.
var refusals = []struct {
	err    error
	reason idempotencyv1.ErrorReason
}{
	{statemachine.ErrFingerprintMismatch, idempotencyv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH},
	{statemachine.ErrLeaseLost, idempotencyv1.ErrorReason_ERROR_REASON_LEASE_LOST},
	{statemachine.ErrSchemaVersionNotAccepted, idempotencyv1.ErrorReason_ERROR_REASON_SCHEMA_VERSION_NOT_ACCEPTED},
	{statemachine.ErrKeyExpired, idempotencyv1.ErrorReason_ERROR_REASON_KEY_EXPIRED},
	{statemachine.ErrAlreadyFinished, idempotencyv1.ErrorReason_ERROR_REASON_ALREADY_FINISHED},
	{statemachine.ErrAttemptsExhausted, idempotencyv1.ErrorReason_ERROR_REASON_ATTEMPTS_EXHAUSTED},
	{statemachine.ErrNotUnknown, idempotencyv1.ErrorReason_ERROR_REASON_NOT_UNKNOWN},
	{statemachine.ErrCheckpointRecorded, idempotencyv1.ErrorReason_ERROR_REASON_CHECKPOINT_RECORDED},
}

// toStatus is the one place where errors become gRPC statuses. Anything it
// does not recognise is logged and answered INTERNAL without detail.
func toStatus(ctx context.Context, logger *slog.Logger, err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	if inv, ok := errors.AsType[*invalidError](err); ok {
		br := &errdetails.BadRequest{FieldViolations: inv.violations}
		st := status.New(codes.InvalidArgument, inv.Error())
		if inv.reason != idempotencyv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
			return withDetails(st, errorinfo.New(inv.reason), br)
		}
		return withDetails(st, br)
	}
	for _, r := range refusals {
		if errors.Is(err, r.err) {
			return withDetails(status.New(codes.FailedPrecondition, err.Error()), errorinfo.New(r.reason))
		}
	}
	switch {
	case errors.Is(err, ledger.ErrUnreadable):
		// The cause may name a key id or a column, never the contents;
		// it goes to the log only.
		logger.ErrorContext(ctx, "stored record unreadable", "err", err)
		return withDetails(status.New(codes.DataLoss, "the stored record cannot be read (RECORD_UNREADABLE); an operator may Forget it"),
			errorinfo.New(idempotencyv1.ErrorReason_ERROR_REASON_RECORD_UNREADABLE))
	case errors.Is(err, ledger.ErrIdentityTooLong):
		// The configured limits keep such identities out (see
		// Config.Resolve); this answers one that slipped past them.
		return withDetails(status.New(codes.InvalidArgument, "invalid key: "+err.Error()),
			&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{
				{Field: "key", Description: err.Error()}}})
	case errors.Is(err, statemachine.ErrNotFound):
		return status.Error(codes.NotFound, "no such record")
	case errors.Is(err, ledger.ErrUnavailable):
		logger.WarnContext(ctx, "database unavailable", "err", err)
		return status.Error(codes.Unavailable, "database unavailable, retry later")
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, "deadline exceeded")
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, "call canceled")
	}
	logger.ErrorContext(ctx, "internal error", "err", err)
	return status.Error(codes.Internal, "internal error")
}

func withDetails(st *status.Status, details ...protoadapt.MessageV1) error {
	out, err := st.WithDetails(details...)
	if err != nil {
		return st.Err()
	}
	return out.Err()
}
