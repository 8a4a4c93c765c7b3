package coordtest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// AnswerFirstTransport is an http.RoundTripper over plain HTTP/1.1 for
// tests of a listener that may answer a request before it has read the
// whole body (an oversized one, refused with 413, then the connection
// closed). It sends each request on a connection of its own, reads the
// answer while it writes the request, and returns an answer that arrived
// even when writing the rest of the body then failed. net/http's own
// Transport returns the failed write instead when it sees it first, which
// a busy machine makes it do now and then.
type AnswerFirstTransport struct{}

// RoundTrip sends req and returns the answer read from its connection,
// which closing the answer's body closes.
func (AnswerFirstTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	conn, err := (&net.Dialer{}).DialContext(req.Context(), "tcp", req.URL.Host)
	if err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	deadline, ok := req.Context().Deadline()
	if !ok {
		deadline = time.Now().Add(time.Minute)
	}
	_ = conn.SetDeadline(deadline)
	wrote := make(chan error, 1)
	go func() { wrote <- req.Write(conn) }()
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("no answer (%w); writing the request: %v", err, <-wrote)
	}
	resp.Body = &connBody{ReadCloser: resp.Body, conn: conn, wrote: wrote}
	return resp, nil
}

// connBody is an answer's body that closes its connection, ending a write
// of the request still under way, and waits for that write to end.
type connBody struct {
	io.ReadCloser
	conn  net.Conn
	wrote chan error
	once  sync.Once
	// writeErr is the request's write's error, once Close has waited for
	// it: an answer may come before the body is all sent.
	writeErr error
}

func (b *connBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(func() {
		_ = b.conn.Close()
		b.writeErr = <-b.wrote
	})
	return err
}
