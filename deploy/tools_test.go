package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// repoRoot is the repository's root, seen from this package's directory.
const repoRoot = ".."

// tool returns the path of a program the tests run: the file named by the
// environment variable env, else ./bin/name, else name on PATH. Without it
// the test is skipped, or fails under CI=true (`make deploy-check` installs
// helm; Debian's prometheus package brings promtool).
func tool(t *testing.T, env, name, install string) string {
	t.Helper()
	if p := os.Getenv(env); p != "" {
		return p
	}
	if p, err := filepath.Abs(filepath.Join(repoRoot, "bin", name)); err == nil {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("no %s (%s, ./bin or PATH): %s", name, env, install)
	}
	t.Skipf("no %s (%s, ./bin or PATH): %s", name, env, install)
	return ""
}

// coordinator returns the idemcoord binary: IDEMCOORD_BIN, else one built
// from ./cmd/idemcoord into a temporary directory.
func coordinator(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("IDEMCOORD_BIN"); p != "" {
		return p
	}
	bin := filepath.Join(t.TempDir(), "idemcoord")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/idemcoord")
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/idemcoord: %v\n%s", err, out)
	}
	return bin
}
