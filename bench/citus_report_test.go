package main

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"
)

// citusReport is a report with the single PostgreSQL's pairs and replays
// at 64 and 256 callers (0.100 CPU-s per 1000 pairs) and the Citus cells,
// each worker's CPU per 1000 pairs as workers says.
func citusReport(workers map[int][2]float64) *report {
	r := &report{Settings: &settings{Client: clientGo, Concurrency: []int{64, 256}, PathConcurrency: []int{64, 256}}}
	for _, c := range []int{64, 256} {
		r.Cells = append(r.Cells,
			Cell{Kind: kindPairs, Concurrency: c, Seconds: 2, Ops: 2000, PGCPUSeconds: 0.2},
			Cell{Kind: kindReplays, Concurrency: c, Seconds: 2, Ops: 20000})
		w, ok := workers[c]
		if !ok {
			continue
		}
		r.Cells = append(r.Cells,
			Cell{Kind: kindCitusPairs, Concurrency: c, Seconds: 2, Ops: 1000, CoordCPUSeconds: 0.3, PGCPUSeconds: 1.0, WorkerCPUSeconds: []float64{w[0], w[1]}},
			Cell{Kind: kindCitusReplays, Concurrency: c, Seconds: 2, Ops: 8000, Errors: 1},
			Cell{Kind: kindCitusSpreadPairs, Concurrency: c, Seconds: 2, Ops: 1200, PGCPUSeconds: 0.6, WorkerCPUSeconds: []float64{0.5, 0.5}})
		if c == 64 {
			// The spread URL's replays, at 64 callers only: the row at
			// 256 shows none.
			r.Cells = append(r.Cells, Cell{Kind: kindCitusSpreadReplays, Concurrency: c, Seconds: 2, Ops: 10000, Errors: 2})
		}
	}
	r.finish()
	return r
}

// TestCitusGoals checks the Citus rows derived from the cells and the
// goals on either side of 0.6x, judged on the highest worker, and not
// measured without Citus.
func TestCitusGoals(t *testing.T) {
	g64, g256 := "Citus worker CPU/pair vs single PostgreSQL at 64 callers", "Citus worker CPU/pair vs single PostgreSQL at 256 callers"

	// Workers at 0.06 and 0.07 CPU-s per 1000 pairs at 64 (0.7x the
	// single PostgreSQL's 0.1, the higher one counts); 0.06 at 256.
	r := citusReport(map[int][2]float64{64: {0.06, 0.07}, 256: {0.06, 0.05}})
	checkGoals(t, r.goals(), map[string]string{g64: "not met", g256: "met"})
	row := r.citusRow(citusCoordinatorNode, 64)
	if row == nil {
		t.Fatalf("no coordinator-node row at 64: %+v", r.Citus)
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
	if !near(row.PairsPerSec, 500) || !near(row.ReplaysPerSec, 4000) || !near(row.CoordNodeCPUPer1000, 1.0) ||
		!near(row.CoordCPUPer1000, 0.3) || len(row.WorkerCPUPer1000) != 2 || !near(row.WorkerCPUPer1000[1], 0.07) ||
		!near(row.PostgresCPUPer1000, 0.1) || !near(row.WorkerRatio, 0.7) || row.Errors != 1 {
		t.Errorf("coordinator-node row at 64 = %+v", row)
	}
	if sp := r.citusRow(citusSpread, 256); sp == nil || !near(sp.PairsPerSec, 600) || !near(sp.CoordNodeCPUPer1000, 0.5) || sp.ReplaysPerSec != 0 {
		t.Errorf("spread row at 256 = %+v", sp)
	}
	if sp := r.citusRow(citusSpread, 64); sp == nil || !near(sp.ReplaysPerSec, 5000) || sp.Errors != 2 {
		t.Errorf("spread row at 64 = %+v, want its replays (5000/s) and their errors", sp)
	}

	var out bytes.Buffer
	if err := r.print(&out); err != nil {
		t.Fatal(err)
	}
	// Compared with the columns' padding squeezed to one space.
	printed := strings.Join(strings.Fields(out.String()), " ")
	for _, text := range []string{"coordinator node 64 500 4000 0.300 1.000 0.060 / 0.070 0.100 0.70 1",
		"spread 256 600 - 0.000 0.500", "spread 64 600 5000 0.000 0.500", "[not met] " + g64, "[met] " + g256,
		"reported, not a goal: 500 pairs/s, coordinator node 1.000 CPU-s/1000 pairs; spread URL 600 pairs/s, coordinator node 0.500"} {
		if !strings.Contains(printed, text) {
			t.Errorf("printed report without %q:\n%s", text, out.String())
		}
	}

	// The JSON keeps the rows: a report read back renders the same goals.
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var back report
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	checkGoals(t, back.goals(), map[string]string{g64: "not met", g256: "met"})

	// Without Citus: not measured, saying why; nothing in the JSON.
	r = citusReport(nil)
	r.CitusSkipped = "the citus extension is not installed"
	checkGoals(t, r.goals(), map[string]string{g64: "not measured", g256: "not measured"})
	out.Reset()
	if err := r.print(&out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "Citus cells not measured: the citus extension is not installed") {
		t.Errorf("printed report without why Citus was not measured:\n%s", out.String())
	}
	if b, _ := json.Marshal(r); strings.Contains(string(b), `"citus"`) || strings.Contains(string(b), "worker_cpu_s") {
		t.Errorf("JSON of a run without Citus cells has Citus fields: %s", b)
	}
}

// TestRenderReportWithoutCitus: a report written before the Citus cells
// renders as it printed, without their goals.
func TestRenderReportWithoutCitus(t *testing.T) {
	var out bytes.Buffer
	if err := render("results/20261123T232305Z.json", &out); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out.String(), "Citus") {
		t.Errorf("rendered report from before the Citus cells mentions Citus:\n%s", out.String())
	}
}
