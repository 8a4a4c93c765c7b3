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
// duration. The fields a service adds with logging.AddFields (tenant,
// scope, outcome) are in it.
type callLog struct {
	logger    *slog.Logger
	threshold time.Duration
	// every is go-grpc-middleware's interceptor as it runs around a call:
	// used for every call when the threshold is 0.
	every grpc.UnaryServerInterceptor
	// after writes the line of a call that has already run, from the
	// callTiming in its context.
	after grpc.UnaryServerInterceptor
}

// callTiming is what callLog measured of a call that already ran.
type callTiming struct {
	start   time.Time
	elapsed time.Duration
	// quiet lowers the line to debug level: a fast successful call.
	quiet bool
}

type callTimingKey struct{}

func newCallLog(l *slog.Logger, threshold time.Duration) *callLog {
	c := &callLog{logger: l, threshold: threshold}
	c.every = logging.UnaryServerInterceptor(interceptorLogger(l), logging.WithLogOnEvents(logging.FinishCall))
	c.after = logging.UnaryServerInterceptor(
		logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
			if t, ok := ctx.Value(callTimingKey{}).(callTiming); ok && t.quiet {
				lvl = logging.LevelDebug
			}
			l.Log(ctx, slog.Level(lvl), msg, fields...)
		}),
		logging.WithLogOnEvents(logging.FinishCall),
		// The call's own start and duration, not those of this replay
		// of its result: these fields win over the interceptor's.
		logging.WithFieldsFromContext(func(ctx context.Context) logging.Fields {
			t, ok := ctx.Value(callTimingKey{}).(callTiming)
			if !ok {
				return nil
			}
			return logging.Fields{"grpc.start_time", t.start.Format(time.RFC3339),
				"grpc.time_ms", fmt.Sprintf("%v", float32(t.elapsed.Nanoseconds()/1000)/1000)}
		}),
	)
	return c
}

// unary is the interceptor.
func (c *callLog) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if c.threshold <= 0 {
		return c.every(ctx, req, info, handler)
	}
	// A home for the fields the service adds, for the line if one is
	// written.
	ctx = logging.InjectFields(ctx, nil)
	start := time.Now()
	resp, err := handler(ctx, req)
	elapsed := time.Since(start)
	quiet := err == nil && elapsed < c.threshold
	if quiet && !c.logger.Enabled(ctx, slog.LevelDebug) {
		return resp, err
	}
	ctx = context.WithValue(ctx, callTimingKey{}, callTiming{start: start, elapsed: elapsed, quiet: quiet})
	_, _ = c.after(ctx, req, info, func(context.Context, any) (any, error) { return resp, err })
	return resp, err
}
