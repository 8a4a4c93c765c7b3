package main

import (
	"crypto/tls"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
)

// readmeCurlCommands returns the curl commands of the README's "Try it with
// curl" block, each joined into one line of shell.
func readmeCurlCommands(t *testing.T) []string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "## Try it with curl")
	if !ok {
		t.Fatal("README.md has no \"Try it with curl\" section")
	}
	_, block, ok := strings.Cut(section, "```sh\n")
	if !ok {
		t.Fatal("no sh block in the curl section")
	}
	block, _, _ = strings.Cut(block, "```")
	var cmds []string
	var cur strings.Builder
	for line := range strings.Lines(block) {
		line = strings.TrimRight(line, "\n")
		if cur.Len() == 0 && !strings.HasPrefix(line, "curl ") {
			continue
		}
		cur.WriteString(line + "\n")
		if !strings.HasSuffix(line, `\`) && strings.Count(cur.String(), "'")%2 == 0 {
			cmds = append(cmds, cur.String())
			cur.Reset()
		}
	}
	return cmds
}

// TestCurlSession runs the README's curl session (Begin, Complete, the
// replay, an error) through curl against the real binary's HTTP listener.
func TestCurlSession(t *testing.T) {
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("curl is not installed (.ci/run installs it); skipping the README's curl session")
	}
	cmds := readmeCurlCommands(t)
	if len(cmds) != 4 {
		t.Fatalf("README curl block has %d commands, want 4:\n%s", len(cmds), strings.Join(cmds, "\n"))
	}
	httpAddr := coordtest.FreeAddr(t)
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), httpAddr)
	defer p.stop()

	token := ""
	run := func(cmd string) map[string]any {
		t.Helper()
		cmd = strings.ReplaceAll(cmd, "127.0.0.1:9090", httpAddr)
		cmd = strings.ReplaceAll(cmd, "lt1.…", token)
		out, err := exec.Command("bash", "-c", cmd).Output()
		if err != nil {
			t.Fatalf("%s: %v\n%s", cmd, err, out)
		}
		var m map[string]any
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("%s: answer is not JSON: %v\n%s", cmd, err, out)
		}
		return m
	}
	field := func(m map[string]any, path ...string) any {
		var v any = m
		for _, p := range path {
			mm, _ := v.(map[string]any)
			v = mm[p]
		}
		return v
	}

	m := run(cmds[0])
	token, _ = m["leaseToken"].(string)
	if m["outcome"] != "OUTCOME_ACQUIRED" || !strings.HasPrefix(token, "lt1.") {
		t.Fatalf("1. Begin: %v", m)
	}
	if m = run(cmds[1]); field(m, "record", "state") != "STATE_COMPLETED" {
		t.Fatalf("2. Complete: %v", m)
	}
	m = run(cmds[2])
	if m["outcome"] != "OUTCOME_REPLAY" || field(m, "record", "state") != "STATE_COMPLETED" ||
		field(m, "record", "response", "body") != "aGVsbG8=" || field(m, "record", "response", "statusCode") != 201.0 ||
		field(m, "record", "response", "metadata", "location") != "/builds/7" {
		t.Fatalf("3. replay: %v", m)
	}
	m = run(cmds[3])
	details, _ := m["details"].([]any)
	if m["code"] != "failed_precondition" || len(details) != 1 {
		t.Fatalf("4. error: %v", m)
	}
	d, _ := details[0].(map[string]any)
	if d["type"] != "google.rpc.ErrorInfo" || field(d, "debug", "reason") != "LEASE_LOST" ||
		field(d, "debug", "domain") != "idempotency.v1" {
		t.Fatalf("4. error details: %v", m)
	}
}

// TestHTTPSWithClientCertificate runs the binary with TLS: the HTTP
// listener serves HTTPS with the same certificate, and a client
// certificate names the tenant there as over gRPC.
func TestHTTPSWithClientCertificate(t *testing.T) {
	ca := testkit.NewCA(t)
	serverFile, serverKeyFile, _ := ca.Issue("server", "idemcoord", "127.0.0.1")
	_, _, clientPair := ca.Issue("client", "builds")
	cfg := filepath.Join(t.TempDir(), "idemcoord.yaml")
	if err := os.WriteFile(cfg, []byte("tenants:\n  - { name: builds, client_cert_names: [builds], scopes: [\"build\"] }\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	httpAddr := coordtest.FreeAddr(t)
	cmd := exec.Command(coordtest.BuildBinary(t), "--listen", coordtest.FreeAddr(t), "--http-listen", httpAddr,
		"--config", cfg, "--tls-cert", serverFile, "--tls-key", serverKeyFile, "--tls-client-ca", ca.File())
	cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.NewDatabase(t))
	p := &proc{t: t, cmd: cmd, logs: &testkit.LogBuffer{}}
	cmd.Stdout, cmd.Stderr = p.logs, p.logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	client := func(certs ...tls.Certificate) *http.Client {
		return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool(), Certificates: certs, MinVersion: tls.VersionTLS12}}}
	}
	withCert := client(clientPair)
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := withCert.Get("https://" + httpAddr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready over HTTPS after 60s: %v\n%s", err, p.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
	begin := func(c *http.Client) (int, string) {
		t.Helper()
		resp, err := c.Post("https://"+httpAddr+"/idempotency.v1.Coordinator/Begin", "application/json",
			strings.NewReader(`{"scope":"build","key":"k"}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := begin(withCert); code != http.StatusOK || !strings.Contains(body, "OUTCOME_ACQUIRED") {
		t.Fatalf("with the client certificate: %d %s", code, body)
	}
	if code, body := begin(client()); code != http.StatusUnauthorized || !strings.Contains(body, `"unauthenticated"`) {
		t.Fatalf("without a certificate: %d %s", code, body)
	}
	if resp, err := http.Post("http://"+httpAddr+"/idempotency.v1.Coordinator/Begin", "application/json",
		strings.NewReader(`{"scope":"build","key":"k"}`)); err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("plain HTTP served the API while TLS is on")
		}
	}
	p.stop()
}
