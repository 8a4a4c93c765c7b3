package clients

import (
	"context"
	"net/http"

	"github.com/dunglas/httpsfv"
	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// ClientKeyOption configures UnaryClientInterceptor.
type ClientKeyOption func(*clientKeyOptions)

type clientKeyOptions struct {
	selector func(fullMethod string) bool
	newKey   func() string
}

func defaultClientKeyOptions() clientKeyOptions {
	return clientKeyOptions{selector: func(string) bool { return true }, newKey: uuid.NewString}
}

// WithClientKeyMethods gives keys only to calls of the named methods (full
// names such as "/payments.v1.Payments/Charge"); calls of other methods
// pass through untouched. By default every unary call gets one.
func WithClientKeyMethods(fullMethods ...string) ClientKeyOption {
	set := make(map[string]bool, len(fullMethods))
	for _, m := range fullMethods {
		set[m] = true
	}
	return func(o *clientKeyOptions) { o.selector = func(m string) bool { return set[m] } }
}

// WithClientKeyFunc sets how a new key is made (default: a random UUIDv4 in
// its canonical lower-case form). f is called once per logical call that
// has no key.
func WithClientKeyFunc(f func() string) ClientKeyOption {
	return func(o *clientKeyOptions) { o.newKey = f }
}

// UnaryClientInterceptor gives every outgoing unary call that carries no
// "idempotency-key" metadata a new key (a UUIDv4 unless
// WithClientKeyFunc), so that a server guarded by UnaryServerInterceptor
// runs the call's side effect once however often the call is retried.
// Install it on the connection to such a server:
//
//	grpc.NewClient(addr, grpc.WithUnaryInterceptor(clients.UnaryClientInterceptor()), …)
//
// It runs once per logical call, above grpc-go's own retries: every attempt
// that grpc-go makes of the call (transparent retries, and the retryPolicy
// of the connection's service config) carries the same key. Retries you
// make yourself, by calling again, are new logical calls: give them one key
// with WithIdempotencyKey before the first. A call that already carries a
// key (WithIdempotencyKey, or metadata set by hand) keeps it.
func UnaryClientInterceptor(opts ...ClientKeyOption) grpc.UnaryClientInterceptor {
	o := defaultClientKeyOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if o.selector(method) {
			if md, _ := metadata.FromOutgoingContext(ctx); len(md.Get(MetadataKey)) == 0 {
				ctx = metadata.AppendToOutgoingContext(ctx, MetadataKey, o.newKey())
			}
		}
		return invoker(ctx, method, req, reply, cc, callOpts...)
	}
}

// WithIdempotencyKey returns a copy of ctx whose outgoing gRPC calls carry
// key as their "idempotency-key" metadata, replacing any key ctx carried.
// Use one such ctx for every call of one operation, your own retries
// included; it works with or without UnaryClientInterceptor.
func WithIdempotencyKey(ctx context.Context, key string) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	md.Set(MetadataKey, key)
	return metadata.NewOutgoingContext(ctx, md)
}

// StampIdempotencyKey gives req an Idempotency-Key header when it has none
// (a new UUIDv4, written as a structured-field string, RFC 9651:
// "\"8e03978e-…\""), and returns the key req carries: the new one, or the
// one it had (parsed as HTTPMiddleware does; the raw value when it does
// not parse). Call it once per operation, before the retry loop, and
// send the same *http.Request (or its clones) on every retry: retrying
// clients such as go-retryablehttp then repeat the key, and the service's
// HTTPMiddleware runs the operation once.
func StampIdempotencyKey(req *http.Request) string {
	if v := req.Header.Get(HTTPKeyHeader); v != "" {
		if key, err := ParseIdempotencyKey(v); err == nil {
			return key
		}
		return v
	}
	key := uuid.NewString()
	v, err := httpsfv.Marshal(httpsfv.NewItem(key))
	if err != nil { // a UUID is always a valid sf-string
		v = `"` + key + `"`
	}
	if req.Header == nil {
		req.Header = http.Header{}
	}
	req.Header.Set(HTTPKeyHeader, v)
	return key
}
