package ledger

import (
	"context"
	"time"
)

// ReapParams bound one reaper pass.
type ReapParams struct {
	// BatchSize is the most rows one statement touches (default 500).
	BatchSize int
	// MaxBatches bounds the statements of one pass per kind of work
	// (default 20), so a pass over a large backlog ends and yields.
	MaxBatches int
	// Retention is how long EXPIRED rows are kept after their expires_at
	// before they are deleted (0 deletes them at the first pass).
	Retention time.Duration
}

// ReapResult counts what a pass did.
type ReapResult struct {
	// Unknown is the number of IN_PROGRESS records whose lease ran out,
	// now UNKNOWN (and uncertain).
	Unknown int
	// UnknownScopes lists the scope of each of them.
	UnknownScopes []string
	// Expired is the number of COMPLETED and FAILED_* records past
	// expires_at, now EXPIRED with their response dropped.
	Expired int
	// Deleted is the number of EXPIRED records deleted after retention.
	Deleted int
	// More reports that the pass stopped at MaxBatches with work left: a
	// caller keeping pace with a backlog runs the next pass at once.
	More bool
}

// The reaper's statements. Each takes $1 now (NULL: the database clock) and
// $2 the batch size, locks its rows with SKIP LOCKED so replicas reaping at
// the same time never touch the same row, and returns one row per record.
// "now" is written inline (not in a CTE) so the planner can use it as an
// index condition.
const (
	reapStaleSQL = `WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state = 1 AND lease_expires_at <= coalesce($1::timestamptz, now())
	ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
UPDATE idempotency_records r SET state = 6, uncertain = true, lease_expires_at = NULL,
	updated_at = coalesce($1::timestamptz, now())
FROM batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING r.scope`

	reapExpiredSQL = `WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state IN (2, 3, 4) AND expires_at <= coalesce($1::timestamptz, now())
	ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
UPDATE idempotency_records r SET state = 5, has_response = false, body = NULL, metadata = NULL,
	updated_at = coalesce($1::timestamptz, now())
FROM batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING 1`

	reapDeleteSQL = `WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state = 5 AND expires_at <= coalesce($1::timestamptz, now()) - $3 * interval '1 microsecond'
	ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM idempotency_records r USING batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING 1`
)

// Reap runs one reaper pass: stale leases become UNKNOWN, terminal records
// past expires_at become EXPIRED without their response, and EXPIRED
// records older than the retention are deleted. IN_PROGRESS and UNKNOWN
// records are never deleted. Work is done in bounded batches, each its own
// transaction; replicas may reap at the same time without doing the same
// work twice.
func (s *Store) Reap(ctx context.Context, p *ReapParams) (ReapResult, error) {
	batch, maxBatches := p.BatchSize, p.MaxBatches
	if batch <= 0 {
		batch = 500
	}
	if maxBatches <= 0 {
		maxBatches = 20
	}
	var res ReapResult
	steps := []struct {
		sql    string
		args   []any
		count  *int
		scopes *[]string
	}{
		{reapStaleSQL, nil, &res.Unknown, &res.UnknownScopes},
		{reapExpiredSQL, nil, &res.Expired, nil},
		{reapDeleteSQL, []any{p.Retention.Microseconds()}, &res.Deleted, nil},
	}
	for _, st := range steps {
		full := 0
		for range maxBatches {
			n, err := s.reapBatch(ctx, st.sql, append([]any{s.now(), batch}, st.args...), st.scopes)
			*st.count += n
			if err != nil {
				return res, classify(err)
			}
			if n < batch {
				break
			}
			full++
		}
		res.More = res.More || full == maxBatches
	}
	return res, nil
}

// reapBatch runs one statement and counts its rows; with scopes set, it
// also collects their first column.
func (s *Store) reapBatch(ctx context.Context, sql string, args []any, scopes *[]string) (int, error) {
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
		if scopes != nil {
			var scope string
			if err := rows.Scan(&scope); err != nil {
				return n, err
			}
			*scopes = append(*scopes, scope)
		}
	}
	return n, rows.Err()
}
