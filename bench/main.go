// Command bench measures the idemcoord coordinator against the floor set by
// PostgreSQL itself. `make bench` runs it (`make bench-quick`, or
// BENCH_QUICK=1, a shorter run); `go run ./bench -h` lists its flags, each
// of which an environment variable (in brackets) can also set.
//
// It starts a durable PostgreSQL cluster (fsync, synchronous_commit and
// full_page_writes on; it refuses to run otherwise) and the coordinator
// binary with its default settings (as `make run` starts it: info logging,
// the reaper every 10 s) as a separate process talking gRPC over loopback,
// and measures at each concurrency:
//
//   - pairs/s: Begin on a new key then Complete, through gRPC (-client
//     says through which client);
//   - replays/s: Begin on a COMPLETED key;
//   - lean baseline pairs/s: the table a user would write by hand (primary
//     key only, no trigger) and the two statements a user would write (INSERT …
//     ON CONFLICT DO NOTHING RETURNING, UPDATE fenced by the lease token),
//     each its own autocommit statement, from this process through one
//     pgx pool of as many connections as callers. Its cells alternate with
//     the pairs cells (lean, pairs, lean, pairs, … for -rounds rounds), so
//     both see the same machine;
//   - baseline pairs/s: the same two durable writes on the coordinator's
//     own migrated table (its trigger and reaper indexes included) with a
//     pool of the coordinator's size, measured before the coordinator
//     starts (its LISTEN connection would otherwise receive every one of
//     the trigger's notifications);
//   - latency percentiles of every call, CPU seconds per 1000 pairs of the
//     coordinator, of PostgreSQL and of this driver (the lean baseline's
//     client), from /proc, and the coordinator's peak RSS (VmHWM, reset
//     before each cell through /proc/<pid>/clear_refs).
//
// Then the other ways of calling the coordinator (-paths), and with the
// generated stub its floor: the same callers against a grpc-go server of
// canned answers (bench/internal/floor), what grpc-go itself allows unary
// callers on the machine. Then replays/s measured by ghz, a third-party
// load generator, and a scale check: Begin latency and pairs/s on an empty
// table and after bulk-loading millions of records, the cost of the
// idempotency_records gauge at that size (and of the whole-table count it
// replaced), and the coordinator's own reaper, at its default settings,
// working through a backlog of records to expire and to delete while
// pairs run. It prints one table
// with the goals (speed, scale, footprint) marked met or not, and writes it as
// JSON to <out>/<UTC timestamp>.json and <out>/latest.json.
//
// Every cell runs for a fixed time after a warm-up and starts with a
// CHECKPOINT.
package main

import (
	"context"
	"debug/buildinfo"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	if served, err := serveFloor(os.Args[1:]); served {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// settings are the knobs of one run; they are recorded in the JSON report.
type settings struct {
	Concurrency      []int         `json:"concurrency"`
	Warmup           time.Duration `json:"-"`
	Duration         time.Duration `json:"-"`
	WarmupSeconds    float64       `json:"warmup_s"`
	DurationSeconds  float64       `json:"duration_s"`
	PoolConns        int           `json:"pool_max_conns"`
	GRPCConns        int           `json:"grpc_conns"`
	BodyBytes        int           `json:"body_bytes"`
	ReplayKeys       int           `json:"replay_keys"`
	GhzConcurrency   int           `json:"ghz_concurrency"`
	ScaleRecords     int           `json:"scale_records"`
	ScaleConcurrency int           `json:"scale_concurrency"`
	// Rounds is how many lean, pairs cell pairs run at each concurrency.
	Rounds int `json:"rounds"`
	// Client is what the callers of the pairs and replays cells call the
	// coordinator through (-client).
	Client string `json:"client"`
	// ClientBatching is -client go's clients.WithCallBatching (0: none).
	ClientBatching int `json:"client_batching,omitempty"`
	// Paths are the other ways of calling the coordinator measured in the
	// same run (-paths; see paths.go), at PathConcurrency callers.
	Paths           []string `json:"paths,omitempty"`
	PathConcurrency []int    `json:"paths_concurrency,omitempty"`
	// Quick marks a short run (fewer cells, shorter ones): its figures are
	// rougher and the 10M-record goals are not measured.
	Quick bool `json:"quick,omitempty"`
	// Citus runs the pairs and replays cells on a Citus cluster too
	// (-citus; see citus.go).
	Citus         bool   `json:"citus,omitempty"`
	CoordLogLevel string `json:"coordinator_log_level"`
	CoordFlags    string `json:"coordinator_flags,omitempty"`
	// Commit is the revision the coordinator was built from, "-dirty" when
	// its tree had changes.
	Commit string `json:"commit,omitempty"`

	coordinator string
	ghz         string
	out         string
	hold        bool
	render      string
}

func parseFlags(args []string) (*settings, error) {
	s := &settings{}
	// A quick run changes the defaults; flags and variables still win.
	s.Quick = os.Getenv("BENCH_QUICK") != "" && os.Getenv("BENCH_QUICK") != "0"
	for _, a := range args {
		if a == "-quick" || a == "--quick" || a == "-quick=true" || a == "--quick=true" {
			s.Quick = true
		}
	}
	defConc, defWarmup, defDuration, defScale, defGhz := "1,16,64,256", time.Second, 6*time.Second, 10_000_000, "bin/ghz"
	if s.Quick {
		defConc, defWarmup, defDuration, defScale, defGhz = "16,64,256", 500*time.Millisecond, 2*time.Second, 200_000, ""
	}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.BoolVar(&s.Quick, "quick", s.Quick, "a run of a minute or two: callers 16,64,256, 0.5s+2s cells, 200k scale records, no ghz (BENCH_QUICK=1)")
	conc := fs.String("concurrency", env("BENCH_CONCURRENCY", defConc), "comma-separated numbers of concurrent callers (BENCH_CONCURRENCY)")
	fs.DurationVar(&s.Warmup, "warmup", envDuration("BENCH_WARMUP", defWarmup), "warm-up before each measured cell (BENCH_WARMUP)")
	fs.DurationVar(&s.Duration, "duration", envDuration("BENCH_DURATION", defDuration), "measured time of each cell (BENCH_DURATION)")
	fs.IntVar(&s.Rounds, "rounds", envInt("BENCH_ROUNDS", 2), "lean-baseline and pairs cells alternated at each concurrency, each this many times (BENCH_ROUNDS)")
	fs.IntVar(&s.PoolConns, "pool", envInt("BENCH_POOL", 32), "connections of the coordinator's-table baseline's pool; keep it equal to the coordinator's (ledger's default, 32) (BENCH_POOL)")
	fs.IntVar(&s.GRPCConns, "grpc-conns", envInt("BENCH_GRPC_CONNS", 1), "gRPC connections the callers share (BENCH_GRPC_CONNS)")
	fs.StringVar(&s.Client, "client", env("BENCH_CLIENT", clientGo), "what the pairs and replays callers call the coordinator through: "+
		clientStub+" (the generated idempotencyv1 client) or "+clientGo+" (the Go client library, clients.New), one per connection (BENCH_CLIENT)")
	fs.IntVar(&s.ClientBatching, "client-batching", envInt("BENCH_CLIENT_BATCHING", 2), "with -client go: the Go client's clients.WithCallBatching, "+
		"how many Batch RPCs its calls share at a time (0: every call unary; must be 0 with -client stub) (BENCH_CLIENT_BATCHING)")
	paths := fs.String("paths", env("BENCH_PATHS", "stub,node,python"), "other ways of calling the coordinator measured in the same run, "+
		"pairs and replays each: stub (the generated client, one unary RPC per call; with it, the same callers against grpc-go alone, "+
		"the floor rows), node and python (their libraries' clients, "+
		"with call batching as -client-batching says, driven by clients/node/bench and clients/python/bench); empty for none (BENCH_PATHS)")
	pathConc := fs.String("paths-concurrency", env("BENCH_PATHS_CONCURRENCY", "64,256"), "callers of the -paths cells (BENCH_PATHS_CONCURRENCY)")
	fs.BoolVar(&s.Citus, "citus", env("BENCH_CITUS", "1") != "0", "after the single PostgreSQL's cells, run pairs and replays at the -paths-concurrency callers "+
		"on a durable Citus cluster (a coordinator node and two workers), through the coordinator node's URL and through a URL spreading the connections over every node; "+
		"reported not measured when the citus extension is not installed (BENCH_CITUS=0 turns it off)")
	fs.IntVar(&s.BodyBytes, "body-bytes", envInt("BENCH_BODY_BYTES", 150), "size of the stored response body (BENCH_BODY_BYTES)")
	fs.IntVar(&s.ReplayKeys, "replay-keys", envInt("BENCH_REPLAY_KEYS", 1024), "COMPLETED keys the replay cells cycle through (BENCH_REPLAY_KEYS)")
	fs.IntVar(&s.GhzConcurrency, "ghz-concurrency", envInt("BENCH_GHZ_CONCURRENCY", 64), "concurrency of the ghz replay row (BENCH_GHZ_CONCURRENCY)")
	fs.IntVar(&s.ScaleRecords, "scale-records", envInt("BENCH_SCALE_RECORDS", defScale), "records bulk-loaded for the scale check; 0 skips it (BENCH_SCALE_RECORDS)")
	fs.IntVar(&s.ScaleConcurrency, "scale-concurrency", envInt("BENCH_SCALE_CONCURRENCY", 16), "callers of the scale check's cells (BENCH_SCALE_CONCURRENCY)")
	fs.StringVar(&s.CoordLogLevel, "coordinator-log-level", env("BENCH_COORDINATOR_LOG_LEVEL", "info"), "the coordinator's --log-level; at info, as in production, failed and slow calls are logged (every call with -coordinator-flags=--slow-call-threshold=0s) (BENCH_COORDINATOR_LOG_LEVEL)")
	fs.StringVar(&s.CoordFlags, "coordinator-flags", env("BENCH_COORDINATOR_FLAGS", ""), "more flags for the coordinator, separated by spaces (BENCH_COORDINATOR_FLAGS)")
	fs.StringVar(&s.coordinator, "coordinator", env("BENCH_COORDINATOR", "bin/idemcoord"), "coordinator binary built from ./cmd/idemcoord (BENCH_COORDINATOR)")
	fs.StringVar(&s.ghz, "ghz", env("BENCH_GHZ", defGhz), "ghz binary; empty skips the ghz row (BENCH_GHZ)")
	fs.StringVar(&s.Commit, "commit", env("BENCH_COMMIT", ""), "the commit the coordinator was built from (default: read from the binary's build info) (BENCH_COMMIT)")
	fs.BoolVar(&s.hold, "hold", false, "after the report, keep PostgreSQL (with the scale check's records) running until interrupted, for EXPLAIN and psql")
	fs.StringVar(&s.out, "out", env("BENCH_OUT", "bench/results"), "directory of the JSON reports (BENCH_OUT)")
	fs.StringVar(&s.render, "render", "", "print the table of a JSON report an earlier run wrote (bench/results/*.json) and exit; measures nothing")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var err error
	if s.Concurrency, err = parseCounts("-concurrency", *conc); err != nil {
		return nil, err
	}
	if s.Paths, err = parsePaths(*paths); err != nil {
		return nil, err
	}
	if s.PathConcurrency, err = parseCounts("-paths-concurrency", *pathConc); err != nil {
		return nil, err
	}
	switch {
	case s.Duration <= 0 || s.Warmup < 0:
		return nil, errors.New("-duration must be positive and -warmup not negative")
	case s.Rounds < 1 || s.PoolConns < 1 || s.GRPCConns < 1 || s.ReplayKeys < 1 || s.GhzConcurrency < 1 || s.ScaleConcurrency < 1:
		return nil, errors.New("-rounds, -pool, -grpc-conns, -replay-keys, -ghz-concurrency and -scale-concurrency must be positive")
	case s.BodyBytes < 0 || s.ScaleRecords < 0:
		return nil, errors.New("-body-bytes and -scale-records must not be negative")
	case s.Client != clientStub && s.Client != clientGo:
		return nil, fmt.Errorf("-client %q: want %s or %s", s.Client, clientStub, clientGo)
	case s.ClientBatching < 0 || (s.ClientBatching > 0 && s.Client != clientGo):
		return nil, fmt.Errorf("-client-batching %d: want 0, or a positive number with -client %s", s.ClientBatching, clientGo)
	}
	s.WarmupSeconds, s.DurationSeconds = s.Warmup.Seconds(), s.Duration.Seconds()
	return s, nil
}

// parseCounts parses a flag of positive integers separated by commas.
func parseCounts(flag, v string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%s %q: want positive integers separated by commas", flag, v)
		}
		out = append(out, n)
	}
	return out, nil
}

func env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return def
}

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return n
	}
	return def
}

func envDuration(name string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv(name)); err == nil {
		return d
	}
	return def
}

// logf reports progress on standard error; the table goes to standard
// output.
func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
}

func run(ctx context.Context, args []string) error {
	s, err := parseFlags(args)
	if err != nil {
		return err
	}
	if s.render != "" {
		return render(s.render, os.Stdout)
	}
	started := time.Now()
	if _, err := os.Stat(s.coordinator); err != nil {
		return fmt.Errorf("coordinator binary: %w (build it with `make build`, or pass -coordinator)", err)
	}
	if s.Commit == "" {
		s.Commit = builtFrom(s.coordinator)
	}
	if s.ghz != "" {
		if _, err := os.Stat(s.ghz); err != nil {
			logf("no ghz at %s (%v): the ghz row is skipped; `make bench` installs it", s.ghz, err)
			s.ghz = ""
		}
	}

	env, err := startEnvironment(ctx, s)
	if err != nil {
		return err
	}
	defer env.close()

	command := "make bench"
	if s.Quick {
		command = "make bench-quick"
	}
	rep := &report{Schema: reportSchema, Command: command, StartedAt: started.UTC().Format(time.RFC3339),
		Machine: describeMachine(), Postgres: env.pgInfo, Settings: s}

	// The baseline on the coordinator's table runs before the coordinator
	// starts: a running coordinator LISTENs for the records trigger's
	// notifications, and receiving every one of the baseline's would load
	// PostgreSQL (and the coordinator) with work that is the coordinator's,
	// not the floor's.
	for _, c := range s.Concurrency {
		cell, err := env.withPool(ctx, &env.baseline, s.PoolConns, kindBaseline, c)
		if err != nil {
			return err
		}
		rep.Cells = append(rep.Cells, cell)
	}
	if err := env.startCoordinator(ctx); err != nil {
		return err
	}
	if err := env.prepareReplayKeys(ctx); err != nil {
		return err
	}
	// The lean baseline has no trigger: its cells alternate with the
	// coordinator's, so that a machine whose speed drifts affects both.
	for _, c := range s.Concurrency {
		for range s.Rounds {
			cell, err := env.withPool(ctx, &env.lean, c, kindLean, c)
			if err != nil {
				return err
			}
			rep.Cells = append(rep.Cells, cell)
			if cell, err = env.runCell(ctx, kindPairs, c, nil); err != nil {
				return err
			}
			rep.Cells = append(rep.Cells, cell)
		}
		cell, err := env.runCell(ctx, kindReplays, c, nil)
		if err != nil {
			return err
		}
		rep.Cells = append(rep.Cells, cell)
	}
	pathCells, skipped, err := env.runPaths(ctx)
	if err != nil {
		return err
	}
	rep.Cells = append(rep.Cells, pathCells...)
	rep.PathsSkipped = skipped
	// The Citus cells run after every single-PostgreSQL cell that the
	// coordinator serves, and with the single PostgreSQL idle.
	citusCells, citusInfo, citusSkipped, err := env.runCitus(ctx)
	if err != nil {
		return err
	}
	rep.Cells = append(rep.Cells, citusCells...)
	rep.CitusInfo, rep.CitusSkipped = citusInfo, citusSkipped
	if s.ghz != "" {
		g, err := env.runGhz(ctx)
		if err != nil {
			return err
		}
		rep.Ghz = g
	}
	if s.ScaleRecords > 0 {
		sc, err := env.runScale(ctx)
		if err != nil {
			return err
		}
		rep.Scale = sc
	}
	rep.Coordinator = env.stopCoordinator()
	rep.TotalSeconds = time.Since(started).Seconds()
	rep.finish()

	if err := rep.print(os.Stdout); err != nil {
		return err
	}
	path, err := rep.write(s.out, started)
	if err != nil {
		return err
	}
	logf("wrote %s and %s", path, s.out+"/latest.json")
	if s.hold {
		logf("holding PostgreSQL at %s until interrupted (the coordinator is stopped)", env.dbURL)
		<-ctx.Done()
	}
	return nil
}

// builtFrom returns the VCS revision stamped into a Go binary, or "".
func builtFrom(binary string) string {
	bi, err := buildinfo.ReadFile(binary)
	if err != nil {
		return ""
	}
	var rev, dirty string
	for _, kv := range bi.Settings {
		switch {
		case kv.Key == "vcs.revision":
			rev = kv.Value
		case kv.Key == "vcs.modified" && kv.Value == "true":
			dirty = "-dirty"
		}
	}
	if rev == "" {
		return ""
	}
	return rev[:min(len(rev), 12)] + dirty
}
