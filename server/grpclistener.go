package server

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
)

// DefaultGRPCReadTimeout is how long, by default, a call on the gRPC
// listener may take to send its request message once its headers are in;
// see WithGRPCReadTimeout.
const DefaultGRPCReadTimeout = 30 * time.Second

// WithGRPCReadTimeout bounds how long the gRPC listener waits for a call's
// request message (for a streaming call, its first message) after
// the call's headers: a call that has not sent it by then is cancelled (it
// ends CANCELLED: gRPC reports a call whose context ended before its
// message was read so, whatever the cause) and what it sent is freed. The
// default is DefaultGRPCReadTimeout.
func WithGRPCReadTimeout(d time.Duration) Option { return func(o *options) { o.grpcReadTimeout = d } }

// While auth is on, calls of the services that need no credentials
// (health, reflection) hold slots: each may send a request message of up
// to the message limit, so they hold at most openCallsAtOnce of them. A
// client is a remote address (an IPv6 /64).
const (
	// healthReadsAtOnce is how many health calls may be reading their
	// request message at once, all clients together; a call holds its
	// slot from its headers until its message is read, not while a Watch
	// stream stays open. One client holds at most healthReadsPerClient.
	// A new call always gets one: it takes the slot of the call that has
	// waited longest for its message, its own client's when that holds
	// its share, which is cancelled (see readSlots): clients that send
	// headers and no message cannot keep a probe out, such as kubelet's
	// (the Helm chart's readiness probe without TLS), which sends its
	// message with its headers.
	healthReadsAtOnce    = 12
	healthReadsPerClient = 4
	// watchesPerClient is how many Health/Watch streams one client may
	// hold open at once.
	watchesPerClient = 16
	// reflectionCallsAtOnce is how many reflection streams may be open at
	// once, all clients together (each of their messages is read under
	// the slot, so it is held while the stream is open); one client holds
	// at most reflectionCallsPerClient.
	reflectionCallsAtOnce    = 4
	reflectionCallsPerClient = 2
	// openCallsAtOnce is how many request messages of those services the
	// listener reads at once at most.
	openCallsAtOnce = healthReadsAtOnce + reflectionCallsAtOnce
)

const (
	// grpcIdleTimeout closes a connection that has had no call for this
	// long (clients reconnect when they need to): idle connections do not
	// keep the listener's connection slots.
	grpcIdleTimeout = 5 * time.Minute
	// grpcPingMinTime is the shortest interval between a client's
	// keepalive pings: a client that pings more often is disconnected.
	grpcPingMinTime = 20 * time.Second
	// grpcMaxHeaderListBytes caps a call's headers (HPACK-decoded, 32
	// bytes counted per field besides its name and value; trailers the
	// same): tokens, keys of 255 bytes and tracing headers (W3C baggage
	// is at most 8 KiB) fit many times over. A connection whose header
	// block passes it is closed at its next CONTINUATION frame, so one
	// that never ends its headers (before which no call exists, nor
	// authentication nor read timeout) holds no more than this; with no
	// call, it is closed as idle.
	grpcMaxHeaderListBytes = 32 << 10
)

const (
	// grpcMaxMessageBytes is the largest request message the gRPC
	// listener reads (grpc.MaxRecvMsgSize, gRPC's default).
	grpcMaxMessageBytes = 4 << 20
	// grpcStreamWindow is a call's HTTP/2 flow-control window: what a
	// client may send on a call whose message the listener is not
	// reading. It is static (no windows grown by bandwidth estimates),
	// so a call waiting for the budget of request messages holds at most
	// this much.
	grpcStreamWindow = 64 << 10
	// grpcConnWindow is a connection's flow-control window, static too:
	// what a client may have in flight over all its calls; what it sends
	// is held only within its calls' windows.
	grpcConnWindow = 1 << 20
	// grpcBufferedCallCost is what one call's request can hold while the
	// listener reads it, charged to the budget of request messages: its
	// message at the limit as read and as decoded (or a second message,
	// which a call that takes one may still send before the listener
	// refuses it), with their 5-byte prefixes, and its window.
	grpcBufferedCallCost = 2*(grpcMaxMessageBytes+5) + grpcStreamWindow
	// grpcBudgetWait is how long a call waits for room in the budget of
	// request messages before it is refused RESOURCE_EXHAUSTED.
	grpcBudgetWait = time.Second
)

// GRPCBufferedCallBytes is what one call is charged in the gRPC
// listener's budget of request messages while its message is read (see
// WithGRPCMaxBufferedBytes): a budget or a share holds at least one call.
const GRPCBufferedCallBytes = grpcBufferedCallCost

// DefaultGRPCMaxBufferedBytes is the default budget of request message
// bytes the gRPC listener holds at once (WithGRPCMaxBufferedBytes): 16
// calls with a message at the 4 MiB limit, about 129 MiB.
const DefaultGRPCMaxBufferedBytes = 16 * grpcBufferedCallCost

// WithGRPCMaxBufferedBytes bounds the request message bytes the gRPC
// listener holds at once, all calls of the API together (default, or 0:
// DefaultGRPCMaxBufferedBytes). Each call is charged what a message at
// the 4 MiB limit costs while the listener reads it, about 8 MiB, and
// gives it back once its message is read: a call that does not fit waits
// up to a second for room, then is refused RESOURCE_EXHAUSTED before its
// message is read. It must be at least one call's charge. See
// WithGRPCMaxBufferedBytesPerClient.
func WithGRPCMaxBufferedBytes(n int64) Option { return func(o *options) { o.grpcMaxBuffered = n } }

// WithGRPCMaxBufferedBytesPerClient bounds the share of the gRPC
// listener's budget of request messages (WithGRPCMaxBufferedBytes) that
// one client holds at once: one tenant while auth is on, whatever
// connections and addresses its calls come from; one remote IP address
// (IPv6 /64) while it is off. Default, or 0: an eighth of the budget, but
// at least one call's charge. Past its share, a client's calls wait and
// are refused as past the budget, while other clients are served.
func WithGRPCMaxBufferedBytesPerClient(n int64) Option {
	return func(o *options) { o.grpcClientBuffered = n }
}

// GRPCMaxBufferedBytes is the most request message bytes the gRPC
// listener holds at once: the budget of the API's calls, and the calls of
// health and reflection that may be open at once while auth is on.
func (s *Server) GRPCMaxBufferedBytes() int64 {
	return s.opts.grpcMaxBuffered + openCallsAtOnce*grpcBufferedCallCost
}

// checkGRPCBudget checks the options of the budget of request messages and
// sets its default.
func (o *options) checkGRPCBudget() error {
	if o.grpcMaxBuffered == 0 {
		o.grpcMaxBuffered = DefaultGRPCMaxBufferedBytes
	}
	if o.grpcMaxBuffered < grpcBufferedCallCost {
		return fmt.Errorf("server: gRPC buffered message budget %d: want at least one call's charge, %d bytes", o.grpcMaxBuffered, grpcBufferedCallCost)
	}
	if o.grpcClientBuffered < 0 || (o.grpcClientBuffered > 0 && o.grpcClientBuffered < grpcBufferedCallCost) {
		return fmt.Errorf("server: gRPC buffered message share per client %d: want at least one call's charge, %d bytes, or 0 for the default",
			o.grpcClientBuffered, grpcBufferedCallCost)
	}
	return nil
}

// listenerOptions are the grpc.Server options that bound what a
// connection can hold: the tap that authenticates a call and arms its read
// timeout before its message is read, the message and header list limits,
// static flow-control windows, the idle timeout and the keepalive policy.
func (s *Server) listenerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InTapHandle(s.admitCall),
		grpc.MaxRecvMsgSize(grpcMaxMessageBytes),
		grpc.MaxHeaderListSize(grpcMaxHeaderListBytes),
		grpc.InitialWindowSize(grpcStreamWindow),
		grpc.InitialConnWindowSize(grpcConnWindow),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: grpcIdleTimeout}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: grpcPingMinTime, PermitWithoutStream: true}),
	}
}

// messageReadKey is the context key of what a call does once its request
// message is read (see messageRead).
type messageReadKey struct{}

// bufferedClientKey is the context key of the client whose share of the
// budget of request messages a call is charged to (see admitCall).
type bufferedClientKey struct{}

// errReadTimeout is the cause of a call cancelled because its request
// message did not arrive within the read timeout (for the server's own
// code: the caller sees CANCELLED, see WithGRPCReadTimeout).
var errReadTimeout = status.Error(codes.DeadlineExceeded, "the request message did not arrive in time")

// errEvicted is the cause of a health call cancelled because a newer call
// took its slot while it still had not sent its message (see readSlots).
var errEvicted = status.Error(codes.ResourceExhausted, "the request message did not arrive before a newer call needed the slot")

// admitCall runs on a new call's headers, before gRPC reads its request
// message (a tap.ServerInHandle). While auth is on, it refuses a call of a
// service that needs credentials without valid ones, UNAUTHENTICATED, with
// the rule of the chain (authenticate, which still authenticates every
// call it admits), and counts and logs the refusal as the chain would
// (see refuseUnread); a call of a service that needs none (health,
// reflection) takes its slots (see openCalls.admit), or is refused
// RESOURCE_EXHAUSTED. Either way, a caller without credentials has no
// request message read. Every admitted call must then send its message
// within the read timeout (a streaming call, its first message). An admitted call names the client whose share
// of the budget of request messages it is charged to: its tenant while
// auth is on, else its remote address (see budgetedRegistrar).
func (s *Server) admitCall(ctx context.Context, info *tap.Info) (context.Context, error) {
	address := ""
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		address = clientOf(p.Addr.String())
	}
	client := "address " + address
	untilRead := func() {}
	open := false // a call that needs no credentials while auth is on
	if s.policies.Load().AuthEnabled() {
		if unauthenticatedService(ctx, interceptors.NewServerCallMeta(info.FullMethodName, nil, nil)) {
			tctx, err := s.authenticateUnread(ctx, info.FullMethodName)
			if err != nil {
				return nil, err
			}
			client = "tenant " + tenantFrom(tctx)
		} else {
			open = true
		}
	}
	ctx, cancel := context.WithCancelCause(ctx)
	if open {
		read, end, err := s.openCalls.admit(info.FullMethodName, address, func() { cancel(errEvicted) })
		if err != nil {
			cancel(nil)
			return nil, err
		}
		// A call cancelled (its read timed out, or a newer call took its
		// slot) gives its slots back at once.
		untilRead = sync.OnceFunc(read)
		context.AfterFunc(ctx, untilRead)
		context.AfterFunc(ctx, end)
	}
	timer := time.AfterFunc(s.opts.grpcReadTimeout, func() { cancel(errReadTimeout) })
	context.AfterFunc(ctx, func() { timer.Stop() })
	read := func() {
		timer.Stop()
		untilRead()
	}
	return context.WithValue(context.WithValue(ctx, messageReadKey{}, read), bufferedClientKey{}, client), nil
}

// messageRead stops the read timeout of the call whose context is ctx and
// gives back what it holds until then: its request message is in (for a
// streaming call, its first message).
func messageRead(ctx context.Context) {
	if read, ok := ctx.Value(messageReadKey{}).(func()); ok {
		read()
	}
}

// readUnary is the first unary interceptor: the call's message is read.
func readUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	messageRead(ctx)
	return handler(ctx, req)
}

// readStream is the first stream interceptor: the call's message is read
// once its first message is (health's Watch and reflection's streams read
// one first).
func readStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if _, ok := ss.Context().Value(messageReadKey{}).(func()); !ok {
		return handler(srv, ss)
	}
	return handler(srv, &firstMessageStream{ServerStream: ss})
}

// firstMessageStream calls messageRead once its first message is received.
type firstMessageStream struct {
	grpc.ServerStream
	received bool
}

// RecvMsg receives a message into m.
func (s *firstMessageStream) RecvMsg(m any) error {
	err := s.ServerStream.RecvMsg(m)
	if !s.received {
		s.received = true
		messageRead(s.Context())
	}
	return err
}

// authenticateUnread authenticates a call of method from ctx's metadata
// and peer alone, before its request is read, with the chain's rule
// (authenticate), and returns ctx with the tenant. A refused call of an
// API method is counted and logged as the chain counts and logs its
// refusals (see refuseUnread).
func (s *Server) authenticateUnread(ctx context.Context, method string) (context.Context, error) {
	tctx, err := s.authenticate(ctx)
	if err != nil {
		s.refuseUnread(ctx, method, err)
		return nil, err
	}
	return tctx, nil
}

// refuseUnread counts and logs err, the refusal of a call of method before
// its request is read, as the chain counts and logs its refusals
// (grpc_server_handled_total with err's code, a "finished call" line),
// when method is one of the API; a method the API does not have is
// neither (it would make a metric label of any string).
func (s *Server) refuseUnread(ctx context.Context, method string, err error) {
	if s.apiMethods[method] {
		_, _ = s.refusedUnread(ctx, nil, &grpc.UnaryServerInfo{FullMethod: method},
			func(context.Context, any) (any, error) { return nil, err })
	}
}

// budgetedRegistrar registers services on the gRPC server with their
// unary methods' request messages held within the listener's budget
// (WithGRPCMaxBufferedBytes): before a call of the gRPC listener reads
// its message, it takes grpcBufferedCallCost bytes of its client's share
// (admitCall names the client), waiting up to grpcBudgetWait for room,
// else it is refused RESOURCE_EXHAUSTED, counted and logged as the chain's
// refusals; once the message is read (or the call fails to read it) it
// gives them back. gRPC reads a unary call's message when the method's
// handler decodes it, which is what this wraps; a call that did not come
// through the listener's tap (the HTTP listener's, whose body its own
// budget holds) is not charged. Streaming methods are registered as they
// are.
type budgetedRegistrar struct{ s *Server }

// RegisterService registers sd's service, its unary methods budgeted.
func (r budgetedRegistrar) RegisterService(sd *grpc.ServiceDesc, impl any) {
	d := *sd
	d.Methods = slices.Clone(sd.Methods)
	for i := range d.Methods {
		d.Methods[i].Handler = r.s.budgetedMethod("/"+sd.ServiceName+"/"+d.Methods[i].MethodName, d.Methods[i].Handler)
	}
	r.s.grpc.RegisterService(&d, impl)
}

// budgetedMethod is handler with its call's message read within the budget
// of request messages; see budgetedRegistrar.
func (s *Server) budgetedMethod(method string, handler grpc.MethodHandler) grpc.MethodHandler {
	return func(srv any, ctx context.Context, dec func(any) error, chain grpc.UnaryServerInterceptor) (any, error) {
		client, ok := ctx.Value(bufferedClientKey{}).(string)
		if !ok {
			return handler(srv, ctx, dec, chain)
		}
		if err := s.grpcBudget.takeWithin(ctx, client, grpcBufferedCallCost, grpcBudgetWait); err != nil {
			err = overBudget(err)
			s.refuseUnread(ctx, method, err)
			return nil, err
		}
		charged := true
		giveBack := func() {
			if charged {
				charged = false
				s.grpcBudget.give(client, grpcBufferedCallCost)
			}
		}
		defer giveBack()
		return handler(srv, ctx, func(m any) error {
			defer giveBack()
			return dec(m)
		}, chain)
	}
}

// overBudget is the status of a call refused because the budget of
// request messages, or its client's share, cannot take it (takeWithin's
// error).
func overBudget(err error) error {
	if errors.Is(err, errClientShare) {
		return status.Error(codes.ResourceExhausted, "too many request messages being received at once for this caller: retry later")
	}
	return status.Error(codes.ResourceExhausted, "too many request messages being received at once: retry later")
}

// openCalls are the slots of the calls that need no credentials while
// auth is on.
type openCalls struct {
	healthReads         *readSlots
	watches, reflection *clientSlots
}

// newOpenCalls is the slots of the calls that need no credentials.
func newOpenCalls() *openCalls {
	return &openCalls{
		healthReads: newReadSlots(healthReadsAtOnce, healthReadsPerClient),
		watches:     newClientSlots(0, watchesPerClient),
		reflection:  newClientSlots(reflectionCallsAtOnce, reflectionCallsPerClient),
	}
}

// admit takes the slots a call of method (health or reflection) from
// client needs, or refuses it RESOURCE_EXHAUSTED when its client holds
// all its open watches or reflection streams: a health call, a slot to
// read its message, which it gives back with untilRead once its message
// is read (evict cancels it when a newer call takes that slot first; see
// readSlots); a Watch besides, one of its client's open watches; a
// reflection stream, a slot of its own. The call gives back the rest with untilEnd
// once it ends; both may be called more than once, and untilEnd gives
// back what untilRead has not.
func (o *openCalls) admit(method, client string, evict func()) (untilRead, untilEnd func(), err error) {
	untilRead, untilEnd = func() {}, func() {}
	if !strings.HasPrefix(method, "/"+healthpb.Health_ServiceDesc.ServiceName+"/") {
		if err := o.reflection.take(client); err != nil {
			return nil, nil, status.Error(codes.ResourceExhausted, "too many reflection calls at once: "+err.Error())
		}
		return untilRead, sync.OnceFunc(func() { o.reflection.give(client) }), nil
	}
	if method == healthpb.Health_Watch_FullMethodName {
		if err := o.watches.take(client); err != nil {
			return nil, nil, status.Error(codes.ResourceExhausted, "too many health watches open at once: "+err.Error())
		}
		untilEnd = sync.OnceFunc(func() { o.watches.give(client) })
	}
	return o.healthReads.take(client, evict), untilEnd, nil
}

// readSlots are the slots of calls reading their request message: all
// clients together hold at most n, one client at most perClient. A new
// call always gets one: when its client holds its share, the client's own
// call that has held its slot longest without its message arriving is
// evicted (cancelled) and its slot is the new call's; when all n are
// held, the oldest of all is. So slow or silent senders bound what is
// read at once, as the slots are for, but cannot keep out a caller that
// sends its message with its headers, not even from its own address: to
// refuse it they would have to take its slot in the moment between its
// headers and its message, not hold slots for the read timeout.
type readSlots struct {
	n, perClient int
	mu           sync.Mutex
	byClient     map[string]int
	held         []*readSlot // oldest first; at most n
}

// readSlot is one call's slot in readSlots.
type readSlot struct {
	client string
	evict  func()
}

func newReadSlots(n, perClient int) *readSlots {
	return &readSlots{n: n, perClient: perClient, byClient: map[string]int{}}
}

// take takes a slot for client, without waiting, evicting client's own
// oldest holder when client holds its share, else the oldest holder when
// all are held (evict is what evicts this one in turn). The call gives
// the slot back with release, which may be called more than once.
func (r *readSlots) take(client string, evict func()) (release func()) {
	r.mu.Lock()
	var evicted *readSlot
	switch {
	case r.byClient[client] >= r.perClient:
		// The client's own oldest: others at its address (behind one
		// NAT, or the node kubelet probes from) cannot keep it out.
		evicted = r.held[slices.IndexFunc(r.held, func(h *readSlot) bool { return h.client == client })]
	case len(r.held) >= r.n:
		evicted = r.held[0]
	}
	if evicted != nil {
		r.dropLocked(evicted)
	}
	s := &readSlot{client: client, evict: evict}
	r.held = append(r.held, s)
	r.byClient[client]++
	r.mu.Unlock()
	if evicted != nil {
		evicted.evict()
	}
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.dropLocked(s)
	}
}

// dropLocked gives back s's slot, unless it was given back already; r.mu
// is held.
func (r *readSlots) dropLocked(s *readSlot) {
	i := slices.Index(r.held, s)
	if i < 0 {
		return
	}
	r.held = slices.Delete(r.held, i, i+1)
	if r.byClient[s.client]--; r.byClient[s.client] <= 0 {
		delete(r.byClient, s.client)
	}
}

// clientSlots are slots of which all clients together hold at most n (0:
// no bound) and one client at most perClient.
type clientSlots struct {
	n, perClient int
	mu           sync.Mutex
	held         int
	byClient     map[string]int
}

func newClientSlots(n, perClient int) *clientSlots {
	return &clientSlots{n: n, perClient: perClient, byClient: map[string]int{}}
}

// take takes a slot for client, without waiting.
func (c *clientSlots) take(client string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.n > 0 && c.held >= c.n:
		return errors.New("retry later")
	case c.byClient[client] >= c.perClient:
		return errors.New("this client holds its share, retry later")
	}
	c.held++
	c.byClient[client]++
	return nil
}

// give gives back a slot client took.
func (c *clientSlots) give(client string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.held--
	if c.byClient[client]--; c.byClient[client] <= 0 {
		delete(c.byClient, client)
	}
}
