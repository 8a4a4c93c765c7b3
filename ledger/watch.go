package ledger

import "context"

// watchSQL marks an IN_PROGRESS record as waited for; $1-$3 identity.
var watchSQL = stateSQL(`UPDATE idempotency_records SET watched = true
	WHERE tenant = $1 AND scope = $2 AND key = $3 AND state = {IN_PROGRESS}`)

// watch marks the record id as waited for, so that the change that ends its
// current attempt is notified (see subscribe): only changes a waiter or a
// replay cache can care about are. A Begin that will wait for a held record
// calls subscribe, then watch, then reads the record again. watch reports
// whether the record is IN_PROGRESS; when it is not, nothing was marked and
// the caller should read the record again instead of waiting.
func (s *Store) watch(ctx context.Context, id Identity) (held bool, err error) {
	tag, err := s.pool.Exec(ctx, watchSQL, id.Tenant, id.Scope, id.Key)
	if err != nil {
		return false, classify(err)
	}
	return tag.RowsAffected() == 1, nil
}
