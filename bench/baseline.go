package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"
)

// The baseline: the two durable writes of a pair issued straight to
// PostgreSQL, each its own autocommit statement, on the same migrated
// table (its trigger included). It stores what the coordinator stores for
// a pair; it skips what only the coordinator does (the state machine,
// validation, gRPC), which is the point of the comparison.
const (
	// baselineInsertSQL claims a new key as Begin does. Parameters: $1
	// tenant, $2 scope, $3 key, $4 fingerprint, $5 lease token, $6 ttl µs,
	// $7 failure ttl µs, $8 lease µs.
	baselineInsertSQL = `INSERT INTO idempotency_records (tenant, scope, key, state, fingerprint,
	attempt, generation, lease_token, ttl_us, failure_ttl_us, created_at, updated_at, lease_expires_at)
VALUES ($1, $2, $3, 1, $4, 1, 1, $5, $6, $7, now(), now(), now() + $8 * interval '1 microsecond')
ON CONFLICT DO NOTHING
RETURNING state, attempt, generation, lease_token, created_at, lease_expires_at`

	// baselineUpdateSQL completes it with the response, fenced by the lease
	// token as Complete is. Parameters: $1 tenant, $2 scope, $3 key, $4
	// lease token, $5 schema version, $6 content type, $7 status code, $8
	// body.
	baselineUpdateSQL = `UPDATE idempotency_records SET state = 2, ended_by = 5, has_response = true,
	schema_version = $5, content_type = $6, status_code = $7, body = $8, updated_at = now(),
	lease_expires_at = NULL, expires_at = now() + ttl_us * interval '1 microsecond'
WHERE tenant = $1 AND scope = $2 AND key = $3 AND lease_token = $4 AND state = 1`
)

// The coordinator's defaults, which the pairs through gRPC get.
const (
	defaultTTL        = 24 * time.Hour
	defaultFailureTTL = time.Hour
	defaultLease      = 30 * time.Second
	benchTenant       = "default"
)

// baselinePair runs the two statements of one pair.
func (e *environment) baselinePair(ctx context.Context, _ int, r *rand.Rand, lat []time.Duration) error {
	key, token := newKey(r), newToken(r)
	t0 := time.Now()
	var (
		state, attempt, generation int32
		gotToken                   string
		created, leaseExpires      time.Time
	)
	err := e.baseline.QueryRow(ctx, baselineInsertSQL, benchTenant, benchScope, key, e.payload.fingerprint, token,
		defaultTTL.Microseconds(), defaultFailureTTL.Microseconds(), defaultLease.Microseconds()).
		Scan(&state, &attempt, &generation, &gotToken, &created, &leaseExpires)
	t1 := time.Now()
	if err != nil {
		return fmt.Errorf("insert: %w", err)
	}
	resp := e.payload.response
	tag, err := e.baseline.Exec(ctx, baselineUpdateSQL, benchTenant, benchScope, key, gotToken,
		resp.GetSchemaVersion(), resp.GetContentType(), resp.GetStatusCode(), resp.GetBody())
	t2 := time.Now()
	if err != nil {
		return fmt.Errorf("update: %w", err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("update changed %d rows", tag.RowsAffected())
	}
	lat[0], lat[1] = t1.Sub(t0), t2.Sub(t1)
	return nil
}
