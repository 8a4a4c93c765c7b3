package coordtest

import (
	"net"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// BuildBinary builds the idemcoord server binary (cmd/idemcoord) into a
// temporary directory of t and returns its path, for tests that run it as
// a separate process.
func BuildBinary(t testing.TB) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "idemcoord")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/idemcoord/idemcoord/cmd/idemcoord").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// FreeAddr returns a loopback address whose port was free a moment ago.
func FreeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// StartTied starts cmd (a coordinator binary, say) for t so that it is
// killed if the test binary dies, however it dies (a SIGKILL included),
// instead of running on after it; on Linux only. The caller waits for cmd
// as usual. Once t's cleanup runs, cmd is killed if it is still running.
func StartTied(t testing.TB, cmd *exec.Cmd) error {
	release := make(chan struct{})
	if err := pgtest.StartTied(cmd, syscall.SIGKILL, release); err != nil {
		return err
	}
	t.Cleanup(func() { close(release) })
	return nil
}
