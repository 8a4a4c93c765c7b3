package clients_test

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

// rpcCounter is a coordinator interceptor that counts the RPCs by method
// and the calls carried by Batch RPCs; hold, when set, runs before a Batch
// is handled.
type rpcCounter struct {
	mu         sync.Mutex
	rpcs       map[string]int
	batchCalls int
	maxCalls   int
	refuse     bool          // answer Batch UNIMPLEMENTED, as an older coordinator does
	delay      time.Duration // hold every Batch's answer this long, the work committed
}

func (r *rpcCounter) option() server.Option { return server.WithUnaryInterceptors(r.intercept) }

func (r *rpcCounter) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	r.mu.Lock()
	if r.rpcs == nil {
		r.rpcs = map[string]int{}
	}
	r.rpcs[info.FullMethod]++
	b, isBatch := req.(*idempotencyv1.BatchRequest)
	if isBatch {
		r.batchCalls += len(b.GetCalls())
		r.maxCalls = max(r.maxCalls, len(b.GetCalls()))
	}
	refuse, delay := r.refuse, r.delay
	r.mu.Unlock()
	if !isBatch {
		return handler(ctx, req)
	}
	if refuse {
		return nil, status.Error(codes.Unimplemented, "unknown method Batch")
	}
	resp, err := handler(context.WithoutCancel(ctx), req)
	time.Sleep(delay)
	return resp, err
}

func (r *rpcCounter) count(method string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.rpcs["/idempotency.v1.Coordinator/"+method]
}

// batchingClient starts a coordinator with counter and a Client of it
// with WithCallBatching(2); plain is a Client of the same coordinator
// without batching.
func batchingClient(t *testing.T, counter *rpcCounter) (batched, plain *clients.Client) {
	t.Helper()
	coord := coordtest.Start(t, coordtest.Options{ServerOptions: []server.Option{counter.option()}})
	batched = clients.New(coord.Dial(t), clients.WithCallBatching(2))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := batched.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return batched, clients.New(coord.Dial(t))
}

// TestCallBatchingSharesRPCs: 64 concurrent callers each make a pair
// (Begin, Complete) and then a replay; their calls travel in far fewer
// Batch RPCs than calls, no call goes unary, and every answer is what a
// unary call gives.
func TestCallBatchingSharesRPCs(t *testing.T) {
	counter := &rpcCounter{delay: 2 * time.Millisecond}
	c, plain := batchingClient(t, counter)
	const callers = 64
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for i := range callers {
		wg.Go(func() {
			errs <- pairAndReplay(c, fmt.Sprintf("k%d", i))
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	rpcs, calls := counter.count("Batch"), counter.batchCalls
	if calls != 3*callers {
		t.Fatalf("Batch RPCs carried %d calls, want %d", calls, 3*callers)
	}
	if rpcs >= calls/2 || counter.maxCalls < 2 {
		t.Errorf("%d calls took %d Batch RPCs (at most %d calls in one): they were not shared", calls, rpcs, counter.maxCalls)
	}
	for _, m := range []string{"Begin", "Complete"} {
		if n := counter.count(m); n != 0 {
			t.Errorf("%d unary %s RPCs, want 0", n, m)
		}
	}
	t.Logf("%d calls in %d Batch RPCs, at most %d in one", calls, rpcs, counter.maxCalls)

	// What the batched client answered is what a unary client reads.
	rec, err := plain.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "pay", Key: "k7"})
	if err != nil || rec.GetRecord().GetState() != idempotencyv1.State_STATE_COMPLETED ||
		!bytes.Equal(rec.GetRecord().GetResponse().GetBody(), []byte("body-k7")) {
		t.Fatalf("unary Lookup of k7 = %v, %v; want COMPLETED with body-k7", rec, err)
	}
}

// pairAndReplay begins key, completes it, and begins it again, checking
// each answer.
func pairAndReplay(c *clients.Client, key string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	b, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
	if err != nil || b.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		return fmt.Errorf("Begin %s = %v, %v; want ACQUIRED", key, b, err)
	}
	body := []byte("body-" + key)
	if _, err := c.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "pay", Key: key, LeaseToken: b.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: body}}); err != nil {
		return fmt.Errorf("Complete %s: %v", key, err)
	}
	r, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
	if err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || !bytes.Equal(r.GetRecord().GetResponse().GetBody(), body) {
		return fmt.Errorf("second Begin %s = %v, %v; want REPLAY of %q", key, r, err, body)
	}
	return nil
}

// TestCallBatchingErrorsAsUnary: a batched call that fails fails with
// the code, message and details its unary call gets, and alone.
func TestCallBatchingErrorsAsUnary(t *testing.T) {
	c, plain := batchingClient(t, &rpcCounter{})
	b, err := plain.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: "held"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		call func(c *clients.Client) error
	}{
		{"stale token", func(c *clients.Client) error {
			_, err := c.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "pay", Key: "held", LeaseToken: "lt1.not-it"})
			return err
		}},
		{"invalid request", func(c *clients.Client) error {
			_, err := c.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: ""})
			return err
		}},
		{"no record", func(c *clients.Client) error {
			_, err := c.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "pay", Key: "absent"})
			return err
		}},
		{"heartbeat of an ended attempt", func(c *clients.Client) error {
			_, err := c.Heartbeat(ctx(t), &idempotencyv1.HeartbeatRequest{Scope: "pay", Key: "held", LeaseToken: "lt1.not-it"})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want, got := status.Convert(tc.call(plain)), status.Convert(tc.call(c))
			if want.Code() == codes.OK {
				t.Fatalf("the unary call did not fail")
			}
			if !proto.Equal(got.Proto(), want.Proto()) {
				t.Fatalf("batched call failed with %v, unary with %v", got.Proto(), want.Proto())
			}
		})
	}
	// The holder's own Complete, batched, still succeeds.
	if _, err := c.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "pay", Key: "held", LeaseToken: b.GetLeaseToken()}); err != nil {
		t.Fatal(err)
	}
}

// TestCallBatchingGoesUnaryWhereItMust: a large Complete, a waiting Begin
// and a call with its own metadata go as unary RPCs; a lone call goes at
// once, alone in its Batch.
func TestCallBatchingGoesUnaryWhereItMust(t *testing.T) {
	counter := &rpcCounter{}
	c, _ := batchingClient(t, counter)
	b, err := c.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: "big"})
	if err != nil {
		t.Fatal(err)
	}
	if counter.count("Batch") != 1 || counter.maxCalls != 1 {
		t.Fatalf("a lone Begin took %d Batch RPCs of at most %d calls, want 1 of 1", counter.count("Batch"), counter.maxCalls)
	}
	if _, err := c.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "pay", Key: "big", LeaseToken: b.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: bytes.Repeat([]byte("x"), 100<<10)}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: "w", Wait: durationpb.New(time.Second)}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "pay", Key: "big"}, grpc.WaitForReady(true)); err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"Complete", "Begin", "Lookup"} {
		if n := counter.count(m); n != 1 {
			t.Errorf("%d unary %s RPCs, want 1", n, m)
		}
	}
}

// TestCallBatchingFallsBackToUnary: against a coordinator without Batch
// every call still gets its answer, and after the first refusal no call
// tries Batch again.
func TestCallBatchingFallsBackToUnary(t *testing.T) {
	counter := &rpcCounter{refuse: true}
	c, _ := batchingClient(t, counter)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			if err := pairAndReplay(c, fmt.Sprintf("f%d", i)); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	batches := counter.count("Batch")
	if err := pairAndReplay(c, "after"); err != nil {
		t.Fatal(err)
	}
	if n := counter.count("Batch"); n != batches || n > 2 {
		t.Fatalf("Batch tried %d times (%d before the last pair), want at most 2 (one per RPC slot), none after", n, batches)
	}
	if counter.count("Begin") != 18 || counter.count("Complete") != 9 {
		t.Fatalf("unary Begin %d, Complete %d; want 18 and 9", counter.count("Begin"), counter.count("Complete"))
	}
}

// TestCallBatchingGiveUpLeavesKeyFree: a Begin whose caller cancels (no
// deadline, so the coordinator cannot know) while its Batch is in flight
// returns CANCELED once the answer is in, and by then the acquisition its
// Batch made is released: the key is as if that Begin never was. The same
// through Once.
func TestCallBatchingGiveUpLeavesKeyFree(t *testing.T) {
	counter := &rpcCounter{delay: 300 * time.Millisecond}
	c, plain := batchingClient(t, counter)
	for _, tc := range []struct {
		name  string
		begin func(ctx context.Context, key string) error
	}{
		{"Begin", func(ctx context.Context, key string) error {
			_, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
			return err
		}},
		{"Once", func(ctx context.Context, key string) error {
			_, err := c.Once(ctx, "pay", key, nil, func(context.Context) (*idempotencyv1.StoredResponse, error) {
				t.Errorf("Once ran its function for a caller that had left")
				return nil, nil
			})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "gone-" + tc.name
			cctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(50*time.Millisecond, cancel)
			if err := tc.begin(cctx, key); status.Code(err) != codes.Canceled {
				t.Fatalf("%s = %v, want CANCELED", tc.name, err)
			}
			if _, err := plain.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "pay", Key: key}); status.Code(err) != codes.NotFound {
				t.Fatalf("after the cancelled %s returned, Lookup = %v; want NOT_FOUND (released)", tc.name, err)
			}
			b, err := plain.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
			if err != nil || b.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || b.GetRecord().GetAttempt() != 1 {
				t.Fatalf("Begin after the release = %v, %v; want ACQUIRED, attempt 1", b, err)
			}
		})
	}
}

// TestCallBatchingOnceRunsOnce: Once through a batching Client, 16
// concurrent duplicates of one key: the function runs once and every
// caller gets its result.
func TestCallBatchingOnceRunsOnce(t *testing.T) {
	c, _ := batchingClient(t, &rpcCounter{})
	var runs atomic.Int32
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			out, err := c.Once(ctx, "pay", "dup", nil, func(context.Context) (*idempotencyv1.StoredResponse, error) {
				runs.Add(1)
				time.Sleep(20 * time.Millisecond)
				return &idempotencyv1.StoredResponse{Body: []byte("done")}, nil
			})
			if err != nil || string(out.Response.GetBody()) != "done" {
				t.Errorf("Once = %v, %v", out, err)
			}
		})
	}
	wg.Wait()
	if n := runs.Load(); n != 1 {
		t.Fatalf("the function ran %d times, want 1", n)
	}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

// TestCallBatchingLargeReplays: concurrent replays of 1 MB responses,
// whose answers together do not fit in one Batch's answer, each get the
// whole stored response: the calls the coordinator refuses to answer in
// the batch are repeated alone.
func TestCallBatchingLargeReplays(t *testing.T) {
	counter := &rpcCounter{delay: 100 * time.Millisecond}
	c, plain := batchingClient(t, counter)
	body := bytes.Repeat([]byte("x"), 1_000_000)
	for i := range 8 {
		key := fmt.Sprintf("big%d", i)
		b, err := plain.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := plain.Complete(ctx(t), &idempotencyv1.CompleteRequest{Scope: "pay", Key: key, LeaseToken: b.GetLeaseToken(),
			Response: &idempotencyv1.StoredResponse{Body: body}}); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for i := range 24 {
		wg.Go(func() {
			key := fmt.Sprintf("big%d", i%8)
			r, err := c.Begin(ctx(t), &idempotencyv1.BeginRequest{Scope: "pay", Key: key})
			if err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || !bytes.Equal(r.GetRecord().GetResponse().GetBody(), body) {
				t.Errorf("Begin %s = outcome %v, %d bytes, %v; want REPLAY of the 1 MB response", key, r.GetOutcome(), len(r.GetRecord().GetResponse().GetBody()), err)
			}
		})
	}
	wg.Wait()
	if counter.maxCalls < 4 || counter.count("Begin") == 0 {
		t.Fatalf("at most %d calls in one Batch, %d unary Begins: the replays were not batched past the answer's limit", counter.maxCalls, counter.count("Begin"))
	}
}

// TestCallBatchingGathersTheCallersOfOneAnswer: callers that move in
// lockstep (each calls again as soon as its answer is in) share the RPCs
// of a step. When a Batch's answer wakes its callers, their next calls go
// together, not the first of them alone in an RPC of its own with the rest
// behind it: such lone RPCs made the coordinator write rounds of one or
// two calls between the large ones, which every call then waited for.
// Before, 8 callers took about 3.5 RPCs a step (137 to 141 for 40 steps);
// now about two or fewer (58 to 89: two groups of callers sharing the two
// RPC slots), and the test allows three.
func TestCallBatchingGathersTheCallersOfOneAnswer(t *testing.T) {
	counter := &rpcCounter{delay: 2 * time.Millisecond}
	c, _ := batchingClient(t, counter)
	const callers, steps = 8, 40
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for i := range callers {
		wg.Go(func() {
			for s := range steps {
				if _, err := c.Lookup(ctx(t), &idempotencyv1.LookupRequest{Scope: "pay", Key: fmt.Sprintf("k%d-%d", i, s)}); status.Code(err) != codes.NotFound {
					errs <- fmt.Errorf("Lookup: %v, want NOT_FOUND", err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	rpcs := counter.count("Batch")
	t.Logf("%d lockstep callers' %d calls in %d Batch RPCs, at most %d in one", callers, callers*steps, rpcs, counter.maxCalls)
	if rpcs > 3*steps {
		t.Errorf("%d callers' %d steps took %d Batch RPCs, want at most %d: the calls woken by one answer did not go together",
			callers, steps, rpcs, 3*steps)
	}
}
