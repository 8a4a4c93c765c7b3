package server

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"google.golang.org/grpc"
)

// DefaultSlowCallThreshold is how long a successful call may take before
// it is logged at info level; see WithSlowCallThreshold.
const DefaultSlowCallThreshold = 250 * time.Millisecond

// WithSlowCallThreshold sets which calls are logged. A call that fails, or
// that takes at least d, is always logged, at the level go-grpc-middleware
// gives its code (info for OK and the caller's errors, warn or error for
// the server's); a successful call faster than d is logged at debug level
// only, so at the default info level it costs no log line. A d of 0 logs
// every call at info level. The default is DefaultSlowCallThreshold. A
// waiting Begin counts its wait.
func WithSlowCallThreshold(d time.Duration) Option {
	return func(o *options) { o.slowCall = max(d, 0) }
}

// callLog logs finished unary calls through go-grpc-middleware's logging
// interceptor, but builds a log line only for the calls that will be
// logged: a call runs first, and only when it failed, was slow, or debug
// logging is on is its line built, with the call's own start time and
// duration and what the service noted of it (noteCall).
type callLog struct {
	logger    *slog.Logger
	threshold time.Duration
	// after writes the line of a call that has already run, from the
	// callNote in its context.
	after grpc.UnaryServerInterceptor
}

// callNote is what callLog measured of a call and what the service noted
// of it with noteCall.
type callNote struct {
	start   time.Time
	elapsed time.Duration
	// quiet lowers the line to debug level: a fast successful call.
	quiet bool

	tenant, scope, outcome string
}

type callNoteKey struct{}

// noteCall records the tenant, scope and (for Begin) outcome of the call
// whose context is ctx, for its log line; empty values are left out.
func noteCall(ctx context.Context, tenant, scope, outcome string) {
	if n, ok := ctx.Value(callNoteKey{}).(*callNote); ok {
		n.tenant, n.scope, n.outcome = tenant, scope, outcome
	}
}

// fields returns the noted values as log fields.
func (n *callNote) fields() logging.Fields {
	var f logging.Fields
	for _, kv := range [...][2]string{{"tenant", n.tenant}, {"scope", n.scope}, {"outcome", n.outcome}} {
		if kv[1] != "" {
			f = append(f, kv[0], kv[1])
		}
	}
	return f
}

func newCallLog(l *slog.Logger, threshold time.Duration) *callLog {
	c := &callLog{logger: l, threshold: threshold}
	c.after = logging.UnaryServerInterceptor(
		logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
			if n, ok := ctx.Value(callNoteKey{}).(*callNote); ok && n.quiet {
				lvl = logging.LevelDebug
			}
			l.Log(ctx, slog.Level(lvl), msg, fields...)
		}),
		logging.WithLogOnEvents(logging.FinishCall),
		// The call's own start and duration, not those of this replay
		// of its result: these fields win over the interceptor's.
		logging.WithFieldsFromContext(func(ctx context.Context) logging.Fields {
			n, ok := ctx.Value(callNoteKey{}).(*callNote)
			if !ok {
				return nil
			}
			return logging.Fields{"grpc.start_time", n.start.Format(time.RFC3339),
				"grpc.time_ms", fmt.Sprintf("%v", float32(n.elapsed.Nanoseconds()/1000)/1000)}
		}),
	)
	return c
}

// unary is the interceptor.
func (c *callLog) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	n := &callNote{start: time.Now()}
	ctx = context.WithValue(ctx, callNoteKey{}, n)
	resp, err := handler(ctx, req)
	n.elapsed = time.Since(n.start)
	n.quiet = err == nil && c.threshold > 0 && n.elapsed < c.threshold
	if n.quiet && !c.logger.Enabled(ctx, slog.LevelDebug) {
		return resp, err
	}
	_, _ = c.after(logging.InjectFields(ctx, n.fields()), req, info, func(context.Context, any) (any, error) { return resp, err })
	return resp, err
}
