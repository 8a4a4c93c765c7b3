package clients

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/felixge/httpsnoop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Expiry headers: when the key of an answer stops being honoured.
const (
	// HTTPExpiresHeader is the response header of HTTPMiddleware's created
	// and replayed answers, an IMF-fixdate (RFC 9110, "Sun, 06 Nov 1994
	// 08:49:37 GMT"): the record's expires_at. A retry with the key after
	// that moment may run the request again (policy on_expired: restart)
	// or be refused (on_expired: reject). On a created answer, which is
	// written before its result is stored, it is the moment the handler
	// answered plus the ttl the coordinator told in Begin, by the service's
	// clock: the record's expires_at is that, or a little later (by the
	// time the store took).
	HTTPExpiresHeader = "Idempotency-Expires"
	// ExpiresHeader is the response header of the interceptor's created and
	// replayed answers, in RFC 3339 (UTC, whole seconds): the record's
	// expires_at, with the same meaning as HTTPExpiresHeader (on a created
	// answer: the moment before its result was stored plus the told ttl).
	ExpiresHeader = "idempotency-expires"
)

// httpReplayHook is the function of WithHTTPReplayHook.
type httpReplayHook func(r *http.Request, stored *idempotencyv1.StoredResponse) *idempotencyv1.StoredResponse

// WithHTTPReplayHook lets f adjust every replayed answer before it is
// written, to refresh per-request fields (a fresh request id, say) while
// the outcome stays the stored one (a job id, say). f gets a copy of the
// stored response, which it may change and return; what it returns is
// answered as a replay (status, Content-Type, metadata as headers, body,
// with "Idempotency-Result: replayed"), and the record in the coordinator
// stays as it was stored. Returning nil answers the stored response.
func WithHTTPReplayHook(f func(r *http.Request, stored *idempotencyv1.StoredResponse) *idempotencyv1.StoredResponse) HTTPOption {
	return func(o *httpOptions) { o.replayHook = f }
}

// replayHook is the function of WithReplayHook.
type replayHook func(ctx context.Context, fullMethod string, resp proto.Message) proto.Message

// WithReplayHook lets f adjust every replayed response message (decoded
// from the stored one, of the method's response type) before it is sent,
// to refresh per-request fields while the outcome stays the stored one.
// f may change resp and return it, or return another message of the same
// type; nil sends resp. The stored record never changes. Replayed
// failures (a stored status) are sent as stored, without f.
func WithReplayHook(f func(ctx context.Context, fullMethod string, resp proto.Message) proto.Message) InterceptorOption {
	return func(o *interceptorOptions) { o.replayHook = f }
}

// WithHTTPMismatchStatus sets the status of the answer to a key reused
// with another request (ProblemKeyReused): 422 Unprocessable Content by
// default, as the IETF draft says, or 409 Conflict, as many API
// guidelines do. Only these two are taken: any other status leaves the
// setting as it was, and HTTPMiddleware logs a warning when it is built.
func WithHTTPMismatchStatus(status int) HTTPOption {
	return func(o *httpOptions) {
		if status == http.StatusUnprocessableEntity || status == http.StatusConflict {
			o.mismatchStatus = status
			return
		}
		o.refusedMismatchStatus = status
	}
}

// toldTTL is what the middleware and the interceptor know of when the
// record of a created answer expires: the ttl and failure_ttl an acquiring Begin told.
type toldTTL struct {
	ttl, failureTTL *durationpb.Duration
}

// expiresAt is when a record stored at now expires, for a success or (a
// replayable status) a failure; zero when the coordinator did not tell.
func (e toldTTL) expiresAt(now time.Time, failure bool) time.Time {
	d := e.ttl
	if failure {
		d = e.failureTTL
	}
	if d == nil {
		return time.Time{}
	}
	return now.Add(d.AsDuration())
}

// setHTTPExpires sets Idempotency-Expires to t, or removes it when t is
// zero.
func setHTTPExpires(h http.Header, t time.Time) {
	if t.IsZero() {
		h.Del(HTTPExpiresHeader)
		return
	}
	h.Set(HTTPExpiresHeader, t.UTC().Format(http.TimeFormat))
}

// grpcExpires is t as the value of ExpiresHeader.
func grpcExpires(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// setExpires sets the interceptor's ExpiresHeader to t (nothing when t is
// zero).
func setExpires(ctx context.Context, t time.Time) {
	if !t.IsZero() {
		_ = grpc.SetHeader(ctx, metadata.Pairs(ExpiresHeader, grpcExpires(t)))
	}
}

// replayStoredHTTP answers the stored response of rec, through the replay
// hook, with Idempotency-Expires.
func (m *httpMiddleware) replayStoredHTTP(w http.ResponseWriter, r *http.Request, rec *idempotencyv1.Record) {
	resp := rec.GetResponse()
	if m.o.replayHook != nil {
		if out := m.o.replayHook(r, proto.CloneOf(resp)); out != nil {
			resp = out
		}
	}
	var exp time.Time
	if rec.GetExpiresAt() != nil {
		exp = rec.GetExpiresAt().AsTime()
	}
	setHTTPExpires(w.Header(), exp)
	replayHTTP(w, resp)
}

// replayed applies the interceptor's replay hook to a replayed message.
func (ic *interceptor) replayed(ctx context.Context, fullMethod string, out proto.Message) proto.Message {
	if ic.o.replayHook == nil {
		return out
	}
	if h := ic.o.replayHook(ctx, fullMethod, out); h != nil {
		return h
	}
	return out
}

// expiresMetadata is the ExpiresHeader of a record that expires at t (nil:
// none).
func expiresMetadata(t *timestamppb.Timestamp) metadata.MD {
	if t == nil {
		return nil
	}
	return metadata.Pairs(ExpiresHeader, grpcExpires(t.AsTime()))
}

// snoop returns the writer the handler writes to: it sends everything to
// rec (which passes it on to the client and keeps a copy) and has exactly
// the optional interfaces of the underlying writer (http.Flusher,
// http.Hijacker, io.ReaderFrom, …), as httpsnoop promises.
func (rec *httpRecorder) snoop() http.ResponseWriter {
	return httpsnoop.Wrap(rec.w, httpsnoop.Hooks{
		WriteHeader: func(httpsnoop.WriteHeaderFunc) httpsnoop.WriteHeaderFunc { return rec.WriteHeader },
		Write:       func(httpsnoop.WriteFunc) httpsnoop.WriteFunc { return rec.Write },
		WriteString: func(httpsnoop.WriteStringFunc) httpsnoop.WriteStringFunc {
			return func(s string) (int, error) { return rec.Write([]byte(s)) }
		},
		ReadFrom: func(httpsnoop.ReadFromFunc) httpsnoop.ReadFromFunc {
			// Through Write, so the body is kept for storage.
			return func(src io.Reader) (int64, error) { return io.Copy(writerOnly{rec}, src) }
		},
		Flush: func(next httpsnoop.FlushFunc) httpsnoop.FlushFunc {
			return func() {
				if !rec.wrote {
					rec.WriteHeader(http.StatusOK)
				}
				next()
			}
		},
		FlushError: func(next httpsnoop.FlushErrorFunc) httpsnoop.FlushErrorFunc {
			return func() error {
				if !rec.wrote {
					rec.WriteHeader(http.StatusOK)
				}
				return next()
			}
		},
		Hijack: func(next httpsnoop.HijackFunc) httpsnoop.HijackFunc {
			return func() (net.Conn, *bufio.ReadWriter, error) {
				rec.hijacked = true
				return next()
			}
		},
	})
}

// writerOnly hides every method of a writer but Write.
type writerOnly struct{ io.Writer }
