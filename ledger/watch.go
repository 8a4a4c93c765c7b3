package ledger

import "context"

// watch marks the record id as waited for, so that the change that ends its
// current attempt is notified (see subscribe): only changes a waiter or a
// replay cache can care about are. A Begin that will wait for a held record
// calls subscribe, then watch, then reads the record again. watch reports
// whether the record is IN_PROGRESS; when it is not, nothing was marked and
// the caller should read the record again instead of waiting.
func (s *Store) watch(ctx context.Context, id Identity) (held bool, err error) {
	q := s.sql.watch(id)
	tag, err := s.pool.Exec(ctx, q.sql, q.args...)
	if err != nil {
		return false, classify(err)
	}
	return tag.RowsAffected() == 1, nil
}
