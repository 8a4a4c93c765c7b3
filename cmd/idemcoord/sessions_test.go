package main

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// consoleBrowser is a cookie-keeping HTTP client of the consoles of
// several replicas; it does not follow redirects.
type consoleBrowser struct {
	t *testing.T
	c *http.Client
}

func newConsoleBrowser(t *testing.T) *consoleBrowser {
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &consoleBrowser{t: t, c: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

func (b *consoleBrowser) do(req *http.Request) (int, string) {
	b.t.Helper()
	resp, err := b.c.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// post sends a form to the console at addr, with the CSRF token of its
// login page, and extra headers.
func (b *consoleBrowser) post(addr, path string, form url.Values, headers ...string) int {
	b.t.Helper()
	req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/console/login", nil)
	_, page := b.do(req)
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(page)
	if m == nil {
		b.t.Fatalf("no CSRF token on %s's login page: %s", addr, page)
	}
	form.Set("csrf", m[1])
	req, _ = http.NewRequest(http.MethodPost, "http://"+addr+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	code, _ := b.do(req)
	return code
}

// signedIn reports whether the console at addr shows its records (200)
// rather than the way to sign in (303).
func (b *consoleBrowser) signedIn(addr string) bool {
	b.t.Helper()
	req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/console/records", nil)
	code, body := b.do(req)
	if code != http.StatusOK && code != http.StatusSeeOther {
		b.t.Fatalf("GET %s/console/records: %d %s", addr, code, body)
	}
	return code == http.StatusOK
}

// TestConsoleSessionsAcrossReplicas runs two coordinators with --console
// over one database: a session signed in on one works on the other and
// signing out on either ends it on both; a hand-made cookie holding the
// token is no session; a cross-origin sign-out is refused; a reload that
// removes the token revokes its sessions, which stay revoked when the
// token comes back.
func TestConsoleSessionsAcrossReplicas(t *testing.T) {
	bin := coordtest.BuildBinary(t)
	token := "ops-secret"
	sum := sha256.Sum256([]byte(token))
	tenants := fmt.Sprintf("tenants:\n  - { name: ops, token_sha256: %s, scopes: [\"*\"], admin: true }\n", hex.EncodeToString(sum[:]))
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	write := func(config string) {
		t.Helper()
		if err := os.WriteFile(cfg, []byte(config), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(tenants)
	dbURL := pgtest.NewDatabase(t)
	httpA, httpB := coordtest.FreeAddr(t), coordtest.FreeAddr(t)
	a := startBinary(t, bin, dbURL, coordtest.FreeAddr(t), httpA, "--config", cfg, "--console")
	startBinary(t, bin, dbURL, coordtest.FreeAddr(t), httpB, "--config", cfg, "--console")

	// Cookies are per host, not per port: one browser holds its session
	// for both replicas, as behind a load balancer.
	b := newConsoleBrowser(t)
	if code := b.post(httpA, "/console/login", url.Values{"token": {token}}); code != http.StatusSeeOther {
		t.Fatalf("sign in on a: %d", code)
	}
	if !b.signedIn(httpA) || !b.signedIn(httpB) {
		t.Fatal("the session made on a does not work on both replicas")
	}
	u, _ := url.Parse("http://" + httpA + "/console/")
	var kept string
	for _, ck := range b.c.Jar.Cookies(u) {
		if ck.Name == "idemcoord_console_session" {
			kept = ck.Value
		}
	}
	if kept == "" {
		t.Fatal("no session cookie")
	}
	if code := b.post(httpB, "/console/logout", url.Values{}, "Sec-Fetch-Site", "cross-site"); code != http.StatusForbidden {
		t.Fatalf("cross-site sign-out: %d, want 403", code)
	}
	if code := b.post(httpB, "/console/logout", url.Values{}); code != http.StatusSeeOther {
		t.Fatalf("sign out on b: %d", code)
	}

	forged := newConsoleBrowser(t)
	forged.c.Jar.SetCookies(u, []*http.Cookie{{Name: "idemcoord_console_session", Value: base64.RawURLEncoding.EncodeToString([]byte(token)), Path: "/console/"}})
	if forged.signedIn(httpA) {
		t.Error("a hand-made cookie holding the token is accepted")
	}
	copied := newConsoleBrowser(t)
	copied.c.Jar.SetCookies(u, []*http.Cookie{{Name: "idemcoord_console_session", Value: kept, Path: "/console/"}})
	if copied.signedIn(httpA) {
		t.Error("a cookie kept from before sign-out is accepted")
	}
	if b.signedIn(httpA) {
		t.Error("the session signed out on b still works on a")
	}

	if code := b.post(httpA, "/console/login", url.Values{"token": {token}}); code != http.StatusSeeOther || !b.signedIn(httpB) {
		t.Fatalf("sign in again: %d", code)
	}
	reloads := func() int { return strings.Count(a.logs.String(), "config reloaded") }
	n := reloads()
	write(strings.Replace(tenants, hex.EncodeToString(sum[:]), strings.Repeat("ab", 32), 1))
	waitFor(t, "a's reload without the token", a, func() bool { return reloads() > n })
	n = reloads()
	write(tenants)
	waitFor(t, "a's reload with the token back", a, func() bool { return reloads() > n })
	fresh := newConsoleBrowser(t)
	if code := fresh.post(httpA, "/console/login", url.Values{"token": {token}}); code != http.StatusSeeOther {
		t.Fatalf("the token does not sign in after it came back: %d", code)
	}
	if b.signedIn(httpB) || b.signedIn(httpA) {
		t.Fatal("the session outlived the removal of its token")
	}
}
