package clients

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/errorinfo"
)

// Names on the wire.
const (
	// MetadataKey is the incoming metadata key the interceptor reads the
	// idempotency key from.
	MetadataKey = "idempotency-key"
	// ResultHeader is the response header the interceptor sets: "created"
	// when this call ran the handler and stored its result, "replayed" when
	// it answered with a stored result.
	ResultHeader = "idempotency-result"
	// PushbackTrailer is the trailer of an ABORTED "in progress" answer: how
	// many milliseconds to wait before retrying. grpc-go clients with a retry
	// policy for ABORTED honour it.
	PushbackTrailer = "grpc-retry-pushback-ms"
	// ErrorDomain is the domain of the google.rpc.ErrorInfo details the
	// interceptor and the coordinator send. Their reasons are the API's enum
	// ErrorReason, sent by name without the ERROR_REASON_ prefix.
	ErrorDomain = errorinfo.Domain
	// ReasonUnknownHeld is the ErrorInfo reason of a call whose key is held
	// UNKNOWN for an operator (policy on_unknown: hold): the wire name of
	// idempotencyv1.ErrorReason_ERROR_REASON_UNKNOWN_HELD, kept as a
	// constant for callers (TestReasonUnknownHeldIsTheEnumsName checks it).
	ReasonUnknownHeld = "UNKNOWN_HELD"
)

// Values stored in StoredResponse.
const (
	// ContentTypeProto is the content type of stored message bodies: the
	// deterministic protobuf encoding.
	ContentTypeProto = "application/x-protobuf"
	// SchemaVersionStatus is the schema version of a stored failure: the
	// body is a google.rpc.Status (code, message and details).
	SchemaVersionStatus = "google.rpc.Status"
)

var (
	// ErrLeaseLost is the cause with which Once cancels its function's
	// context, and the error Once returns, when a heartbeat learns that
	// another attempt took the key over.
	ErrLeaseLost = errors.New("clients: the lease on the idempotency key was lost")
	// ErrLeaseUnconfirmed is the cause with which Once and the interceptor
	// cancel the context of the function or handler they run when no
	// Heartbeat could confirm the lease before it would run out by the
	// local clock (the coordinator is unreachable, say): another attempt may
	// take the key over soon, so the cut-off holder stops first. Once also
	// returns it when the lease could not be confirmed before its function
	// started (which then does not run).
	ErrLeaseUnconfirmed = errors.New("clients: the lease on the idempotency key could not be confirmed before it would run out")
	// ErrUnknownHeld matches (with errors.Is) the error of a call whose key
	// is held UNKNOWN for an operator. The error is also a gRPC status
	// FAILED_PRECONDITION with ErrorInfo reason UNKNOWN_HELD.
	ErrUnknownHeld = errors.New("clients: the outcome of an earlier attempt is unknown and held for an operator")
	// ErrInProgress matches (with errors.Is) the interceptor's error for a
	// call whose key another attempt holds. The error is also a gRPC status
	// ABORTED with google.rpc.RetryInfo.
	ErrInProgress = errors.New("clients: another attempt with this idempotency key is in progress")
)

// FailureError lets the function given to Client.Once, or a handler under
// the interceptor, say how its failure is recorded. Errors of other types
// are recorded by their gRPC code (see WithFailureKinds). The interceptor
// always stores a replayable failure as the error's gRPC status; only Once
// stores Response.
type FailureError struct {
	// Kind is how the failure is recorded.
	Kind idempotencyv1.FailureKind
	// Response is stored with a FAILURE_KIND_REPLAYABLE failure; when nil,
	// Err's gRPC status is stored (schema version SchemaVersionStatus).
	Response *idempotencyv1.StoredResponse
	// Err is the failure.
	Err error
}

// Error returns Err's message.
func (e *FailureError) Error() string {
	if e.Err == nil {
		return "failed (" + e.Kind.String() + ")"
	}
	return e.Err.Error()
}

// Unwrap returns Err.
func (e *FailureError) Unwrap() error { return e.Err }

// statusError is a gRPC status that also matches a sentinel with errors.Is.
type statusError struct {
	st       *status.Status
	sentinel error
}

func (e *statusError) Error() string              { return e.st.Err().Error() }
func (e *statusError) GRPCStatus() *status.Status { return e.st }
func (e *statusError) Is(target error) bool       { return target == e.sentinel }

func withDetails(st *status.Status, details ...protoadapt.MessageV1) *status.Status {
	if out, err := st.WithDetails(details...); err == nil {
		return out
	}
	return st
}

// unknownHeldError is FAILED_PRECONDITION, reason UNKNOWN_HELD.
func unknownHeldError() error {
	st := status.New(codes.FailedPrecondition,
		"the outcome of an earlier attempt with this idempotency key is unknown and held for an operator")
	return &statusError{st: withDetails(st, errorinfo.New(idempotencyv1.ErrorReason_ERROR_REASON_UNKNOWN_HELD)), sentinel: ErrUnknownHeld}
}

// inProgressError is ABORTED with RetryInfo; the caller sets the trailer.
func inProgressError(retryAfter time.Duration) error {
	st := status.New(codes.Aborted, fmt.Sprintf(
		"another attempt with this idempotency key is in progress; retry after %v", retryAfter))
	return &statusError{st: withDetails(st, &errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)}),
		sentinel: ErrInProgress}
}

// pushbackMillis renders d for the grpc-retry-pushback-ms trailer.
func pushbackMillis(d time.Duration) string {
	return strconv.FormatInt(max(d.Milliseconds(), 1), 10)
}

// endingKind is how an attempt whose function failed with err is recorded:
// after MarkSideEffect always UNKNOWN, unless a FailureError names
// REPLAYABLE; before it, as failureKind says.
func endingKind(err error, kinds map[codes.Code]idempotencyv1.FailureKind, marked bool) idempotencyv1.FailureKind {
	if !marked {
		return failureKind(err, kinds)
	}
	var fe *FailureError
	if errors.As(err, &fe) && fe.Kind == idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE {
		return fe.Kind
	}
	return idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN
}

// failureKind classifies err by kinds, FailureError first.
func failureKind(err error, kinds map[codes.Code]idempotencyv1.FailureKind) idempotencyv1.FailureKind {
	var fe *FailureError
	if errors.As(err, &fe) && fe.Kind != idempotencyv1.FailureKind_FAILURE_KIND_UNSPECIFIED {
		return fe.Kind
	}
	if k, ok := kinds[status.Code(err)]; ok {
		return k
	}
	return idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN
}

// statusResponse stores err's gRPC status (code, message, details).
func statusResponse(err error) (*idempotencyv1.StoredResponse, error) {
	st := status.Convert(err)
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(st.Proto())
	if err != nil {
		return nil, err
	}
	return &idempotencyv1.StoredResponse{SchemaVersion: SchemaVersionStatus, ContentType: ContentTypeProto,
		Body: body, StatusCode: int32(st.Code())}, nil //nolint:gosec // gRPC codes run from 0 to 16
}

// storedStatus is the status of a stored replayable failure: the stored
// google.rpc.Status when the body is one, else the stored status_code (a gRPC
// code; FAILED_PRECONDITION when there is none) with the failure reason.
func storedStatus(rec *idempotencyv1.Record) *status.Status {
	resp := rec.GetResponse()
	if resp.GetSchemaVersion() == SchemaVersionStatus {
		var sp spb.Status
		if err := proto.Unmarshal(resp.GetBody(), &sp); err == nil && sp.GetCode() != int32(codes.OK) {
			return status.FromProto(&sp)
		}
	}
	msg := rec.GetFailureReason()
	if msg == "" {
		msg = "replayed failure"
	}
	code := codes.FailedPrecondition
	if c := resp.GetStatusCode(); c > 0 && c <= int32(codes.Unauthenticated) {
		code = codes.Code(c)
	}
	return status.New(code, msg)
}

// storedError is the error Once answers for a stored replayable failure:
// the stored gRPC status, or a FailureError carrying a response of the
// caller's own.
func storedError(rec *idempotencyv1.Record) error {
	st := storedStatus(rec)
	if rec.GetResponse().GetSchemaVersion() == SchemaVersionStatus {
		return st.Err()
	}
	return &FailureError{Kind: idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE, Response: rec.GetResponse(), Err: st.Err()}
}

// maxReasonBytes is the coordinator's default limit on Fail.reason.
const maxReasonBytes = 1024

// failReason makes err's message a valid Fail reason: valid UTF-8, no NUL,
// at most maxReasonBytes.
func failReason(msg string) string {
	msg = strings.ToValidUTF8(strings.ReplaceAll(msg, "\x00", ""), "\uFFFD")
	if len(msg) <= maxReasonBytes {
		return msg
	}
	cut := maxReasonBytes
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut]
}

// callError turns the error of a key or fingerprint function into a status.
func callError(what string, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Errorf(codes.InvalidArgument, "idempotency %s: %v", what, err)
}

// contextStatus is the status of a call whose own context ended.
func contextStatus(ctx context.Context) error {
	return status.FromContextError(ctx.Err()).Err()
}

// errorReason returns the ErrorReason of the ErrorInfo in err's status
// details: ERROR_REASON_UNSPECIFIED when there is none or its reason is
// not one of the enum's.
func errorReason(err error) idempotencyv1.ErrorReason {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return errorinfo.Parse(ei.GetReason())
		}
	}
	return idempotencyv1.ErrorReason_ERROR_REASON_UNSPECIFIED
}

// transportFailure reports whether err says that the coordinator could not
// be reached or did not answer in time: the only failures fail-open may
// run a handler unprotected for. A rate limit (RESOURCE_EXHAUSTED) or an
// authentication refusal is the coordinator's answer, not an outage.
func transportFailure(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded:
		return true
	}
	return false
}

// unanswered reports whether a call that failed with err may have taken
// effect without its answer being read: it was cut off, timed out or
// cancelled.
func unanswered(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return false
}

// unreachable reports whether err means the coordinator could not be
// reached or did not answer in time, as opposed to a refusal.
func unreachable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Canceled:
		return true
	}
	return false
}
