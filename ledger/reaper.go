package ledger

import (
	"context"
	"strconv"
	"strings"
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
	// UnknownRetention is how long an UNKNOWN record (counted from when it
	// became UNKNOWN; for an IN_PROGRESS record whose lease lapsed, from
	// the end of its lease) stays in the live table before it is moved to
	// the archive, with all its columns. 0 archives nothing.
	UnknownRetention time.Duration
	// ScopeRetention overrides UnknownRetention for the scopes its
	// entries match; the first matching entry wins.
	ScopeRetention []ScopeRetention
	// ArchiveRetention is how long an archived record is kept, counted
	// from its archived_at, before it is deleted from the archive for
	// good. 0 keeps the archive forever.
	ArchiveRetention time.Duration
}

// ScopeRetention is the unknown retention of the scopes matching Glob (in
// which `*` matches any run of bytes, every other byte itself).
type ScopeRetention struct {
	Glob      string
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
	// Archived is the number of UNKNOWN records moved to the archive;
	// ArchivedScopes lists the scope of each.
	Archived       int
	ArchivedScopes []string
	// ArchivePruned is the number of archived records deleted after
	// ArchiveRetention; ArchivePrunedScopes lists the scope of each.
	ArchivePruned       int
	ArchivePrunedScopes []string
	// More reports that the pass stopped at MaxBatches with work left: a
	// caller keeping pace with a backlog runs the next pass at once.
	More bool
}

// The reaper's statements. Each takes $1 now (NULL: the database clock) and
// $2 the batch size, locks its rows with SKIP LOCKED so replicas reaping at
// the same time never touch the same row, and returns one row per record.
// "now" is written inline (not in a CTE) so the planner can use it as an
// index condition.
var (
	reapStaleSQL = stateSQL(`WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state = {IN_PROGRESS} AND lease_expires_at <= coalesce($1::timestamptz, now())
	ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
UPDATE idempotency_records r SET state = {UNKNOWN}, uncertain = true, lease_expires_at = NULL,
	updated_at = coalesce($1::timestamptz, now())
FROM batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING r.scope`)

	reapExpiredSQL = stateSQL(`WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state IN ({COMPLETED}, {FAILED_RETRYABLE}, {FAILED_REPLAYABLE}) AND expires_at <= coalesce($1::timestamptz, now())
	ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
UPDATE idempotency_records r SET state = {EXPIRED}, has_response = false, body = NULL, metadata = NULL,
	updated_at = coalesce($1::timestamptz, now())
FROM batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING 1`)

	reapDeleteSQL = stateSQL(`WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state = {EXPIRED} AND expires_at <= coalesce($1::timestamptz, now()) - $3 * interval '1 microsecond'
	ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM idempotency_records r USING batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING 1`)

	reapArchivePruneSQL = `WITH batch AS (
	SELECT tenant, scope, key, archived_at FROM idempotency_archive
	WHERE archived_at <= coalesce($1::timestamptz, now()) - $3 * interval '1 microsecond'
	ORDER BY archived_at LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM idempotency_archive a USING batch
WHERE a.tenant = batch.tenant AND a.scope = batch.scope AND a.key = batch.key AND a.archived_at = batch.archived_at
RETURNING a.scope`
)

// Reap runs one reaper pass: stale leases become UNKNOWN, terminal records
// past expires_at become EXPIRED without their response, EXPIRED records
// older than the retention are deleted, and UNKNOWN records older than
// their unknown retention are moved to the archive (see ListParams.Archived),
// and archived records older than the archive retention are deleted.
// IN_PROGRESS and UNKNOWN records are never deleted from the live table. Work is done in bounded batches, each its own
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
	if p.UnknownRetention > 0 {
		// First, so a lease that lapsed long ago is archived by its lease's
		// end, before marking it UNKNOWN would stamp it with the present.
		sql, args := archiveStatement(p)
		steps = append([]struct {
			sql    string
			args   []any
			count  *int
			scopes *[]string
		}{{sql, args, &res.Archived, &res.ArchivedScopes}}, steps...)
	}
	if p.ArchiveRetention > 0 {
		steps = append(steps, struct {
			sql    string
			args   []any
			count  *int
			scopes *[]string
		}{reapArchivePruneSQL, []any{p.ArchiveRetention.Microseconds()}, &res.ArchivePruned, &res.ArchivePrunedScopes})
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

// archiveStatement returns the reaper's archiving statement for p and its
// arguments after $1 now and $2 the batch size: $3 the least retention
// (µs, which lets the indexes narrow the scan), then the retention of
// each scope rule and the default, in a CASE that picks the first match.
func archiveStatement(p *ReapParams) (string, []any) {
	least := p.UnknownRetention
	args := []any{int64(0)}
	var retention strings.Builder
	retention.WriteString("CASE")
	for _, r := range p.ScopeRetention {
		least = min(least, r.Retention)
		args = append(args, globToLike(r.Glob), r.Retention.Microseconds())
		retention.WriteString(" WHEN scope LIKE $" + strconv.Itoa(len(args)+1) + " THEN $" + strconv.Itoa(len(args)+2) + "::int8")
	}
	args = append(args, p.UnknownRetention.Microseconds())
	def := "$" + strconv.Itoa(len(args)+2) + "::int8"
	if len(p.ScopeRetention) == 0 {
		retention.Reset()
		retention.WriteString(def)
	} else {
		retention.WriteString(" ELSE " + def + " END")
	}
	args[0] = least.Microseconds()
	cutoff := func(us string) string {
		return "coalesce($1::timestamptz, now()) - " + us + " * interval '1 microsecond'"
	}
	return stateSQL(`WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE ((state = {UNKNOWN} AND updated_at <= ` + cutoff("$3") + `)
		OR (state = {IN_PROGRESS} AND lease_expires_at <= ` + cutoff("$3") + `))
		AND CASE WHEN state = {UNKNOWN} THEN updated_at ELSE lease_expires_at END <= ` + cutoff("("+retention.String()+")") + `
	ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED),
moved AS (
	DELETE FROM idempotency_records r USING batch
	WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
	RETURNING r.tenant, r.scope, r.key, ` + recordColumnsR + `)
INSERT INTO idempotency_archive (tenant, scope, key, ` + recordColumns + `, archived_at)
SELECT tenant, scope, key, ` + recordColumns + `, coalesce($1::timestamptz, now()) FROM moved
RETURNING scope`), args
}

// reapBatch runs one statement and counts its rows; with scopes set, it
// also collects their first column.
//
// The statement commits by itself, so it runs to its end even when ctx
// ends meanwhile (see commitTimeout); ctx is checked before it starts.
func (s *Store) reapBatch(ctx context.Context, sql string, args []any, scopes *[]string) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	ctx, cancel := commitContext(ctx)
	defer cancel()
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
