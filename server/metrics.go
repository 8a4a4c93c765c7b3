package server

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// otherScope is the scope label of scopes the policy file does not name
// (and of any seen after maxScopeLabels distinct labels), so callers cannot
// grow the metrics, nor learn other tenants' scopes from them.
const otherScope = "other"

// metrics are the server's Prometheus collectors, on a registry of its own.
type metrics struct {
	registry *prometheus.Registry
	grpc     *grpcprom.ServerMetrics

	begin        *prometheus.CounterVec
	replay       *prometheus.CounterVec
	expiredRetry *prometheus.CounterVec
	unknown      *prometheus.CounterVec
	mismatch     *prometheus.CounterVec
	leaseLost    *prometheus.CounterVec
	checkpoints  *prometheus.CounterVec
	archived     *prometheus.CounterVec
	// archivePruned counts archived records deleted after
	// reaper.archive_retention.
	archivePruned *prometheus.CounterVec

	reloadFailures prometheus.Counter
	reaperCaughtUp prometheus.Gauge

	scopes scopeLabels
}

// scopeLabels maps scopes to label values: named maps a scope to the label
// the policy file gives it (see Policies.scopeLabel), and of those the
// first max distinct ones are kept, otherScope after that.
type scopeLabels struct {
	named func(scope string) string
	mu    sync.Mutex
	seen  map[string]struct{}
	max   int
}

func (l *scopeLabels) label(scope string) string {
	if l.named != nil {
		scope = l.named(scope)
	}
	if scope == otherScope {
		return otherScope
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.seen[scope]; ok {
		return scope
	}
	if len(l.seen) >= l.max {
		return otherScope
	}
	l.seen[scope] = struct{}{}
	return scope
}

func newMetrics(store *ledger.Store, maxScopes int, logger *slog.Logger) *metrics {
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
	}
	m := &metrics{
		registry: prometheus.NewRegistry(),
		grpc: grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
			grpcprom.WithHistogramBuckets([]float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}))),
		begin: counter("idempotency_begin_total",
			"Begin answers by outcome (acquired, replay, in_progress).", "outcome", "scope"),
		replay: counter("idempotency_replay_total",
			"Begins answered with a stored response.", "scope"),
		expiredRetry: counter("idempotency_expired_retry_total",
			"Begins that found an expired record.", "scope"),
		unknown: counter("idempotency_unknown_state_total",
			"Records entering UNKNOWN (Fail UNKNOWN or a lapsed lease), once per record and acquisition.", "scope"),
		mismatch: counter("idempotency_fingerprint_mismatch_total",
			"Begins refused because the fingerprint differed.", "scope"),
		leaseLost: counter("idempotency_lease_lost_total",
			"Complete, Fail or Heartbeat calls refused because the token lost its lease.", "scope"),
		checkpoints: counter("idempotency_checkpoints_total",
			"Checkpoints recorded (Heartbeats with a checkpoint that were accepted).", "scope"),
		reloadFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "idempotency_config_reload_failures_total",
			Help: "Config reloads refused (unreadable, empty or invalid file, or a change that takes a restart); the configuration in force stayed."}),
		reaperCaughtUp: prometheus.NewGauge(prometheus.GaugeOpts{Name: "idempotency_reaper_caught_up_timestamp_seconds",
			Help: "Unix time at which this replica's reaper last finished a pass without error and with no work left (0: not yet)."}),
		archived: counter("idempotency_archived_total",
			"UNKNOWN records (and IN_PROGRESS ones whose lease lapsed) the reaper moved to the archive after their unknown_retention.", "scope"),
		archivePruned: counter("idempotency_archive_pruned_total",
			"Archived records the reaper deleted for good after reaper.archive_retention.", "scope"),
		scopes: scopeLabels{seen: map[string]struct{}{}, max: maxScopes},
	}
	notif := func() ledger.NotificationStats { return store.NotificationStats() }
	m.registry.MustRegister(m.grpc, m.begin, m.replay, m.expiredRetry, m.unknown, m.mismatch, m.leaseLost, m.checkpoints, m.archived, m.archivePruned, m.reloadFailures, m.reaperCaughtUp,
		newRecordsCollector(store, logger),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idempotency_notification_queue_usage",
			Help: "PostgreSQL's pg_notification_queue_usage() (0-1), sampled every 200ms; changes stop being notified at idemcoord.notify_queue_limit (default 0.5)."},
			func() float64 { return notif().QueueUsage }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "idempotency_notifications_dropped_total",
			Help: "Changes the database did not notify because the notification queue was over its limit (database-wide, as last seen)."},
			func() float64 { return float64(max(notif().Dropped, 0)) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idempotency_notifications_polling",
			Help: "1 while this replica does not trust change notifications: waiting Begins poll every second and the replay cache is not served."},
			func() float64 {
				if notif().Polling {
					return 1
				}
				return 0
			}),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

var outcomeLabels = map[statemachine.Outcome]string{
	statemachine.OutcomeAcquired:   "acquired",
	statemachine.OutcomeReplay:     "replay",
	statemachine.OutcomeInProgress: "in_progress",
}

// observeBegin counts a Begin's final answer or refusal.
func (m *metrics) observeBegin(scope string, res *ledger.Result, err error) {
	label := m.scopes.label(scope)
	if err != nil {
		switch {
		case errors.Is(err, statemachine.ErrFingerprintMismatch):
			m.mismatch.WithLabelValues(label).Inc()
		case errors.Is(err, statemachine.ErrKeyExpired):
			m.expiredRetry.WithLabelValues(label).Inc()
		}
		return
	}
	m.begin.WithLabelValues(outcomeLabels[res.Outcome], label).Inc()
	if res.Outcome == statemachine.OutcomeReplay {
		m.replay.WithLabelValues(label).Inc()
	}
	if res.FoundExpired {
		m.expiredRetry.WithLabelValues(label).Inc()
	}
	if res.EnteredUnknown {
		m.unknown.WithLabelValues(label).Inc()
	}
}

// observeFinish counts what a Complete, Fail or Heartbeat did.
func (m *metrics) observeFinish(scope string, res *ledger.Result, err error) {
	switch {
	case errors.Is(err, statemachine.ErrLeaseLost):
		m.leaseLost.WithLabelValues(m.scopes.label(scope)).Inc()
	case err == nil && res.EnteredUnknown:
		m.unknown.WithLabelValues(m.scopes.label(scope)).Inc()
	}
}

// observeCheckpoint counts a recorded checkpoint.
func (m *metrics) observeCheckpoint(scope string) {
	m.checkpoints.WithLabelValues(m.scopes.label(scope)).Inc()
}

// registerReady exports ready (the answer of gRPC health and /readyz) as
// idempotency_database_reachable.
func (m *metrics) registerReady(ready func() bool) {
	m.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idempotency_database_reachable",
		Help: "1 while the latest health check reached the database (gRPC health SERVING, /readyz 200), else 0."},
		func() float64 {
			if ready() {
				return 1
			}
			return 0
		}))
}

// observeReap counts the leases a reaper pass found lapsed and the records
// it archived.
func (m *metrics) observeReap(res ledger.ReapResult) {
	for _, scope := range res.UnknownScopes {
		m.unknown.WithLabelValues(m.scopes.label(scope)).Inc()
	}
	for _, scope := range res.ArchivedScopes {
		m.archived.WithLabelValues(m.scopes.label(scope)).Inc()
	}
	for _, scope := range res.ArchivePrunedScopes {
		m.archivePruned.WithLabelValues(m.scopes.label(scope)).Inc()
	}
}

// recordsCollector reports idempotency_records{state}, the number of
// records per state in effect now, from ledger.Store.StateCounts: exact
// for IN_PROGRESS and UNKNOWN, estimated for the other states once the
// table is large, never a scan of the whole table. It is cached for
// recordsCacheFor between scrapes.
type recordsCollector struct {
	store  *ledger.Store
	logger *slog.Logger
	desc   *prometheus.Desc

	mu     sync.Mutex
	at     time.Time
	counts map[statemachine.State]int64
}

const recordsCacheFor = 10 * time.Second

func newRecordsCollector(store *ledger.Store, logger *slog.Logger) *recordsCollector {
	return &recordsCollector{store: store, logger: logger, desc: prometheus.NewDesc("idempotency_records",
		"Records per state in effect now (refreshed at most every 10s). in_progress and unknown are exact; "+
			"on a table over 64 MiB the other states are PostgreSQL's planner estimates of the stored states.",
		[]string{"state"}, nil)}
}

func (c *recordsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *recordsCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.counts == nil || time.Since(c.at) >= recordsCacheFor {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		sc, err := c.store.StateCounts(ctx)
		cancel()
		if err != nil {
			c.logger.Warn("counting records per state failed", "err", err)
			if c.counts == nil {
				return
			}
		} else {
			c.counts, c.at = sc.Counts, time.Now()
		}
	}
	for st := statemachine.StateInProgress; st <= statemachine.StateUnknown; st++ {
		n, ok := c.counts[st]
		if !ok {
			continue // not estimated yet (a large table never analyzed)
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), stateLabel(st))
	}
}

// stateLabel is a state as written in the API without the prefix, lower
// case: in_progress, completed, …
func stateLabel(s statemachine.State) string {
	return strings.ToLower(s.String())
}
