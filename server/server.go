package server

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"time"

	"buf.build/go/protovalidate"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/ratelimit"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/selector"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/ledger"
)

// Server is the coordinator: the idempotency.v1.Coordinator service, gRPC
// health (NOT_SERVING while the database is unreachable) and reflection, on
// one grpc.Server.
type Server struct {
	idempotencyv1.UnimplementedCoordinatorServer

	store     *ledger.Store
	policies  atomic.Pointer[Policies]
	validator protovalidate.Validator
	logger    *slog.Logger
	grpc      *grpc.Server
	health    *health.Server
	// stopping ends the health service's Watch streams (see
	// watchesEndAtShutdown).
	stopping context.CancelFunc
	ready    atomic.Bool
	metrics  *metrics
	api      http.Handler
	opts     options
	unary    []grpc.UnaryServerInterceptor // the chain, for AdminConn
	// batchItem is the chain each call of a Batch runs through as its
	// unary method: call log, recovery and rate limit (the Batch RPC
	// itself was counted and authenticated).
	batchItem grpc.UnaryServerInterceptor
	// refusedUnread counts and logs, as the gRPC chain does, a call of an
	// API method that a listener refused unauthenticated before reading
	// its request (see authenticateUnread); apiMethods are those methods'
	// full names.
	refusedUnread grpc.UnaryServerInterceptor
	apiMethods    map[string]bool
	// openCalls are the slots of calls that need no credentials while
	// auth is on (see admitCall).
	openCalls *openCalls
	// grpcBudget holds the request messages the gRPC listener reads (see
	// budgetedRegistrar).
	grpcBudget *bodyBudget
	// callWorkers run the calls of Batch RPCs.
	callWorkers *callWorkers
}

// Option configures a Server.
type Option func(*options)

type options struct {
	policies       *Policies
	logger         *slog.Logger
	healthInterval time.Duration
	maxScopeLabels int
	grpcOptions    []grpc.ServerOption
	unary          []grpc.UnaryServerInterceptor
	metricsToken   string
	slowCall       time.Duration

	grpcReadTimeout    time.Duration
	grpcMaxBuffered    int64
	grpcClientBuffered int64

	httpMaxBody      int64
	httpReadTimeout  time.Duration
	httpMaxBuffered  int64
	httpAllowedHosts map[string]bool

	httpOtherMaxBody   int64
	httpClientBuffered int64
}

// WithPolicies sets the per-scope policy and limits (default
// DefaultPolicies()).
func WithPolicies(p *Policies) Option { return func(o *options) { o.policies = p } }

// WithLogger sets the logger for calls and background work.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// WithHealthInterval sets how often the database is pinged to drive the gRPC
// health status (default 1s).
func WithHealthInterval(d time.Duration) Option { return func(o *options) { o.healthInterval = d } }

// WithMaxScopeLabels bounds the distinct scope label values of the domain
// metrics (default 200); later scopes are counted as "other". Only scopes
// the policy file names get a label of their own in any case (see
// Policies.scopeLabel).
func WithMaxScopeLabels(n int) Option { return func(o *options) { o.maxScopeLabels = n } }

// WithMetricsToken puts /metrics behind a bearer token: a scrape must send
// `Authorization: Bearer <token>` (compared in constant time) or gets 401.
// /healthz and /readyz stay open. Empty (the default) leaves /metrics open.
func WithMetricsToken(token string) Option { return func(o *options) { o.metricsToken = token } }

// WithHTTPMaxBodyBytes caps a request body on the HTTP listener, as sent
// and once inflated, and one message of the HTTP/JSON API either way
// (default DefaultHTTPMaxBodyBytes); see NewHTTPServer.
func WithHTTPMaxBodyBytes(n int64) Option { return func(o *options) { o.httpMaxBody = n } }

// WithHTTPMaxBufferedBytes bounds the request body bytes the HTTP listener
// holds at once, all requests together, as read and as inflated (default:
// DefaultHTTPMaxBufferedBytes or 16 body caps, whichever is larger; 0 keeps
// the default). It must be at least the body cap. See NewHTTPServer.
func WithHTTPMaxBufferedBytes(n int64) Option { return func(o *options) { o.httpMaxBuffered = n } }

// WithHTTPMaxBufferedBytesPerClient bounds the share of the HTTP
// listener's budget of buffered body bytes (WithHTTPMaxBufferedBytes) that
// one client, a remote IP address or IPv6 /64 network, holds at once
// (default, or 0: an eighth of the budget, but at least one body at the
// cap). Behind a proxy, every request through it is one client: raise the
// share to the budget to turn shares off. See NewHTTPServer.
func WithHTTPMaxBufferedBytesPerClient(n int64) Option {
	return func(o *options) { o.httpClientBuffered = n }
}

// WithHTTPOtherMaxBodyBytes caps the body of a request to the HTTP
// listener that is not a call of an API method (default
// DefaultHTTPOtherMaxBodyBytes): the forms of a console mounted next to
// the API need more. Such requests are held within a budget of their own,
// 8 bodies at this cap but at least 1 MiB; see NewHTTPServer.
func WithHTTPOtherMaxBodyBytes(n int64) Option { return func(o *options) { o.httpOtherMaxBody = n } }

// WithHTTPReadTimeout bounds how long the HTTP listener waits for a
// request's headers and body (default DefaultHTTPReadTimeout); see
// NewHTTPServer.
func WithHTTPReadTimeout(d time.Duration) Option { return func(o *options) { o.httpReadTimeout = d } }

// WithHTTPAllowedHosts adds names or addresses (a port, if any, is ignored;
// "*" is every host) that the Host header of a request to the HTTP listener
// may give while auth is off, besides the loopback ones; see NewHTTPServer.
func WithHTTPAllowedHosts(hosts ...string) Option {
	return func(o *options) {
		for _, h := range hosts {
			if h = normalizeHost(h); h != "" {
				o.httpAllowedHosts[h] = true
			}
		}
	}
}

// WithGRPCOptions adds options to the grpc.Server (TLS credentials, message
// size limits, …).
func WithGRPCOptions(opts ...grpc.ServerOption) Option {
	return func(o *options) { o.grpcOptions = append(o.grpcOptions, opts...) }
}

// WithUnaryInterceptors adds interceptors that run inside logging,
// recovery, authentication and rate limiting, just before the service.
func WithUnaryInterceptors(i ...grpc.UnaryServerInterceptor) Option {
	return func(o *options) { o.unary = append(o.unary, i...) }
}

// streamWorkers is the number of goroutines that serve calls; see New.
const streamWorkers = 256

// HealthServices are the service names whose health the server reports:
// the whole server ("") and the Coordinator.
var healthServices = []string{"", idempotencyv1.Coordinator_ServiceDesc.ServiceName}

// New builds a Server over store. Call Serve to accept calls.
func New(store *ledger.Store, opts ...Option) (*Server, error) {
	o := options{policies: DefaultPolicies(), logger: slog.New(slog.DiscardHandler), healthInterval: time.Second, maxScopeLabels: 200,
		slowCall: DefaultSlowCallThreshold, grpcReadTimeout: DefaultGRPCReadTimeout,
		httpMaxBody: DefaultHTTPMaxBodyBytes, httpOtherMaxBody: DefaultHTTPOtherMaxBodyBytes, httpReadTimeout: DefaultHTTPReadTimeout, httpAllowedHosts: map[string]bool{}}
	for _, opt := range opts {
		opt(&o)
	}
	if o.httpMaxBody <= 0 || o.httpMaxBody > math.MaxUint32 {
		return nil, fmt.Errorf("server: HTTP body cap %d: want 1 to %d bytes", o.httpMaxBody, uint32(math.MaxUint32))
	}
	if o.httpMaxBuffered == 0 {
		o.httpMaxBuffered = max(DefaultHTTPMaxBufferedBytes, httpBufferedBodyCaps*o.httpMaxBody)
	}
	if o.httpMaxBuffered < o.httpMaxBody {
		return nil, fmt.Errorf("server: HTTP buffered body budget %d: want at least the body cap, %d bytes", o.httpMaxBuffered, o.httpMaxBody)
	}
	if o.httpClientBuffered < 0 || (o.httpClientBuffered > 0 && o.httpClientBuffered < o.httpMaxBody) {
		return nil, fmt.Errorf("server: HTTP buffered body share per client %d: want at least the body cap, %d bytes, or 0 for the default",
			o.httpClientBuffered, o.httpMaxBody)
	}
	if o.httpOtherMaxBody <= 0 || o.httpOtherMaxBody > o.httpMaxBody {
		return nil, fmt.Errorf("server: HTTP body cap of requests that are not API calls %d: want 1 to the body cap, %d bytes",
			o.httpOtherMaxBody, o.httpMaxBody)
	}
	if err := o.checkGRPCBudget(); err != nil {
		return nil, err
	}
	if o.grpcReadTimeout <= 0 {
		return nil, fmt.Errorf("server: gRPC read timeout %v: want more than 0", o.grpcReadTimeout)
	}
	if o.httpReadTimeout <= 0 {
		return nil, fmt.Errorf("server: HTTP read timeout %v: want more than 0", o.httpReadTimeout)
	}
	pv, err := protovalidate.New()
	if err != nil {
		return nil, fmt.Errorf("server: build validator: %w", err)
	}
	s := &Server{store: store, validator: pv, logger: o.logger, opts: o, callWorkers: newCallWorkers(), openCalls: newOpenCalls(),
		grpcBudget: newBodyBudget(o.grpcMaxBuffered, o.grpcClientBuffered, grpcBufferedCallCost),
		metrics:    newMetrics(store, o.maxScopeLabels, o.logger)}
	s.policies.Store(o.policies)
	s.metrics.scopes.named = func(scope string) string { return s.policies.Load().scopeLabel(scope) }

	recoveryHandler := recovery.WithRecoveryHandlerContext(s.recoverPanic)
	needsAuth := selector.MatchFunc(unauthenticatedService)
	limiter := &tenantLimiter{server: s, byKey: map[string]*rate.Limiter{}}
	callLog := newCallLog(o.logger, o.slowCall).unary
	unary := append([]grpc.UnaryServerInterceptor{
		s.metrics.grpc.UnaryServerInterceptor(),
		callLog,
		recovery.UnaryServerInterceptor(recoveryHandler),
		selector.UnaryServerInterceptor(auth.UnaryServerInterceptor(s.authenticate), needsAuth),
		// A Batch takes one token per call instead (batchItem).
		selector.UnaryServerInterceptor(ratelimit.UnaryServerInterceptor(limiter), selector.MatchFunc(rateLimited)),
	}, o.unary...)
	s.unary = unary
	s.refusedUnread = chainUnary([]grpc.UnaryServerInterceptor{s.metrics.grpc.UnaryServerInterceptor(), callLog})
	s.apiMethods = map[string]bool{}
	for _, sd := range []grpc.ServiceDesc{idempotencyv1.Coordinator_ServiceDesc, idempotencyv1.Admin_ServiceDesc} {
		for _, m := range sd.Methods {
			s.apiMethods["/"+sd.ServiceName+"/"+m.MethodName] = true
		}
	}
	s.batchItem = chainUnary([]grpc.UnaryServerInterceptor{
		callLog,
		recovery.UnaryServerInterceptor(recoveryHandler),
		ratelimit.UnaryServerInterceptor(limiter),
	})
	gopts := append(s.listenerOptions(),
		// Calls run on long-lived worker goroutines whose stacks have
		// already grown, instead of a new goroutine per call that grows
		// its stack again (about 8% of the coordinator's CPU under load,
		// in runtime.copystack). Beyond streamWorkers calls at once, gRPC
		// starts a goroutine per call as without workers.
		grpc.NumStreamWorkers(streamWorkers),
		grpc.ForceServerCodecV2(newLenientCodec()),
		// The first interceptor stops the read timeout that admitCall set.
		grpc.ChainUnaryInterceptor(append([]grpc.UnaryServerInterceptor{readUnary}, unary...)...),
		grpc.ChainStreamInterceptor(
			readStream,
			s.metrics.grpc.StreamServerInterceptor(),
			logging.StreamServerInterceptor(interceptorLogger(o.logger), logging.WithLogOnEvents(logging.FinishCall)),
			recovery.StreamServerInterceptor(recoveryHandler),
			selector.StreamServerInterceptor(auth.StreamServerInterceptor(s.authenticate), needsAuth),
		))
	gopts = append(gopts, o.grpcOptions...)
	s.grpc = grpc.NewServer(gopts...)
	idempotencyv1.RegisterCoordinatorServer(budgetedRegistrar{s}, s)
	idempotencyv1.RegisterAdminServer(budgetedRegistrar{s}, &adminService{s: s})
	s.health = health.NewServer()
	for _, name := range healthServices {
		s.health.SetServingStatus(name, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	var stopping context.Context
	stopping, s.stopping = context.WithCancel(context.Background())
	healthpb.RegisterHealthServer(s.grpc, watchesEndAtShutdown{s.health, stopping})
	reflection.Register(s.grpc)
	s.metrics.grpc.InitializeMetrics(s.grpc)
	s.metrics.registerReady(s.Ready)
	if s.api, err = newAPIHandler(s.grpc, uint32(o.httpMaxBody)); err != nil {
		return nil, err
	}
	return s, nil
}

// recoverPanic is the recovery handler of every call (and every call of a
// Batch): it logs the panic with its stack and answers INTERNAL with no
// detail.
func (s *Server) recoverPanic(ctx context.Context, p any) error {
	s.logger.ErrorContext(ctx, "panic in call", "panic", p, "stack", string(debug.Stack()))
	return status.Error(codes.Internal, "internal error")
}

// SetPolicies replaces the policy and limits for calls that start after it
// returns, unchecked; a running coordinator reloads its file with Reload,
// which refuses changes that take a restart.
func (s *Server) SetPolicies(p *Policies) { s.policies.Store(p) }

// Ready reports whether the database answered the latest health check.
func (s *Server) Ready() bool { return s.ready.Load() }

// HTTPHandler serves /metrics (Prometheus; behind a bearer token with
// WithMetricsToken), /healthz (the process is up),
// /readyz (the database is reachable: 200, else 503), and every Coordinator
// and Admin method as HTTP/JSON under /idempotency.v1.Coordinator/ and
// /idempotency.v1.Admin/ (Connect protocol and gRPC-Web, see the README).
// A listener serves it through NewHTTPServer, whose guard bounds the work a
// request causes before it gets here.
func (s *Server) HTTPHandler() http.Handler {
	mux := http.NewServeMux()
	for _, name := range apiServices {
		mux.Handle("/"+name+"/", s.api)
	}
	mux.Handle("GET /metrics", requireBearer(s.opts.metricsToken, promhttp.HandlerFor(s.metrics.registry, promhttp.HandlerOpts{})))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !s.Ready() {
			http.Error(w, "database unreachable", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ready\n")
	})
	return mux
}

// requireBearer serves next only to requests that send token as a bearer
// token; without a token it is next.
func requireBearer(token string, next http.Handler) http.Handler {
	if token == "" {
		return next
	}
	want := sha256.Sum256([]byte(token))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		sum := sha256.Sum256([]byte(got))
		if !ok || subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="metrics"`)
			http.Error(w, "metrics need `Authorization: Bearer <token>`", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// GRPCServer returns the underlying grpc.Server, for registering more
// services before Serve.
func (s *Server) GRPCServer() *grpc.Server { return s.grpc }

// Serve accepts calls on lis until Shutdown, and keeps the health status in
// step with the database meanwhile.
func (s *Server) Serve(lis net.Listener) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.watchHealth(ctx)
	return s.grpc.Serve(lis)
}

// Shutdown stops taking calls and waits for those in flight to finish, or
// for ctx to end, after which it cancels them.
func (s *Server) Shutdown(ctx context.Context) {
	s.health.Shutdown()
	s.stopping()
	s.ready.Store(false)
	done := make(chan struct{})
	go func() {
		s.grpc.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		s.grpc.Stop()
		<-done
	}
	s.callWorkers.shutdown()
}

// RunReaper runs the reaper with the current policies' settings until ctx
// ends (see ledger.Store.Reap). Every replica may run it.
func (s *Server) RunReaper(ctx context.Context) {
	rs := s.policies.Load().Reaper()
	if rs.Interval <= 0 {
		s.logger.Warn("reaper disabled (reaper.interval: 0s): stale leases and expired records stay until read")
		return
	}
	t := time.NewTicker(rs.Interval)
	defer t.Stop()
	for {
		// A pass that stopped with work left is followed at once by the
		// next, so the reaper keeps pace with any rate of new records
		// instead of a fixed number per interval.
		more, err := s.reapPass(ctx)
		if err != nil && ctx.Err() == nil {
			s.logger.Warn("reaper pass failed; retrying at the next interval", "err", err)
		}
		if more && err == nil && ctx.Err() == nil {
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// ReapOnce runs one reaper pass with the current settings and counts the
// leases it found lapsed, the records it archived and the archived records
// it deleted.
func (s *Server) ReapOnce(ctx context.Context) error {
	_, err := s.reapPass(ctx)
	return err
}

// reapPass is ReapOnce that also reports whether the pass left work.
func (s *Server) reapPass(ctx context.Context) (more bool, err error) {
	pols := s.policies.Load()
	rs := pols.Reaper()
	unknownRetention, scopeRetention := pols.unknownRetention()
	res, err := s.store.Reap(ctx, &ledger.ReapParams{BatchSize: rs.BatchSize, Retention: rs.ExpiredRetention,
		UnknownRetention: unknownRetention, ScopeRetention: scopeRetention, ArchiveRetention: rs.ArchiveRetention})
	s.metrics.observeReap(res)
	if err == nil && !res.More {
		// Wall-clock time, not the server's clock: Prometheus compares it
		// with its own time().
		s.metrics.reaperCaughtUp.SetToCurrentTime()
	}
	if res.Unknown+res.Expired+res.Deleted+res.Archived+res.ArchivePruned > 0 {
		s.logger.Debug("reaper pass", "unknown", res.Unknown, "expired", res.Expired, "deleted", res.Deleted,
			"archived", res.Archived, "archive_pruned", res.ArchivePruned, "more", res.More)
	}
	return res.More, err
}

// watchHealth pings the database every interval and reports SERVING or
// NOT_SERVING accordingly.
func (s *Server) watchHealth(ctx context.Context) {
	serving := false
	t := time.NewTicker(s.opts.healthInterval)
	defer t.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, max(s.opts.healthInterval, time.Second))
		err := s.store.Ping(pctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if ok := err == nil; ok != serving {
			serving = ok
			s.ready.Store(ok)
			st := healthpb.HealthCheckResponse_NOT_SERVING
			if ok {
				st = healthpb.HealthCheckResponse_SERVING
				s.logger.Info("database reachable: serving")
			} else {
				s.logger.Warn("database unreachable: not serving", "err", err)
			}
			for _, name := range healthServices {
				s.health.SetServingStatus(name, st)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// interceptorLogger adapts slog to go-grpc-middleware's logging interface.
func interceptorLogger(l *slog.Logger) logging.Logger {
	return logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
		l.Log(ctx, slog.Level(lvl), msg, fields...)
	})
}

// watchesEndAtShutdown is the health service, whose Watch streams end once
// the server shuts down (Canceled, after NOT_SERVING when the watcher gets
// it first): a Watch never ends by itself, and one held open by any caller
// would keep a graceful stop waiting until its timeout.
type watchesEndAtShutdown struct {
	*health.Server
	stopping context.Context
}

// Watch serves a Watch stream until it ends or the server shuts down.
func (h watchesEndAtShutdown) Watch(req *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	defer context.AfterFunc(h.stopping, cancel)()
	return h.Server.Watch(req, watchStream{stream, ctx})
}

// watchStream is a Watch stream with a context of its own.
type watchStream struct {
	healthpb.Health_WatchServer
	ctx context.Context
}

func (w watchStream) Context() context.Context { return w.ctx }
