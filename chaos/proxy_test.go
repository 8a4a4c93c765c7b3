package chaos

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"
)

// TestProxyForwardsAndCuts checks the proxy itself: it forwards both ways,
// CutAll resets open connections, and a cut chance of 1 cuts a connection
// at its first chunk.
func TestProxyForwardsAndCuts(t *testing.T) {
	t.Parallel()
	echo := startEcho(t)
	p, err := NewProxy(echo.Addr().String(), 1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	roundTrip := func(c net.Conn) error {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping\n")); err != nil {
			return err
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		if err == nil && line != "ping\n" {
			t.Fatalf("echo through the proxy = %q", line)
		}
		return err
	}
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := roundTrip(c); err != nil {
		t.Fatalf("through the proxy: %v", err)
	}
	if n := p.CutAll(); n != 1 {
		t.Fatalf("CutAll cut %d connections, want 1", n)
	}
	if err := roundTrip(c); err == nil {
		t.Fatal("a cut connection still carried data")
	}

	p.SetCutChance(1)
	c2, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if err := roundTrip(c2); err == nil {
		t.Fatal("cut chance 1 let a round trip through")
	}
	if got := p.Cuts(); got != 2 {
		t.Fatalf("Cuts() = %d, want 2", got)
	}
}

// TestDoubleLeasesFound checks the double-lease check on made-up holds.
func TestDoubleLeasesFound(t *testing.T) {
	t.Parallel()
	at := func(ms int) time.Time { return time.Date(2026, 1, 1, 0, 0, 0, ms*int(time.Millisecond), time.UTC) }
	a := &hold{key: "k", token: "A", acquiredAt: at(0), provenAt: at(10)}
	overlapping := &hold{key: "k", token: "B", acquiredAt: at(5), provenAt: at(15)}
	after := &hold{key: "k", token: "C", acquiredAt: at(11), provenAt: at(20)}
	otherKey := &hold{key: "j", token: "D", acquiredAt: at(5), provenAt: at(15)}
	unproven := &hold{key: "k", token: "E", acquiredAt: at(6)}
	if got := doubleLeases([]*hold{a, after, otherKey, unproven}); len(got) != 0 {
		t.Fatalf("violations in a clean history: %v", got)
	}
	if got := doubleLeases([]*hold{a, overlapping}); len(got) != 1 {
		t.Fatalf("found %d violations in two overlapping tokens, want 1", len(got))
	}
}

// startEcho serves on a loopback port a TCP server that writes back what
// it reads, until the test ends.
func startEcho(t *testing.T) net.Listener {
	t.Helper()
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = echo.Close() })
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	return echo
}
