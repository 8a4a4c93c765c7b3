package clients

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// UnaryServerInterceptor makes the unary methods of a gRPC server
// idempotent through the coordinator that c calls. Install it after
// authentication and inside recovery:
//
//	grpc.ChainUnaryInterceptor(recovery, auth, clients.UnaryServerInterceptor(c))
//
// For each wrapped call with a key (see the options) it calls Begin on scope
// = the full method name, and then:
//
//   - acquired: runs the handler (which can read AttemptFrom and LeaseFrom,
//     and calls MarkSideEffect before its first irreversible step),
//     heartbeating while it runs, stores its response message
//     (deterministic proto encoding, schema version = the message's full
//     name) and the headers and trailers it set (see WithReplayMetadata)
//     with Complete and answers it with header "idempotency-result:
//     created". If Complete cannot reach the coordinator, the response is
//     still answered and Complete is retried in the background for up to one
//     lease (see Client.Shutdown). A handler error is recorded by its code
//     (see WithFailureKinds), or UNKNOWN once the handler called
//     MarkSideEffect, and answered as is; a replayable one also gets the
//     "created" header. A panicking handler is recorded UNKNOWN and the
//     panic goes on to the recovery interceptor. The handler's context is
//     cancelled (cause ErrLeaseUnconfirmed) when no heartbeat can confirm
//     the lease before it would run out by the local clock;
//   - replay: answers the stored message (decoded into the method's response
//     type, then through WithReplayHook) or the stored status, with the
//     stored headers and trailers and "idempotency-result: replayed",
//     without calling the handler. Created and replayed answers carry the
//     header idempotency-expires (see ExpiresHeader);
//   - in progress: ABORTED with google.rpc.RetryInfo and the
//     grpc-retry-pushback-ms trailer, or waits for the result with
//     WithWaitForResult; held UNKNOWN: FAILED_PRECONDITION with ErrorInfo
//     reason UNKNOWN_HELD;
//   - the coordinator's refusals (fingerprint mismatch, attempts exhausted,
//     key expired, schema version not accepted: FAILED_PRECONDITION with its
//     ErrorInfo; an invalid key: INVALID_ARGUMENT) are answered as they come;
//   - coordinator unreachable (UNAVAILABLE or DEADLINE_EXCEEDED after c's
//     retries): UNAVAILABLE, handler not run, unless WithFailOpen. The
//     coordinator's rate limit (RESOURCE_EXHAUSTED) is answered as
//     RESOURCE_EXHAUSTED and never fails open. Other coordinator errors (bad
//     credentials, say) are INTERNAL: they are this server's problem, not
//     the caller's.
//
// A caller that gives up (its deadline passes, it cancels, its connection
// is cut) never strands a key and is never answered a success the handler
// did not produce:
//
//   - before the handler runs: when the call's context ends while Begin is
//     in flight or while the interceptor waits (WithWaitForResult), or
//     after Begin acquired the key but before the handler starts, the
//     handler does not run and the interceptor releases the acquisition
//     before it returns: it sends Begin again with the same attempt_id on a
//     context detached from the call (bounded by a few seconds) and ends
//     what that acquires with Fail ABANDONED, reason ReleaseReason. The key
//     is then as if the attempt never was (absent if it was new, otherwise
//     as before; the released attempt does not count against max_attempts),
//     so the caller's retry acquires at once. A Begin that fails without a
//     readable answer (UNAVAILABLE) is released the same way, in the
//     background. Only when the coordinator cannot be reached for the
//     release does the lease lapse (UNKNOWN);
//   - while the handler runs: its context is the call's, so it sees the
//     caller go; whatever it returns is recorded by the rules above (a
//     handler that returns the context's error is recorded UNKNOWN, as
//     DEADLINE_EXCEEDED and CANCELED are; one that returns a response has
//     produced it, and it is stored);
//   - lease lost while the handler runs, or before its outcome is stored
//     (another attempt took the key over, an operator resolved or forgot
//     the record): nothing is stored and no "idempotency-result: created"
//     header is sent. A handler error is answered ABORTED when a heartbeat
//     learnt of the loss while the handler ran, and as it is otherwise; a
//     response the handler returned is passed on as it is (the handler did
//     produce it; the new holder's outcome is the one recorded).
//
// Every ABANDONED the interceptor records, for a release or for a handler
// error of the ABANDONED class (INVALID_ARGUMENT, …), puts the key back as
// it was before the acquisition, and so does not count against
// max_attempts: neither attempt touched the outside world.
//
// Calls without a key run the handler unprotected unless WithRequireKey. A
// handler that sends its headers itself (grpc.SendHeader) gets no
// idempotency-result header.
//
// Build it with WithPrincipal or WithoutPrincipal: with neither, it logs a
// warning through c's logger, since two end users who send the same key and
// request would share one record.
func UnaryServerInterceptor(c *Client, opts ...InterceptorOption) grpc.UnaryServerInterceptor {
	ic := &interceptor{c: c, o: defaultInterceptorOptions()}
	for _, opt := range opts {
		opt(&ic.o)
	}
	if !ic.o.principalSet {
		c.warnUndecidedPrincipal("UnaryServerInterceptor", "WithPrincipal", "WithoutPrincipal")
	}
	return ic.intercept
}

type interceptor struct {
	c       *Client
	o       interceptorOptions
	methods sync.Map // full method name → *method
}

// method is what the interceptor knows of one full method name.
type method struct {
	wrapped      bool
	unregistered bool  // selected by default but without a registered descriptor
	err          error // a method selected on purpose that cannot be wrapped
	output       protoreflect.MessageType
	schema       string
	name         string // the full method name
}

// result header values.
const (
	resultCreated  = "created"
	resultReplayed = "replayed"
)

func (ic *interceptor) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	m := ic.method(ctx, info.FullMethod)
	if !m.wrapped {
		return handler(ctx, req)
	}
	if m.err != nil {
		return nil, m.err
	}
	key, err := ic.o.key(ctx, req)
	if err != nil {
		return nil, callError("key", err)
	}
	if key == "" {
		if ic.o.requireKey {
			return nil, status.Error(codes.InvalidArgument, "this method requires an idempotency-key")
		}
		return handler(ctx, req)
	}
	if ic.o.principal != nil {
		p, err := ic.o.principal(ctx)
		if err != nil {
			return nil, callError("principal", err)
		}
		key = FoldPrincipal(p, key)
	}
	fp, err := ic.fingerprint(ctx, info.FullMethod, req)
	if err != nil {
		return nil, callError("fingerprint", err)
	}
	breq := &idempotencyv1.BeginRequest{
		Scope:                ic.o.scope(info.FullMethod),
		Key:                  key,
		Fingerprint:          fp,
		Lease:                ic.c.leaseRequest(),
		AcceptSchemaVersions: []string{m.schema, SchemaVersionStatus},
		AttemptId:            newAttemptID(),
	}
	res, sent, err := ic.c.beginWaiting(ctx, breq, time.Now().Add(ic.o.wait))
	if err != nil {
		return ic.beginFailed(ctx, err, req, handler)
	}
	switch res.GetOutcome() {
	case idempotencyv1.Outcome_OUTCOME_ACQUIRED:
		return ic.run(ctx, m, req, handler, ic.c.newLease(breq, res, sent), toldTTL{ttl: res.GetTtl(), failureTTL: res.GetFailureTtl()})
	case idempotencyv1.Outcome_OUTCOME_REPLAY:
		return ic.replay(ctx, m, res.GetRecord())
	}
	if res.GetRecord().GetState() == idempotencyv1.State_STATE_UNKNOWN {
		return nil, unknownHeldError()
	}
	retryAfter := res.GetRetryAfter().AsDuration()
	_ = grpc.SetTrailer(ctx, metadata.Pairs(PushbackTrailer, pushbackMillis(retryAfter)))
	return nil, inProgressError(retryAfter)
}

// beginFailed answers a Begin that failed.
func (ic *interceptor) beginFailed(ctx context.Context, err error, req any, handler grpc.UnaryHandler) (any, error) {
	if ctx.Err() != nil {
		return nil, contextStatus(ctx)
	}
	switch code := status.Code(err); {
	case code == codes.FailedPrecondition || code == codes.InvalidArgument:
		return nil, err
	case transportFailure(err):
		if ic.o.failOpen {
			ic.c.logger.WarnContext(ctx, "idempotency: coordinator unreachable; running the handler unprotected (fail open)", "err", err)
			return handler(ctx, req)
		}
		return nil, status.Error(codes.Unavailable, "idempotency coordinator unavailable; retry later")
	case code == codes.ResourceExhausted:
		// The coordinator's rate limit: an answer, not an outage. Never
		// fail open on it.
		return nil, status.Error(codes.ResourceExhausted, "idempotency coordinator rate limit reached; retry later")
	}
	ic.c.logger.ErrorContext(ctx, "idempotency: coordinator refused Begin", "err", err)
	return nil, status.Error(codes.Internal, "idempotency coordinator refused the call")
}

// run runs the handler under the acquired lease and records its outcome.
func (ic *interceptor) run(ctx context.Context, m *method, req any, handler grpc.UnaryHandler, l *lease, told toldTTL) (any, error) {
	var rec *recordingStream
	hctx := ctx
	if st := grpc.ServerTransportStreamFromContext(ctx); st != nil {
		rec = &recordingStream{ServerTransportStream: st}
		hctx = grpc.NewContextWithServerTransportStream(ctx, rec)
	}
	var resp any
	var herr error
	switch l.run(hctx, func(ctx context.Context) { resp, herr = handler(ctx, req) }) {
	case runCallerGone:
		_ = l.release(ctx)
		return nil, contextStatus(ctx)
	case runNotStarted:
		_ = l.finish(ctx, ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED,
			reason: "the lease could not be confirmed before the handler started"})
		return nil, status.Error(codes.Unavailable, "idempotency coordinator unavailable; retry later")
	case runLost:
		ic.c.logger.WarnContext(ctx, "idempotency: lease lost while the handler ran; its result is not stored",
			"scope", l.scope, "key", l.key, "handler_err", herr)
		if herr != nil {
			return nil, status.Error(codes.Aborted, "the idempotency key was taken over by another attempt; retry")
		}
		return resp, nil
	}
	if herr == nil {
		msg, ok := resp.(proto.Message)
		var body []byte
		var err error
		if ok && msg != nil {
			body, err = proto.MarshalOptions{Deterministic: true}.Marshal(msg)
		}
		if !ok || msg == nil || err != nil {
			_ = l.finish(ctx, ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN,
				reason: "the handler's response could not be encoded for storage"})
			return resp, nil //nolint:nilerr // the handler's answer goes back as it is; the record ends UNKNOWN
		}
		// "created" only once the response is stored (or being retried in
		// the background): a Complete refused because the lease was lost
		// stored nothing.
		storing := time.Now()
		if l.finish(ctx, ending{complete: &idempotencyv1.StoredResponse{SchemaVersion: m.schema,
			ContentType: ContentTypeProto, Body: body, Metadata: rec.stored(&ic.o)}}) == nil {
			setResult(ctx, resultCreated)
			setExpires(ctx, told.expiresAt(storing, false))
		}
		return resp, nil
	}
	e := ending{kind: endingKind(herr, ic.o.kinds, l.marked()), reason: failReason(herr.Error())}
	if e.kind == idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE {
		stored, err := statusResponse(herr)
		if err != nil {
			e.kind = idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN
		} else {
			stored.Metadata = rec.stored(&ic.o)
			e.response = stored
		}
	}
	storing := time.Now()
	if l.finish(ctx, e) == nil && e.kind == idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE {
		setResult(ctx, resultCreated)
		setExpires(ctx, told.expiresAt(storing, true))
	}
	return nil, herr
}

// replay answers a stored result, with the headers and trailers stored
// with it.
func (ic *interceptor) replay(ctx context.Context, m *method, rec *idempotencyv1.Record) (any, error) {
	stored := rec.GetResponse()
	header, trailer := replayedMetadata(stored.GetMetadata())
	header.Set(ResultHeader, resultReplayed)
	header = metadata.Join(header, expiresMetadata(rec.GetExpiresAt()))
	_ = grpc.SetHeader(ctx, header)
	if len(trailer) > 0 {
		_ = grpc.SetTrailer(ctx, trailer)
	}
	if rec.GetState() == idempotencyv1.State_STATE_FAILED_REPLAYABLE {
		return nil, storedStatus(rec).Err()
	}
	if v := stored.GetSchemaVersion(); v != m.schema {
		// Begin accepts the status schema for failures; a COMPLETED record
		// under it (an operator's doing) cannot be decoded as a response.
		ic.c.logger.ErrorContext(ctx, "idempotency: stored response has another schema version",
			"scope", rec.GetScope(), "key", rec.GetKey(), "schema_version", v, "want", m.schema)
		return nil, status.Error(codes.Internal, "the stored response for this idempotency key has schema version "+v)
	}
	out := m.output.New().Interface()
	if err := proto.Unmarshal(stored.GetBody(), out); err != nil {
		ic.c.logger.ErrorContext(ctx, "idempotency: stored response cannot be decoded",
			"scope", rec.GetScope(), "key", rec.GetKey(), "schema_version", stored.GetSchemaVersion(), "err", err)
		return nil, status.Error(codes.Internal, "the stored response for this idempotency key cannot be decoded")
	}
	return ic.replayed(ctx, m.name, out), nil
}

func setResult(ctx context.Context, v string) {
	_ = grpc.SetHeader(ctx, metadata.Pairs(ResultHeader, v))
}

func (ic *interceptor) fingerprint(ctx context.Context, fullMethod string, req any) ([]byte, error) {
	if ic.o.fingerprint != nil {
		return ic.o.fingerprint(ctx, req)
	}
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, errors.New("request is not a proto message")
	}
	return Fingerprint(fullMethod, msg)
}

// method resolves and caches what the interceptor does with fullMethod.
func (ic *interceptor) method(ctx context.Context, fullMethod string) *method {
	if m, ok := ic.methods.Load(fullMethod); ok {
		return m.(*method) //nolint:forcetypeassert // ic.methods holds only *method
	}
	m := ic.resolve(fullMethod)
	if actual, loaded := ic.methods.LoadOrStore(fullMethod, m); loaded {
		return actual.(*method) //nolint:forcetypeassert // ic.methods holds only *method
	}
	if m.unregistered {
		ic.c.logger.WarnContext(ctx, "idempotency: method has no registered descriptor; passing it through unprotected",
			"method", fullMethod)
	}
	return m
}

func (ic *interceptor) resolve(fullMethod string) *method {
	if !ic.o.selector(fullMethod) {
		return &method{}
	}
	md, err := methodDescriptor(fullMethod)
	var mt protoreflect.MessageType
	if err == nil {
		mt, err = protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName())
	}
	if err != nil {
		if !ic.o.explicit {
			return &method{unregistered: true}
		}
		return &method{wrapped: true, err: status.Errorf(codes.Internal,
			"idempotency: cannot wrap %s: %v", fullMethod, err)}
	}
	if opts, ok := md.Options().(*descriptorpb.MethodOptions); ok &&
		opts.GetIdempotencyLevel() == descriptorpb.MethodOptions_NO_SIDE_EFFECTS {
		return &method{}
	}
	schema := string(md.Output().FullName())
	if v, ok := ic.o.schemas[fullMethod]; ok {
		schema = v
	}
	return &method{wrapped: true, output: mt, schema: schema, name: fullMethod}
}

// methodDescriptor finds "/pkg.Service/Method" in protoregistry.GlobalFiles.
func methodDescriptor(fullMethod string) (protoreflect.MethodDescriptor, error) {
	name := strings.Replace(strings.TrimPrefix(fullMethod, "/"), "/", ".", 1)
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(name))
	if err != nil {
		return nil, err
	}
	md, ok := d.(protoreflect.MethodDescriptor)
	if !ok {
		return nil, errors.New(name + " is not a method")
	}
	return md, nil
}
