package console

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Prefix is the path under which the console serves its pages. Mount a
// Console at it: mux.Handle(console.Prefix, c).
const Prefix = "/console/"

const (
	// sessionCookie holds the random id of the operator's session
	// (base64url), set by the login form; never the token.
	sessionCookie = "idemcoord_console_session"
	// csrfCookie holds the random token that every form must echo.
	csrfCookie = "idemcoord_console_csrf"
	// tenantHeader is the response header of server.AdminConn naming the
	// caller's tenant (server.TenantHeader).
	tenantHeader = "idemcoord-tenant"
	// maxTokenBytes bounds a bearer token typed into the login form.
	maxTokenBytes = 4096
)

// MaxFormBytes bounds a form the console takes: a resolved response's
// body (the server's limit, max_response_bytes, is 1 MiB by default) plus
// the other fields. A listener that serves the console lets its requests'
// bodies be this large.
const MaxFormBytes = 2 << 20

//go:embed templates/*.html static/style.css
var files embed.FS

// Counters are the server's counters the console charts, as running
// totals since the process started (server.(*Server).CounterTotals).
type Counters struct {
	// Acquired, Replayed and InProgress count Begin answers by outcome.
	Acquired, Replayed, InProgress float64
	// UnknownEntered counts records entering UNKNOWN.
	UnknownEntered float64
}

// Option configures a Console.
type Option func(*options)

type options struct {
	logger      *slog.Logger
	counters    func() Counters
	sampleEvery time.Duration
	sessions    SessionStore
	sessionIdle time.Duration
	sessionTTL  time.Duration
}

// WithLogger sets where the console writes each operator action (with the
// operator's tenant) and refused requests. Default: discard.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// WithCounters gives the console the server's counters to chart over the
// last hour. Without it the dashboard shows no chart.
func WithCounters(f func() Counters) Option { return func(o *options) { o.counters = f } }

// WithSampleInterval sets how often Run samples the counters (default one
// minute); the chart shows the last 60 intervals.
func WithSampleInterval(d time.Duration) Option { return func(o *options) { o.sampleEvery = d } }

// WithSessions sets where the console keeps the sessions of operators who
// sign in with a bearer token. Without it, signing in with a token is
// refused (a client certificate, or auth disabled, needs no session).
func WithSessions(s SessionStore) Option { return func(o *options) { o.sessions = s } }

// WithSessionTTL sets how long a session lasts after sign-in, used or not
// (default 12 hours).
func WithSessionTTL(d time.Duration) Option { return func(o *options) { o.sessionTTL = d } }

// WithSessionIdleTimeout sets how long a session lasts without use
// (default 30 minutes).
func WithSessionIdleTimeout(d time.Duration) Option { return func(o *options) { o.sessionIdle = d } }

// Console is the operator console: an http.Handler for the paths under
// Prefix.
type Console struct {
	admin   idempotencyv1.AdminClient
	opts    options
	pages   map[string]*template.Template
	handler http.Handler
	ring    *ring
}

// New returns a console that calls the Admin service over conn, as each
// request's operator.
func New(conn grpc.ClientConnInterface, opts ...Option) *Console {
	o := options{logger: slog.New(slog.DiscardHandler), sampleEvery: time.Minute, sessionIdle: 30 * time.Minute, sessionTTL: 12 * time.Hour}
	for _, opt := range opts {
		opt(&o)
	}
	c := &Console{admin: idempotencyv1.NewAdminClient(conn), opts: o, pages: parsePages(), ring: newRing(chartBuckets + 1)}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /console/{$}", c.dashboard)
	mux.HandleFunc("GET /console/login", c.loginForm)
	mux.HandleFunc("POST /console/login", c.login)
	mux.HandleFunc("POST /console/logout", c.logout)
	mux.HandleFunc("GET /console/records", c.records)
	mux.HandleFunc("GET /console/record", c.record)
	mux.HandleFunc("GET /console/confirm", c.confirm)
	mux.HandleFunc("POST /console/resolve", c.resolve)
	mux.HandleFunc("POST /console/forget", c.forget)
	mux.HandleFunc("GET /console/style.css", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/css; charset=utf-8")
		b, _ := files.ReadFile("static/style.css")
		_, _ = w.Write(b)
	})
	cop := http.NewCrossOriginProtection()
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.opts.logger.Warn("console: cross-origin request refused", "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr)
		c.renderError(w, r, http.StatusForbidden, "Cross-origin request refused.")
	}))
	// Cross-origin posts are refused before the session is even looked up.
	c.handler = cop.Handler(c.withSession(mux))
	return c
}

// ServeHTTP serves the console's pages.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	if r.TLS == nil && !loopbackRemote(r.RemoteAddr) {
		// The server binary refuses a plain-HTTP console on a non-loopback
		// address; this holds behind any other wiring too.
		c.renderError(w, r, http.StatusForbidden, "The console serves plain HTTP to loopback clients only: use TLS.")
		return
	}
	c.handler.ServeHTTP(w, r)
}

// Run samples the counters every sample interval until ctx ends, for the
// dashboard's chart. Without WithCounters it returns at once.
func (c *Console) Run(ctx context.Context) {
	if c.opts.counters == nil {
		return
	}
	c.ring.add(time.Now(), c.opts.counters())
	t := time.NewTicker(c.opts.sampleEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			c.ring.add(now, c.opts.counters())
		}
	}
}

// callContext returns r's context carrying the operator's credentials for
// Admin calls: the bearer token of the request's session and, over TLS,
// the client certificate the listener verified.
func callContext(r *http.Request) context.Context {
	ctx := r.Context()
	if s, ok := sessionOf(r); ok {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+s.token)
	}
	if r.TLS != nil && len(r.TLS.VerifiedChains) > 0 {
		addr, _ := net.ResolveTCPAddr("tcp", r.RemoteAddr)
		var a net.Addr = addr
		if addr == nil {
			a = &net.TCPAddr{}
		}
		ctx = peer.NewContext(ctx, &peer.Peer{Addr: a, AuthInfo: credentials.TLSInfo{State: *r.TLS}})
	}
	return ctx
}

// validToken reports whether s can be a bearer token: 1-4096 visible ASCII
// bytes, as gRPC metadata allows.
func validToken(s string) bool {
	if s == "" || len(s) > maxTokenBytes {
		return false
	}
	for i := range len(s) {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// setCookie sets a console cookie: HttpOnly, SameSite=Strict, limited to
// the console's paths, Secure whenever the request came over TLS.
func setCookie(w http.ResponseWriter, r *http.Request, name, value string, maxAge time.Duration) {
	ck := &http.Cookie{Name: name, Value: value, Path: Prefix, HttpOnly: true, Secure: r.TLS != nil, //nolint:gosec // Secure whenever the request came over TLS: the console also serves plain HTTP on loopback, where a Secure cookie would never come back
		SameSite: http.SameSiteStrictMode}
	if maxAge < 0 {
		ck.MaxAge = -1
	} else if maxAge > 0 {
		ck.MaxAge = int(maxAge / time.Second)
	}
	http.SetCookie(w, ck)
}

// csrfToken returns the request's CSRF token, setting a new random one
// when it has none.
func csrfToken(w http.ResponseWriter, r *http.Request) string {
	if ck, err := r.Cookie(csrfCookie); err == nil && len(ck.Value) == 43 {
		return ck.Value
	}
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	tok := base64.RawURLEncoding.EncodeToString(b)
	setCookie(w, r, csrfCookie, tok, 0)
	return tok
}

// checkCSRF reports whether a posted form echoes the request's CSRF
// cookie. Call it after parsing the form.
func checkCSRF(r *http.Request) bool {
	ck, err := r.Cookie(csrfCookie)
	if err != nil || len(ck.Value) != 43 {
		return false
	}
	return subtle.ConstantTimeCompare([]byte(ck.Value), []byte(r.PostFormValue("csrf"))) == 1
}

// parsePost reads a posted form (URL-encoded or multipart, at most
// MaxFormBytes) and checks its CSRF token; it answers the request itself
// and returns false when either fails.
func (c *Console) parsePost(w http.ResponseWriter, r *http.Request) bool {
	r.Body = http.MaxBytesReader(w, r.Body, MaxFormBytes)
	var err error
	if strings.HasPrefix(r.Header.Get("Content-Type"), "multipart/form-data") {
		err = r.ParseMultipartForm(MaxFormBytes) //nolint:gosec // r.Body is capped by http.MaxBytesReader at MaxFormBytes above
	} else {
		err = r.ParseForm()
	}
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			c.renderError(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf("The form is larger than %d MiB.", MaxFormBytes>>20))
			return false
		}
		c.renderError(w, r, http.StatusBadRequest, "The form could not be read.")
		return false
	}
	if !checkCSRF(r) {
		c.opts.logger.Warn("console: request without a valid CSRF token refused", "path", r.URL.Path, "remote", r.RemoteAddr)
		c.renderError(w, r, http.StatusForbidden, "This form has expired or did not come from the console (CSRF check failed). Reload the page and try again.")
		return false
	}
	return true
}

// loopbackRemote reports whether a request's remote address is a loopback
// one.
func loopbackRemote(remote string) bool {
	host, _, err := net.SplitHostPort(remote)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// view is what every page template gets.
type view struct {
	Title    string
	Tenant   string
	CSRF     string
	Flash    string
	SignedIn bool
	Page     any
}

// render writes page name with status code.
func (c *Console) render(w http.ResponseWriter, r *http.Request, code int, name string, v view) {
	v.CSRF = csrfToken(w, r)
	_, v.SignedIn = sessionOf(r)
	var buf bytes.Buffer
	if err := c.pages[name].ExecuteTemplate(&buf, "layout", v); err != nil {
		c.opts.logger.Error("console: render page", "page", name, "err", err)
		http.Error(w, "internal error", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write(buf.Bytes())
}

// renderError writes an error page.
func (c *Console) renderError(w http.ResponseWriter, r *http.Request, code int, msg string) {
	c.render(w, r, code, "error", view{Title: http.StatusText(code), Page: msg})
}

// fail answers a request whose Admin call failed: a GET without valid
// credentials goes to the login form, anything else gets an error page with
// the HTTP status closest to the gRPC code.
func (c *Console) fail(w http.ResponseWriter, r *http.Request, err error) {
	st := status.Convert(err)
	switch st.Code() {
	case codes.Unauthenticated:
		if s, ok := sessionOf(r); ok {
			// The session's token no longer names a tenant here (a
			// reload or restart removed it): the session is over.
			if err := c.opts.sessions.DeleteSession(r.Context(), s.idSHA256); err != nil {
				c.opts.logger.Warn("console: ending a session whose token was refused failed", "err", err)
			}
			setCookie(w, r, sessionCookie, "", -1)
		}
		if r.Method == http.MethodGet {
			http.Redirect(w, r, "/console/login?"+url.Values{"next": {r.URL.RequestURI()}}.Encode(), http.StatusSeeOther)
			return
		}
		c.renderError(w, r, http.StatusUnauthorized, "Sign in first: "+st.Message())
	case codes.PermissionDenied:
		c.renderError(w, r, http.StatusForbidden, "Your tenant may not use the Admin API: "+st.Message())
	case codes.NotFound:
		c.renderError(w, r, http.StatusNotFound, "No such record in your tenant.")
	case codes.InvalidArgument:
		c.renderError(w, r, http.StatusBadRequest, st.Message())
	case codes.FailedPrecondition:
		c.renderError(w, r, http.StatusConflict, st.Message())
	case codes.Unavailable, codes.ResourceExhausted:
		c.renderError(w, r, http.StatusServiceUnavailable, "The coordinator cannot answer now: "+st.Message())
	default:
		c.opts.logger.Warn("console: Admin call failed", "path", r.URL.Path, "code", st.Code().String(), "err", st.Message())
		c.renderError(w, r, http.StatusBadGateway, "The Admin API failed: "+st.Code().String())
	}
}

// tenantOf returns the tenant an Admin call's response header names.
func tenantOf(md metadata.MD) string {
	if v := md.Get(tenantHeader); len(v) > 0 {
		return v[0]
	}
	return ""
}

// statusCode names the gRPC code of an Admin call's error.
func statusCode(err error) string { return status.Code(err).String() }
