package polyglot_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/errorinfo"
)

func TestMain(m *testing.M) { os.Exit(coordtest.Main(m)) }

// python is the interpreter the Python library is tested with: Debian's,
// with Debian's python3-grpcio and python3-protobuf.
const python = "/usr/bin/python3"

// repoRoot is the repository's top directory (tests run in clients/polyglot).
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// missing skips the test naming what is missing, or fails it under CI=true,
// where every runtime must be present.
func missingf(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true and %s", msg)
	}
	t.Skip("skipping: " + msg)
}

// nodeReady returns the node binary, or skips (fails under CI) naming what is missing.
func nodeReady(t *testing.T) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		missingf(t, "no `node` on PATH; install Node.js ≥ 18 (Debian: apt-get install nodejs npm), then `npm ci --prefix clients/node`")
	}
	if _, err := os.Stat(filepath.Join(repoRoot(t), "clients", "node", "node_modules", "@grpc", "grpc-js", "package.json")); err != nil {
		missingf(t, "clients/node/node_modules is missing; install it with `npm ci --prefix clients/node`")
	}
	return node
}

// pythonReady skips (fails under CI) naming what is missing.
func pythonReady(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(python); err != nil {
		missingf(t, "no %s; install it with `apt-get install python3 python3-grpcio python3-protobuf`", python)
	}
	if out, err := exec.Command(python, "-c", "import grpc, google.protobuf").CombinedOutput(); err != nil {
		missingf(t, "%s cannot import grpc and protobuf (%s); install them with `apt-get install python3-grpcio python3-protobuf`",
			python, bytes.TrimSpace(out))
	}
}

// startCoordinator starts a coordinator with auth on for one tenant and
// returns the environment that points a suite at it.
func startCoordinator(t *testing.T) []string {
	t.Helper()
	var raw [24]byte
	_, _ = rand.Read(raw[:])
	token := hex.EncodeToString(raw[:])
	sum := sha256.Sum256([]byte(token))
	c := coordtest.Start(t, coordtest.Options{Config: "tenants:\n  - name: clients-test\n    token_sha256: " +
		hex.EncodeToString(sum[:]) + "\n    scopes: [\"*\"]\n"})
	return append(os.Environ(), "IDEMCOORD_ADDR="+c.Addr, "IDEMCOORD_TOKEN="+token)
}

// runSuite runs a library's test suite in dir and fails when it fails.
func runSuite(t *testing.T, dir string, env []string, name string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir, cmd.Env = dir, env
	out, err := cmd.CombinedOutput()
	t.Logf("%s %s in %s:\n%s", name, strings.Join(args, " "), dir, out)
	if err != nil {
		t.Fatalf("%s %s: %v", name, strings.Join(args, " "), err)
	}
}

func TestNodeClient(t *testing.T) {
	t.Parallel()
	nodeReady(t)
	npm, err := exec.LookPath("npm")
	if err != nil {
		missingf(t, "no `npm` on PATH; install it (Debian: apt-get install npm)")
	}
	runSuite(t, filepath.Join(repoRoot(t), "clients", "node"), startCoordinator(t), npm, "test")
}

func TestPythonClient(t *testing.T) {
	t.Parallel()
	pythonReady(t)
	runSuite(t, filepath.Join(repoRoot(t), "clients", "python"), startCoordinator(t), python, "-m", "unittest", "discover", "-v")
}

// TestExpressExample runs examples/express's test (its dependencies from
// `npm ci --prefix examples/express`).
func TestExpressExample(t *testing.T) {
	t.Parallel()
	nodeReady(t)
	npm, err := exec.LookPath("npm")
	if err != nil {
		missingf(t, "no `npm` on PATH; install it (Debian: apt-get install npm)")
	}
	dir := filepath.Join(repoRoot(t), "examples", "express")
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "express", "package.json")); err != nil {
		missingf(t, "examples/express/node_modules is missing; install it with `npm ci --prefix examples/express`")
	}
	runSuite(t, dir, startCoordinator(t), npm, "test")
}

// TestFastAPIExample runs examples/fastapi's test with Debian's FastAPI.
func TestFastAPIExample(t *testing.T) {
	t.Parallel()
	pythonReady(t)
	if out, err := exec.Command(python, "-c", "import fastapi, uvicorn, httpx").CombinedOutput(); err != nil {
		missingf(t, "%s cannot import fastapi, uvicorn and httpx (%s); install them with `apt-get install python3-fastapi python3-uvicorn python3-httpx`",
			python, bytes.TrimSpace(out))
	}
	runSuite(t, filepath.Join(repoRoot(t), "examples", "fastapi"), startCoordinator(t), python, "-m", "unittest", "-v")
}

// names are project names on which the languages' own string functions
// disagree; each library must still give Go's key.
var names = []string{"\uFEFFFlower Shop", "Flower\u0085Shop", "DİYARBAKIR", "ΟΔΟΣ ΣΟΦΟΣ", "Cafe\u0301", "A\u001cB", "🌸  x"}

// TestDedupKeyAcrossLanguages asks Node (require('./clients/node') from the
// repository root) and Python (idemcoord with clients/python on sys.path)
// for the keys of names and compares them with clients.DedupKey.
func TestDedupKeyAcrossLanguages(t *testing.T) {
	t.Parallel()
	want := make([]string, len(names))
	for i, n := range names {
		want[i] = clients.DedupKey("create-project", "u1", "", n)
	}
	in, err := json.Marshal(names)
	if err != nil {
		t.Fatal(err)
	}
	check := func(t *testing.T, name string, args ...string) {
		cmd := exec.Command(name, args...)
		cmd.Dir, cmd.Stdin = repoRoot(t), bytes.NewReader(in)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var got []string
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("%s printed %q: %v", name, out, err)
		}
		for i := range names {
			if i >= len(got) || got[i] != want[i] {
				t.Errorf("%s: key of %+q = %v, Go's is %q", name, names[i], got, want[i])
			}
		}
	}
	t.Run("node", func(t *testing.T) {
		node := nodeReady(t)
		check(t, node, "-e", `const {dedupKey} = require('./clients/node');
const names = JSON.parse(require('fs').readFileSync(0, 'utf8'));
console.log(JSON.stringify(names.map((n) => dedupKey('create-project', 'u1', '', n))));`)
	})
	t.Run("python", func(t *testing.T) {
		pythonReady(t)
		check(t, python, "-c", `import json, sys
sys.path.insert(0, "clients/python")
import idemcoord
names = json.load(sys.stdin)
print(json.dumps([idemcoord.dedup_key("create-project", "u1", "", n) for n in names]))`)
	})
}

// TestErrorReasonsAcrossLanguages: Go's generated enum ErrorReason, and the
// descriptor sets Node and Python load, give the same ErrorInfo reasons,
// and each library's UNKNOWN_HELD constant is one of them.
func TestErrorReasonsAcrossLanguages(t *testing.T) {
	t.Parallel()
	var want []string
	for n := range idempotencyv1.ErrorReason_name {
		if r := idempotencyv1.ErrorReason(n); r != idempotencyv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
			want = append(want, errorinfo.Reason(r))
		}
	}
	slices.Sort(want)
	held := errorinfo.Reason(idempotencyv1.ErrorReason_ERROR_REASON_UNKNOWN_HELD)
	if clients.ReasonUnknownHeld != held {
		t.Errorf("clients.ReasonUnknownHeld = %q, want %q", clients.ReasonUnknownHeld, held)
	}
	check := func(t *testing.T, name string, args ...string) {
		cmd := exec.Command(name, args...)
		cmd.Dir = repoRoot(t)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var got struct {
			Reasons     []string `json:"reasons"`
			UnknownHeld string   `json:"unknown_held"`
		}
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("%s printed %q: %v", name, out, err)
		}
		slices.Sort(got.Reasons)
		if !slices.Equal(got.Reasons, want) {
			t.Errorf("%s: reasons %q, Go's enum gives %q", name, got.Reasons, want)
		}
		if got.UnknownHeld != held {
			t.Errorf("%s: REASON_UNKNOWN_HELD = %q, want %q", name, got.UnknownHeld, held)
		}
	}
	t.Run("node", func(t *testing.T) {
		node := nodeReady(t)
		check(t, node, "-e", `const {REASONS, REASON_UNKNOWN_HELD} = require('./clients/node');
console.log(JSON.stringify({reasons: Object.values(REASONS), unknown_held: REASON_UNKNOWN_HELD}));`)
	})
	t.Run("python", func(t *testing.T) {
		pythonReady(t)
		check(t, python, "-c", `import json, sys
sys.path.insert(0, "clients/python")
import idemcoord
print(json.dumps({"reasons": sorted(idemcoord.REASONS), "unknown_held": idemcoord.REASON_UNKNOWN_HELD}))`)
	})
}

// pythonWheelProgram runs in a fresh venv where only the wheel provides
// idemcoord: it checks that the package, its descriptor set and its
// shared tables come from the venv, then Begin, Complete and a replay
// against the coordinator.
const pythonWheelProgram = `import os, sys, uuid
import idemcoord
from idemcoord import _api, _tables
venv = sys.prefix
for path in (idemcoord.__file__, _api.DESCRIPTORS, _tables.TABLES_FILE):
    assert path.startswith(venv), "%s is not inside the venv %s" % (path, venv)
    assert os.path.exists(path), path
assert os.path.exists(os.path.join(os.path.dirname(idemcoord.__file__), "py.typed"))
with idemcoord.Client(os.environ["IDEMCOORD_ADDR"], token=os.environ["IDEMCOORD_TOKEN"]) as client:
    key = "wheel-" + uuid.uuid4().hex
    res = client.begin(scope="wheel", key=key, fingerprint=b"fp")
    assert res.outcome == idemcoord.Outcome.OUTCOME_ACQUIRED, res
    client.complete(scope="wheel", key=key, lease_token=res.lease_token, response={"body": b"made"})
    again = client.once("wheel", key, b"fp", lambda attempt: {"body": b"made twice"})
    assert again.replayed and bytes(again.response.body) == b"made", again
print("wheel ok: replayed", bytes(again.response.body))
`

// TestPythonWheel builds the Python library's wheel from pyproject.toml
// offline (Debian's python3-build, --no-isolation), installs it into a
// fresh venv that sees Debian's grpcio and protobuf, and runs a program
// against a coordinator from outside the source tree.
func TestPythonWheel(t *testing.T) {
	t.Parallel()
	pythonReady(t)
	if out, err := exec.Command(python, "-c", "import build, venv, ensurepip").CombinedOutput(); err != nil {
		missingf(t, "%s cannot build wheels or venvs (%s); install them with `apt-get install python3-build python3-venv`",
			python, bytes.TrimSpace(out))
	}
	src, tmp := filepath.Join(repoRoot(t), "clients", "python"), t.TempDir()
	// Build from a copy: setuptools writes build/ and *.egg-info beside pyproject.toml.
	pkg := filepath.Join(tmp, "src")
	if err := os.CopyFS(pkg, os.DirFS(src)); err != nil {
		t.Fatal(err)
	}
	run := func(dir string, env []string, name string, args ...string) string {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Dir, cmd.Env = dir, env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	dist, venv := filepath.Join(tmp, "dist"), filepath.Join(tmp, "venv")
	run(pkg, os.Environ(), python, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, ".")
	wheels, _ := filepath.Glob(filepath.Join(dist, "idemcoord-*.whl"))
	if len(wheels) != 1 {
		t.Fatalf("want one wheel in %s, got %v", dist, wheels)
	}
	run(tmp, os.Environ(), python, "-m", "venv", "--system-site-packages", venv)
	vpython := filepath.Join(venv, "bin", "python")
	run(tmp, os.Environ(), vpython, "-m", "pip", "install", "--no-index", "--no-deps", wheels[0])
	out := run(tmp, startCoordinator(t), vpython, "-c", pythonWheelProgram)
	if !strings.Contains(out, "wheel ok") {
		t.Fatalf("the program did not finish: %s", out)
	}
	t.Logf("%s", out)
}
