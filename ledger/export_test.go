package ledger

// WithNotifyQueueLimit sets the notification queue usage above which the
// store's writes stop notifying (idemcoord.notify_queue_limit), so tests
// reach it without filling PostgreSQL's 8 GB queue.
func WithNotifyQueueLimit(limit string) Option {
	return func(o *options) { o.notifyQueueLimit = limit }
}
