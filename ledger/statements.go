package ledger

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemcoord/idemcoord/ledger/internal/keyring"
	"github.com/idemcoord/idemcoord/ledger/internal/notifier"
	"github.com/idemcoord/idemcoord/statemachine"
)

// This file is the ledger's statement layer: the SQL text of every
// statement the ledger runs, with the arguments each one takes, and
// nothing else of the ledger holds SQL (TestStatementsInOnePlace keeps it
// so). What a statement returns (its columns, in order) is part of its
// contract, written on its field, since the Go code that scans it is the
// same for every dialect.
//
// A dialect is a set of statements: Open builds the one of its database
// (statementsFor) and every call runs s.sql's. A dialect that needs
// another statement, or another shape of one (other arguments, a
// statement split in two, a clock passed from Go where PostgreSQL reads
// its own), replaces that field in statementsFor and nothing else.

// query is a statement ready to run: its text and its arguments.
type query struct {
	sql  string
	args []any
	// local, when set, is run first in the same transaction (a SET LOCAL
	// that must reach every node the statement runs on).
	local string
}

// dialect names a database the ledger runs on.
type dialect int

const (
	// postgreSQL is a single PostgreSQL server (a primary and its
	// standbys).
	postgreSQL dialect = iota
	// citus is a Citus coordinator node whose records table is
	// distributed.
	citus
)

// String names the dialect as start-up logs it.
func (d dialect) String() string {
	switch d {
	case postgreSQL:
		return "PostgreSQL"
	case citus:
		return "Citus"
	}
	return "dialect " + strconv.Itoa(int(d))
}

// citusInstalledSQL reports whether the database has the citus extension.
const citusInstalledSQL = `SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')`

// citusNodesSQL lists the active primary nodes of a Citus cluster other
// than the coordinator node: host, port.
const citusNodesSQL = `SELECT nodename, nodeport FROM pg_dist_node
WHERE noderole = 'primary' AND isactive AND groupid <> 0 ORDER BY nodeid`

// citusDistributedSQL reports whether the records table is distributed (on
// a database with the citus extension only).
const citusDistributedSQL = `SELECT EXISTS (SELECT 1 FROM pg_dist_partition
	WHERE logicalrelid = to_regclass('idempotency_records'))`

// newRecord is what creating a key stores beyond its constant columns.
type newRecord struct {
	id Identity
	// fingerprint is in its stored form (see Store.beginEvent).
	fingerprint            []byte
	token, attemptID       string
	ttl, failureTTL, lease time.Duration
}

// newRecordOf is what a Begin with ev (its fingerprint in its stored
// form) creates of the key id: a failure TTL is never longer than the TTL.
func newRecordOf(id Identity, ev statemachine.Event) newRecord {
	return newRecord{id: id, fingerprint: ev.Fingerprint, token: ev.NewToken, attemptID: ev.AttemptID,
		ttl: ev.TTL, failureTTL: min(ev.FailureTTL, ev.TTL), lease: ev.Lease}
}

// storedResponse is a response in its stored form (see
// Store.responseArgs): the columns has_response, schema_version,
// content_type, status_code, body, metadata and enc_key_id.
type storedResponse struct {
	has                        bool
	schemaVersion, contentType string
	statusCode                 int32
	body, metadata             []byte
	keyID                      string
}

// heldCompletion is one Complete of a batch: the record id, ended by the
// holder of token with response.
type heldCompletion struct {
	id       Identity
	token    string
	response storedResponse
}

// statements are the statements of one dialect. Every field is set
// (TestStatementsComplete). now is the injected clock or nil, which makes
// a statement read the database's clock; "the clock" below is the time a
// statement took as now, returned as its last column where it says so.
type statements struct {
	// One record, named by its identity: each statement's WHERE holds
	// tenant, scope and key with equality.

	// begin creates n's key IN_PROGRESS, or reads the existing record,
	// in one statement; a lock wait longer than lockWait fails it
	// (isLockTimeout) having written nothing. Its row: created (bool),
	// fullColumns, the clock; no row when a concurrent creation
	// committed after the statement's snapshot.
	begin func(n newRecord, keyID string, now *time.Time, lockWait time.Duration) query
	// completeHeld ends the record id as COMPLETED when token holds it
	// (IN_PROGRESS or UNKNOWN with that lease token), as statemachine.Next
	// does for a Complete with the latest token; a COMPLETED generation is
	// no longer uncertain. Its row: fullColumns (a completed record keeps
	// its checkpoint, which its answer carries), the clock; none when
	// token does not hold the record.
	completeHeld func(id Identity, token string, r storedResponse, now *time.Time) query
	// read reads the record id: fullColumns, the clock.
	read func(id Identity, now *time.Time) query
	// lock is read under the row lock (FOR UPDATE), inside a
	// transaction.
	lock func(id Identity, now *time.Time) query
	// lockNow is lock whose clock is the time the statement runs
	// (clock_timestamp), not the transaction's start: for RunTx, whose
	// transaction may have waited on the key's lock.
	lockNow func(id Identity, now *time.Time) query
	// insert creates the record id with cols (recordArgs, fullColumns)
	// unless it exists: one row affected when it did.
	insert func(id Identity, cols []any) query
	// update overwrites the record id with cols (recordArgs, fullColumns).
	update func(id Identity, cols []any) query
	// remove deletes the record id.
	remove func(id Identity) query
	// forget deletes the record id and returns it: recordColumns, the
	// clock.
	forget func(id Identity, now *time.Time) query
	// watch marks the record id, if IN_PROGRESS, as waited for (one row
	// affected when it was).
	watch func(id Identity) query

	// Many records named by their identities, in one statement.

	// beginBatch is begin for many distinct keys. Its rows: created,
	// tenant, scope, key, fullColumns, the clock; one per key created
	// or found. It takes its row locks in the global lock order (see
	// compareIdentity), whatever order recs come in.
	beginBatch func(recs []newRecord, keyID string, now *time.Time, lockWait time.Duration) query
	// completeBatch is completeHeld for many distinct records, locking
	// them first in the global lock order. Its rows: tenant, scope, key,
	// fullColumns, the clock; one per record completed.
	completeBatch func(cs []heldCompletion, now *time.Time) query

	// Transactions.

	// clock reads the clock inside a transaction (when there is no row
	// to read it with): one timestamptz.
	clock func() query
	// runTxStart bounds the lock waits of the rest of RunTx's
	// transaction by lockWait and reads the clock at the time it runs:
	// one timestamptz.
	runTxStart func(lockWait time.Duration, now *time.Time) query
	// runTxLockDefault lifts runTxStart's bound for what fn does.
	runTxLockDefault func() query
	// runTxClock reads the clock at the time it runs: one timestamptz.
	runTxClock func(now *time.Time) query

	// Many records found by a condition (listing, counting, the reaper's
	// passes, converting legacy rows).

	// list is a page of ListRecords: scope, key, listColumns, the clock,
	// and archived_at when listing the archive; at most limit rows.
	list func(p *ListParams, now *time.Time, limit int) query
	// count counts a tenant's records by scope and state in effect now:
	// scope, state, count, in that order; at most limit rows.
	count func(tenant string, limit int, now *time.Time) query
	// countByState counts every record by its state in effect now:
	// state, count.
	countByState func(now *time.Time) query
	// tableSize is the records table's size in bytes: one int8.
	tableSize func() query
	// stateCounts reads without scanning the table: IN_PROGRESS records,
	// those of them whose lease lapsed, UNKNOWN records, the table's
	// estimated row count (float8, NULL when unknown), and the most
	// common stored states with their frequencies (int2[], float4[]).
	stateCounts func(now *time.Time) query
	// countLegacy counts the rows not in the current sealed form: one
	// int8.
	countLegacy func() query
	// legacyBatch locks (SKIP LOCKED) and returns the next limit rows not
	// in the current sealed form after the record after (nil: from the
	// start), in identity order: tenant, scope, key, fullColumns.
	legacyBatch func(after *Identity, limit int) query
	// legacyLock, where its text is not empty, is how legacyBatch's rows
	// are locked (legacyBatch then locks nothing): it locks the record
	// id, unless another transaction holds it (SKIP LOCKED), and returns
	// it as legacyBatch does while it is still not in the current sealed
	// form.
	legacyLock func(id Identity) query
	// The reaper's passes (see Reap). Each locks its rows with SKIP
	// LOCKED, so replicas reaping at once never touch the same row, and
	// returns one row per record, at most batch: reapStale,
	// reapArchive and reapArchivePrune return its scope, the others a
	// constant. On Citus they run per shard (citusPerShard), at most
	// batch rows per shard, with a second column: NULL, or what failed on
	// a shard.
	reapStale        func(now *time.Time, batch int) query
	reapExpired      func(now *time.Time, batch int) query
	reapDelete       func(now *time.Time, batch int, retention time.Duration) query
	reapArchive      func(p *ReapParams, now *time.Time, batch int) query
	reapArchivePrune func(now *time.Time, batch int, retention time.Duration) query

	// Console sessions, each named by its id's hash (except revoke).

	// sessionCreate stores a session, after deleting at most sweep
	// expired ones: created_at, last_seen_at, expires_at.
	sessionCreate func(p *CreateSessionParams, now *time.Time, sweep int) query
	// sessionTouch records the use of a live session: tenant,
	// token_sha256, credential, created_at, last_seen_at, expires_at; no
	// row when it is not live.
	sessionTouch func(idSHA256 []byte, now *time.Time) query
	// sessionDeleteExpired deletes the session if it has expired.
	sessionDeleteExpired func(idSHA256 []byte, now *time.Time) query
	// sessionDelete deletes the session.
	sessionDelete func(idSHA256 []byte) query
	// sessionRevoke deletes the sessions of these token hashes.
	sessionRevoke func(tokenSHA256s [][]byte) query

	// notifier are the change listener's statements.
	notifier notifier.Statements
}

// statementsFor returns the statements of dialect d.
func statementsFor(d dialect) *statements {
	switch d {
	case postgreSQL:
		return postgreSQLStatements()
	case citus:
		return citusStatements()
	}
	panic("ledger: no statements for dialect " + strconv.Itoa(int(d)))
}

// recordColumnNames are a record's columns beyond its identity, in the
// order scanTargets scans and recordArgs writes them. Every column list and
// placeholder list below is derived from it.
var recordColumnNames = []string{"state", "fingerprint", "attempt", "generation", "lease_token",
	"attempt_id", "acquired_from", "ended_by", "has_response", "schema_version", "content_type",
	"status_code", "body", "metadata", "failure_reason", "ttl_us", "failure_ttl_us", "created_at",
	"updated_at", "lease_expires_at", "expires_at", "enc_key_id", "uncertain", "seal_version"}

// checkpointColumnNames are the columns of a record's checkpoint (all NULL
// when it has none), which follow recordColumnNames where a statement reads
// or writes them (fullColumns): every statement whose row answers a call,
// so that the record in an answer carries its generation's checkpoint (a
// Begin's replay and the holder's Complete included), and those that
// rewrite a record whole; not Forget's, whose record is gone.
var checkpointColumnNames = []string{"checkpoint_phase", "checkpoint_data", "checkpoint_at", "checkpoint_attempt"}

var (
	// recordColumns lists recordColumnNames for SELECT and RETURNING.
	recordColumns = strings.Join(recordColumnNames, ", ")
	// checkpointColumns lists checkpointColumnNames.
	checkpointColumns = strings.Join(checkpointColumnNames, ", ")
	// fullColumns are recordColumns followed by checkpointColumns: the
	// whole record, as scanFullTargets scans it and recordArgs writes it.
	fullColumns = recordColumns + ", " + checkpointColumns
	// recordColumnsR is recordColumns qualified by the alias r.
	recordColumnsR = "r." + strings.Join(recordColumnNames, ", r.")
	// fullColumnsR is fullColumns qualified by the alias r.
	fullColumnsR = recordColumnsR + ", r." + strings.Join(checkpointColumnNames, ", r.")
	// listColumns are fullColumns with the stored response and the
	// checkpoint's data left out (has_response false, no body, metadata
	// or checkpoint_data), so listing never reads bodies.
	listColumns = strings.NewReplacer("has_response", "false",
		"body", "NULL::bytea", "metadata", "NULL::bytea", "checkpoint_data", "NULL::bytea").Replace(fullColumns)
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

// legacyRowSQL selects the rows not in the current sealed form.
const legacyRowSQL = `(enc_key_id = '' OR seal_version < 2)`

// lockWaitSQL is a CTE, lock_wait, that bounds the lock waits of the
// statement it is part of to the lock_timeout given in param (as
// lockTimeoutArg formats it). A statement's INSERT reads lock_wait with its
// rows, so the bound is set before the first row is inserted, and with it
// before any wait on another transaction's insert or change of the same
// key (such as a RunTx running fn); it ends with the statement's
// transaction. A wait that reaches it fails the statement with
// lock_not_available (isLockTimeout), having written nothing.
func lockWaitSQL(param string) string {
	return `lock_wait AS MATERIALIZED (SELECT set_config('lock_timeout', ` + param + `, true) AS lock_timeout)`
}

// lockTimeoutArg formats d for lockWaitSQL: whole milliseconds, at least
// one (0 would mean no bound).
func lockTimeoutArg(d time.Duration) string {
	return strconv.FormatInt(max(d.Milliseconds(), 1), 10) + "ms"
}

// storedFingerprint is a fingerprint as a bytea column holds it: never
// NULL.
func storedFingerprint(fp []byte) []byte {
	if fp == nil {
		return []byte{}
	}
	return fp
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

// The PostgreSQL dialect's fixed texts.
var (
	// pgBeginSQL: $1 tenant, $2 scope, $3 key, $4 fingerprint, $5 lease
	// token, $6 attempt_id, $7 ttl µs, $8 failure ttl µs, $9 lease µs, $10
	// now or NULL, $11 enc_key_id, $12 seal_version, $13 lock_timeout.
	pgBeginSQL = `WITH clock AS (SELECT coalesce($10::timestamptz, now()) AS now),
` + lockWaitSQL("$13") + `,
ins AS (
	INSERT INTO idempotency_records (tenant, scope, key, state, fingerprint, attempt, generation,
		lease_token, attempt_id, ttl_us, failure_ttl_us, created_at, updated_at, lease_expires_at,
		enc_key_id, seal_version)
	SELECT $1, $2, $3, 1, $4, 1, 1, $5, $6, $7, $8, clock.now, clock.now,
		clock.now + $9 * interval '1 microsecond', $11, $12
	FROM clock, lock_wait
	ON CONFLICT DO NOTHING
	RETURNING ` + fullColumns + `
)
SELECT true, ins.*, clock.now FROM ins, clock
UNION ALL
SELECT false, ` + fullColumns + `, clock.now FROM idempotency_records, clock
	WHERE tenant = $1 AND scope = $2 AND key = $3 AND NOT EXISTS (SELECT 1 FROM ins)`

	// pgBeginBatchSQL: $1 now or NULL; $2.. arrays, one element per
	// record: tenant, scope, key, fingerprint, token, attempt_id, ttl µs,
	// failure ttl µs, lease µs; $11 enc_key_id, $12 seal_version, $13
	// lock_timeout.
	pgBeginBatchSQL = `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now),
` + lockWaitSQL("$13") + `,
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
	FROM input i, clock, lock_wait
	ORDER BY i.tenant COLLATE "C", i.scope COLLATE "C", i.key COLLATE "C"
	ON CONFLICT DO NOTHING
	RETURNING tenant, scope, key, ` + fullColumns + `)
SELECT true, ins.*, clock.now FROM ins, clock
UNION ALL
SELECT false, r.tenant, r.scope, r.key, ` + fullColumnsR + `, clock.now
FROM idempotency_records r JOIN input i ON r.tenant = i.tenant AND r.scope = i.scope AND r.key = i.key, clock
WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.tenant = i.tenant AND ins.scope = i.scope AND ins.key = i.key)`

	// pgCompleteHeldSQL: $1-$3 identity, $4 now or NULL, $5 token, then
	// the stored response $6-$12.
	pgCompleteHeldSQL = stateSQL(`WITH clock AS (SELECT coalesce($4::timestamptz, now()) AS now)
UPDATE idempotency_records r SET state = {COMPLETED}, ended_by = {ENDED_BY_COMPLETED}, has_response = $6, schema_version = $7,
	content_type = $8, status_code = $9, body = $10, metadata = $11, enc_key_id = $12,
	failure_reason = '', lease_expires_at = NULL, updated_at = clock.now, uncertain = false,
	expires_at = clock.now + r.ttl_us * interval '1 microsecond'
FROM clock
WHERE r.tenant = $1 AND r.scope = $2 AND r.key = $3 AND r.lease_token = $5 AND r.state IN ({IN_PROGRESS}, {UNKNOWN})
RETURNING ` + fullColumns + `, clock.now`)

	// pgCompleteBatchSQL: $1 now or NULL; $2.. arrays, one element per
	// record: tenant, scope, key, token, then the stored response's
	// columns.
	pgCompleteBatchSQL = stateSQL(`WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now),
input AS (
	SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::bool[], $7::text[],
		$8::text[], $9::int4[], $10::bytea[], $11::bytea[], $12::text[])
		AS i(tenant, scope, key, token, has_response, schema_version, content_type, status_code,
			body, metadata, enc_key_id)),
locked AS MATERIALIZED (
	SELECT i.* FROM idempotency_records r
	JOIN input i ON r.tenant = i.tenant AND r.scope = i.scope AND r.key = i.key
	WHERE r.lease_token = i.token AND r.state IN ({IN_PROGRESS}, {UNKNOWN})
	ORDER BY r.tenant COLLATE "C", r.scope COLLATE "C", r.key COLLATE "C"
	FOR UPDATE OF r)
UPDATE idempotency_records r SET state = {COMPLETED}, ended_by = {ENDED_BY_COMPLETED}, has_response = l.has_response,
	schema_version = l.schema_version, content_type = l.content_type, status_code = l.status_code,
	body = l.body, metadata = l.metadata, enc_key_id = l.enc_key_id, failure_reason = '',
	lease_expires_at = NULL, updated_at = clock.now, uncertain = false,
	expires_at = clock.now + r.ttl_us * interval '1 microsecond'
FROM locked l, clock
WHERE r.tenant = l.tenant AND r.scope = l.scope AND r.key = l.key AND r.lease_token = l.token
	AND r.state IN ({IN_PROGRESS}, {UNKNOWN})
RETURNING r.tenant, r.scope, r.key, ` + fullColumnsR + `, clock.now`)

	// pgReadSQL, pgLockSQL, pgLockNowSQL: $1-$3 identity, $4 now or NULL.
	pgReadSQL = `SELECT ` + fullColumns + `, coalesce($4::timestamptz, now())
	FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3`
	pgLockSQL    = pgReadSQL + ` FOR UPDATE`
	pgLockNowSQL = `SELECT ` + fullColumns + `, coalesce($4::timestamptz, clock_timestamp())
	FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3 FOR UPDATE`

	// pgInsertSQL, pgUpdateSQL: $1-$3 identity, then recordArgs.
	pgInsertSQL = wholeRecordSQL(true)
	pgUpdateSQL = wholeRecordSQL(false)

	// pgForgetSQL: $1-$3 identity, $4 now or NULL.
	pgForgetSQL = `WITH clock AS (SELECT coalesce($4::timestamptz, now()) AS now)
	DELETE FROM idempotency_records USING clock
	WHERE tenant = $1 AND scope = $2 AND key = $3
	RETURNING ` + recordColumns + `, clock.now`

	// pgWatchSQL: $1-$3 identity.
	pgWatchSQL = stateSQL(`UPDATE idempotency_records SET watched = true
	WHERE tenant = $1 AND scope = $2 AND key = $3 AND state = {IN_PROGRESS}`)

	// pgStateCountsSQL: $1 now or NULL. It reads the lease index (which
	// holds only IN_PROGRESS rows), the partial index of UNKNOWN rows
	// where it exists, and the planner's statistics.
	pgStateCountsSQL = stateSQL(`SELECT
	(SELECT count(*) FROM idempotency_records WHERE state = {IN_PROGRESS}),
	(SELECT count(*) FROM idempotency_records WHERE state = {IN_PROGRESS} AND lease_expires_at <= coalesce($1::timestamptz, now())),
	(SELECT count(*) FROM idempotency_records WHERE state = {UNKNOWN}),
	(SELECT reltuples::float8 FROM pg_class WHERE oid = 'idempotency_records'::regclass),
	(SELECT most_common_vals::text::int2[] FROM pg_stats
		WHERE schemaname = current_schema() AND tablename = 'idempotency_records' AND attname = 'state'),
	(SELECT most_common_freqs FROM pg_stats
		WHERE schemaname = current_schema() AND tablename = 'idempotency_records' AND attname = 'state')`)

	// The reaper's fixed passes: $1 now or NULL, $2 the batch size, $3
	// (where used) a retention in µs. "now" is written inline (not in a
	// CTE) so the planner can use it as an index condition.
	pgReapStaleSQL = stateSQL(`WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state = {IN_PROGRESS} AND lease_expires_at <= coalesce($1::timestamptz, now())
	ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
UPDATE idempotency_records r SET state = {UNKNOWN}, uncertain = true, lease_expires_at = NULL,
	updated_at = coalesce($1::timestamptz, now())
FROM batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING r.scope`)

	pgReapExpiredSQL = stateSQL(`WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state IN ({COMPLETED}, {FAILED_RETRYABLE}, {FAILED_REPLAYABLE}) AND expires_at <= coalesce($1::timestamptz, now())
	ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
UPDATE idempotency_records r SET state = {EXPIRED}, has_response = false, body = NULL, metadata = NULL,
	checkpoint_phase = NULL, checkpoint_data = NULL, checkpoint_at = NULL, checkpoint_attempt = NULL,
	updated_at = coalesce($1::timestamptz, now())
FROM batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING 1`)

	pgReapDeleteSQL = stateSQL(`WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE state = {EXPIRED} AND expires_at <= coalesce($1::timestamptz, now()) - $3 * interval '1 microsecond'
	ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM idempotency_records r USING batch
WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
RETURNING 1`)

	pgReapArchivePruneSQL = `WITH batch AS (
	SELECT tenant, scope, key, archived_at FROM idempotency_archive
	WHERE archived_at <= coalesce($1::timestamptz, now()) - $3 * interval '1 microsecond'
	ORDER BY archived_at LIMIT $2 FOR UPDATE SKIP LOCKED)
DELETE FROM idempotency_archive a USING batch
WHERE a.tenant = batch.tenant AND a.scope = batch.scope AND a.key = batch.key AND a.archived_at = batch.archived_at
RETURNING a.scope`

	// pgSessionCreateSQL: $1 now or NULL, $2 id hash, $3 tenant, $4 token
	// hash, $5 credential, $6 idle timeout µs, $7 lifetime µs, $8 how
	// many expired sessions to delete at most.
	pgSessionCreateSQL = `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now),
swept AS (
	DELETE FROM idempotency_console_sessions WHERE id_sha256 IN (
		SELECT id_sha256 FROM idempotency_console_sessions
		WHERE expires_at <= coalesce($1::timestamptz, now())
		ORDER BY expires_at LIMIT $8 FOR UPDATE SKIP LOCKED))
INSERT INTO idempotency_console_sessions (id_sha256, tenant, token_sha256, credential, created_at, last_seen_at,
	idle_timeout, absolute_expires_at, expires_at)
SELECT $2, $3, $4, $5, clock.now, clock.now, $6::bigint * interval '1 microsecond',
	clock.now + $7::bigint * interval '1 microsecond',
	least(clock.now + $6::bigint * interval '1 microsecond', clock.now + $7::bigint * interval '1 microsecond')
FROM clock
RETURNING created_at, last_seen_at, expires_at`

	// pgSessionTouchSQL: $1 now or NULL, $2 id hash.
	pgSessionTouchSQL = `UPDATE idempotency_console_sessions s
SET last_seen_at = clock.now, expires_at = least(clock.now + s.idle_timeout, s.absolute_expires_at)
FROM (SELECT coalesce($1::timestamptz, now()) AS now) clock
WHERE s.id_sha256 = $2 AND s.expires_at > clock.now
RETURNING s.tenant, s.token_sha256, s.credential, s.created_at, s.last_seen_at, s.expires_at`
)

// wholeRecordSQL builds the insert or the update of a whole record from
// recordColumnNames and checkpointColumnNames.
func wholeRecordSQL(insert bool) string {
	names := slices.Concat(recordColumnNames, checkpointColumnNames)
	if insert {
		ph := make([]string, 3+len(names))
		for i := range ph {
			ph[i] = "$" + strconv.Itoa(i+1)
		}
		return "INSERT INTO idempotency_records (tenant, scope, key, " + fullColumns +
			") VALUES (" + strings.Join(ph, ", ") + ") ON CONFLICT DO NOTHING"
	}
	set := make([]string, len(names))
	for i, c := range names {
		set[i] = c + " = $" + strconv.Itoa(i+4)
	}
	return "UPDATE idempotency_records SET " + strings.Join(set, ", ") +
		" WHERE tenant = $1 AND scope = $2 AND key = $3"
}

// postgreSQLStatements are the statements of a single PostgreSQL server.
func postgreSQLStatements() *statements {
	identity := func(id Identity, more ...any) []any {
		return append([]any{id.Tenant, id.Scope, id.Key}, more...)
	}
	fixed := func(sql string) func() query { return func() query { return query{sql: sql} } }
	return &statements{
		begin: func(n newRecord, keyID string, now *time.Time, lockWait time.Duration) query {
			return query{sql: pgBeginSQL, args: identity(n.id, storedFingerprint(n.fingerprint), n.token, n.attemptID,
				n.ttl.Microseconds(), n.failureTTL.Microseconds(), n.lease.Microseconds(), now,
				keyID, int16(keyring.SealVersion), lockTimeoutArg(lockWait))}
		},
		completeHeld: func(id Identity, token string, r storedResponse, now *time.Time) query {
			return query{sql: pgCompleteHeldSQL, args: identity(id, now, token, r.has, r.schemaVersion, r.contentType,
				r.statusCode, r.body, r.metadata, r.keyID)}
		},
		read:    func(id Identity, now *time.Time) query { return query{sql: pgReadSQL, args: identity(id, now)} },
		lock:    func(id Identity, now *time.Time) query { return query{sql: pgLockSQL, args: identity(id, now)} },
		lockNow: func(id Identity, now *time.Time) query { return query{sql: pgLockNowSQL, args: identity(id, now)} },
		insert:  func(id Identity, cols []any) query { return query{sql: pgInsertSQL, args: identity(id, cols...)} },
		update:  func(id Identity, cols []any) query { return query{sql: pgUpdateSQL, args: identity(id, cols...)} },
		remove: func(id Identity) query {
			return query{sql: `DELETE FROM idempotency_records WHERE tenant = $1 AND scope = $2 AND key = $3`, args: identity(id)}
		},
		forget: func(id Identity, now *time.Time) query { return query{sql: pgForgetSQL, args: identity(id, now)} },
		watch:  func(id Identity) query { return query{sql: pgWatchSQL, args: identity(id)} },

		beginBatch: func(recs []newRecord, keyID string, now *time.Time, lockWait time.Duration) query {
			n := len(recs)
			tenants, scopes, keys := make([]string, n), make([]string, n), make([]string, n)
			fps, tokens, attemptIDs := make([][]byte, n), make([]string, n), make([]string, n)
			ttls, fttls, leases := make([]int64, n), make([]int64, n), make([]int64, n)
			for i, r := range recs {
				tenants[i], scopes[i], keys[i] = r.id.Tenant, r.id.Scope, r.id.Key
				fps[i], tokens[i], attemptIDs[i] = storedFingerprint(r.fingerprint), r.token, r.attemptID
				ttls[i], fttls[i], leases[i] = r.ttl.Microseconds(), r.failureTTL.Microseconds(), r.lease.Microseconds()
			}
			return query{sql: pgBeginBatchSQL, args: []any{now, tenants, scopes, keys, fps, tokens, attemptIDs, ttls, fttls, leases,
				keyID, int16(keyring.SealVersion), lockTimeoutArg(lockWait)}}
		},
		completeBatch: func(cs []heldCompletion, now *time.Time) query {
			n := len(cs)
			tenants, scopes, keys, tokens := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
			has := make([]bool, n)
			svs, cts, keyIDs := make([]string, n), make([]string, n), make([]string, n)
			codes := make([]int32, n)
			bodies, metas := make([][]byte, n), make([][]byte, n)
			for i, c := range cs {
				r := c.response
				tenants[i], scopes[i], keys[i], tokens[i] = c.id.Tenant, c.id.Scope, c.id.Key, c.token
				has[i], svs[i], cts[i], codes[i] = r.has, r.schemaVersion, r.contentType, r.statusCode
				bodies[i], metas[i], keyIDs[i] = r.body, r.metadata, r.keyID
			}
			return query{sql: pgCompleteBatchSQL, args: []any{now, tenants, scopes, keys, tokens, has, svs, cts, codes, bodies, metas, keyIDs}}
		},

		clock: fixed(`SELECT now()`),
		runTxStart: func(lockWait time.Duration, now *time.Time) query {
			return query{sql: `SELECT coalesce($2::timestamptz, clock_timestamp()) FROM set_config('lock_timeout', $1, true)`, args: []any{strconv.FormatInt(lockWait.Milliseconds()+1, 10) + "ms", now}}
		},
		runTxLockDefault: fixed(`SET LOCAL lock_timeout TO DEFAULT`),
		runTxClock: func(now *time.Time) query {
			return query{sql: `SELECT coalesce($1::timestamptz, clock_timestamp())`, args: []any{now}}
		},

		list: pgList,
		count: func(tenant string, limit int, now *time.Time) query {
			return query{sql: `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now)
		SELECT scope, ` + effectiveStateSQL + ` AS effective, count(*)
		FROM idempotency_records, clock
		WHERE tenant = $2
		GROUP BY scope, effective
		ORDER BY scope, effective
		LIMIT $3`, args: []any{now, tenant, limit}}
		},
		countByState: func(now *time.Time) query {
			return query{sql: `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now)
		SELECT ` + effectiveStateSQL + ` AS effective, count(*)
		FROM idempotency_records, clock GROUP BY effective`, args: []any{now}}
		},
		tableSize:   fixed(`SELECT pg_relation_size('idempotency_records')`),
		stateCounts: func(now *time.Time) query { return query{sql: pgStateCountsSQL, args: []any{now}} },
		countLegacy: fixed(`SELECT count(*) FROM idempotency_records WHERE ` + legacyRowSQL),
		legacyBatch: func(after *Identity, limit int) query {
			return legacyRows(after, limit, ` FOR UPDATE SKIP LOCKED`)
		},
		legacyLock: func(Identity) query { return query{} },
		reapStale:  func(now *time.Time, batch int) query { return query{sql: pgReapStaleSQL, args: []any{now, batch}} },
		reapExpired: func(now *time.Time, batch int) query {
			return query{sql: pgReapExpiredSQL, args: []any{now, batch}}
		},
		reapDelete: func(now *time.Time, batch int, retention time.Duration) query {
			return query{sql: pgReapDeleteSQL, args: []any{now, batch, retention.Microseconds()}}
		},
		reapArchive: pgReapArchive,
		reapArchivePrune: func(now *time.Time, batch int, retention time.Duration) query {
			return query{sql: pgReapArchivePruneSQL, args: []any{now, batch, retention.Microseconds()}}
		},

		sessionCreate: func(p *CreateSessionParams, now *time.Time, sweep int) query {
			return query{sql: pgSessionCreateSQL, args: []any{now, p.IDSHA256, p.Tenant, p.TokenSHA256, p.Credential,
				p.IdleTimeout.Microseconds(), p.MaxLifetime.Microseconds(), sweep}}
		},
		sessionTouch: func(idSHA256 []byte, now *time.Time) query {
			return query{sql: pgSessionTouchSQL, args: []any{now, idSHA256}}
		},
		sessionDeleteExpired: func(idSHA256 []byte, now *time.Time) query {
			return query{sql: `DELETE FROM idempotency_console_sessions
WHERE id_sha256 = $2 AND expires_at <= coalesce($1::timestamptz, now())`, args: []any{now, idSHA256}}
		},
		sessionDelete: func(idSHA256 []byte) query {
			return query{sql: `DELETE FROM idempotency_console_sessions WHERE id_sha256 = $1`, args: []any{idSHA256}}
		},
		sessionRevoke: func(tokenSHA256s [][]byte) query {
			return query{sql: `DELETE FROM idempotency_console_sessions WHERE token_sha256 = ANY($1::bytea[])`, args: []any{tokenSHA256s}}
		},

		notifier: notifier.Statements{
			Listen:     `LISTEN ` + notifier.Channel,
			Dropped:    `SELECT dropped FROM idemcoord_notify_drops`,
			Ping:       `SELECT pg_notify($1, $2 || d.dropped), pg_notification_queue_usage() FROM idemcoord_notify_drops d`,
			QueueUsage: `SELECT pg_notification_queue_usage()`,
		},
	}
}

// pgList builds a page of ListRecords: keyset pages over the primary key,
// so records written between two pages never shift the ones that follow.
func pgList(p *ListParams, now *time.Time, limit int) query {
	args := []any{now, p.Tenant}
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
	if p.CheckpointPhase != "" {
		// An expired record reads without its checkpoint.
		where.WriteString(" AND checkpoint_phase = " + arg(p.CheckpointPhase) + " AND " + effectiveStateSQL +
			" <> " + strconv.Itoa(int(statemachine.StateExpired)))
	}
	sql := `WITH clock AS (SELECT coalesce($1::timestamptz, now()) AS now)
		SELECT scope, key, ` + listColumns + `, clock.now` + extra + `
		FROM ` + table + `, clock
		WHERE ` + where.String() + `
		ORDER BY ` + order + `
		LIMIT ` + arg(limit)
	return query{sql: sql, args: args}
}

// pgReapArchive builds the reaper's archiving pass for p: $1 now, $2 the
// batch size, $3 the least retention (µs, which lets the indexes narrow
// the scan), then the retention of each scope rule and the default, in a
// CASE that picks the first match.
func pgReapArchive(p *ReapParams, now *time.Time, batch int) query {
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
	return query{sql: stateSQL(`WITH batch AS (
	SELECT tenant, scope, key FROM idempotency_records
	WHERE ((state = {UNKNOWN} AND updated_at <= ` + cutoff("$3") + `)
		OR (state = {IN_PROGRESS} AND lease_expires_at <= ` + cutoff("$3") + `))
		AND CASE WHEN state = {UNKNOWN} THEN updated_at ELSE lease_expires_at END <= ` + cutoff("("+retention.String()+")") + `
	ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED),
moved AS (
	DELETE FROM idempotency_records r USING batch
	WHERE r.tenant = batch.tenant AND r.scope = batch.scope AND r.key = batch.key
	RETURNING r.tenant, r.scope, r.key, ` + fullColumnsR + `)
INSERT INTO idempotency_archive (tenant, scope, key, ` + fullColumns + `, archived_at)
SELECT tenant, scope, key, ` + fullColumns + `, coalesce($1::timestamptz, now()) FROM moved
RETURNING scope`), args: append([]any{now, batch}, args...)}
}

// citusStatements are the statements of a Citus coordinator node whose
// records (and archive) are distributed by hash of key: the PostgreSQL
// set with the statements Citus cannot run, or runs on more than one
// shard, replaced.
//
// Citus routes a statement whose WHERE (or VALUES) names the key with
// equality to the one shard that holds it, with no intermediate results,
// as long as the statement has no CTE, no COALESCE or CASE over a
// function that is not IMMUTABLE, no such function in RETURNING, and no
// STABLE function or operator next to a column reference (it evaluates
// now() on the coordinator node, once, before it sends the statement). So
// the clock is written inline: the parameter of the injected clock, or
// now(); the statement returns it as the column it was written to; and
// "clock + ttl" is computed in UTC with the IMMUTABLE timestamp
// arithmetic.
func citusStatements() *statements {
	st := postgreSQLStatements()
	// A change notifies on the worker that holds the record, and its
	// trigger counts there the changes it could not notify: the listener
	// creates that table on each worker it listens on.
	st.notifier.Prepare = `CREATE TABLE IF NOT EXISTS idemcoord_notify_drops (
    id      boolean PRIMARY KEY DEFAULT true CHECK (id),
    dropped bigint  NOT NULL DEFAULT 0);
INSERT INTO idemcoord_notify_drops DEFAULT VALUES ON CONFLICT DO NOTHING`
	identity := func(id Identity, more ...any) []any {
		return append([]any{id.Tenant, id.Scope, id.Key}, more...)
	}
	st.begin = func(n newRecord, keyID string, now *time.Time, lockWait time.Duration) query {
		args := identity(n.id, storedFingerprint(n.fingerprint), n.token, n.attemptID,
			n.ttl.Microseconds(), n.failureTTL.Microseconds(), n.lease.Microseconds(), keyID, int16(keyring.SealVersion))
		clock := citusClock(now, &args)
		// An existing key returns no row: the Begin then decides on the
		// locked path, which reads it under its row lock.
		return query{sql: `INSERT INTO idempotency_records (tenant, scope, key, state, fingerprint, attempt, generation,
		lease_token, attempt_id, ttl_us, failure_ttl_us, created_at, updated_at, lease_expires_at,
		enc_key_id, seal_version)
	VALUES ($1, $2, $3, 1, $4, 1, 1, $5, $6, $7, $8, ` + clock + `, ` + clock + `,
		` + clock + ` + $9 * interval '1 microsecond', $10, $11)
	ON CONFLICT DO NOTHING
	RETURNING true, ` + fullColumns + `, created_at`,
			args: args, local: `SET LOCAL citus.propagate_set_commands = 'local'; SET LOCAL lock_timeout = '` + lockTimeoutArg(lockWait) + `'`}
	}
	// RunTx's bound on its lock waits must reach the workers too (and so
	// does its lifting, runTxLockDefault, a SET LOCAL in the same
	// transaction).
	st.runTxStart = func(lockWait time.Duration, now *time.Time) query {
		return query{sql: `SELECT coalesce($1::timestamptz, clock_timestamp())`, args: []any{now},
			local: `SET LOCAL citus.propagate_set_commands = 'local'; SET LOCAL lock_timeout = '` +
				strconv.FormatInt(lockWait.Milliseconds()+1, 10) + `ms'`}
	}
	st.completeHeld = func(id Identity, token string, r storedResponse, now *time.Time) query {
		args := identity(id, token, r.has, r.schemaVersion, r.contentType, r.statusCode, r.body, r.metadata, r.keyID)
		clock := citusClock(now, &args)
		return query{sql: stateSQL(`UPDATE idempotency_records r SET state = {COMPLETED}, ended_by = {ENDED_BY_COMPLETED},
	has_response = $5, schema_version = $6, content_type = $7, status_code = $8, body = $9, metadata = $10,
	enc_key_id = $11, failure_reason = '', lease_expires_at = NULL, updated_at = ` + clock + `, uncertain = false,
	expires_at = ((` + clock + `) AT TIME ZONE 'UTC' + r.ttl_us * interval '1 microsecond') AT TIME ZONE 'UTC'
WHERE r.tenant = $1 AND r.scope = $2 AND r.key = $3 AND r.lease_token = $4 AND r.state IN ({IN_PROGRESS}, {UNKNOWN})
RETURNING ` + fullColumns + `, updated_at`), args: args}
	}
	// The records gauge: sizes and exact counts of IN_PROGRESS and
	// UNKNOWN records summed over the shards; the planner's statistics of
	// the coordinator node's table say nothing of the shards, so there is
	// no estimate of the other states.
	st.tableSize = func() query { return query{sql: `SELECT citus_relation_size('idempotency_records')`} }
	st.stateCounts = func(now *time.Time) query {
		return query{sql: stateSQL(`SELECT
	(SELECT count(*) FROM idempotency_records WHERE state = {IN_PROGRESS}),
	(SELECT count(*) FROM idempotency_records WHERE state = {IN_PROGRESS} AND lease_expires_at <= coalesce($1::timestamptz, now())),
	(SELECT count(*) FROM idempotency_records WHERE state = {UNKNOWN}),
	NULL::float8, NULL::int2[], NULL::float4[]`), args: []any{now}}
	}
	// Converting legacy rows: the candidates over every shard, unlocked,
	// then each locked on its own shard.
	st.legacyBatch = func(after *Identity, limit int) query { return legacyRows(after, limit, "") }
	st.legacyLock = func(id Identity) query {
		return query{sql: `SELECT tenant, scope, key, ` + fullColumns + ` FROM idempotency_records
				WHERE tenant = $1 AND scope = $2 AND key = $3 AND ` + legacyRowSQL + ` FOR UPDATE SKIP LOCKED`, args: identity(id)}
	}
	// The reaper's passes, per shard.
	for _, f := range []*func(now *time.Time, batch int) query{&st.reapStale, &st.reapExpired} {
		pg := *f
		*f = func(now *time.Time, batch int) query { return citusPerShard(pg(now, batch), "idempotency_records") }
	}
	pgDelete, pgArchive, pgPrune := st.reapDelete, st.reapArchive, st.reapArchivePrune
	st.reapDelete = func(now *time.Time, batch int, retention time.Duration) query {
		return citusPerShard(pgDelete(now, batch, retention), "idempotency_records")
	}
	st.reapArchive = func(p *ReapParams, now *time.Time, batch int) query {
		return citusPerShard(pgArchive(p, now, batch), "idempotency_records")
	}
	st.reapArchivePrune = func(now *time.Time, batch int, retention time.Duration) query {
		return citusPerShard(pgPrune(now, batch, retention), "idempotency_archive")
	}
	return st
}

// citusClock is the clock written inline in a Citus statement: the
// injected clock, appended to args as the last parameter, or now().
func citusClock(now *time.Time, args *[]any) string {
	if now == nil {
		return "now()"
	}
	*args = append(*args, *now)
	return "$" + strconv.Itoa(len(*args)) + "::timestamptz"
}

// citusClockArg is how the PostgreSQL reaper statements read the clock:
// their first parameter, or the database's clock.
const citusClockArg = "coalesce($1::timestamptz, now())"

// citusPerShard turns q, one of the PostgreSQL dialect's reaper statements
// (which reads the clock as citusClockArg only, and takes integers and
// text after it), into one run on every shard of table, and on the
// archive's co-located shard where q names the archive too (Citus cannot
// run q's FOR UPDATE SKIP LOCKED over distributed tables). Each shard's
// statement runs on its worker in a transaction of its own, with the
// coordinator node's clock and q's other parameters written into its
// text. Its rows: one per row q returns on a shard, with the first column
// of q's row (as text) and NULL; and one per shard where q failed, with
// NULL and what failed.
func citusPerShard(q query, table string) query {
	text := q.sql
	fn := "run_command_on_shards('" + table + "', "
	if table == "idempotency_records" && strings.Contains(text, "idempotency_archive") {
		fn = "run_command_on_colocated_placements('idempotency_records', 'idempotency_archive', "
		text = strings.ReplaceAll(text, "idempotency_archive", "%%2$s")
	}
	text = strings.ReplaceAll(text, table, "%%1$s")
	text = strings.ReplaceAll(text, citusClockArg, "%1$L::timestamptz")
	// format's arguments: the clock, then q's $2.. as text. Replaced from
	// the last, so $1 is never taken for the start of $12.
	formatArgs := make([]string, len(q.args))
	args := make([]any, len(q.args)+1)
	args[1] = q.args[0]
	formatArgs[0] = "coalesce($2::timestamptz, now())"
	for i := len(q.args); i >= 2; i-- {
		n := strconv.Itoa(i)
		switch v := q.args[i-1].(type) {
		case int:
			text = strings.ReplaceAll(text, "$"+n, "(%"+n+"$s)")
			args[i] = strconv.Itoa(v)
		case int64:
			text = strings.ReplaceAll(text, "$"+n, "(%"+n+"$s)")
			args[i] = strconv.FormatInt(v, 10)
		case string:
			// run_command_on_* reads the text as a format too.
			text = strings.ReplaceAll(text, "$"+n, "%"+n+"$L")
			args[i] = strings.ReplaceAll(v, "%", "%%")
		default:
			panic(fmt.Sprintf("ledger: citusPerShard: parameter $%d is a %T", i, v))
		}
		formatArgs[i-1] = "$" + strconv.Itoa(i+1) + "::text"
	}
	// A data-modifying WITH must be at the top level: q's own CTEs go
	// before done.
	ctes, main := splitWith(text)
	args[0] = "WITH " + ctes + "done AS (" + main + ") SELECT coalesce(json_agg(done), '[]') FROM done"
	return query{sql: `SELECT (SELECT value FROM json_each_text(e) LIMIT 1), CASE WHEN NOT r.success THEN r.result END
FROM ` + fn + `format($1::text, ` + strings.Join(formatArgs, ", ") + `)) r
LEFT JOIN LATERAL json_array_elements(CASE WHEN r.success THEN r.result::json END) e ON true
WHERE NOT r.success OR e IS NOT NULL`, args: args}
}

// splitWith splits a statement into its WITH list, each CTE followed by a
// comma (empty without WITH), and the statement that follows it.
func splitWith(sql string) (ctes, main string) {
	if !strings.HasPrefix(sql, "WITH ") {
		return "", sql
	}
	depth, quoted := 0, false
	for i, c := range sql {
		switch {
		case c == '\'':
			quoted = !quoted
		case quoted:
		case c == '(':
			depth++
		case c == ')':
			depth--
			if depth == 0 {
				rest := strings.TrimLeft(sql[i+1:], " \t\n")
				if !strings.HasPrefix(rest, ",") {
					return strings.TrimPrefix(sql[:i+1], "WITH ") + ",\n", rest
				}
			}
		}
	}
	return "", sql
}

// legacyRows reads the next limit legacy rows after after (from the start
// when nil), in key order, with lock appended (a locking clause, or
// nothing).
func legacyRows(after *Identity, limit int, lock string) query {
	args := []any{limit}
	where := legacyRowSQL
	if after != nil {
		where += ` AND (tenant, scope, key) > ($2, $3, $4)`
		args = append(args, after.Tenant, after.Scope, after.Key)
	}
	return query{sql: `SELECT tenant, scope, key, ` + fullColumns + ` FROM idempotency_records
				WHERE ` + where + ` ORDER BY tenant, scope, key LIMIT $1` + lock, args: args}
}
