package main

// Tests of the binary as a process: signals (SIGHUP reload, SIGTERM
// finishing a call in flight), start-up before the database answers, the
// TLS and log flags, two coordinators on one database, and `make run`. Each
// runs the real binary.

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
)

// launch starts bin with args and env added to the test's environment,
// without waiting for it to serve.
func launch(t *testing.T, bin string, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	p := &proc{t: t, cmd: cmd, logs: &testkit.LogBuffer{}}
	cmd.Stdout, cmd.Stderr = p.logs, p.logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return p
}

// waitFor polls cond every 50 ms until it holds, failing after a generous
// minute (a condition, not a timing assertion).
func waitFor(t *testing.T, what string, p *proc, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			logs := ""
			if p != nil {
				logs = p.logs.String()
			}
			t.Fatalf("timed out waiting for %s\n%s", what, logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// serving reports whether the gRPC health service at addr answers SERVING
// over creds.
func serving(addr string, creds credentials.TransportCredentials) bool {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return false
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
}

func dialCoordinator(t *testing.T, addr string) idempotencyv1.CoordinatorClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return idempotencyv1.NewCoordinatorClient(conn)
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestSIGHUPReloadsWithoutFileWatch changes the policy in a way the file
// watch cannot see (--config is a symlink into another directory, and the
// file it points to is rewritten in place): only SIGHUP can pick it up.
func TestSIGHUPReloadsWithoutFileWatch(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "real"), 0o755); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(dir, "real", "policy.yaml")
	link := filepath.Join(dir, "idemcoord.yaml")
	if err := os.WriteFile(target, []byte("scopes:\n  - { match: \"build\", ttl: 60s }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), coordtest.FreeAddr(t), "--config", link)
	defer p.stop()
	client := dialCoordinator(t, p.grpcAddr)
	n := 0
	ttlOfNewRecord := func() time.Duration {
		t.Helper()
		n++
		key := "k" + strconv.Itoa(n)
		b, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "build", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		c, err := client.Complete(callCtx(t), &idempotencyv1.CompleteRequest{Scope: "build", Key: key, LeaseToken: b.GetLeaseToken()})
		if err != nil {
			t.Fatal(err)
		}
		r := c.GetRecord()
		return r.GetExpiresAt().AsTime().Sub(r.GetUpdatedAt().AsTime()).Round(time.Second)
	}
	if got := ttlOfNewRecord(); got != 60*time.Second {
		t.Fatalf("ttl = %v, want 60s from the file", got)
	}
	// Rewrite in place (same inode, another directory than the watched one).
	if err := os.WriteFile(target, []byte("scopes:\n  - { match: \"build\", ttl: 300s }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := ttlOfNewRecord(); got != 60*time.Second {
		t.Fatalf("ttl = %v before SIGHUP; the change should be invisible to the file watch", got)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, `"config reloaded" after SIGHUP`, p, func() bool {
		return strings.Contains(p.logs.String(), "config reloaded") && strings.Contains(p.logs.String(), "SIGHUP")
	})
	if got := ttlOfNewRecord(); got != 300*time.Second {
		t.Fatalf("ttl = %v after SIGHUP, want 300s\n%s", got, p.logs)
	}
}

// TestSIGTERMFinishesCallInFlight sends SIGTERM while a Begin is waiting
// (wait=3s) on a held key: the call still answers normally, and the
// process exits 0 afterwards.
func TestSIGTERMFinishesCallInFlight(t *testing.T) {
	httpAddr := coordtest.FreeAddr(t)
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), httpAddr)
	client := dialCoordinator(t, p.grpcAddr)
	if _, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "held"}); err != nil {
		t.Fatal(err)
	}
	type result struct {
		r   *idempotencyv1.BeginResponse
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "held", Wait: durationpb.New(3 * time.Second)})
		done <- result{r, err}
	}()
	// In flight: the server has started a second Begin and finished only one.
	waitFor(t, "the waiting Begin to be in flight", p, func() bool {
		return begins(httpAddr, "grpc_server_started_total") == 2 && begins(httpAddr, "grpc_server_handled_total") == 1
	})
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- p.cmd.Wait() }()
	var res result
	select {
	case res = <-done:
	case <-time.After(time.Minute):
		t.Fatalf("the call in flight never answered\n%s", p.logs)
	}
	if res.err != nil || res.r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS {
		t.Fatalf("call in flight at SIGTERM: %v, %v; want IN_PROGRESS after its wait\n%s", res.r.GetOutcome(), res.err, p.logs)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, p.logs)
		}
	case <-time.After(time.Minute):
		t.Fatalf("no exit after SIGTERM\n%s", p.logs)
	}
	if !strings.Contains(p.logs.String(), "finishing calls in flight") || !strings.Contains(p.logs.String(), "stopped") {
		t.Fatalf("shutdown not logged:\n%s", p.logs)
	}
}

// begins sums the Begin series of a gRPC server metric on /metrics at
// httpAddr (-1 when it cannot be read).
func begins(httpAddr, metric string) int {
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	total := 0
	re := regexp.MustCompile(`(?m)^` + metric + `\{[^}]*grpc_method="Begin"[^}]*\} (\d+)$`)
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		v, _ := strconv.Atoi(m[1])
		total += v
	}
	return total
}

// forward accepts connections on lis and pipes each to target.
func forward(lis net.Listener, target string) {
	for {
		c, err := lis.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			u, err := net.Dial("tcp", target)
			if err != nil {
				return
			}
			defer u.Close()
			go func() { _, _ = io.Copy(u, c) }()
			_, _ = io.Copy(c, u)
		}()
	}
}

// TestStartupWaitsForDatabase starts the binary while nothing listens at
// its database address: it keeps retrying (logged) instead of exiting, and
// serves once the database appears.
func TestStartupWaitsForDatabase(t *testing.T) {
	dbURL := pgtest.NewDatabase(t)
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	realAddr := u.Host
	lateAddr := coordtest.FreeAddr(t)
	u.Host = lateAddr
	grpcAddr := coordtest.FreeAddr(t)
	p := launch(t, coordtest.BuildBinary(t), []string{"DATABASE_URL=" + u.String()},
		"--listen", grpcAddr, "--http-listen", coordtest.FreeAddr(t))
	p.grpcAddr = grpcAddr
	exited := make(chan error, 1)
	go func() { exited <- p.cmd.Wait() }()
	waitFor(t, "two logged retries", p, func() bool {
		select {
		case err := <-exited:
			t.Fatalf("exited while the database was down: %v\n%s", err, p.logs)
		default:
		}
		return strings.Count(p.logs.String(), "database not reachable yet") >= 2
	})
	lis, err := net.Listen("tcp", lateAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	go forward(lis, realAddr)
	waitFor(t, "SERVING once the database is up", p, func() bool { return serving(grpcAddr, insecure.NewCredentials()) })
	client := dialCoordinator(t, grpcAddr)
	if r, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k"}); err != nil ||
		r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("Begin: %v %v", r, err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, p.logs)
		}
	case <-time.After(time.Minute):
		t.Fatalf("no exit after SIGTERM\n%s", p.logs)
	}
}

// TestTLSAndLogFlags runs the binary with --tls-cert/--tls-key,
// --log-format json and --log-level warn: it serves only TLS (a plaintext
// client gets nothing), every log line is JSON, and none is below WARN.
func TestTLSAndLogFlags(t *testing.T) {
	ca := testkit.NewCA(t)
	certFile, keyFile, _ := ca.Issue("server", "idemcoord", "127.0.0.1")
	pool := ca.Pool()
	grpcAddr := coordtest.FreeAddr(t)
	p := launch(t, coordtest.BuildBinary(t), []string{"DATABASE_URL=" + pgtest.NewDatabase(t)},
		"--listen", grpcAddr, "--http-listen", coordtest.FreeAddr(t),
		"--tls-cert", certFile, "--tls-key", keyFile, "--log-format", "json", "--log-level", "warn")
	tlsCreds := credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})
	waitFor(t, "SERVING over TLS", p, func() bool { return serving(grpcAddr, tlsCreds) })
	if serving(grpcAddr, insecure.NewCredentials()) {
		t.Fatal("a plaintext client is served although --tls-cert is set")
	}
	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(tlsCreds))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := idempotencyv1.NewCoordinatorClient(conn)
	if _, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k"}); err != nil {
		t.Fatal(err)
	}
	p.grpcAddr = grpcAddr
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, p.logs)
	}

	lines := 0
	sc := bufio.NewScanner(strings.NewReader(p.logs.String()))
	for sc.Scan() {
		var rec struct {
			Level string `json:"level"`
			Msg   string `json:"msg"`
		}
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("--log-format json wrote a line that is not JSON: %q (%v)", sc.Text(), err)
		}
		if rec.Level != "WARN" && rec.Level != "ERROR" {
			t.Fatalf("--log-level warn logged %s: %q", rec.Level, sc.Text())
		}
		lines++
	}
	if lines == 0 || !strings.Contains(p.logs.String(), "auth disabled") {
		t.Fatalf("the WARN line about auth is missing:\n%s", p.logs)
	}
}

// TestTwoCoordinatorsOneDatabase runs two binaries over one database: a key
// held through one is IN_PROGRESS through the other, concurrent first
// calls through both acquire a key once, and a Begin waiting on one
// coordinator is woken by a Complete through the other (LISTEN/NOTIFY: the
// holder's lease and the wait are both about an hour, so without the
// wake-up it would not answer for that long; the test allows two minutes).
func TestTwoCoordinatorsOneDatabase(t *testing.T) {
	bin := coordtest.BuildBinary(t)
	dbURL := pgtest.NewDatabase(t)
	cfg := filepath.Join(t.TempDir(), "idemcoord.yaml")
	if err := os.WriteFile(cfg, []byte("limits: { max_wait: 1h }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startBinary(t, bin, dbURL, coordtest.FreeAddr(t), coordtest.FreeAddr(t), "--config", cfg)
	defer a.stop()
	bHTTP := coordtest.FreeAddr(t)
	b := startBinary(t, bin, dbURL, coordtest.FreeAddr(t), bHTTP, "--config", cfg)
	defer b.stop()
	ca, cb := dialCoordinator(t, a.grpcAddr), dialCoordinator(t, b.grpcAddr)

	held, err := ca.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Lease: durationpb.New(time.Hour)})
	if err != nil || held.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		t.Fatalf("Begin through A: %v %v", held, err)
	}
	if r, err := cb.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: "k"}); err != nil ||
		r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_IN_PROGRESS {
		t.Fatalf("Begin through B of a key A holds: %v %v", r, err)
	}

	type result struct {
		r   *idempotencyv1.BeginResponse
		err error
	}
	waiter := make(chan result, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
		defer cancel()
		r, err := cb.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "s", Key: "k", Wait: durationpb.New(50 * time.Minute)})
		waiter <- result{r, err}
	}()
	// Complete through A only once B's waiting Begin is in flight.
	waitFor(t, "B's waiting Begin to be in flight", b, func() bool {
		return begins(bHTTP, "grpc_server_started_total") == 2 && begins(bHTTP, "grpc_server_handled_total") == 1
	})
	if _, err := ca.Complete(callCtx(t), &idempotencyv1.CompleteRequest{Scope: "s", Key: "k", LeaseToken: held.GetLeaseToken(),
		Response: &idempotencyv1.StoredResponse{Body: []byte("from A")}}); err != nil {
		t.Fatal(err)
	}
	var w result
	select {
	case w = <-waiter:
	case <-time.After(2 * time.Minute):
		t.Fatalf("B's waiting Begin was not woken by A's Complete\n%s", b.logs)
	}
	if w.err != nil || w.r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || string(w.r.GetRecord().GetResponse().GetBody()) != "from A" {
		t.Fatalf("B's waiting Begin after A's Complete: %v %v", w.r.GetOutcome(), w.err)
	}

	for i := range 20 {
		key := "race-" + strconv.Itoa(i)
		results := make(chan result, 2)
		for _, c := range []idempotencyv1.CoordinatorClient{ca, cb} {
			go func() {
				r, err := c.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "s", Key: key})
				results <- result{r, err}
			}()
		}
		acquired := 0
		for range 2 {
			r := <-results
			if r.err != nil {
				t.Fatal(r.err)
			}
			if r.r.GetOutcome() == idempotencyv1.Outcome_OUTCOME_ACQUIRED {
				acquired++
			}
		}
		if acquired != 1 {
			t.Fatalf("%s: acquired %d times through two coordinators, want once", key, acquired)
		}
	}
}

// TestMakeRun runs scripts/run-local.sh (what `make run` runs) from a copy
// of the script in a temporary root, so its PostgreSQL cluster lands in a
// temporary .data/: the coordinator serves a Begin/Complete/replay, and
// Ctrl-C stops the coordinator and then PostgreSQL.
func TestMakeRun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	_, port, _ := net.SplitHostPort(coordtest.FreeAddr(t))
	runScript(t, "run-local.sh", []string{"IDEMCOORD_PG_PORT=" + port}, []string{filepath.Join(".data", "pg")},
		func(client idempotencyv1.CoordinatorClient) {
			b, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "build", Key: "order-42"})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := client.Complete(callCtx(t), &idempotencyv1.CompleteRequest{Scope: "build", Key: "order-42", LeaseToken: b.GetLeaseToken(),
				Response: &idempotencyv1.StoredResponse{Body: []byte("hello")}}); err != nil {
				t.Fatal(err)
			}
			r, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "build", Key: "order-42"})
			if err != nil || r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || string(r.GetRecord().GetResponse().GetBody()) != "hello" {
				t.Fatalf("replay: %v %v", r, err)
			}
		})
}

// TestMakeRunCitus runs scripts/run-citus.sh (what `make run-citus` runs)
// from a copy in a temporary root: three Citus nodes under a temporary
// .data/citus/, the coordinator serving on the coordinator node with the
// records distributed over both workers, and Ctrl-C stopping the
// coordinator and every node. (Only Begin of new keys is exercised: the
// other statements are not single-shard yet, see docs/scale-out.md.)
func TestMakeRunCitus(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Citus cluster")
	}
	pgtest.RequireCitus(t)
	var ports []string
	for range 3 {
		_, port, _ := net.SplitHostPort(coordtest.FreeAddr(t))
		ports = append(ports, port)
	}
	var nodes []string
	for _, n := range []string{"coordinator", "worker1", "worker2"} {
		nodes = append(nodes, filepath.Join(".data", "citus", n, "pg"))
	}
	runScript(t, "run-citus.sh", []string{"IDEMCOORD_CITUS_PORT=" + ports[0], "IDEMCOORD_CITUS_WORKER_PORTS=" + ports[1] + " " + ports[2]}, nodes,
		func(client idempotencyv1.CoordinatorClient) {
			for i := range 20 {
				key := fmt.Sprintf("order-%d", i)
				b, err := client.Begin(callCtx(t), &idempotencyv1.BeginRequest{Scope: "build", Key: key})
				if err != nil || b.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
					t.Fatalf("Begin %s: %v %v", key, b, err)
				}
			}
			conn, err := pgx.Connect(callCtx(t), "postgres://postgres@127.0.0.1:"+ports[0]+"/idemcoord?sslmode=disable")
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(context.Background())
			// The rows each worker's shards hold, counted on the worker.
			var records, nodesWithRows int
			if err := conn.QueryRow(callCtx(t), `SELECT coalesce(sum(result::int), 0), count(DISTINCT nodeport) FILTER (WHERE result::int > 0)
				FROM run_command_on_placements('idempotency_records', 'SELECT count(*) FROM %s')`).Scan(&records, &nodesWithRows); err != nil {
				t.Fatal(err)
			}
			if records != 20 || nodesWithRows != 2 {
				t.Errorf("records in the workers' shards: %d on %d workers, want 20 on 2", records, nodesWithRows)
			}
		})
}

// runScript runs a copy of scripts/<name> (and the helpers it sources) in
// a temporary root with env added, waits until the coordinator serves,
// calls exercise with a client of it, then sends Ctrl-C and checks that
// the coordinator shut down gracefully and that every data directory of
// dataDirs (relative to the root) was created and its server stopped.
func runScript(t *testing.T, name string, env, dataDirs []string, exercise func(idempotencyv1.CoordinatorClient)) {
	t.Helper()
	root := t.TempDir()
	// As root, the script runs PostgreSQL as the postgres user, which must
	// reach the directories.
	for d := root; d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		_ = os.Chmod(d, 0o755)
	}
	for _, f := range []string{name, filepath.Join("lib", "pgnode.sh")} {
		if err := os.MkdirAll(filepath.Join(root, "scripts", filepath.Dir(f)), 0o755); err != nil {
			t.Fatal(err)
		}
		script, err := os.ReadFile(filepath.Join("..", "..", "scripts", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, "scripts", f), script, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	grpcAddr := coordtest.FreeAddr(t)
	env = append(env, "IDEMCOORD_BIN="+coordtest.BuildBinary(t),
		"IDEMCOORD_LISTEN="+grpcAddr, "IDEMCOORD_HTTP_LISTEN="+coordtest.FreeAddr(t))
	cmd := exec.Command(filepath.Join(root, "scripts", name))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.WaitDelay = 10 * time.Second // PostgreSQL must not keep the output pipe open
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	p := &proc{t: t, cmd: cmd, logs: &testkit.LogBuffer{}, grpcAddr: grpcAddr}
	cmd.Stdout, cmd.Stderr = p.logs, p.logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var waitErr error
	exited := make(chan struct{}) // closed once the script has exited, with waitErr set
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(time.Minute):
				_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
				t.Errorf("%s ignored SIGTERM\n%s", name, p.logs)
			}
		}
	})
	waitFor(t, name+" to serve", p, func() bool {
		select {
		case <-exited:
			t.Fatalf("%s exited: %v\n%s", name, waitErr, p.logs)
		default:
		}
		return serving(grpcAddr, insecure.NewCredentials())
	})
	exercise(dialCoordinator(t, grpcAddr))

	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	var exitErr *exec.ExitError
	select {
	case <-exited:
		if !errors.As(waitErr, &exitErr) || exitErr.ExitCode() != 130 {
			t.Fatalf("%s after Ctrl-C: %v, want exit status 130\n%s", name, waitErr, p.logs)
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("%s did not stop after Ctrl-C\n%s", name, p.logs)
	}
	if !strings.Contains(p.logs.String(), "stopped") {
		t.Fatalf("the coordinator did not shut down gracefully:\n%s", p.logs)
	}
	for _, d := range dataDirs {
		if _, err := os.Stat(filepath.Join(root, d, "postmaster.pid")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("PostgreSQL in %s still running after Ctrl-C (postmaster.pid: %v)\n%s", d, err, p.logs)
		}
		if _, err := os.Stat(filepath.Join(root, d, "PG_VERSION")); err != nil {
			t.Fatalf("no cluster in %s under the temporary root: %v", d, err)
		}
	}
}

// TestScriptsSayWhereTheCoordinatorListens checks coordinator_addrs, with
// which make run, make run-citus and run-ha.sh print the coordinator's
// addresses: the flags passed to the coordinator win over the environment,
// which wins over the defaults, in every spelling the flag package takes.
func TestScriptsSayWhereTheCoordinatorListens(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  []string
		args string
		want string
	}{
		{nil, "", "127.0.0.1:50051 127.0.0.1:9090"},
		{[]string{"IDEMCOORD_LISTEN=10.0.0.1:1", "IDEMCOORD_HTTP_LISTEN=10.0.0.1:2"}, "", "10.0.0.1:1 10.0.0.1:2"},
		{[]string{"IDEMCOORD_LISTEN=10.0.0.1:1"}, "--listen 127.0.0.1:7000 --log-level debug", "127.0.0.1:7000 127.0.0.1:9090"},
		{nil, "-listen=:7001 --http-listen=:7002", ":7001 :7002"},
		{nil, "--http-listen :7003 -http-listen :7004 --listen", "127.0.0.1:50051 :7004"},
	} {
		cmd := exec.Command("bash", "-c", `source scripts/lib/pgnode.sh && coordinator_addrs `+tc.args+` && echo "$grpc_addr $http_addr"`)
		cmd.Dir = filepath.Join("..", "..")
		cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, tc.env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%v %q: %v\n%s", tc.env, tc.args, err, out)
		}
		if got := strings.TrimSpace(string(out)); got != tc.want {
			t.Errorf("%v %q: %q, want %q", tc.env, tc.args, got, tc.want)
		}
	}
}
