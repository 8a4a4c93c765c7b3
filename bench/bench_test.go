package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	// The command name may hold spaces and parentheses.
	line := "4242 (idem (co) ord) S 17 4242 4242 0 -1 4194560 1000 0 0 0 250 75 0 0 20 0 9 0 100 0 0\n"
	st, err := parseStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if st.ppid != 17 || st.cpu != 3.25 {
		t.Fatalf("parseStat = %+v, want ppid 17 and 3.25 CPU seconds", st)
	}
	if _, err := parseStat([]byte("4242 (x) S 1")); err == nil {
		t.Fatal("parseStat accepted a short line")
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
			CoordCPUSeconds: 2, CoordPeakRSSMB: 60}
	}
	pairs := map[string]Latency{"begin": {P50: 2, P99: 8}, "complete": {P50: 3, P99: 9}}
	r := &report{Schema: reportSchema, Settings: &settings{Concurrency: []int{16, 64}}, TotalSeconds: 300}
	for _, c := range []int{16, 64} {
		r.Cells = append(r.Cells, cell(kindPairs, c, 1000, pairs),
			cell(kindReplays, c, 4000, map[string]Latency{"begin": {P50: 1, P99: 2}}),
			cell(kindBaseline, c, 1250, map[string]Latency{"insert": {P50: 1}, "update": {P50: 1}}))
	}
	r.finish()
	if len(r.Rows) != 2 {
		t.Fatalf("%d rows, want 2", len(r.Rows))
	}
	row := r.Rows[1]
	if row.Ratio != 0.8 || row.ReplayPairRatio != 4 || row.CoordCPUPer1000 != 2 || row.BaselineP50MS != 2 {
		t.Fatalf("row 64 = %+v", row)
	}
	want := []string{"not met", "met", "met", "not measured", "not measured", "met"}
	for i, g := range r.Goals {
		if g.Status != want[i] {
			t.Errorf("goal %q: %s, want %s", g.Name, g.Status, want[i])
		}
	}
	var out bytes.Buffer
	if err := r.print(&out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "[not met]") {
		t.Errorf("table without goal statuses:\n%s", out.String())
	}
	dir := t.TempDir()
	if _, err := r.write(dir, time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)); err != nil {
		t.Fatal(err)
	}
}
