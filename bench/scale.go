package main

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/idemcoord/idemcoord/ledger"
)

// Scale is the scale check: the same pairs cell on an empty table and on
// one holding Records bulk-loaded records, the cost of the records gauge
// at that size, and the coordinator's reaper working through a backlog
// while pairs run.
type Scale struct {
	Records     int     `json:"records"`
	Concurrency int     `json:"concurrency"`
	LoadSeconds float64 `json:"load_s"`
	// VacuumSeconds is the VACUUM ANALYZE after the load.
	VacuumSeconds float64 `json:"vacuum_analyze_s"`
	TableMB       float64 `json:"table_mb"`
	IndexesMB     float64 `json:"indexes_mb"`

	Empty  Cell      `json:"empty"`
	Loaded Cell      `json:"loaded"`
	Gauge  GaugeCost `json:"gauge"`
	// Backlog is what the reaper found to do after the load, and
	// LoadedReaping the pairs cell run while it did it.
	Backlog       Backlog `json:"backlog"`
	LoadedReaping Cell    `json:"loaded_while_reaping"`
}

// GaugeCost is what one reading of the idempotency_records gauge costs on
// the loaded table: ledger.Store.StateCounts (median of a few readings) and,
// once, the whole-table count it replaced (ledger.Store.CountByState).
type GaugeCost struct {
	Records     int     `json:"records"`
	MS          float64 `json:"ms"`
	Estimated   bool    `json:"estimated"`
	FullCountMS float64 `json:"full_count_ms"`
	Error       string  `json:"error,omitempty"`
}

// Backlog is the reaper's work in the scale check: records added due to
// expire (COMPLETED past expires_at) and due for deletion (EXPIRED past
// the retention), and how fast the coordinator's own reaper, at its
// default settings, got through them: the pairs cell runs meanwhile, and
// the bench then waits (up to backlogWait) until both are done, reading
// what is left every second.
type Backlog struct { //nolint:recvcheck // String on the value so a Backlog prints as itself; summarize fills one in
	DueToExpire int `json:"due_to_expire"`
	DueToDelete int `json:"due_to_delete"`
	// Expired and Deleted are those of the backlog the reaper had done
	// Seconds after the backlog was committed.
	Expired int     `json:"expired"`
	Deleted int     `json:"deleted"`
	Seconds float64 `json:"seconds"`
	// FirstPassSeconds is when the first reading saw the backlog shrink
	// (the reaper ticks every 10 s, so its first pass may wait that long).
	FirstPassSeconds float64 `json:"first_pass_s"`
	// ExpiredPerSec and DeletedPerSec are the reaper's sustained rates:
	// each kind's rows over the time from the last reading before the
	// first pass to the first reading that found that kind done (or the
	// last reading).
	ExpiredPerSec float64 `json:"expired_per_s"`
	DeletedPerSec float64 `json:"deleted_per_s"`
	// UnderLoadExpired and UnderLoadDeleted are what it did while the
	// pairs cell ran.
	UnderLoadExpired int  `json:"under_load_expired"`
	UnderLoadDeleted int  `json:"under_load_deleted"`
	Drained          bool `json:"drained"`
}

// backlogWait bounds the wait for the reaper to finish the backlog.
const backlogWait = 3 * time.Minute

// backlogReading is what was left of the backlog at one time.
type backlogReading struct {
	at                 time.Time
	toExpire, toDelete int
}

// bulkLoadSQL adds $1 COMPLETED records in one statement, expiring in a
// day. Keys are 16 hex digits spread evenly below 8000000000000000 ($2
// apart) and inserted in order; the bench's random keys (32 digits) fall
// between them. $3 is the response body, $4 the fingerprint.
const bulkLoadSQL = `INSERT INTO idempotency_records (tenant, scope, key, state, fingerprint,
	attempt, generation, lease_token, ended_by, has_response, schema_version, content_type,
	status_code, body, ttl_us, failure_ttl_us, created_at, updated_at, expires_at)
SELECT 'default', 'bench', lpad(to_hex(i::bigint * $2::bigint), 16, '0'),
	2, $4::bytea, 1, 1, 'lt1.bulk' || i, 5, true, 'bench.v1.Response/1', 'application/x-protobuf', 0, $3::bytea,
	86400000000, 3600000000, now() - interval '3 days', now() - interval '3 days',
	now() + interval '1 day' + i * interval '1 microsecond'
FROM generate_series(1, $1::int) AS i`

// backlogSQL adds the reaper's backlog: $1 records with keys 'backlog-…',
// the odd ones COMPLETED with expires_at an hour ago (to expire), the even
// ones EXPIRED two days ago (past the 24 h retention: to delete). $2 is the
// body, $3 the fingerprint.
const backlogSQL = `INSERT INTO idempotency_records (tenant, scope, key, state, fingerprint,
	attempt, generation, lease_token, ended_by, has_response, schema_version, content_type,
	status_code, body, ttl_us, failure_ttl_us, created_at, updated_at, expires_at)
SELECT 'default', 'bench', 'backlog-' || i, CASE WHEN i % 2 = 1 THEN 2 ELSE 5 END, $3::bytea, 1, 1,
	'lt1.backlog' || i, 5, i % 2 = 1, 'bench.v1.Response/1', 'application/x-protobuf', 0,
	CASE WHEN i % 2 = 1 THEN $2::bytea END, 86400000000, 3600000000,
	now() - interval '3 days', now() - interval '3 days',
	CASE WHEN i % 2 = 1 THEN now() - interval '1 hour' ELSE now() - interval '2 days' END + i * interval '1 microsecond'
FROM generate_series(1, $1::int) AS i`

// backlogLeftSQL counts what is left of the backlog, through the reaper's
// own partial indexes.
const backlogLeftSQL = `SELECT
	(SELECT count(*) FROM idempotency_records WHERE state IN (2, 3, 4) AND expires_at <= now()),
	(SELECT count(*) FROM idempotency_records WHERE state = 5 AND expires_at <= now() - interval '24 hours')`

func (e *environment) runScale(ctx context.Context) (*Scale, error) {
	s := e.s
	sc := &Scale{Records: s.ScaleRecords, Concurrency: s.ScaleConcurrency}

	// TRUNCATE leaves the table with no statistics, as a new deployment's.
	// With a VACUUM ANALYZE here (statistics saying "empty") this cell ran
	// slower than both the 16-caller cell of the main run and the loaded
	// one, for a reason not pinned down: it would flatter the scale ratio.
	logf("scale: emptying the table")
	if err := e.exec(ctx, "TRUNCATE idempotency_records"); err != nil {
		return nil, err
	}
	var err error
	if sc.Empty, err = e.runCell(ctx, kindPairs, s.ScaleConcurrency, nil); err != nil {
		return nil, err
	}
	sc.Empty.Label = "empty table"

	logf("scale: bulk-loading %d records", s.ScaleRecords)
	t0 := time.Now()
	step := math.MaxInt64 / int64(s.ScaleRecords)
	if err := e.exec(ctx, bulkLoadSQL, s.ScaleRecords, step, e.payload.response.GetBody(), e.payload.fingerprint); err != nil {
		return nil, fmt.Errorf("bulk load: %w", err)
	}
	sc.LoadSeconds = time.Since(t0).Seconds()
	t0 = time.Now()
	if err := e.exec(ctx, "VACUUM ANALYZE idempotency_records"); err != nil {
		return nil, err
	}
	sc.VacuumSeconds = time.Since(t0).Seconds()
	var table, indexes int64
	if err := e.admin.QueryRow(ctx, `SELECT pg_table_size('idempotency_records'), pg_indexes_size('idempotency_records')`).
		Scan(&table, &indexes); err != nil {
		return nil, err
	}
	sc.TableMB, sc.IndexesMB = float64(table)/(1<<20), float64(indexes)/(1<<20)
	logf("scale: loaded in %.1fs, VACUUM ANALYZE %.1fs; table %.0f MB, indexes %.0f MB",
		sc.LoadSeconds, sc.VacuumSeconds, sc.TableMB, sc.IndexesMB)

	sc.Gauge = e.gaugeCost(ctx)
	logf("scale: gauge %.1f ms (estimated %v); the whole-table count it replaced %.0f ms",
		sc.Gauge.MS, sc.Gauge.Estimated, sc.Gauge.FullCountMS)

	if sc.Loaded, err = e.runCell(ctx, kindPairs, s.ScaleConcurrency, nil); err != nil {
		return nil, err
	}
	sc.Loaded.Label = count(s.ScaleRecords) + " records"

	// The backlog: a fifth of the records again, half to expire, half to
	// delete. The coordinator's reaper (default settings) starts on it at
	// its next tick; the pairs cell runs meanwhile.
	n := max(s.ScaleRecords/5, 2)
	logf("scale: adding a reaper backlog of %d records", n)
	if err := e.exec(ctx, backlogSQL, n, e.payload.response.GetBody(), e.payload.fingerprint); err != nil {
		return nil, fmt.Errorf("backlog: %w", err)
	}
	committed := time.Now()
	if err := e.exec(ctx, "ANALYZE idempotency_records"); err != nil {
		return nil, err
	}
	b := &sc.Backlog
	*b = Backlog{DueToExpire: (n + 1) / 2, DueToDelete: n / 2}
	readings := []backlogReading{{at: committed, toExpire: b.DueToExpire, toDelete: b.DueToDelete}}
	read := func() (backlogReading, error) {
		r := backlogReading{at: time.Now()}
		err := e.admin.QueryRow(ctx, backlogLeftSQL).Scan(&r.toExpire, &r.toDelete)
		r.at = r.at.Add(time.Since(r.at) / 2)
		return r, err
	}
	var readErr error
	if sc.LoadedReaping, err = e.runCell(ctx, kindPairs, s.ScaleConcurrency, func(ctx context.Context, stop <-chan struct{}) {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			r, err := read()
			if err != nil {
				readErr = err
				return
			}
			readings = append(readings, r)
		}
	}); err != nil {
		return nil, err
	}
	if readErr != nil {
		return nil, readErr
	}
	sc.LoadedReaping.Label = count(s.ScaleRecords) + " records, reaper on a backlog"
	last := readings[len(readings)-1]
	b.UnderLoadExpired, b.UnderLoadDeleted = b.DueToExpire-last.toExpire, b.DueToDelete-last.toDelete
	for time.Since(committed) < backlogWait && (last.toExpire > 0 || last.toDelete > 0) {
		sleep(ctx, time.Second)
		if last, err = read(); err != nil {
			return nil, err
		}
		readings = append(readings, last)
	}
	b.summarize(readings)
	logf("scale: reaper: %s", b)
	return sc, nil
}

// summarize derives the backlog's figures from the readings, the first of
// which is the full backlog at its commit.
func (b *Backlog) summarize(readings []backlogReading) {
	first, last := readings[0], readings[len(readings)-1]
	b.Seconds = last.at.Sub(first.at).Seconds()
	b.Expired, b.Deleted = b.DueToExpire-last.toExpire, b.DueToDelete-last.toDelete
	b.Drained = last.toExpire == 0 && last.toDelete == 0
	start := -1 // the last reading before the backlog shrank
	for i := 1; i < len(readings); i++ {
		if readings[i].toExpire < b.DueToExpire || readings[i].toDelete < b.DueToDelete {
			start = i - 1
			b.FirstPassSeconds = readings[i].at.Sub(first.at).Seconds()
			break
		}
	}
	if start < 0 {
		return
	}
	rate := func(left func(backlogReading) int) float64 {
		end := len(readings) - 1
		for i := start; i < len(readings); i++ {
			if left(readings[i]) == 0 {
				end = i
				break
			}
		}
		d := readings[end].at.Sub(readings[start].at).Seconds()
		return ratio(float64(left(readings[start])-left(readings[end])), d)
	}
	b.ExpiredPerSec = rate(func(r backlogReading) int { return r.toExpire })
	b.DeletedPerSec = rate(func(r backlogReading) int { return r.toDelete })
}

// gaugeCost times the records gauge's reading on the loaded table.
func (e *environment) gaugeCost(ctx context.Context) GaugeCost {
	g := GaugeCost{Records: e.s.ScaleRecords}
	store, err := ledger.Open(ctx, e.dbURL, ledger.WithMaxConns(2), ledger.WithReplayCache(0))
	if err != nil {
		g.Error = err.Error()
		return g
	}
	defer store.Close()
	var times []time.Duration
	for range 5 {
		t0 := time.Now()
		sc, err := store.StateCounts(ctx)
		times = append(times, time.Since(t0))
		if err != nil {
			g.Error = err.Error()
			return g
		}
		g.Estimated = sc.Estimated
	}
	g.MS = summarize(times).P50
	t0 := time.Now()
	if _, err := store.CountByState(ctx); err != nil {
		g.Error = err.Error()
	}
	g.FullCountMS = ms(time.Since(t0))
	return g
}

func (b Backlog) String() string {
	s := fmt.Sprintf("first pass seen after %.1fs; in %.1fs it expired %d of %d (%.0f/s sustained) and deleted %d of %d (%.0f/s sustained); "+
		"while pairs ran: %d expired, %d deleted",
		b.FirstPassSeconds, b.Seconds, b.Expired, b.DueToExpire, b.ExpiredPerSec, b.Deleted, b.DueToDelete, b.DeletedPerSec,
		b.UnderLoadExpired, b.UnderLoadDeleted)
	if b.Drained {
		s += "; all done"
	}
	return s
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
