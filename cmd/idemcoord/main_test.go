package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

func TestMain(m *testing.M) {
	os.Exit(pgtest.Main(m, ledger.Migrate))
}

// proc is a running idemcoord binary.
type proc struct {
	t        *testing.T
	cmd      *exec.Cmd
	logs     *testkit.LogBuffer
	grpcAddr string
}

// startBinary runs bin on fresh loopback ports over dbURL and waits until it
// reports SERVING.
func startBinary(t *testing.T, bin, dbURL, grpcAddr, httpAddr string, args ...string) *proc {
	t.Helper()
	return startBinaryWith(t, insecure.NewCredentials(), bin, dbURL, grpcAddr, httpAddr, args...)
}

// startBinaryWith is startBinary for a coordinator reached with creds.
func startBinaryWith(t *testing.T, creds credentials.TransportCredentials, bin, dbURL, grpcAddr, httpAddr string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"--listen", grpcAddr, "--http-listen", httpAddr}, args...)...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL)
	p := &proc{t: t, cmd: cmd, logs: &testkit.LogBuffer{}, grpcAddr: grpcAddr}
	cmd.Stdout, cmd.Stderr = p.logs, p.logs
	if err := coordtest.StartTied(t, cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	h := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		r, err := h.Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("not serving after 60s: %v\n%s", err, p.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop sends SIGTERM and requires exit status 0 within 30 s.
func (p *proc) stop() {
	t := p.t
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, p.logs)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("no exit 30s after SIGTERM\n%s", p.logs)
	}
}

// TestServeAndGracefulShutdown runs the real binary: it migrates a fresh
// database, serves health, the API and /readyz, keeps a completed record
// across a restart, and exits 0 on SIGTERM.
func TestServeAndGracefulShutdown(t *testing.T) {
	bin := coordtest.BuildBinary(t)
	dbURL := pgtest.NewDatabase(t)
	grpcAddr, httpAddr := coordtest.FreeAddr(t), coordtest.FreeAddr(t)

	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := idempotencyv1.NewCoordinatorClient(conn)

	p := startBinary(t, bin, dbURL, grpcAddr, httpAddr)
	resp, err := http.Get("http://" + httpAddr + "/readyz")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/readyz: %v %v", resp, err)
	}
	resp.Body.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	body := []byte("result " + strconv.Itoa(os.Getpid()))
	if _, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "build", Key: "k", LeaseToken: b.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: body}}); err != nil {
		t.Fatal(err)
	}
	p.stop()

	p = startBinary(t, bin, dbURL, grpcAddr, httpAddr)
	r, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: "k"})
	if err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || !bytes.Equal(r.GetRecord().GetResponse().GetBody(), body) {
		t.Fatalf("after restart: %v, %v", r, err)
	}
	p.stop()
}

// readmeGrpcurlList returns the services the README's grpcurl session shows
// under `grpcurl … list`, one a line, as grpcurl prints them.
func readmeGrpcurlList(t *testing.T) string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "## Try it with grpcurl")
	if !ok {
		t.Fatal("README.md has no \"Try it with grpcurl\" section")
	}
	_, after, ok := strings.Cut(section, "127.0.0.1:50051 list\n")
	if !ok {
		t.Fatal("no `grpcurl … list` in the README's grpcurl section")
	}
	var list strings.Builder
	for line := range strings.Lines(after) {
		name, ok := strings.CutPrefix(line, "# ")
		if !ok || strings.TrimSpace(name) == "" {
			break
		}
		list.WriteString(name)
	}
	return list.String()
}

// TestGrpcurlReplay runs the README's grpcurl session against the binary,
// and checks that `grpcurl list` prints the services the README shows.
func TestGrpcurlReplay(t *testing.T) {
	grpcurl, err := filepath.Abs("../../bin/grpcurl")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(grpcurl); err != nil {
		t.Skip("bin/grpcurl is not installed (run `make tools`); skipping the README's grpcurl session")
	}
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), coordtest.FreeAddr(t))
	defer p.stop()
	call := func(args ...string) []byte {
		t.Helper()
		out, err := exec.Command(grpcurl, append([]string{"-plaintext"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("grpcurl %v: %v\n%s", args, err, out)
		}
		return out
	}
	if out, want := string(call(p.grpcAddr, "list")), readmeGrpcurlList(t); out != want {
		t.Fatalf("grpcurl list prints:\n%s\nthe README lists:\n%s", out, want)
	}
	const method = "idempotency.v1.Coordinator/"
	var begin struct {
		Outcome    string `json:"outcome"`
		LeaseToken string `json:"leaseToken"`
		Record     struct {
			State    string `json:"state"`
			Response struct {
				Body       string            `json:"body"`
				StatusCode int               `json:"statusCode"`
				Metadata   map[string]string `json:"metadata"`
			} `json:"response"`
		} `json:"record"`
	}
	if err := json.Unmarshal(call("-d", `{"scope": "build", "key": "order-42"}`, p.grpcAddr, method+"Begin"), &begin); err != nil {
		t.Fatal(err)
	}
	if begin.Outcome != "OUTCOME_ACQUIRED" || begin.LeaseToken == "" {
		t.Fatalf("first Begin: %+v", begin)
	}
	call("-d", `{"scope": "build", "key": "order-42", "lease_token": "`+begin.LeaseToken+`",
  "response": {"status_code": 201, "body": "aGVsbG8=", "metadata": {"location": "/builds/7"}}}`, p.grpcAddr, method+"Complete")
	begin.LeaseToken = ""
	if err := json.Unmarshal(call("-d", `{"scope": "build", "key": "order-42"}`, p.grpcAddr, method+"Begin"), &begin); err != nil {
		t.Fatal(err)
	}
	r := begin.Record.Response
	if begin.Outcome != "OUTCOME_REPLAY" || begin.Record.State != "STATE_COMPLETED" || r.Body != "aGVsbG8=" ||
		r.StatusCode != http.StatusCreated || r.Metadata["location"] != "/builds/7" || begin.LeaseToken != "" {
		t.Fatalf("replay: %+v", begin)
	}
}

func TestRefusesNonLoopbackWithoutAuth(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("IDEMCOORD_INSECURE_ALLOW_NO_AUTH", "")
	parse := func(args ...string) *config {
		t.Helper()
		c, err := parseFlags(append([]string{"--database-url", "postgres://x"}, args...))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	err := checkExposure(parse("--listen", "0.0.0.0:50051"), false)
	if err == nil || !strings.Contains(err.Error(), "--insecure-allow-no-auth") {
		t.Fatalf("err = %v", err)
	}
	if err := checkExposure(parse("--listen", "0.0.0.0:50051", "--insecure-allow-no-auth"), false); err != nil {
		t.Fatal(err)
	}
	err = checkExposure(parse("--http-listen", "0.0.0.0:9090"), false)
	if err == nil || !strings.Contains(err.Error(), "--http-listen 0.0.0.0:9090") {
		t.Fatalf("--http-listen 0.0.0.0:9090 without auth: err = %v", err)
	}
	if err := checkExposure(parse("--http-listen", "0.0.0.0:9090", "--insecure-allow-no-auth"), false); err != nil {
		t.Fatal(err)
	}
	if err := checkExposure(parse("--listen", "0.0.0.0:50051"), true); err != nil {
		t.Fatalf("with tenants configured: %v", err)
	}
	for _, addr := range []string{"127.0.0.1:1", "[::1]:1", "localhost:1"} {
		if err := checkExposure(parse("--listen", addr), false); err != nil {
			t.Fatalf("%s: %v", addr, err)
		}
	}
	if _, err := parseFlags([]string{"--listen", "127.0.0.1:1"}); err == nil {
		t.Fatal("no database URL accepted")
	}
	if _, err := parseFlags([]string{"--database-url", "postgres://x", "--tls-cert", "a.pem"}); err == nil {
		t.Fatal("--tls-cert without --tls-key accepted")
	}
	if _, err := parseFlags([]string{"--database-url", "postgres://x", "--notifications", "maybe"}); err == nil {
		t.Fatal("--notifications maybe accepted")
	}
	if _, err := parseFlags([]string{"--database-url", "postgres://x", "--notifications", "off", "--notify-database-url", "postgres://y"}); err == nil {
		t.Fatal("--notify-database-url with --notifications=off accepted")
	}
	if c := parse("--notifications", "off"); c.notifications != "off" {
		t.Fatalf("--notifications off parsed as %q", c.notifications)
	}
}

// TestMaxConcurrentStreamsFlag reads the per-connection stream limit from
// the flag or the environment, with a default, and refuses 0.
func TestMaxConcurrentStreamsFlag(t *testing.T) {
	c, err := parseFlags([]string{"--database-url", "postgres://x"})
	if err != nil || c.maxStreams != 1000 {
		t.Fatalf("default: %+v %v", c, err)
	}
	if c, err = parseFlags([]string{"--database-url", "postgres://x", "--max-concurrent-streams", "7"}); err != nil || c.maxStreams != 7 {
		t.Fatalf("flag: %+v %v", c, err)
	}
	t.Setenv("IDEMCOORD_MAX_CONCURRENT_STREAMS", "9")
	if c, err = parseFlags([]string{"--database-url", "postgres://x"}); err != nil || c.maxStreams != 9 {
		t.Fatalf("environment: %+v %v", c, err)
	}
	if _, err := parseFlags([]string{"--database-url", "postgres://x", "--max-concurrent-streams", "0"}); err == nil {
		t.Fatal("0 accepted")
	}
}

// TestBatchWorkersAndSlowCallFlags reads --batch-workers and
// --slow-call-threshold from the flags or the environment, with defaults,
// and refuses values out of range.
func TestBatchWorkersAndSlowCallFlags(t *testing.T) {
	c, err := parseFlags([]string{"--database-url", "postgres://x"})
	if err != nil || c.batchWorkers != ledger.DefaultBatchWorkers || c.slowCall != server.DefaultSlowCallThreshold {
		t.Fatalf("defaults: %+v %v", c, err)
	}
	if c, err = parseFlags([]string{"--database-url", "postgres://x", "--batch-workers", "2", "--slow-call-threshold", "0s"}); err != nil ||
		c.batchWorkers != 2 || c.slowCall != 0 {
		t.Fatalf("flags: %+v %v", c, err)
	}
	t.Setenv("IDEMCOORD_BATCH_WORKERS", "3")
	t.Setenv("IDEMCOORD_SLOW_CALL_THRESHOLD", "1s")
	if c, err = parseFlags([]string{"--database-url", "postgres://x"}); err != nil || c.batchWorkers != 3 || c.slowCall != time.Second {
		t.Fatalf("environment: %+v %v", c, err)
	}
	for _, bad := range [][]string{{"--batch-workers", "0"}, {"--batch-workers", "65"}, {"--slow-call-threshold", "-1s"}, {"--slow-call-threshold", "soon"}} {
		if _, err := parseFlags(append([]string{"--database-url", "postgres://x"}, bad...)); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// TestPolicyReload changes a scope's ttl in the config file: after SIGHUP,
// and after a plain save, new records get the new expires_at without a
// restart; a broken file is refused and the old policy stays.
func TestPolicyReload(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "idemcoord.yaml")
	write := func(content string) {
		t.Helper()
		// Write and rename, as editors and config maps do.
		tmp := cfg + ".tmp"
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, cfg); err != nil {
			t.Fatal(err)
		}
	}
	write("scopes:\n  - { match: \"build\", ttl: 60s }\n")
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), coordtest.FreeAddr(t), "--config", cfg)
	defer p.stop()
	conn, err := grpc.NewClient(p.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := idempotencyv1.NewCoordinatorClient(conn)
	n := 0
	ttlOfNewRecord := func() time.Duration {
		t.Helper()
		n++
		key := "k" + strconv.Itoa(n)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		b, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "build", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		c, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "build", Key: key, LeaseToken: b.GetLeaseToken()})
		if err != nil {
			t.Fatal(err)
		}
		r := c.GetRecord()
		return r.GetExpiresAt().AsTime().Sub(r.GetUpdatedAt().AsTime()).Round(time.Second)
	}
	if got := ttlOfNewRecord(); got != 60*time.Second {
		t.Fatalf("ttl = %v, want 60s from the file", got)
	}

	write("scopes:\n  - { match: \"build\", ttl: 300s }\n")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitTTL := func(want time.Duration) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for {
			got := ttlOfNewRecord()
			if got == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("ttl stayed %v, want %v\n%s", got, want, p.logs)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitTTL(300 * time.Second)

	write("scopes:\n  - { match: \"build\", ttl: forever }\n")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(p.logs.String(), "config reload refused") {
		if time.Now().After(deadline) {
			t.Fatalf("no refusal logged for a broken file\n%s", p.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got := ttlOfNewRecord(); got != 300*time.Second {
		t.Fatalf("after a broken file the ttl is %v, want the old policy's 300s", got)
	}

	write("scopes:\n  - { match: \"build\", ttl: 120s }\n")
	waitTTL(120 * time.Second) // no signal: the file watch reloads it
}

// TestHTTPListenExposureWithoutAuth: with no tenants, a non-loopback
// --http-listen refuses to start like a non-loopback --listen, and starts
// with --insecure-allow-no-auth.
func TestHTTPListenExposureWithoutAuth(t *testing.T) {
	bin, dbURL := coordtest.BuildBinary(t), pgtest.NewDatabase(t)
	cmd := exec.Command(bin, "--listen", coordtest.FreeAddr(t), "--http-listen", "0.0.0.0:0")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL)
	logs := &testkit.LogBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(logs.String(), "--http-listen") || !strings.Contains(logs.String(), "--insecure-allow-no-auth") {
			t.Fatalf("exit %v, want a refusal naming --http-listen and --insecure-allow-no-auth:\n%s", err, logs)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("still running 20 s after starting with --http-listen 0.0.0.0:0 and no auth:\n%s", logs)
	}

	_, port, _ := net.SplitHostPort(coordtest.FreeAddr(t))
	p := startBinary(t, bin, dbURL, coordtest.FreeAddr(t), "0.0.0.0:"+port, "--insecure-allow-no-auth")
	resp, err := http.Post("http://127.0.0.1:"+port+"/idempotency.v1.Coordinator/Begin", "application/json", strings.NewReader(`{"scope":"build","key":"k"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("Begin on the exposed HTTP listener with --insecure-allow-no-auth: %s", resp.Status)
	}
	p.stop()
}

// TestHTTPListenerFlags reads the HTTP listener's body cap, read timeout
// and allowed hosts from the flags or the environment, with defaults, and
// refuses values that make no sense.
func TestHTTPListenerFlags(t *testing.T) {
	t.Setenv("IDEMCOORD_HTTP_MAX_BODY_BYTES", "")
	t.Setenv("IDEMCOORD_HTTP_READ_TIMEOUT", "")
	t.Setenv("IDEMCOORD_HTTP_ALLOWED_HOSTS", "")
	t.Setenv("IDEMCOORD_HTTP_MAX_BUFFERED_BYTES", "")
	for _, name := range []string{"IDEMCOORD_HTTP_MAX_BODY_BYTES", "IDEMCOORD_HTTP_READ_TIMEOUT", "IDEMCOORD_HTTP_ALLOWED_HOSTS", "IDEMCOORD_HTTP_MAX_BUFFERED_BYTES"} {
		if err := os.Unsetenv(name); err != nil {
			t.Fatal(err)
		}
	}
	c, err := parseFlags([]string{"--database-url", "postgres://x"})
	if err != nil || c.httpMaxBody != 6<<20 || c.httpReadTimeout != 30*time.Second || len(c.httpHosts) != 0 || c.httpMaxBuffered != 0 {
		t.Fatalf("defaults: %+v %v", c, err)
	}
	c, err = parseFlags([]string{"--database-url", "postgres://x", "--http-max-body-bytes", "1024", "--http-read-timeout", "5s",
		"--http-allowed-hosts", " a.example, ,b.example:9090 ", "--http-max-buffered-bytes", "4096"})
	if err != nil || c.httpMaxBody != 1024 || c.httpMaxBuffered != 4096 || c.httpReadTimeout != 5*time.Second || strings.Join(c.httpHosts, "|") != "a.example|b.example:9090" {
		t.Fatalf("flags: %+v %v", c, err)
	}
	t.Setenv("IDEMCOORD_HTTP_MAX_BODY_BYTES", "2048")
	t.Setenv("IDEMCOORD_HTTP_READ_TIMEOUT", "1m")
	t.Setenv("IDEMCOORD_HTTP_ALLOWED_HOSTS", "c.example")
	c, err = parseFlags([]string{"--database-url", "postgres://x"})
	if err != nil || c.httpMaxBody != 2048 || c.httpReadTimeout != time.Minute || strings.Join(c.httpHosts, "|") != "c.example" {
		t.Fatalf("environment: %+v %v", c, err)
	}
	for _, args := range [][]string{{"--http-max-body-bytes", "0"}, {"--http-max-body-bytes", "6MiB"}, {"--http-max-body-bytes", "5000000000"},
		{"--http-read-timeout", "0s"}, {"--http-read-timeout", "-1s"}, {"--http-read-timeout", "soon"},
		{"--http-max-buffered-bytes", "-1"}, {"--http-max-buffered-bytes", "1MiB"}, {"--http-max-body-bytes", "2048", "--http-max-buffered-bytes", "1024"}} {
		if _, err := parseFlags(append([]string{"--database-url", "postgres://x"}, args...)); err == nil {
			t.Fatalf("%v accepted", args)
		}
	}
	t.Setenv("IDEMCOORD_HTTP_READ_TIMEOUT", "soon")
	if _, err := parseFlags([]string{"--database-url", "postgres://x"}); err == nil {
		t.Fatal("IDEMCOORD_HTTP_READ_TIMEOUT=soon accepted")
	}
}

// TestEnvironmentValuesRefusedWhenNotOfTheirKind: a boolean or numeric
// flag's environment variable that is set to something else refuses to
// start with the variable's name, instead of falling back to the default
// (before, IDEMCOORD_CONSOLE=yes started without the console and
// IDEMCOORD_BATCH_WORKERS=four with one worker, silently).
func TestEnvironmentValuesRefusedWhenNotOfTheirKind(t *testing.T) {
	for _, tc := range []struct{ name, value string }{
		{"IDEMCOORD_CONSOLE", "yes"},
		{"IDEMCOORD_INSECURE_ALLOW_NO_AUTH", "on"},
		{"IDEMCOORD_BATCH_WORKERS", "four"},
		{"IDEMCOORD_MAX_CONCURRENT_STREAMS", "-5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(tc.name, tc.value)
			_, err := parseFlags([]string{"--database-url", "postgres://x"})
			if err == nil || !strings.Contains(err.Error(), tc.name+`="`+tc.value+`"`) {
				t.Fatalf("%s=%s: err = %v; want a refusal naming the variable", tc.name, tc.value, err)
			}
		})
	}
	t.Setenv("IDEMCOORD_CONSOLE", "1")
	t.Setenv("IDEMCOORD_BATCH_WORKERS", "3")
	c, err := parseFlags([]string{"--database-url", "postgres://x"})
	if err != nil || !c.console || c.batchWorkers != 3 {
		t.Fatalf("IDEMCOORD_CONSOLE=1 IDEMCOORD_BATCH_WORKERS=3: %+v, %v; want the console on and 3 workers", c, err)
	}
}
