package coordtest

import (
	"net"
	"os/exec"
	"path/filepath"
	"testing"
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
