package main

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestGRPCUnfinishedHeadersBoundMemory: 40 connections without a token
// each send a HEADERS frame without END_HEADERS and then ~15 MiB of header
// fields in CONTINUATION frames, never ending the block. With grpc-go's
// default header list limit (16 MiB), and auth and the read timeout
// starting only once headers end, every connection held what it sent
// (+640 MiB; up to 16 GiB with --grpc-max-connections 1024). With the
// listener's 32 KiB limit each is closed once past it.
func TestGRPCUnfinishedHeadersBoundMemory(t *testing.T) {
	p, _ := startWithTenants(t)
	before := processMemory(t, p.cmd.Process.Pid)
	val := strings.Repeat("v", 8000)
	var wg sync.WaitGroup
	for range 40 {
		c := dialRawGRPC(t, p.grpcAddr)
		wg.Go(func() {
			time.Sleep(500 * time.Millisecond) // settings exchanged: no frame may come between HEADERS and CONTINUATION
			c.mu.Lock()
			defer c.mu.Unlock()
			c.headers.Reset()
			for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", beginMethod}, {":authority", "x"}, {"content-type", "application/grpc"}} {
				_ = c.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
			}
			if err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: c.headers.Bytes()}); err != nil {
				return
			}
			for k := range 15 << 20 / 16000 {
				var hb bytes.Buffer
				for j := range 2 {
					name := fmt.Sprintf("x-%d-%d", k, j)
					hb.WriteByte(0)
					hb.WriteByte(byte(len(name)))
					hb.WriteString(name)
					hb.Write([]byte{0x7f, byte((len(val)-127)%128 | 128), byte((len(val) - 127) / 128)})
					hb.WriteString(val)
				}
				if c.fr.WriteContinuation(1, false, hb.Bytes()) != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	time.Sleep(2 * time.Second)
	wantMemoryBounded(t, p, "40 connections × 15 MiB of unfinished header blocks, no token", before, 4*rssBoundBytes)
	p.stop()
}
