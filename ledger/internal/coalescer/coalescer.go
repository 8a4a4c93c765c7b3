package coalescer

import (
	"context"
	"sync"
	"time"
)

// Coalescer gathers concurrent requests of one kind into batches run by a
// few workers: a worker takes the first waiting request and every other one
// already queued (up to max), runs them together, and goes back for more.
// Nothing waits for a batch to fill, so a lone request runs at once, and
// under load the batches grow by themselves.
//
// Every request submitted is answered: by run, or by reject once the
// coalescer is closed.
type Coalescer[T any] struct {
	queue   chan T
	max     int
	timeout time.Duration
	run     func(context.Context, []T)
	reject  func(T)

	// mu orders Submit against Close: a request is either queued before
	// closed is set (and then run or rejected) or refused by Submit.
	mu     sync.RWMutex
	closed bool
	stop   chan struct{}
	// base is the parent of every batch's context; Close cancels it, so a
	// batch in flight ends at once.
	base   context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// New starts workers that run batches of at most maxBatch requests, each under
// a context that ends after timeout or at Close, whichever comes first.
// reject answers a request that the coalescer will not run (it was queued
// when Close was called).
func New[T any](workers, maxBatch int, timeout time.Duration, run func(context.Context, []T), reject func(T)) *Coalescer[T] {
	base, cancel := context.WithCancel(context.Background()) //nolint:gosec // cancel is kept in the Coalescer and called by Close
	c := &Coalescer[T]{queue: make(chan T, workers*maxBatch), max: maxBatch, timeout: timeout, run: run, reject: reject,
		stop: make(chan struct{}), base: base, cancel: cancel}
	for range workers {
		c.wg.Add(1)
		go c.work()
	}
	return c
}

// Submit queues r, or returns false when the coalescer is closed or ctx
// ended first.
func (c *Coalescer[T]) Submit(ctx context.Context, r T) bool {
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

// Closing reports whether Close has been called; a batch that fails then
// answers its callers as closed instead of retrying them.
func (c *Coalescer[T]) Closing() bool { return c.base.Err() != nil }

func (c *Coalescer[T]) work() {
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
		if c.Closing() {
			// Closed while these were queued: Close answers the rest.
			for _, r := range batch {
				c.reject(r)
			}
			return
		}
		ctx, cancel := context.WithTimeout(c.base, c.timeout)
		c.run(ctx, batch)
		cancel()
	}
}

// Close stops the workers: a batch in flight has its context cancelled
// and answers its callers, and every request still queued is answered by
// reject. Later submits fail.
func (c *Coalescer[T]) Close() {
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
