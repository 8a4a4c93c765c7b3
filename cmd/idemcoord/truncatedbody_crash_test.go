package main

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestHTTPTruncatedJSONBodyDoesNotCrash: authenticated HTTP/JSON calls
// from 8 connections at once whose body the coordinator cannot take, each
// connection half-closed once its request is sent, do not crash it. A body
// cut short (Content-Length 50 bytes more than is sent, or a gzip stream
// cut short) was taken as whole; the transcoder then answered the decode
// error from the body's reader while gRPC answered the call, cancelled by
// the client's going, from its handler: "fatal error: concurrent map
// writes" within seconds. A whole body that does not decode (an unknown
// field) took the same path.
func TestHTTPTruncatedJSONBodyDoesNotCrash(t *testing.T) {
	p, httpAddr := startWithTenants(t)
	request := func(body []byte, declared int, extra string) []byte {
		return append([]byte(fmt.Sprintf("POST /idempotency.v1.Coordinator/Begin HTTP/1.1\r\nHost: 127.0.0.1\r\n"+
			"Content-Type: application/json\r\nAuthorization: Bearer pay-secret\r\n%sContent-Length: %d\r\n\r\n",
			extra, declared)), body...)
	}
	cut := []byte(`{"scope":"s","key":"k`)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte(`{"scope":"s","key":"k","ttl":"60s","lease":"30s"}`))
	_ = zw.Close()
	gzCut := gz.Bytes()[:gz.Len()-6]
	unknown := []byte(`{"scope":"s","key":"k","lease_tokn":"x"}`)
	for _, tc := range []struct {
		name    string
		req     []byte
		answers string // the start of the answer, when one comes
	}{
		{"cut short", request(cut, len(cut)+50, ""), "HTTP/1.1 400"},
		{"gzip cut short", request(gzCut, len(gzCut), "Content-Encoding: gzip\r\n"), "HTTP/1.1 400"},
		{"whole, not decodable", request(unknown, len(unknown), ""), "HTTP/1.1 400"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			deadline := time.Now().Add(5 * time.Second)
			var wg sync.WaitGroup
			var mu sync.Mutex
			var answers []string
			for range 8 {
				wg.Go(func() {
					for time.Now().Before(deadline) {
						c, err := net.Dial("tcp", httpAddr)
						if err != nil {
							return // the coordinator is gone
						}
						_, _ = c.Write(tc.req)
						_ = c.(*net.TCPConn).CloseWrite()
						_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
						buf := make([]byte, 128)
						n, _ := c.Read(buf)
						_ = c.Close()
						if n > 0 {
							mu.Lock()
							answers = append(answers, string(buf[:n]))
							mu.Unlock()
						}
					}
				})
			}
			wg.Wait()
			if logs := p.logs.String(); strings.Contains(logs, "fatal error") || strings.Contains(logs, "panic:") {
				i := max(strings.Index(logs, "fatal error"), 0)
				t.Fatalf("the coordinator crashed:\n%s", logs[i:min(i+1500, len(logs))])
			}
			if len(answers) == 0 {
				t.Fatal("no request was answered")
			}
			for _, a := range answers {
				if !strings.HasPrefix(a, tc.answers) {
					t.Fatalf("answer %q, want %s…", a, tc.answers)
				}
			}
		})
	}
	p.stop()
}
