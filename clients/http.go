package clients

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/dunglas/httpsfv"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// HTTP names on the wire.
const (
	// HTTPKeyHeader is the request header HTTPMiddleware reads the
	// idempotency key from, and the response header it echoes it in.
	HTTPKeyHeader = "Idempotency-Key"
	// HTTPResultHeader is the response header HTTPMiddleware sets:
	// "created" when this request ran the handler and its response is
	// stored, "replayed" when the response is a stored one.
	HTTPResultHeader = "Idempotency-Result"
	// HTTPReplayedHeader is "true" on every replayed answer, beside
	// "Idempotency-Result: replayed": the header Stripe's client libraries
	// read. Created answers and the middleware's own answers lack it.
	HTTPReplayedHeader = "Idempotent-Replayed"
	// HTTPSchemaVersion is the schema version of the responses
	// HTTPMiddleware stores: StoredResponse.status_code is the HTTP status,
	// content_type the Content-Type, metadata the other stored headers
	// (several values of one header joined by "\n") and body the body.
	// Begin accepts only this version for a replay: an operator who resolves
	// a record of the middleware as completed stores it under this version.
	HTTPSchemaVersion = "idemcoord.http/1"
	// DefaultHTTPScope is the one scope every record of the middleware had
	// before the default became the operation (see WithHTTPService).
	// WithHTTPScope(DefaultHTTPScope) keeps that behaviour, and the records
	// stored under it readable after an upgrade.
	DefaultHTTPScope = "http"
)

// Problem types (RFC 9457) of the application/problem+json answers that
// HTTPMiddleware writes itself.
const (
	// ProblemKeyMissing (400): WithHTTPRequireKey is set and the request
	// has no Idempotency-Key.
	ProblemKeyMissing = "urn:idemcoord:problem:idempotency-key-missing"
	// ProblemKeyInvalid (400): the Idempotency-Key is not 1-255 printable
	// bytes, bare or as a structured-field string, or appears twice.
	ProblemKeyInvalid = "urn:idemcoord:problem:idempotency-key-invalid"
	// ProblemKeyReused (422, or 409 with WithHTTPMismatchStatus): the key
	// was first used with another request (method, path or body; see
	// WithHTTPFingerprintFunc).
	ProblemKeyReused = "urn:idemcoord:problem:idempotency-key-reused"
	// ProblemKeyExpired (422): the key's stored result has expired and the
	// coordinator's policy (on_expired: reject) refuses to run it again.
	ProblemKeyExpired = "urn:idemcoord:problem:idempotency-key-expired"
	// ProblemAttemptsExhausted (422): the key failed as many times as the
	// coordinator's policy (max_attempts) allows.
	ProblemAttemptsExhausted = "urn:idemcoord:problem:idempotency-attempts-exhausted"
	// ProblemInProgress (409, with Retry-After): another request with the
	// key is still running; retry after the given seconds.
	ProblemInProgress = "urn:idemcoord:problem:idempotency-request-in-progress"
	// ProblemOutcomeUnknown (409): an earlier request with the key may or
	// may not have taken effect, and the key is held for an operator
	// (policy on_unknown: hold). Retrying does not help.
	ProblemOutcomeUnknown = "urn:idemcoord:problem:idempotency-outcome-unknown"
	// ProblemBodyTooLarge (413): the request body exceeds
	// WithHTTPMaxBodyBytes.
	ProblemBodyTooLarge = "urn:idemcoord:problem:request-body-too-large"
	// ProblemUnavailable (503, with Retry-After): the idempotency
	// coordinator cannot be reached; the handler did not run.
	ProblemUnavailable = "urn:idemcoord:problem:idempotency-coordinator-unavailable"
	// ProblemLeaseLost (503, with Retry-After): the request's hold on its
	// key was lost while the handler ran (another request took the key
	// over, or an operator forgot or resolved the record) and the handler
	// had written nothing; nothing was stored for this request. Retry with
	// the same Idempotency-Key to get the outcome of the request that
	// holds the key now. (Its last segment, /lease-lost, names it in every
	// library.)
	ProblemLeaseLost = "urn:idemcoord:problem:idempotency/lease-lost"
	// ProblemInternal (500): the coordinator refused the service's call
	// (bad credentials, say): the service's problem, not the client's.
	ProblemInternal = "urn:idemcoord:problem:idempotency-coordinator-refused"
)

const (
	defaultHTTPWait         = 5 * time.Second
	defaultHTTPMaxBodyBytes = 10 << 20
	// maxCapturedBody bounds the response body the middleware keeps for
	// storage (the coordinator's largest message); a larger response is
	// answered but recorded UNKNOWN.
	maxCapturedBody = 4 << 20
)

// HTTPOption configures HTTPMiddleware.
type HTTPOption func(*httpOptions)

// HTTPPrincipalFunc returns the end user a request acts for.
type HTTPPrincipalFunc func(r *http.Request) (string, error)

// HTTPFingerprintFunc returns the fingerprint of a request (at most 64
// bytes; empty skips the check) from the request and its whole body.
type HTTPFingerprintFunc func(r *http.Request, body []byte) ([]byte, error)

// HTTPKeyFunc returns the idempotency key of a request that has no
// Idempotency-Key header, from the request and its whole body; "" means
// the request has no key. See WithHTTPKeyFunc.
type HTTPKeyFunc func(r *http.Request, body []byte) (string, error)

type httpOptions struct {
	wait          time.Duration
	requireKey    bool
	failOpen      bool
	principal     HTTPPrincipalFunc
	principalSet  bool // WithHTTPPrincipal or WithoutHTTPPrincipal was given
	methods       map[string]bool
	fingerprint   HTTPFingerprintFunc
	keyFunc       HTTPKeyFunc
	replayHeaders []string // canonical names, Content-Type handled apart
	replayable    map[int]bool
	scope         string // "": the operation's (httpOperationScope)
	service       string
	maxBody       int64
	// Callers' options (callers_answers.go).
	replayHook            httpReplayHook
	mismatchStatus        int
	refusedMismatchStatus int // a WithHTTPMismatchStatus that was not taken
}

func defaultHTTPOptions() httpOptions {
	return httpOptions{
		wait:          defaultHTTPWait,
		methods:       map[string]bool{http.MethodPost: true, http.MethodPatch: true},
		fingerprint:   func(r *http.Request, body []byte) ([]byte, error) { return HTTPFingerprint(r, body), nil },
		replayHeaders: []string{"Location"},
		replayable:    map[int]bool{http.StatusNotFound: true, http.StatusConflict: true, http.StatusUnprocessableEntity: true},
		maxBody:       defaultHTTPMaxBodyBytes,

		mismatchStatus: http.StatusUnprocessableEntity,
	}
}

// WithHTTPWait sets how long a request whose key another request holds
// waits for that request's result before it answers 409 with Retry-After
// (default 5 s; 0 answers at once). It holds no lock while it waits.
func WithHTTPWait(d time.Duration) HTTPOption {
	return func(o *httpOptions) { o.wait = max(d, 0) }
}

// WithHTTPRequireKey makes a guarded request without an Idempotency-Key
// fail with 400 (ProblemKeyMissing). By default it runs the handler
// unprotected.
func WithHTTPRequireKey() HTTPOption {
	return func(o *httpOptions) { o.requireKey = true }
}

// WithHTTPFailOpen runs the handler unprotected when the coordinator
// cannot be reached at the start of a request (Begin still answers
// UNAVAILABLE or DEADLINE_EXCEEDED after the Client's retries). Only such
// transport failures open: a refusal by the coordinator, its rate limit
// included, never does. AttemptFrom then reports ok = false. By default the request fails closed with 503
// (ProblemUnavailable) and the handler does not run.
func WithHTTPFailOpen() HTTPOption {
	return func(o *httpOptions) { o.failOpen = true }
}

// WithHTTPPrincipal folds the principal that f returns (the end user's id,
// for instance) into every key with FoldPrincipal, so two end users who
// send the same key never share a record. Install the middleware after the
// authentication that f relies on. An error from f answers 400. The folded
// key must stay within 255 bytes, so keys are then at most 211 bytes.
//
// Whom a key belongs to is a decision, not a default: HTTPMiddleware logs a
// warning through its Client's logger when it is built with neither
// WithHTTPPrincipal nor WithoutHTTPPrincipal.
func WithHTTPPrincipal(f HTTPPrincipalFunc) HTTPOption {
	return func(o *httpOptions) { o.principal, o.principalSet = f, true }
}

// WithoutHTTPPrincipal says on purpose that keys are not per end user:
// every request with the same Idempotency-Key (and request) shares one
// record, whoever sends it (a service with one caller, or keys already
// unique per user). It is the explicit opposite of WithHTTPPrincipal and
// silences the warning HTTPMiddleware logs when neither is given.
func WithoutHTTPPrincipal() HTTPOption {
	return func(o *httpOptions) { o.principal, o.principalSet = nil, true }
}

// WithHTTPMethods sets the HTTP methods the middleware guards (default
// POST and PATCH); requests with other methods pass through untouched.
func WithHTTPMethods(methods ...string) HTTPOption {
	return func(o *httpOptions) {
		o.methods = make(map[string]bool, len(methods))
		for _, m := range methods {
			o.methods[strings.ToUpper(m)] = true
		}
	}
}

// WithHTTPFingerprintFunc sets how a request is fingerprinted (default
// HTTPFingerprint: method, path with query, and body), for requests with
// parts that vary between retries (a timestamp in the body, say). A key
// reused with a request of another fingerprint answers 422
// (ProblemKeyReused). An error from f answers 400.
func WithHTTPFingerprintFunc(f HTTPFingerprintFunc) HTTPOption {
	return func(o *httpOptions) { o.fingerprint = f }
}

// WithHTTPKeyFunc takes the key of a request that sends no Idempotency-Key
// header from the request itself, as f returns it (a field of the payload,
// say: an order id or a message id); an Idempotency-Key header, when sent,
// always wins. The returned key is used as a header's would be: it must be
// 1-255 bytes of UTF-8 without control characters (else 400,
// ProblemKeyInvalid), it is echoed in the Idempotency-Key answer header,
// and it is folded with WithHTTPPrincipal. f returning "" means no key:
// the handler runs unprotected, or the answer is 400 with
// WithHTTPRequireKey. f returning an error answers 400 (ProblemKeyInvalid)
// and runs nothing. With f set, the body of every guarded request without
// the header is read whole (up to WithHTTPMaxBodyBytes) before f is called,
// and handed to the handler as it was.
func WithHTTPKeyFunc(f HTTPKeyFunc) HTTPOption {
	return func(o *httpOptions) { o.keyFunc = f }
}

// WithHTTPReplayHeaders adds response headers that are stored and replayed,
// besides Content-Type and Location. Other headers the handler sets reach
// the first response only.
func WithHTTPReplayHeaders(names ...string) HTTPOption {
	return func(o *httpOptions) {
		for _, n := range names {
			if c := http.CanonicalHeaderKey(n); c != "Content-Type" {
				o.replayHeaders = append(o.replayHeaders, c)
			}
		}
	}
}

// WithHTTPReplayableStatuses sets the 4xx statuses that are business
// answers to store and replay like a success (default 404, 409 and 422;
// see HTTPMiddleware for the others).
func WithHTTPReplayableStatuses(statuses ...int) HTTPOption {
	return func(o *httpOptions) {
		o.replayable = make(map[int]bool, len(statuses))
		for _, s := range statuses {
			o.replayable[s] = true
		}
	}
}

// WithHTTPScope sets one scope for all the middleware's records, in place
// of the default: the operation, the request's method and URL path
// ("POST /orders", prefixed by WithHTTPService's name). A key is then one
// record whatever the route it is sent to (a key reused on another route
// answers 422, ProblemKeyReused). WithHTTPScope(DefaultHTTPScope) keeps the
// scope of earlier versions. With auth on, the service's tenant must be
// allowed the scope.
func WithHTTPScope(scope string) HTTPOption {
	return func(o *httpOptions) { o.scope = scope }
}

// WithHTTPService names the service: the default scope of a record, the
// operation "POST /orders", becomes "payments POST /orders", so two
// services that share a coordinator and a tenant never share records.
// Without WithHTTPService or WithHTTPScope, HTTPMiddleware logs a warning
// when it is built: a service should name itself or run under its own
// tenant (token).
func WithHTTPService(name string) HTTPOption {
	return func(o *httpOptions) { o.service = name }
}

// maxHTTPScopeBytes is the longest scope the coordinator takes.
const maxHTTPScopeBytes = 255

// scopeOf is the scope of r's record: WithHTTPScope's, else
// HTTPOperationScope's.
func (o *httpOptions) scopeOf(r *http.Request) string {
	if o.scope != "" {
		return o.scope
	}
	return HTTPOperationScope(o.service, r.Method, r.URL.EscapedPath())
}

// HTTPOperationScope is HTTPMiddleware's default scope of a request with
// method and path (as sent, percent-encoded, without the query), for the
// service named with WithHTTPService ("" for none): "POST /orders", or
// "payments POST /orders". A scope longer than 255 bytes is its first 190
// bytes (never cutting a UTF-8 sequence), "~", and the unpadded base64url
// SHA-256 of the whole. Every library computes it the same way.
func HTTPOperationScope(service, method, path string) string {
	s := method + " " + path
	if service != "" {
		s = service + " " + s
	}
	if len(s) <= maxHTTPScopeBytes {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	cut := 190
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "~" + base64.RawURLEncoding.EncodeToString(sum[:])
}

// WithHTTPMaxBodyBytes bounds the body of a request with a key, which the
// middleware reads whole to fingerprint it (default 10 MiB); a larger one
// answers 413 (ProblemBodyTooLarge) without running the handler.
func WithHTTPMaxBodyBytes(n int64) HTTPOption {
	return func(o *httpOptions) { o.maxBody = n }
}

// HTTPFingerprint is the middleware's default request fingerprint: the
// SHA-256 of the method, a newline, the request URI (path and query, as
// sent), a newline, and the body.
func HTTPFingerprint(r *http.Request, body []byte) []byte {
	h := sha256.New()
	h.Write([]byte(r.Method))
	h.Write([]byte{'\n'})
	h.Write([]byte(r.URL.RequestURI()))
	h.Write([]byte{'\n'})
	h.Write(body)
	return h.Sum(nil)
}

// HTTPMiddleware makes the handlers of a net/http service idempotent
// through the coordinator that c calls, following the IETF
// Idempotency-Key draft. It works with any router that takes standard
// middleware.
//
// A guarded request (POST or PATCH unless WithHTTPMethods) with an
// Idempotency-Key header (1-255 printable bytes, bare or as a
// structured-field string such as "\"8e03978e\"") calls Begin on the scope
// of its operation, "POST /orders" (see HTTPOperationScope, WithHTTPService
// and WithHTTPScope), with the key (folded with WithHTTPPrincipal) and the
// request's fingerprint (method, path with query, body; see
// WithHTTPFingerprintFunc), and then:
//
//   - acquired: runs the handler (which can read AttemptFrom and LeaseFrom
//     from r.Context(), and calls MarkSideEffect before its first
//     irreversible step), heartbeating while it runs, and passes its
//     response through to the client as it is written, keeping a copy. The
//     handler's context is cancelled (cause ErrLeaseUnconfirmed) when no
//     heartbeat can confirm the lease before it would run out by the local
//     clock, and when the lease cannot be confirmed before the handler
//     starts (after a long wait), the handler does not run and the answer
//     is 503. The response is recorded by its status:
//     2xx and 3xx are stored (status, Content-Type, Location and the headers of
//     WithHTTPReplayHeaders, and the body) and answered with
//     "Idempotency-Result: created"; 404, 409 and 422 (see
//     WithHTTPReplayableStatuses) are stored FAILED_REPLAYABLE and
//     answered the same way; other 4xx (400, 401, 403, 429, …) leave no
//     record, so the client may fix the request and retry with the key;
//     503 is RETRYABLE (nothing happened: the next request runs the
//     handler); other 5xx are UNKNOWN (the side effect may have happened:
//     the next request runs the handler with AttemptFrom's previous state
//     STATE_UNKNOWN, or gets 409 under on_unknown: hold). After
//     MarkSideEffect, every response that is not stored is recorded
//     UNKNOWN; the stored ones (2xx and 3xx and the replayable statuses, which
//     are the handler's definitive answers) are stored as before. A
//     panicking handler is recorded UNKNOWN and the panic goes on. If Complete or
//     Fail cannot reach the coordinator it is retried in the background
//     for up to one lease (see Client.Shutdown);
//   - replay: answers the stored status, headers and body byte for byte
//     (or what WithHTTPReplayHook makes of them), with "Idempotency-Result:
//     replayed" and "Idempotent-Replayed: true", without calling the
//     handler. Created and replayed answers carry Idempotency-Expires
//     (see HTTPExpiresHeader);
//   - another request holds the key: waits for its result up to 5 s
//     (WithHTTPWait), then answers 409 with Retry-After
//     (ProblemInProgress); a key held UNKNOWN for an operator answers 409
//     (ProblemOutcomeUnknown);
//   - the key was first used with another request: 422 (ProblemKeyReused;
//     409 with WithHTTPMismatchStatus);
//     the coordinator's other refusals: 422 ProblemKeyExpired or
//     ProblemAttemptsExhausted, 400 for a key it finds invalid;
//   - the coordinator cannot be reached (after c's retries): 503 with
//     Retry-After (ProblemUnavailable) and the handler does not run,
//     unless WithHTTPFailOpen.
//
// A client that gives up (it times out, disconnects) never strands a key,
// and no success is claimed for work not done:
//
//   - before the handler runs: when the request's context ends while Begin
//     is in flight or while the middleware waits, or after Begin acquired
//     the key but before the handler starts, the handler does not run and
//     the middleware releases the acquisition before it returns: it sends
//     Begin again with the same attempt_id on a context detached from the
//     request (bounded by a few seconds) and ends what that acquires with
//     Fail ABANDONED, reason ReleaseReason. The key is then as if the
//     request never came (absent if it was new, otherwise as before; the
//     released attempt does not count against max_attempts), so the
//     client's retry runs the handler at once. A Begin that fails without a
//     readable answer is released the same way, in the background. Only
//     when the coordinator cannot be reached for the release does the lease
//     lapse (UNKNOWN);
//   - a handler that returns without writing anything after its request's
//     context ended (the client went away, or the lease could not be
//     confirmed) is never taken for a 200: nothing is stored, the attempt
//     is recorded RETRYABLE (UNKNOWN after MarkSideEffect), so the retry
//     runs the handler again, and the answer is 503 with Retry-After;
//   - when the lease is lost while the handler runs (another request took
//     the key over, an operator resolved or forgot the record) nothing is
//     stored; if the handler has written nothing, the answer is 503
//     application/problem+json with Retry-After (ProblemLeaseLost), never a
//     2xx and never "Idempotency-Result: created". What a handler already
//     wrote has gone to the client as written.
//
// The handler writes through a wrapper with exactly the optional
// interfaces of the server's writer (http.Flusher, http.Hijacker,
// io.ReaderFrom, …); a handler that hijacks the connection is recorded
// UNKNOWN, since what it sends there is not seen.
//
// Every answer to a request with a key echoes it in the Idempotency-Key
// response header. Answers the middleware writes itself are
// application/problem+json (RFC 9457). A guarded request without an
// Idempotency-Key header takes its key from WithHTTPKeyFunc when set; one
// without a key runs the handler unprotected, or answers 400 with
// WithHTTPRequireKey; other methods pass through.
func HTTPMiddleware(c *Client, opts ...HTTPOption) func(http.Handler) http.Handler {
	o := defaultHTTPOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if !o.principalSet {
		c.warnUndecidedPrincipal("HTTPMiddleware", "WithHTTPPrincipal", "WithoutHTTPPrincipal")
	}
	if o.scope == "" && o.service == "" {
		c.logger.Warn("idempotency: HTTPMiddleware built without WithHTTPService or WithHTTPScope: its records' scope is " +
			"the operation alone (\"POST /orders\"), the same for every service that shares the coordinator's tenant; " +
			"name the service with WithHTTPService, or give each service a tenant (token) of its own")
	}
	if o.refusedMismatchStatus != 0 {
		c.logger.Warn("idempotency: WithHTTPMismatchStatus takes 409 or 422 only; ignoring it",
			"status", o.refusedMismatchStatus, "in_force", o.mismatchStatus)
	}
	return func(next http.Handler) http.Handler {
		return &httpMiddleware{c: c, o: o, next: next}
	}
}

type httpMiddleware struct {
	c    *Client
	o    httpOptions
	next http.Handler
}

func (m *httpMiddleware) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !m.o.methods[r.Method] {
		m.next.ServeHTTP(w, r)
		return
	}
	raw := r.Header.Values(HTTPKeyHeader)
	var (
		key, echo string
		body      []byte
		bodyRead  bool
	)
	switch {
	case len(raw) > 1:
		writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency-Key is invalid",
			"send one Idempotency-Key header")
		return
	case len(raw) == 1:
		k, err := ParseIdempotencyKey(raw[0])
		if err != nil {
			writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency-Key is invalid", err.Error())
			return
		}
		key, echo = k, raw[0]
	case m.o.keyFunc != nil:
		if body, bodyRead = m.readBody(w, r); !bodyRead {
			return
		}
		k, err := m.o.keyFunc(r, body)
		r.Body = io.NopCloser(bytes.NewReader(body)) // the function may have read it
		if err != nil {
			writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency key is invalid",
				"the idempotency key could not be taken from the request: "+err.Error())
			return
		}
		if k != "" {
			if err := checkKey(k); err != nil {
				writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency key is invalid",
					"the idempotency key taken from the request "+err.Error())
				return
			}
			key, echo = k, k
		}
	}
	if key == "" {
		if m.o.requireKey {
			writeProblem(w, http.StatusBadRequest, ProblemKeyMissing, "Idempotency-Key is missing",
				"this request requires an Idempotency-Key header")
			return
		}
		m.next.ServeHTTP(w, r)
		return
	}
	w.Header().Set(HTTPKeyHeader, echo)
	if m.o.principal != nil {
		p, err := m.o.principal(r)
		if err != nil {
			writeProblem(w, http.StatusBadRequest, "about:blank", "Bad Request", "idempotency principal: "+err.Error())
			return
		}
		key = FoldPrincipal(p, key)
	}
	if !bodyRead {
		if body, bodyRead = m.readBody(w, r); !bodyRead {
			return
		}
	}
	fp, err := m.o.fingerprint(r, body)
	if err != nil {
		writeProblem(w, http.StatusBadRequest, "about:blank", "Bad Request", "idempotency fingerprint: "+err.Error())
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body)) // the function may have read it

	ctx := r.Context()
	breq := &idempotencyv1.BeginRequest{
		Scope:                m.o.scopeOf(r),
		Key:                  key,
		Fingerprint:          fp,
		Lease:                m.c.leaseRequest(),
		AcceptSchemaVersions: []string{HTTPSchemaVersion},
		AttemptId:            newAttemptID(),
	}
	res, sent, err := m.c.beginWaiting(ctx, breq, time.Now().Add(m.o.wait))
	if err != nil {
		m.beginFailed(w, r, err)
		return
	}
	switch res.GetOutcome() {
	case idempotencyv1.Outcome_OUTCOME_ACQUIRED:
		m.run(w, r, m.c.newLease(breq, res, sent), toldTTL{ttl: res.GetTtl(), failureTTL: res.GetFailureTtl()})
		return
	case idempotencyv1.Outcome_OUTCOME_REPLAY:
		m.replayStoredHTTP(w, r, res.GetRecord())
		return
	}
	if res.GetRecord().GetState() == idempotencyv1.State_STATE_UNKNOWN {
		writeProblem(w, http.StatusConflict, ProblemOutcomeUnknown, "Outcome of an earlier request unknown",
			"an earlier request with this Idempotency-Key may or may not have taken effect; it is held for an operator, and retrying does not help")
		return
	}
	retryAfter := res.GetRetryAfter().AsDuration()
	w.Header().Set("Retry-After", retryAfterSeconds(retryAfter))
	writeProblem(w, http.StatusConflict, ProblemInProgress, "Request in progress",
		fmt.Sprintf("another request with this Idempotency-Key is in progress; retry after %v", retryAfter))
}

// beginFailed answers a Begin that failed.
func (m *httpMiddleware) beginFailed(w http.ResponseWriter, r *http.Request, err error) {
	ctx := r.Context()
	if ctx.Err() != nil {
		// The client has gone; what is written here reaches no one.
		writeProblem(w, http.StatusServiceUnavailable, ProblemUnavailable, "Request cancelled", ctx.Err().Error())
		return
	}
	st := status.Convert(err)
	switch {
	case transportFailure(err):
		if m.o.failOpen {
			m.c.logger.WarnContext(ctx, "idempotency: coordinator unreachable; running the handler unprotected (fail open)", "err", err)
			m.next.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Retry-After", "1")
		writeProblem(w, http.StatusServiceUnavailable, ProblemUnavailable, "Idempotency coordinator unavailable",
			"the request was not processed; retry later with the same Idempotency-Key")
		return
	case st.Code() == codes.ResourceExhausted:
		// The coordinator's rate limit: an answer, not an outage, so it
		// never fails open.
		w.Header().Set("Retry-After", "1")
		writeProblem(w, http.StatusServiceUnavailable, ProblemUnavailable, "Idempotency coordinator busy",
			"the request was not processed; retry later with the same Idempotency-Key")
		return
	case st.Code() == codes.FailedPrecondition:
		switch errorReason(err) {
		case idempotencyv1.ErrorReason_ERROR_REASON_FINGERPRINT_MISMATCH, idempotencyv1.ErrorReason_ERROR_REASON_SCHEMA_VERSION_NOT_ACCEPTED:
			writeProblem(w, m.o.mismatchStatus, ProblemKeyReused, "Idempotency-Key reused",
				"this Idempotency-Key was first used with another request")
			return
		case idempotencyv1.ErrorReason_ERROR_REASON_KEY_EXPIRED:
			writeProblem(w, http.StatusUnprocessableEntity, ProblemKeyExpired, "Idempotency-Key expired",
				"the result stored for this Idempotency-Key has expired and the key may not be used again")
			return
		case idempotencyv1.ErrorReason_ERROR_REASON_ATTEMPTS_EXHAUSTED:
			writeProblem(w, http.StatusUnprocessableEntity, ProblemAttemptsExhausted, "Idempotency-Key attempts exhausted",
				"requests with this Idempotency-Key failed as many times as allowed")
			return
		}
	case st.Code() == codes.InvalidArgument:
		writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency-Key is invalid", st.Message())
		return
	}
	m.c.logger.ErrorContext(ctx, "idempotency: coordinator refused Begin", "err", err)
	writeProblem(w, http.StatusInternalServerError, ProblemInternal, "Internal Server Error",
		"the idempotency coordinator refused the call")
}

// run runs the handler under the acquired lease and records its response.
func (m *httpMiddleware) run(w http.ResponseWriter, r *http.Request, l *lease, exp toldTTL) {
	ctx := r.Context()
	rec := &httpRecorder{w: w, m: m, expiry: exp}
	hw := rec.snoop()
	// silenced is why the handler's context ended, when it returned after
	// that without writing anything.
	var silenced error
	end := l.run(ctx, func(ctx context.Context) {
		m.next.ServeHTTP(hw, r.WithContext(ctx))
		if !rec.wrote && ctx.Err() != nil {
			silenced = context.Cause(ctx)
		}
	})
	switch end {
	case runCallerGone:
		_ = l.release(ctx)
		// The client has gone; what is written here reaches no one.
		writeProblem(w, http.StatusServiceUnavailable, ProblemUnavailable, "Request cancelled", ctx.Err().Error())
		return
	case runNotStarted:
		_ = l.finish(ctx, ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED,
			reason: "the lease could not be confirmed before the handler started"})
		w.Header().Set("Retry-After", "1")
		writeProblem(w, http.StatusServiceUnavailable, ProblemUnavailable, "Idempotency coordinator unavailable",
			"the request was not processed; retry later with the same Idempotency-Key")
		return
	case runLost:
		m.c.logger.WarnContext(ctx, "idempotency: lease lost while the handler ran; its response is not stored",
			"scope", l.scope, "key", l.key, "status", rec.status)
		if !rec.wrote {
			// Nothing was done or stored for this request: never a 2xx.
			w.Header().Set("Retry-After", "1")
			writeProblem(w, http.StatusServiceUnavailable, ProblemLeaseLost, "Idempotency key taken over",
				"this request lost its hold on the Idempotency-Key before it answered, and nothing was stored for it; "+
					"retry with the same Idempotency-Key to get the outcome")
		}
		return
	}
	if !rec.wrote && silenced != nil {
		// The handler gave up without a word once its context ended (the
		// client went away, or the lease could not be confirmed): no
		// success is claimed for work not done.
		e := ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE,
			reason: failReason("the handler wrote no response after its request ended: " + silenced.Error())}
		if l.marked() {
			e.kind, e.reason = idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, failReason(e.reason+" (after MarkSideEffect)")
		}
		_ = l.finish(ctx, e)
		w.Header().Set("Retry-After", "1")
		if errors.Is(silenced, ErrLeaseUnconfirmed) {
			writeProblem(w, http.StatusServiceUnavailable, ProblemUnavailable, "Idempotency coordinator unavailable",
				"the request was not completed; retry later with the same Idempotency-Key")
			return
		}
		writeProblem(w, http.StatusServiceUnavailable, "about:blank", "Service Unavailable",
			"the request ended before the handler answered; retry with the same Idempotency-Key")
		return
	}
	if rec.hijacked {
		// The handler took the connection over: what it sent there is
		// neither seen nor stored, and may have done anything.
		_ = l.finish(ctx, ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN,
			reason: "the handler took over the connection (Hijack)"})
		return
	}
	if !rec.wrote {
		rec.WriteHeader(http.StatusOK)
	}
	_ = l.finish(ctx, m.ending(rec, l.marked()))
}

// ending is how a handler's response is recorded. After MarkSideEffect,
// a response that is not stored (see stores) is recorded UNKNOWN.
func (m *httpMiddleware) ending(rec *httpRecorder, marked bool) ending {
	reason := fmt.Sprintf("HTTP %d %s", rec.status, http.StatusText(rec.status))
	kind := m.kind(rec.status)
	switch {
	case rec.overflow && (kind == idempotencyv1.FailureKind_FAILURE_KIND_UNSPECIFIED || kind == idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE):
		return ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN,
			reason: reason + ": response body too large to store"}
	case kind == idempotencyv1.FailureKind_FAILURE_KIND_UNSPECIFIED:
		return ending{complete: rec.stored()}
	case kind == idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE:
		return ending{kind: kind, response: rec.stored(), reason: reason}
	case marked:
		return ending{kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN, reason: reason + " after MarkSideEffect"}
	}
	return ending{kind: kind, reason: reason}
}

// kind classifies a final status (2xx-5xx; the recorder passes 1xx through):
// UNSPECIFIED means stored as a success.
func (m *httpMiddleware) kind(status int) idempotencyv1.FailureKind {
	switch {
	case status < 400:
		return idempotencyv1.FailureKind_FAILURE_KIND_UNSPECIFIED
	case m.o.replayable[status]:
		return idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE
	case status < 500:
		return idempotencyv1.FailureKind_FAILURE_KIND_ABANDONED
	case status == http.StatusServiceUnavailable:
		return idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE
	}
	return idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN
}

// stores reports whether a response with status is stored (and so
// answered "created").
func (m *httpMiddleware) stores(status int) bool {
	k := m.kind(status)
	return k == idempotencyv1.FailureKind_FAILURE_KIND_UNSPECIFIED || k == idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE
}

// httpRecorder passes the handler's response through and keeps a copy of
// what is stored: the status, the replayed headers as they were when the
// status was written, and the body.
type httpRecorder struct {
	w        http.ResponseWriter
	m        *httpMiddleware
	wrote    bool
	status   int
	header   http.Header
	body     bytes.Buffer
	overflow bool
	expiry   toldTTL // for Idempotency-Expires
	hijacked bool
}

// Header returns the response's header map.
func (rec *httpRecorder) Header() http.Header { return rec.w.Header() }

// WriteHeader records and sends the status; informational (1xx) statuses
// pass through unrecorded.
func (rec *httpRecorder) WriteHeader(status int) {
	if rec.wrote || status < 200 {
		rec.w.WriteHeader(status)
		return
	}
	rec.wrote, rec.status = true, status
	h := rec.w.Header()
	rec.header = http.Header{}
	for _, name := range append([]string{"Content-Type"}, rec.m.o.replayHeaders...) {
		if v := h.Values(name); len(v) > 0 {
			rec.header[name] = append([]string(nil), v...)
		}
	}
	if rec.m.stores(status) {
		h.Set(HTTPResultHeader, resultCreated)
		setHTTPExpires(h, rec.expiry.expiresAt(time.Now(), rec.m.kind(status) == idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE))
	} else {
		h.Del(HTTPResultHeader)
		h.Del(HTTPExpiresHeader)
	}
	rec.w.WriteHeader(status)
}

// Write sends p and keeps a copy.
func (rec *httpRecorder) Write(p []byte) (int, error) {
	if !rec.wrote {
		rec.WriteHeader(http.StatusOK)
	}
	if !rec.overflow {
		if rec.body.Len()+len(p) > maxCapturedBody {
			rec.overflow = true
			rec.body = bytes.Buffer{}
		} else {
			rec.body.Write(p)
		}
	}
	return rec.w.Write(p)
}

// stored is the response to store.
func (rec *httpRecorder) stored() *idempotencyv1.StoredResponse {
	resp := &idempotencyv1.StoredResponse{SchemaVersion: HTTPSchemaVersion, StatusCode: int32(rec.status), //nolint:gosec // an HTTP status code has three digits (net/http refuses others)
		Body: bytes.Clone(rec.body.Bytes())}
	for name, values := range rec.header {
		if name == "Content-Type" {
			resp.ContentType = strings.Join(values, ", ")
			continue
		}
		if resp.Metadata == nil {
			resp.Metadata = map[string]string{}
		}
		resp.Metadata[name] = strings.Join(values, "\n")
	}
	return resp
}

// replayHTTP answers a stored response.
func replayHTTP(w http.ResponseWriter, resp *idempotencyv1.StoredResponse) {
	h := w.Header()
	if ct := resp.GetContentType(); ct != "" {
		h.Set("Content-Type", ct)
	}
	for name, v := range resp.GetMetadata() {
		h[http.CanonicalHeaderKey(name)] = strings.Split(v, "\n")
	}
	h.Set(HTTPResultHeader, resultReplayed)
	h.Set(HTTPReplayedHeader, "true")
	h.Set("Content-Length", strconv.Itoa(len(resp.GetBody())))
	code := int(resp.GetStatusCode())
	if code < 200 || code > 999 {
		code = http.StatusOK
	}
	w.WriteHeader(code)
	_, _ = w.Write(resp.GetBody())
}

// readBody reads r's whole body, up to WithHTTPMaxBodyBytes, and puts it
// back for the handler; it answers 413 or 400 itself and reports false when
// the body cannot be read.
func (m *httpMiddleware) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.o.maxBody))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeProblem(w, http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Request body too large",
				fmt.Sprintf("a request with an Idempotency-Key may have at most %d bytes of body", m.o.maxBody))
			return nil, false
		}
		writeProblem(w, http.StatusBadRequest, "about:blank", "Bad Request", "reading the request body: "+err.Error())
		return nil, false
	}
	_ = r.Body.Close()
	r.Body = io.NopCloser(bytes.NewReader(body))
	return body, true
}

// ParseIdempotencyKey returns the key of an Idempotency-Key header value:
// the value itself, or the content of a structured-field string (RFC 8941:
// quoted, with \" and \\ escapes). The key must be 1-255 bytes of valid
// UTF-8 without control characters.
func ParseIdempotencyKey(value string) (string, error) {
	v := strings.Trim(value, " \t")
	if len(v) >= 2 && v[0] == '"' {
		item, err := httpsfv.UnmarshalItem([]string{v})
		if err != nil {
			return "", errors.New("Idempotency-Key: not a valid structured-field string (printable ASCII in quotes, escaping only \\\" and \\\\)")
		}
		str, ok := item.Value.(string)
		if !ok || len(item.Params.Names()) > 0 {
			return "", errors.New("Idempotency-Key: a quoted key must be a structured-field string without parameters")
		}
		v = str
	}
	if err := checkKey(v); err != nil {
		return "", fmt.Errorf("Idempotency-Key %w", err)
	}
	return v, nil
}

// checkKey checks what every key must be: 1-255 bytes of UTF-8 without
// control characters. Its errors read after the key's name.
func checkKey(v string) error {
	switch {
	case v == "":
		return errors.New("is empty")
	case len(v) > 255:
		return fmt.Errorf("is %d bytes long, more than 255", len(v))
	case !utf8.ValidString(v):
		return errors.New("is not valid UTF-8")
	case strings.IndexFunc(v, unicode.IsControl) >= 0:
		return errors.New("holds a control character")
	}
	return nil
}

// writeProblem answers an RFC 9457 problem.
func writeProblem(w http.ResponseWriter, status int, typ, title, detail string) {
	body, _ := json.Marshal(struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail,omitempty"`
	}{typ, title, status, detail})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)+1))
	h.Del(HTTPResultHeader)
	h.Del(HTTPExpiresHeader)
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// retryAfterSeconds renders d as a Retry-After value: whole seconds, at
// least 1.
func retryAfterSeconds(d time.Duration) string {
	return strconv.FormatInt(max(int64(math.Ceil(d.Seconds())), 1), 10)
}
