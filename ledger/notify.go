package ledger

import (
	"github.com/idemcoord/idemcoord/ledger/internal/notifier"
)

// recordHash names the record id as its change notifications do.
func recordHash(id Identity) string { return notifier.RecordHash(id.Tenant, id.Scope, id.Key) }

// subscribe returns a channel that receives a value after every committed
// change of the record id that a waiting Begin cares about (its state, its
// holder, its expiry or its deletion; not a Heartbeat), whenever the
// listener (re)connects (or at once if it is connected), and every second
// while notifications cannot be trusted; and a function that ends the
// subscription. subscribe before reading the record, so no change between
// the read and the wait is missed.
func (s *Store) subscribe(id Identity) (<-chan struct{}, func()) {
	return s.notifier.Subscribe(recordHash(id))
}

// NotificationStats describe the change notifications of a Store.
type NotificationStats struct {
	// QueueUsage is PostgreSQL's pg_notification_queue_usage() at the
	// latest ping: the fraction of the notification queue that holds
	// notifications some listener has not read yet.
	QueueUsage float64
	// Dropped is the database's count of changes that were not notified
	// because the queue was over its limit (as of the latest ping; -1
	// before the first).
	Dropped int64
	// Polling reports that this store does not trust notifications right
	// now, so waiting Begins re-read every second and the replay cache is
	// not served.
	Polling bool
}

// NotificationStats reports the state of change notifications.
func (s *Store) NotificationStats() NotificationStats {
	st := s.notifier.Stats()
	return NotificationStats{QueueUsage: st.QueueUsage, Dropped: st.Dropped, Polling: st.Polling}
}
