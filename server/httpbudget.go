package server

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"time"
)

// DefaultHTTPOtherMaxBodyBytes is the default cap on the body of a request
// to the HTTP listener that is not a call of an API method (/metrics,
// /healthz, /readyz, an unknown path, a page or form mounted next to the
// API): a sign-in form's token and a few fields.
const DefaultHTTPOtherMaxBodyBytes = 16 << 10

// httpOtherBufferedBodies is how many bodies at the other-paths cap the
// budget of buffered bodies of requests that are not API calls holds;
// that budget is at least httpOtherMinBuffered.
const (
	httpOtherBufferedBodies = 8
	httpOtherMinBuffered    = 1 << 20
)

// httpClientShares is how many clients' default shares a budget of
// buffered body bytes holds: a client holds at most a share, so that
// fewer clients than this cannot spend the whole budget.
const httpClientShares = 8

// errBodyBudget is readBody's error when the listener's budget of buffered
// body bytes cannot take the request's next bytes.
var errBodyBudget = errors.New("the budget of buffered request bodies is spent")

// errClientShare is readBody's error when the request's client holds its
// whole share of the budget of buffered body bytes.
var errClientShare = errors.New("the client's share of the budget of buffered request bodies is spent")

// bodyBudget is a budget of request body bytes buffered at once, all
// clients together, of which one client (clientOf) holds at most its
// share.
type bodyBudget struct {
	total, share int64

	mu    sync.Mutex
	used  int64
	held  map[string]int64 // by client, only clients holding bytes
	freed chan struct{}    // closed by the next give, while a takeWithin waits
}

// newBodyBudget returns a budget of total bytes of which one client holds
// at most share (share 0: a share of total/httpClientShares, but at least
// one body's largest cost, maxCost).
func newBodyBudget(total, share, maxCost int64) *bodyBudget {
	if share <= 0 {
		share = max(total/httpClientShares, maxCost)
	}
	return &bodyBudget{total: total, share: min(share, total), held: map[string]int64{}}
}

// bodyCost is the most a body within maxBody bytes can charge to a
// budget: the body (readBody reads at most one byte past the cap) and a
// gzip reader's state.
func bodyCost(maxBody int64) int64 { return maxBody + 1 + gzipStateBytes }

// take charges n bytes to client, without waiting: errBodyBudget when
// they do not fit in the budget, else errClientShare when they do not fit
// in client's share.
func (b *bodyBudget) take(client string, n int64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.takeLocked(client, n)
}

// takeWithin charges n bytes to client as take does, waiting until they
// fit, ctx ends or wait passes (then it fails with take's error).
func (b *bodyBudget) takeWithin(ctx context.Context, client string, n int64, wait time.Duration) error {
	var timeout <-chan time.Time
	for {
		b.mu.Lock()
		err := b.takeLocked(client, n)
		if err != nil && b.freed == nil {
			b.freed = make(chan struct{})
		}
		freed := b.freed
		b.mu.Unlock()
		if err == nil {
			return nil
		}
		if timeout == nil {
			t := time.NewTimer(wait)
			defer t.Stop() //nolint:gocritic // once: timeout is nil only the first time round
			timeout = t.C
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return err
		case <-timeout:
			return err
		}
	}
}

// takeLocked is take, with b.mu held.
func (b *bodyBudget) takeLocked(client string, n int64) error {
	switch {
	case b.used+n > b.total:
		return errBodyBudget
	case b.held[client]+n > b.share:
		return errClientShare
	}
	b.used += n
	b.held[client] += n
	return nil
}

// give gives back n bytes that take charged to client.
func (b *bodyBudget) give(client string, n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.used -= n
	if b.held[client] -= n; b.held[client] <= 0 {
		delete(b.held, client)
	}
	if b.freed != nil {
		close(b.freed)
		b.freed = nil
	}
}

// clientOf names the client of a request from its remote address (the
// TCP peer, never a header a client could write): its IPv4 address, or
// the /64 network of its IPv6 address, which one host commonly holds
// whole. Behind a proxy, every request through it is one client.
func clientOf(remoteAddr string) string {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		host = remoteAddr
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	addr = addr.Unmap().WithZone("")
	if addr.Is6() {
		p, _ := addr.Prefix(64)
		return p.String()
	}
	return addr.String()
}

// httpOtherMaxBuffered is the budget of buffered body bytes of requests
// that are not API calls.
func (s *Server) httpOtherMaxBuffered() int64 {
	return max(httpOtherBufferedBodies*s.opts.httpOtherMaxBody, httpOtherMinBuffered)
}

// HTTPMaxBufferedBytes is the most request body bytes the HTTP listener
// holds at once, API calls and other requests together: what the listener
// can hold live, besides its connections, however it is called.
func (s *Server) HTTPMaxBufferedBytes() int64 {
	return s.opts.httpMaxBuffered + s.httpOtherMaxBuffered()
}
