package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

func TestMain(m *testing.M) { os.Exit(coordtest.Main(m)) }

// result is what one idemctl run printed and returned.
type result struct {
	code           int
	stdout, stderr string
}

// idemctl runs the CLI in-process against addr (through IDEMCOORD_ADDR),
// with env adding to the environment it sees.
func idemctl(t *testing.T, addr string, env map[string]string, stdin string, args ...string) result {
	t.Helper()
	getenv := func(k string) string {
		if v, ok := env[k]; ok {
			return v
		}
		if k == "IDEMCOORD_ADDR" {
			return addr
		}
		return ""
	}
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, strings.NewReader(stdin), &out, &errOut, getenv)
	t.Logf("idemctl %s -> %d\n%s%s", strings.Join(args, " "), code, out.String(), errOut.String())
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

func mustRun(t *testing.T, addr string, args ...string) string {
	t.Helper()
	r := idemctl(t, addr, nil, "", args...)
	if r.code != 0 {
		t.Fatalf("idemctl %s: exit %d: %s", strings.Join(args, " "), r.code, r.stderr)
	}
	return r.stdout
}

type env struct {
	t      *testing.T
	coord  *coordtest.Coordinator
	client idempotencyv1.CoordinatorClient
}

func newEnv(t *testing.T, config string) *env {
	c := coordtest.Start(t, coordtest.Options{FakeClock: true, Config: config})
	return &env{t: t, coord: c, client: idempotencyv1.NewCoordinatorClient(c.Dial(t))}
}

func (e *env) begin(ctx context.Context, scope, key string, lease time.Duration) *idempotencyv1.BeginResponse {
	e.t.Helper()
	r, err := e.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: scope, Key: key, Lease: durationpb.New(lease)})
	if err != nil {
		e.t.Fatalf("Begin(%s, %s): %v", scope, key, err)
	}
	return r
}

// tableRows returns the lines of a list table whose first column is scope
// and second is key, split into fields.
func tableRow(t *testing.T, table, scope, key string) []string {
	t.Helper()
	for line := range strings.SplitSeq(table, "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[0] == scope && f[1] == key {
			return f
		}
	}
	return nil
}

// TestResolveCompletedStory is the operator's story through the CLI: a
// holder dies, `idemctl list --state unknown` finds its key, `idemctl
// resolve --as completed --body-file` ends it, and a later Begin replays
// that body.
func TestResolveCompletedStory(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "")
	ctx := context.Background()
	dead := e.begin(ctx, "/payments.v1.Payments/Charge", "order-17", time.Second)
	e.begin(ctx, "/payments.v1.Payments/Charge", "order-18", time.Hour)
	e.coord.Clock.Advance(2 * time.Second) // the first holder's lease ran out

	table := mustRun(t, e.coord.Addr, "list", "--state", "unknown")
	if !strings.HasPrefix(table, "SCOPE") || tableRow(t, table, "/payments.v1.Payments/Charge", "order-17") == nil ||
		tableRow(t, table, "/payments.v1.Payments/Charge", "order-18") != nil {
		t.Fatalf("list --state unknown:\n%s", table)
	}
	if row := tableRow(t, table, "/payments.v1.Payments/Charge", "order-17"); row[2] != "unknown" || row[3] != "1" {
		t.Fatalf("row %q", row)
	}
	// States are case-insensitive; JSON output is a ListRecordsResponse.
	var listed idempotencyv1.ListRecordsResponse
	if err := protojson.Unmarshal([]byte(mustRun(t, e.coord.Addr, "list", "--state", "UNKNOWN", "--output", "json")), &listed); err != nil {
		t.Fatal(err)
	}
	if len(listed.GetRecords()) != 1 || listed.GetRecords()[0].GetKey() != "order-17" || listed.GetRecords()[0].GetState() != idempotencyv1.State_STATE_UNKNOWN {
		t.Fatalf("json list: %v", &listed)
	}

	body := []byte("{\"charge\":\"ch_17\"}\n\x00binary tail")
	bodyFile := filepath.Join(t.TempDir(), "body")
	if err := os.WriteFile(bodyFile, body, 0o600); err != nil {
		t.Fatal(err)
	}
	out := mustRun(t, e.coord.Addr, "resolve", "/payments.v1.Payments/Charge", "order-17", "--as", "completed",
		"--body-file", bodyFile, "--schema-version", "payments.v1.ChargeResponse/3", "--status-code", "201", "--output", "json")
	var rec idempotencyv1.Record
	if err := protojson.Unmarshal([]byte(out), &rec); err != nil {
		t.Fatal(err)
	}
	if rec.GetState() != idempotencyv1.State_STATE_COMPLETED || !bytes.Equal(rec.GetResponse().GetBody(), body) {
		t.Fatalf("resolved: %v", &rec)
	}
	replay, err := e.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "/payments.v1.Payments/Charge", Key: "order-17"})
	if err != nil {
		t.Fatal(err)
	}
	resp := replay.GetRecord().GetResponse()
	if replay.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || !bytes.Equal(resp.GetBody(), body) ||
		resp.GetSchemaVersion() != "payments.v1.ChargeResponse/3" || resp.GetStatusCode() != 201 {
		t.Fatalf("Begin after resolve: %v", replay)
	}
	// The dead holder can no longer finish it.
	_, err = e.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "/payments.v1.Payments/Charge", Key: "order-17", LeaseToken: dead.GetLeaseToken()})
	wantLeaseLost(t, err)

	// Resolving it again fails with the reason, exit status 1.
	r := idemctl(t, e.coord.Addr, nil, "", "resolve", "/payments.v1.Payments/Charge", "order-17", "--as", "retryable")
	if r.code != 1 || !strings.Contains(r.stderr, "FAILED_PRECONDITION") || !strings.Contains(r.stderr, "NOT_UNKNOWN") {
		t.Fatalf("second resolve: %+v", r)
	}

	// lookup shows the record as a table.
	look := mustRun(t, e.coord.Addr, "lookup", "/payments.v1.Payments/Charge", "order-17")
	for _, want := range []string{"state", "completed", "payments.v1.ChargeResponse/3", "201", fmt.Sprintf("%d bytes", len(body))} {
		if !strings.Contains(look, want) {
			t.Errorf("lookup table lacks %q:\n%s", want, look)
		}
	}
}

// TestResolveRetryableAndForget: --as retryable lets the next Begin
// acquire; forget deletes a record; stdin bodies; --limit pages.
func TestResolveRetryableAndForget(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "")
	ctx := context.Background()
	b := e.begin(ctx, "build", "k1", time.Minute)
	if _, err := e.client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "build", Key: "k1", LeaseToken: b.GetLeaseToken(),
		Kind: idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN}); err != nil {
		t.Fatal(err)
	}
	out := mustRun(t, e.coord.Addr, "resolve", "--as", "RETRYABLE", "build", "k1")
	if !strings.Contains(out, "failed_retryable") {
		t.Fatalf("resolve output:\n%s", out)
	}
	next := e.begin(ctx, "build", "k1", time.Minute)
	if next.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED || next.GetPreviousState() != idempotencyv1.State_STATE_FAILED_RETRYABLE {
		t.Fatalf("Begin after resolve --as retryable: %v", next)
	}

	// A body from standard input.
	e.begin(ctx, "build", "k2", time.Second)
	e.coord.Clock.Advance(2 * time.Second)
	r := idemctl(t, e.coord.Addr, nil, "from stdin", "resolve", "build", "k2", "--as", "completed", "--body-file", "-")
	if r.code != 0 {
		t.Fatalf("resolve from stdin: %+v", r)
	}
	if replay := e.begin(ctx, "build", "k2", time.Minute); string(replay.GetRecord().GetResponse().GetBody()) != "from stdin" {
		t.Fatalf("replay: %v", replay)
	}

	// --limit follows pages up to N and says when more follow.
	for i := range 5 {
		e.begin(ctx, "many", fmt.Sprintf("m%d", i), time.Hour)
	}
	table := mustRun(t, e.coord.Addr, "list", "--scope", "many", "--limit", "3")
	if n := strings.Count(table, "\nmany "); n != 3 || !strings.Contains(table, "more records follow") {
		t.Fatalf("list --limit 3 (%d rows):\n%s", n, table)
	}
	table = mustRun(t, e.coord.Addr, "list", "--limit", "0", "--scope", "m*")
	if n := strings.Count(table, "\nmany "); n != 5 || strings.Contains(table, "more records follow") {
		t.Fatalf("list --limit 0 (%d rows):\n%s", n, table)
	}
	table = mustRun(t, e.coord.Addr, "list", "--key-prefix", "m3")
	if n := strings.Count(table, "\nmany "); n != 1 || !strings.Contains(table, "m3") {
		t.Fatalf("list --key-prefix m3 (%d rows):\n%s", n, table)
	}

	// forget deletes; then lookup and forget fail NOT_FOUND.
	var rec idempotencyv1.Record
	if err := protojson.Unmarshal([]byte(mustRun(t, e.coord.Addr, "--output", "json", "forget", "build", "k1")), &rec); err != nil {
		t.Fatal(err)
	}
	if rec.GetKey() != "k1" || rec.GetState() != idempotencyv1.State_STATE_IN_PROGRESS {
		t.Fatalf("forgotten: %v", &rec)
	}
	for _, args := range [][]string{{"lookup", "build", "k1"}, {"forget", "build", "k1"}} {
		if r := idemctl(t, e.coord.Addr, nil, "", args...); r.code != 1 || !strings.Contains(r.stderr, "NOT_FOUND") {
			t.Fatalf("%v after forget: %+v", args, r)
		}
	}
	if a := e.begin(ctx, "build", "k1", time.Minute); a.GetPreviousState() != idempotencyv1.State_STATE_UNSPECIFIED {
		t.Fatalf("Begin after forget: %v", a)
	}
}

// TestListUncertain: `idemctl list --uncertain` lists every record that
// needs a decision: an UNKNOWN one (a lapsed lease included) and an
// uncertain FAILED_RETRYABLE one, which `--state unknown` does not show;
// never a COMPLETED or a plain FAILED_RETRYABLE one.
func TestListUncertain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "")
	ctx := context.Background()
	fail := func(key string, kind idempotencyv1.FailureKind) {
		t.Helper()
		b := e.begin(ctx, "s", key, time.Minute)
		if _, err := e.client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "s", Key: key, LeaseToken: b.GetLeaseToken(),
			Kind: kind}); err != nil {
			t.Fatal(err)
		}
	}
	fail("failed-unknown", idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN)
	fail("uncertain-retryable", idempotencyv1.FailureKind_FAILURE_KIND_UNKNOWN)
	fail("uncertain-retryable", idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE)
	fail("retryable", idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE)
	b := e.begin(ctx, "s", "completed", time.Minute)
	if _, err := e.client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "s", Key: "completed", LeaseToken: b.GetLeaseToken()}); err != nil {
		t.Fatal(err)
	}
	e.begin(ctx, "s", "lapsed", time.Second)
	e.coord.Clock.Advance(2 * time.Second)

	table := mustRun(t, e.coord.Addr, "list", "--uncertain")
	for key, state := range map[string]string{"failed-unknown": "unknown", "lapsed": "unknown", "uncertain-retryable": "failed_retryable"} {
		if row := tableRow(t, table, "s", key); row == nil || row[2] != state {
			t.Errorf("list --uncertain: %s is not listed as %s", key, state)
		}
	}
	for _, key := range []string{"completed", "retryable"} {
		if tableRow(t, table, "s", key) != nil {
			t.Errorf("list --uncertain lists %s", key)
		}
	}
	if n := strings.Count(table, "\ns "); n != 3 {
		t.Errorf("list --uncertain shows %d records, want 3:\n%s", n, table)
	}
	if unknown := mustRun(t, e.coord.Addr, "list", "--state", "unknown"); tableRow(t, unknown, "s", "uncertain-retryable") != nil ||
		tableRow(t, unknown, "s", "lapsed") == nil {
		t.Errorf("list --state unknown:\n%s", unknown)
	}
	if retryable := mustRun(t, e.coord.Addr, "list", "--uncertain", "--state", "FAILED_RETRYABLE"); tableRow(t, retryable, "s", "uncertain-retryable") == nil ||
		tableRow(t, retryable, "s", "failed-unknown") != nil || tableRow(t, retryable, "s", "retryable") != nil {
		t.Errorf("list --uncertain --state failed_retryable:\n%s", retryable)
	}
	if help := mustRun(t, e.coord.Addr, "help"); !strings.Contains(help, "--uncertain lists every record that needs a decision") {
		t.Errorf("help does not explain --uncertain:\n%s", help)
	}
}

// TestUsageErrors: mistakes on the command line exit 2 without calling.
func TestUsageErrors(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"lookup", "only-scope"},
		{"lookup", "s", "k", "extra"},
		{"list", "--state", "bogus"},
		{"list", "--state", "unspecified"},
		{"list", "--limit", "-1"},
		{"list", "--uncertain", "--archived"},
		{"list", "--uncertain", "--state", "completed"},
		{"list", "--output", "yaml"},
		{"resolve", "s", "k"},
		{"resolve", "s", "k", "--as", "done"},
		{"resolve", "s", "k", "--as", "retryable", "--body-file", "x"},
		{"resolve", "s", "k", "--as", "completed", "--status-code", "two"},
		{"forget", "s", "k", "--no-such-flag"},
	} {
		r := idemctl(t, "127.0.0.1:1", nil, "", args...)
		if r.code != 2 || !strings.HasPrefix(r.stderr, "idemctl: ") {
			t.Errorf("idemctl %q: exit %d, stderr %q; want a usage error", args, r.code, r.stderr)
		}
	}
	if r := idemctl(t, "127.0.0.1:1", nil, "", "help"); r.code != 0 || !strings.Contains(r.stdout, "usage: idemctl") {
		t.Errorf("help: %+v", r)
	}
	// A missing body file is an error of the run, not of the usage.
	if r := idemctl(t, "127.0.0.1:1", nil, "", "resolve", "s", "k", "--as", "completed", "--body-file", "/nonexistent/body"); r.code != 1 {
		t.Errorf("missing body file: %+v", r)
	}
}

// TestTokenAndAddress: --token and IDEMCOORD_TOKEN authenticate (Admin and
// Coordinator calls); flags
// override the environment.
func TestTokenAndAddress(t *testing.T) {
	t.Parallel()
	sum := sha256.Sum256([]byte("ops-secret"))
	e := newEnv(t, fmt.Sprintf("tenants:\n  - { name: ops, token_sha256: %s, scopes: [\"*\"], admin: true }\n", hex.EncodeToString(sum[:])))
	if r := idemctl(t, e.coord.Addr, nil, "", "list"); r.code != 1 || !strings.Contains(r.stderr, "UNAUTHENTICATED") {
		t.Fatalf("list without a token: %+v", r)
	}
	if r := idemctl(t, e.coord.Addr, map[string]string{"IDEMCOORD_TOKEN": "ops-secret"}, "", "list"); r.code != 0 {
		t.Fatalf("list with IDEMCOORD_TOKEN: %+v", r)
	}
	if r := idemctl(t, e.coord.Addr, map[string]string{"IDEMCOORD_TOKEN": "wrong"}, "", "list", "--token", "ops-secret"); r.code != 0 {
		t.Fatalf("--token over IDEMCOORD_TOKEN: %+v", r)
	}
	if r := idemctl(t, "127.0.0.1:1", nil, "", "--addr", e.coord.Addr, "--token", "ops-secret", "list"); r.code != 0 {
		t.Fatalf("--addr over IDEMCOORD_ADDR: %+v", r)
	}
	// lookup goes through clients.Client (clients.WithToken): refused
	// without the token, NOT_FOUND (authenticated) with it.
	if r := idemctl(t, e.coord.Addr, nil, "", "lookup", "build", "k1"); r.code != 1 || !strings.Contains(r.stderr, "UNAUTHENTICATED") {
		t.Fatalf("lookup without a token: %+v", r)
	}
	if r := idemctl(t, e.coord.Addr, nil, "", "--token", "ops-secret", "lookup", "build", "k1"); r.code == 0 || !strings.Contains(r.stderr, "NOT_FOUND") {
		t.Fatalf("lookup with the token: %+v", r)
	}
}

// TestBinary builds idemctl and runs it as a program: exit statuses and
// output streams are what a shell sees.
func TestBinary(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "idemctl")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	e := newEnv(t, "")
	e.begin(context.Background(), "build", "dead", time.Second)
	e.coord.Clock.Advance(2 * time.Second)
	runBin := func(args ...string) (int, string, string) {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "IDEMCOORD_ADDR="+e.coord.Addr, "IDEMCOORD_TOKEN=")
		var out, errOut bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		var exit *exec.ExitError
		if err != nil && !errors.As(err, &exit) {
			t.Fatal(err)
		}
		return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
	}
	code, out, _ := runBin("list", "--state", "unknown")
	if code != 0 || tableRow(t, out, "build", "dead") == nil {
		t.Fatalf("list: exit %d\n%s", code, out)
	}
	if code, out, _ = runBin("resolve", "build", "dead", "--as", "retryable"); code != 0 || !strings.Contains(out, "failed_retryable") {
		t.Fatalf("resolve: exit %d\n%s", code, out)
	}
	if code, _, stderr := runBin("lookup", "build", "never"); code != 1 || !strings.Contains(stderr, "NOT_FOUND") {
		t.Fatalf("lookup of a missing key: exit %d, stderr %q", code, stderr)
	}
	if code, _, _ = runBin("list", "--state"); code != 2 {
		t.Fatalf("usage error: exit %d", code)
	}
}

// TestArchivedStory: UNKNOWN records older than their policy's
// unknown_retention are moved to the archive by the reaper (a scope's own
// retention first, the default's later); `idemctl list --archived` shows
// them with the time they were archived, the live listing no longer does,
// and the key is new again.
func TestArchivedStory(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "defaults: {unknown_retention: 48h}\nscopes: [{match: short, unknown_retention: 1h}]")
	ctx := context.Background()
	e.begin(ctx, "short", "a", time.Second)
	e.begin(ctx, "long", "b", time.Second)
	e.coord.Clock.Advance(2 * time.Hour)
	if err := e.coord.Server.ReapOnce(ctx); err != nil {
		t.Fatal(err)
	}
	archived := mustRun(t, e.coord.Addr, "list", "--archived")
	row := tableRow(t, archived, "short", "a")
	if row == nil || row[2] != "unknown" || !strings.Contains(archived, "ARCHIVED") || tableRow(t, archived, "long", "b") != nil {
		t.Fatalf("list --archived after 2h:\n%s", archived)
	}
	live := mustRun(t, e.coord.Addr, "list", "--state", "unknown")
	if tableRow(t, live, "short", "a") != nil || tableRow(t, live, "long", "b") == nil {
		t.Fatalf("list --state unknown after 2h:\n%s", live)
	}
	if r := e.begin(ctx, "short", "a", time.Minute); r.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED ||
		r.GetPreviousState() != idempotencyv1.State_STATE_UNSPECIFIED {
		t.Fatalf("Begin of an archived key: %v", r)
	}

	// long/b became UNKNOWN when the first pass marked it (2h in).
	e.coord.Clock.Advance(48 * time.Hour)
	if err := e.coord.Server.ReapOnce(ctx); err != nil {
		t.Fatal(err)
	}
	var listed idempotencyv1.ListRecordsResponse
	if err := protojson.Unmarshal([]byte(mustRun(t, e.coord.Addr, "list", "--archived", "--output", "json")), &listed); err != nil {
		t.Fatal(err)
	}
	keys := []string{}
	for _, r := range listed.GetRecords() {
		if r.GetArchivedAt() == nil || r.GetState() != idempotencyv1.State_STATE_UNKNOWN {
			t.Fatalf("archived record %v", r)
		}
		keys = append(keys, r.GetScope()+"/"+r.GetKey())
	}
	// short/a was begun again with a 1 min lease: it lapsed 48h ago, past
	// its 1h retention, and is archived a second time.
	if strings.Join(keys, " ") != "long/b short/a short/a" {
		t.Fatalf("archive after 50h: %v", keys)
	}
}

// TestCheckpointShown: lookup shows a record's checkpoint (phase, data
// quoted or in base64, time), and list --checkpoint-phase lists the
// records whose last checkpoint has that phase.
func TestCheckpointShown(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "")
	ctx := context.Background()
	record := func(key, phase string, data []byte) {
		t.Helper()
		b := e.begin(ctx, "s", key, time.Minute)
		if _, err := e.client.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: "s", Key: key, LeaseToken: b.GetLeaseToken(),
			Checkpoint: &idempotencyv1.Checkpoint{Phase: phase, Data: data}}); err != nil {
			t.Fatal(err)
		}
	}
	record("text", "charged", []byte("ch_1\x1b[2J"))
	record("binary", "reserved", []byte{0xff, 0x00, 0x01})
	e.begin(ctx, "s", "none", time.Minute)

	out := mustRun(t, e.coord.Addr, "lookup", "s", "text")
	for _, want := range []string{"checkpoint       charged", `checkpoint data  8 bytes: "ch_1\x1b[2J"`, "checkpoint at    2026-"} {
		if !strings.Contains(out, want) {
			t.Errorf("lookup lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "\x1b") {
		t.Errorf("lookup printed the data's escape sequence raw")
	}
	if out := mustRun(t, e.coord.Addr, "lookup", "s", "binary"); !strings.Contains(out, "3 bytes, base64: /wAB") {
		t.Errorf("lookup of binary data:\n%s", out)
	}
	if out := mustRun(t, e.coord.Addr, "lookup", "s", "none"); !slices.Contains(strings.Split(out, "\n"), "checkpoint      -") {
		t.Errorf("lookup without a checkpoint:\n%s", out)
	}
	table := mustRun(t, e.coord.Addr, "list", "--checkpoint-phase", "charged")
	if tableRow(t, table, "s", "text") == nil || tableRow(t, table, "s", "binary") != nil || tableRow(t, table, "s", "none") != nil {
		t.Errorf("list --checkpoint-phase charged:\n%s", table)
	}
	if out := mustRun(t, e.coord.Addr, "--output", "json", "lookup", "s", "text"); !strings.Contains(strings.Join(strings.Fields(out), ""), `"phase":"charged"`) {
		t.Errorf("lookup --output json:\n%s", out)
	}
}

// TestTableOutputQuotesUnprintableText: a checkpoint phase, key or failure
// reason holding a character a terminal acts on (a bidirectional override,
// ESC) is shown quoted in the table output, never raw.
func TestTableOutputQuotesUnprintableText(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "")
	ctx := context.Background()
	const phase, key = "charged\u202egnippihs", "order\u2028id"
	b := e.begin(ctx, "s", key, time.Minute)
	if _, err := e.client.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: "s", Key: key, LeaseToken: b.GetLeaseToken(),
		Checkpoint: &idempotencyv1.Checkpoint{Phase: phase, Data: []byte("ch_1")}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.Fail(ctx, &idempotencyv1.FailRequest{Scope: "s", Key: key, LeaseToken: b.GetLeaseToken(),
		Kind: idempotencyv1.FailureKind_FAILURE_KIND_RETRYABLE, Reason: "card declined\x1b[2J"}); err != nil {
		t.Fatal(err)
	}
	out := mustRun(t, e.coord.Addr, "lookup", "s", key)
	for _, want := range []string{`checkpoint       "charged\u202egnippihs"`, `key              "order\u2028id"`,
		`failure reason   "card declined\x1b[2J"`} {
		if !strings.Contains(out, want) {
			t.Errorf("lookup lacks %s:\n%s", want, out)
		}
	}
	list := mustRun(t, e.coord.Addr, "list", "--checkpoint-phase", phase)
	if tableRow(t, list, "s", `"order\u2028id"`) == nil {
		t.Errorf("list --checkpoint-phase:\n%s", list)
	}
	for _, raw := range []string{"\u202e", "\u2028", "\x1b"} {
		if strings.Contains(out+list, raw) {
			t.Errorf("idemctl printed %q raw:\n%s\n%s", raw, out, list)
		}
	}
}
