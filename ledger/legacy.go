package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/statemachine"
)

// CountLegacyRows counts the records not in the current sealed form: in
// clear (written while encryption was off) or sealed by a version before
// seal_version 2. With a keyring that does not accept legacy rows, each of
// them reads ErrUnreadable. It scans the whole table.
func (s *Store) CountLegacyRows(ctx context.Context) (int64, error) {
	var n int64
	q := s.sql.countLegacy()
	err := s.pool.QueryRow(ctx, q.sql, q.args...).Scan(&n)
	return n, classify(err)
}

// ConvertLegacyRows rewrites every legacy record (see CountLegacyRows) in
// the current form: sensitive columns sealed with the active key and bound
// to the record, fingerprint keyed. It needs a keyring that accepts legacy
// rows (Keyring.AcceptingLegacyRows). It walks the table once in primary
// key order, batchSize rows per transaction, each row under its lock
// (rows another transaction holds are left for a later pass); rows that do
// not open even in the legacy form are left as they are and counted in
// skipped. Replicas may run it at the same time.
func (s *Store) ConvertLegacyRows(ctx context.Context, batchSize int) (converted, skipped int, err error) {
	if !s.keyring.AcceptsLegacyRows() {
		return 0, 0, errors.New("ledger: converting legacy rows needs a keyring that accepts them")
	}
	if batchSize <= 0 {
		batchSize = 500
	}
	var after *Identity
	for {
		var n, sk int
		var last *Identity
		err := withTx(ctx, s.pool, func(tx pgx.Tx) error {
			q := s.sql.legacyBatch(after, batchSize)
			rows, err := tx.Query(ctx, q.sql, q.args...)
			if err != nil {
				return err
			}
			type row struct {
				id  Identity
				rec statemachine.Record
				err error
			}
			var batch []row
			for rows.Next() {
				var r row
				dest, fin := s.scanFullTargets(&r.rec, &r.id)
				if err := rows.Scan(append([]any{&r.id.Tenant, &r.id.Scope, &r.id.Key}, dest...)...); err != nil {
					rows.Close()
					return err
				}
				r.err = fin()
				batch = append(batch, r)
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return err
			}
			for _, r := range batch {
				id := r.id
				last = &id
				if lq := s.sql.legacyLock(id); lq.sql != "" {
					locked := false
					err := func() error {
						rows, err := tx.Query(ctx, lq.sql, lq.args...)
						if err != nil {
							return err
						}
						defer rows.Close()
						if !rows.Next() {
							return rows.Err()
						}
						dest, fin := s.scanFullTargets(&r.rec, &r.id)
						if err := rows.Scan(append([]any{&r.id.Tenant, &r.id.Scope, &r.id.Key}, dest...)...); err != nil {
							return err
						}
						r.err, locked = fin(), true
						rows.Close()
						return rows.Err()
					}()
					if err != nil {
						return err
					}
					if !locked {
						continue // held by another transaction, or converted meanwhile
					}
				}
				if r.err != nil {
					s.logger.Warn("legacy record does not open; left as it is", "tenant", id.Tenant, "scope", id.Scope, "err", r.err)
					sk++
					continue
				}
				cols, err := s.recordArgs(id, r.rec)
				if err != nil {
					return err
				}
				q := s.sql.update(id, cols)
				if _, err := tx.Exec(ctx, q.sql, q.args...); err != nil {
					return err
				}
				n++
			}
			return nil
		})
		if err != nil {
			return converted, skipped, fmt.Errorf("ledger: converting legacy rows: %w", classify(err))
		}
		converted, skipped = converted+n, skipped+sk
		if last == nil {
			return converted, skipped, nil
		}
		after = last
	}
}
