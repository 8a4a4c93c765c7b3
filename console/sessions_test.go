package console_test

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

const sessionCookieName = "idemcoord_console_session"

// sessionCookie returns the value of the browser's session cookie.
func (b *browser) sessionCookie() string {
	b.t.Helper()
	u, _ := url.Parse(b.url + "/console/")
	for _, ck := range b.c.Jar.Cookies(u) {
		if ck.Name == sessionCookieName {
			return ck.Value
		}
	}
	b.t.Fatal("no session cookie")
	return ""
}

// setSessionCookie puts value in the browser's session cookie, as a
// person copying or making a cookie by hand would.
func (b *browser) setSessionCookie(value string) {
	u, _ := url.Parse(b.url + "/console/")
	b.c.Jar.SetCookies(u, []*http.Cookie{{Name: sessionCookieName, Value: value, Path: "/console/"}})
}

// signedIn reports whether GET /console/records shows the list (200) or
// sends the browser to the login form; anything else fails the test.
func (b *browser) signedIn() bool {
	b.t.Helper()
	r := b.get("/console/records")
	switch {
	case r.code == http.StatusOK:
		return true
	case r.code == http.StatusSeeOther && strings.HasPrefix(r.location, "/console/login"):
		return false
	}
	b.t.Fatalf("GET /console/records: %d %q %s", r.code, r.location, r.body)
	return false
}

// TestHandMadeCookieRefused: a cookie holding a valid admin token, made by
// hand without signing in, is no session.
func TestHandMadeCookieRefused(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	b := e.browser()
	for _, v := range []string{base64.RawURLEncoding.EncodeToString([]byte(opsToken)), opsToken,
		base64.RawURLEncoding.EncodeToString(make([]byte, 32))} {
		b.setSessionCookie(v)
		if b.signedIn() {
			t.Errorf("hand-made cookie %q accepted", v)
		}
	}
}

// TestSignOutEndsSession: after sign-out the session's cookie, kept or
// copied to another browser, is refused.
func TestSignOutEndsSession(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	b := e.browser()
	if r := b.login(opsToken); r.code != http.StatusSeeOther {
		t.Fatalf("login: %d %s", r.code, r.body)
	}
	value := b.sessionCookie()
	if strings.Contains(value, base64.RawURLEncoding.EncodeToString([]byte(opsToken))) {
		t.Errorf("the session cookie carries the token: %q", value)
	}
	copied := e.browser()
	copied.setSessionCookie(value)
	if !copied.signedIn() {
		t.Fatal("the copied cookie does not work before sign-out")
	}
	if r := b.post("/console/logout", url.Values{"csrf": {b.csrf()}}); r.code != http.StatusSeeOther {
		t.Fatalf("logout: %d %s", r.code, r.body)
	}
	b.setSessionCookie(value)
	if b.signedIn() {
		t.Error("the signed-out session's cookie still works in its browser")
	}
	if copied.signedIn() {
		t.Error("the signed-out session's cookie still works in another browser")
	}
}

// TestSessionExpiry: a session ends after 30 minutes without use, and 12
// hours after sign-in however much it is used.
func TestSessionExpiry(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	b := e.browser()
	b.login(opsToken)
	e.coord.Clock.Advance(29 * time.Minute)
	if !b.signedIn() {
		t.Fatal("signed out after 29 idle minutes")
	}
	e.coord.Clock.Advance(30 * time.Minute)
	if b.signedIn() {
		t.Fatal("still signed in after 30 idle minutes")
	}

	b = e.browser()
	b.login(opsToken)
	for elapsed := time.Duration(0); elapsed+25*time.Minute < 12*time.Hour; elapsed += 25 * time.Minute {
		e.coord.Clock.Advance(25 * time.Minute)
		if !b.signedIn() {
			t.Fatalf("signed out after %v of use", elapsed+25*time.Minute)
		}
	}
	e.coord.Clock.Advance(25 * time.Minute)
	if b.signedIn() {
		t.Fatal("still signed in 12 hours after sign-in")
	}
}

// TestReloadRemovingTokenRevokesSessions: a reload that removes the
// token an operator signed in with ends the session; putting the token
// back does not bring it back.
func TestReloadRemovingTokenRevokesSessions(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	b := e.browser()
	b.login(opsToken)
	if !b.signedIn() {
		t.Fatal("not signed in")
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	reload := func(config string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := e.coord.Server.Reload(path); err != nil {
			t.Fatal(err)
		}
	}
	reload(strings.Replace(tenantsConfig(), sha(opsToken), sha("new-ops-secret"), 1))
	reload(tenantsConfig())
	if b.signedIn() {
		t.Fatal("the session outlived the removal of its token")
	}
	if r := b.login(opsToken); r.code != http.StatusSeeOther || !b.signedIn() {
		t.Fatalf("signing in again: %d", r.code)
	}
}

// TestSessionSharedByReplicas: a session made by one replica's console
// works on another replica over the same database, and signing out on one
// ends it on both.
func TestSessionSharedByReplicas(t *testing.T) {
	t.Parallel()
	a := newConsoleEnv(t, false)
	other := newConsoleEnvOn(t, false, a.coord.DatabaseURL)
	ba := a.browser()
	if r := ba.login(opsToken); r.code != http.StatusSeeOther {
		t.Fatalf("login on a: %d", r.code)
	}
	bb := other.browser()
	bb.setSessionCookie(ba.sessionCookie())
	if !bb.signedIn() {
		t.Fatal("replica b refuses a's session")
	}
	if r := bb.post("/console/logout", url.Values{"csrf": {bb.csrf()}}); r.code != http.StatusSeeOther {
		t.Fatalf("logout on b: %d", r.code)
	}
	if ba.signedIn() {
		t.Fatal("the session signed out on b still works on a")
	}
}

// TestCrossOriginPostsRefused: a form posted from another site is refused
// even with a valid CSRF token, sign-in and sign-out included, and does not
// end or make a session.
func TestCrossOriginPostsRefused(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	b := e.browser()
	if r := b.login(opsToken); r.code != http.StatusSeeOther || !b.signedIn() {
		t.Fatalf("login: %d", r.code)
	}
	for _, h := range [][]string{{"Sec-Fetch-Site", "cross-site"}, {"Sec-Fetch-Site", "same-site"}, {"Origin", "http://evil.example"}} {
		if r := b.post("/console/logout", url.Values{"csrf": {b.csrf()}}, h...); r.code != http.StatusForbidden {
			t.Errorf("logout with %v: %d", h, r.code)
		}
		other := e.browser()
		if r := other.post("/console/login", url.Values{"csrf": {other.csrf()}, "token": {opsToken}}, h...); r.code != http.StatusForbidden ||
			len(r.header.Values("Set-Cookie")) > 0 && strings.Contains(strings.Join(r.header.Values("Set-Cookie"), ";"), sessionCookieName) {
			t.Errorf("login with %v: %d %v", h, r.code, r.header.Values("Set-Cookie"))
		}
	}
	if r := b.get("/console/records"); r.code != 200 {
		t.Fatalf("a cross-origin post ended the session: %d %s %s", r.code, r.location, r.body)
	}
}

// TestChangedSessionRowEnds: a session whose stored credential was changed
// in the database (it no longer opens with the cookie's id) is no session,
// and not an error page either.
func TestChangedSessionRowEnds(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	b := e.browser()
	b.login(opsToken)
	conn, err := pgx.Connect(context.Background(), e.coord.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if tag, err := conn.Exec(context.Background(), `UPDATE idempotency_console_sessions SET credential = '\x00'`); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("changing the row: %v %v", tag, err)
	}
	if b.signedIn() {
		t.Fatal("a session with a changed credential works")
	}
	if !strings.Contains(e.log.String(), "does not open") {
		t.Errorf("not logged:\n%s", e.log.String())
	}
}
