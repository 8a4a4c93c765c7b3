package ledger

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/statemachine"
)

// RecordKey names a record within a tenant. ArchivedAt tells archived
// records of one key apart (zero for live records).
type RecordKey struct {
	Scope      string
	Key        string
	ArchivedAt time.Time
}

// ListParams select a page of one tenant's records.
type ListParams struct {
	Tenant string
	// State keeps only records whose state in effect now is this one;
	// StateNone keeps all.
	State statemachine.State
	// NeedsDecision keeps only records that need an operator's decision
	// (see statemachine.Record.NeedsDecision): UNKNOWN in effect now (a
	// lapsed IN_PROGRESS lease included) and uncertain FAILED_RETRYABLE.
	// It combines with State.
	NeedsDecision bool
	// ScopeGlob keeps only records whose scope matches it (`*` matches any
	// run of bytes, every other byte itself); empty keeps all.
	ScopeGlob string
	// KeyPrefix keeps only records whose key starts with it; empty keeps
	// all.
	KeyPrefix string
	// CheckpointPhase keeps only records whose last checkpoint has this
	// phase; empty keeps all.
	CheckpointPhase string
	// After, when set, starts the page after this record in (scope, key)
	// order: the last record of the previous page.
	After *RecordKey
	// Limit is the most records to return (at least 1).
	Limit int
	// Archived lists the archive instead of the live records, in (scope,
	// key, archived_at) order: the records Reap moved there.
	Archived bool
}

// ListedRecord is one record of a page, as in effect at the page's Now,
// without its response.
type ListedRecord struct {
	RecordKey
	Record statemachine.Record
}

// ListResult is a page of records.
type ListResult struct {
	Records []ListedRecord
	// More reports that records follow the last one of this page.
	More bool
}

// ListRecords returns a page of the tenant's records in (scope, key) order,
// filtered by their state in effect now and by scope; with Archived, a
// page of the archive. Pages are keyset
// pages over the primary key, so records written between two pages never
// shift the ones that follow.
func (s *Store) ListRecords(ctx context.Context, p *ListParams) (*ListResult, error) {
	limit := max(p.Limit, 1)
	q := s.sql.list(p, s.now(), limit+1)
	rows, err := s.pool.Query(ctx, q.sql, q.args...)
	if err != nil {
		return nil, classify(err)
	}
	defer rows.Close()
	res := &ListResult{}
	var now time.Time
	for rows.Next() {
		if len(res.Records) == limit {
			res.More = true
			break
		}
		var lr ListedRecord
		id := Identity{Tenant: p.Tenant}
		dest, fin := s.scanTargetsMode(&lr.Record, &id, scanList, true)
		dest = append(append([]any{&id.Scope, &id.Key}, dest...), &now)
		if p.Archived {
			dest = append(dest, &lr.ArchivedAt)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, classify(err)
		}
		if err := fin(); err != nil {
			return nil, err
		}
		lr.Scope, lr.Key = id.Scope, id.Key
		if p.Archived {
			lr.ArchivedAt = lr.ArchivedAt.UTC()
		}
		lr.Record = statemachine.Effective(lr.Record, now.UTC())
		res.Records = append(res.Records, lr)
	}
	if err := rows.Err(); err != nil {
		return nil, classify(err)
	}
	return res, nil
}

// CountParams select the counts of one tenant's records.
type CountParams struct {
	Tenant string
	// MaxGroups is the most (scope, state) groups to return (at least 1).
	MaxGroups int
}

// RecordCount is the number of records of one scope in one state in
// effect now.
type RecordCount struct {
	Scope string
	State statemachine.State
	Count int64
}

// CountResult holds a tenant's record counts.
type CountResult struct {
	// Counts has one entry per (scope, state) with records, in (scope,
	// state) order.
	Counts []RecordCount
	// Truncated reports that more groups exist than MaxGroups.
	Truncated bool
}

// CountRecords counts a tenant's records by scope and by state in effect
// now, as ListRecords reads them. It reads every record of the tenant.
func (s *Store) CountRecords(ctx context.Context, p *CountParams) (*CountResult, error) {
	limit := max(p.MaxGroups, 1)
	q := s.sql.count(p.Tenant, limit+1, s.now())
	rows, err := s.pool.Query(ctx, q.sql, q.args...)
	if err != nil {
		return nil, classify(err)
	}
	defer rows.Close()
	res := &CountResult{}
	for rows.Next() {
		if len(res.Counts) == limit {
			res.Truncated = true
			break
		}
		var c RecordCount
		var st int16
		if err := rows.Scan(&c.Scope, &st, &c.Count); err != nil {
			return nil, classify(err)
		}
		c.State = statemachine.State(st)
		res.Counts = append(res.Counts, c)
	}
	if err := rows.Err(); err != nil {
		return nil, classify(err)
	}
	return res, nil
}

// ResolveParams are the inputs of Resolve.
type ResolveParams struct {
	ID Identity
	// As is StateCompleted or StateFailedRetryable.
	As statemachine.State
	// Response is stored for StateCompleted (nil stores an empty one).
	Response *statemachine.Response
}

// Resolve ends a record that needs a decision (UNKNOWN, one whose lease ran
// out included, or an uncertain FAILED_RETRYABLE: see
// statemachine.Record.NeedsDecision) as an operator decided, under the
// record's row lock: see statemachine's EventResolve. Any other record is
// refused with
// statemachine.ErrNotUnknown, a missing one with statemachine.ErrNotFound.
// Waiting Begins wake, as on every write.
func (s *Store) Resolve(ctx context.Context, p *ResolveParams) (*Result, error) {
	if err := checkIdentity(p.ID); err != nil {
		return nil, err
	}
	return s.locked(ctx, p.ID, statemachine.Event{Kind: statemachine.EventResolve, ResolveAs: p.As,
		Response: p.Response}, statemachine.Policy{})
}

// ForgetParams are the inputs of Forget.
type ForgetParams struct {
	ID Identity
}

// Forget deletes a record whatever its state and returns it as it was in
// effect just before, or statemachine.ErrNotFound. A record that does not
// open (ErrUnreadable elsewhere) is deleted too and returned without its
// sealed columns (response, failure reason, fingerprint). A holder's later
// Complete, Fail or Heartbeat then finds no record; the next Begin acquires
// the key as new. Waiting Begins wake.
func (s *Store) Forget(ctx context.Context, p *ForgetParams) (statemachine.Record, error) {
	type deleted struct {
		rec statemachine.Record
		now time.Time
	}
	// The DELETE commits by itself: never cancelled by ctx (see
	// commitTimeout).
	q := s.sql.forget(p.ID, s.now())
	d, err := detached(ctx, func(cctx context.Context) (deleted, error) {
		row := s.pool.QueryRow(cctx, q.sql, q.args...)
		// Leniently: a record that does not open is forgotten too, and
		// returned without its sealed columns.
		var d deleted
		id := p.ID
		dest, fin := s.scanTargetsMode(&d.rec, &id, scanLenient, false)
		err := row.Scan(append(dest, &d.now)...)
		if err == nil {
			err = fin()
		}
		return d, err
	})
	rec, now := d.rec, d.now
	if errors.Is(err, pgx.ErrNoRows) {
		return statemachine.Record{}, statemachine.ErrNotFound
	}
	if err != nil {
		return statemachine.Record{}, classify(err)
	}
	return statemachine.Effective(rec, now.UTC()), nil
}
