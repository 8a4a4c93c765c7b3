package server

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"strings"
	"sync"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// tenantKey is the context key of the authenticated tenant.
type tenantKey struct{}

// tenantFrom returns the name of the tenant the call is authenticated as
// (DefaultTenant while auth is disabled).
func tenantFrom(ctx context.Context) string {
	if t, ok := ctx.Value(tenantKey{}).(*tenant); ok {
		return t.name
	}
	return DefaultTenant
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

// authenticate finds the caller's tenant from a verified TLS client
// certificate or a bearer token. With auth disabled it lets every call
// through as DefaultTenant. It is an auth.AuthFunc.
func (s *Server) authenticate(ctx context.Context) (context.Context, error) {
	pols := s.policies.Load()
	if !pols.AuthEnabled() {
		return ctx, nil
	}
	if names, ok := certificateNames(ctx); ok {
		for _, name := range names {
			for i := range pols.tenants {
				if pols.tenants[i].name == name {
					return context.WithValue(ctx, tenantKey{}, &pols.tenants[i]), nil
				}
			}
		}
		return nil, status.Error(codes.Unauthenticated, "the client certificate names no configured tenant")
	}
	token, err := auth.AuthFromMD(ctx, "bearer")
	if err != nil {
		return nil, status.Error(codes.Unauthenticated, "credentials required: send `authorization: Bearer <token>` or a client certificate")
	}
	sum := sha256.Sum256([]byte(token))
	var found *tenant
	for i := range pols.tenants {
		t := &pols.tenants[i]
		// Compare against every tenant so timing does not tell which matched.
		if t.token != nil && subtle.ConstantTimeCompare(t.token, sum[:]) == 1 && found == nil {
			found = t
		}
	}
	if found == nil {
		return nil, status.Error(codes.Unauthenticated, "invalid bearer token")
	}
	return context.WithValue(ctx, tenantKey{}, found), nil
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
