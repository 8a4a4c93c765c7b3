package console

import (
	"fmt"
	"strings"
	"sync"
	"time"
)

// chartBuckets is how many sample intervals the chart shows (60 one-minute
// intervals: the last hour).
const chartBuckets = 60

// Chart geometry, in SVG user units.
const (
	chartWidth  = 600
	chartHeight = 140
	chartTop    = 10
	chartLeft   = 40
)

// sample is the counters at one moment.
type sample struct {
	at time.Time
	c  Counters
}

// ring keeps the latest samples of the counters, oldest first.
type ring struct {
	mu      sync.Mutex
	samples []sample
	size    int
}

func newRing(size int) *ring { return &ring{size: size} }

func (r *ring) add(at time.Time, c Counters) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.samples) == r.size {
		r.samples = append(r.samples[:0], r.samples[1:]...)
	}
	r.samples = append(r.samples, sample{at: at, c: c})
}

// series is one line of the chart.
type series struct {
	Name   string
	Color  string
	Points string // SVG polyline points
	Total  float64
}

// chart is what the dashboard draws: how much each counter grew in each
// interval between samples, scaled to the chart's box.
type chart struct {
	Width, Height, Top, Left, Bottom int
	Series                           []series
	Max                              float64
	Intervals                        int
	Every                            time.Duration
	Since                            string
	// Collecting reports that there are too few intervals to draw a line
	// (a line needs two points): the dashboard says it is collecting, and
	// from when it will have a line (ReadyAt), instead of an empty box.
	Collecting bool
	ReadyAt    string
}

// chartMinIntervals is how many intervals the chart needs before it draws:
// two points make the first line.
const chartMinIntervals = 2

// chart draws the samples so far; with fewer than chartMinIntervals
// intervals it has no lines yet and says it is collecting.
func (r *ring) chart(every time.Duration) *chart {
	r.mu.Lock()
	samples := append([]sample(nil), r.samples...)
	r.mu.Unlock()
	ch := &chart{Width: chartWidth, Height: chartHeight, Top: chartTop, Left: chartLeft,
		Bottom: chartTop + chartHeight, Every: every}
	defs := []struct {
		name, color string
		get         func(Counters) float64
	}{
		{"acquired", "#2b6cb0", func(c Counters) float64 { return c.Acquired }},
		{"replayed", "#2f855a", func(c Counters) float64 { return c.Replayed }},
		{"in progress", "#b7791f", func(c Counters) float64 { return c.InProgress }},
		{"entered UNKNOWN", "#c53030", func(c Counters) float64 { return c.UnknownEntered }},
	}
	deltas := make([][]float64, len(defs))
	for i, d := range defs {
		for j := 1; j < len(samples); j++ {
			v := max(d.get(samples[j].c)-d.get(samples[j-1].c), 0)
			deltas[i] = append(deltas[i], v)
			ch.Max = max(ch.Max, v)
		}
	}
	if len(samples) > 0 {
		ch.Since = samples[0].at.UTC().Format("15:04 MST")
		ch.ReadyAt = samples[0].at.Add(chartMinIntervals * every).UTC().Format("15:04 MST")
	}
	ch.Intervals = max(len(samples)-1, 0)
	ch.Collecting = ch.Intervals < chartMinIntervals
	scale := max(ch.Max, 1)
	step := float64(chartWidth-chartLeft) / float64(chartBuckets-1)
	for i, d := range defs {
		s := series{Name: d.name, Color: d.color}
		var pts strings.Builder
		// The newest interval sits at the right edge.
		offset := chartBuckets - len(deltas[i])
		for j, v := range deltas[i] {
			s.Total += v
			x := float64(chartLeft) + float64(offset+j)*step
			y := float64(chartTop+chartHeight) - v/scale*float64(chartHeight)
			fmt.Fprintf(&pts, "%.1f,%.1f ", x, y)
		}
		s.Points = strings.TrimSpace(pts.String())
		ch.Series = append(ch.Series, s)
	}
	return ch
}
