package ledger

import (
	"context"
	"math"

	"github.com/idemcoord/idemcoord/statemachine"
)

// exactCountBytes is the table size below which StateCounts counts every
// state exactly: scanning that much takes a few milliseconds.
const exactCountBytes = 64 << 20

// StateCounts is what StateCounts read.
type StateCounts struct {
	// Counts holds records per state in effect now. A state missing from
	// the map was not estimated (the table has no statistics yet).
	Counts map[statemachine.State]int64
	// Estimated reports that the COMPLETED, FAILED_RETRYABLE,
	// FAILED_REPLAYABLE and EXPIRED counts are the planner's estimates
	// (pg_class.reltuples × the frequency of each state in pg_stats) of
	// the stored states; IN_PROGRESS and UNKNOWN are always exact.
	Estimated bool
}

// StateCounts counts records per state in effect now at a cost that does
// not grow with the table: it is what the idempotency_records gauge
// reports. IN_PROGRESS and UNKNOWN (a lapsed lease counts as UNKNOWN) are
// exact, read from the partial indexes that hold only those rows, so they
// cost in proportion to the records that need a decision. While the table
// is small (under 64 MiB) the other states are exact too; above that they
// are estimates from the planner's statistics, which autovacuum keeps up to
// date, and count stored states (a COMPLETED record past expires_at counts
// as COMPLETED until the reaper marks it EXPIRED). CountByState is exact
// for every state and scans the table.
func (s *Store) StateCounts(ctx context.Context) (*StateCounts, error) {
	var size int64
	q := s.sql.tableSize()
	if err := s.pool.QueryRow(ctx, q.sql, q.args...).Scan(&size); err != nil {
		return nil, classify(err)
	}
	if size < s.exactCountBytes {
		counts, err := s.CountByState(ctx)
		if err != nil {
			return nil, err
		}
		for st := statemachine.StateInProgress; st <= statemachine.StateUnknown; st++ {
			counts[st] += 0 // every state, 0 when none
		}
		return &StateCounts{Counts: counts}, nil
	}
	var (
		inProgress, lapsed, unknown int64
		reltuples                   *float64
		vals                        []int16
		freqs                       []float32
	)
	q = s.sql.stateCounts(s.now())
	if err := s.pool.QueryRow(ctx, q.sql, q.args...).Scan(&inProgress, &lapsed, &unknown, &reltuples, &vals, &freqs); err != nil {
		return nil, classify(err)
	}
	out := &StateCounts{Estimated: true, Counts: map[statemachine.State]int64{
		statemachine.StateInProgress: inProgress - lapsed,
		statemachine.StateUnknown:    unknown + lapsed,
	}}
	if reltuples == nil || *reltuples < 0 || len(vals) != len(freqs) {
		return out, nil // never analyzed: no estimate yet
	}
	for _, st := range []statemachine.State{statemachine.StateCompleted, statemachine.StateFailedRetryable,
		statemachine.StateFailedReplayable, statemachine.StateExpired} {
		out.Counts[st] = 0
	}
	for i, v := range vals {
		st := statemachine.State(v)
		if _, ok := out.Counts[st]; ok && st != statemachine.StateInProgress && st != statemachine.StateUnknown {
			out.Counts[st] = int64(math.Round(*reltuples * float64(freqs[i])))
		}
	}
	return out, nil
}
