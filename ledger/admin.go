package ledger

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/statemachine"
)

// effectiveStateSQL is statemachine.Effective's rule for the state, in SQL
// over a record row and clock.now: an IN_PROGRESS record at or past its
// lease reads UNKNOWN, a COMPLETED or FAILED_* record at or past expires_at
// reads EXPIRED. TestEffectiveStateSQL holds the two together.
var effectiveStateSQL = stateSQL(`CASE
	WHEN state = {IN_PROGRESS} AND lease_expires_at <= clock.now THEN {UNKNOWN}
	WHEN state IN ({COMPLETED}, {FAILED_RETRYABLE}, {FAILED_REPLAYABLE}) AND expires_at <= clock.now THEN {EXPIRED}
	ELSE state END`)

// needsDecisionSQL keeps the records that need an operator's decision:
// UNKNOWN in effect now, or an uncertain FAILED_RETRYABLE.
var needsDecisionSQL = stateSQL(`(` + effectiveStateSQL + ` = {UNKNOWN} OR (` + effectiveStateSQL + ` = {FAILED_RETRYABLE} AND uncertain))`)

// listColumns are recordColumns with the stored response left out
// (has_response false, no body or metadata), so listing never reads bodies.
var listColumns = strings.NewReplacer("has_response", "false",
	"body", "NULL::bytea", "metadata", "NULL::bytea").Replace(recordColumns)

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
	args := []any{s.now(), p.Tenant}
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	var where strings.Builder
	where.WriteString("tenant = $2")
	table, extra, order := "idempotency_records", "", "tenant, scope, key"
	if p.Archived {
		table, extra, order = "idempotency_archive", ", archived_at", "tenant, scope, key, archived_at"
	}
	if p.After != nil {
		// A row comparison the primary key index serves directly.
		if p.Archived {
			where.WriteString(" AND (tenant, scope, key, archived_at) > ($2, " + arg(p.After.Scope) + ", " +
				arg(p.After.Key) + ", " + arg(p.After.ArchivedAt) + ")")
		} else {
			where.WriteString(" AND (tenant, scope, key) > ($2, " + arg(p.After.Scope) + ", " + arg(p.After.Key) + ")")
		}
	}
	if p.State != statemachine.StateNone {
		where.WriteString(" AND " + effectiveStateSQL + " = " + arg(int16(p.State)))
	}
	if p.NeedsDecision {
		where.WriteString(" AND " + needsDecisionSQL)
	}
	if p.ScopeGlob != "" && p.ScopeGlob != "*" {
		where.WriteString(" AND scope LIKE " + arg(globToLike(p.ScopeGlob)))
	}
	if p.KeyPrefix != "" {
		where.WriteString(" AND starts_with(key, " + arg(p.KeyPrefix) + ")")
	}
	sql := `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now)
		SELECT scope, key, ` + listColumns + `, clock.now` + extra + `
		FROM ` + table + `, clock
		WHERE ` + where.String() + `
		ORDER BY ` + order + `
		LIMIT ` + arg(limit+1)
	rows, err := s.pool.Query(ctx, sql, args...)
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
		dest, fin := s.scanTargetsMode(&lr.Record, &id, scanList)
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
	rows, err := s.pool.Query(ctx, `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now)
		SELECT scope, `+effectiveStateSQL+` AS effective, count(*)
		FROM idempotency_records, clock
		WHERE tenant = $2
		GROUP BY scope, effective
		ORDER BY scope, effective
		LIMIT $3`, s.now(), p.Tenant, limit+1)
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

// globToLike turns a glob in which `*` matches any run of bytes into a LIKE
// pattern (with LIKE's default escape character, the backslash).
func globToLike(glob string) string {
	var b strings.Builder
	for _, r := range glob {
		switch r {
		case '\\', '%', '_':
			b.WriteByte('\\')
			b.WriteRune(r)
		case '*':
			b.WriteByte('%')
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
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
	d, err := detached(ctx, func(cctx context.Context) (deleted, error) {
		row := s.pool.QueryRow(cctx, `WITH clock AS (SELECT coalesce($4::timestamptz, now()) AS now)
		DELETE FROM idempotency_records USING clock
		WHERE tenant = $1 AND scope = $2 AND key = $3
		RETURNING `+recordColumns+`, clock.now`,
			p.ID.Tenant, p.ID.Scope, p.ID.Key, s.now())
		// Leniently: a record that does not open is forgotten too, and
		// returned without its sealed columns.
		var d deleted
		id := p.ID
		dest, fin := s.scanTargetsMode(&d.rec, &id, scanLenient)
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
