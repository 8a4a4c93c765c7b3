package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// The lean baseline: the table a user would write by hand (primary key
// only, no trigger, no other index) and the two autocommit statements of a
// pair, through one pgx pool with as many connections as callers: what a
// user would otherwise write, and the floor the coordinator is measured against.
const (
	leanTableSQL = `CREATE TABLE baseline_records (
  tenant text NOT NULL, scope text NOT NULL, key text NOT NULL, state smallint NOT NULL,
  fingerprint bytea, attempt int NOT NULL DEFAULT 1, generation int NOT NULL DEFAULT 1,
  lease_token text NOT NULL, lease_expires_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
  schema_version text, status_code int, body bytea,
  created_at timestamptz NOT NULL DEFAULT now(), updated_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant, scope, key))`

	// leanInsertSQL claims a new key. Parameters: $1 tenant, $2 scope, $3
	// key, $4 fingerprint, $5 lease token, $6 lease µs, $7 ttl µs.
	leanInsertSQL = `INSERT INTO baseline_records (tenant, scope, key, state, fingerprint, lease_token, lease_expires_at, expires_at)
VALUES ($1, $2, $3, 1, $4, $5, now() + $6 * interval '1 microsecond', now() + $7 * interval '1 microsecond')
ON CONFLICT DO NOTHING RETURNING state`

	// leanUpdateSQL stores the response, fenced by the lease token.
	// Parameters: $1 tenant, $2 scope, $3 key, $4 lease token, $5 schema
	// version, $6 status code, $7 body.
	leanUpdateSQL = `UPDATE baseline_records SET state = 2, schema_version = $5, status_code = $6, body = $7, updated_at = now()
WHERE tenant = $1 AND scope = $2 AND key = $3 AND lease_token = $4 AND state = 1`
)

// leanPair runs the two statements of one pair on the lean table.
func (e *environment) leanPair(ctx context.Context, _ int, r *rand.Rand, lat []time.Duration) error {
	key, token := newKey(r), newToken(r)
	t0 := time.Now()
	var state int16
	err := e.lean.QueryRow(ctx, leanInsertSQL, benchTenant, benchScope, key, e.payload.fingerprint, token,
		defaultLease.Microseconds(), defaultTTL.Microseconds()).Scan(&state)
	t1 := time.Now()
	if err != nil {
		return fmt.Errorf("insert: %w", err)
	}
	resp := e.payload.response
	tag, err := e.lean.Exec(ctx, leanUpdateSQL, benchTenant, benchScope, key, token,
		resp.GetSchemaVersion(), resp.GetStatusCode(), resp.GetBody())
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

// openPool opens a pool of exactly conns connections to the bench database,
// all connected before it returns, so no cell pays for connecting.
func (e *environment) openPool(ctx context.Context, conns int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.dbURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(conns)
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "on"
	cfg.ConnConfig.RuntimeParams["application_name"] = "idemcoord-bench"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	var wg sync.WaitGroup
	errs := make([]error, conns)
	held := make([]*pgxpool.Conn, conns)
	for i := range conns {
		wg.Go(func() { held[i], errs[i] = pool.Acquire(ctx) })
	}
	wg.Wait()
	for i, c := range held {
		if c != nil {
			c.Release()
		}
		if errs[i] != nil && err == nil {
			err = errs[i]
		}
	}
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("open %d connections: %w", conns, err)
	}
	return pool, nil
}

// withPool runs a cell of kind on a pool of conns connections set in *dst,
// closed afterwards (the server allows 300 connections; the lean pool at
// 256 callers and the coordinator's must fit together).
func (e *environment) withPool(ctx context.Context, dst **pgxpool.Pool, conns int, kind cellKind, concurrency int) (Cell, error) {
	pool, err := e.openPool(ctx, conns)
	if err != nil {
		return Cell{}, err
	}
	*dst = pool
	defer func() {
		pool.Close()
		*dst = nil
	}()
	return e.runCell(ctx, kind, concurrency, nil)
}
