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

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// ErrorDomain is the domain of every google.rpc.ErrorInfo the server sends.
const ErrorDomain = "idempotency.v1"

// The ErrorInfo reasons the server sends.
const (
	ReasonFingerprintMismatch      = "FINGERPRINT_MISMATCH"
	ReasonLeaseLost                = "LEASE_LOST"
	ReasonSchemaVersionNotAccepted = "SCHEMA_VERSION_NOT_ACCEPTED"
	ReasonKeyExpired               = "KEY_EXPIRED"
	ReasonAlreadyFinished          = "ALREADY_FINISHED"
	ReasonAttemptsExhausted        = "ATTEMPTS_EXHAUSTED"
	ReasonResponseTooLarge         = "RESPONSE_TOO_LARGE"
	// ReasonKeyFormat (with INVALID_ARGUMENT): the key does not match the
	// key_pattern of its scope's policy.
	ReasonKeyFormat = "KEY_FORMAT"
	// ReasonNotUnknown: Admin.Resolve found a record that does not read
	// STATE_UNKNOWN.
	ReasonNotUnknown = "NOT_UNKNOWN"
	// ReasonRecordUnreadable (with DATA_LOSS): the stored record cannot be
	// opened (a key no longer configured, a row altered in the table, or
	// a row in clear where encryption is required). Its contents are never
	// sent; an operator can Forget it.
	ReasonRecordUnreadable = "RECORD_UNREADABLE"
)

// invalidError is a request that failed validation.
type invalidError struct {
	violations []*errdetails.BadRequest_FieldViolation
	// reason, when set, is sent as an ErrorInfo reason too.
	reason string
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
	reason string
}{
	{statemachine.ErrFingerprintMismatch, ReasonFingerprintMismatch},
	{statemachine.ErrLeaseLost, ReasonLeaseLost},
	{statemachine.ErrSchemaVersionNotAccepted, ReasonSchemaVersionNotAccepted},
	{statemachine.ErrKeyExpired, ReasonKeyExpired},
	{statemachine.ErrAlreadyFinished, ReasonAlreadyFinished},
	{statemachine.ErrAttemptsExhausted, ReasonAttemptsExhausted},
	{statemachine.ErrNotUnknown, ReasonNotUnknown},
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
	var inv *invalidError
	if errors.As(err, &inv) {
		br := &errdetails.BadRequest{FieldViolations: inv.violations}
		st := status.New(codes.InvalidArgument, inv.Error())
		if inv.reason != "" {
			return withDetails(st, errorInfo(inv.reason), br)
		}
		return withDetails(st, br)
	}
	for _, r := range refusals {
		if errors.Is(err, r.err) {
			return withDetails(status.New(codes.FailedPrecondition, err.Error()), errorInfo(r.reason))
		}
	}
	switch {
	case errors.Is(err, ledger.ErrUnreadable):
		// The cause may name a key id or a column, never the contents;
		// it goes to the log only.
		logger.ErrorContext(ctx, "stored record unreadable", "err", err)
		return withDetails(status.New(codes.DataLoss, "the stored record cannot be read (RECORD_UNREADABLE); an operator may Forget it"),
			errorInfo(ReasonRecordUnreadable))
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

func errorInfo(reason string) *errdetails.ErrorInfo {
	return &errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}
}

func withDetails(st *status.Status, details ...protoadapt.MessageV1) error {
	out, err := st.WithDetails(details...)
	if err != nil {
		return st.Err()
	}
	return out.Err()
}
