package ledger

import (
	"context"
	"sync"
)

// batchTimeout bounds one batch statement. The statements commit by
// themselves and run apart from their callers' contexts, so a caller that
// gives up never cancels a commit; the bound is commitTimeout's, for the
// same reason.
const batchTimeout = commitTimeout

// coalescer gathers concurrent requests of one kind into batches run by a
// few workers: a worker takes the first waiting request and every other one
// already queued (up to max), runs them together, and goes back for more.
// Nothing waits for a batch to fill, so a lone request runs at once, and
// under load the batches grow by themselves.
//
// Every request submitted is answered: by run, or by reject once the
// coalescer is closed.
type coalescer[T any] struct {
	queue  chan T
	max    int
	run    func(context.Context, []T)
	reject func(T)

	// mu orders submit against close: a request is either queued before
	// closed is set (and then run or rejected) or refused by submit.
	mu     sync.RWMutex
	closed bool
	stop   chan struct{}
	// base is the parent of every batch's context; close cancels it, so a
	// batch in flight ends at once.
	base   context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// newCoalescer starts workers that run batches of at most max requests.
// reject answers a request that the coalescer will not run (it was queued
// when close was called).
func newCoalescer[T any](workers, max int, run func(context.Context, []T), reject func(T)) *coalescer[T] {
	base, cancel := context.WithCancel(context.Background())
	c := &coalescer[T]{queue: make(chan T, workers*max), max: max, run: run, reject: reject,
		stop: make(chan struct{}), base: base, cancel: cancel}
	for range workers {
		c.wg.Add(1)
		go c.work()
	}
	return c
}

// submit queues r, or returns false when the coalescer is closed or ctx
// ended first.
func (c *coalescer[T]) submit(ctx context.Context, r T) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return false
	}
	select {
	case c.queue <- r:
		return true
	case <-ctx.Done():
		return false
	}
}

// closing reports whether close has been called; a batch that fails then
// answers its callers ErrUnavailable instead of retrying them.
func (c *coalescer[T]) closing() bool { return c.base.Err() != nil }

func (c *coalescer[T]) work() {
	defer c.wg.Done()
	batch := make([]T, 0, c.max)
	for {
		select {
		case <-c.stop:
			return
		case r := <-c.queue:
			batch = append(batch[:0], r)
		}
	drain:
		for len(batch) < c.max {
			select {
			case r := <-c.queue:
				batch = append(batch, r)
			default:
				break drain
			}
		}
		if c.closing() {
			// Closed while these were queued: close answers the rest.
			for _, r := range batch {
				c.reject(r)
			}
			return
		}
		ctx, cancel := context.WithTimeout(c.base, batchTimeout)
		c.run(ctx, batch)
		cancel()
	}
}

// close stops the workers: a batch in flight has its statement cancelled
// and answers its callers (ErrUnavailable unless it had finished), and
// every request still queued is answered by reject. Later submits fail.
func (c *coalescer[T]) close() {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.cancel()
	close(c.stop)
	c.wg.Wait()
	for {
		select {
		case r := <-c.queue:
			c.reject(r)
		default:
			return
		}
	}
}
