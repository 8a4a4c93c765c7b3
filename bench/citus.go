package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/idemcoord/idemcoord/internal/pgtest"
	"github.com/idemcoord/idemcoord/ledger"
)

// The Citus cells (-citus): after the single PostgreSQL's cells, the same
// run starts a durable Citus cluster (a coordinator node and two workers),
// migrates it, starts the coordinator binary with its default flags
// against the coordinator node and runs pairs and replays at the
// -paths-concurrency callers through the callers' client of the main
// table, then pairs and replays again with the coordinator's connections
// spread over the three nodes (a multi-host URL with
// load_balance_hosts=random).

// Variants of the Citus rows: the URL the coordinator was given.
const (
	citusCoordinatorNode = "coordinator node" // the coordinator node's URL
	citusSpread          = "spread"           // every node, load_balance_hosts=random
)

// citusWorkerTarget is the goal of the highest worker's CPU per pair over
// the single PostgreSQL's at the same callers: the work really splits.
const citusWorkerTarget = 0.6

// CitusRow is one variant at one concurrency of the Citus cells.
type CitusRow struct {
	Variant       string  `json:"variant"`
	Concurrency   int     `json:"concurrency"`
	PairsPerSec   float64 `json:"pairs_per_s"`
	ReplaysPerSec float64 `json:"replays_per_s,omitempty"`
	// CPU seconds per 1000 pairs: the coordinator process, the Citus
	// coordinator node and each worker (postmaster and children, /proc).
	CoordCPUPer1000     float64   `json:"coordinator_cpu_s_per_1000_pairs"`
	CoordNodeCPUPer1000 float64   `json:"coordinator_node_cpu_s_per_1000_pairs"`
	WorkerCPUPer1000    []float64 `json:"worker_cpu_s_per_1000_pairs"`
	// PostgresCPUPer1000 is the single PostgreSQL's CPU per 1000 pairs at
	// the same callers (the main table's pairs), WorkerRatio the highest
	// worker's over it.
	PostgresCPUPer1000 float64 `json:"single_postgres_cpu_s_per_1000_pairs"`
	WorkerRatio        float64 `json:"highest_worker_vs_single_postgres"`
	Errors             int64   `json:"errors"`
}

// CitusInfo describes the Citus cluster of the run.
type CitusInfo struct {
	Version string `json:"version"`
	// Nodes is pg_dist_node's primaries with hasmetadata and
	// metadatasynced, as "host:port metadata=t synced=t".
	Nodes []string `json:"nodes"`
}

// runCitus runs the Citus cells. It returns the cells and the cluster's
// description, or why they were not measured: Citus missing or a failure
// on the way never fails the run (only ctx's end does).
func (e *environment) runCitus(ctx context.Context) ([]Cell, *CitusInfo, string, error) {
	if !e.s.Citus {
		return nil, nil, "-citus=false", nil
	}
	if err := pgtest.CitusMissing(); err != nil {
		logf("Citus cells not measured: %v", err)
		return nil, nil, err.Error(), nil
	}
	cells, info, err := e.citusCells(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, "", ctx.Err()
		}
		logf("Citus cells not measured: %v", err)
		return nil, nil, err.Error(), nil
	}
	return cells, info, "", nil
}

func (e *environment) citusCells(ctx context.Context) (_ []Cell, _ *CitusInfo, err error) {
	logf("starting a durable Citus cluster (a coordinator node and two workers)")
	cc, err := pgtest.LaunchCitus(pgtest.ClusterOptions{Durable: true})
	if err != nil {
		return nil, nil, err
	}
	ce := &environment{s: e.s, payload: e.payload, cluster: cc.Coordinator, workers: cc.Workers}
	defer func() {
		ce.close() // stops the coordinator node too
		if cerr := cc.Close(); cerr != nil {
			logf("%v", cerr)
		}
	}()
	if ce.dir, err = os.MkdirTemp("", "idemcoord-bench-citus-"); err != nil {
		return nil, nil, err
	}
	if err := cc.CreateDatabase(ctx, benchDatabase); err != nil {
		return nil, nil, err
	}
	ce.dbURL = cc.URL(benchDatabase)
	if err := ledger.Migrate(ctx, ce.dbURL); err != nil {
		return nil, nil, err
	}
	if ce.admin, err = ce.openPool(ctx, 4); err != nil {
		return nil, nil, err
	}
	if _, err := checkDurable(ctx, ce.admin); err != nil {
		return nil, nil, fmt.Errorf("the coordinator node: %w", err)
	}
	info := &CitusInfo{}
	if err := ce.admin.QueryRow(ctx, "SELECT extversion FROM pg_extension WHERE extname = 'citus'").Scan(&info.Version); err != nil {
		return nil, nil, err
	}
	rows, err := ce.admin.Query(ctx, `SELECT format('%s:%s metadata=%s synced=%s', nodename, nodeport, hasmetadata, metadatasynced)
		FROM pg_dist_node WHERE noderole = 'primary' ORDER BY nodeid`)
	if err != nil {
		return nil, nil, err
	}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, nil, err
		}
		info.Nodes = append(info.Nodes, n)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	logf("Citus %s, nodes: %s", info.Version, strings.Join(info.Nodes, ", "))

	spread := cc.SpreadURL(benchDatabase)
	// First through the coordinator node's URL, then the same cells with
	// the coordinator's pool spread over every node (the replay keys are
	// written once: the second coordinator starts with an empty replay
	// cache, as the first did).
	var cells []Cell
	for _, phase := range []struct {
		coordURL string
		kinds    []cellKind
	}{{"", []cellKind{kindCitusPairs, kindCitusReplays}}, {spread, []cellKind{kindCitusSpreadPairs, kindCitusSpreadReplays}}} {
		ce.stopCoordinator()
		ce.closeClients()
		ce.coordURL = phase.coordURL
		if err := ce.startCoordinator(ctx); err != nil {
			return nil, nil, err
		}
		if slices.Contains(phase.kinds, kindCitusReplays) {
			if err := ce.prepareReplayKeys(ctx); err != nil {
				return nil, nil, err
			}
		}
		for _, c := range e.s.PathConcurrency {
			for _, kind := range phase.kinds {
				cell, err := ce.runCell(ctx, kind, c, nil)
				if err != nil {
					return nil, nil, err
				}
				cells = append(cells, cell)
			}
		}
	}
	return cells, info, nil
}

// closeClients closes the gRPC connections to the coordinator.
func (e *environment) closeClients() {
	for _, c := range e.conns {
		_ = c.Close()
	}
	e.conns, e.clients, e.stubs = nil, nil, nil
}

// citusRows derives the Citus rows from the cells, beside the single
// PostgreSQL's CPU per pair at the same callers.
func (r *report) citusRows() []CitusRow {
	var out []CitusRow
	for _, v := range []struct {
		name           string
		pairs, replays cellKind
	}{{citusCoordinatorNode, kindCitusPairs, kindCitusReplays}, {citusSpread, kindCitusSpreadPairs, kindCitusSpreadReplays}} {
		for _, c := range r.Settings.PathConcurrency {
			pc := r.cells(v.pairs, c)
			if len(pc) == 0 {
				continue
			}
			p := pool(pc)
			row := CitusRow{Variant: v.name, Concurrency: c, PairsPerSec: p.perSec(),
				CoordCPUPer1000: p.per1000(p.coord), CoordNodeCPUPer1000: p.per1000(p.pg), Errors: p.errs}
			for i := range pc[0].WorkerCPUSeconds {
				var cpu float64
				for _, cell := range pc {
					if i < len(cell.WorkerCPUSeconds) {
						cpu += cell.WorkerCPUSeconds[i]
					}
				}
				row.WorkerCPUPer1000 = append(row.WorkerCPUPer1000, p.per1000(cpu))
			}
			if rc := r.cells(v.replays, c); len(rc) > 0 {
				rp := pool(rc)
				row.ReplaysPerSec, row.Errors = rp.perSec(), row.Errors+rp.errs
			}
			if main := r.row(c); main != nil {
				row.PostgresCPUPer1000 = main.PGCPUPer1000
			}
			row.WorkerRatio = ratio(highest(row.WorkerCPUPer1000), row.PostgresCPUPer1000)
			out = append(out, row)
		}
	}
	return out
}

// highest returns the largest of xs, or 0.
func highest(xs []float64) float64 {
	var m float64
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}

// citusRow returns the row of variant at concurrency, or nil.
func (r *report) citusRow(variant string, concurrency int) *CitusRow {
	for i := range r.Citus {
		if row := &r.Citus[i]; row.Variant == variant && row.Concurrency == concurrency {
			return row
		}
	}
	return nil
}

// citusGoals are the goals of the Citus cells: each worker's CPU per pair
// (the highest worker's) at most 0.6 times the single PostgreSQL's, at 64
// and at 256 callers, through the coordinator node's URL; the coordinator
// node's CPU per pair and the pairs/s are reported beside.
func (r *report) citusGoals() []Goal {
	var gs []Goal
	for _, c := range []int{64, 256} {
		g := Goal{Area: "scale-out", Name: fmt.Sprintf("Citus worker CPU/pair vs single PostgreSQL at %d callers", c),
			Target: fmt.Sprintf("<= %.1fx", citusWorkerTarget), Unit: "x", Status: "not measured"}
		row := r.citusRow(citusCoordinatorNode, c)
		switch {
		case row != nil && row.PostgresCPUPer1000 > 0 && len(row.WorkerCPUPer1000) > 0:
			g.Value = row.WorkerRatio
			g.Status = map[bool]string{true: "met", false: "not met"}[row.WorkerRatio <= citusWorkerTarget]
			g.Note = fmt.Sprintf("reported, not a goal: %.0f pairs/s, coordinator node %.3f CPU-s/1000 pairs",
				row.PairsPerSec, row.CoordNodeCPUPer1000)
			if sp := r.citusRow(citusSpread, c); sp != nil {
				g.Note += fmt.Sprintf("; spread URL %.0f pairs/s, coordinator node %.3f", sp.PairsPerSec, sp.CoordNodeCPUPer1000)
			}
		case r.CitusSkipped != "":
			g.Note = firstLine(r.CitusSkipped)
		}
		gs = append(gs, g)
	}
	return gs
}

// printCitus writes the Citus rows, or why there are none.
func (r *report) printCitus(out io.Writer) error {
	if len(r.Citus) == 0 {
		if r.CitusSkipped != "" {
			fmt.Fprintf(out, "\nCitus cells not measured: %s\n", firstLine(r.CitusSkipped))
		}
		return nil
	}
	version := ""
	if r.CitusInfo != nil {
		version = " " + r.CitusInfo.Version
	}
	fmt.Fprintf(out, "\nCitus%s, a coordinator node and two workers, durable, same machine; callers' client: %s; "+
		"CPU s per 1000 pairs of each process tree (spread: the coordinator's URL lists every node, load_balance_hosts=random):\n",
		version, r.Settings.clientName())
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "URL\tcallers\tpairs/s\treplays/s\tcoord\tcoord node\tworkers\tsingle PG\thighest worker vs PG\terrors\t")
	for _, row := range r.Citus {
		replays := "-"
		if row.ReplaysPerSec > 0 {
			replays = fmt.Sprintf("%.0f", row.ReplaysPerSec)
		}
		var workers []string
		for _, w := range row.WorkerCPUPer1000 {
			workers = append(workers, fmt.Sprintf("%.3f", w))
		}
		fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%.3f\t%.3f\t%s\t%.3f\t%.2f\t%d\t\n", row.Variant, row.Concurrency, row.PairsPerSec, replays,
			row.CoordCPUPer1000, row.CoordNodeCPUPer1000, strings.Join(workers, " / "), row.PostgresCPUPer1000, row.WorkerRatio, row.Errors)
	}
	return tw.Flush()
}
