package console_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/idemcoord/idemcoord/console"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/server"
)

// TestOperatorResolvesUnknown is the operator's story over HTTP: sign in,
// find the UNKNOWN record on the dashboard and the list, open it (its scope
// has slashes), resolve it as completed with an uploaded body, see it
// COMPLETED; the action is logged with the operator's tenant.
func TestOperatorResolvesUnknown(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	e.unknownRecord(opsToken, chargeScope, "order-42")
	b := e.browser()

	r := b.login(opsToken)
	if r.code != http.StatusSeeOther || r.location != "/console/" {
		t.Fatalf("login: %d %q %s", r.code, r.location, r.body)
	}
	r = b.get("/console/")
	if r.code != http.StatusOK || !strings.Contains(r.body, `id="tenant">ops<`) || !strings.Contains(r.body, chargeScope) ||
		!strings.Contains(r.body, `id="chart-collecting" role="status">Collecting:`) || strings.Contains(r.body, "<polyline") {
		t.Fatalf("dashboard before any counter samples: %d %s", r.code, r.body)
	}
	// Once the counters have two intervals, the chart draws instead.
	now := time.Now()
	for i := range 3 {
		console.SampleAt(e.console, now.Add(time.Duration(i-3)*time.Minute))
	}
	r = b.get("/console/")
	if r.code != http.StatusOK || strings.Contains(r.body, "chart-collecting") || !strings.Contains(r.body, "<polyline") {
		t.Fatalf("dashboard with three samples: %d %s", r.code, r.body)
	}
	r = b.get("/console/records?state=unknown")
	if r.code != http.StatusOK || !strings.Contains(r.body, "order-42") {
		t.Fatalf("UNKNOWN list: %d %s", r.code, r.body)
	}
	// The list links to the record page with the scope escaped.
	link := recordPath(chargeScope, "order-42")
	if !strings.Contains(r.body, strings.ReplaceAll(link, "&", "&amp;")) || !strings.Contains(link, "%2Fpayments.v1.Payments%2FCharge") {
		t.Fatalf("list has no link %q: %s", link, r.body)
	}
	r = b.get(link)
	if r.code != http.StatusOK || !strings.Contains(r.body, `id="state">unknown<`) || !strings.Contains(r.body, `id="resolve-completed"`) {
		t.Fatalf("record page: %d %s", r.code, r.body)
	}
	r = b.get("/console/confirm?" + url.Values{"action": {"completed"}, "scope": {chargeScope}, "key": {"order-42"}}.Encode())
	if r.code != http.StatusOK || !strings.Contains(r.body, "Resolve order-42 as completed") {
		t.Fatalf("confirmation: %d %s", r.code, r.body)
	}
	csrf := csrfField.FindStringSubmatch(r.body)[1]

	// Upload a body that is not UTF-8, with metadata-less response fields.
	body := []byte{0xff, 0x00, 'o', 'k'}
	var form bytes.Buffer
	mw := multipart.NewWriter(&form)
	for k, v := range map[string]string{"csrf": csrf, "as": "completed", "scope": chargeScope, "key": "order-42",
		"confirm": "order-42", "schema_version": "payments.v1.ChargeResponse", "status_code": "201", "body": ""} {
		_ = mw.WriteField(k, v)
	}
	fw, _ := mw.CreateFormFile("body_file", "resp.bin")
	_, _ = fw.Write(body)
	_ = mw.Close()
	req, _ := http.NewRequest(http.MethodPost, b.url+"/console/resolve", &form)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	r = b.do(req)
	if r.code != http.StatusSeeOther || !strings.HasPrefix(r.location, link) {
		t.Fatalf("resolve: %d %q %s", r.code, r.location, r.body)
	}
	r = b.get(r.location)
	if r.code != http.StatusOK || !strings.Contains(r.body, `id="state">completed<`) || !strings.Contains(r.body, `id="body-hex"`) ||
		!strings.Contains(r.body, "ff 00 6f 6b") || !strings.Contains(r.body, "Resolved as completed") {
		t.Fatalf("record after resolve: %d %s", r.code, r.body)
	}
	rec, err := e.lookup(opsToken, chargeScope, "order-42")
	if err != nil || rec.GetState() != idempotencyv1.State_STATE_COMPLETED || !bytes.Equal(rec.GetResponse().GetBody(), body) ||
		rec.GetResponse().GetStatusCode() != 201 || rec.GetResponse().GetSchemaVersion() != "payments.v1.ChargeResponse" {
		t.Fatalf("stored record %v %v", rec, err)
	}
	logs := e.log.String()
	if !strings.Contains(logs, `msg="console: record resolved" tenant=ops scope=/payments.v1.Payments/Charge key=order-42 as=completed`) {
		t.Fatalf("no action log line with the tenant:\n%s", logs)
	}
	if strings.Contains(logs, opsToken) {
		t.Fatalf("the token was logged:\n%s", logs)
	}

	// Forget it, confirmed.
	r = b.post("/console/forget", url.Values{"csrf": {csrf}, "scope": {chargeScope}, "key": {"order-42"}, "confirm": {"order-42"}})
	if r.code != http.StatusSeeOther {
		t.Fatalf("forget: %d %s", r.code, r.body)
	}
	if _, err := e.lookup(opsToken, chargeScope, "order-42"); err == nil {
		t.Fatal("record still there after Forget")
	}
	if !strings.Contains(e.log.String(), `msg="console: record forgotten" tenant=ops`) {
		t.Fatalf("no forget log line:\n%s", e.log.String())
	}
}

// TestResolveRetryablePastedText resolves as retryable, and as completed
// with pasted text (line ends stored as \n), shown as text.
func TestResolveRetryablePastedText(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	e.unknownRecord(opsToken, "build", "a")
	e.unknownRecord(opsToken, "build", "b")
	b := e.browser()
	b.login(opsToken)
	csrf := b.csrf()
	r := b.post("/console/resolve", url.Values{"csrf": {csrf}, "as": {"retryable"}, "scope": {"build"}, "key": {"a"}, "confirm": {"a"}})
	if r.code != http.StatusSeeOther {
		t.Fatalf("resolve retryable: %d %s", r.code, r.body)
	}
	if rec, err := e.lookup(opsToken, "build", "a"); err != nil || rec.GetState() != idempotencyv1.State_STATE_FAILED_RETRYABLE {
		t.Fatalf("after resolve retryable: %v %v", rec, err)
	}
	r = b.post("/console/resolve", url.Values{"csrf": {csrf}, "as": {"completed"}, "scope": {"build"}, "key": {"b"},
		"confirm": {"b"}, "body": {"{\r\n \"id\": \"<b>7</b>\"\r\n}"}})
	if r.code != http.StatusSeeOther {
		t.Fatalf("resolve completed: %d %s", r.code, r.body)
	}
	if rec, _ := e.lookup(opsToken, "build", "b"); string(rec.GetResponse().GetBody()) != "{\n \"id\": \"<b>7</b>\"\n}" {
		t.Fatalf("stored body %q", rec.GetResponse().GetBody())
	}
	r = b.get(recordPath("build", "b"))
	if !strings.Contains(r.body, `id="body">{`) || !strings.Contains(r.body, "&lt;b&gt;7&lt;/b&gt;") {
		t.Fatalf("text body not shown escaped: %s", r.body)
	}
	// Resolving again is refused (the record is no longer UNKNOWN) and
	// changes nothing; an unconfirmed or unknown action is refused too.
	r = b.post("/console/resolve", url.Values{"csrf": {csrf}, "as": {"retryable"}, "scope": {"build"}, "key": {"b"}, "confirm": {"b"}})
	if r.code != http.StatusConflict {
		t.Fatalf("second resolve: %d %s", r.code, r.body)
	}
	for _, f := range []url.Values{
		{"csrf": {csrf}, "as": {"retryable"}, "scope": {"build"}, "key": {"b"}},
		{"csrf": {csrf}, "as": {"retryable"}, "scope": {"build"}, "key": {"b"}, "confirm": {"a"}},
		{"csrf": {csrf}, "as": {"maybe"}, "scope": {"build"}, "key": {"b"}, "confirm": {"b"}},
		{"csrf": {csrf}, "as": {"completed"}, "scope": {"build"}, "key": {"b"}, "confirm": {"b"}, "status_code": {"99999999999"}},
	} {
		if r := b.post("/console/resolve", f); r.code != http.StatusBadRequest {
			t.Errorf("resolve %v: %d, want 400", f, r.code)
		}
	}
	if rec, _ := e.lookup(opsToken, "build", "b"); rec.GetState() != idempotencyv1.State_STATE_COMPLETED {
		t.Fatalf("record changed by refused posts: %v", rec)
	}
}

// TestUnauthenticatedSeesNoRecord: without a session every page redirects
// to the login form and shows nothing; posts get 401 and change nothing.
func TestUnauthenticatedSeesNoRecord(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	e.unknownRecord(opsToken, chargeScope, "secret-key")
	b := e.browser()
	for _, path := range []string{"/console/", "/console/records", "/console/records?state=unknown",
		recordPath(chargeScope, "secret-key"), "/console/confirm?action=forget&scope=x&key=secret-key"} {
		r := b.get(path)
		if r.code != http.StatusSeeOther || !strings.HasPrefix(r.location, "/console/login?next=") {
			t.Errorf("GET %s: %d %q, want a redirect to the login form", path, r.code, r.location)
		}
		if strings.Contains(r.body, "secret-key") && !strings.Contains(r.location, "secret-key") {
			t.Errorf("GET %s shows the record: %s", path, r.body)
		}
	}
	// A forged session cookie is no better.
	u, _ := url.Parse(b.url + "/console/")
	b.c.Jar.SetCookies(u, []*http.Cookie{{Name: "idemcoord_console_session", Value: "bm90LWEtdG9rZW4", Path: "/console/"}})
	if r := b.get("/console/records"); r.code != http.StatusSeeOther || strings.Contains(r.body, "secret-key") {
		t.Errorf("forged session: %d %s", r.code, r.body)
	}
	csrf := b.csrf()
	for _, path := range []string{"/console/resolve", "/console/forget"} {
		r := b.post(path, url.Values{"csrf": {csrf}, "as": {"retryable"}, "scope": {chargeScope}, "key": {"secret-key"}, "confirm": {"secret-key"}})
		if r.code != http.StatusUnauthorized || strings.Contains(r.body, "secret-key") {
			t.Errorf("POST %s: %d %s, want 401", path, r.code, r.body)
		}
	}
	if r := b.login("wrong-token"); r.code != http.StatusUnauthorized {
		t.Errorf("login with a wrong token: %d", r.code)
	}
	if rec, err := e.lookup(opsToken, chargeScope, "secret-key"); err != nil || rec.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("record after unauthenticated posts: %v %v", rec, err)
	}
}

// TestNonAdminTenantForbidden: a tenant without admin: true cannot sign
// in, and its token in a hand-made cookie is no session: pages send the
// browser to sign in, posts get 401.
func TestNonAdminTenantForbidden(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	e.unknownRecord(payToken, chargeScope, "pay-key")
	b := e.browser()
	r := b.login(payToken)
	if r.code != http.StatusForbidden || len(r.header.Values("Set-Cookie")) > 0 && strings.Contains(strings.Join(r.header.Values("Set-Cookie"), ";"), "idemcoord_console_session") {
		t.Fatalf("login as payments: %d %v", r.code, r.header.Values("Set-Cookie"))
	}
	u, _ := url.Parse(b.url + "/console/")
	b.c.Jar.SetCookies(u, []*http.Cookie{{Name: "idemcoord_console_session", Value: "cGF5LXNlY3JldA", Path: "/console/"}}) // pay-secret
	for _, path := range []string{"/console/", "/console/records", recordPath(chargeScope, "pay-key")} {
		if r := b.get(path); r.code != http.StatusSeeOther || !strings.HasPrefix(r.location, "/console/login") {
			t.Errorf("GET %s with payments' token as cookie: %d, want a redirect to sign in", path, r.code)
		}
	}
	r = b.post("/console/forget", url.Values{"csrf": {b.csrf()}, "scope": {chargeScope}, "key": {"pay-key"}, "confirm": {"pay-key"}})
	if r.code != http.StatusUnauthorized {
		t.Errorf("forget with payments' token as cookie: %d", r.code)
	}
	if rec, err := e.lookup(payToken, chargeScope, "pay-key"); err != nil || rec.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("record after payments' posts: %v %v", rec, err)
	}
}

// TestCSRF: an action without the form's CSRF token, with another token,
// or from another origin is refused and changes nothing.
func TestCSRF(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	e.unknownRecord(opsToken, "build", "k")
	b := e.browser()
	if r := b.login(opsToken); r.code != http.StatusSeeOther {
		t.Fatalf("login: %d", r.code)
	}
	csrf := b.csrf()
	form := func(token string) url.Values {
		v := url.Values{"as": {"retryable"}, "scope": {"build"}, "key": {"k"}, "confirm": {"k"}}
		if token != "" {
			v.Set("csrf", token)
		}
		return v
	}
	for name, c := range map[string]struct {
		form    url.Values
		headers []string
	}{
		"no token":           {form(""), nil},
		"wrong token":        {form("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"), nil},
		"cross-site":         {form(csrf), []string{"Sec-Fetch-Site", "cross-site"}},
		"same-site":          {form(csrf), []string{"Sec-Fetch-Site", "same-site"}},
		"foreign origin":     {form(csrf), []string{"Origin", "http://evil.example"}},
		"other port, origin": {form(csrf), []string{"Origin", "http://127.0.0.1:1"}},
	} {
		for _, path := range []string{"/console/resolve", "/console/forget", "/console/logout"} {
			if r := b.post(path, c.form, c.headers...); r.code != http.StatusForbidden {
				t.Errorf("%s: POST %s = %d, want 403", name, path, r.code)
			}
		}
	}
	// Login needs the token too (no login CSRF).
	if r := b.post("/console/login", url.Values{"token": {opsToken}}); r.code != http.StatusForbidden {
		t.Errorf("login without CSRF token: %d", r.code)
	}
	if rec, err := e.lookup(opsToken, "build", "k"); err != nil || rec.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("record after refused posts: %v %v", rec, err)
	}
	// The same request from the console's own page goes through.
	if r := b.post("/console/resolve", form(csrf), "Sec-Fetch-Site", "same-origin"); r.code != http.StatusSeeOther {
		t.Fatalf("same-origin post: %d %s", r.code, r.body)
	}
}

// TestOtherTenantInvisible: an admin tenant sees, counts and acts on its own
// records only; another tenant's record looks absent.
func TestOtherTenantInvisible(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	e.unknownRecord(payToken, chargeScope, "theirs")
	e.unknownRecord(opsToken, "build", "mine")
	b := e.browser()
	b.login(opsToken)
	for _, path := range []string{"/console/", "/console/records", "/console/records?state=unknown",
		"/console/records?prefix=the"} {
		r := b.get(path)
		if r.code != http.StatusOK || strings.Contains(r.body, "theirs") || strings.Contains(r.body, chargeScope) {
			t.Errorf("GET %s shows payments' record: %d %s", path, r.code, r.body)
		}
	}
	if r := b.get(recordPath(chargeScope, "theirs")); r.code != http.StatusNotFound {
		t.Errorf("payments' record page: %d", r.code)
	}
	csrf := b.csrf()
	for _, path := range []string{"/console/resolve", "/console/forget"} {
		r := b.post(path, url.Values{"csrf": {csrf}, "as": {"retryable"}, "scope": {chargeScope}, "key": {"theirs"}, "confirm": {"theirs"}})
		if r.code != http.StatusNotFound {
			t.Errorf("POST %s on payments' record: %d", path, r.code)
		}
	}
	if rec, err := e.lookup(payToken, chargeScope, "theirs"); err != nil || rec.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("payments' record after ops' posts: %v %v", rec, err)
	}
}

// TestListFiltersAndPaging pages through 120 records with the console's
// filters (state, scope glob, key prefix).
func TestListFiltersAndPaging(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	for i := range 120 {
		e.unknownRecord(opsToken, "batch/job", "k"+string(rune('a'+i/26))+string(rune('a'+i%26)))
	}
	b := e.browser()
	b.login(opsToken)
	seen := 0
	path := "/console/records?" + url.Values{"state": {"unknown"}, "scope": {"batch/*"}, "prefix": {"k"}}.Encode()
	for pages := 0; path != ""; pages++ {
		if pages > 5 {
			t.Fatal("too many pages")
		}
		r := b.get(path)
		if r.code != http.StatusOK {
			t.Fatalf("GET %s: %d %s", path, r.code, r.body)
		}
		seen += strings.Count(r.body, `<span class="badge state-unknown">unknown</span>`)
		path = ""
		if m := nextLink.FindStringSubmatch(r.body); m != nil {
			path = strings.ReplaceAll(m[1], "&amp;", "&")
		}
	}
	if seen != 120 {
		t.Fatalf("paged through %d records, want 120", seen)
	}
	r := b.get("/console/records?prefix=kb")
	if n := strings.Count(r.body, `state-unknown">unknown<`); n != 26 {
		t.Errorf("prefix kb lists %d records, want 26", n)
	}
	if r := b.get("/console/records?state=bogus"); r.code != http.StatusBadRequest {
		t.Errorf("bad state: %d", r.code)
	}
	if r := b.get("/console/records?scope=" + url.QueryEscape("a\x01")); r.code != http.StatusBadRequest {
		t.Errorf("control character in the glob: %d", r.code)
	}
}

// TestDecisionList: the navigation's "Needs a decision" list shows the
// records that need an operator's decision through the API's uncertain
// filter: an UNKNOWN record and an uncertain FAILED_RETRYABLE one (marked
// uncertain), not a COMPLETED one; it pages with the filter kept.
func TestDecisionList(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+opsToken)
	end := func(key string, fail idempotencyv1.FailureKind) {
		t.Helper()
		b, err := e.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "s", Key: key})
		if err == nil && fail == idempotencyv1.FailureKind_FAILURE_KIND_UNSPECIFIED {
			_, err = e.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "s", Key: key, LeaseToken: b.GetLeaseToken()})
		} else if err == nil {
			_, err = e.client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "s", Key: key, LeaseToken: b.GetLeaseToken(), Kind: fail})
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	e.unknownRecord(opsToken, "s", "lapsed")
	end("uncertain-retryable", idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN)
	end("uncertain-retryable", idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE)
	end("completed", idempotencyv1.FailureKind_FAILURE_KIND_UNSPECIFIED)
	b := e.browser()
	b.login(opsToken)

	r := b.get("/console/")
	if !strings.Contains(r.body, `<a href="/console/records?uncertain=1"`) {
		t.Fatalf("no link to the decision list: %s", r.body)
	}
	r = b.get("/console/records?uncertain=1")
	if r.code != http.StatusOK || !strings.Contains(r.body, "<code>lapsed</code>") || !strings.Contains(r.body, "<code>uncertain-retryable</code>") ||
		strings.Contains(r.body, "<code>completed</code>") || !strings.Contains(r.body, `<span class="uncertain">uncertain</span>`) ||
		!strings.Contains(r.body, `id="filter-uncertain" checked`) || !strings.Contains(r.body, "need a decision") {
		t.Fatalf("decision list: %d %s", r.code, r.body)
	}
	if r := b.get("/console/records?uncertain=1&state=failed_retryable"); strings.Contains(r.body, "<code>lapsed</code>") ||
		!strings.Contains(r.body, "<code>uncertain-retryable</code>") {
		t.Fatalf("decision list of failed_retryable records: %d %s", r.code, r.body)
	}
	for i := range 60 {
		e.unknownRecord(opsToken, "t", fmt.Sprintf("k%02d", i))
	}
	r = b.get("/console/records?uncertain=1")
	m := nextLink.FindStringSubmatch(r.body)
	if m == nil || !strings.Contains(m[1], "uncertain=1") {
		t.Fatalf("the next page of the decision list loses the filter: %v", m)
	}
	if r := b.get(strings.ReplaceAll(m[1], "&amp;", "&")); r.code != http.StatusOK || !strings.Contains(r.body, "<code>k59</code>") {
		t.Fatalf("second page: %d %s", r.code, r.body)
	}
	if r := b.get("/console/records?uncertain=yes"); r.code != http.StatusBadRequest {
		t.Errorf("uncertain=yes: %d", r.code)
	}
	if r := b.get("/console/records?uncertain=1&state=completed"); r.code != http.StatusBadRequest {
		t.Errorf("uncertain=1&state=completed: %d", r.code)
	}
}

// TestCookiesAndHeaders: the session cookie is HttpOnly, SameSite=Strict and
// limited to the console, Secure over TLS; pages forbid framing and
// caching; plain HTTP from a non-loopback client is refused.
func TestCookiesAndHeaders(t *testing.T) {
	t.Parallel()
	for _, useTLS := range []bool{false, true} {
		e := newConsoleEnv(t, useTLS)
		if useTLS {
			e.http.StartTLS()
		}
		b := e.browser()
		r := b.login(opsToken)
		var session *http.Cookie
		for _, ck := range (&http.Response{Header: r.header}).Cookies() {
			if ck.Name == "idemcoord_console_session" {
				session = ck
			}
		}
		if session == nil || !session.HttpOnly || session.SameSite != http.SameSiteStrictMode || session.Path != "/console/" ||
			session.Secure != useTLS {
			t.Fatalf("TLS %v: session cookie %+v", useTLS, session)
		}
		r = b.get("/console/")
		if r.header.Get("X-Frame-Options") != "DENY" || r.header.Get("Cache-Control") != "no-store" ||
			!strings.Contains(r.header.Get("Content-Security-Policy"), "frame-ancestors 'none'") {
			t.Errorf("TLS %v: headers %v", useTLS, r.header)
		}
		if r := b.post("/console/logout", url.Values{"csrf": {b.csrf()}}); r.code != http.StatusSeeOther {
			t.Errorf("logout: %d", r.code)
		}
		if r := b.get("/console/"); r.code != http.StatusSeeOther {
			t.Errorf("TLS %v: after logout: %d", useTLS, r.code)
		}
	}
	e := newConsoleEnv(t, false)
	req := httptest.NewRequest(http.MethodGet, "/console/", nil)
	req.RemoteAddr = "192.0.2.7:4000"
	w := httptest.NewRecorder()
	e.console.ServeHTTP(w, req)
	if w.Code != http.StatusForbidden {
		t.Errorf("plain HTTP from a remote client: %d", w.Code)
	}
	// Open redirects after login are refused.
	b := e.browser()
	for _, next := range []string{"//evil.example/", "https://evil.example/console/", "/\\evil.example", "/metrics",
		"/console/../metrics", "/console/../idempotency.v1.Admin/ListRecords"} {
		r := b.post("/console/login", url.Values{"csrf": {b.csrf()}, "token": {opsToken}, "next": {next}})
		if r.code != http.StatusSeeOther || r.location != "/console/" {
			t.Errorf("next %q: redirected to %q", next, r.location)
		}
	}
}

// TestClientCertificateSignsIn: over TLS, a client certificate that the
// listener verified and that an admin tenant lists in client_cert_names is
// enough; one a non-admin tenant lists gets 403.
func TestClientCertificateSignsIn(t *testing.T) {
	t.Parallel()
	ca := testkit.NewCA(t)
	e := newConsoleEnv(t, true)
	e.http.TLS = &tls.Config{ClientCAs: ca.Pool(), ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS12}
	e.http.StartTLS()
	e.unknownRecord(opsToken, "build", "by-cert")
	for _, c := range []struct {
		cn   string
		want int
	}{{"ops", http.StatusOK}, {"payments", http.StatusForbidden}, {"nobody", http.StatusSeeOther}} {
		b := e.browser()
		tr := b.c.Transport.(*http.Transport).Clone()
		_, _, pair := ca.Issue(c.cn, c.cn)
		tr.TLSClientConfig.Certificates = []tls.Certificate{pair}
		b.c.Transport = tr
		r := b.get("/console/records?state=unknown")
		if r.code != c.want {
			t.Errorf("certificate %s: %d, want %d", c.cn, r.code, c.want)
		}
		if (c.want == http.StatusOK) != strings.Contains(r.body, "by-cert") {
			t.Errorf("certificate %s: record shown = %v", c.cn, strings.Contains(r.body, "by-cert"))
		}
	}
}

var nextLink = regexp.MustCompile(`href="([^"]*)" id="next"`)

// TestHostileInput: markup in keys is escaped and still round-trips through
// links; malformed parameters get 4xx, never a 5xx or a changed record.
func TestHostileInput(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	scope, key := `/x.v1.X/<b>?&#`, `<script>alert("k")</script>'&%2F/..`
	e.unknownRecord(opsToken, scope, key)
	b := e.browser()
	b.login(opsToken)
	for _, path := range []string{"/console/", "/console/records", recordPath(scope, key),
		"/console/confirm?" + url.Values{"action": {"completed"}, "scope": {scope}, "key": {key}}.Encode()} {
		r := b.get(path)
		if r.code != http.StatusOK || strings.Contains(r.body, "<script>") || strings.Contains(r.body, "<b>?") {
			t.Errorf("GET %s: %d, unescaped markup: %s", path, r.code, r.body)
		}
	}
	r := b.get("/console/records")
	m := regexp.MustCompile(`href="(/console/record\?[^"]*)"`).FindStringSubmatch(r.body)
	if m == nil {
		t.Fatalf("no record link: %s", r.body)
	}
	if r := b.get(strings.ReplaceAll(m[1], "&amp;", "&")); r.code != http.StatusOK || !strings.Contains(r.body, "&lt;script&gt;") {
		t.Fatalf("the list's link does not lead to the record: %d", r.code)
	}
	for path, want := range map[string]int{
		"/console/record?scope=%FF&key=k":                         http.StatusBadRequest,
		"/console/record?scope=a&key=":                            http.StatusBadRequest,
		"/console/record?key=k":                                   http.StatusBadRequest,
		"/console/record?scope=a&key=" + strings.Repeat("k", 300): http.StatusBadRequest,
		"/console/records?prefix=%FF":                             http.StatusBadRequest,
		"/console/records?page=not-a-token":                       http.StatusBadRequest,
		"/console/confirm?action=drop&scope=a&key=b":              http.StatusBadRequest,
		"/console/confirm?action=forget&scope=a&key=b":            http.StatusNotFound,
		"/console/nope":                                           http.StatusNotFound,
	} {
		if r := b.get(path); r.code != want {
			t.Errorf("GET %s: %d, want %d", path, r.code, want)
		}
	}
	csrf := b.csrf()
	big := strings.NewReader(url.Values{"csrf": {csrf}, "body": {strings.Repeat("x", 9<<20)}}.Encode())
	req, _ := http.NewRequest(http.MethodPost, b.url+"/console/resolve", big)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if r := b.do(req); r.code != http.StatusRequestEntityTooLarge {
		t.Errorf("9 MiB form: %d", r.code)
	}
	// A body over the server's limit (1 MiB), in a form under the
	// console's cap, is refused by the Admin API.
	r = b.post("/console/resolve", url.Values{"csrf": {csrf}, "as": {"completed"}, "scope": {scope}, "key": {key},
		"confirm": {key}, "body": {strings.Repeat("x", 3<<19)}})
	if r.code != http.StatusBadRequest {
		t.Errorf("1.5 MiB body: %d %s", r.code, r.body)
	}
	if rec, err := e.lookup(opsToken, scope, key); err != nil || rec.GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("record after hostile posts: %v %v", rec, err)
	}
}

// TestReloadRevokesAccess: a signed-in operator whose tenant loses admin
// (or whose token is removed) in a config reload is refused at the next
// request; the console holds no authority of its own.
func TestReloadRevokesAccess(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	e.unknownRecord(opsToken, "build", "k")
	b := e.browser()
	b.login(opsToken)
	if r := b.get("/console/records"); r.code != http.StatusOK {
		t.Fatalf("before the reload: %d", r.code)
	}
	reload := func(config string) {
		t.Helper()
		p, err := server.ParsePolicies([]byte(config))
		if err != nil {
			t.Fatal(err)
		}
		e.coord.Server.SetPolicies(p)
	}
	reload(strings.Replace(tenantsConfig(), `scopes: ["*"], admin: true`, `scopes: ["*"]`, 1))
	if r := b.get("/console/records"); r.code != http.StatusForbidden || strings.Contains(r.body, ">k<") {
		t.Fatalf("after admin was withdrawn: %d", r.code)
	}
	reload(strings.Replace(tenantsConfig(), sha(opsToken), sha("new-ops-secret"), 1))
	if r := b.get("/console/records"); r.code != http.StatusSeeOther {
		t.Fatalf("after the token changed: %d", r.code)
	}
}

// TestAuthDisabled: without tenants every caller is tenant default, in the
// console as in the Admin API (the server binary then allows the console on
// loopback only); actions still need the CSRF token.
func TestAuthDisabled(t *testing.T) {
	t.Parallel()
	c := coordtest.Start(t, coordtest.Options{FakeClock: true})
	con := console.New(c.Server.AdminConn())
	mux := http.NewServeMux()
	mux.Handle(console.Prefix, con)
	hs := httptest.NewServer(mux)
	defer hs.Close()
	e := &consoleEnv{t: t, coord: c, http: hs}
	b := e.browser()
	if r := b.get("/console/"); r.code != http.StatusOK || !strings.Contains(r.body, `id="tenant">default<`) {
		t.Fatalf("dashboard without auth: %d %s", r.code, r.body)
	}
	if r := b.post("/console/forget", url.Values{"scope": {"a"}, "key": {"b"}, "confirm": {"b"}}); r.code != http.StatusForbidden {
		t.Fatalf("forget without CSRF token: %d", r.code)
	}
}

// TestSignInPageSaysWhatTheCookieHolds: the sign-in form says the cookie
// holds a random session id, not the token (which is stored sealed on the
// server side), as docs/security-console.md describes.
func TestSignInPageSaysWhatTheCookieHolds(t *testing.T) {
	t.Parallel()
	r := newConsoleEnv(t, false).browser().get("/console/login")
	if r.code != http.StatusOK {
		t.Fatalf("sign-in page: %d", r.code)
	}
	if strings.Contains(r.body, "token is kept in") || !strings.Contains(r.body, "random session id") {
		t.Fatalf("the sign-in page misstates what its cookie holds: %s", r.body)
	}
}
