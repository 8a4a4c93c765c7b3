package server

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// TenantHeader is the response header in which an AdminConn call reports
// the tenant it was authenticated as ("default" while auth is disabled),
// for callers that act for a person, such as the operator console. Ask for
// it with grpc.Header.
const TenantHeader = "idemcoord-tenant"

// AdminConn returns a connection to this server's idempotency.v1.Admin
// service that stays within the process. Its calls run through the same
// interceptors as calls over the network (metrics, logging, recovery,
// authentication, rate limit) and are authenticated the same way: a bearer
// token in the outgoing metadata (`authorization: Bearer …`), or a client
// certificate given as the context's peer (peer.NewContext with a
// credentials.TLSInfo whose VerifiedChains are set). The caller vouches for
// that peer: put there only a certificate chain that a tls.Config with the
// server's client CA verified, as net/http does for a request's TLS state.
//
// Only unary Admin methods are served; other methods fail UNIMPLEMENTED.
// grpc.Header call options receive the response header, including
// TenantHeader.
func (s *Server) AdminConn() grpc.ClientConnInterface {
	return &inProcessConn{s: s, admin: &adminService{s: s}}
}

// inProcessConn is the grpc.ClientConnInterface of AdminConn.
type inProcessConn struct {
	s     *Server
	admin *adminService
}

// inProcessAddr is the peer address of an in-process call that names none.
type inProcessAddr struct{}

func (inProcessAddr) Network() string { return "inprocess" }
func (inProcessAddr) String() string  { return "inprocess" }

func (c *inProcessConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	service, name, ok := strings.Cut(strings.TrimPrefix(method, "/"), "/")
	if !ok || service != idempotencyv1.Admin_ServiceDesc.ServiceName {
		return status.Errorf(codes.Unimplemented, "method %s is not served in process", method)
	}
	var handler func(any, context.Context, func(any) error, grpc.UnaryServerInterceptor) (any, error)
	for _, m := range idempotencyv1.Admin_ServiceDesc.Methods {
		if m.MethodName == name {
			handler = m.Handler
		}
	}
	if handler == nil {
		return status.Errorf(codes.Unimplemented, "unknown method %s", method)
	}
	in, ok := args.(proto.Message)
	if !ok {
		return status.Errorf(codes.Internal, "request %T is not a proto message", args)
	}
	out, ok := reply.(proto.Message)
	if !ok {
		return status.Errorf(codes.Internal, "reply %T is not a proto message", reply)
	}

	md, _ := metadata.FromOutgoingContext(ctx)
	sctx := metadata.NewIncomingContext(ctx, md.Copy())
	if _, ok := peer.FromContext(sctx); !ok {
		sctx = peer.NewContext(sctx, &peer.Peer{Addr: inProcessAddr{}})
	}
	stream := &inProcessStream{method: method}
	sctx = grpc.NewContextWithServerTransportStream(sctx, stream)

	// The server's own chain, then one step that reports the tenant the
	// chain authenticated.
	chain := append(append([]grpc.UnaryServerInterceptor(nil), c.s.unary...),
		func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
			_ = grpc.SetHeader(ctx, metadata.Pairs(TenantHeader, tenantFrom(ctx)))
			return next(ctx, req)
		})
	dec := func(m any) error {
		pm, ok := m.(proto.Message)
		if !ok {
			return fmt.Errorf("decode into %T: not a proto message", m)
		}
		proto.Merge(pm, in)
		return nil
	}
	resp, err := handler(c.admin, sctx, dec, chainUnary(chain))
	for _, o := range opts {
		if h, ok := o.(grpc.HeaderCallOption); ok {
			*h.HeaderAddr = stream.headerMD()
		}
	}
	if err != nil {
		return status.Convert(err).Err()
	}
	pm, ok := resp.(proto.Message)
	if !ok {
		return status.Errorf(codes.Internal, "response %T is not a proto message", resp)
	}
	proto.Reset(out)
	proto.Merge(out, pm)
	return nil
}

func (c *inProcessConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, status.Error(codes.Unimplemented, "streams are not served in process")
}

// chainUnary composes interceptors into one, the first outermost, as
// grpc.ChainUnaryInterceptor does.
func chainUnary(is []grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		next := handler
		for _, in := range slices.Backward(is) {
			h := next
			next = func(ctx context.Context, req any) (any, error) { return in(ctx, req, info, h) }
		}
		return next(ctx, req)
	}
}

// inProcessStream is the grpc.ServerTransportStream of an in-process call:
// it keeps the header the handlers set.
type inProcessStream struct {
	method string
	mu     sync.Mutex
	header metadata.MD
}

func (s *inProcessStream) Method() string { return s.method }

func (s *inProcessStream) SetHeader(md metadata.MD) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.header = metadata.Join(s.header, md)
	return nil
}

func (s *inProcessStream) SendHeader(md metadata.MD) error { return s.SetHeader(md) }

// SetTrailer drops trailers: no Admin method sets any.
func (s *inProcessStream) SetTrailer(metadata.MD) error { return nil }

func (s *inProcessStream) headerMD() metadata.MD {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.header.Copy()
}

var _ net.Addr = inProcessAddr{}
