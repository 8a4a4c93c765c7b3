package clients

import (
	"context"
	"log/slog"
	"maps"
	"strings"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc/codes"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Option configures a Client.
type Option func(*options)

type options struct {
	attempts uint
	backoff  retry.BackoffFunc
	logger   *slog.Logger
	lease    time.Duration
	token    string
	// batchRPCs is WithCallBatching's limit (0: every call unary).
	batchRPCs int
}

func defaultOptions() options {
	return options{
		attempts: 5,
		backoff:  retry.BackoffExponentialWithJitterBounded(50*time.Millisecond, 0.2, time.Second),
		logger:   slog.New(slog.DiscardHandler),
	}
}

// WithMaxAttempts sets how many times a call to the coordinator is tried
// when it answers UNAVAILABLE (default 5, so four retries). 1 disables
// retries.
func WithMaxAttempts(n uint) Option {
	return func(o *options) { o.attempts = max(n, 1) }
}

// WithBackoff sets the wait between retries of a call to the coordinator
// (default: exponential from 50 ms with 20 % jitter, at most 1 s). Any
// go-grpc-middleware retry backoff fits.
func WithBackoff(f retry.BackoffFunc) Option {
	return func(o *options) { o.backoff = f }
}

// WithLogger sets the logger for what happens after a call has returned:
// background retries of Complete/Fail, and giving up on them (default: a
// logger that discards everything).
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.logger = l }
}

// WithLease sets the lease that Once and the interceptor ask for in Begin
// and Heartbeat. It must lie within the coordinator's bounds (1 s to 1 h by
// default), or every Begin fails with INVALID_ARGUMENT. By default (0) they
// send none, so the coordinator's policy for the scope decides; the
// heartbeat interval is a third of whichever lease is in force.
func WithLease(d time.Duration) Option {
	return func(o *options) { o.lease = d }
}

// WithToken makes every call of the Client carry the metadata
// "authorization: Bearer <token>", the credentials of a coordinator with
// auth on (a tenant's token_sha256 is the SHA-256 of token). An empty token
// sends none. The token travels in clear unless the connection uses TLS
// (grpc.WithTransportCredentials): use TLS beyond loopback.
func WithToken(token string) Option {
	return func(o *options) { o.token = token }
}

// InterceptorOption configures UnaryServerInterceptor.
type InterceptorOption func(*interceptorOptions)

// KeyFunc returns the idempotency key of a call; "" means the call has none.
// An error fails the call: a gRPC status error keeps its code, anything else
// becomes INVALID_ARGUMENT.
type KeyFunc func(ctx context.Context, req any) (string, error)

// FingerprintFunc returns the fingerprint of a request (at most 64 bytes; an
// empty one skips the coordinator's check). An error fails the call as a
// KeyFunc's does.
type FingerprintFunc func(ctx context.Context, req any) ([]byte, error)

// PrincipalFunc returns the end user a call acts for. An error fails the
// call as a KeyFunc's does.
type PrincipalFunc func(ctx context.Context) (string, error)

type interceptorOptions struct {
	key          KeyFunc
	principal    PrincipalFunc
	principalSet bool            // WithPrincipal or WithoutPrincipal was given
	replayKeys   map[string]bool // nil: every key but defaultNotReplayed
	scope        func(fullMethod string) string
	fingerprint  FingerprintFunc
	selector     func(fullMethod string) bool
	explicit     bool // the selection names methods on purpose
	requireKey   bool
	schemas      map[string]string
	kinds        map[codes.Code]idempotencyv1.FailureKind
	wait         time.Duration
	failOpen     bool
	replayHook   replayHook // callers_answers.go
}

func defaultInterceptorOptions() interceptorOptions {
	return interceptorOptions{
		key:      keyFromMetadata,
		scope:    func(fullMethod string) string { return fullMethod },
		selector: func(string) bool { return true },
		schemas:  map[string]string{},
		kinds:    defaultFailureKinds(),
	}
}

// WithKeyFunc takes the idempotency key from f instead of the incoming
// metadata "idempotency-key". f may still read the metadata itself (see
// KeyFromMetadata) and fall back to a derived key such as DedupKey.
func WithKeyFunc(f KeyFunc) InterceptorOption {
	return func(o *interceptorOptions) { o.key = f }
}

// WithPrincipal folds the principal that f returns (the end user's id, for
// instance) into every key with FoldPrincipal, so two end users who send the
// same key never share a record. Install the interceptor after the
// authentication that f reads.
//
// Whom a key belongs to is a decision, not a default: without WithPrincipal,
// two end users of one service who send the same key and request share one
// record (the second gets the first one's response). The interceptor logs a
// warning when it is built with neither WithPrincipal nor WithoutPrincipal.
func WithPrincipal(f PrincipalFunc) InterceptorOption {
	return func(o *interceptorOptions) { o.principal, o.principalSet = f, true }
}

// WithoutPrincipal says on purpose that keys are not per end user: every
// caller of the service shares one key space (a service whose only caller
// is another service, say, or whose keys are already unique per user). It
// silences the warning the interceptor logs when neither WithPrincipal nor
// WithoutPrincipal is given.
func WithoutPrincipal() InterceptorOption {
	return func(o *interceptorOptions) { o.principal, o.principalSet = nil, true }
}

// WithReplayMetadata sets which response headers and trailers a handler
// sets (grpc.SetHeader, grpc.SendHeader, grpc.SetTrailer) are stored with
// its result and replayed, by key (case-insensitive): only these. By default
// every key is stored except transport and auth metadata: keys starting
// with "grpc-" or ":", content-type, content-length, te, user-agent, host,
// date, connection, keep-alive, transfer-encoding, upgrade, authorization,
// proxy-authorization, cookie, set-cookie, www-authenticate,
// proxy-authenticate, idempotency-key and idempotency-result. A replay
// then differs from the first answer only in idempotency-result.
// WithReplayMetadata() with no keys stores none.
func WithReplayMetadata(keys ...string) InterceptorOption {
	set := make(map[string]bool, len(keys))
	for _, k := range keys {
		set[strings.ToLower(k)] = true
	}
	return func(o *interceptorOptions) { o.replayKeys = set }
}

// WithScopeFunc sets the coordinator scope of a method (default: the full
// method name, such as "/payments.v1.Payments/Charge", which the
// coordinator's per-scope policy can match).
func WithScopeFunc(f func(fullMethod string) string) InterceptorOption {
	return func(o *interceptorOptions) { o.scope = f }
}

// WithFingerprintFunc replaces the default fingerprint, Fingerprint(full
// method, request), for requests with fields that may differ between retries
// of the same intent (a free-text prompt, a client timestamp). Returning
// Fingerprint of a copy of the request with those fields cleared keeps the
// check for everything else.
func WithFingerprintFunc(f FingerprintFunc) InterceptorOption {
	return func(o *interceptorOptions) { o.fingerprint = f }
}

// WithMethods wraps only the named methods (full names such as
// "/payments.v1.Payments/Charge"). Methods whose proto says idempotency_level
// = NO_SIDE_EFFECTS are never wrapped. A named method whose descriptor is not
// in protoregistry.GlobalFiles fails with INTERNAL, since its stored response
// could not be decoded.
func WithMethods(fullMethods ...string) InterceptorOption {
	set := make(map[string]bool, len(fullMethods))
	for _, m := range fullMethods {
		set[m] = true
	}
	return func(o *interceptorOptions) {
		o.selector = func(m string) bool { return set[m] }
		o.explicit = true
	}
}

// WithMethodSelector wraps only the methods for which f returns true (and
// never those with idempotency_level = NO_SIDE_EFFECTS). A selected method
// whose descriptor is not in protoregistry.GlobalFiles fails with INTERNAL.
//
// Without WithMethods or WithMethodSelector every unary method is wrapped
// except NO_SIDE_EFFECTS ones, and a method without a registered descriptor
// is passed through (and logged once).
func WithMethodSelector(f func(fullMethod string) bool) InterceptorOption {
	return func(o *interceptorOptions) {
		o.selector = f
		o.explicit = true
	}
}

// WithRequireKey makes a wrapped call without a key fail with
// INVALID_ARGUMENT. By default such a call runs the handler unprotected.
func WithRequireKey() InterceptorOption {
	return func(o *interceptorOptions) { o.requireKey = true }
}

// WithSchemaVersion sets the schema version stored with fullMethod's
// responses (default: the response message's full name, such as
// "payments.v1.ChargeResponse"). Begin accepts only this version for a
// replay, so after a change to "payments.v1.ChargeResponse/2" a record stored
// under the old version is refused with FAILED_PRECONDITION
// (SCHEMA_VERSION_NOT_ACCEPTED) instead of being decoded wrongly. An
// operator who resolves an UNKNOWN record of a wrapped method as completed
// must store the response message under this version for retries to get it.
func WithSchemaVersion(fullMethod, version string) InterceptorOption {
	return func(o *interceptorOptions) { o.schemas[fullMethod] = version }
}

// WithFailureKinds overrides how handler errors are recorded, by gRPC code;
// codes not in kinds keep their default:
//
//   - FAILURE_KIND_ABANDONED (not stored; the caller may fix the request and
//     retry with the same key): INVALID_ARGUMENT, UNAUTHENTICATED,
//     PERMISSION_DENIED, RESOURCE_EXHAUSTED, UNIMPLEMENTED;
//   - FAILURE_KIND_RETRYABLE (nothing happened; the next call runs the
//     handler): UNAVAILABLE, ABORTED;
//   - FAILURE_KIND_UNKNOWN (the side effect may have happened; the next call
//     runs the handler with previous state UNKNOWN, see AttemptFrom):
//     DEADLINE_EXCEEDED, CANCELED, INTERNAL, UNKNOWN, DATA_LOSS, and errors
//     that carry no gRPC status;
//   - FAILURE_KIND_REPLAYABLE (the status with its message and details is
//     stored and replayed): FAILED_PRECONDITION, NOT_FOUND, ALREADY_EXISTS,
//     OUT_OF_RANGE.
//
// The table applies only before the handler calls MarkSideEffect: after
// it, every error is recorded UNKNOWN (a *FailureError naming REPLAYABLE
// excepted), whatever kinds says. A panicking handler is always recorded
// UNKNOWN.
func WithFailureKinds(kinds map[codes.Code]idempotencyv1.FailureKind) InterceptorOption {
	return func(o *interceptorOptions) {
		maps.Copy(o.kinds, kinds)
	}
}

// WithWaitForResult makes a call that finds another attempt with its key in
// progress wait up to d (and within its own deadline) for that attempt's
// result, and answer with it, instead of failing at once with ABORTED.
// While waiting it holds no lock; the coordinator wakes it when the record
// changes.
func WithWaitForResult(d time.Duration) InterceptorOption {
	return func(o *interceptorOptions) { o.wait = d }
}

// WithFailOpen runs the handler unprotected when the coordinator cannot be
// reached at the start of a call: Begin still answers UNAVAILABLE or
// DEADLINE_EXCEEDED after the Client's retries, while the call's own context
// is live. AttemptFrom and LeaseFrom then report ok = false. By default such
// a call fails closed with UNAVAILABLE and runs nothing. Fail-open is for
// transport failures only: a coordinator that answers RESOURCE_EXHAUSTED
// (its rate limit), PERMISSION_DENIED or UNAUTHENTICATED never opens it.
func WithFailOpen() InterceptorOption {
	return func(o *interceptorOptions) { o.failOpen = true }
}

// defaultFailureKinds is the handler-error table of docs/go.md.
func defaultFailureKinds() map[codes.Code]idempotencyv1.FailureKind {
	const (
		abandoned  = idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED
		retryable  = idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE
		unknown    = idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN
		replayable = idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE
	)
	return map[codes.Code]idempotencyv1.FailureKind{
		codes.InvalidArgument: abandoned, codes.Unauthenticated: abandoned,
		codes.PermissionDenied: abandoned, codes.ResourceExhausted: abandoned,
		codes.Unimplemented: abandoned,
		codes.Unavailable:   retryable, codes.Aborted: retryable,
		codes.DeadlineExceeded: unknown, codes.Canceled: unknown, codes.Internal: unknown,
		codes.Unknown: unknown, codes.DataLoss: unknown,
		codes.FailedPrecondition: replayable, codes.NotFound: replayable,
		codes.AlreadyExists: replayable, codes.OutOfRange: replayable,
	}
}

// warnUndecidedPrincipal logs, through c's logger, that guard (the
// interceptor or the HTTP middleware) was built without deciding whom keys
// belong to: with neither the option with, which folds the end user into
// every key, nor without, which says on purpose that keys are shared.
func (c *Client) warnUndecidedPrincipal(guard, with, without string) {
	c.logger.Warn("idempotency: " + guard + " built without " + with + " or " + without + ": " +
		"two end users who send the same idempotency key and request share one record; " +
		"fold the end user in with " + with + ", or say " + without)
}
