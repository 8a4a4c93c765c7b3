package server

import (
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// CounterTotals are the server's domain counters summed over scopes, since
// the process started: what /metrics exports as
// idempotency_begin_total{outcome} and idempotency_unknown_state_total.
// They count every tenant's calls on this replica.
type CounterTotals struct {
	// Acquired, Replayed and InProgress count Begin answers by outcome.
	Acquired, Replayed, InProgress float64
	// UnknownEntered counts records entering UNKNOWN.
	UnknownEntered float64
}

// CounterTotals reads the domain counters now. It is cheap: it reads
// in-memory counters only (never the records gauge's table scan).
func (s *Server) CounterTotals() CounterTotals {
	var t CounterTotals
	sumCounter(s.metrics.begin, func(labels map[string]string, v float64) {
		switch labels["outcome"] {
		case "acquired":
			t.Acquired += v
		case "replay":
			t.Replayed += v
		case "in_progress":
			t.InProgress += v
		}
	})
	sumCounter(s.metrics.unknown, func(_ map[string]string, v float64) { t.UnknownEntered += v })
	return t
}

// sumCounter calls add with the labels and value of every counter c
// collects.
func sumCounter(c prometheus.Collector, add func(labels map[string]string, v float64)) {
	ch := make(chan prometheus.Metric, 64)
	go func() {
		c.Collect(ch)
		close(ch)
	}()
	for m := range ch {
		var d dto.Metric
		if m.Write(&d) != nil || d.GetCounter() == nil {
			continue
		}
		labels := make(map[string]string, len(d.GetLabel()))
		for _, l := range d.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		add(labels, d.GetCounter().GetValue())
	}
}
