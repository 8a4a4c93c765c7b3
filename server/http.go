package server

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/vanguard"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// connectVersionHeader is the header that marks a Connect unary request.
const connectVersionHeader = "Connect-Protocol-Version"

// apiServices are the services HTTPHandler serves as HTTP/JSON; the others
// on the grpc.Server (health, reflection) stay gRPC only.
var apiServices = []string{
	idempotencyv1.Coordinator_ServiceDesc.ServiceName,
	idempotencyv1.Admin_ServiceDesc.ServiceName,
}

// newAPIHandler serves the Coordinator and Admin methods of g over HTTP with
// the Connect protocol (JSON or binary) and gRPC-Web, translated by
// connectrpc.com/vanguard into gRPC calls that g serves in process. Every
// call therefore goes through g's interceptors: the same authentication
// (bearer token in the Authorization header; a client certificate when the
// listener serves TLS), validation, limits, metrics and logs as over gRPC.
// Errors are Connect's JSON error: {"code": "not_found", "message": …,
// "details": [{"type": "google.rpc.ErrorInfo", "value": …, "debug": {…}}]}.
//
// A POST whose content type is application/json or application/proto is
// taken as a Connect unary call even without the Connect-Protocol-Version
// header, so a plain curl works.
//
// maxMessageBytes bounds one request or response message as it travels over
// HTTP (the listener's body cap, see WithHTTPMaxBodyBytes): a larger one
// fails with resource_exhausted before it reaches the service, and the gRPC
// limits then apply to what passes.
//
// The transcoder's request message is read whole, and any error in it
// answered, before g sees the call (see transcodedFirst): a request the
// transcoder cannot decode is answered once, never while g answers it too.
func newAPIHandler(g *grpc.Server, maxMessageBytes uint32) (http.Handler, error) {
	calls := transcodedFirst(g)
	services := make([]*vanguard.Service, 0, len(apiServices))
	for _, name := range apiServices {
		services = append(services, vanguard.NewService(name, calls))
	}
	t, err := vanguard.NewTranscoder(services,
		vanguard.WithCodec(newStrictJSONCodec),
		vanguard.WithDefaultServiceOptions(
			vanguard.WithTargetProtocols(vanguard.ProtocolGRPC),
			vanguard.WithTargetCodecs(vanguard.CodecProto),
			vanguard.WithMaxMessageBufferBytes(maxMessageBytes)))
	if err != nil {
		return nil, fmt.Errorf("server: HTTP/JSON transcoder: %w", err)
	}
	return connectByDefault(trackAnswer(t)), nil
}

// answerKey is the context key of a request's *answerTracker.
type answerKey struct{}

// answerTracker is the transcoder's ResponseWriter: it records whether an
// answer has begun (a header or body written).
type answerTracker struct {
	http.ResponseWriter
	begun atomic.Bool
}

func (w *answerTracker) WriteHeader(code int) {
	w.begun.Store(true)
	w.ResponseWriter.WriteHeader(code)
}

func (w *answerTracker) Write(p []byte) (int, error) {
	w.begun.Store(true)
	return w.ResponseWriter.Write(p)
}

// Flush flushes what was written, if the writer under it can.
func (w *answerTracker) Flush() { _ = http.NewResponseController(w.ResponseWriter).Flush() }

// Unwrap is the writer under it, for http.ResponseController.
func (w *answerTracker) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// trackAnswer serves next with an answerTracker, which transcodedFirst
// finds in the request's context.
func trackAnswer(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tw := &answerTracker{ResponseWriter: w}
		next.ServeHTTP(tw, r.WithContext(context.WithValue(r.Context(), answerKey{}, tw)))
	})
}

// transcodedFirst serves a call the transcoder made of an HTTP request by
// reading its request message (as the transcoder turns the body into it)
// whole, then handing g the call with that message as its body. The
// transcoder answers a body it cannot take (not valid JSON, a broken
// envelope, over the size limit) from the body's reader, without
// synchronisation; read by g's transport on a goroutine of its own, that
// answer could be written while g answered the same call from its handler
// (the client gone, a deadline passed, an interceptor refusing it), a
// concurrent write of the same headers that crashes the process. Read here
// first, on the goroutine g will answer on, it is written before g starts,
// and g is then not called.
func transcodedFirst(g http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		msg, err := io.ReadAll(r.Body)
		_ = r.Body.Close()
		if tw, ok := r.Context().Value(answerKey{}).(*answerTracker); ok && tw.begun.Load() {
			return // answered
		}
		var body io.Reader = bytes.NewReader(msg)
		if err != nil {
			// An error the transcoder left to g (a Connect GET whose
			// message does not decode, say): g reads it as before.
			body = io.MultiReader(body, failingReader{err})
		}
		r.Body = io.NopCloser(body)
		r.ContentLength = int64(len(msg))
		g.ServeHTTP(w, r)
	})
}

// failingReader fails every read with its error.
type failingReader struct{ err error }

func (f failingReader) Read([]byte) (int, error) { return 0, f.err }

// strictJSONCodec is vanguard's JSON codec, except that a request it cannot
// decode (not JSON, a field of the wrong type, an unknown field: a typo such
// as "lease_tokn" must not pass as an absent field) fails invalid_argument,
// a client mistake, instead of vanguard's unknown.
type strictJSONCodec struct{ *vanguard.JSONCodec }

func newStrictJSONCodec(res vanguard.TypeResolver) vanguard.Codec {
	c := vanguard.NewJSONCodec(res)
	c.UnmarshalOptions.DiscardUnknown = false
	return strictJSONCodec{c}
}

// Unmarshal decodes data into msg.
func (c strictJSONCodec) Unmarshal(data []byte, msg proto.Message) error {
	if err := c.JSONCodec.Unmarshal(data, msg); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("request is not a valid %s in JSON: %w",
			msg.ProtoReflect().Descriptor().FullName(), err))
	}
	return nil
}

// connectByDefault marks a POST with a unary Connect content type and no
// Connect-Protocol-Version header as a Connect call. Vanguard would
// otherwise take it for a REST call, which these services do not map. It
// also answers an empty JSON body invalid_argument (as connect-go does),
// which vanguard would pass on as no request at all, and a POST of another
// content type (curl's default form encoding, say) 415 with a hint, where
// vanguard would answer a bare 404.
func connectByDefault(next http.Handler) http.Handler {
	errw := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
		switch {
		case err == nil && (mt == "application/json" || mt == "application/proto"):
		case err == nil && (mt == "application/grpc" || mt == "application/grpc-web" ||
			strings.HasPrefix(mt, "application/grpc+") || strings.HasPrefix(mt, "application/grpc-web+") ||
			strings.HasPrefix(mt, "application/connect+")):
			next.ServeHTTP(w, r)
			return
		default:
			w.Header().Set("Accept-Post", "application/json, application/proto, application/grpc-web+proto, application/grpc-web+json")
			http.Error(w, "unsupported Content-Type: send the request message as JSON with `Content-Type: application/json`",
				http.StatusUnsupportedMediaType)
			return
		}
		if len(r.Header.Values(connectVersionHeader)) == 0 {
			r.Header.Set(connectVersionHeader, "1")
		}
		if mt == "application/json" {
			body := bufio.NewReader(r.Body)
			if _, err := body.Peek(1); err == io.EOF {
				_ = errw.Write(w, r, connect.NewError(connect.CodeInvalidArgument,
					errors.New("empty request body: send a JSON object ({} at least)")))
				return
			}
			r.Body = readCloser{body, r.Body}
		}
		next.ServeHTTP(w, r)
	})
}

// readCloser reads from a buffered reader and closes the body under it.
type readCloser struct {
	io.Reader
	io.Closer
}

// DefaultHTTPMaxBodyBytes is the default cap on a request body on the HTTP
// listener, counted after decompression: a message at the gRPC limit of
// 4 MiB, written as JSON (bytes fields in base64).
const DefaultHTTPMaxBodyBytes = 6 << 20

// DefaultHTTPReadTimeout is how long the HTTP listener waits, by default,
// for a request's headers and body.
const DefaultHTTPReadTimeout = 30 * time.Second

// DefaultHTTPMaxBufferedBytes is the least budget of request body bytes the
// HTTP listener holds at once, all requests together, when
// WithHTTPMaxBufferedBytes does not set one: the default is this or 16 body
// caps, whichever is larger.
const DefaultHTTPMaxBufferedBytes = 128 << 20

// httpBufferedBodyCaps is how many body caps the default budget of
// buffered body bytes holds at least.
const httpBufferedBodyCaps = 16

// httpBusyRetryAfter is the Retry-After, in seconds, of a 503 given when the
// budget of buffered body bytes is spent.
const httpBusyRetryAfter = "1"

const (
	// httpReadHeaderTimeout is how long the HTTP listener waits for a
	// request's headers (or ReadTimeout when shorter).
	httpReadHeaderTimeout = 10 * time.Second
	// httpIdleTimeout is how long a kept-alive connection may wait for its
	// next request: more than a scrape interval of a minute.
	httpIdleTimeout = 2 * time.Minute
	// httpMaxHeaderBytes caps a request's line and headers (a Connect GET
	// carries its request message in the URL).
	httpMaxHeaderBytes = 64 << 10
	// httpWriteMargin is how much longer than the longest wait an answer
	// has to be written.
	httpWriteMargin = 15 * time.Second
)

// NewHTTPServer returns the http.Server for the coordinator's HTTP
// listener: it serves h (HTTPHandler, or a mux that mounts it) behind the
// listener's guard, which bounds the work any request, authenticated or
// not, can cause before h sees it:
//
//   - While auth is off (no tenants), a request whose Host header is not a
//     loopback name or address ("localhost", 127.0.0.0/8, ::1) or a host of
//     WithHTTPAllowedHosts gets 421 Misdirected Request: a web page that
//     rebinds its DNS name to the coordinator's address cannot use it.
//     /healthz and /readyz answer whatever the Host.
//   - The body is read whole before h runs, at most WithHTTPMaxBodyBytes
//     bytes as sent and, for Content-Encoding gzip, once inflated: past the
//     cap it is 413, and nothing is decoded; a body that ends before its
//     Content-Length, last chunk or gzip end is 400, its connection
//     closed. Any other Content-Encoding but
//     identity, and per-message compression (Grpc-Encoding,
//     Connect-Content-Encoding, a Connect GET's compression parameter) but
//     identity, is 415: the listener inflates only what it can bound.
//   - A request that is not a call of an API method (/metrics, /healthz,
//     /readyz, an unknown path, a page or form mounted next to the API)
//     has a body cap of its own, WithHTTPOtherMaxBodyBytes, and its own
//     small budget of buffered bytes (8 of its bodies, at least 1 MiB),
//     apart from the API's: no such request takes from the API's budget.
//   - API calls together hold at most WithHTTPMaxBufferedBytes bytes of
//     body (as read and, for gzip, as inflated, plus the inflater's state),
//     charged as they are read and given back once the request is answered:
//     a request whose next bytes do not fit gets 503 with Retry-After and
//     its connection closed, without reading more. Many small requests fit
//     at once; many connections that each hold a body near the cap (for
//     instance a few KB of gzip inflating to it and never finished) cost
//     the budget, not the cap each. A body is read into pieces that grow
//     as it comes (4 KiB, then twice as large up to 64 KiB), so a
//     connection that trickles a few bytes costs a few KiB.
//   - One client (the remote IP address; an IPv6 /64 network) holds at
//     most its share of either budget (WithHTTPMaxBufferedBytesPerClient;
//     an eighth by default): past it, its request gets 429 with
//     Retry-After and its connection closed, while other clients are
//     still served. Behind a proxy every request through it is one
//     client.
//   - Framing mistakes the transcoder would answer as internal errors are
//     invalid_argument: a gRPC-Web body cut inside a frame, or of more than
//     one frame (grpc-status 3),
//     a Connect GET whose message is not base64url or whose base64
//     parameter is neither 0 nor 1 (400).
//   - Headers take at most 10 s and 64 KiB; headers and body at most
//     WithHTTPReadTimeout (else 408 or a closed connection). Once the body
//     is in, the answer has the scope's longest wait (max_wait) plus 15 s
//     to be written; an idle kept-alive connection is closed after 2 min.
func (s *Server) NewHTTPServer(h http.Handler) *http.Server {
	read := s.opts.httpReadTimeout
	return &http.Server{
		Handler:           s.guardHTTP(h),
		ReadHeaderTimeout: min(httpReadHeaderTimeout, read),
		ReadTimeout:       read,
		// Past the headers, the answer waits for the body, then for the
		// call; guardHTTP sets the deadline of each call's answer once
		// its body is in, from the max_wait in force.
		WriteTimeout:   read + max(s.policies.Load().Limits().MaxWait, DefaultLimits().MaxWait) + httpWriteMargin,
		IdleTimeout:    httpIdleTimeout,
		MaxHeaderBytes: httpMaxHeaderBytes,
	}
}

// guardHTTP checks the Host, reads the body within the cap and sets the
// connection's deadlines before next runs; see NewHTTPServer.
func (s *Server) guardHTTP(next http.Handler) http.Handler {
	allowed := s.opts.httpAllowedHosts
	apiBudget := newBodyBudget(s.opts.httpMaxBuffered, s.opts.httpClientBuffered, bodyCost(s.opts.httpMaxBody))
	otherBudget := newBodyBudget(s.httpOtherMaxBuffered(), 0, bodyCost(s.opts.httpOtherMaxBody))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.policies.Load().AuthEnabled() && !isProbe(r) && !hostAllowed(r.Host, allowed) {
			closeUnread(w)
			http.Error(w, fmt.Sprintf("Host %q is not served while auth is off: use a loopback address or name, "+
				"or list the host in --http-allowed-hosts", r.Host), http.StatusMisdirectedRequest)
			return
		}
		if s.policies.Load().AuthEnabled() && isAPICall(r) {
			if err := s.authenticateHTTP(r); err != nil {
				closeUnread(w)
				refuseCall(w, r, carriesStatusInTrailers(r), connect.CodeUnauthenticated, status.Convert(err).Message())
				return
			}
		}
		gz, err := requestCompression(r)
		if err != nil {
			w.Header().Set("Accept-Encoding", "gzip")
			closeUnread(w)
			http.Error(w, err.Error(), http.StatusUnsupportedMediaType)
			return
		}
		maxBody, budget := s.opts.httpMaxBody, apiBudget
		if !isAPICall(r) {
			maxBody, budget = s.opts.httpOtherMaxBody, otherBudget
		}
		client := clientOf(r.RemoteAddr)
		body, charged, err := readBody(w, r, gz, maxBody, budget, client)
		defer budget.give(client, charged)
		if err != nil {
			var tooLarge *http.MaxBytesError
			switch {
			case errors.Is(err, errBodyBudget):
				w.Header().Set("Connection", "close")
				w.Header().Set("Retry-After", httpBusyRetryAfter)
				http.Error(w, "too many request bodies being received at once: retry later", http.StatusServiceUnavailable)
			case errors.Is(err, errClientShare):
				w.Header().Set("Connection", "close")
				w.Header().Set("Retry-After", httpBusyRetryAfter)
				http.Error(w, "too many request bodies being received at once from this client: retry later", http.StatusTooManyRequests)
			case errors.As(err, &tooLarge):
				w.Header().Set("Connection", "close")
				http.Error(w, fmt.Sprintf("request body over %d bytes (counted after decompression)", maxBody),
					http.StatusRequestEntityTooLarge)
			case errors.Is(err, os.ErrDeadlineExceeded):
				w.Header().Set("Connection", "close")
				http.Error(w, "request body not received in time", http.StatusRequestTimeout)
			default:
				// A body cut short or broken: what follows it on the
				// connection, if anything, cannot be trusted.
				w.Header().Set("Connection", "close")
				http.Error(w, "cannot read the request body: "+err.Error(), http.StatusBadRequest)
			}
			return
		}
		if web, err := checkFraming(r, body); err != nil {
			refuseMalformed(w, r, web, err)
			return
		}
		if body != nil {
			n := bodyLen(body)
			r.Body = io.NopCloser(&body)
			r.ContentLength = n
			r.TransferEncoding = nil
			r.Header.Del("Content-Encoding")
			r.Header.Set("Content-Length", strconv.FormatInt(n, 10))
		}
		// The body is in: the read deadline, which would otherwise cancel
		// a waiting call when it passes, is lifted, and the answer gets
		// the longest wait plus a margin.
		rc := http.NewResponseController(w)
		_ = rc.SetReadDeadline(time.Time{})
		_ = rc.SetWriteDeadline(time.Now().Add(s.policies.Load().Limits().MaxWait + httpWriteMargin))
		next.ServeHTTP(w, r)
	})
}

// isProbe reports whether r asks /healthz or /readyz, which reveal and
// change nothing.
func isProbe(r *http.Request) bool {
	return (r.Method == http.MethodGet || r.Method == http.MethodHead) && (r.URL.Path == "/healthz" || r.URL.Path == "/readyz")
}

// normalizeHost returns the name or address of a Host header or an entry
// of WithHTTPAllowedHosts: without port or IPv6 brackets, in lower case,
// without a trailing dot.
func normalizeHost(host string) string {
	host = strings.TrimSpace(host)
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		host = host[1 : len(host)-1]
	}
	return strings.TrimSuffix(strings.ToLower(host), ".")
}

// hostAllowed reports whether a request's Host names the loopback interface
// ("localhost", 127.0.0.0/8, ::1) or one of allowed (normalized; "*" allows
// every host). Names under .localhost are not taken for loopback: some
// resolvers forward them.
func hostAllowed(host string, allowed map[string]bool) bool {
	name := normalizeHost(host)
	if name == "" {
		return false
	}
	if name == "localhost" || allowed["*"] || allowed[name] {
		return true
	}
	ip := net.ParseIP(name)
	return ip != nil && ip.IsLoopback()
}

// requestCompression reports whether r's body is gzip, and refuses any
// other compression: another Content-Encoding, or message compression
// (gRPC-Web's Grpc-Encoding, Connect streaming's Connect-Content-Encoding,
// a Connect GET's compression parameter), which the transcoder would inflate
// without a bound.
func requestCompression(r *http.Request) (gz bool, err error) {
	var codings []string
	for _, v := range r.Header.Values("Content-Encoding") {
		for c := range strings.SplitSeq(v, ",") {
			if c = strings.ToLower(strings.TrimSpace(c)); c != "" && c != "identity" {
				codings = append(codings, c)
			}
		}
	}
	switch {
	case len(codings) == 1 && (codings[0] == "gzip" || codings[0] == "x-gzip"):
		gz = true
	case len(codings) > 0:
		return false, fmt.Errorf("unsupported Content-Encoding %q: send the body as is or with gzip", strings.Join(codings, ", "))
	}
	for _, name := range []string{"Grpc-Encoding", "Connect-Content-Encoding"} {
		if v := strings.TrimSpace(r.Header.Get(name)); v != "" && !strings.EqualFold(v, "identity") {
			return false, fmt.Errorf("unsupported %s %q: send messages uncompressed (gzip the whole body with Content-Encoding instead)", name, v)
		}
	}
	if v := r.URL.Query().Get("compression"); v != "" && !strings.EqualFold(v, "identity") {
		return false, fmt.Errorf("unsupported compression %q: send the message uncompressed", v)
	}
	return gz, nil
}

// A body is read into pieces of bodyFirstSlabBytes, then each twice as
// large as the one before up to bodySlabBytes: a body that has come in
// costs at most its length plus 64 KiB (or twice its length, under
// 128 KiB), never more than the cap plus a byte, and a connection that
// trickles a few bytes costs a few KiB, not the largest piece.
const (
	bodyFirstSlabBytes = 4 << 10
	bodySlabBytes      = 64 << 10
)

// gzipStateBytes is what readBody charges to the budget for a gzip
// reader's state (its 32 KiB window, tables and buffer).
const gzipStateBytes = 64 << 10

// readBody reads r's body whole, inflating it when gz, and fails with an
// *http.MaxBytesError once it is over maxBytes as sent or as inflated. A
// request without a body gives nil. Each piece of the body (and the gzip
// reader's state) is charged to client in budget before it is allocated,
// without waiting: when it does not fit, readBody fails with take's error
// (errBodyBudget or errClientShare). It returns how much it charged, to
// give back once the body is no longer used, whether it fails or not.
func readBody(w http.ResponseWriter, r *http.Request, gz bool, maxBytes int64, budget *bodyBudget, client string) (_ net.Buffers, charged int64, _ error) {
	if r.Body == nil || r.Body == http.NoBody || (r.ContentLength == 0 && len(r.TransferEncoding) == 0) {
		return nil, 0, nil
	}
	if r.ContentLength > maxBytes {
		return nil, 0, &http.MaxBytesError{Limit: maxBytes}
	}
	charge := func(n int64) error {
		if err := budget.take(client, n); err != nil {
			return err
		}
		charged += n
		return nil
	}
	raw := http.MaxBytesReader(w, r.Body, maxBytes)
	// limit is one byte more than the body can hold: reading it tells the
	// body is over the cap, or (its length being known) at its end.
	limit := maxBytes + 1
	var src io.Reader = raw
	if gz {
		if err := charge(gzipStateBytes); err != nil {
			return nil, charged, err
		}
		br := bufio.NewReaderSize(raw, gzipReadBufferBytes)
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, charged, fmt.Errorf("the body is not gzip: %w", err)
		}
		defer zr.Close()
		zr.Multistream(false)
		src = &gzipMembers{zr: zr, br: br}
	} else if r.ContentLength > 0 {
		limit = r.ContentLength + 1
	}
	body := net.Buffers{}
	for n, next := int64(0), int64(bodyFirstSlabBytes); ; next = min(2*next, bodySlabBytes) {
		size := min(next, limit-n)
		if err := charge(size); err != nil {
			return nil, charged, err
		}
		slab := make([]byte, size)
		k, err := fill(src, slab)
		body = append(body, slab[:k])
		n += int64(k)
		switch {
		case n > maxBytes:
			return nil, charged, &http.MaxBytesError{Limit: maxBytes}
		case errors.Is(err, io.EOF) && !gz && r.ContentLength > 0 && n < r.ContentLength:
			return nil, charged, fmt.Errorf("%w: %d of %d bytes", errBodyCut, n, r.ContentLength)
		case errors.Is(err, io.EOF):
			return body, charged, nil
		case errors.Is(err, io.ErrUnexpectedEOF):
			return nil, charged, fmt.Errorf("%w: %w", errBodyCut, err)
		case err != nil:
			return nil, charged, err
		}
	}
}

// gzipReadBufferBytes is the buffer between a gzip body and its inflater,
// within gzipStateBytes.
const gzipReadBufferBytes = 4 << 10

// gzipMembers inflates a gzip body of one or more members (RFC 1952 allows
// several one after the other, as "cat a.gz b.gz" makes), and tells bytes
// after the last member that are not gzip from a body cut short: zr reads
// from br one member at a time, and at the end of each, what br still
// holds must be another member.
type gzipMembers struct {
	zr *gzip.Reader
	br *bufio.Reader
}

func (g *gzipMembers) Read(p []byte) (int, error) {
	for {
		n, err := g.zr.Read(p)
		if !errors.Is(err, io.EOF) {
			return n, err
		}
		// A member ended: the body ends here, or another member starts
		// (with a header of at least 10 bytes).
		header, err := g.br.Peek(10)
		switch {
		case len(header) == 0 && errors.Is(err, io.EOF):
			return n, io.EOF
		case err != nil && !errors.Is(err, io.EOF):
			return n, err // the body was cut short
		case len(header) < 10:
			return n, fmt.Errorf("%w (%d bytes)", errGzipTrailer, len(header))
		}
		if err := g.zr.Reset(g.br); errors.Is(err, gzip.ErrHeader) {
			return n, errGzipTrailer
		} else if err != nil {
			return n, err
		}
		g.zr.Multistream(false)
		if n > 0 {
			return n, nil
		}
	}
}

// errGzipTrailer is readBody's error for a gzip body that goes on after
// the end of its last member with bytes that are not gzip.
var errGzipTrailer = errors.New("the body goes on after the end of its gzip stream with bytes that are not gzip")

// errBodyCut is readBody's error for a body that ends before its end: the
// connection closed before Content-Length bytes, the last chunk or the end
// of the gzip stream came.
var errBodyCut = errors.New("the request body ends before its end")

// fill reads src into p until p is full (nil) or src ends: io.EOF only at
// the end of the body, any other error (io.ErrUnexpectedEOF for a body cut
// short) as src gives it.
func fill(src io.Reader, p []byte) (int, error) {
	n := 0
	for n < len(p) {
		k, err := src.Read(p[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// grpcWebContentType is the media type of gRPC-Web requests with binary
// framing; application/grpc-web-text (base64) starts with it too.
const grpcWebContentType = "application/grpc-web"

// checkFraming finds the client mistakes in framing that the transcoder
// would answer as internal errors (gRPC-Web grpc-status 13, Connect HTTP
// 500): a gRPC-Web body (binary framing) that does not end at the end of a
// frame or holds more than one (every method served over HTTP is unary),
// and a Connect GET (a GET with an encoding or connect=v1 query
// parameter) whose base64 parameter is neither 0 nor 1 or whose message is
// not base64url. web tells whether r is gRPC-Web. gRPC-Web's text framing
// (base64) is left to the transcoder.
func checkFraming(r *http.Request, body net.Buffers) (web bool, err error) {
	ct := strings.ToLower(r.Header.Get("Content-Type"))
	if strings.HasPrefix(ct, grpcWebContentType) && !strings.HasPrefix(ct, grpcWebContentType+"-text") {
		rest := append(net.Buffers(nil), body...) // reading a net.Buffers consumes it
		var header [5]byte
		for frames := 0; ; frames++ {
			k, err := io.ReadFull(&rest, header[:])
			switch {
			case k == 0:
				return true, nil
			case err != nil:
				return true, fmt.Errorf("the body ends inside a gRPC-Web frame header (%d of 5 bytes)", k)
			case frames == 1:
				return true, errors.New("more than one gRPC-Web frame: every method of the API takes one request message")
			}
			length := int64(header[1])<<24 | int64(header[2])<<16 | int64(header[3])<<8 | int64(header[4])
			if k, _ := io.CopyN(io.Discard, &rest, length); k < length {
				return true, fmt.Errorf("the body ends inside a gRPC-Web frame (%d of %d bytes)", k, length)
			}
		}
	}
	q := r.URL.Query()
	if r.Method != http.MethodGet || !(q.Has("encoding") || q.Get("connect") == "v1") {
		return false, nil // not a Connect GET
	}
	switch q.Get("base64") {
	case "", "0":
	case "1":
		if m := q.Get("message"); m != "" {
			if _, err := base64.RawURLEncoding.DecodeString(m); err != nil {
				if _, err := base64.URLEncoding.DecodeString(m); err != nil {
					return false, errors.New("query parameter message is not base64url")
				}
			}
		}
	default:
		return false, errors.New("query parameter base64 must be absent, 0 or 1")
	}
	return false, nil
}

// refuseMalformed answers a request checkFraming refused with
// invalid_argument in its own protocol (see refuseCall).
func refuseMalformed(w http.ResponseWriter, r *http.Request, web bool, err error) {
	refuseCall(w, r, web, connect.CodeInvalidArgument, err.Error())
}

// refuseCall answers an API request that guardHTTP refuses before the
// transcoder sees it with code and message in the request's protocol: a
// trailers-only answer with grpc-status when trailers (gRPC, gRPC-Web)
// carry its status, else a Connect error (JSON, with the code's HTTP
// status).
func refuseCall(w http.ResponseWriter, r *http.Request, trailers bool, code connect.Code, message string) {
	if trailers {
		w.Header().Set("Content-Type", r.Header.Get("Content-Type"))
		w.Header().Set("Grpc-Status", strconv.Itoa(int(code)))
		w.Header().Set("Grpc-Message", percentEncode(message))
		w.WriteHeader(http.StatusOK)
		return
	}
	b, _ := json.Marshal(struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}{code.String(), message})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(connectHTTPStatus(code))
	_, _ = w.Write(b)
}

// connectHTTPStatus is the HTTP status of a Connect error of code, for the
// codes refuseCall answers with.
func connectHTTPStatus(code connect.Code) int {
	switch code {
	case connect.CodeUnauthenticated:
		return http.StatusUnauthorized
	case connect.CodeInvalidArgument:
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

// percentEncode encodes a grpc-message value: bytes outside printable
// ASCII, and '%', as %XX.
func percentEncode(s string) string {
	var b strings.Builder
	for i := range len(s) {
		if c := s[i]; c >= 0x20 && c <= 0x7e && c != '%' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// isAPICall reports whether r asks a Coordinator or Admin method, which
// every caller must authenticate for (while auth is on).
func isAPICall(r *http.Request) bool {
	for _, name := range apiServices {
		if strings.HasPrefix(r.URL.Path, "/"+name+"/") {
			return true
		}
	}
	return false
}

// carriesStatusInTrailers reports whether r is a gRPC or gRPC-Web request,
// whose answer carries its status in (trailers-only) headers.
func carriesStatusInTrailers(r *http.Request) bool {
	return strings.HasPrefix(strings.ToLower(r.Header.Get("Content-Type")), "application/grpc")
}

// authenticateHTTP authenticates an API request from its headers and TLS
// state before its body is read, with the same rule the gRPC chain applies
// to the call the transcoder makes of it (authenticate, on the same
// authorization values and the same client certificate); that chain still
// authenticates the call. It lets guardHTTP refuse a caller without valid
// credentials before buffering, inflating or decoding anything it sent; a
// refusal is counted and logged as the gRPC listener's are
// (authenticateUnread).
func (s *Server) authenticateHTTP(r *http.Request) error {
	ctx := r.Context()
	if v := r.Header.Values("Authorization"); len(v) > 0 {
		ctx = metadata.NewIncomingContext(ctx, metadata.MD{"authorization": v})
	}
	p := &peer.Peer{Addr: httpPeerAddr(r.RemoteAddr)}
	if r.TLS != nil {
		p.AuthInfo = credentials.TLSInfo{State: *r.TLS}
	}
	_, err := s.authenticateUnread(peer.NewContext(ctx, p), r.URL.Path)
	return err
}

// httpPeerAddr is the remote address of an HTTP request, as a peer's.
type httpPeerAddr string

func (httpPeerAddr) Network() string  { return "tcp" }
func (a httpPeerAddr) String() string { return string(a) }

// closeUnread, called before a request is answered without its body being
// read, closes the connection once the answer is sent, without reading
// what is left of the body (net/http would otherwise read up to 256 KiB of
// it, waiting for it until the read timeout).
func closeUnread(w http.ResponseWriter) {
	w.Header().Set("Connection", "close")
	_ = http.NewResponseController(w).SetReadDeadline(time.Now())
}

// bodyLen is the length of a body readBody read.
func bodyLen(b net.Buffers) int64 {
	var n int64
	for _, s := range b {
		n += int64(len(s))
	}
	return n
}
