package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Paths are the ways of calling the coordinator that the bench measures
// beside its main table's callers' client (-client), in the same run
// (-paths): the generated stub (one unary RPC per call, what grpcurl,
// curl and most languages send), and the Node and Python libraries'
// clients, driven by their own load generators (clients/node/bench,
// clients/python/bench).
const (
	pathStub   = "stub"
	pathNode   = "node"
	pathPython = "python"
)

// newStub is the generated stub over conn.
func newStub(conn grpc.ClientConnInterface) coordinatorCalls {
	return idempotencyv1.NewCoordinatorClient(conn)
}

// Cell kinds of the paths: kind "<path>-pairs" and "<path>-replays".
func pathKind(path string, replays bool) cellKind {
	if replays {
		return cellKind(path + "-replays")
	}
	return cellKind(path + "-pairs")
}

// PathRow is one path at one concurrency, beside the main table's row at
// the same concurrency.
type PathRow struct {
	Path        string `json:"path"`
	Concurrency int    `json:"concurrency"`
	// Skipped says why the path was not measured (its runtime is missing).
	Skipped       string  `json:"skipped,omitempty"`
	PairsPerSec   float64 `json:"pairs_per_s"`
	ReplaysPerSec float64 `json:"replays_per_s"`
	// LeanRatio is pairs/s over the lean baseline's at this concurrency
	// in this run; MainRatio over the main table's pairs/s (the -client's).
	LeanRatio       float64 `json:"lean_ratio"`
	MainRatio       float64 `json:"main_client_ratio"`
	ReplayPairRatio float64 `json:"replays_per_pair"`
	BeginP99MS      float64 `json:"begin_p99_ms"`
	CoordCPUPer1000 float64 `json:"coordinator_cpu_s_per_1000_pairs"`
	PGCPUPer1000    float64 `json:"postgres_cpu_s_per_1000_pairs"`
	// CallersCPUPer1000 is the callers' CPU per 1000 pairs: this driver's
	// goroutines for the stub, the load generator's process otherwise.
	CallersCPUPer1000 float64 `json:"callers_cpu_s_per_1000_pairs"`
	Errors            int64   `json:"errors"`
	FirstError        string  `json:"first_error,omitempty"`
}

// generator is an external load generator: a command that drives the
// coordinator at target with callers concurrent callers, and speaks the
// protocol of runExternal.
type generator struct {
	name string
	argv []string
}

// generatorFor returns the load generator of path, or why it cannot run.
func generatorFor(path string) (generator, string) {
	switch path {
	case pathNode:
		node, err := exec.LookPath("node")
		if err != nil {
			return generator{}, "no node on PATH"
		}
		script := filepath.Join("clients", "node", "bench", "pairs.mjs")
		if _, err := os.Stat(script); err != nil {
			return generator{}, "no " + script
		}
		if _, err := os.Stat(filepath.Join("clients", "node", "node_modules", "@grpc", "grpc-js")); err != nil {
			return generator{}, "clients/node has no node_modules (npm ci --prefix clients/node)"
		}
		return generator{name: "node", argv: []string{node, script}}, ""
	case pathPython:
		py := "/usr/bin/python3"
		if _, err := os.Stat(py); err != nil {
			return generator{}, "no /usr/bin/python3"
		}
		if err := exec.Command(py, "-c", "import grpc").Run(); err != nil {
			return generator{}, "python3 cannot import grpc (Debian: python3-grpcio)"
		}
		script := filepath.Join("clients", "python", "bench", "pairs.py")
		if _, err := os.Stat(script); err != nil {
			return generator{}, "no " + script
		}
		return generator{name: "python", argv: []string{py, script}}, ""
	}
	return generator{}, "unknown path"
}

// generatorResult is the load generator's last line of output.
type generatorResult struct {
	Ops        int64   `json:"ops"`
	Errors     int64   `json:"errors"`
	Seconds    float64 `json:"seconds"`
	FirstError string  `json:"first_error"`
	BeginP50MS float64 `json:"begin_p50_ms"`
	BeginP99MS float64 `json:"begin_p99_ms"`
}

// runExternal runs g for one cell: pairs (Begin on a new key, then
// Complete) or replays (Begin on the replay keys, "replay-0" …), with
// callers concurrent callers, through the library's client with call
// batching when batching > 0. The generator warms up for the warm-up
// time, prints a line "measuring" as its measured window starts, and when
// it ends prints one JSON line (generatorResult) of the iterations that
// started and ended inside the window, then exits. The coordinator's,
// PostgreSQL's and the generator's CPU are read when "measuring" arrives
// and when the result does.
func (e *environment) runExternal(ctx context.Context, g generator, path string, replays bool, callers, batching int) (Cell, error) {
	kind := pathKind(path, replays)
	if err := e.coordinatorAlive(); err != nil {
		return Cell{}, err
	}
	if err := e.exec(ctx, "CHECKPOINT"); err != nil {
		return Cell{}, fmt.Errorf("checkpoint: %w", err)
	}
	mode := "pairs"
	if replays {
		mode = "replays"
	}
	args := append(slices.Clip(g.argv[1:]), "--target", e.addr, "--callers", strconv.Itoa(callers), "--mode", mode,
		"--warmup", fmt.Sprintf("%.3f", e.s.Warmup.Seconds()), "--duration", fmt.Sprintf("%.3f", e.s.Duration.Seconds()),
		"--replay-keys", strconv.Itoa(e.s.ReplayKeys), "--body-bytes", strconv.Itoa(e.s.BodyBytes),
		"--batching", strconv.Itoa(batching), "--scope", benchScope)
	cctx, cancel := context.WithTimeout(ctx, e.s.Warmup+e.s.Duration+2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, g.argv[0], args...)
	var stderr strings.Builder
	cmd.Stderr = &limitedWriter{w: &stderr, n: 8 << 10}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return Cell{}, err
	}
	if err := cmd.Start(); err != nil {
		return Cell{}, fmt.Errorf("%s load generator: %w", g.name, err)
	}
	pid := e.coord.Process.Pid
	var before, after snapshot
	var beforeGen, afterGen float64
	var res generatorResult
	var got bool
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "measuring":
			before, beforeGen = e.snapshot(pid), treeCPU(cmd.Process.Pid)
		case strings.HasPrefix(line, "{"):
			after, afterGen = e.snapshot(pid), treeCPU(cmd.Process.Pid)
			if err := json.Unmarshal([]byte(line), &res); err != nil {
				return Cell{}, fmt.Errorf("%s load generator's result %q: %w", g.name, line, err)
			}
			got = true
		}
	}
	waitErr := cmd.Wait()
	if !got || before.at.IsZero() {
		return Cell{}, fmt.Errorf("%s load generator (%s) gave no result: %v\n%s", g.name, strings.Join(cmd.Args, " "), waitErr, stderr.String())
	}
	cell := Cell{Kind: kind, Label: g.name, Concurrency: callers, Seconds: after.at.Sub(before.at).Seconds(),
		Ops: res.Ops, Errors: res.Errors, FirstError: res.FirstError,
		LatencyMS:        map[string]Latency{"begin": {P50: res.BeginP50MS, P99: res.BeginP99MS}},
		CoordCPUSeconds:  after.coordCPU - before.coordCPU,
		PGCPUSeconds:     max(after.pgCPU-before.pgCPU, 0), // a backend that exited took its share
		DriverCPUSeconds: afterGen - beforeGen,
		CoordPeakRSSMB:   after.coordHWM,
	}
	if res.Seconds > 0 {
		cell.Seconds = res.Seconds
	}
	if capacity := float64(runtime.NumCPU()) * cell.Seconds; capacity > 0 {
		others := (after.busyCPU - before.busyCPU) - cell.CoordCPUSeconds - cell.PGCPUSeconds - cell.DriverCPUSeconds -
			(after.selfCPU - before.selfCPU)
		cell.OthersCPUShare = max(others, 0) / capacity
		cell.StealShare = (after.stealCPU - before.stealCPU) / capacity
	}
	cell.OpsPerSec = ratio(float64(cell.Ops), cell.Seconds)
	logf("%-14s %4d callers: %9.0f/s  Begin p99 %.2f ms%s%s", kind, callers, cell.OpsPerSec, res.BeginP99MS, errorSummary(cell), busySummary(cell))
	if cell.Ops == 0 {
		return cell, fmt.Errorf("%s at %d callers: nothing succeeded: %s", kind, callers, res.FirstError)
	}
	return cell, nil
}

// firstLine is s up to its first line break.
func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// limitedWriter keeps the first n bytes written to it.
type limitedWriter struct {
	w io.Writer
	n int
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	if l.n > 0 {
		k := min(len(p), l.n)
		_, _ = l.w.Write(p[:k])
		l.n -= k
	}
	return len(p), nil
}

// runPaths measures every path of -paths at every concurrency of
// -paths-concurrency: pairs, then replays. The stub runs in this driver
// over the same connections as the main table's callers; Node and Python
// run their load generators (with their clients' call batching when the
// main table's Go client batches, at the same setting). A path whose
// runtime is missing is reported skipped. With the stub, the floor's
// cells follow (floor.go): the stub's callers against grpc-go alone.
func (e *environment) runPaths(ctx context.Context) ([]Cell, []PathRow, error) {
	var cells []Cell
	var skipped []PathRow
	for _, path := range e.s.Paths {
		var g generator
		if path != pathStub {
			var why string
			if g, why = generatorFor(path); why != "" {
				logf("path %s skipped: %s", path, why)
				for _, c := range e.s.PathConcurrency {
					skipped = append(skipped, PathRow{Path: path, Concurrency: c, Skipped: why})
				}
				continue
			}
		}
	concurrencies:
		for _, c := range e.s.PathConcurrency {
			for _, replays := range []bool{false, true} {
				if path == pathStub {
					cell, err := e.runCell(ctx, pathKind(pathStub, replays), c, nil)
					if err != nil {
						return nil, nil, err
					}
					cells = append(cells, cell)
					continue
				}
				cell, err := e.runExternal(ctx, g, path, replays, c, e.s.ClientBatching)
				if err != nil {
					// A load generator that fails costs its path, not the
					// run; a coordinator that died ends the run.
					if dead := e.coordinatorAlive(); dead != nil || ctx.Err() != nil {
						return nil, nil, errors.Join(err, dead, ctx.Err())
					}
					logf("path %s at %d callers not measured: %v", path, c, err)
					skipped = append(skipped, PathRow{Path: path, Concurrency: c, Skipped: "the load generator failed: " + firstLine(err.Error())})
					continue concurrencies
				}
				cells = append(cells, cell)
			}
		}
	}
	if slices.Contains(e.s.Paths, pathStub) {
		floorCells, err := e.runFloor(ctx)
		if err != nil {
			return nil, nil, err
		}
		cells = append(cells, floorCells...)
	}
	return cells, skipped, nil
}

// stub returns the generated stub of caller w: one per connection, the
// connections the main table's callers use.
func (e *environment) stub(w int) coordinatorCalls {
	return e.stubs[w%len(e.stubs)]
}

// pathRows derives the paths' rows from the cells, beside the main rows.
func (r *report) pathRows(skipped []PathRow) []PathRow {
	var rows []PathRow
	for _, path := range append(slices.Clone(r.Settings.Paths), pathFloor) {
		for _, c := range r.Settings.PathConcurrency {
			pc, rc := r.cells(pathKind(path, false), c), r.cells(pathKind(path, true), c)
			if len(pc) == 0 || (len(rc) == 0 && path != pathFloor) { // the floor's replays run at 64 callers only
				continue
			}
			p, rp := pool(pc), pool(rc)
			row := PathRow{Path: path, Concurrency: c, PairsPerSec: p.perSec(), ReplaysPerSec: rp.perSec(),
				BeginP99MS: p.p99["begin"], CoordCPUPer1000: p.per1000(p.coord), PGCPUPer1000: p.per1000(p.pg),
				CallersCPUPer1000: p.per1000(p.driver), Errors: p.errs + rp.errs}
			row.ReplayPairRatio = ratio(row.ReplaysPerSec, row.PairsPerSec)
			if lean := pool(r.cells(kindLean, c)); lean.ops > 0 {
				row.LeanRatio = ratio(row.PairsPerSec, lean.perSec())
			}
			if main := r.row(c); main != nil {
				row.MainRatio = ratio(row.PairsPerSec, main.PairsPerSec)
			}
			for _, cell := range append(pc, rc...) {
				if row.FirstError == "" && cell.FirstError != "" {
					row.FirstError = cell.FirstError
				}
			}
			rows = append(rows, row)
		}
	}
	return append(rows, skipped...)
}

// pathRow returns the row of path at concurrency c, or nil.
func (r *report) pathRow(path string, c int) *PathRow {
	for i := range r.Paths {
		if p := &r.Paths[i]; p.Path == path && p.Concurrency == c && p.Skipped == "" {
			return p
		}
	}
	return nil
}

// errNoPaths is parsePaths' error for an empty or unknown path.
var errNoPaths = errors.New("want stub, node or python, separated by commas, or none")

// parsePaths parses -paths.
func parsePaths(v string) ([]string, error) {
	var out []string
	for f := range strings.SplitSeq(v, ",") {
		switch p := strings.TrimSpace(f); p {
		case "":
		case pathStub, pathNode, pathPython:
			out = append(out, p)
		default:
			return nil, fmt.Errorf("-paths %q: %w", v, errNoPaths)
		}
	}
	return out, nil
}
