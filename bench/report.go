package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// reportSchema names the layout of the JSON report; change it when a field
// changes meaning.
const reportSchema = "idemcoord-bench/2"

// report is one run of the bench, as printed and as written to JSON.
type report struct {
	Schema       string       `json:"schema"`
	Command      string       `json:"command"`
	StartedAt    string       `json:"started_at"`
	TotalSeconds float64      `json:"total_s"`
	Machine      machine      `json:"machine"`
	Postgres     postgresInfo `json:"postgres"`
	Settings     *settings    `json:"settings"`
	// Rows is the table: one row per concurrency, from Cells.
	Rows []Row `json:"rows"`
	// Paths are the other ways of calling the coordinator (-paths), by
	// path and concurrency; PathsSkipped those whose runtime was missing.
	Paths        []PathRow `json:"paths,omitempty"`
	PathsSkipped []PathRow `json:"paths_skipped,omitempty"`
	// Citus are the Citus cells' rows (-citus); CitusSkipped says why
	// there are none.
	Citus        []CitusRow `json:"citus,omitempty"`
	CitusInfo    *CitusInfo `json:"citus_cluster,omitempty"`
	CitusSkipped string     `json:"citus_skipped,omitempty"`
	Ghz          *GhzRow    `json:"ghz,omitempty"`
	Scale        *Scale     `json:"scale,omitempty"`
	Goals        []Goal     `json:"goals"`
	// Coordinator is what the coordinator process used over the whole run.
	Coordinator coordinatorTotals `json:"coordinator"`
	// Cells are the raw measurements the rows come from.
	Cells []Cell `json:"cells"`
}

// Row is one concurrency's line of the table. With several rounds, the
// pairs and lean figures pool their rounds: ops over seconds, CPU over ops,
// the mean p50 and the largest p99.
type Row struct {
	Concurrency int     `json:"concurrency"`
	PairsPerSec float64 `json:"pairs_per_s"`
	// LeanPerSec is the lean baseline (the hand-written table of lean.go);
	// LeanRatio is pairs / lean, and LeanRatios the ratio of each round.
	LeanPerSec float64   `json:"lean_pairs_per_s"`
	LeanRatio  float64   `json:"lean_ratio"`
	LeanRatios []float64 `json:"lean_ratios"`
	// BaselinePerSec is the baseline on the coordinator's own table.
	BaselinePerSec    float64 `json:"baseline_pairs_per_s"`
	Ratio             float64 `json:"ratio"` // pairs / baseline
	ReplaysPerSec     float64 `json:"replays_per_s"`
	ReplayPairRatio   float64 `json:"replays_per_pair"` // replays / pairs
	BeginP50MS        float64 `json:"begin_p50_ms"`
	BeginP99MS        float64 `json:"begin_p99_ms"`
	CompleteP50MS     float64 `json:"complete_p50_ms"`
	CompleteP99MS     float64 `json:"complete_p99_ms"`
	ReplayP50MS       float64 `json:"replay_p50_ms"`
	ReplayP99MS       float64 `json:"replay_p99_ms"`
	LeanP50MS         float64 `json:"lean_pair_p50_ms"`     // insert p50 + update p50
	BaselineP50MS     float64 `json:"baseline_pair_p50_ms"` // insert p50 + update p50
	CoordCPUPer1000   float64 `json:"coordinator_cpu_s_per_1000_pairs"`
	PGCPUPer1000      float64 `json:"postgres_cpu_s_per_1000_pairs"`
	LeanPGPer1000     float64 `json:"lean_postgres_cpu_s_per_1000_pairs"`
	LeanClientPer1000 float64 `json:"lean_client_cpu_s_per_1000_pairs"`
	// CallersCPUPer1000 is the coordinator's callers' side (this driver's
	// gRPC clients) during the pairs cells: not part of a CPU goal, but on
	// one machine it takes the same CPUs, so the whole machine's cost of a
	// pair is callers + coordinator + PostgreSQL against the lean
	// baseline's client + PostgreSQL.
	CallersCPUPer1000 float64 `json:"callers_cpu_s_per_1000_pairs"`
	BaselinePGPer1000 float64 `json:"baseline_postgres_cpu_s_per_1000_pairs"`
	// CPUPerPairRatio is (coordinator + PostgreSQL) over (PostgreSQL +
	// client) of the lean baseline, CPU per pair.
	CPUPerPairRatio float64 `json:"cpu_per_pair_vs_lean"`
	// PGCPUPerPairRatio is PostgreSQL's CPU per pair on the coordinator's
	// path over PostgreSQL's CPU per pair of the lean baseline
	// (PGCPUPer1000 / LeanPGPer1000).
	PGCPUPerPairRatio float64 `json:"postgres_cpu_per_pair_vs_lean"`
	CoordPeakRSSMB    float64 `json:"coordinator_peak_rss_mb"` // over the row's pairs and replays cells
	// OthersCPUShare is the largest share of the CPUs other processes took
	// during one of the row's cells.
	OthersCPUShare float64 `json:"others_cpu_share"`
	Errors         int64   `json:"errors"`
}

// Goal is one figure the benchmark is judged by, in its area: "speed"
// (against the lean table), "scale" (the reaper and the gauge at many
// records), "scale-out" (Citus: each worker's CPU per pair) or
// "footprint" (memory, latency with many records, run time).
type Goal struct {
	Area   string  `json:"area"`
	Name   string  `json:"name"`
	Target string  `json:"target"`
	Value  float64 `json:"value"`
	Unit   string  `json:"unit"`
	// Status is "met", "not met" or "not measured".
	Status string `json:"status"`
	// Note is a figure reported beside the goal that is not part of it.
	Note string `json:"note,omitempty"`
}

// cells returns every cell of kind at concurrency, in run order.
func (r *report) cells(kind cellKind, concurrency int) []*Cell {
	var out []*Cell
	for i := range r.Cells {
		if c := &r.Cells[i]; c.Kind == kind && c.Concurrency == concurrency {
			out = append(out, c)
		}
	}
	return out
}

// pooled is the cells of one kind at one concurrency taken together.
type pooled struct {
	ops, errs            int64
	seconds              float64
	coord, pg, driver    float64
	p50, p99             map[string]float64
	peakRSS, othersShare float64
}

func pool(cs []*Cell) pooled {
	p := pooled{p50: map[string]float64{}, p99: map[string]float64{}}
	for _, c := range cs {
		p.ops += c.Ops
		p.errs += c.Errors
		p.seconds += c.Seconds
		p.coord += c.CoordCPUSeconds
		p.pg += c.PGCPUSeconds
		p.driver += c.DriverCPUSeconds
		for name, l := range c.LatencyMS {
			p.p50[name] += l.P50 / float64(len(cs))
			p.p99[name] = max(p.p99[name], l.P99)
		}
		p.peakRSS = max(p.peakRSS, c.CoordPeakRSSMB)
		p.othersShare = max(p.othersShare, c.OthersCPUShare)
	}
	return p
}

func (p pooled) perSec() float64 { return ratio(float64(p.ops), p.seconds) }

func (p pooled) per1000(cpu float64) float64 { return ratio(cpu, float64(p.ops)) * 1000 }

func (r *report) row(concurrency int) *Row {
	for i := range r.Rows {
		if r.Rows[i].Concurrency == concurrency {
			return &r.Rows[i]
		}
	}
	return nil
}

// finish derives the rows and the goals from the cells.
func (r *report) finish() {
	r.Rows = nil
	for _, c := range r.Settings.Concurrency {
		pc, rc, lc, bc := r.cells(kindPairs, c), r.cells(kindReplays, c), r.cells(kindLean, c), r.cells(kindBaseline, c)
		if len(pc) == 0 || len(rc) == 0 {
			continue
		}
		p, rp, l, b := pool(pc), pool(rc), pool(lc), pool(bc)
		row := Row{Concurrency: c, PairsPerSec: p.perSec(), LeanPerSec: l.perSec(), BaselinePerSec: b.perSec(),
			ReplaysPerSec: rp.perSec(),
			BeginP50MS:    p.p50["begin"], BeginP99MS: p.p99["begin"],
			CompleteP50MS: p.p50["complete"], CompleteP99MS: p.p99["complete"],
			ReplayP50MS: rp.p50["begin"], ReplayP99MS: rp.p99["begin"],
			LeanP50MS:       l.p50["insert"] + l.p50["update"],
			BaselineP50MS:   b.p50["insert"] + b.p50["update"],
			CoordCPUPer1000: p.per1000(p.coord), PGCPUPer1000: p.per1000(p.pg), CallersCPUPer1000: p.per1000(p.driver),
			LeanPGPer1000: l.per1000(l.pg), LeanClientPer1000: l.per1000(l.driver),
			BaselinePGPer1000: b.per1000(b.pg),
			CoordPeakRSSMB:    max(p.peakRSS, rp.peakRSS),
			OthersCPUShare:    max(p.othersShare, rp.othersShare, l.othersShare, b.othersShare),
			Errors:            p.errs + rp.errs + l.errs + b.errs,
		}
		row.Ratio = ratio(row.PairsPerSec, row.BaselinePerSec)
		row.LeanRatio = ratio(row.PairsPerSec, row.LeanPerSec)
		row.ReplayPairRatio = ratio(row.ReplaysPerSec, row.PairsPerSec)
		row.CPUPerPairRatio = ratio(row.CoordCPUPer1000+row.PGCPUPer1000, row.LeanPGPer1000+row.LeanClientPer1000)
		row.derive()
		for i := range min(len(pc), len(lc)) {
			row.LeanRatios = append(row.LeanRatios, ratio(pc[i].OpsPerSec, lc[i].OpsPerSec))
		}
		r.Rows = append(r.Rows, row)
	}
	if r.Ghz != nil {
		if rc := r.cells(kindReplays, r.Ghz.Concurrency); len(rc) > 0 {
			rp := pool(rc)
			r.Ghz.OursPerSec, r.Ghz.OursP50MS, r.Ghz.OursP99MS = rp.perSec(), rp.p50["begin"], rp.p99["begin"]
			if rp.ops > 0 {
				r.Ghz.OursGeneratorCPUPer1000 = rp.per1000(rp.driver)
			}
		}
	}
	r.Paths = r.pathRows(r.PathsSkipped)
	r.Citus = r.citusRows()
	r.Goals = r.goals()
}

// derive sets the row's figures that later versions of the report added
// and that the row's own figures determine, so that a report an earlier
// version wrote renders with them.
func (row *Row) derive() {
	row.PGCPUPerPairRatio = ratio(row.PGCPUPer1000, row.LeanPGPer1000)
}

// maxPairsPerSec is the highest pairs/s of the run's rows: the pair rate
// the reaper must keep pace with.
func (r *report) maxPairsPerSec() float64 {
	var m float64
	for _, row := range r.Rows {
		m = max(m, row.PairsPerSec)
	}
	return m
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

func (r *report) goals() []Goal {
	var gs []Goal
	add := func(area, name, target, unit string, value float64, measured, met bool) *Goal {
		g := Goal{Area: area, Name: name, Target: target, Value: value, Unit: unit, Status: "not measured"}
		if measured {
			g.Status = map[bool]string{true: "met", false: "not met"}[met]
		}
		gs = append(gs, g)
		return &gs[len(gs)-1]
	}
	row64, row16, row256 := r.row(64), r.row(16), r.row(256)
	v := func(row *Row, f func(*Row) float64) float64 {
		if row == nil {
			return 0
		}
		return f(row)
	}
	has := func(row *Row) bool { return row != nil && row.LeanPerSec > 0 }

	// Speed: faster and lighter on PostgreSQL than the table a user would
	// write by hand.
	lean64 := v(row64, func(x *Row) float64 { return x.LeanRatio })
	add("speed", "pairs/s vs lean baseline at 64 callers", ">= 1.5x", "x", lean64, has(row64), lean64 >= 1.5)
	lean256 := v(row256, func(x *Row) float64 { return x.LeanRatio })
	add("speed", "pairs/s vs lean baseline at 256 callers", ">= 3.0x", "x", lean256, has(row256), lean256 >= 3.0)
	rp64 := v(row64, func(x *Row) float64 { return x.ReplayPairRatio })
	add("speed", "replays/s vs pairs/s at 64 callers", ">= 8.0x", "x", rp64, row64 != nil, rp64 >= 8.0)
	// The other paths (-paths): the generated stub against the lean
	// table, Node's and Python's clients against the main table's client,
	// and replays against pairs on each.
	for _, c := range []struct {
		n      int
		target float64
	}{{64, 1.0}, {256, 2.0}} {
		p := r.pathRow(pathStub, c.n)
		val := 0.0
		if p != nil {
			val = p.LeanRatio
		}
		g := add("speed", fmt.Sprintf("stub (unary) pairs/s vs lean at %d callers", c.n), fmt.Sprintf(">= %.1fx", c.target), "x",
			val, p != nil && p.LeanRatio > 0, val >= c.target)
		if f := r.pathRow(pathFloor, c.n); f != nil && f.LeanRatio > 0 {
			g.Note = fmt.Sprintf("reported, not a goal: grpc-go alone (floor) %.0f pairs/s, %.2fx lean", f.PairsPerSec, f.LeanRatio)
		}
	}
	for _, path := range []string{pathNode, pathPython} {
		p := r.pathRow(path, 64)
		val := 0.0
		if p != nil {
			val = p.MainRatio
		}
		add("speed", fmt.Sprintf("%s client pairs/s vs the %s client at 64", path, r.Settings.Client), ">= 0.8x", "x",
			val, p != nil && p.MainRatio > 0, val >= 0.8)
	}
	for _, path := range []string{pathStub, pathNode, pathPython} {
		p := r.pathRow(path, 64)
		val := 0.0
		if p != nil {
			val = p.ReplayPairRatio
		}
		g := add("speed", path+" replays/s vs pairs/s at 64 callers", ">= 8.0x", "x", val, p != nil, val >= 8.0)
		if f := r.pathRow(pathFloor, 64); path == pathStub && f != nil && has(row64) {
			// A stub path that meets its pairs goal (the lean table's
			// pairs/s) and this one answers 8 Begins a pair: the floor's
			// Begins/s over the lean table's pairs/s bounds that ratio.
			g.Note = fmt.Sprintf("reported, not a goal: grpc-go alone (floor) answers %.0f replays/s, %.2fx the lean table's pairs/s",
				f.ReplaysPerSec, f.ReplaysPerSec/row64.LeanPerSec)
		}
	}
	pgCPU := v(row64, func(x *Row) float64 { return x.PGCPUPerPairRatio })
	g := add("speed", "PostgreSQL CPU/pair vs lean's PostgreSQL at 64", "<= 0.5x", "x", pgCPU,
		has(row64) && row64.LeanPGPer1000 > 0, pgCPU <= 0.5)
	switch {
	case row64 != nil && row64.CallersCPUPer1000 > 0:
		g.Note = fmt.Sprintf("reported, not a goal: coordinator %.3f + callers %.3f CPU ms/pair",
			row64.CoordCPUPer1000, row64.CallersCPUPer1000)
	case row64 != nil: // a report from before the callers' CPU was recorded
		g.Note = fmt.Sprintf("reported, not a goal: coordinator %.3f CPU ms/pair, callers' not recorded", row64.CoordCPUPer1000)
	}
	p99 := v(row16, func(x *Row) float64 { return x.BeginP99MS })
	add("speed", "Begin p99 at 16 callers", "<= 5 ms", "ms", p99, row16 != nil, p99 <= 5)
	var errs int64
	for _, row := range r.Rows {
		errs += row.Errors
	}
	for _, p := range r.Paths {
		errs += p.Errors
	}
	add("speed", "no errors (sum over the rows)", "= 0", "", float64(errs), len(r.Rows) > 0, errs == 0)

	// Scale: the reaper keeps pace, the gauge stays cheap.
	var pace float64
	paceMeasured := r.Scale != nil && r.Scale.Backlog.FirstPassSeconds > 0 && r.maxPairsPerSec() > 0
	if paceMeasured {
		b := r.Scale.Backlog
		pace = min(b.ExpiredPerSec, b.DeletedPerSec) / r.maxPairsPerSec()
	}
	add("scale", "reaper (defaults) rows/s vs the highest pairs/s", ">= 1.0x", "x", pace, paceMeasured, pace >= 1.0)
	var gauge float64
	gaugeMeasured := r.Scale != nil && r.Scale.Gauge.Error == "" && r.Scale.Gauge.Records > 0
	name := "records gauge reading at 10M records"
	if gaugeMeasured {
		gauge = r.Scale.Gauge.MS
		name = fmt.Sprintf("records gauge reading at %s records", count(r.Scale.Gauge.Records))
	}
	add("scale", name, "<= 100 ms", "ms", gauge, gaugeMeasured && r.Scale.Gauge.Records >= 10_000_000, gauge <= 100)

	// Footprint: memory, latency at many records, the run's own time.
	rss := v(row256, func(x *Row) float64 { return x.CoordPeakRSSMB })
	add("footprint", "coordinator peak RSS at 256 callers", "<= 200 MB", "MB", rss, row256 != nil, rss <= 200)
	var scale float64
	measured := r.Scale != nil && r.Scale.Empty.Ops > 0 && r.Scale.Loaded.Ops > 0
	if measured {
		scale = ratio(r.Scale.Loaded.LatencyMS["begin"].P50, r.Scale.Empty.LatencyMS["begin"].P50)
	}
	name = "Begin p50 with many records vs an empty table"
	if r.Scale != nil {
		name = fmt.Sprintf("Begin p50 with %s records vs an empty table", count(r.Scale.Records))
	}
	add("footprint", name, "<= 1.5x", "x", scale, measured && r.Scale.Records >= 10_000_000, scale <= 1.5)
	// A report from before the Citus cells has neither rows nor a reason:
	// it renders as it printed.
	if len(r.Citus) > 0 || r.CitusSkipped != "" {
		gs = append(gs, r.citusGoals()...)
	}
	add("footprint", "make bench run time (driver)", "<= 600 s", "s", r.TotalSeconds, !r.Settings.Quick, r.TotalSeconds <= 600)
	return gs
}

// count writes n as 10M, 250k or 900.
func count(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dM", n/1_000_000)
	case n >= 1_000 && n%1_000 == 0:
		return fmt.Sprintf("%dk", n/1_000)
	}
	return strconv.Itoa(n)
}

// print writes the table.
func (r *report) print(out io.Writer) error {
	s := r.Settings
	commit := s.Commit
	if commit == "" {
		commit = "unknown commit"
	}
	fmt.Fprintf(out, "\nidemcoord bench (%s) — %s, %s, %d CPUs, PostgreSQL %s durable (fsync, synchronous_commit, full_page_writes on)\n",
		r.Command, commit, r.StartedAt, r.Machine.CPUs, r.Postgres.Version)
	fmt.Fprintf(out, "%s warm-up + %s measured per cell, %d rounds of lean/pairs; callers' client: %s; lean baseline: pool of as many connections as callers; "+
		"baseline on the coordinator's table: pool %d; %d-byte responses; total %.0f s\n\n",
		s.Warmup, s.Duration, s.Rounds, s.clientName(), s.PoolConns, s.BodyBytes, r.TotalSeconds)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "callers\tpairs/s\tlean/s\tvs lean\tbaseline/s\tvs base\treplays/s\treplay/pair\tBegin p50/p99 ms\tComplete p50/p99 ms\treplay p50/p99 ms\tlean p50 ms\t"+
		"CPU s/1k pairs coord+PG\tlean PG+client\tPG vs lean PG\tgRPC callers\tcoord RSS MB\tothers CPU\terrors\t")
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%d\t%.0f\t%.0f\t%.2f\t%.0f\t%.2f\t%.0f\t%.2f\t%.2f / %.2f\t%.2f / %.2f\t%.2f / %.2f\t%.2f\t%.3f+%.3f\t%.3f+%.3f\t%.2f\t%.3f\t%.0f\t%.0f%%\t%d\t\n",
			row.Concurrency, row.PairsPerSec, row.LeanPerSec, row.LeanRatio, row.BaselinePerSec, row.Ratio,
			row.ReplaysPerSec, row.ReplayPairRatio,
			row.BeginP50MS, row.BeginP99MS, row.CompleteP50MS, row.CompleteP99MS, row.ReplayP50MS, row.ReplayP99MS, row.LeanP50MS,
			row.CoordCPUPer1000, row.PGCPUPer1000, row.LeanPGPer1000, row.LeanClientPer1000, row.PGCPUPerPairRatio, row.CallersCPUPer1000, row.CoordPeakRSSMB,
			row.OthersCPUShare*100, row.Errors)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(r.Paths) > 0 {
		fmt.Fprintf(out, "\nother callers' paths, same run (vs %s: the table's pairs/s at the same callers):\n", s.Client)
		tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "path\tcallers\tpairs/s\tvs lean\tvs %s\treplays/s\treplay/pair\tBegin p99 ms\tCPU s/1k pairs coord+PG\tcallers\terrors\t\n", s.Client)
		var skipped []string
		for _, p := range r.Paths {
			if p.Skipped != "" {
				skipped = append(skipped, fmt.Sprintf("  %s at %d callers not measured: %s\n", p.Path, p.Concurrency, p.Skipped))
				continue
			}
			replays, perPair := fmt.Sprintf("%.0f", p.ReplaysPerSec), fmt.Sprintf("%.2f", p.ReplayPairRatio)
			if p.ReplaysPerSec == 0 && p.Path == pathFloor { // the floor's replays run at 64 callers only
				replays, perPair = "-", "-"
			}
			fmt.Fprintf(tw, "%s\t%d\t%.0f\t%.2f\t%.2f\t%s\t%s\t%.2f\t%.3f+%.3f\t%.3f\t%d\t\n", p.Path, p.Concurrency,
				p.PairsPerSec, p.LeanRatio, p.MainRatio, replays, perPair, p.BeginP99MS,
				p.CoordCPUPer1000, p.PGCPUPer1000, p.CallersCPUPer1000, p.Errors)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprint(out, strings.Join(skipped, ""))
		if slices.ContainsFunc(r.Paths, func(p PathRow) bool { return p.Path == pathFloor && p.Skipped == "" }) {
			fmt.Fprintln(out, "  floor: the stub's callers against grpc-go alone (a server of canned answers of the coordinator's size; no coordinator,\n"+
				"  no PostgreSQL; its CPU in the coord column): what grpc-go allows unary callers on this machine, the stub's ceiling")
		}
	}
	if err := r.printCitus(out); err != nil {
		return err
	}
	if g := r.Ghz; g != nil {
		fmt.Fprintf(out, "\nghz %s, %s at %d callers: %.0f/s, p50 %.2f ms, p99 %.2f ms, load generator %.3f CPU s/1k calls (%d OK, %d cut at the end)\n",
			g.Version, g.Call, g.Concurrency, g.PerSec, g.P50MS, g.P99MS, g.GeneratorCPUPer1000, g.OK, g.Count-uint64(g.OK))
		fmt.Fprintf(out, "  ours, same keys:            %.0f/s, p50 %.2f ms, p99 %.2f ms, load generator %.3f CPU s/1k calls\n",
			g.OursPerSec, g.OursP50MS, g.OursP99MS, g.OursGeneratorCPUPer1000)
	}
	if sc := r.Scale; sc != nil {
		fmt.Fprintf(out, "\nscale, pairs at %d callers (bulk load of %s records %.0f s, VACUUM ANALYZE %.0f s; table %.0f MB, indexes %.0f MB):\n",
			sc.Concurrency, count(sc.Records), sc.LoadSeconds, sc.VacuumSeconds, sc.TableMB, sc.IndexesMB)
		tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  table\tpairs/s\tBegin p50/p99 ms\tComplete p50/p99 ms")
		for _, c := range []Cell{sc.Empty, sc.Loaded, sc.LoadedReaping} {
			fmt.Fprintf(tw, "  %s\t%.0f\t%.2f / %.2f\t%.2f / %.2f\n", c.Label, c.OpsPerSec,
				c.LatencyMS["begin"].P50, c.LatencyMS["begin"].P99, c.LatencyMS["complete"].P50, c.LatencyMS["complete"].P99)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		g := sc.Gauge
		fmt.Fprintf(out, "  idempotency_records gauge at %s records: %.1f ms a reading (estimated: %v); the whole-table count it replaced: %.0f ms\n",
			count(g.Records), g.MS, g.Estimated, g.FullCountMS)
		if g.Error != "" {
			fmt.Fprintf(out, "    error: %s\n", g.Error)
		}
		fmt.Fprintf(out, "  the coordinator's reaper (default settings), backlog of %s to expire and %s to delete, pairs running: %s;"+
			" highest pairs/s of the run: %.0f\n", count(sc.Backlog.DueToExpire), count(sc.Backlog.DueToDelete), sc.Backlog, r.maxPairsPerSec())
	}
	fmt.Fprintln(out, "\ngoals:")
	for _, g := range r.Goals {
		note := ""
		if g.Note != "" {
			note = "  " + g.Note
		}
		fmt.Fprintf(out, "  %-15s %-50s %8.2f %-2s (target %s)%s\n", "["+g.Status+"]", g.Name, g.Value, g.Unit, g.Target, note)
	}
	cells := append([]Cell(nil), r.Cells...)
	if r.Scale != nil {
		cells = append(cells, r.Scale.Empty, r.Scale.Loaded, r.Scale.LoadedReaping)
	}
	var busy []string
	for _, c := range cells {
		if c.OthersCPUShare >= busyThreshold {
			name := fmt.Sprintf("%s/%d", c.Kind, c.Concurrency)
			if c.Label != "" {
				name = "scale " + c.Label
			}
			busy = append(busy, fmt.Sprintf("%s %.0f%%", name, c.OthersCPUShare*100))
		}
	}
	if len(busy) > 0 {
		fmt.Fprintf(out, "WARNING: other processes used CPU during %d cells (%s): those figures are not comparable; rerun on a quiet machine\n",
			len(busy), strings.Join(busy, ", "))
	}
	for _, c := range r.Cells {
		if c.Errors > 0 {
			fmt.Fprintf(out, "errors: %s at %d callers: %d, first: %s\n", c.Kind, c.Concurrency, c.Errors, c.FirstError)
		}
	}
	return nil
}

// render prints the report stored in a JSON file by an earlier run (`go run
// ./bench -render FILE`): the figures of the documentation's performance
// page are this output, not a paste. The figures are the run's own, as it
// printed them, with the columns later versions added where the run's rows
// determine them; the goals are today's, judged on those rows (the JSON
// keeps the goals the run was judged by).
func render(path string, out io.Writer) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var r report
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if r.Schema != reportSchema || r.Settings == nil {
		return fmt.Errorf("%s: schema %q, want %q with settings", path, r.Schema, reportSchema)
	}
	r.Settings.Warmup = time.Duration(r.Settings.WarmupSeconds * float64(time.Second))
	r.Settings.Duration = time.Duration(r.Settings.DurationSeconds * float64(time.Second))
	if r.Settings.Client == "" {
		// Runs from before -client drove the cells with the generated stub.
		r.Settings.Client = clientStub
	}
	for i := range r.Rows {
		r.Rows[i].derive()
	}
	r.Goals = r.goals()
	return r.print(out)
}

// write stores the report as <dir>/<timestamp>.json and <dir>/latest.json
// and returns the first path.
func (r *report) write(dir string, started time.Time) (string, error) {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return "", err
	}
	b = append(b, '\n')
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	path := filepath.Join(dir, started.UTC().Format("20060102T150405Z")+".json")
	for _, p := range []string{path, filepath.Join(dir, "latest.json")} {
		if err := os.WriteFile(p, b, 0o644); err != nil {
			return "", err
		}
	}
	return path, nil
}
