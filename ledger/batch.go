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
type coalescer[T any] struct {
	queue chan T
	max   int
	run   func(context.Context, []T)
	stop  chan struct{}
	wg    sync.WaitGroup
}

func newCoalescer[T any](workers, max int, run func(context.Context, []T)) *coalescer[T] {
	c := &coalescer[T]{queue: make(chan T, workers*max), max: max, run: run, stop: make(chan struct{})}
	for range workers {
		c.wg.Add(1)
		go c.work()
	}
	return c
}

// submit queues r, or returns false when the coalescer stopped or ctx ended
// first.
func (c *coalescer[T]) submit(ctx context.Context, r T) bool {
	select {
	case c.queue <- r:
		return true
	case <-c.stop:
		return false
	case <-ctx.Done():
		return false
	}
}

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
		ctx, cancel := context.WithTimeout(context.Background(), batchTimeout)
		c.run(ctx, batch)
		cancel()
	}
}

// close stops the workers after their current batch. Requests still queued
// are not run; their callers see their own context end or close's error.
func (c *coalescer[T]) close() {
	close(c.stop)
	c.wg.Wait()
}
