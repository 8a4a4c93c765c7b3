package chaos

import (
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
)

// Proxy forwards TCP connections from a loopback port to a target address
// and cuts them when told to: all at once (CutAll), or at random while data
// flows (SetCutChance), so that a cut lands in the middle of a
// transaction: before a statement reaches the server, or after the server
// has executed it but before the answer is back. A cut resets both sides
// (SO_LINGER 0), as a failing network or a crashed middlebox would.
//
// Its methods are safe for concurrent use.
type Proxy struct {
	target string
	ln     net.Listener

	mu     sync.Mutex
	links  map[*link]struct{}
	rng    *rand.Rand
	chance float64 // probability that a forwarded chunk triggers a cut
	closed bool

	cuts     atomic.Int64
	accepted atomic.Int64
	wg       sync.WaitGroup
}

// link is one proxied connection: the client side and the target side.
type link struct {
	client, server net.Conn
	once           sync.Once
}

// NewProxy listens on a free port of 127.0.0.1 and forwards every
// connection to target. seed makes the random cuts repeatable for a given
// order of traffic.
func NewProxy(target string, seed uint64) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{target: target, ln: ln, links: map[*link]struct{}{},
		rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the host:port clients connect to instead of the target.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetCutChance sets the probability (0 to 1) that a chunk of data read from
// either side cuts its connection; the chunk is forwarded first or not, at
// random. 0 stops random cuts.
func (p *Proxy) SetCutChance(chance float64) {
	p.mu.Lock()
	p.chance = chance
	p.mu.Unlock()
}

// CutAll resets every open connection and returns how many it cut.
func (p *Proxy) CutAll() int {
	p.mu.Lock()
	ls := make([]*link, 0, len(p.links))
	for l := range p.links {
		ls = append(ls, l)
	}
	p.mu.Unlock()
	n := 0
	for _, l := range ls {
		if p.cut(l) {
			n++
		}
	}
	return n
}

// Cuts is the number of connections cut so far, at random or by CutAll.
func (p *Proxy) Cuts() int64 { return p.cuts.Load() }

// Links is the number of connections open through the proxy now.
func (p *Proxy) Links() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.links)
}

// Accepted is the number of connections accepted so far.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// Close stops accepting, resets every open connection and waits for the
// forwarding goroutines to end.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	err := p.ln.Close()
	p.CutAll()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		p.wg.Add(1)
		go p.serve(c)
	}
}

// serve dials the target for client c and copies both ways until either
// side ends or the link is cut.
func (p *Proxy) serve(c net.Conn) {
	defer p.wg.Done()
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		reset(c)
		return
	}
	l := &link{client: c, server: s}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		reset(c)
		reset(s)
		return
	}
	p.links[l] = struct{}{}
	p.mu.Unlock()

	done := make(chan struct{}, 2)
	go func() { p.pipe(l, s, c); done <- struct{}{} }()
	go func() { p.pipe(l, c, s); done <- struct{}{} }()
	<-done
	// One direction ended: end the other too (a plain close, not a cut).
	l.once.Do(func() {
		_ = c.Close()
		_ = s.Close()
	})
	<-done
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
}

// pipe copies from src to dst, deciding at every chunk whether to cut.
func (p *Proxy) pipe(l *link, dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			cut, forwardFirst := p.roll()
			if cut && !forwardFirst {
				p.cut(l)
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
			if cut {
				p.cut(l)
				return
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				return
			}
			// Half-close: pass the EOF on so the other side sees it.
			if tc, ok := dst.(*net.TCPConn); ok {
				_ = tc.CloseWrite()
			}
			return
		}
	}
}

// roll decides whether the current chunk cuts its link and, if so,
// whether the chunk is forwarded before the cut.
func (p *Proxy) roll() (cut, forwardFirst bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.chance <= 0 || p.rng.Float64() >= p.chance {
		return false, false
	}
	return true, p.rng.IntN(2) == 0
}

// cut resets both sides of l, once; it reports whether this call did it.
func (p *Proxy) cut(l *link) bool {
	did := false
	l.once.Do(func() {
		did = true
		p.cuts.Add(1)
		reset(l.client)
		reset(l.server)
	})
	return did
}

// reset closes c so that the peer sees a connection reset, not an orderly
// end.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}
