package main

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/bench/internal/procstat"
)

func TestParseStat(t *testing.T) {
	// The command name may hold spaces and parentheses.
	line := "4242 (idem (co) ord) S 17 4242 4242 0 -1 4194560 1000 0 0 0 250 75 0 0 20 0 9 0 100 0 0\n"
	st, err := procstat.Parse([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if st.PPID != 17 || st.CPU != 3.25 {
		t.Fatalf("procstat.Parse = %+v, want ppid 17 and 3.25 CPU seconds", st)
	}
	if _, err := procstat.Parse([]byte("4242 (x) S 1")); err == nil {
		t.Fatal("procstat.Parse accepted a short line")
	}
}

func TestParseHWM(t *testing.T) {
	mb, err := parseHWM(strings.NewReader("Name:\tidemcoord\nVmPeak:\t  900000 kB\nVmHWM:\t   51200 kB\nVmRSS:\t 40000 kB\n"))
	if err != nil || mb != 50 {
		t.Fatalf("parseHWM = %v, %v; want 50 MB", mb, err)
	}
	if _, err := parseHWM(strings.NewReader("Name:\tx\n")); err == nil {
		t.Fatal("parseHWM found a VmHWM in a status without one")
	}
}

func TestParseMachineCPU(t *testing.T) {
	busy, steal, err := parseMachineCPU([]byte("cpu  100 20 30 5000 40 5 5 7 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"))
	if err != nil || busy != 1.5 || steal != 0.07 {
		t.Fatalf("parseMachineCPU = %v, %v, %v; want 1.5, 0.07", busy, steal, err)
	}
}

func TestSummarize(t *testing.T) {
	var d []time.Duration
	for i := 100; i >= 1; i-- {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	l := summarize(d)
	if l.Count != 100 || l.P50 != 50 || l.P90 != 90 || l.P99 != 99 || l.Max != 100 {
		t.Fatalf("summarize = %+v", l)
	}
	if (summarize(nil) != Latency{}) {
		t.Fatal("summarize(nil) is not zero")
	}
}

func TestParseGhz(t *testing.T) {
	const out = `{"count": 1010, "total": 2000000000, "rps": 505,
		"errorDistribution": {"rpc error: code = Unavailable desc = closing": 10},
		"statusCodeDistribution": {"OK": 1000, "Unavailable": 10},
		"latencyDistribution": [{"percentage": 50, "latency": 1500000}, {"percentage": 99, "latency": 9250000}]}`
	row, err := parseGhz([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	if row.OK != 1000 || row.PerSec != 500 || row.P50MS != 1.5 || row.P99MS != 9.25 || row.Count != 1010 {
		t.Fatalf("parseGhz = %+v", row)
	}
	if _, err := parseGhz([]byte(`{"count": 3, "statusCodeDistribution": {"Unavailable": 3}}`)); err == nil {
		t.Fatal("parseGhz accepted a run where nothing succeeded")
	}
}

// TestReport checks the rows and goals derived from cells, and that the
// table and the JSON are written.
func TestReport(t *testing.T) {
	cell := func(kind cellKind, c int, ops int64, lat map[string]Latency) Cell {
		return Cell{Kind: kind, Concurrency: c, Seconds: 1, Ops: ops, OpsPerSec: float64(ops), LatencyMS: lat,
			CoordCPUSeconds: 2, PGCPUSeconds: 1, DriverCPUSeconds: 0.5, CoordPeakRSSMB: 60}
	}
	pairs := map[string]Latency{"begin": {P50: 2, P99: 8}, "complete": {P50: 3, P99: 9}}
	direct := map[string]Latency{"insert": {P50: 1}, "update": {P50: 1}}
	r := &report{Schema: reportSchema, Settings: &settings{Concurrency: []int{16, 64}, Rounds: 2, Client: clientStub}, TotalSeconds: 300}
	for _, c := range []int{16, 64} {
		r.Cells = append(r.Cells, cell(kindBaseline, c, 1250, direct))
	}
	for _, c := range []int{16, 64} {
		// Two rounds: pairs 1000 and 3000 against lean 2000 and 2000.
		r.Cells = append(r.Cells, cell(kindLean, c, 2000, direct), cell(kindPairs, c, 1000, pairs),
			cell(kindLean, c, 2000, direct), cell(kindPairs, c, 3000, pairs),
			cell(kindReplays, c, 8000, map[string]Latency{"begin": {P50: 1, P99: 2}}))
	}
	r.Scale = &Scale{Records: 10_000_000, Gauge: GaugeCost{Records: 10_000_000, MS: 3},
		Backlog: Backlog{Seconds: 10, FirstPassSeconds: 1, ExpiredPerSec: 5000, DeletedPerSec: 1500}}
	r.finish()
	if len(r.Rows) != 2 {
		t.Fatalf("%d rows, want 2", len(r.Rows))
	}
	row := r.Rows[1]
	// Pooled: 4000 pairs over 2 s against 4000 lean pairs over 2 s.
	if row.PairsPerSec != 2000 || row.LeanRatio != 1 || row.Ratio != 1.6 || row.ReplayPairRatio != 4 ||
		row.CoordCPUPer1000 != 1 || row.BaselineP50MS != 2 || row.LeanP50MS != 2 || fmt.Sprint(row.LeanRatios) != "[0.5 1.5]" {
		t.Fatalf("row 64 = %+v", row)
	}
	// (2+1)/2 CPU s per 1000 pairs against (1+0.5)/2 for the lean baseline.
	if row.CPUPerPairRatio != 2 {
		t.Fatalf("CPU per pair ratio = %v, want 2", row.CPUPerPairRatio)
	}
	// PostgreSQL: 1 CPU s per cell, 2000 ops a cell on both sides.
	if row.PGCPUPerPairRatio != 1 {
		t.Fatalf("PostgreSQL CPU per pair ratio = %v, want 1", row.PGCPUPerPairRatio)
	}
	want := map[string]string{
		"pairs/s vs lean baseline at 64 callers":          "not met", // 1.0x < 1.2x
		"pairs/s vs lean baseline at 256 callers":         "not measured",
		"replays/s vs pairs/s at 64 callers":              "not met", // 4x < 8x
		"PostgreSQL CPU/pair vs lean's PostgreSQL at 64":  "not met", // 1.0x > 0.5x
		"Begin p99 at 16 callers":                         "not met", // 8 ms > 5 ms
		"no errors (sum over the rows)":                   "met",
		"reaper (defaults) rows/s vs the highest pairs/s": "not met", // 1500 deleted/s < 2000 pairs/s
		"records gauge reading at 10M records":            "met",
		"coordinator peak RSS at 256 callers":             "not measured",
		"make bench run time (driver)":                    "met",
	}
	checkGoals(t, r.Goals, want)
	var out bytes.Buffer
	if err := r.print(&out); err != nil {
		t.Fatal(err)
	}
	for _, text := range []string{"[not met]", "lean/s", "PG vs lean PG", "callers' client: stub",
		"coordinator 1.000 + callers 0.250 CPU ms/pair"} {
		if !strings.Contains(out.String(), text) {
			t.Errorf("table without %q:\n%s", text, out.String())
		}
	}
	dir := t.TempDir()
	if _, err := r.write(dir, time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)); err != nil {
		t.Fatal(err)
	}
}

// checkGoals fails t unless gs holds every goal of want with its status.
func checkGoals(t *testing.T, gs []Goal, want map[string]string) {
	t.Helper()
	seen := map[string]bool{}
	for _, g := range gs {
		seen[g.Name] = true
		if w, ok := want[g.Name]; ok && g.Status != w {
			t.Errorf("goal %q: %s (%v %s), want %s", g.Name, g.Status, g.Value, g.Unit, w)
		}
	}
	for name := range want {
		if !seen[name] {
			t.Errorf("no goal %q", name)
		}
	}
}

// TestGoalsAgainstLean checks each goal judged on the 16-, 64- and
// 256-caller rows on either side of its target.
func TestGoalsAgainstLean(t *testing.T) {
	// good meets every goal, just.
	good := func() []Row {
		return []Row{
			{Concurrency: 16, PairsPerSec: 1000, LeanPerSec: 1000, BeginP99MS: 5},
			{Concurrency: 64, PairsPerSec: 1500, LeanPerSec: 1000, LeanRatio: 1.5, ReplaysPerSec: 12000, ReplayPairRatio: 8,
				PGCPUPer1000: 0.1, LeanPGPer1000: 0.2, CoordCPUPer1000: 0.15, CallersCPUPer1000: 0.05},
			{Concurrency: 256, PairsPerSec: 3000, LeanPerSec: 1000, LeanRatio: 3.0},
		}
	}
	goals := []string{"pairs/s vs lean baseline at 64 callers", "pairs/s vs lean baseline at 256 callers",
		"replays/s vs pairs/s at 64 callers", "PostgreSQL CPU/pair vs lean's PostgreSQL at 64",
		"Begin p99 at 16 callers", "no errors (sum over the rows)"}
	for _, tc := range []struct {
		name   string
		change func(rows []Row)
		missed string // the goal not met, "" for none
	}{
		{"all met", func([]Row) {}, ""},
		{"pairs at 64 under 1.5x", func(rows []Row) { rows[1].LeanRatio = 1.49 }, goals[0]},
		{"pairs at 256 under 3.0x", func(rows []Row) { rows[2].LeanRatio = 2.99 }, goals[1]},
		{"replays under 8x pairs", func(rows []Row) { rows[1].ReplayPairRatio = 7.9 }, goals[2]},
		{"PostgreSQL CPU over 0.5x", func(rows []Row) { rows[1].PGCPUPer1000 = 0.11 }, goals[3]},
		{"Begin p99 over 5 ms", func(rows []Row) { rows[0].BeginP99MS = 5.01 }, goals[4]},
		{"one error", func(rows []Row) { rows[2].Errors = 1 }, goals[5]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rows := good()
			tc.change(rows)
			for i := range rows {
				rows[i].derive()
			}
			r := &report{Settings: &settings{}, Rows: rows}
			want := map[string]string{}
			for _, name := range goals {
				want[name] = map[bool]string{true: "not met", false: "met"}[name == tc.missed]
			}
			gs := r.goals()
			checkGoals(t, gs, want)
			for _, g := range gs {
				if g.Area == "speed" && g.Name == goals[3] && g.Note != "reported, not a goal: coordinator 0.150 + callers 0.050 CPU ms/pair" {
					t.Errorf("goal %q: note %q", g.Name, g.Note)
				}
			}
		})
	}
	t.Run("no rows", func(t *testing.T) {
		want := map[string]string{}
		for _, name := range goals {
			want[name] = "not measured"
		}
		checkGoals(t, (&report{Settings: &settings{}}).goals(), want)
	})
}

// TestPathGoals judges the other paths: the stub against the lean table at
// 64 and 256 callers, Node and Python against the main table's client at
// 64, replays against pairs on each; a skipped path is not measured.
func TestPathGoals(t *testing.T) {
	good := func() []PathRow {
		return []PathRow{
			{Path: pathStub, Concurrency: 64, LeanRatio: 1.0, ReplayPairRatio: 8},
			{Path: pathStub, Concurrency: 256, LeanRatio: 2.0, ReplayPairRatio: 8},
			{Path: pathNode, Concurrency: 64, MainRatio: 0.8, ReplayPairRatio: 8},
			{Path: pathPython, Concurrency: 64, MainRatio: 0.8, ReplayPairRatio: 8},
		}
	}
	goals := []string{"stub (unary) pairs/s vs lean at 64 callers", "stub (unary) pairs/s vs lean at 256 callers",
		"node client pairs/s vs the go client at 64", "python client pairs/s vs the go client at 64",
		"stub replays/s vs pairs/s at 64 callers", "node replays/s vs pairs/s at 64 callers", "python replays/s vs pairs/s at 64 callers"}
	for _, tc := range []struct {
		name   string
		change func(rows []PathRow)
		want   map[string]string // goals not "met"
	}{
		{"all met", func([]PathRow) {}, nil},
		{"stub at 64 under 1.0x", func(rows []PathRow) { rows[0].LeanRatio = 0.99 }, map[string]string{goals[0]: "not met"}},
		{"stub at 256 under 2.0x", func(rows []PathRow) { rows[1].LeanRatio = 1.99 }, map[string]string{goals[1]: "not met"}},
		{"node under 0.8x", func(rows []PathRow) { rows[2].MainRatio = 0.79 }, map[string]string{goals[2]: "not met"}},
		{"python replays under 8x", func(rows []PathRow) { rows[3].ReplayPairRatio = 7.9 }, map[string]string{goals[6]: "not met"}},
		{"python skipped", func(rows []PathRow) { rows[3] = PathRow{Path: pathPython, Concurrency: 64, Skipped: "no python"} },
			map[string]string{goals[3]: "not measured", goals[6]: "not measured"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rows := good()
			tc.change(rows)
			r := &report{Settings: &settings{Client: clientGo}, Paths: rows}
			want := map[string]string{}
			for _, name := range goals {
				want[name] = "met"
				if w, ok := tc.want[name]; ok {
					want[name] = w
				}
			}
			checkGoals(t, r.goals(), want)
		})
	}
	if _, err := parsePaths("stub,perl"); err == nil {
		t.Error("-paths stub,perl accepted")
	}
	if p, err := parsePaths(" node , python,"); err != nil || len(p) != 2 || p[0] != pathNode || p[1] != pathPython {
		t.Errorf("-paths ' node , python,': %v %v", p, err)
	}
	if p, err := parsePaths(""); err != nil || len(p) != 0 {
		t.Errorf("-paths '': %v %v", p, err)
	}
}

// TestRenderEarlierReport renders a report written before the PostgreSQL
// ratio and -client existed: the ratio comes from its rows, the goals are
// today's.
func TestRenderEarlierReport(t *testing.T) {
	var out bytes.Buffer
	if err := render("results/20261123T232305Z.json", &out); err != nil {
		t.Fatal(err)
	}
	for _, text := range []string{"callers' client: stub", "PG vs lean PG", "(target >= 1.5x)", "(target >= 3.0x)",
		"(target >= 8.0x)", "(target <= 0.5x)", "(target <= 5 ms)", "no errors (sum over the rows)",
		// PostgreSQL 0.157 against the lean table's 0.218 CPU ms per pair at 64 callers.
		"0.72 x  (target <= 0.5x)  reported, not a goal: coordinator 0.192 CPU ms/pair, callers' not recorded"} {
		if !strings.Contains(out.String(), text) {
			t.Errorf("rendered report without %q:\n%s", text, out.String())
		}
	}
}

func TestBacklogSummarize(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	b := Backlog{DueToExpire: 1000, DueToDelete: 1000}
	// Nothing for 5 s (waiting for the tick), then 500 expired a second;
	// deletions, after the expiries, take 2 s more.
	b.summarize([]backlogReading{{at(0), 1000, 1000}, {at(5), 1000, 1000}, {at(6), 500, 1000},
		{at(7), 0, 1000}, {at(8), 0, 500}, {at(9), 0, 0}, {at(10), 0, 0}})
	if b.FirstPassSeconds != 6 || b.ExpiredPerSec != 500 || b.DeletedPerSec != 250 || !b.Drained || b.Seconds != 10 {
		t.Fatalf("summarize = %+v", b)
	}
}

func TestParseFlagsClient(t *testing.T) {
	t.Setenv("BENCH_CLIENT", "")
	t.Setenv("BENCH_CLIENT_BATCHING", "")
	s, err := parseFlags(nil)
	if err != nil || s.Client != clientGo || s.ClientBatching != 2 {
		t.Fatalf("parseFlags() = %+v, %v; want -client %s -client-batching 2", s, err, clientGo)
	}
	if s, err := parseFlags([]string{"-client", "stub", "-client-batching", "0"}); err != nil || s.Client != clientStub {
		t.Fatalf("parseFlags(-client stub -client-batching 0) = %+v, %v", s, err)
	}
	if s, err := parseFlags([]string{"-client", "go"}); err != nil || s.Client != clientGo {
		t.Fatalf("parseFlags(-client go) = %+v, %v", s, err)
	}
	if s, err := parseFlags([]string{"-client", "go", "-client-batching", "2"}); err != nil || s.ClientBatching != 2 || s.clientName() != "go, clients.WithCallBatching(2)" {
		t.Fatalf("parseFlags(-client go -client-batching 2) = %+v, %v", s, err)
	}
	if _, err := parseFlags([]string{"-client", "stub"}); err == nil {
		t.Fatal("parseFlags accepted -client-batching without -client go")
	}
	if _, err := parseFlags([]string{"-client", "grpcurl"}); err == nil {
		t.Fatal("parseFlags accepted -client grpcurl")
	}
}
