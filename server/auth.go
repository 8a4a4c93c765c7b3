package server

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/ledger"
)

// tenantKey is the context key of the authenticated tenant.
type tenantKey struct{}

// tenantFrom returns the name of the tenant the call is authenticated as
// (ledger.DefaultTenant while auth is disabled).
func tenantFrom(ctx context.Context) string {
	if t, ok := ctx.Value(tenantKey{}).(*tenant); ok {
		return t.name
	}
	return ledger.DefaultTenant
}

// unauthenticatedServices may be called without credentials: health checks
// and reflection reveal no records.
func unauthenticatedService(_ context.Context, c interceptors.CallMeta) bool {
	switch c.Service {
	case healthpb.Health_ServiceDesc.ServiceName, "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection":
		return false
	}
	return true
}

// rateLimited reports whether a call takes a token of its tenant's rate
// limit: every authenticated call but a Batch, whose calls take one each.
func rateLimited(ctx context.Context, c interceptors.CallMeta) bool {
	return unauthenticatedService(ctx, c) && c.FullMethod() != idempotencyv1.Coordinator_Batch_FullMethodName
}

// authenticate finds the caller's tenant from a verified TLS client
// certificate or a bearer token; each authenticates on its own. A
// certificate selects a tenant only when that tenant lists its subject CN or
// one of its URI SANs in client_cert_names; a verified certificate naming no
// tenant is ignored, so a valid token on the same call still works. When
// both name a tenant they must name the same one. A bearer token that is
// sent must be valid. With auth disabled every call goes through as
// ledger.DefaultTenant. It is an auth.AuthFunc.
func (s *Server) authenticate(ctx context.Context) (context.Context, error) {
	pols := s.policies.Load()
	if !pols.AuthEnabled() {
		return ctx, nil
	}
	byCert, err := pols.tenantByCertificate(ctx)
	if err != nil {
		return nil, err
	}
	byToken, err := pols.tenantByToken(ctx)
	if err != nil {
		return nil, err
	}
	switch {
	case byCert != nil && byToken != nil && byCert != byToken:
		return nil, status.Error(codes.Unauthenticated, "the client certificate and the bearer token name different tenants")
	case byCert != nil:
		return context.WithValue(ctx, tenantKey{}, byCert), nil
	case byToken != nil:
		return context.WithValue(ctx, tenantKey{}, byToken), nil
	}
	return nil, status.Error(codes.Unauthenticated, "credentials required: send `authorization: Bearer <token>` or a client certificate listed in a tenant's client_cert_names")
}

// tenantByCertificate returns the tenant whose client_cert_names lists a
// name of the call's verified client certificate, or nil (no certificate,
// or one no tenant lists). A certificate whose names select two tenants is
// refused.
func (p *Policies) tenantByCertificate(ctx context.Context) (*tenant, error) {
	names, ok := certificateNames(ctx)
	if !ok {
		return nil, nil
	}
	var found *tenant
	for i := range p.tenants {
		t := &p.tenants[i]
		for _, name := range names {
			if !slices.Contains(t.certNames, name) {
				continue
			}
			if found != nil && found != t {
				return nil, status.Error(codes.Unauthenticated, "the client certificate's names select more than one tenant")
			}
			found = t
		}
	}
	return found, nil
}

// tenantByToken returns the tenant of the call's bearer token, nil when the
// call sends no authorization header, or UNAUTHENTICATED for a malformed
// header, more than one authorization value (gRPC metadata or HTTP
// headers, which the transcoder passes as metadata: taking one of them
// would let a proxy that checks another disagree about who calls), or an
// unknown token.
func (p *Policies) tenantByToken(ctx context.Context) (*tenant, error) {
	switch values := metadata.ValueFromIncomingContext(ctx, "authorization"); {
	case len(values) == 0:
		return nil, nil
	case len(values) > 1:
		return nil, status.Error(codes.Unauthenticated, "more than one authorization header: send one `Bearer <token>`")
	}
	token, err := auth.AuthFromMD(ctx, "bearer")
	if err != nil || token == "" {
		return nil, status.Error(codes.Unauthenticated, "malformed authorization header: want `Bearer <token>`")
	}
	sum := sha256.Sum256([]byte(token))
	var found *tenant
	for i := range p.tenants {
		t := &p.tenants[i]
		// Compare against every tenant so timing does not tell which matched.
		if t.token != nil && subtle.ConstantTimeCompare(t.token, sum[:]) == 1 && found == nil {
			found = t
		}
	}
	if found == nil {
		return nil, status.Error(codes.Unauthenticated, "invalid bearer token")
	}
	return found, nil
}

// certificateNames returns the subject common name and URI SANs of a
// verified client certificate, if the call came with one.
func certificateNames(ctx context.Context) ([]string, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, false
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return nil, false
	}
	cert := info.State.VerifiedChains[0][0]
	var names []string
	if cert.Subject.CommonName != "" {
		names = append(names, cert.Subject.CommonName)
	}
	for _, u := range cert.URIs {
		names = append(names, u.String())
	}
	return names, true
}

// authorizeScope fails PERMISSION_DENIED unless the caller's tenant may use
// scope.
func authorizeScope(ctx context.Context, scope string) error {
	t, ok := ctx.Value(tenantKey{}).(*tenant)
	if !ok {
		return nil // auth disabled
	}
	for _, g := range t.scopes {
		if globMatch(g, scope) {
			return nil
		}
	}
	return status.Errorf(codes.PermissionDenied, "scope %q is not allowed for tenant %q", scope, t.name)
}

// authorizeAdmin fails PERMISSION_DENIED unless auth is disabled or the
// caller's tenant is an admin tenant.
func authorizeAdmin(ctx context.Context) error {
	t, ok := ctx.Value(tenantKey{}).(*tenant)
	if !ok || t.admin {
		return nil
	}
	return status.Errorf(codes.PermissionDenied, "tenant %q may not call the Admin service", t.name)
}

// tenantLimiter is a token bucket per tenant, configured by the current
// policies' rate_limit. It implements the go-grpc-middleware ratelimit
// Limiter.
type tenantLimiter struct {
	server *Server
	mu     sync.Mutex
	byKey  map[string]*rate.Limiter
}

func (l *tenantLimiter) Limit(ctx context.Context) error {
	rl := l.server.policies.Load().rateLimit
	if rl == nil {
		return nil
	}
	name := tenantFrom(ctx)
	key := fmt.Sprintf("%s\x1f%g\x1f%d", name, rl.RequestsPerSecond, rl.Burst)
	l.mu.Lock()
	lim := l.byKey[key]
	if lim == nil {
		// Forget buckets of an older configuration.
		for k := range l.byKey {
			if strings.HasPrefix(k, name+"\x1f") {
				delete(l.byKey, k)
			}
		}
		lim = rate.NewLimiter(rate.Limit(rl.RequestsPerSecond), rl.Burst)
		l.byKey[key] = lim
	}
	l.mu.Unlock()
	if !lim.Allow() {
		return fmt.Errorf("tenant %q exceeded %g calls per second", name, rl.RequestsPerSecond)
	}
	return nil
}
