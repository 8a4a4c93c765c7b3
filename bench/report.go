package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"
)

// reportSchema names the layout of the JSON report; change it when a field
// changes meaning.
const reportSchema = "idemcoord-bench/1"

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
	Rows  []Row   `json:"rows"`
	Ghz   *GhzRow `json:"ghz,omitempty"`
	Scale *Scale  `json:"scale,omitempty"`
	Goals []Goal  `json:"goals"`
	// Coordinator is what the coordinator process used over the whole run.
	Coordinator coordinatorTotals `json:"coordinator"`
	// Cells are the raw measurements the rows come from.
	Cells []Cell `json:"cells"`
}

// Row is one concurrency's line of the table.
type Row struct {
	Concurrency       int     `json:"concurrency"`
	PairsPerSec       float64 `json:"pairs_per_s"`
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
	BaselineP50MS     float64 `json:"baseline_pair_p50_ms"` // insert p50 + update p50
	CoordCPUPer1000   float64 `json:"coordinator_cpu_s_per_1000_pairs"`
	PGCPUPer1000      float64 `json:"postgres_cpu_s_per_1000_pairs"`
	BaselinePGPer1000 float64 `json:"baseline_postgres_cpu_s_per_1000_pairs"`
	CoordPeakRSSMB    float64 `json:"coordinator_peak_rss_mb"` // over the row's pairs and replays cells
	Errors            int64   `json:"errors"`
}

// Goal is one "done when" figure of issue 6.
type Goal struct {
	Name   string  `json:"name"`
	Target string  `json:"target"`
	Value  float64 `json:"value"`
	Unit   string  `json:"unit"`
	// Status is "met", "not met" or "not measured".
	Status string `json:"status"`
}

func (r *report) cell(kind cellKind, concurrency int) *Cell {
	for i := range r.Cells {
		if c := &r.Cells[i]; c.Kind == kind && c.Concurrency == concurrency {
			return c
		}
	}
	return nil
}

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
		p, rp, b := r.cell(kindPairs, c), r.cell(kindReplays, c), r.cell(kindBaseline, c)
		if p == nil || rp == nil || b == nil {
			continue
		}
		row := Row{Concurrency: c, PairsPerSec: p.OpsPerSec, BaselinePerSec: b.OpsPerSec, ReplaysPerSec: rp.OpsPerSec,
			BeginP50MS: p.LatencyMS["begin"].P50, BeginP99MS: p.LatencyMS["begin"].P99,
			CompleteP50MS: p.LatencyMS["complete"].P50, CompleteP99MS: p.LatencyMS["complete"].P99,
			ReplayP50MS: rp.LatencyMS["begin"].P50, ReplayP99MS: rp.LatencyMS["begin"].P99,
			BaselineP50MS:  b.LatencyMS["insert"].P50 + b.LatencyMS["update"].P50,
			CoordPeakRSSMB: max(p.CoordPeakRSSMB, rp.CoordPeakRSSMB),
			Errors:         p.Errors + rp.Errors + b.Errors,
		}
		row.Ratio = ratio(row.PairsPerSec, row.BaselinePerSec)
		row.ReplayPairRatio = ratio(row.ReplaysPerSec, row.PairsPerSec)
		if p.Ops > 0 {
			row.CoordCPUPer1000 = p.CoordCPUSeconds / float64(p.Ops) * 1000
			row.PGCPUPer1000 = p.PGCPUSeconds / float64(p.Ops) * 1000
		}
		if b.Ops > 0 {
			row.BaselinePGPer1000 = b.PGCPUSeconds / float64(b.Ops) * 1000
		}
		r.Rows = append(r.Rows, row)
	}
	if r.Ghz != nil {
		if rp := r.cell(kindReplays, r.Ghz.Concurrency); rp != nil {
			r.Ghz.OursPerSec, r.Ghz.OursP50MS, r.Ghz.OursP99MS = rp.OpsPerSec, rp.LatencyMS["begin"].P50, rp.LatencyMS["begin"].P99
			if rp.Ops > 0 {
				r.Ghz.OursGeneratorCPUPer1000 = rp.DriverCPUSeconds / float64(rp.Ops) * 1000
			}
		}
	}
	r.Goals = r.goals()
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

func (r *report) goals() []Goal {
	var gs []Goal
	add := func(name, target, unit string, value float64, measured, met bool) {
		g := Goal{Name: name, Target: target, Value: value, Unit: unit, Status: "not measured"}
		if measured {
			g.Status = map[bool]string{true: "met", false: "not met"}[met]
		}
		gs = append(gs, g)
	}
	row64, row16, row256 := r.row(64), r.row(16), r.row(256)
	v := func(row *Row, f func(*Row) float64) float64 {
		if row == nil {
			return 0
		}
		return f(row)
	}
	ratio64 := v(row64, func(x *Row) float64 { return x.Ratio })
	add("pairs/s vs direct-SQL baseline at 64 callers", ">= 1.0x", "x", ratio64, row64 != nil, ratio64 >= 1.0)
	rp64 := v(row64, func(x *Row) float64 { return x.ReplayPairRatio })
	add("replays/s vs pairs/s at 64 callers", ">= 3.0x", "x", rp64, row64 != nil, rp64 >= 3.0)
	p99 := v(row16, func(x *Row) float64 { return x.BeginP99MS })
	add("Begin p99 at 16 callers", "<= 10 ms", "ms", p99, row16 != nil, p99 <= 10)
	rss := v(row256, func(x *Row) float64 { return x.CoordPeakRSSMB })
	add("coordinator peak RSS at 256 callers", "<= 200 MB", "MB", rss, row256 != nil, rss <= 200)
	var scale float64
	measured := r.Scale != nil && r.Scale.Empty.Ops > 0 && r.Scale.Loaded.Ops > 0
	if measured {
		scale = ratio(r.Scale.Loaded.LatencyMS["begin"].P50, r.Scale.Empty.LatencyMS["begin"].P50)
	}
	name := "Begin p50 with many records vs an empty table"
	if r.Scale != nil {
		name = fmt.Sprintf("Begin p50 with %s records vs an empty table", count(r.Scale.Records))
	}
	add(name, "<= 1.5x", "x", scale, measured && r.Scale.Records >= 10_000_000, scale <= 1.5)
	add("make bench run time (driver)", "<= 600 s", "s", r.TotalSeconds, true, r.TotalSeconds <= 600)
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
	return fmt.Sprint(n)
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
	fmt.Fprintf(out, "%s warm-up + %s measured per cell; pool %d connections for the coordinator and the baseline; %d-byte responses; total %.0f s\n\n",
		s.Warmup, s.Duration, s.PoolConns, s.BodyBytes, r.TotalSeconds)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "callers\tpairs/s\tbaseline/s\tratio\treplays/s\treplay/pair\tBegin p50/p99 ms\tComplete p50/p99 ms\treplay p50/p99 ms\tcoord CPU s/1k pairs\tPG CPU s/1k (coord/base)\tcoord RSS MB\terrors\t")
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%d\t%.0f\t%.0f\t%.2f\t%.0f\t%.2f\t%.2f / %.2f\t%.2f / %.2f\t%.2f / %.2f\t%.3f\t%.3f / %.3f\t%.0f\t%d\t\n",
			row.Concurrency, row.PairsPerSec, row.BaselinePerSec, row.Ratio, row.ReplaysPerSec, row.ReplayPairRatio,
			row.BeginP50MS, row.BeginP99MS, row.CompleteP50MS, row.CompleteP99MS, row.ReplayP50MS, row.ReplayP99MS,
			row.CoordCPUPer1000, row.PGCPUPer1000, row.BaselinePGPer1000, row.CoordPeakRSSMB, row.Errors)
	}
	if err := tw.Flush(); err != nil {
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
		fmt.Fprintf(out, "  reaper (ledger.Store.Reap, %s of the records deletable):\n    alone:      %s\n    under load: %s\n",
			count(sc.DeletableRecords), sc.Reaper, sc.ReaperUnder)
	}
	fmt.Fprintln(out, "\ngoals (issue 6):")
	for _, g := range r.Goals {
		fmt.Fprintf(out, "  %-15s %-55s %8.2f %-2s (target %s)\n", "["+g.Status+"]", g.Name, g.Value, g.Unit, g.Target)
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
