package clients

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"sync"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Client calls an idemcoord coordinator. It is safe for concurrent use.
//
// Every call is retried with backoff while the coordinator answers
// UNAVAILABLE (see WithMaxAttempts and WithBackoff), since each is safe to
// repeat: Begin carries an attempt_id, and the coordinator answers a
// repeated Complete or Fail with the same token and content OK.
//
// Once and the interceptor may leave work running after they return: when
// Complete or Fail cannot reach the coordinator, they keep trying in the
// background for up to one lease. Shutdown waits for that work.
type Client struct {
	rpc    idempotencyv1.CoordinatorClient
	batch  *batcher // nil without WithCallBatching
	opts   options
	logger *slog.Logger

	bgCtx    context.Context
	bgCancel context.CancelFunc
	bgMu     sync.Mutex
	bgCount  int
	bgIdle   chan struct{} // closed when bgCount drops to 0; nil while 0
}

// New returns a Client that calls the coordinator over conn (a
// *grpc.ClientConn, typically). The Client does not own conn: close it
// yourself after Shutdown.
func New(conn grpc.ClientConnInterface, opts ...Option) *Client {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	rc := &retryingConn{ClientConnInterface: conn, token: o.token, retry: retry.UnaryClientInterceptor(
		retry.WithMax(o.attempts),
		retry.WithBackoff(o.backoff),
		retry.WithCodes(codes.Unavailable),
		retry.WithOnRetryCallback(func(ctx context.Context, attempt uint, err error) {
			o.logger.DebugContext(ctx, "idempotency: retrying coordinator call", "attempt", attempt, "err", err)
		}),
	)}
	c := &Client{rpc: idempotencyv1.NewCoordinatorClient(rc), opts: o, logger: o.logger}
	if o.batchRPCs > 0 {
		c.batch = &batcher{c: c, max: o.batchRPCs}
	}
	c.bgCtx, c.bgCancel = context.WithCancel(context.Background())
	return c
}

// retryingConn applies go-grpc-middleware's retry interceptor to the unary
// calls of a connection the Client did not dial itself.
type retryingConn struct {
	grpc.ClientConnInterface
	retry grpc.UnaryClientInterceptor
	token string // sent as "authorization: Bearer <token>" when set
}

func (r *retryingConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	if r.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+r.token)
	}
	return r.retry(ctx, method, args, reply, nil,
		func(ctx context.Context, method string, req, reply any, _ *grpc.ClientConn, opts ...grpc.CallOption) error {
			return r.ClientConnInterface.Invoke(ctx, method, req, reply, opts...)
		}, opts...)
}

// Begin claims a key (see idempotency.v1.Coordinator.Begin). When
// req.AttemptId is empty, Begin sends a copy of req with a fresh random
// attempt_id, the same on each of its own retries: a retried Begin whose
// reply was lost gets the same lease token, never a stranded key. To retry
// Begin across calls as the same logical attempt, set AttemptId yourself.
// Extra opts may include go-grpc-middleware retry call options.
func (c *Client) Begin(ctx context.Context, req *idempotencyv1.BeginRequest, opts ...grpc.CallOption) (*idempotencyv1.BeginResponse, error) {
	if req.GetAttemptId() == "" {
		req = proto.CloneOf(req)
		req.AttemptId = newAttemptID()
	}
	if req.GetWait().AsDuration() <= 0 {
		if size, ok := c.batch.batchable(ctx, opts, req); ok {
			res, err := c.batch.call(ctx, &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Begin{Begin: req}}, size)
			return batchAnswer(res, err, (*idempotencyv1.BatchResult).GetBegin)
		}
	}
	return c.rpc.Begin(ctx, req, opts...)
}

// Complete stores the response and ends the record COMPLETED (see
// idempotency.v1.Coordinator.Complete).
func (c *Client) Complete(ctx context.Context, req *idempotencyv1.CompleteRequest, opts ...grpc.CallOption) (*idempotencyv1.CompleteResponse, error) {
	if size, ok := c.batch.batchable(ctx, opts, req); ok {
		res, err := c.batch.call(ctx, &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Complete{Complete: req}}, size)
		return batchAnswer(res, err, (*idempotencyv1.BatchResult).GetComplete)
	}
	return c.rpc.Complete(ctx, req, opts...)
}

// Fail ends the attempt with a failure (see idempotency.v1.Coordinator.Fail).
// A FAILURE_KIND_ABANDONED Fail that finds no record answers an empty
// FailResponse, not NOT_FOUND: an abandoned first attempt deletes its record,
// so a retried Fail whose first reply was lost finds nothing, which is the
// outcome it asked for.
func (c *Client) Fail(ctx context.Context, req *idempotencyv1.FailRequest, opts ...grpc.CallOption) (*idempotencyv1.FailResponse, error) {
	var res *idempotencyv1.FailResponse
	var err error
	if size, ok := c.batch.batchable(ctx, opts, req); ok {
		var r *idempotencyv1.BatchResult
		r, err = c.batch.call(ctx, &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Fail{Fail: req}}, size)
		res, err = batchAnswer(r, err, (*idempotencyv1.BatchResult).GetFail)
	} else {
		res, err = c.rpc.Fail(ctx, req, opts...)
	}
	if err != nil && req.GetKind() == idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED && status.Code(err) == codes.NotFound {
		return &idempotencyv1.FailResponse{}, nil
	}
	return res, err
}

// Lookup reads a record as in effect now (see
// idempotency.v1.Coordinator.Lookup).
func (c *Client) Lookup(ctx context.Context, req *idempotencyv1.LookupRequest, opts ...grpc.CallOption) (*idempotencyv1.LookupResponse, error) {
	if size, ok := c.batch.batchable(ctx, opts, req); ok {
		res, err := c.batch.call(ctx, &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Lookup{Lookup: req}}, size)
		return batchAnswer(res, err, (*idempotencyv1.BatchResult).GetLookup)
	}
	return c.rpc.Lookup(ctx, req, opts...)
}

// Heartbeat extends the current attempt's lease (see
// idempotency.v1.Coordinator.Heartbeat).
func (c *Client) Heartbeat(ctx context.Context, req *idempotencyv1.HeartbeatRequest, opts ...grpc.CallOption) (*idempotencyv1.HeartbeatResponse, error) {
	if size, ok := c.batch.batchable(ctx, opts, req); ok {
		res, err := c.batch.call(ctx, &idempotencyv1.BatchCall{Call: &idempotencyv1.BatchCall_Heartbeat{Heartbeat: req}}, size)
		return batchAnswer(res, err, (*idempotencyv1.BatchResult).GetHeartbeat)
	}
	return c.rpc.Heartbeat(ctx, req, opts...)
}

// Shutdown waits until the background work of Once and the interceptor has
// finished (each piece ends within one lease). If ctx ends first, it cancels
// that work, waits for its goroutines to return and answers ctx's error; a
// record whose Complete or Fail was cancelled then reads UNKNOWN once its
// lease runs out. Call it after the gRPC server that uses the interceptor
// has stopped; work started after Shutdown returned is not waited for.
func (c *Client) Shutdown(ctx context.Context) error {
	idle := c.idle()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		c.bgCancel()
		<-idle
		return ctx.Err()
	}
}

// idle returns a channel closed when no background work runs.
func (c *Client) idle() <-chan struct{} {
	c.bgMu.Lock()
	defer c.bgMu.Unlock()
	if c.bgIdle == nil {
		ch := make(chan struct{})
		close(ch)
		return ch
	}
	return c.bgIdle
}

// background runs f in a goroutine that Shutdown waits for.
func (c *Client) background(f func(ctx context.Context)) {
	c.bgMu.Lock()
	if c.bgCount == 0 {
		c.bgIdle = make(chan struct{})
	}
	c.bgCount++
	c.bgMu.Unlock()
	go func() {
		defer func() {
			c.bgMu.Lock()
			defer c.bgMu.Unlock()
			if c.bgCount--; c.bgCount == 0 {
				close(c.bgIdle)
				c.bgIdle = nil
			}
		}()
		f(c.bgCtx)
	}()
}

// newAttemptID returns 32 random hex digits.
func newAttemptID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
