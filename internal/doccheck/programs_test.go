package doccheck

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/internal/coordtest"
)

// The addresses the docs' programs use: the coordinator of `make run` and
// the service of the HTTP page's middleware program. A program run by the
// check gets the test's own addresses in their place.
const (
	docCoordinatorAddr = "127.0.0.1:50051"
	docServiceAddr     = "127.0.0.1:8080"
)

// blocksOn returns the blocks of one page in one language whose text holds
// every one of marks.
func blocksOn(t *testing.T, path, lang string, marks ...string) []block {
	t.Helper()
	var bs []block
	for _, b := range readPage(t, path).blocks {
		if b.lang != lang {
			continue
		}
		all := true
		for _, m := range marks {
			all = all && strings.Contains(b.text, m)
		}
		if all {
			bs = append(bs, b)
		}
	}
	if len(bs) == 0 {
		t.Fatalf("%s: no %s block holds %q: the page's program is gone, or this check is", path, lang, marks)
	}
	return bs
}

// localize points a program at the test's coordinator and service.
func localize(text, coordAddr, serviceAddr string) string {
	text = strings.ReplaceAll(text, docCoordinatorAddr, coordAddr)
	return strings.ReplaceAll(text, docServiceAddr, serviceAddr)
}

// runProgram runs a program with a deadline and the environment given on
// top of the test's own (IDEMCOORD_* of the caller's shell left out).
func runProgram(t *testing.T, dir string, env []string, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMCOORD_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// refusedThenRuns runs a coordinator client program without the token (it
// must fail, refused by auth) and with it (it must succeed).
func refusedThenRuns(t *testing.T, b block, run func(token string) (string, error)) string {
	t.Helper()
	if out, err := run(""); err == nil || !strings.Contains(strings.ToLower(out), "unauthenticated") {
		t.Errorf("%s: without a token it did not fail UNAUTHENTICATED: %v\n%s", b, err, out)
	}
	out, err := run(token)
	if err != nil {
		t.Errorf("%s: with the token: %v\n%s", b, err, out)
	}
	return out
}

// nodeModules returns clients/node's node_modules, which the library needs
// (`npm ci --prefix clients/node`); missing, the test is skipped, or fails
// under CI=true.
func nodeModules(t *testing.T) string {
	t.Helper()
	nm, err := filepath.Abs(filepath.Join(root, "clients", "node", "node_modules"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(nm, "@grpc", "grpc-js")); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("clients/node has no node_modules: run npm ci --prefix clients/node")
		}
		t.Skip("clients/node has no node_modules (npm ci --prefix clients/node); skipping")
	}
	return nm
}

// nodeProject makes a directory in which require('idemcoord') finds
// clients/node, as `npm install /path/to/idemcoord/clients/node` does.
func nodeProject(t *testing.T) string {
	t.Helper()
	nodeModules(t)
	dir := t.TempDir()
	lib, err := filepath.Abs(filepath.Join(root, "clients", "node"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "node_modules"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(lib, filepath.Join(dir, "node_modules", "idemcoord")); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestNodeProgramRunsAgainstAuthOnCoordinator runs the Node page's complete
// program (require('idemcoord'), the token from IDEMCOORD_TOKEN) with node
// against a real coordinator with auth on: refused without the token, run
// with it, and replayed the second time.
func TestNodeProgramRunsAgainstAuthOnCoordinator(t *testing.T) {
	node := lookRuntime(t, "node")
	bs := blocksOn(t, "docs/node.md", "js", "require('idemcoord')", "process.env.IDEMCOORD_TOKEN")
	dir := nodeProject(t)
	coord := startAuthOn(t)
	for i, b := range bs {
		f := filepath.Join(dir, fmt.Sprintf("program%d.js", i))
		if err := os.WriteFile(f, []byte(localize(b.text, coord.Addr, "")), 0o644); err != nil {
			t.Fatal(err)
		}
		run := func(tok string) (string, error) {
			return runProgram(t, dir, []string{"IDEMCOORD_TOKEN=" + tok}, node, f)
		}
		out := refusedThenRuns(t, b, run)
		if !strings.Contains(out, "replayed: false") {
			t.Errorf("%s: the first run did not run the function:\n%s", b, out)
		}
		if out, _ := run(token); !strings.Contains(out, "replayed: true") {
			t.Errorf("%s: the second run was not a replay:\n%s", b, out)
		}
	}
}

// TestPythonProgramRunsAgainstAuthOnCoordinator does the same for the
// Python page's program, with /usr/bin/python3 (Debian's grpcio) and
// clients/python on PYTHONPATH.
func TestPythonProgramRunsAgainstAuthOnCoordinator(t *testing.T) {
	python := lookPython(t, "grpc")
	bs := blocksOn(t, "docs/python.md", "python", "import idemcoord", "IDEMCOORD_TOKEN")
	lib, err := filepath.Abs(filepath.Join(root, "clients", "python"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	coord := startAuthOn(t)
	for i, b := range bs {
		f := filepath.Join(dir, fmt.Sprintf("program%d.py", i))
		if err := os.WriteFile(f, []byte(localize(b.text, coord.Addr, "")), 0o644); err != nil {
			t.Fatal(err)
		}
		run := func(tok string) (string, error) {
			return runProgram(t, dir, []string{"PYTHONPATH=" + lib, "IDEMCOORD_TOKEN=" + tok}, python, f)
		}
		out := refusedThenRuns(t, b, run)
		if !strings.Contains(out, "replayed: False") {
			t.Errorf("%s: the first run did not run the function:\n%s", b, out)
		}
		if out, _ := run(token); !strings.Contains(out, "replayed: True") {
			t.Errorf("%s: the second run was not a replay:\n%s", b, out)
		}
	}
}

// lookPython finds /usr/bin/python3 with the modules given importable;
// missing, the test is skipped, or fails under CI=true.
func lookPython(t *testing.T, modules ...string) string {
	t.Helper()
	python := lookRuntime(t, "/usr/bin/python3")
	for _, m := range modules {
		if err := exec.Command(python, "-c", "import "+m).Run(); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s cannot import %s (Debian: apt-get install python3-%s)", python, m, m)
			}
			t.Skipf("%s cannot import %s; skipping", python, m)
		}
	}
	return python
}

// buildGoBlock builds one Go block as a program of this module.
func buildGoBlock(t *testing.T, b block, text string) string {
	t.Helper()
	dir := docRunDir(t)
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "program")
	build := exec.Command("go", "build", "-o", bin, "./"+filepath.Base(dir))
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("%s: go build: %v\n%s", b, err, out)
	}
	return bin
}

// startService starts the HTTP page's middleware program on addr against
// coord, with the token, and waits until it listens.
func startService(t *testing.T, coord *coordtest.Coordinator, addr string) {
	t.Helper()
	svc := blocksOn(t, "docs/http.md", "go", "clients.HTTPMiddleware(")[0]
	bin := buildGoBlock(t, svc, localize(svc.text, coord.Addr, addr))
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "IDEMCOORD_TOKEN="+token)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := coordtest.StartTied(t, cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("%s: the service's output:\n%s", svc, out.String())
		}
	})
	for deadline := time.Now().Add(30 * time.Second); ; {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the service never listened on %s: %v\n%s", svc, addr, err, out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestHTTPPageClientsAgainstItsMiddleware runs the HTTP page's middleware
// program against a coordinator with auth on, then every client the pages
// show for it (the Go retryablehttp program and the curl session of
// docs/http.md, the Node fetch and the Python requests functions of the
// Node and Python pages): each must get 201, the first created and a retry
// with the same key replayed. So a client that sends another header than
// the service reads fails the check.
func TestHTTPPageClientsAgainstItsMiddleware(t *testing.T) {
	coord := startAuthOn(t)
	addr := coordtest.FreeAddr(t)
	startService(t, coord, addr)

	t.Run("go", func(t *testing.T) {
		b := blocksOn(t, "docs/http.md", "go", "StampIdempotencyKey(")[0]
		bin := buildGoBlock(t, b, localize(b.text, coord.Addr, addr))
		out, err := runProgram(t, filepath.Dir(bin), nil, bin)
		if err != nil || !strings.Contains(out, "201 Created created") {
			t.Errorf("%s: want 201 Created, created: %v\n%s", b, err, out)
		}
	})
	t.Run("curl", func(t *testing.T) {
		lookRuntime(t, "curl")
		b := blocksOn(t, "docs/http.md", "sh", "Idempotency-Key", docServiceAddr)[0]
		// The block once, then its curl again with the same $key, as its
		// comment says; -i to see the headers.
		script := localize(b.text, coord.Addr, addr)
		script = strings.ReplaceAll(script, "curl ", "curl -sS -i ")
		_, curl, _ := strings.Cut(script, "curl ")
		curl = "curl " + curl
		out, err := runProgram(t, t.TempDir(), nil, "bash", "-e", "-c", script+"\necho ---\n"+curl)
		first, second, _ := strings.Cut(out, "---")
		if err != nil || !strings.Contains(first, "HTTP/1.1 201") || !strings.Contains(strings.ToLower(first), "idempotency-result: created") ||
			!strings.Contains(second, "HTTP/1.1 201") || !strings.Contains(strings.ToLower(second), "idempotency-result: replayed") {
			t.Errorf("%s: want 201 created, then 201 replayed: %v\n%s", b, err, out)
		}
	})
	t.Run("node", func(t *testing.T) {
		node := lookRuntime(t, "node")
		b := blocksOn(t, "docs/node.md", "js", "Idempotency-Key", docServiceAddr)[0]
		dir := nodeProject(t)
		if err := os.WriteFile(filepath.Join(dir, "keys.js"), []byte(localize(b.text, coord.Addr, addr)), 0o644); err != nil {
			t.Fatal(err)
		}
		main := `const { createProject } = require('./keys.js');
createProject('Apollo').then(async (res) => {
  console.log(res.status, res.headers.get('idempotency-result'), await res.text());
  if (res.status !== 201) process.exitCode = 1;
}, (err) => { console.error(err); process.exitCode = 1; });
`
		if err := os.WriteFile(filepath.Join(dir, "main.js"), []byte(main), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := runProgram(t, dir, []string{"NODE_PATH=" + nodeModules(t)}, node, "main.js")
		if err != nil || !strings.Contains(out, "201 created") {
			t.Errorf("%s: createProject: want 201 created: %v\n%s", b, err, out)
		}
	})
	t.Run("python", func(t *testing.T) {
		python := lookPython(t, "grpc", "requests")
		b := blocksOn(t, "docs/python.md", "python", "Idempotency-Key", docServiceAddr)[0]
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "keys.py"), []byte(localize(b.text, coord.Addr, addr)), 0o644); err != nil {
			t.Fatal(err)
		}
		main := "import keys\nr = keys.create_project('Apollo')\nprint(r.status_code, r.headers.get('Idempotency-Result'), r.text)\nraise SystemExit(0 if r.status_code == 201 else 1)\n"
		out, err := runProgram(t, dir, nil, python, "-c", main)
		if err != nil || !strings.Contains(out, "201 created") {
			t.Errorf("%s: create_project: want 201 created: %v\n%s", b, err, out)
		}
	})
}

// TestGoInstallFromAClone runs the Go page's install lines (the module
// pointed at this clone) in a module of its own outside the repository and
// builds the page's first program there, as a newcomer's service would.
func TestGoInstallFromAClone(t *testing.T) {
	b := blocksOn(t, "docs/go.md", "sh", "go mod edit")[0]
	clone, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if out, err := runProgram(t, dir, nil, "go", "mod", "init", "example.com/service"); err != nil {
		t.Fatalf("go mod init: %v\n%s", err, out)
	}
	prog := blocksOn(t, "docs/go.md", "go", "clients.New(")[0]
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(prog.text), 0o644); err != nil {
		t.Fatal(err)
	}
	script := strings.ReplaceAll(b.text, "/path/to/idemcoord", clone)
	if out, err := runProgram(t, dir, []string{"GOFLAGS=-mod=mod"}, "bash", "-e", "-c", script); err != nil {
		t.Fatalf("%s: %v\n%s", b, err, out)
	}
	if out, err := runProgram(t, dir, nil, "go", "build", "-o", filepath.Join(dir, "service"), "."); err != nil {
		t.Errorf("%s: the program does not build in a module set up by the page's lines: %v\n%s", prog, err, out)
	}
}
