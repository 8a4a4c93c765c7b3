package doccheck

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemcoord/idemcoord/internal/coordtest"
)

func TestMain(m *testing.M) { os.Exit(coordtest.Main(m)) }

// tokenEnv is the environment variable a runnable Go block reads its
// coordinator token from; a Go block that reads it is run, not only
// compiled.
const tokenEnv = "IDEMCOORD_TOKEN"

// token is the one tenant's token of the coordinators startAuthOn starts.
const token = "doc-snippet-token"

// startAuthOn starts a coordinator with auth on: one tenant, every scope,
// admin, whose token is token.
func startAuthOn(t *testing.T) *coordtest.Coordinator {
	t.Helper()
	sum := sha256.Sum256([]byte(token))
	return coordtest.Start(t, coordtest.Options{Config: fmt.Sprintf(
		"tenants:\n  - { name: docs, token_sha256: %s, scopes: [\"*\"], admin: true }\n", hex.EncodeToString(sum[:]))})
}

// TestGoBlocksRunAgainstAuthOnCoordinator runs every Go block that reads
// IDEMCOORD_TOKEN (with `go run`) against a real coordinator with auth on:
// without the token it must fail, with it it must succeed. So the docs'
// client snippets are known to authenticate, not only to compile.
func TestGoBlocksRunAgainstAuthOnCoordinator(t *testing.T) {
	var runnable []block
	for _, b := range blocksOf(t, "go") {
		if strings.Contains(b.text, `os.Getenv("`+tokenEnv+`")`) && strings.Contains(b.text, `os.Getenv("IDEMCOORD_ADDR")`) {
			runnable = append(runnable, b)
		}
	}
	if len(runnable) == 0 {
		t.Fatal("no Go block reads IDEMCOORD_TOKEN and IDEMCOORD_ADDR: the Go client snippet of docs/go.md should")
	}
	coord := startAuthOn(t)
	dir := docRunDir(t)
	for i, b := range runnable {
		sub := filepath.Join(dir, fmt.Sprintf("b%d", i))
		if err := os.MkdirAll(sub, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(sub, "main.go"), []byte(b.text), 0o644); err != nil {
			t.Fatal(err)
		}
		bin := filepath.Join(sub, "snippet")
		build := exec.Command("go", "build", "-o", bin, "./"+filepath.Join(filepath.Base(dir), filepath.Base(sub)))
		build.Dir = root
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("%s: go build: %v\n%s", b, err, out)
		}
		run := func(token string) (string, error) {
			cmd := exec.Command(bin)
			cmd.Env = append(os.Environ(), "IDEMCOORD_ADDR="+coord.Addr, tokenEnv+"="+token)
			out, err := cmd.CombinedOutput()
			return string(out), err
		}
		if out, err := run(""); err == nil || !strings.Contains(out, "Unauthenticated") {
			t.Errorf("%s: without a token it did not fail UNAUTHENTICATED: %v\n%s", b, err, out)
		}
		if out, err := run(token); err != nil {
			t.Errorf("%s: with the token: %v\n%s", b, err, out)
		} else {
			t.Logf("%s: ran against an auth-on coordinator:\n%s", b, out)
		}
	}
}

// docRunDir is a directory inside the module (so a program built there
// uses this module's go.mod), removed when t ends.
func docRunDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp(root, "_docrun")
	if err == nil {
		dir, err = filepath.Abs(dir)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
