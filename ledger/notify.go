package ledger

import (
	"context"
	"crypto/md5"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// notifyChannel is the channel the records trigger notifies on.
const notifyChannel = "idemcoord_records"

// Change notification tuning.
const (
	// pingEvery is how often a store sends a ping through the
	// notification channel: it measures its own listener's delay, and
	// carries the database's count of changes not notified.
	pingEvery = 200 * time.Millisecond
	// pingStaleAfter: when no own ping came back for this long, the
	// listener is taken to miss changes, and waiting Begins poll.
	pingStaleAfter = 2 * time.Second
	// listenerLagLimit: a listener whose own pings take longer than this
	// to come back while they are sent fine has fallen behind; it is
	// reconnected (which frees PostgreSQL's queue from its backlog).
	listenerLagLimit = 10 * time.Second
	// pollEvery is how often waiting Begins re-read while the listener
	// cannot be trusted.
	pollEvery = time.Second
	// pollHold is how long a store keeps polling after it saw changes go
	// un-notified.
	pollHold = 10 * time.Second
	// queueWarnAt is the notification queue usage that is logged as a
	// warning (at most every queueWarnEvery). The trigger stops notifying
	// at idemcoord.notify_queue_limit (default 0.5).
	queueWarnAt    = 0.1
	queueWarnEvery = time.Minute
)

// notifier keeps one dedicated connection LISTENing on notifyChannel and
// wakes the subscribers of the record each notification names. It
// reconnects by itself; after a reconnect it wakes every subscriber, since
// notifications may have been missed. While it cannot trust notifications
// (not connected, its pings do not come back, or the database reported
// changes it did not notify), it wakes every subscriber every pollEvery:
// waiting Begins poll.
type notifier struct {
	connConfig *pgx.ConnConfig
	logger     *slog.Logger
	nonce      string
	// noListen: no listening connection at all (WithoutNotifications);
	// notifications are never trusted, so subscribers poll.
	noListen bool

	// onPayload, if set, sees every record notification; onLost runs each
	// time notifications may have been missed (at every (re)connect, and
	// when changes went un-notified), before subscribers wake.
	onPayload func(string)
	onLost    func()

	// lastSeen is the send time (UnixNano, local clock) of the latest own
	// ping that came back; connectedAt when the listener last connected;
	// dropped the database's count of un-notified changes as last seen (-1
	// unknown); pollUntil the end of polling after un-notified changes.
	lastSeen, connectedAt, dropped, pollUntil atomic.Int64
	// usage is the notification queue usage (math.Float64bits) at the
	// latest ping; connects counts the listener's connections.
	usage    atomic.Uint64
	connects atomic.Int64

	mu         sync.Mutex
	subs       map[string]map[*subscription]struct{}
	connected  bool
	started    bool
	cancel     context.CancelFunc
	connCancel context.CancelFunc // ends the current listening connection
	done       chan struct{}
}

type subscription struct {
	ch chan struct{}
}

// notify wakes the subscriber unless a wake-up is already pending.
func (sub *subscription) notify() {
	select {
	case sub.ch <- struct{}{}:
	default:
	}
}

func newNotifier(cfg *pgx.ConnConfig, logger *slog.Logger) *notifier {
	var b [8]byte
	_, _ = rand.Read(b[:])
	n := &notifier{connConfig: cfg, logger: logger, subs: map[string]map[*subscription]struct{}{},
		nonce: hex.EncodeToString(b[:])}
	n.dropped.Store(-1)
	return n
}

// recordHash is the payload the trigger sends for a record: md5 of tenant,
// scope and key joined by U+001F, which printable names never contain.
func recordHash(id Identity) string {
	sum := md5.Sum([]byte(id.Tenant + "\x1f" + id.Scope + "\x1f" + id.Key))
	return hex.EncodeToString(sum[:])
}

// subscribe returns a channel that receives a value after every committed
// change of the record id that a waiting Begin cares about (its state, its
// holder, its expiry or its deletion; not a Heartbeat), whenever the
// listener (re)connects (or at once if it is connected), and every second
// while notifications cannot be trusted; and a function that ends the
// subscription. subscribe before reading the record, so no change between
// the read and the wait is missed.
func (s *Store) subscribe(id Identity) (<-chan struct{}, func()) {
	return s.notifier.subscribe(recordHash(id))
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
	return NotificationStats{QueueUsage: math.Float64frombits(s.notifier.usage.Load()),
		Dropped: s.notifier.dropped.Load(), Polling: s.notifier.polling()}
}

// polling reports whether notifications cannot be trusted now.
func (n *notifier) polling() bool {
	n.mu.Lock()
	connected := n.connected
	n.mu.Unlock()
	now := time.Now().UnixNano()
	seen := max(n.lastSeen.Load(), n.connectedAt.Load())
	return !connected || now < n.pollUntil.Load() || now-seen > int64(pingStaleAfter)
}

// fresh reports whether an own ping came back within d and notifications
// can be trusted: the replay cache is served only then.
func (n *notifier) fresh(d time.Duration) bool {
	return time.Since(time.Unix(0, n.lastSeen.Load())) < d && time.Now().UnixNano() >= n.pollUntil.Load()
}

// start starts the listener unless it runs already. Call with n.mu held.
func (n *notifier) startLocked() {
	if n.started {
		return
	}
	n.started = true
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	n.done = make(chan struct{})
	go n.run(ctx)
}

func (n *notifier) start() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.startLocked()
}

func (n *notifier) subscribe(h string) (<-chan struct{}, func()) {
	sub := &subscription{ch: make(chan struct{}, 1)}
	n.mu.Lock()
	n.startLocked()
	set := n.subs[h]
	if set == nil {
		set = map[*subscription]struct{}{}
		n.subs[h] = set
	}
	set[sub] = struct{}{}
	if n.connected {
		// Tell the new subscriber the listener is up, as a reconnect would.
		sub.notify()
	}
	n.mu.Unlock()
	return sub.ch, func() {
		n.mu.Lock()
		delete(set, sub)
		if len(set) == 0 && n.subs[h] != nil && len(n.subs[h]) == 0 {
			delete(n.subs, h)
		}
		n.mu.Unlock()
	}
}

func (n *notifier) close() {
	n.mu.Lock()
	started, cancel, done := n.started, n.cancel, n.done
	n.mu.Unlock()
	if started {
		cancel()
		<-done
	}
}

func (n *notifier) wake(h string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for sub := range n.subs[h] {
		sub.notify()
	}
}

func (n *notifier) wakeAll() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, set := range n.subs {
		for sub := range set {
			sub.notify()
		}
	}
}

// reconnect ends the current listening connection; run connects again.
func (n *notifier) reconnect() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.connCancel != nil {
		n.connCancel()
	}
}

func (n *notifier) run(ctx context.Context) {
	polled := make(chan struct{})
	defer func() {
		<-polled
		close(n.done)
	}()
	go func() {
		defer close(polled)
		n.pollLoop(ctx)
	}()
	if n.noListen {
		<-ctx.Done()
		return
	}
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		err := n.listen(ctx)
		if ctx.Err() != nil {
			return
		}
		n.logger.Warn("change listener lost its connection; reconnecting (waiting Begins poll meanwhile)", "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}

// pollLoop wakes every subscriber every pollEvery while notifications
// cannot be trusted.
func (n *notifier) pollLoop(ctx context.Context) {
	t := time.NewTicker(pollEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if n.polling() {
			n.wakeAll()
		}
	}
}

// listen connects, LISTENs and dispatches notifications until the
// connection fails or ctx ends.
func (n *notifier) listen(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	n.mu.Lock()
	n.connCancel = cancel
	n.mu.Unlock()
	conn, err := pgx.ConnectConfig(ctx, n.connConfig)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+notifyChannel); err != nil {
		return err
	}
	// Changes not notified from here on raise the count past this.
	var dropped int64
	if err := conn.QueryRow(ctx, `SELECT dropped FROM idemcoord_notify_drops`).Scan(&dropped); err != nil {
		return err
	}
	n.dropped.Store(dropped)
	// Changes made while no connection listened were missed.
	if n.onLost != nil {
		n.onLost()
	}
	n.connectedAt.Store(time.Now().UnixNano())
	n.connects.Add(1)
	n.setConnected(true)
	defer n.setConnected(false)
	n.wakeAll()
	for {
		note, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if rest, ok := strings.CutPrefix(note.Payload, "ping:"); ok {
			n.pinged(rest)
			continue
		}
		if n.onPayload != nil {
			n.onPayload(note.Payload)
		}
		n.wake(note.Payload)
	}
}

func (n *notifier) setConnected(c bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.connected = c
}

// pingPayload is the payload of a ping sent at t, without the drop count
// the ping statement appends.
func (n *notifier) pingPayload(t time.Time) string {
	return "ping:" + n.nonce + ":" + strconv.FormatInt(t.UnixNano(), 10) + ":"
}

// pinged handles a ping (the payload after "ping:"), of any replica: its
// drop count tells whether changes went un-notified since the last one;
// an own ping also records the listener's delay.
func (n *notifier) pinged(rest string) {
	parts := strings.Split(rest, ":")
	if len(parts) != 3 {
		return
	}
	if d, err := strconv.ParseInt(parts[2], 10, 64); err == nil {
		if prev := n.dropped.Swap(d); prev >= 0 && d != prev {
			n.pollUntil.Store(time.Now().Add(pollHold).UnixNano())
			n.logger.Warn("changes were not notified (the notification queue was over its limit): "+
				"replay cache dropped, waiting Begins poll", "not_notified", d-prev, "poll_for", pollHold)
			if n.onLost != nil {
				n.onLost()
			}
			n.wakeAll()
		}
	}
	if parts[0] != n.nonce {
		return
	}
	if ns, err := strconv.ParseInt(parts[1], 10, 64); err == nil && ns > n.lastSeen.Load() {
		n.lastSeen.Store(ns)
	}
}

// pingSQL sends a ping whose payload ends with the database's count of
// un-notified changes, and returns the queue usage.
const pingSQL = `SELECT pg_notify($1, $2 || d.dropped), pg_notification_queue_usage() FROM idemcoord_notify_drops d`

// pingLoop sends a ping every pingEvery until ctx ends, watches the
// notification queue's usage, and reconnects a listener that fell behind.
func (s *Store) pingLoop(ctx context.Context) {
	n := s.notifier
	t := time.NewTicker(pingEvery)
	defer t.Stop()
	var warned time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		sent := time.Now()
		pctx, cancel := context.WithTimeout(ctx, pingStaleAfter)
		var ignored string
		var usage float64
		err := s.pool.QueryRow(pctx, pingSQL, notifyChannel, n.pingPayload(sent)).Scan(&ignored, &usage)
		if err != nil {
			// A full queue refuses the ping's notification; read the usage
			// on its own.
			err = s.pool.QueryRow(pctx, `SELECT pg_notification_queue_usage()`).Scan(&usage)
		}
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				s.logger.Debug("notification ping failed", "err", err)
			}
			continue
		}
		n.usage.Store(math.Float64bits(usage))
		if usage >= queueWarnAt && time.Since(warned) >= queueWarnEvery {
			warned = time.Now()
			s.logger.Warn("PostgreSQL's notification queue is filling: a listening connection is not reading "+
				"(a stalled replica?); past idemcoord.notify_queue_limit (default 50%) changes are no longer notified "+
				"and every replica polls", "usage", usage)
		}
		n.checkLag(sent)
	}
}

// checkLag reconnects the listener when the own pings sent up to sent (the
// latest sent fine) have not come back for listenerLagLimit: it has fallen
// behind, and holds PostgreSQL's queue back for every replica. Until the
// new connection is up, the replay cache is not served and waiting Begins
// poll; the reconnect drops the cache (onLost).
func (n *notifier) checkLag(sent time.Time) {
	seen := max(n.lastSeen.Load(), n.connectedAt.Load())
	if lag := sent.Sub(time.Unix(0, seen)); seen > 0 && lag > listenerLagLimit {
		n.logger.Warn("change listener fell behind; reconnecting it (replay cache dropped, waiting Begins poll)", "lag", lag)
		n.pollUntil.Store(time.Now().Add(pollHold).UnixNano())
		n.connectedAt.Store(time.Now().UnixNano()) // one reconnect per lag limit
		n.reconnect()
	}
}
