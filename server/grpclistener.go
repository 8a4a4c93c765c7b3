package server

import (
	"context"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"golang.org/x/sync/semaphore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
)

// DefaultGRPCReadTimeout is how long, by default, a call on the gRPC
// listener may take to send its request message once its headers are in;
// see WithGRPCReadTimeout.
const DefaultGRPCReadTimeout = 30 * time.Second

// WithGRPCReadTimeout bounds how long the gRPC listener waits for a call's
// request message (for a streaming call, until its handler starts) after
// the call's headers: a call that has not sent it by then ends
// DEADLINE_EXCEEDED and what it sent is freed. The default is
// DefaultGRPCReadTimeout.
func WithGRPCReadTimeout(d time.Duration) Option { return func(o *options) { o.grpcReadTimeout = d } }

// openCallsAtOnce is how many calls of the services that need no
// credentials (health, reflection) may be open at once while auth is on:
// each may send a request message of up to the message limit, so they hold
// at most this many of them.
const openCallsAtOnce = 16

const (
	// grpcIdleTimeout closes a connection that has had no call for this
	// long (clients reconnect when they need to): idle connections do not
	// keep the listener's connection slots.
	grpcIdleTimeout = 5 * time.Minute
	// grpcPingMinTime is the shortest interval between a client's
	// keepalive pings: a client that pings more often is disconnected.
	grpcPingMinTime = 20 * time.Second
)

// listenerOptions are the grpc.Server options that bound what a
// connection can hold: the tap that authenticates a call and arms its read
// timeout before its message is read, the idle timeout and the keepalive
// policy.
func (s *Server) listenerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InTapHandle(s.admitCall),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: grpcIdleTimeout}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: grpcPingMinTime, PermitWithoutStream: true}),
	}
}

// readTimerKey is the context key of a call's read timer.
type readTimerKey struct{}

// errReadTimeout is the cause of a call cancelled because its request
// message did not arrive within the read timeout.
var errReadTimeout = status.Error(codes.DeadlineExceeded, "the request message did not arrive in time")

// admitCall runs on a new call's headers, before gRPC reads its request
// message (a tap.ServerInHandle). While auth is on, it refuses a call of a
// service that needs credentials without valid ones, UNAUTHENTICATED, with
// the rule of the chain (authenticate, which still authenticates every
// call it admits), and counts and logs the refusal as the chain would
// (see refuseUnread); a call of a service that needs none (health,
// reflection) takes one of openCallsAtOnce slots until it ends, or is
// refused RESOURCE_EXHAUSTED. Either way, a caller without credentials has
// no request message read. Every admitted call must then send its message
// within the read timeout.
func (s *Server) admitCall(ctx context.Context, info *tap.Info) (context.Context, error) {
	if s.policies.Load().AuthEnabled() {
		if unauthenticatedService(ctx, interceptors.NewServerCallMeta(info.FullMethodName, nil, nil)) {
			if err := s.authenticateUnread(ctx, info.FullMethodName); err != nil {
				return nil, err
			}
		} else {
			if !s.openCalls.TryAcquire(1) {
				return nil, status.Error(codes.ResourceExhausted, "too many health or reflection calls at once: retry later")
			}
			context.AfterFunc(ctx, func() { s.openCalls.Release(1) })
		}
	}
	ctx, cancel := context.WithCancelCause(ctx)
	timer := time.AfterFunc(s.opts.grpcReadTimeout, func() { cancel(errReadTimeout) })
	context.AfterFunc(ctx, func() { timer.Stop() })
	return context.WithValue(ctx, readTimerKey{}, timer), nil
}

// messageRead stops the read timeout of the call whose context is ctx:
// its request message is in (or, for a streaming call, its handler runs).
func messageRead(ctx context.Context) {
	if t, ok := ctx.Value(readTimerKey{}).(*time.Timer); ok {
		t.Stop()
	}
}

// readUnary is the first unary interceptor: the call's message is read.
func readUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	messageRead(ctx)
	return handler(ctx, req)
}

// readStream is the first stream interceptor: the call's handler runs.
func readStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	messageRead(ss.Context())
	return handler(srv, ss)
}

// authenticateUnread authenticates a call of method from ctx's metadata
// and peer alone, before its request is read, with the chain's rule
// (authenticate). A refused call of an API method is counted and logged as
// the chain counts and logs its refusals (grpc_server_handled_total with
// code Unauthenticated, a "finished call" line); a method the API does not
// have is neither (it would make a metric label of any string).
func (s *Server) authenticateUnread(ctx context.Context, method string) error {
	_, err := s.authenticate(ctx)
	if err != nil && s.apiMethods[method] {
		_, _ = s.refusedUnread(ctx, nil, &grpc.UnaryServerInfo{FullMethod: method},
			func(context.Context, any) (any, error) { return nil, err })
	}
	return err
}

// newOpenCalls is the slots of the calls that need no credentials.
func newOpenCalls() *semaphore.Weighted { return semaphore.NewWeighted(openCallsAtOnce) }
