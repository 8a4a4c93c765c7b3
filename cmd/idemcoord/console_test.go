package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
)

// TestConsoleFlag runs the binary with --console: the HTTP listener serves
// the console (sign-in required) next to /metrics; without the flag there is
// no console.
func TestConsoleFlag(t *testing.T) {
	bin := coordtest.BuildBinary(t)
	sum := sha256.Sum256([]byte("ops-secret"))
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("tenants:\n  - { name: ops, token_sha256: %s, scopes: [\"*\"], admin: true }\n",
		hex.EncodeToString(sum[:]))), 0o600); err != nil {
		t.Fatal(err)
	}
	dbURL := pgtest.NewDatabase(t)
	httpAddr := coordtest.FreeAddr(t)
	p := startBinary(t, bin, dbURL, coordtest.FreeAddr(t), httpAddr, "--config", cfg, "--console")
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(path string) (*http.Response, string) {
		t.Helper()
		resp, err := client.Get("http://" + httpAddr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	if resp, _ := get("/console/"); resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(resp.Header.Get("Location"), "/console/login") {
		t.Fatalf("/console/ without a session: %d %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	if resp, _ := get("/metrics"); resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %d", resp.StatusCode)
	}
	_, page := get("/console/login")
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("login page: %s", page)
	}
	resp, err := client.PostForm("http://"+httpAddr+"/console/login", url.Values{"csrf": {m[1]}, "token": {"ops-secret"}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("login: %d", resp.StatusCode)
	}
	if resp, body := get("/console/"); resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="tenant">ops<`) {
		t.Fatalf("dashboard after login: %d %s", resp.StatusCode, body)
	}
	if !strings.Contains(p.logs.String(), "operator console enabled") || !strings.Contains(p.logs.String(), "console: signed in") {
		t.Fatalf("logs:\n%s", p.logs)
	}
	p.stop()

	httpAddr = coordtest.FreeAddr(t)
	startBinary(t, bin, dbURL, coordtest.FreeAddr(t), httpAddr, "--config", cfg)
	if resp, _ := get("/console/"); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("/console/ without --console: %d", resp.StatusCode)
	}
}

// TestConsoleExposure: a plain-HTTP console only on loopback, a console
// without auth only on loopback unless --insecure-allow-no-auth; with TLS
// the listener serves HTTPS and the session cookie is Secure.
func TestConsoleExposure(t *testing.T) {
	t.Setenv("IDEMCOORD_INSECURE_ALLOW_NO_AUTH", "")
	certFile, keyFile, _ := testkit.NewCA(t).Issue("server", "idemcoord", "127.0.0.1")
	logger := slog.New(slog.DiscardHandler)
	parse := func(args ...string) *config {
		t.Helper()
		c, err := parseFlags(append([]string{"--database-url", "postgres://x", "--console"}, args...))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	for _, c := range []struct {
		args []string
		auth bool
		want string
	}{
		{[]string{"--http-listen", "0.0.0.0:9090"}, true, "needs TLS"},
		{[]string{"--http-listen", "0.0.0.0:9090", "--tls-cert", certFile, "--tls-key", keyFile}, false, "--insecure-allow-no-auth"},
	} {
		_, _, err := mountConsole(context.Background(), parse(c.args...), logger, nil, nil, c.auth, nil)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v (auth %v): err = %v, want %q", c.args, c.auth, err, c.want)
		}
		if err := checkConsoleExposure(parse(c.args...), c.auth); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("checkConsoleExposure %v (auth %v): err = %v, want %q", c.args, c.auth, err, c.want)
		}
	}
	for _, args := range [][]string{
		{"--http-listen", "127.0.0.1:9090"},
		{"--http-listen", "0.0.0.0:9090", "--tls-cert", certFile, "--tls-key", keyFile},
		{"--http-listen", "0.0.0.0:9090", "--tls-cert", certFile, "--tls-key", keyFile, "--insecure-allow-no-auth"},
	} {
		if err := checkConsoleExposure(parse(args...), len(args) != 7); err != nil { // the last one: no auth, allowed by flag
			t.Errorf("%v: %v", args, err)
		}
	}

	coord := coordtest.Start(t, coordtest.Options{})
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	h, lis, err := mountConsole(ctx, parse("--http-listen", raw.Addr().String(), "--tls-cert", certFile, "--tls-key", keyFile),
		logger, coord.Server, coord.Store, false, raw)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Close()
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} // a self-signed test certificate
	resp, err := client.Get("https://" + raw.Addr().String() + "/console/login")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	secure := false
	for _, ck := range resp.Cookies() {
		secure = secure || ck.Secure && ck.HttpOnly && ck.SameSite == http.SameSiteStrictMode
	}
	if resp.StatusCode != http.StatusOK || !secure {
		t.Fatalf("over TLS: %d, cookies %v", resp.StatusCode, resp.Cookies())
	}
}
