package console

import (
	"strings"
	"testing"
	"time"
)

// TestChartCollecting: until the counters have two intervals (a line needs
// two points) the chart says it is collecting and when it will draw,
// instead of drawing an empty box.
func TestChartCollecting(t *testing.T) {
	r := newRing(chartBuckets + 1)
	start := time.Date(2026, 1, 2, 3, 4, 0, 0, time.UTC)
	if ch := r.chart(time.Minute); !ch.Collecting || ch.Since != "" {
		t.Fatalf("no samples: %+v", ch)
	}
	for i := range 2 {
		r.add(start.Add(time.Duration(i)*time.Minute), Counters{Acquired: float64(i)})
		if ch := r.chart(time.Minute); !ch.Collecting || ch.Since != "03:04 UTC" || ch.ReadyAt != "03:06 UTC" {
			t.Fatalf("%d samples: collecting %v since %q ready at %q", i+1, ch.Collecting, ch.Since, ch.ReadyAt)
		}
	}
	r.add(start.Add(2*time.Minute), Counters{Acquired: 5})
	if ch := r.chart(time.Minute); ch.Collecting || len(strings.Fields(ch.Series[0].Points)) != 2 {
		t.Fatalf("3 samples: collecting %v, points %q", ch.Collecting, ch.Series[0].Points)
	}
}

// TestChartRing draws per-interval increases of the counters, newest at the
// right edge, and keeps only the last hour of samples.
func TestChartRing(t *testing.T) {
	r := newRing(chartBuckets + 1)
	start := time.Date(2026, 1, 2, 3, 0, 0, 0, time.UTC)
	if ch := r.chart(time.Minute); ch.Intervals != 0 || ch.Series[0].Points != "" {
		t.Fatalf("empty ring: %+v", ch)
	}
	for i := range 100 {
		r.add(start.Add(time.Duration(i)*time.Minute), Counters{Acquired: float64(i * 2), UnknownEntered: float64(i / 50)})
	}
	ch := r.chart(time.Minute)
	if ch.Intervals != chartBuckets || ch.Max != 2 || ch.Since != "03:39 UTC" {
		t.Fatalf("chart: intervals %d max %v since %q", ch.Intervals, ch.Max, ch.Since)
	}
	acq, unk := ch.Series[0], ch.Series[3]
	if acq.Total != 120 || unk.Total != 1 {
		t.Fatalf("totals: acquired %v, unknown %v", acq.Total, unk.Total)
	}
	pts := strings.Fields(acq.Points)
	if len(pts) != chartBuckets || pts[len(pts)-1] != "600.0,10.0" {
		t.Fatalf("acquired points %q", acq.Points)
	}
	// A counter that goes down (a restart) draws 0, never below the axis.
	r.add(start.Add(101*time.Minute), Counters{})
	for p := range strings.FieldsSeq(r.chart(time.Minute).Series[0].Points) {
		if !strings.HasSuffix(p, ",150.0") && !strings.HasSuffix(p, ",10.0") {
			t.Fatalf("point %q outside the chart", p)
		}
	}
}
