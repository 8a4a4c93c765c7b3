package pgtest

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// StartPgBouncer starts a PgBouncer in transaction pooling mode in front of
// the server that databaseURL names (any database on it, as "postgres"
// without a password) and returns databaseURL rewritten to go through it,
// with default_query_exec_mode=exec added: pgx then runs every statement
// as one unnamed Parse/Bind/Execute, which a transaction pooler cannot
// split across two server connections (named prepared statements, pgx's
// default, need PgBouncer 1.21 or later). It is stopped when t's cleanup
// runs, and killed if the test binary dies first. The test is skipped when
// no pgbouncer binary is installed (Debian: pgbouncer; .ci/run installs
// it).
func StartPgBouncer(t testing.TB, databaseURL string) string {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr != nil {
			t.Skip("pgtest: no pgbouncer installed (Debian: apt-get install pgbouncer)")
		}
		bin = "/usr/sbin/pgbouncer"
	}
	u, err := url.Parse(databaseURL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil {
		t.Fatalf("pgtest: %s: %v", databaseURL, err)
	}
	// Not t.TempDir: its parent is private to this process's user, and
	// pgbouncer runs as postgres when the test runs as root.
	dir, err := os.MkdirTemp("", "pgtest-pgbouncer-")
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	var asUser *user.User
	if os.Geteuid() == 0 { // pgbouncer refuses to run as root
		if asUser, err = user.Lookup("postgres"); err != nil {
			t.Fatalf("pgtest: running as root needs a \"postgres\" system user to run pgbouncer: %v", err)
		}
		uid, _ := strconv.Atoi(asUser.Uid)
		gid, _ := strconv.Atoi(asUser.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatalf("pgtest: %v", err)
		}
	}
	listen, err := freePort()
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
max_client_conn = 500
default_pool_size = 20
ignore_startup_parameters = extra_float_digits,synchronous_commit
logfile = %s
`, host, port, listen, filepath.Join(dir, "users.txt"), filepath.Join(dir, "pgbouncer.log"))
	for name, content := range map[string]string{"pgbouncer.ini": ini, "users.txt": `"postgres" ""` + "\n"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatalf("pgtest: %v", err)
		}
	}
	// As the postgres user from its start (not pgbouncer's own -u, which
	// would switch after the parent-death signal is set and so clear it),
	// in its own process group, and killed if the test binary dies first.
	cmd := exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: credential(asUser)}
	done, err := startTied(cmd, syscall.SIGKILL)
	if err != nil {
		t.Fatalf("pgtest: start pgbouncer: %v", err)
	}
	logTail := func() string {
		b, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
		return string(b)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("pgtest: pgbouncer log:\n%s", logTail())
		}
		_ = cmd.Process.Signal(syscall.SIGINT)
		select {
		case <-done:
		case <-time.After(stopTimeout):
			_ = cmd.Process.Kill()
			<-done
		}
	})

	u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(listen))
	q := u.Query()
	q.Set("default_query_exec_mode", "exec")
	u.RawQuery = q.Encode()
	proxied := u.String()
	deadline := time.Now().Add(startTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		conn, err := pgx.Connect(ctx, proxied)
		if err == nil {
			_ = conn.Close(ctx)
			cancel()
			return proxied
		}
		cancel()
		select {
		case <-done:
			t.Fatalf("pgtest: pgbouncer exited: %s", logTail())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgtest: pgbouncer not ready after %v: %v\n%s", startTimeout, err, logTail())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
