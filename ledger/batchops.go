package ledger

import (
	"context"
	"time"

	"github.com/idemcoord/idemcoord/statemachine"
)

// Batch sizes and worker counts of the coalesced write paths.
const (
	batchWorkers = 4
	batchMax     = 64
)

// beginReq is a Begin run in a batch.
type beginReq struct {
	ctx context.Context
	p   *BeginParams
	ev  statemachine.Event
	out chan beginRes
}

// beginRes is what the batch found: the key created with this request's
// token (inserted), or the existing record (found), or neither (the caller
// takes the single-record path).
type beginRes struct {
	rec      statemachine.Record
	now      time.Time
	inserted bool
	found    bool
	err      error
}

// beginBatchSQL creates every key of the batch that does not exist yet and
// reads every one that does, in one statement: beginSQL for many records.
// $1 now or NULL; $2.. arrays: tenant, scope, key, fingerprint, token,
// attempt_id, ttl µs, failure ttl µs, lease µs; $11 enc_key_id, $12
// seal_version. The first column says whether the row was created; created
// rows carry the creator's token.
var beginBatchSQL = `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now),
input AS (
	SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[], $7::text[],
		$8::int8[], $9::int8[], $10::int8[])
		AS i(tenant, scope, key, fp, token, attempt_id, ttl, fttl, lease)),
ins AS (
	INSERT INTO idempotency_records (tenant, scope, key, state, fingerprint, attempt, generation,
		lease_token, attempt_id, ttl_us, failure_ttl_us, created_at, updated_at, lease_expires_at,
		enc_key_id, seal_version)
	SELECT i.tenant, i.scope, i.key, 1, i.fp, 1, 1, i.token, i.attempt_id, i.ttl, i.fttl,
		clock.now, clock.now, clock.now + i.lease * interval '1 microsecond', $11, $12
	FROM input i, clock
	ON CONFLICT DO NOTHING
	RETURNING tenant, scope, key, ` + recordColumns + `)
SELECT true, ins.*, clock.now FROM ins, clock
UNION ALL
SELECT DISTINCT ON (r.tenant, r.scope, r.key) false, r.tenant, r.scope, r.key, ` + recordColumnsR + `, clock.now
FROM idempotency_records r JOIN input i ON r.tenant = i.tenant AND r.scope = i.scope AND r.key = i.key, clock
WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.tenant = i.tenant AND ins.scope = i.scope AND ins.key = i.key)`

// runBeginBatch runs one batch of Begins and answers each request.
func (s *Store) runBeginBatch(ctx context.Context, batch []*beginReq) {
	var live []*beginReq
	for _, r := range batch {
		if r.ctx.Err() != nil {
			r.out <- beginRes{err: r.ctx.Err()}
			continue
		}
		live = append(live, r)
	}
	switch len(live) {
	case 0:
		return
	case 1:
		// Alone: the single-record statement plans faster than unnest.
		r := live[0]
		rec, inserted, now, found, err := s.insertOrRead(ctx, r.p.ID, &r.ev)
		r.out <- beginRes{rec: rec, now: now, inserted: inserted, found: found, err: classify(err)}
		return
	}
	n := len(live)
	tenants, scopes, keys := make([]string, n), make([]string, n), make([]string, n)
	fps, tokens, attemptIDs := make([][]byte, n), make([]string, n), make([]string, n)
	ttls, fttls, leases := make([]int64, n), make([]int64, n), make([]int64, n)
	for i, r := range live {
		tenants[i], scopes[i], keys[i] = r.p.ID.Tenant, r.p.ID.Scope, r.p.ID.Key
		fps[i] = r.ev.Fingerprint
		if fps[i] == nil {
			fps[i] = []byte{}
		}
		tokens[i], attemptIDs[i] = r.ev.NewToken, r.ev.AttemptID
		ttls[i], fttls[i], leases[i] = r.ev.TTL.Microseconds(), min(r.ev.FailureTTL, r.ev.TTL).Microseconds(), r.ev.Lease.Microseconds()
	}
	type row struct {
		rec      statemachine.Record
		now      time.Time
		inserted bool
	}
	found := map[Identity]row{}
	rows, err := s.pool.Query(ctx, beginBatchSQL, s.now(), tenants, scopes, keys, fps, tokens, attemptIDs, ttls, fttls, leases,
		s.newRowKeyID(), int16(sealVersion))
	if err == nil {
		for rows.Next() {
			var id Identity
			var rw row
			dest, fin := s.scanTargets(&rw.rec, &id)
			if err = rows.Scan(append(append([]any{&rw.inserted, &id.Tenant, &id.Scope, &id.Key}, dest...), &rw.now)...); err != nil {
				break
			}
			if err = fin(); err != nil {
				break
			}
			rw.now = rw.now.UTC()
			found[id] = rw
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	for _, r := range live {
		rw, ok := found[r.p.ID]
		switch {
		case err != nil:
			r.out <- beginRes{err: classify(err)}
		case !ok:
			r.out <- beginRes{}
		case rw.inserted && rw.rec.LeaseToken != r.ev.NewToken:
			// Another Begin of the same new key in this batch created it.
			r.out <- beginRes{}
		default:
			r.out <- beginRes{rec: rw.rec, now: rw.now, inserted: rw.inserted, found: true}
		}
	}
}

// completeReq is a Complete by the holder of the lease, tried in a batch.
type completeReq struct {
	ctx  context.Context
	id   Identity
	ev   statemachine.Event
	args []any // responseArgs
	out  chan completeRes
}

type completeRes struct {
	res *Result // nil: not held by that token; take the locked path
	err error
}

// completeBatchSQL ends every held record of the batch (IN_PROGRESS or
// UNKNOWN with the request's token) as COMPLETED, in one statement; see
// completeHeldSQL for the single form. $1 now or NULL; $2.. arrays: tenant,
// scope, key, token, then the responseArgs columns.
var completeBatchSQL = `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now),
input AS (
	SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::bool[], $7::text[],
		$8::text[], $9::int4[], $10::bytea[], $11::bytea[], $12::text[])
		AS i(tenant, scope, key, token, has_response, schema_version, content_type, status_code,
			body, metadata, enc_key_id))
UPDATE idempotency_records r SET state = 2, ended_by = 5, has_response = i.has_response,
	schema_version = i.schema_version, content_type = i.content_type, status_code = i.status_code,
	body = i.body, metadata = i.metadata, enc_key_id = i.enc_key_id, failure_reason = '',
	lease_expires_at = NULL, updated_at = clock.now, uncertain = false,
	expires_at = clock.now + r.ttl_us * interval '1 microsecond'
FROM input i, clock
WHERE r.tenant = i.tenant AND r.scope = i.scope AND r.key = i.key AND r.lease_token = i.token
	AND r.state IN (1, 6)
RETURNING r.tenant, r.scope, r.key, ` + recordColumnsR + `, clock.now`

// runCompleteBatch runs one batch of Completes and answers each request. A
// batch holds at most one request per record; the others wait for the
// next batch.
func (s *Store) runCompleteBatch(ctx context.Context, batch []*completeReq) {
	var live []*completeReq
	seen := map[Identity]bool{}
	for _, r := range batch {
		switch {
		case r.ctx.Err() != nil:
			r.out <- completeRes{err: r.ctx.Err()}
		case seen[r.id]:
			// A second Complete of the same record in this batch: let it
			// decide on its own, after this batch commits.
			r.out <- completeRes{}
		default:
			seen[r.id] = true
			live = append(live, r)
		}
	}
	switch len(live) {
	case 0:
		return
	case 1:
		r := live[0]
		res, err := s.completeHeldOne(ctx, r.id, r.ev.Token, r.args)
		r.out <- completeRes{res: res, err: classify(err)}
		return
	}
	n := len(live)
	tenants, scopes, keys, tokens := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	has := make([]bool, n)
	svs, cts, keyIDs := make([]string, n), make([]string, n), make([]string, n)
	codes := make([]int32, n)
	bodies, metas := make([][]byte, n), make([][]byte, n)
	for i, r := range live {
		tenants[i], scopes[i], keys[i], tokens[i] = r.id.Tenant, r.id.Scope, r.id.Key, r.ev.Token
		has[i] = r.args[0].(bool)
		svs[i], cts[i], codes[i] = r.args[1].(string), r.args[2].(string), r.args[3].(int32)
		bodies[i], metas[i], keyIDs[i] = r.args[4].([]byte), r.args[5].([]byte), r.args[6].(string)
	}
	rows, err := s.pool.Query(ctx, completeBatchSQL, s.now(), tenants, scopes, keys, tokens, has, svs, cts, codes, bodies, metas, keyIDs)
	done := map[Identity]*Result{}
	if err == nil {
		for rows.Next() {
			var id Identity
			var rec statemachine.Record
			var now time.Time
			dest, fin := s.scanTargets(&rec, &id)
			if err = rows.Scan(append(append([]any{&id.Tenant, &id.Scope, &id.Key}, dest...), &now)...); err != nil {
				break
			}
			if err = fin(); err != nil {
				break
			}
			done[id] = &Result{Decision: statemachine.Decision{Write: statemachine.WriteUpdate, Record: rec, Exists: true}, Now: now.UTC()}
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	for _, r := range live {
		if err != nil {
			r.out <- completeRes{err: classify(err)}
			continue
		}
		r.out <- completeRes{res: done[r.id]}
	}
}
