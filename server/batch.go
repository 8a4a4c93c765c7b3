package server

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// maxBatchCalls is the most calls one Batch may carry.
const maxBatchCalls = 256

// maxBatchAnswerBytes bounds the answers of a Batch's calls that changed
// nothing (Lookups, and Begins that did not acquire: replays carry stored
// responses of up to a MiB each): past it such a call is answered
// RESOURCE_EXHAUSTED instead, to be made alone. Kept under gRPC's default
// 4 MiB receive limit, with room for the answers that are always sent (an
// acquisition's, a Complete's), and under the HTTP listener's 6 MiB answer
// buffer once bodies are base64 in JSON.
const maxBatchAnswerBytes = 3 << 20

// Batch makes several calls in one RPC; see idempotency.v1.Coordinator.
// Each call runs concurrently through the method its unary call reaches
// (Begin, Complete, Fail, Lookup, Heartbeat), under the RPC's context and
// its own timeout, with its own panic recovery, rate-limit token and log
// line (see WithSlowCallThreshold). The RPC fails whole only when it is not
// well-formed: no calls, more than 256, a call without a request, or
// invalid UTF-8 anywhere (the codec cannot tell which call it was in).
//
// The answer is bounded: once the calls' answers add up to
// maxBatchAnswerBytes, a further call that changed nothing is answered
// RESOURCE_EXHAUSTED (and its answer dropped at once); a call that wrote
// (an acquisition, a Complete, a Fail, a Heartbeat) always gets its answer,
// so that nothing committed is lost with an answer too large to receive.
func (s *Server) Batch(ctx context.Context, req *idempotencyv1.BatchRequest) (*idempotencyv1.BatchResponse, error) {
	start := time.Now()
	noteCall(ctx, tenantFrom(ctx), "", "")
	if err := checkBatch(req); err != nil {
		return nil, s.status(ctx, err)
	}
	results := make([]*idempotencyv1.BatchResult, len(req.GetCalls()))
	var wg sync.WaitGroup
	var left atomic.Int64
	left.Store(maxBatchAnswerBytes)
	for i, call := range req.GetCalls() {
		wg.Add(1)
		s.callWorkers.run(func() {
			defer wg.Done()
			results[i] = fitAnswer(&left, s.batchCall(ctx, start, i, call))
		})
	}
	wg.Wait()
	return &idempotencyv1.BatchResponse{Results: results}, nil
}

// callWorkerCount is the number of long-lived goroutines that run the
// calls of Batch RPCs.
const callWorkerCount = 256

// callWorkers runs the calls of Batch RPCs on long-lived goroutines whose
// stacks have already grown, as gRPC's stream workers serve unary calls
// (see New): a fresh goroutine per call grows its stack again, which took
// about 12% of the coordinator's CPU under batched load (runtime.copystack
// and the stack maps it reads). When every worker is busy a call gets a
// goroutine of its own. The workers start with the first Batch and end at
// Shutdown.
type callWorkers struct {
	once, stopped sync.Once
	work          chan func()
	stop          chan struct{}
}

// shutdown ends the idle workers, and each busy one after its call.
func (w *callWorkers) shutdown() { w.stopped.Do(func() { close(w.stop) }) }

func newCallWorkers() *callWorkers {
	return &callWorkers{work: make(chan func()), stop: make(chan struct{})}
}

// run runs f on an idle worker, or on a goroutine of its own.
func (w *callWorkers) run(f func()) {
	w.once.Do(func() {
		for range callWorkerCount {
			go w.loop()
		}
	})
	select {
	case w.work <- f:
	default:
		go f()
	}
}

func (w *callWorkers) loop() {
	for {
		select {
		case f := <-w.work:
			f()
		case <-w.stop:
			return
		}
	}
}

// fitAnswer takes res's size from the answer's budget left; when the
// budget does not hold it and res changed nothing, it returns
// RESOURCE_EXHAUSTED in its place (see maxBatchAnswerBytes).
func fitAnswer(left *atomic.Int64, res *idempotencyv1.BatchResult) *idempotencyv1.BatchResult {
	n := int64(proto.Size(res))
	if left.Add(-n) >= 0 || !changedNothing(res) {
		return res
	}
	left.Add(n)
	return &idempotencyv1.BatchResult{Result: &idempotencyv1.BatchResult_Error{Error: status.New(codes.ResourceExhausted,
		fmt.Sprintf("the answer to this call (%d bytes) did not fit in the Batch's answer (%d bytes of answers that change nothing): "+
			"nothing was changed by it; make it alone", n, maxBatchAnswerBytes)).Proto()}}
}

// changedNothing reports whether res answers a call that wrote nothing: a
// Lookup, or a Begin that replayed or found the key held (an error's
// answer is small).
func changedNothing(res *idempotencyv1.BatchResult) bool {
	switch {
	case res.GetLookup() != nil:
		return true
	case res.GetBegin() != nil:
		return res.GetBegin().GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED
	}
	return false
}

// checkBatch refuses a BatchRequest that cannot be split into calls.
func checkBatch(req *idempotencyv1.BatchRequest) error {
	var v violations
	if !checkWireFaults(&v, req) {
		return v.err()
	}
	switch n := len(req.GetCalls()); {
	case n == 0:
		v.addf("calls", "must have at least 1 call")
	case n > maxBatchCalls:
		v.addf("calls", "must have at most %d calls, got %d", maxBatchCalls, n)
	}
	for i, call := range req.GetCalls() {
		if call.GetCall() == nil {
			v.addf(fmt.Sprintf("calls[%d]", i), "must set one of begin, complete, fail, lookup, heartbeat")
		}
	}
	return v.err()
}

// batchCall runs calls[i] of a Batch that started at start, through the
// item chain (call log, recovery, rate limit) as its unary method, and
// returns its result.
func (s *Server) batchCall(ctx context.Context, start time.Time, i int, call *idempotencyv1.BatchCall) *idempotencyv1.BatchResult {
	method, req := batchCallRequest(call)
	ctx = logging.InjectLogField(ctx, "batch.call", i)
	info := &grpc.UnaryServerInfo{Server: s, FullMethod: method}
	resp, err := s.batchItem(ctx, req, info, func(ctx context.Context, _ any) (any, error) {
		return s.runBatchCall(ctx, start, i, call, req)
	})
	return batchResult(resp, err)
}

// runBatchCall checks what a batch adds to calls[i] (its timeout, no wait)
// and runs it, whose request is req, through its unary method.
func (s *Server) runBatchCall(ctx context.Context, start time.Time, i int, call *idempotencyv1.BatchCall, req proto.Message) (any, error) {
	scope := ""
	if r, ok := req.(interface{ GetScope() string }); ok {
		scope = r.GetScope()
	}
	noteCall(ctx, tenantFrom(ctx), scope, "")
	if err := checkBatchCall(i, call); err != nil {
		return nil, s.status(ctx, err)
	}
	if t := call.GetTimeout(); t != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, start.Add(t.AsDuration()))
		defer cancel()
	}
	switch c := call.GetCall().(type) {
	case *idempotencyv1.BatchCall_Begin:
		return s.Begin(ctx, c.Begin)
	case *idempotencyv1.BatchCall_Complete:
		return s.Complete(ctx, c.Complete)
	case *idempotencyv1.BatchCall_Fail:
		return s.Fail(ctx, c.Fail)
	case *idempotencyv1.BatchCall_Lookup:
		return s.Lookup(ctx, c.Lookup)
	case *idempotencyv1.BatchCall_Heartbeat:
		return s.Heartbeat(ctx, c.Heartbeat)
	}
	return nil, status.Error(codes.InvalidArgument, "call without a request") // checkBatch refused it
}

// checkBatchCall checks the fields a batch adds to calls[i]: a valid
// timeout of more than 0, and no wait on a Begin (a batched call never
// waits on another key's holder). The request itself is its unary
// method's to check.
func checkBatchCall(i int, call *idempotencyv1.BatchCall) error {
	var v violations
	field := fmt.Sprintf("calls[%d]", i)
	checkDuration(&v, field+".timeout", call.GetTimeout(), 0, math.MaxInt64, true)
	if w := call.GetBegin().GetWait(); w != nil && w.CheckValid() == nil && w.AsDuration() > 0 {
		v.addf(field+".begin.wait", "must be absent or 0 in a batch, got %v", w.AsDuration())
	}
	return v.err()
}

// batchCallRequest returns the full method name and request of call.
func batchCallRequest(call *idempotencyv1.BatchCall) (string, proto.Message) {
	switch c := call.GetCall().(type) {
	case *idempotencyv1.BatchCall_Begin:
		return idempotencyv1.Coordinator_Begin_FullMethodName, c.Begin
	case *idempotencyv1.BatchCall_Complete:
		return idempotencyv1.Coordinator_Complete_FullMethodName, c.Complete
	case *idempotencyv1.BatchCall_Fail:
		return idempotencyv1.Coordinator_Fail_FullMethodName, c.Fail
	case *idempotencyv1.BatchCall_Lookup:
		return idempotencyv1.Coordinator_Lookup_FullMethodName, c.Lookup
	case *idempotencyv1.BatchCall_Heartbeat:
		return idempotencyv1.Coordinator_Heartbeat_FullMethodName, c.Heartbeat
	}
	return idempotencyv1.Coordinator_Batch_FullMethodName, call
}

// batchResult is the BatchResult of a call that answered resp or failed
// with err.
func batchResult(resp any, err error) *idempotencyv1.BatchResult {
	if err == nil {
		switch r := resp.(type) {
		case *idempotencyv1.BeginResponse:
			return &idempotencyv1.BatchResult{Result: &idempotencyv1.BatchResult_Begin{Begin: r}}
		case *idempotencyv1.CompleteResponse:
			return &idempotencyv1.BatchResult{Result: &idempotencyv1.BatchResult_Complete{Complete: r}}
		case *idempotencyv1.FailResponse:
			return &idempotencyv1.BatchResult{Result: &idempotencyv1.BatchResult_Fail{Fail: r}}
		case *idempotencyv1.LookupResponse:
			return &idempotencyv1.BatchResult{Result: &idempotencyv1.BatchResult_Lookup{Lookup: r}}
		case *idempotencyv1.HeartbeatResponse:
			return &idempotencyv1.BatchResult{Result: &idempotencyv1.BatchResult_Heartbeat{Heartbeat: r}}
		}
		err = status.Errorf(codes.Internal, "internal error")
	}
	return &idempotencyv1.BatchResult{Result: &idempotencyv1.BatchResult_Error{Error: status.Convert(err).Proto()}}
}
