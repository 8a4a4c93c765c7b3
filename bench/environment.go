package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemcoord/idemcoord/clients"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
)

const benchDatabase = "idemcoord_bench"

// environment is what the cells run against: the cluster, the coordinator
// process, a gRPC client of it and the baselines' pools.
type environment struct {
	s       *settings
	cluster *pgtest.Cluster
	// workers are, on Citus, the workers (cluster is the coordinator node).
	workers []*pgtest.Cluster
	dbURL   string // the bench database, as the baseline and the driver reach it
	// coordURL, when set, is the coordinator's --database-url instead of
	// dbURL.
	coordURL string
	pgInfo   postgresInfo
	dir      string // the coordinator's config and log

	addr      string // the coordinator's gRPC address
	coord     *exec.Cmd
	coordLog  string
	coordDone chan struct{} // closed when the coordinator has exited
	// coordTie, closed once the coordinator has exited, ends the thread
	// that started it (see startCoordinator).
	coordTie chan struct{}
	conns    []*grpc.ClientConn
	clients  []coordinatorCalls // one per connection, of the -client kind
	stubs    []coordinatorCalls // one per connection, the generated stub (the stub path)
	// floor, while the floor's cells run, is their server (see floor.go).
	floor *floorServer
	// admin runs the bench's own statements (CHECKPOINT, the scale
	// check's loads and counts); baseline and lean are the baselines'
	// pools, open only during their cells.
	admin    *pgxpool.Pool
	baseline *pgxpool.Pool
	lean     *pgxpool.Pool
	payload  payload
}

// postgresInfo describes the server; the durability settings are checked.
type postgresInfo struct {
	Version           string `json:"version"`
	Fsync             string `json:"fsync"`
	SynchronousCommit string `json:"synchronous_commit"`
	FullPageWrites    string `json:"full_page_writes"`
	WalSyncMethod     string `json:"wal_sync_method"`
	SharedBuffers     string `json:"shared_buffers"`
	MaxWalSize        string `json:"max_wal_size"`
	DataOnTmpfs       bool   `json:"data_on_tmpfs"`
}

func startEnvironment(ctx context.Context, s *settings) (_ *environment, err error) {
	e := &environment{s: s, payload: newPayload(s.BodyBytes)}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	if e.dir, err = os.MkdirTemp("", "idemcoord-bench-"); err != nil {
		return nil, err
	}

	logf("starting a durable PostgreSQL cluster")
	if e.cluster, err = pgtest.Launch(pgtest.ClusterOptions{Durable: true}); err != nil {
		return nil, err
	}
	admin, err := pgx.Connect(ctx, e.cluster.URL("postgres"))
	if err != nil {
		return nil, err
	}
	_, err = admin.Exec(ctx, "CREATE DATABASE "+benchDatabase)
	admin.Close(context.WithoutCancel(ctx))
	if err != nil {
		return nil, fmt.Errorf("create database: %w", err)
	}
	e.dbURL = e.cluster.URL(benchDatabase)
	if err := ledger.Migrate(ctx, e.dbURL); err != nil {
		return nil, err
	}

	if e.admin, err = e.openPool(ctx, 4); err != nil {
		return nil, err
	}
	if e.pgInfo, err = checkDurable(ctx, e.admin); err != nil {
		return nil, err
	}
	if err := e.exec(ctx, leanTableSQL); err != nil {
		return nil, fmt.Errorf("create the lean baseline's table: %w", err)
	}
	return e, nil
}

// checkDurable reads the server's settings and refuses a server that could
// acknowledge a commit it would lose in a crash.
func checkDurable(ctx context.Context, pool *pgxpool.Pool) (postgresInfo, error) {
	var pi postgresInfo
	var dataDir string
	for _, q := range []struct {
		name string
		dst  *string
	}{
		{"server_version", &pi.Version}, {"fsync", &pi.Fsync}, {"synchronous_commit", &pi.SynchronousCommit},
		{"full_page_writes", &pi.FullPageWrites}, {"wal_sync_method", &pi.WalSyncMethod},
		{"shared_buffers", &pi.SharedBuffers}, {"max_wal_size", &pi.MaxWalSize}, {"data_directory", &dataDir},
	} {
		if err := pool.QueryRow(ctx, "SELECT current_setting($1)", q.name).Scan(q.dst); err != nil {
			return pi, fmt.Errorf("read %s: %w", q.name, err)
		}
	}
	if pi.Fsync != "on" || pi.SynchronousCommit != "on" || pi.FullPageWrites != "on" {
		return pi, fmt.Errorf("PostgreSQL is not durable (fsync=%s synchronous_commit=%s full_page_writes=%s): refusing to benchmark",
			pi.Fsync, pi.SynchronousCommit, pi.FullPageWrites)
	}
	var st syscall.Statfs_t
	if syscall.Statfs(dataDir, &st) == nil {
		pi.DataOnTmpfs = st.Type == 0x01021994 // TMPFS_MAGIC
	}
	if pi.DataOnTmpfs {
		return pi, fmt.Errorf("the data directory %s is on tmpfs, where fsync costs nothing: unset TMPDIR or point it at a disk", dataDir)
	}
	return pi, nil
}

// startCoordinator starts the coordinator binary with its default settings
// (no config file: the reaper runs every 10 s as in `make run`) on free
// loopback ports,
// waits until its gRPC health says SERVING and dials it.
func (e *environment) startCoordinator(ctx context.Context) error {
	grpcAddr, err := freeAddr()
	if err != nil {
		return err
	}
	httpAddr, err := freeAddr()
	if err != nil {
		return err
	}
	e.coordLog = filepath.Join(e.dir, "idemcoord.log")
	logFile, err := os.Create(e.coordLog)
	if err != nil {
		return err
	}
	defer logFile.Close()
	// The pool size stays the coordinator's own (ledger's default, 32):
	// pool_max_conns in the URL would also reach the migration, whose
	// driver passes it to the server, which refuses it.
	dbURL := e.dbURL
	if e.coordURL != "" {
		dbURL = e.coordURL
	}
	args := append([]string{"--listen", grpcAddr, "--http-listen", httpAddr,
		"--database-url", dbURL, "--log-level", e.s.CoordLogLevel},
		strings.Fields(e.s.CoordFlags)...)
	cmd := exec.Command(e.s.coordinator, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// Dies with this process, whatever ends it: the parent-death signal is
	// tied to a thread kept for it. Set on the thread a goroutine happens
	// to run on, it fired whenever that thread ended, as one does when a
	// goroutine locked to it returns (the Citus nodes' ties do, when the
	// Citus cells stop their cluster): a make bench run lost its
	// coordinator that way before the scale check.
	tie := make(chan struct{})
	if err := pgtest.StartTied(cmd, syscall.SIGKILL, tie); err != nil {
		return fmt.Errorf("start coordinator: %w", err)
	}
	e.coord, e.coordDone, e.coordTie, e.addr = cmd, make(chan struct{}), tie, grpcAddr
	go func() {
		_ = cmd.Wait()
		close(e.coordDone)
	}()
	logf("coordinator PID %d on %s (log %s)", cmd.Process.Pid, grpcAddr, e.coordLog)

	for range e.s.GRPCConns {
		conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		e.conns = append(e.conns, conn)
		e.clients = append(e.clients, newCoordinatorCalls(e.s, conn))
		e.stubs = append(e.stubs, newStub(conn))
	}
	health := healthpb.NewHealthClient(e.conns[0])
	deadline := time.Now().Add(60 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		res, err := health.Check(cctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && res.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		select {
		case <-e.coordDone:
			return fmt.Errorf("coordinator exited during start-up; its log %s ends:\n%s", e.coordLog, tail(e.coordLog))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("coordinator not serving after 60s; its log %s ends:\n%s", e.coordLog, tail(e.coordLog))
		}
	}
}

// Values of -client: what the pairs and replays cells call the coordinator
// through.
const (
	clientStub = "stub" // the generated idempotencyv1.CoordinatorClient
	clientGo   = "go"   // the Go client library: clients.New(conn, goClientOptions(s)...)
)

// coordinatorCalls is what the pairs and replays cells call: the
// coordinator's Begin and Complete, with the signatures of the generated
// idempotencyv1.CoordinatorClient, which the Go client library's
// *clients.Client shares.
type coordinatorCalls interface {
	Begin(ctx context.Context, in *idempotencyv1.BeginRequest, opts ...grpc.CallOption) (*idempotencyv1.BeginResponse, error)
	Complete(ctx context.Context, in *idempotencyv1.CompleteRequest, opts ...grpc.CallOption) (*idempotencyv1.CompleteResponse, error)
}

// newCoordinatorCalls returns the -client of s over one connection.
func newCoordinatorCalls(s *settings, conn *grpc.ClientConn) coordinatorCalls {
	if s.Client == clientGo {
		return clients.New(conn, goClientOptions(s)...)
	}
	return idempotencyv1.NewCoordinatorClient(conn)
}

// clientName names the callers' client of s as the report prints it.
func (s *settings) clientName() string {
	if s.Client == clientGo && s.ClientBatching > 0 {
		return fmt.Sprintf("%s, clients.WithCallBatching(%d)", clientGo, s.ClientBatching)
	}
	return s.Client
}

// goClientOptions are the Go client's options that the flags choose; with
// none, clients.New's defaults.
func goClientOptions(s *settings) []clients.Option {
	if s.ClientBatching > 0 {
		return []clients.Option{clients.WithCallBatching(s.ClientBatching)}
	}
	return nil
}

// client returns the coordinator client of caller w.
func (e *environment) client(w int) coordinatorCalls {
	return e.clients[w%len(e.clients)]
}

// coordinatorAlive returns an error once the coordinator has exited.
func (e *environment) coordinatorAlive() error {
	select {
	case <-e.coordDone:
		return fmt.Errorf("the coordinator exited; its log %s ends:\n%s", e.coordLog, tail(e.coordLog))
	default:
		return nil
	}
}

// coordinatorTotals is what the coordinator used over its whole life.
type coordinatorTotals struct {
	CPUSeconds float64 `json:"cpu_s"`
	MaxRSSMB   float64 `json:"max_rss_mb"`
	ExitCode   int     `json:"exit_code"`
}

// stopCoordinator sends SIGTERM, waits for a graceful exit and returns the
// totals from its rusage.
func (e *environment) stopCoordinator() coordinatorTotals {
	var t coordinatorTotals
	if e.coord == nil {
		return t
	}
	_ = e.coord.Process.Signal(syscall.SIGTERM)
	select {
	case <-e.coordDone:
	case <-time.After(30 * time.Second):
		_ = e.coord.Process.Kill()
		<-e.coordDone
	}
	close(e.coordTie)
	if ps := e.coord.ProcessState; ps != nil {
		t.ExitCode = ps.ExitCode()
		t.CPUSeconds = (ps.UserTime() + ps.SystemTime()).Seconds()
		if ru, ok := ps.SysUsage().(*syscall.Rusage); ok {
			t.MaxRSSMB = float64(ru.Maxrss) / 1024 // KiB on Linux
		}
	}
	e.coord = nil
	return t
}

func (e *environment) close() {
	for _, c := range e.conns {
		_ = c.Close()
	}
	e.stopCoordinator()
	e.stopFloor()
	for _, p := range []*pgxpool.Pool{e.admin, e.baseline, e.lean} {
		if p != nil {
			p.Close()
		}
	}
	if e.cluster != nil {
		if err := e.cluster.Close(); err != nil {
			logf("%v", err)
		}
	}
	if e.dir != "" {
		_ = os.RemoveAll(e.dir)
	}
}

// exec runs one statement on the bench database.
func (e *environment) exec(ctx context.Context, sql string, args ...any) error {
	_, err := e.admin.Exec(ctx, sql, args...)
	return err
}

// checkpoint runs CHECKPOINT on the bench database's server, and on
// Citus on every worker too.
func (e *environment) checkpoint(ctx context.Context) error {
	if err := e.exec(ctx, "CHECKPOINT"); err != nil {
		return err
	}
	for _, w := range e.workers {
		conn, err := pgx.Connect(ctx, w.URL(benchDatabase))
		if err != nil {
			return err
		}
		_, err = conn.Exec(ctx, "CHECKPOINT")
		_ = conn.Close(context.WithoutCancel(ctx))
		if err != nil {
			return err
		}
	}
	return nil
}

// freeAddr returns a loopback address nothing listens on now.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// tail returns the last few KiB of a file.
func tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	const n = 4 << 10
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

var errCoordinatorAnswer = errors.New("unexpected answer")
