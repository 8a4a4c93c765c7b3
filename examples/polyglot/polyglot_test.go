package polyglot_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
)

func TestMain(m *testing.M) { os.Exit(coordtest.Main(m)) }

// repoRoot is the repository's top directory (tests run in their package's
// directory, examples/polyglot).
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// python is the interpreter the Python caller is written for: Debian's,
// with Debian's python3-grpcio and python3-protobuf.
const python = "/usr/bin/python3"

// replayed matches the line a caller prints after a good replay, naming
// the record it made.
var replayed = regexp.MustCompile(`(?m)^replayed \d+ bytes for ([^/\s]+)/(\S+):`)

// runCaller runs a caller against a fresh coordinator and checks that it
// succeeded and that the record it names is COMPLETED there.
func runCaller(t *testing.T, name string, args ...string) {
	t.Helper()
	c := coordtest.Start(t, coordtest.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, append(args, c.Addr)...)
	cmd.Dir = repoRoot(t)
	cmd.Env = append(os.Environ(), "IDEMCOORD_TOKEN=")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	t.Logf("%s %v:\nstdout:\n%s\nstderr:\n%s", name, args, stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("%s %v: %v", name, args, err)
	}
	m := replayed.FindStringSubmatch(stdout.String())
	if m == nil {
		t.Fatalf("%s %v did not report a replay", name, args)
	}
	resp, err := idempotencyv1.NewCoordinatorClient(c.Dial(t)).Lookup(ctx, &idempotencyv1.LookupRequest{Scope: m[1], Key: m[2]})
	if err != nil || resp.GetRecord().GetState() != idempotencyv1.State_STATE_COMPLETED {
		t.Fatalf("the caller's record %s/%s: %v, %v", m[1], m[2], resp, err)
	}
}

func TestNodeCaller(t *testing.T) {
	t.Parallel()
	node, err := exec.LookPath("node")
	if err != nil {
		missingRuntime(t, "skipping the Node caller: no `node` on PATH; install Node.js (Debian: apt-get install nodejs npm), then `npm ci --prefix examples/node`")
	}
	if _, err := os.Stat(filepath.Join(repoRoot(t), "examples", "node", "node_modules", "@grpc", "grpc-js", "package.json")); err != nil {
		missingRuntime(t, "skipping the Node caller: examples/node/node_modules is missing; install it with `npm ci --prefix examples/node`")
	}
	runCaller(t, node, filepath.Join("examples", "node", "replay.js"))
}

func TestPythonCaller(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat(python); err != nil {
		missingRuntime(t, "skipping the Python caller: no %s; install it with `apt-get install python3 python3-grpcio python3-protobuf`", python)
	}
	if out, err := exec.Command(python, "-c", "import grpc, google.protobuf").CombinedOutput(); err != nil {
		missingRuntime(t, "skipping the Python caller: %s cannot import grpc and protobuf (%s); install them with `apt-get install python3-grpcio python3-protobuf`",
			python, bytes.TrimSpace(out))
	}
	runCaller(t, python, filepath.Join("examples", "python", "replay.py"))
}

// TestDescriptorSetIsFresh fails when idempotency.binpb, which the Node and
// Python callers load the API from, no longer matches what proto/ builds.
func TestDescriptorSetIsFresh(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	buf := filepath.Join(root, "bin", "buf")
	if _, err := os.Stat(buf); err != nil {
		missingRuntime(t, "skipping the descriptor set check: no bin/buf; install the pinned tools with `make tools`")
	}
	fresh := filepath.Join(t.TempDir(), "idempotency.binpb")
	cmd := exec.Command(buf, "build", "--as-file-descriptor-set", "--exclude-source-info", "-o", fresh)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("buf build: %v\n%s", err, out)
	}
	want, err := os.ReadFile(fresh)
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile("idempotency.binpb")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("examples/polyglot/idempotency.binpb is stale: run `bin/buf build --as-file-descriptor-set --exclude-source-info -o examples/polyglot/idempotency.binpb` and commit it")
	}
}

// missingRuntime skips the test for a missing runtime or tool, and fails it
// under CI=true (as .ci/run sets), where README promises that `make test`
// runs the Node and Python callers: a CI machine without them is a broken
// CI machine, not a reason to skip silently.
func missingRuntime(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true, so this fails instead of skipping: "+format, args...)
	}
	t.Skipf(format, args...)
}
