package ledger

import (
	"context"
	"fmt"
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
	type step struct {
		query  func(now *time.Time) query
		count  *int
		scopes *[]string
	}
	var steps []step
	if p.UnknownRetention > 0 {
		// First, so a lease that lapsed long ago is archived by its lease's
		// end, before marking it UNKNOWN would stamp it with the present.
		steps = append(steps, step{func(now *time.Time) query { return s.sql.reapArchive(p, now, batch) },
			&res.Archived, &res.ArchivedScopes})
	}
	steps = append(steps,
		step{func(now *time.Time) query { return s.sql.reapStale(now, batch) }, &res.Unknown, &res.UnknownScopes},
		step{func(now *time.Time) query { return s.sql.reapExpired(now, batch) }, &res.Expired, nil},
		step{func(now *time.Time) query { return s.sql.reapDelete(now, batch, p.Retention) }, &res.Deleted, nil})
	if p.ArchiveRetention > 0 {
		steps = append(steps, step{func(now *time.Time) query { return s.sql.reapArchivePrune(now, batch, p.ArchiveRetention) },
			&res.ArchivePruned, &res.ArchivePrunedScopes})
	}
	for _, st := range steps {
		full := 0
		for range maxBatches {
			n, err := s.reapBatch(ctx, st.query(s.now()), st.scopes)
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
//
// The statement commits by itself, so it runs to its end even when ctx
// ends meanwhile (see commitTimeout); ctx is checked before it starts.
func (s *Store) reapBatch(ctx context.Context, q query, scopes *[]string) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	ctx, cancel := commitContext(ctx)
	defer cancel()
	rows, err := s.pool.Query(ctx, q.sql, q.args...)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	// A statement run per shard has a second column: what failed on a
	// shard, or NULL.
	perShard := len(rows.FieldDescriptions()) == 2
	n := 0
	var failed []string
	for rows.Next() {
		switch {
		case perShard:
			var scope, failure *string
			if err := rows.Scan(&scope, &failure); err != nil {
				return n, err
			}
			if failure != nil {
				failed = append(failed, *failure)
				continue
			}
			if scopes != nil && scope != nil {
				*scopes = append(*scopes, *scope)
			}
		case scopes != nil:
			var scope string
			if err := rows.Scan(&scope); err != nil {
				return n, err
			}
			*scopes = append(*scopes, scope)
		}
		n++
	}
	if err := rows.Err(); err != nil || len(failed) == 0 {
		return n, err
	}
	return n, shardsFailedError(fmt.Sprintf("ledger: reaping failed on %d shards: %s", len(failed), strings.Join(failed, "; ")))
}

// shardsFailedError is what failed on the shards where a statement run per
// shard failed (their workers' own errors, as text).
type shardsFailedError string

func (e shardsFailedError) Error() string { return string(e) }
