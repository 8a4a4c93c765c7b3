package main

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemcoord/idemcoord/bench/internal/floor"
	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// cellKind is what a cell measures.
type cellKind string

const (
	kindPairs    cellKind = "pairs"    // Begin (new key) + Complete through gRPC
	kindReplays  cellKind = "replays"  // Begin on a COMPLETED key through gRPC
	kindBaseline cellKind = "baseline" // INSERT + UPDATE straight to PostgreSQL, on the coordinator's table
	kindLean     cellKind = "lean"     // INSERT + UPDATE straight to PostgreSQL, on a hand-written table
	// Pairs and replays through the generated stub (see paths.go).
	kindStubPairs   cellKind = pathStub + "-pairs"
	kindStubReplays cellKind = pathStub + "-replays"
	// Pairs and replays through the generated stub against grpc-go alone
	// (see floor.go).
	kindFloorPairs   cellKind = pathFloor + "-pairs"
	kindFloorReplays cellKind = pathFloor + "-replays"
	// Pairs and replays on Citus (see citus.go): through the coordinator
	// node's URL, and through the URL that spreads the coordinator's
	// connections over every node.
	kindCitusPairs         cellKind = "citus-pairs"
	kindCitusReplays       cellKind = "citus-replays"
	kindCitusSpreadPairs   cellKind = "citus-spread-pairs"
	kindCitusSpreadReplays cellKind = "citus-spread-replays"
)

// direct reports that the kind talks to PostgreSQL without the coordinator.
func (k cellKind) direct() bool { return k == kindBaseline || k == kindLean }

// floor reports that the kind's callers call the floor's server instead of
// the coordinator.
func (k cellKind) floor() bool { return k == kindFloorPairs || k == kindFloorReplays }

// The calls whose latency a cell records, by kind.
var cellCalls = map[cellKind][]string{
	kindPairs:    {"begin", "complete"},
	kindReplays:  {"begin"},
	kindBaseline: {"insert", "update"},
	kindLean:     {"insert", "update"},

	kindStubPairs:   {"begin", "complete"},
	kindStubReplays: {"begin"},

	kindFloorPairs:   {"begin", "complete"},
	kindFloorReplays: {"begin"},

	kindCitusPairs:         {"begin", "complete"},
	kindCitusReplays:       {"begin"},
	kindCitusSpreadPairs:   {"begin", "complete"},
	kindCitusSpreadReplays: {"begin"},
}

// benchScope is the scope of every record the bench writes.
const benchScope = "bench"

// payload is what every pair stores: the same for the coordinator and the
// baseline.
type payload struct {
	fingerprint []byte
	response    *idempotencyv1.StoredResponse
}

func newPayload(bodyBytes int) payload {
	fp := sha256.Sum256([]byte("idemcoord bench request"))
	body := make([]byte, bodyBytes)
	for i := range body {
		body[i] = byte('a' + i%26)
	}
	return payload{fingerprint: fp[:], response: &idempotencyv1.StoredResponse{
		SchemaVersion: "bench.v1.Response/1", ContentType: "application/x-protobuf", Body: body}}
}

// newKey returns a random 32-hex-digit key, like a client's UUID. Its
// first 16 digits are uniform below 8000000000000000, the range the scale
// check's bulk-loaded keys spread over, so new keys land all over the
// primary key index instead of at one end of it.
func newKey(r *rand.Rand) string {
	return fmt.Sprintf("%016x%016x", r.Uint64()>>1, r.Uint64())
}

// replayKey is the i-th COMPLETED key of the replay cells (and of ghz).
func replayKey(i int) string { return fmt.Sprintf("%s%d", floor.ReplayPrefix, i) }

// newToken returns a lease token shaped like the coordinator's.
func newToken(r *rand.Rand) string {
	var b [18]byte
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return "lt1." + base64.RawURLEncoding.EncodeToString(b[:])
}

// op runs one iteration of a cell for caller w and stores the latency of
// each of its calls in lat, in the order of cellCalls.
type op func(ctx context.Context, w int, r *rand.Rand, lat []time.Duration) error

func (e *environment) op(kind cellKind) op {
	switch kind {
	case kindPairs, kindCitusPairs, kindCitusSpreadPairs:
		return e.pairOp(e.client)
	case kindReplays, kindCitusReplays, kindCitusSpreadReplays:
		return e.replayOp(e.client)
	case kindStubPairs:
		return e.pairOp(e.stub)
	case kindStubReplays:
		return e.replayOp(e.stub)
	case kindFloorPairs:
		return e.pairOp(e.floorStub)
	case kindFloorReplays:
		return e.replayOp(e.floorStub)
	case kindLean:
		return e.leanPair
	default:
		return e.baselinePair
	}
}

// pairOp is Begin on a new key, then Complete with the lease token,
// through client(w) of caller w.
func (e *environment) pairOp(client func(w int) coordinatorCalls) op {
	return func(ctx context.Context, w int, r *rand.Rand, lat []time.Duration) error {
		return e.pair(ctx, client(w), r, lat)
	}
}

// replayOp is Begin on one of the COMPLETED replay keys, through client(w)
// of caller w.
func (e *environment) replayOp(client func(w int) coordinatorCalls) op {
	return func(ctx context.Context, w int, r *rand.Rand, lat []time.Duration) error {
		return e.replay(ctx, client(w), r, lat)
	}
}

// pair is Begin on a new key, then Complete with the lease token.
func (e *environment) pair(ctx context.Context, c coordinatorCalls, r *rand.Rand, lat []time.Duration) error {
	key := newKey(r)
	t0 := time.Now()
	br, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: benchScope, Key: key, Fingerprint: e.payload.fingerprint})
	t1 := time.Now()
	if err != nil {
		return fmt.Errorf("Begin: %w", err)
	}
	if br.GetOutcome() != idempotencyv1.Outcome_OUTCOME_ACQUIRED {
		return fmt.Errorf("%w: Begin on a new key answered %v", errCoordinatorAnswer, br.GetOutcome())
	}
	_, err = c.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: benchScope, Key: key,
		LeaseToken: br.GetLeaseToken(), Response: e.payload.response})
	t2 := time.Now()
	if err != nil {
		return fmt.Errorf("Complete: %w", err)
	}
	lat[0], lat[1] = t1.Sub(t0), t2.Sub(t1)
	return nil
}

// replay is Begin on one of the COMPLETED replay keys.
func (e *environment) replay(ctx context.Context, c coordinatorCalls, r *rand.Rand, lat []time.Duration) error {
	key := replayKey(r.IntN(e.s.ReplayKeys))
	t0 := time.Now()
	br, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: benchScope, Key: key, Fingerprint: e.payload.fingerprint})
	lat[0] = time.Since(t0)
	if err != nil {
		return fmt.Errorf("Begin: %w", err)
	}
	if br.GetOutcome() != idempotencyv1.Outcome_OUTCOME_REPLAY || len(br.GetRecord().GetResponse().GetBody()) != len(e.payload.response.GetBody()) {
		return fmt.Errorf("%w: Begin on a completed key answered %v", errCoordinatorAnswer, br.GetOutcome())
	}
	return nil
}

// prepareReplayKeys completes the keys the replay cells replay.
func (e *environment) prepareReplayKeys(ctx context.Context) error {
	logf("completing %d keys for the replay cells", e.s.ReplayKeys)
	for i := range e.s.ReplayKeys {
		c, key := e.client(i), replayKey(i)
		br, err := c.Begin(ctx, &idempotencyv1.BeginRequest{Scope: benchScope, Key: key, Fingerprint: e.payload.fingerprint})
		if err != nil {
			return fmt.Errorf("prepare replay key: %w", err)
		}
		if _, err := c.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: benchScope, Key: key,
			LeaseToken: br.GetLeaseToken(), Response: e.payload.response}); err != nil {
			return fmt.Errorf("prepare replay key: %w", err)
		}
	}
	return nil
}

// Cell is the measurement of one kind of work at one concurrency.
type Cell struct {
	Kind        cellKind `json:"kind"`
	Label       string   `json:"label,omitempty"`
	Concurrency int      `json:"concurrency"`
	Seconds     float64  `json:"seconds"`
	// Ops counts iterations (pairs or replays) that succeeded while measuring.
	Ops        int64   `json:"ops"`
	OpsPerSec  float64 `json:"ops_per_s"`
	Errors     int64   `json:"errors"`
	FirstError string  `json:"first_error,omitempty"`
	// LatencyMS holds percentiles of each call ("begin", "complete",
	// "insert", "update"), in milliseconds.
	LatencyMS map[string]Latency `json:"latency_ms"`
	// CPU seconds used while measuring: by the coordinator process (0 for
	// the baseline), by every PostgreSQL process, and by this driver.
	CoordCPUSeconds  float64 `json:"coordinator_cpu_s"`
	PGCPUSeconds     float64 `json:"postgres_cpu_s"`
	DriverCPUSeconds float64 `json:"driver_cpu_s"`
	// WorkerCPUSeconds is, on Citus, each worker's (PGCPUSeconds is then
	// the coordinator node's).
	WorkerCPUSeconds []float64 `json:"worker_cpu_s,omitempty"`
	// CoordPeakRSSMB is the coordinator's VmHWM at the end of the cell,
	// reset before it (the peak over its life when the reset failed).
	CoordPeakRSSMB float64 `json:"coordinator_peak_rss_mb"`
	// OthersCPUShare is the share of the machine's CPU time that processes
	// other than the coordinator, PostgreSQL and this driver used while
	// measuring (0.1 = 10 %); StealShare the share the hypervisor took. A
	// figure measured beside other work is not comparable.
	OthersCPUShare float64 `json:"others_cpu_share"`
	StealShare     float64 `json:"steal_share"`
	RSSResetFailed bool    `json:"rss_reset_failed,omitempty"`
}

// Latency summarises one call's latencies.
type Latency struct {
	Count int     `json:"count"`
	P50   float64 `json:"p50"`
	P90   float64 `json:"p90"`
	P99   float64 `json:"p99"`
	Max   float64 `json:"max"`
}

// summarize sorts d and returns its percentiles (nearest rank).
func summarize(d []time.Duration) Latency {
	if len(d) == 0 {
		return Latency{}
	}
	slices.Sort(d)
	at := func(p float64) float64 {
		i := int(p*float64(len(d))+0.999999) - 1
		return ms(d[min(max(i, 0), len(d)-1)])
	}
	return Latency{Count: len(d), P50: at(0.50), P90: at(0.90), P99: at(0.99), Max: ms(d[len(d)-1])}
}

// Phases of a cell, as its callers see them.
const (
	phaseWarmup int32 = iota
	phaseMeasure
	phaseStop
)

// callerStats is what one caller goroutine measured.
type callerStats struct {
	ops, errs int64
	firstErr  error
	lat       [][]time.Duration
}

// runCell runs kind with concurrency callers: a warm-up, then the measured
// duration. Only iterations that start and end inside the measured window
// count. during, when set, runs alongside the whole cell; stop closes when
// the cell ends, and the cell waits for during to return.
func (e *environment) runCell(ctx context.Context, kind cellKind, concurrency int, during func(ctx context.Context, stop <-chan struct{})) (Cell, error) {
	if err := e.serverAlive(kind); err != nil {
		return Cell{}, err
	}
	// Each cell starts from a fresh checkpoint, so none of them pays for
	// another's dirty pages or meets a timed checkpoint by chance.
	if err := e.checkpoint(ctx); err != nil {
		return Cell{}, fmt.Errorf("checkpoint: %w", err)
	}
	calls := cellCalls[kind]
	run, phase := e.op(kind), atomic.Int32{}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stats := make([]callerStats, concurrency)
	var wg sync.WaitGroup
	if during != nil {
		wg.Go(func() { during(ctx, cctx.Done()) })
	}
	for w := range concurrency {
		wg.Go(func() {
			st := &stats[w]
			st.lat = make([][]time.Duration, len(calls))
			r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(w)))
			lat := make([]time.Duration, len(calls))
			for {
				ph := phase.Load()
				if ph == phaseStop || cctx.Err() != nil {
					return
				}
				err := run(cctx, w, r, lat)
				if ph != phaseMeasure || phase.Load() != phaseMeasure {
					continue
				}
				if err != nil {
					st.errs++
					if st.firstErr == nil {
						st.firstErr = err
					}
					time.Sleep(10 * time.Millisecond) // no hot loop against a dead server
					continue
				}
				st.ops++
				for i := range calls {
					st.lat[i] = append(st.lat[i], lat[i])
				}
			}
		})
	}

	pid := 0
	switch {
	case kind.floor():
		pid = e.floor.cmd.Process.Pid
	case !kind.direct():
		pid = e.coord.Process.Pid
	}
	sleep(ctx, e.s.Warmup)
	rssReset := pid != 0 && resetPeakRSS(pid) == nil
	before := e.snapshot(pid)
	phase.Store(phaseMeasure)
	sleep(ctx, e.measuredFor(kind))
	phase.Store(phaseStop)
	after := e.snapshot(pid)
	cancel()
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return Cell{}, err
	}

	cell := Cell{Kind: kind, Concurrency: concurrency, Seconds: after.at.Sub(before.at).Seconds(),
		LatencyMS:        map[string]Latency{},
		CoordCPUSeconds:  after.coordCPU - before.coordCPU,
		PGCPUSeconds:     max(after.pgCPU-before.pgCPU, 0), // a backend that exited took its share
		DriverCPUSeconds: after.selfCPU - before.selfCPU,
		WorkerCPUSeconds: after.workersCPU(before),
		CoordPeakRSSMB:   after.coordHWM,
		RSSResetFailed:   pid != 0 && !rssReset,
	}
	if capacity := float64(runtime.NumCPU()) * cell.Seconds; capacity > 0 {
		others := (after.busyCPU - before.busyCPU) - cell.CoordCPUSeconds - cell.PGCPUSeconds - cell.DriverCPUSeconds
		for _, w := range cell.WorkerCPUSeconds {
			others -= w
		}
		cell.OthersCPUShare = max(others, 0) / capacity
		cell.StealShare = (after.stealCPU - before.stealCPU) / capacity
	}
	var firstErr error
	for i, name := range calls {
		var all []time.Duration
		for _, st := range stats {
			all = append(all, st.lat[i]...)
		}
		cell.LatencyMS[name] = summarize(all)
	}
	for _, st := range stats {
		cell.Ops += st.ops
		cell.Errors += st.errs
		if firstErr == nil {
			firstErr = st.firstErr
		}
	}
	if firstErr != nil {
		cell.FirstError = firstErr.Error()
	}
	cell.OpsPerSec = float64(cell.Ops) / cell.Seconds
	logf("%-8s %4d callers: %9.0f/s  %s%s%s", kind, concurrency, cell.OpsPerSec, latencySummary(cell, calls), errorSummary(cell), busySummary(cell))
	if cell.Ops == 0 {
		if err := e.serverAlive(kind); err != nil {
			return cell, err
		}
		if firstErr == nil {
			firstErr = errors.New("no iteration ended within the measured time")
		}
		return cell, fmt.Errorf("%s at %d callers: nothing succeeded: %w", kind, concurrency, firstErr)
	}
	return cell, nil
}

// serverAlive returns an error once the server kind's callers call (the
// coordinator, or the floor's) has exited; nil for the direct kinds.
func (e *environment) serverAlive(kind cellKind) error {
	switch {
	case kind.floor():
		return e.floorAlive()
	case kind.direct():
		return nil
	}
	return e.coordinatorAlive()
}

func latencySummary(c Cell, calls []string) string {
	var s strings.Builder
	for _, name := range calls {
		l := c.LatencyMS[name]
		fmt.Fprintf(&s, "  %s p50 %.2f p99 %.2f ms", name, l.P50, l.P99)
	}
	return s.String()
}

func errorSummary(c Cell) string {
	if c.Errors == 0 {
		return ""
	}
	return fmt.Sprintf("  %d errors, first: %s", c.Errors, c.FirstError)
}

// busyThreshold is the share of the machine other processes may use
// during a cell before its figures are flagged.
const busyThreshold = 0.05

func busySummary(c Cell) string {
	if c.OthersCPUShare < busyThreshold {
		return ""
	}
	return fmt.Sprintf("  (other processes used %.0f%% of the CPUs)", c.OthersCPUShare*100)
}

// sleep waits for d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
