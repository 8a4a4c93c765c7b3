package clients

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

const (
	// batchMaxCalls is the most calls one Batch RPC carries (the
	// coordinator takes up to 256).
	batchMaxCalls = 128
	// batchMaxCallBytes is the largest request that goes into a batch; a
	// larger one (a Complete with a big response) goes as its own unary
	// call.
	batchMaxCallBytes = 64 << 10
	// batchMaxBytes bounds the requests of one Batch RPC, well under
	// gRPC's default 4 MiB message limit.
	batchMaxBytes = 2 << 20
	// batchMaxAnswerBytes is the receive limit of a Batch's answer, which
	// carries the stored responses of its replays. An answer larger than
	// that is asked for again call by call.
	batchMaxAnswerBytes = 64 << 20
)

// WithCallBatching makes concurrent calls of the Client share RPCs: Begin
// (without a wait), Complete, Fail, Lookup and Heartbeat calls go to the
// coordinator's Batch method, at most maxInFlight Batch RPCs at a time.
// Nothing waits for a batch to fill: while fewer than maxInFlight RPCs are in
// flight a call is sent as soon as the goroutines ready at that moment have
// had their turn (runtime.Gosched), with the calls they made meanwhile, or
// alone; the calls that arrive while all are in flight go together in the
// next RPC. Under load this divides the fixed costs of a call (HTTP/2
// frames, gRPC's paths on both sides, logging) by the calls per RPC and
// hands the coordinator larger batches to write in one transaction. 2 is a
// good value; 0 (the default) sends every call as its own unary RPC.
//
// Each call keeps what a unary call has: its own answer or its own error
// (the same codes and details), its own deadline (sent as the call's
// timeout; the coordinator ends the call at it), the coordinator's
// validation, permission checks, rate limit and metrics per call, and the
// Client's retries (a Batch RPC that fails UNAVAILABLE is retried whole,
// which is safe for each call as it is for a unary one). A call goes unary
// instead when it has CallOptions, outgoing metadata of its own, is larger
// than 64 KiB, or is a Begin that waits; and every call goes unary once the
// coordinator answers that it has no Batch method (an older version).
//
// A Begin whose context ends before its answer came back returns the
// context's error once that answer is in (normally milliseconds later; at
// most 3 s, after which it is awaited in the background), having ended an
// acquisition the answer carries with Fail ABANDONED (reason
// ReleaseReason), since nobody will act on it: the coordinator cannot see
// that one call of a Batch was given up. A unary Begin returns at once, and
// the coordinator ends such an acquisition itself.
func WithCallBatching(maxInFlight int) Option {
	return func(o *options) { o.batchRPCs = max(maxInFlight, 0) }
}

// batcher gathers a Client's concurrent calls into Batch RPCs.
type batcher struct {
	c   *Client
	max int

	mu       sync.Mutex
	queue    []*batchItem
	inFlight int
	taking   bool // a sender is about to take the queue (see run)

	// unary is set once the coordinator answered UNIMPLEMENTED for Batch.
	unary atomic.Bool
}

// batchItem is one call waiting for its result.
type batchItem struct {
	call     *idempotencyv1.BatchCall
	size     int
	deadline time.Time // zero: none
	done     chan struct{}
	result   *idempotencyv1.BatchResult
	err      error // the Batch RPC's own error
}

// batchable reports whether a call with ctx, opts and req may go into a
// batch, and req's size.
func (b *batcher) batchable(ctx context.Context, opts []grpc.CallOption, req proto.Message) (int, bool) {
	if b == nil || len(opts) > 0 || b.unary.Load() {
		return 0, false
	}
	if md, ok := metadata.FromOutgoingContext(ctx); ok && md.Len() > 0 {
		return 0, false
	}
	size := proto.Size(req)
	return size, size <= batchMaxCallBytes
}

// call sends call in a batch and waits for its result within ctx.
func (b *batcher) call(ctx context.Context, call *idempotencyv1.BatchCall, size int) (*idempotencyv1.BatchResult, error) {
	it := &batchItem{call: call, size: size, done: make(chan struct{})}
	it.deadline, _ = ctx.Deadline()
	if err := ctx.Err(); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	b.enqueue(it)
	select {
	case <-it.done:
		if it.err != nil {
			return nil, it.err
		}
		return it.result, nil
	case <-ctx.Done():
		if !b.withdraw(it) && call.GetBegin() != nil {
			b.settleGone(it)
		}
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// withdraw takes it out of the queue if it is still there (not sent), and
// reports whether it was.
func (b *batcher) withdraw(it *batchItem) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, q := range b.queue {
		if q == it {
			b.queue = append(b.queue[:i:i], b.queue[i+1:]...)
			return true
		}
	}
	return false
}

// settleGone deals with the answer to a Begin whose caller left before it
// came back: an acquisition it carries is ended with Fail ABANDONED, since
// nobody will act on it. It waits for the answer (normally milliseconds)
// for at most releaseTimeout, so that the caller's own release (Once's, the
// interceptor's) finds the key settled; after that the answer is awaited in
// the background.
func (b *batcher) settleGone(it *batchItem) {
	t := time.NewTimer(releaseTimeout)
	defer t.Stop()
	select {
	case <-it.done:
		b.releaseAnswered(context.Background(), it)
	case <-t.C:
		b.c.background(func(bg context.Context) {
			select {
			case <-it.done:
				b.releaseAnswered(bg, it)
			case <-bg.Done():
			}
		})
	}
}

// releaseAnswered ends the acquisition that the answered Begin item it
// carries, if any, as Once and the interceptor end one nobody will act on.
func (b *batcher) releaseAnswered(ctx context.Context, it *batchItem) {
	if res := it.result.GetBegin(); it.err == nil && res.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		_ = b.c.newLease(it.call.GetBegin(), res, time.Now()).release(ctx)
	}
}

// enqueue queues it and, while fewer than max Batch RPCs are in flight and
// no sender is about to take the queue, starts a sender.
func (b *batcher) enqueue(it *batchItem) {
	b.mu.Lock()
	b.queue = append(b.queue, it)
	if b.inFlight >= b.max || b.taking {
		b.mu.Unlock()
		return
	}
	b.inFlight++
	b.taking = true
	b.mu.Unlock()
	go b.run()
}

// take removes from the queue the calls of the next Batch RPC: as many as
// fit the limits, in arrival order. b.mu is held.
func (b *batcher) take() []*batchItem {
	n, bytes := 0, 0
	for n < len(b.queue) && n < batchMaxCalls && (n == 0 || bytes+b.queue[n].size <= batchMaxBytes) {
		bytes += b.queue[n].size
		n++
	}
	batch := b.queue[:n:n]
	b.queue = b.queue[n:]
	if len(b.queue) == 0 {
		b.queue = nil
	}
	return batch
}

// run sends batches until the queue is empty. It takes the queue only
// after letting the goroutines that are ready run first (runtime.Gosched):
// the callers that one answer woke call again at nearly the same time, and
// their calls then go in one RPC, where sending the first of them at once
// put it alone in an RPC of its own, with the rest in another behind it
// (and the coordinator wrote the lone call in a round of its own, which
// the others then waited for). b.taking, set while a sender is about to
// take the queue, keeps those callers from starting a second sender for
// the same calls; it is set before the callers of an answer are woken.
func (b *batcher) run() {
	for {
		runtime.Gosched()
		b.mu.Lock()
		b.taking = false
		if len(b.queue) == 0 {
			b.inFlight--
			b.mu.Unlock()
			return
		}
		batch := b.take()
		b.mu.Unlock()
		b.send(batch)
		b.mu.Lock()
		if b.taking {
			// Another sender will take the queue: this one is done.
			b.inFlight--
			b.mu.Unlock()
			answer(batch)
			return
		}
		b.taking = true
		b.mu.Unlock()
		answer(batch)
	}
}

// answer hands every call of batch its result (or error).
func answer(batch []*batchItem) {
	for _, it := range batch {
		close(it.done)
	}
}

// send makes one Batch RPC for batch and sets every call's result. The
// RPC's deadline is the latest of its calls' (none if a call has none);
// each call's own goes as its timeout.
func (b *batcher) send(batch []*batchItem) {
	if b.unary.Load() {
		b.eachUnary(batch)
		return
	}
	now := time.Now()
	req := &idempotencyv1.BatchRequest{Calls: make([]*idempotencyv1.BatchCall, len(batch))}
	var latest time.Time
	bounded := true
	for i, it := range batch {
		call := it.call
		if !it.deadline.IsZero() {
			call = proto.CloneOf(call)
			call.Timeout = durationpb.New(max(it.deadline.Sub(now), time.Millisecond))
			latest = maxTime(latest, it.deadline)
		} else {
			bounded = false
		}
		req.Calls[i] = call
	}
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if bounded {
		ctx, cancel = context.WithDeadline(ctx, latest)
	}
	defer cancel()
	resp, err := b.c.rpc.Batch(ctx, req, grpc.MaxCallRecvMsgSize(batchMaxAnswerBytes))
	switch {
	case status.Code(err) == codes.Unimplemented:
		b.unary.Store(true)
		b.eachUnary(batch)
	case status.Code(err) == codes.ResourceExhausted && resp == nil:
		// The answer was too large to receive (or the coordinator
		// refused the request's size): ask call by call.
		b.eachUnary(batch)
	case err != nil:
		for _, it := range batch {
			it.err = err
		}
	case len(resp.GetResults()) != len(batch):
		err := status.Errorf(codes.Internal, "coordinator answered %d results to a Batch of %d calls", len(resp.GetResults()), len(batch))
		for _, it := range batch {
			it.err = err
		}
	default:
		var again []*batchItem
		for i, it := range batch {
			it.result = resp.GetResults()[i]
			if tooLargeToBatch(it) {
				again = append(again, it)
			}
		}
		b.eachUnary(again)
	}
}

// tooLargeToBatch reports whether it is a call that changed nothing (a
// Lookup, or a Begin, which did not acquire since it failed) answered
// RESOURCE_EXHAUSTED: the coordinator refuses a batched call whose answer
// would not fit in the Batch's (a replay of a large response, say), and
// such a call is repeated alone, which is safe (a Begin keeps its
// attempt_id). A call refused by the rate limit is repeated too, and
// answers as the rate limit decides then.
func tooLargeToBatch(it *batchItem) bool {
	if status.FromProto(it.result.GetError()).Code() != codes.ResourceExhausted {
		return false
	}
	return it.call.GetLookup() != nil || it.call.GetBegin() != nil
}

// eachUnary makes each call of batch as its own unary RPC, at once.
func (b *batcher) eachUnary(batch []*batchItem) {
	var wg sync.WaitGroup
	for _, it := range batch {
		wg.Go(func() {
			ctx, cancel := context.Background(), context.CancelFunc(func() {})
			if !it.deadline.IsZero() {
				ctx, cancel = context.WithDeadline(ctx, it.deadline)
			}
			defer cancel()
			it.result = unaryCall(ctx, b.c.rpc, it.call)
		})
	}
	wg.Wait()
}

// unaryCall makes call as the unary RPC of its kind and wraps the answer
// as a BatchResult (an error answer is a BatchResult_Error).
func unaryCall(ctx context.Context, rpc idempotencyv1.CoordinatorClient, call *idempotencyv1.BatchCall) *idempotencyv1.BatchResult {
	out := &idempotencyv1.BatchResult{}
	var err error
	switch c := call.GetCall().(type) {
	case *idempotencyv1.BatchCall_Begin:
		var r *idempotencyv1.BeginResponse
		r, err = rpc.Begin(ctx, c.Begin)
		out.Result = &idempotencyv1.BatchResult_Begin{Begin: r}
	case *idempotencyv1.BatchCall_Complete:
		var r *idempotencyv1.CompleteResponse
		r, err = rpc.Complete(ctx, c.Complete)
		out.Result = &idempotencyv1.BatchResult_Complete{Complete: r}
	case *idempotencyv1.BatchCall_Fail:
		var r *idempotencyv1.FailResponse
		r, err = rpc.Fail(ctx, c.Fail)
		out.Result = &idempotencyv1.BatchResult_Fail{Fail: r}
	case *idempotencyv1.BatchCall_Lookup:
		var r *idempotencyv1.LookupResponse
		r, err = rpc.Lookup(ctx, c.Lookup)
		out.Result = &idempotencyv1.BatchResult_Lookup{Lookup: r}
	case *idempotencyv1.BatchCall_Heartbeat:
		var r *idempotencyv1.HeartbeatResponse
		r, err = rpc.Heartbeat(ctx, c.Heartbeat)
		out.Result = &idempotencyv1.BatchResult_Heartbeat{Heartbeat: r}
	}
	if err != nil {
		return &idempotencyv1.BatchResult{Result: &idempotencyv1.BatchResult_Error{Error: status.Convert(err).Proto()}}
	}
	return out
}

// batchAnswer returns the response of type T in res, or the error it
// carries.
func batchAnswer[T proto.Message](res *idempotencyv1.BatchResult, err error, get func(*idempotencyv1.BatchResult) T) (T, error) {
	var zero T
	if err != nil {
		return zero, err
	}
	if e := res.GetError(); e != nil {
		return zero, status.ErrorProto(e)
	}
	out := get(res)
	if !out.ProtoReflect().IsValid() {
		return zero, status.Errorf(codes.Internal, "coordinator answered a Batch call with %T, not %T", res.GetResult(), zero)
	}
	return out, nil
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
