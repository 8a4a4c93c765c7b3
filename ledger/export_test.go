package ledger

import (
	"context"
	"testing"
)

// WithNotifyQueueLimit sets the notification queue usage above which the
// store's writes stop notifying (idemcoord.notify_queue_limit), so tests
// reach it without filling PostgreSQL's 8 GB queue.
func WithNotifyQueueLimit(limit string) Option {
	return func(o *options) { o.notifyQueueLimit = limit }
}

// Subscribe lets the package's external tests wait for a record's change
// notifications as a waiting Begin does (see subscribe).
func (s *Store) Subscribe(id Identity) (<-chan struct{}, func()) { return s.subscribe(id) }

// Watch lets the package's external tests mark a record as waited for, as
// a waiting Begin does (see watch).
func (s *Store) Watch(ctx context.Context, id Identity) (held bool, err error) {
	return s.watch(ctx, id)
}

// SkipOnCitus skips a test that does not hold on Citus, saying why.
func SkipOnCitus(t testing.TB, s *Store, why string) {
	t.Helper()
	if s.dialect == citus {
		t.Skip("on Citus " + why)
	}
}

// SkipWithoutBatching skips a test of batched calls on a store that runs
// every Begin and Complete alone (on Citus).
func SkipWithoutBatching(t testing.TB, s *Store) {
	t.Helper()
	if s.writes == nil {
		t.Skip("this store does not batch (on Citus every Begin and Complete runs alone)")
	}
}

// SkipWithoutNotifications skips a test of change notifications or of the
// replay cache on a store that has none.
func SkipWithoutNotifications(t testing.TB, s *Store) {
	t.Helper()
	if s.cache == nil {
		t.Skip("the store has no change notifications and no replay cache")
	}
}
