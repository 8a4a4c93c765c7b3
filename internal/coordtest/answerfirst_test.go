package coordtest

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"testing"
)

// TestAnswerFirstTransportKeepsAnEarlyAnswer: a server that answers 413
// after the request's headers and closes the connection at once, 8 MiB of
// body unread (so the client's writes fail), is still heard.
func TestAnswerFirstTransportKeepsAnEarlyAnswer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			if _, err := http.ReadRequest(bufio.NewReader(conn)); err == nil {
				_, _ = io.WriteString(conn, "HTTP/1.1 413 Request Entity Too Large\r\nContent-Length: 9\r\nConnection: close\r\n\r\ntoo large")
			}
			_ = conn.Close()
		}
	}()
	client := &http.Client{Transport: AnswerFirstTransport{}}
	for range 5 {
		resp, err := client.Post("http://"+ln.Addr().String()+"/", "application/json", bytes.NewReader(make([]byte, 8<<20)))
		if err != nil {
			t.Fatalf("no answer: %v", err)
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge || string(b) != "too large" || err != nil {
			t.Fatalf("HTTP %d %q (%v), want 413 too large", resp.StatusCode, b, err)
		}
	}
}
