package notifier

import (
	"context"
	"crypto/md5" //nolint:gosec // md5 names a record in LISTEN payloads (a non-cryptographic hash the SQL trigger computes too)
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

// Channel is the channel the records trigger notifies on.
const Channel = "idemcoord_records"

// RecordHash is the payload the trigger sends for the record (tenant,
// scope, key): md5 of the three joined by U+001F, which printable names
// never contain. Subscribers and the replay cache name records by it.
func RecordHash(tenant, scope, key string) string {
	sum := md5.Sum([]byte(tenant + "\x1f" + scope + "\x1f" + key)) //nolint:gosec // md5 names a record in LISTEN payloads (a non-cryptographic hash the SQL trigger computes too)
	return hex.EncodeToString(sum[:])
}

// Querier runs the pings' statements: a connection pool over the
// records' database.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Statements are the statements a Notifier runs, which its user writes
// for its database.
type Statements struct {
	// Listen starts listening on Channel.
	Listen string
	// Dropped reads the database's count of changes not notified: one
	// int8.
	Dropped string
	// Ping sends $2 followed by that count as a notification on channel
	// $1, and reads the notification queue's usage: (any, float8).
	Ping string
	// QueueUsage reads the notification queue's usage: one float8.
	QueueUsage string
}

// Config is what a Notifier listens with and whom it tells.
type Config struct {
	// Statements are what it runs.
	Statements Statements
	// ConnConfig is the listening connection's configuration.
	ConnConfig *pgx.ConnConfig
	// Pings runs the pings; nil with NoListen.
	Pings Querier
	// Logger receives the listener's warnings.
	Logger *slog.Logger
	// NoListen: no listening connection and no pings at all;
	// notifications are never trusted, so subscribers poll.
	NoListen bool
	// OnPayload, if set, sees every record notification; OnLost runs each
	// time notifications may have been missed (at every (re)connect, and
	// when changes went un-notified), before subscribers wake.
	OnPayload func(string)
	OnLost    func()
}

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

// Notifier keeps one dedicated connection LISTENing on Channel and wakes
// the subscribers of the record each notification names. It reconnects by
// itself; after a reconnect it wakes every subscriber, since notifications
// may have been missed. While it cannot trust notifications (not
// connected, its pings do not come back, or the database reported changes
// it did not notify), it wakes every subscriber every pollEvery: waiting
// Begins poll. It is safe for concurrent use.
type Notifier struct {
	cfg   Config
	nonce string

	// lastSeen is the send time (UnixNano, local clock) of the latest own
	// ping that came back; connectedAt when the listener last connected;
	// dropped the database's count of un-notified changes as last seen (-1
	// unknown); pollUntil the end of polling after un-notified changes.
	lastSeen, connectedAt, dropped, pollUntil atomic.Int64
	// usage is the notification queue usage (math.Float64bits) at the
	// latest ping; connects counts the listener's connections.
	usage    atomic.Uint64
	connects atomic.Int64

	// stopPing ends the ping loop, which closes pingDone.
	stopPing context.CancelFunc
	pingDone chan struct{}

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

// New returns a Notifier that is not started yet (see Start).
func New(cfg Config) *Notifier {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	n := &Notifier{cfg: cfg, subs: map[string]map[*subscription]struct{}{},
		nonce: hex.EncodeToString(b[:])}
	n.dropped.Store(-1)
	return n
}

// Stats is the state of change notifications.
type Stats struct {
	// QueueUsage is PostgreSQL's pg_notification_queue_usage() at the
	// latest ping.
	QueueUsage float64
	// Dropped is the database's count of changes that were not notified
	// (as of the latest ping; -1 before the first).
	Dropped int64
	// Polling reports that notifications cannot be trusted now.
	Polling bool
}

// Stats reports the state of change notifications.
func (n *Notifier) Stats() Stats {
	return Stats{QueueUsage: math.Float64frombits(n.usage.Load()), Dropped: n.dropped.Load(), Polling: n.Polling()}
}

// Polling reports whether notifications cannot be trusted now.
func (n *Notifier) Polling() bool {
	n.mu.Lock()
	connected := n.connected
	n.mu.Unlock()
	now := time.Now().UnixNano()
	seen := max(n.lastSeen.Load(), n.connectedAt.Load())
	return !connected || now < n.pollUntil.Load() || now-seen > int64(pingStaleAfter)
}

// Fresh reports whether an own ping came back within d and notifications
// can be trusted: the replay cache is served only then.
func (n *Notifier) Fresh(d time.Duration) bool {
	return time.Since(time.Unix(0, n.lastSeen.Load())) < d && time.Now().UnixNano() >= n.pollUntil.Load()
}

// startLocked starts the listener unless it runs already. Call with n.mu
// held.
func (n *Notifier) startLocked() {
	if n.started {
		return
	}
	n.started = true
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	n.done = make(chan struct{})
	go n.run(ctx)
}

// Start starts the listener and its pings, which measure the listener's
// delay and carry the database's count of changes not notified. Call it
// once, before Subscribe.
func (n *Notifier) Start() {
	n.mu.Lock()
	n.startLocked()
	n.mu.Unlock()
	pctx, cancel := context.WithCancel(context.Background())
	n.stopPing, n.pingDone = cancel, make(chan struct{})
	go func() {
		defer close(n.pingDone)
		if !n.cfg.NoListen {
			n.pingLoop(pctx)
		}
	}()
}

// Subscribe returns a channel that receives a value after every
// notification of the record whose RecordHash is h, whenever the listener
// (re)connects (or at once if it is connected), and every pollEvery while
// notifications cannot be trusted; and a function that ends the
// subscription.
func (n *Notifier) Subscribe(h string) (<-chan struct{}, func()) {
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

// Close stops the pings and the listener.
func (n *Notifier) Close() {
	if n.stopPing != nil {
		n.stopPing()
		<-n.pingDone
	}
	n.mu.Lock()
	started, cancel, done := n.started, n.cancel, n.done
	n.mu.Unlock()
	if started {
		cancel()
		<-done
	}
}

func (n *Notifier) wake(h string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for sub := range n.subs[h] {
		sub.notify()
	}
}

func (n *Notifier) wakeAll() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, set := range n.subs {
		for sub := range set {
			sub.notify()
		}
	}
}

// reconnect ends the current listening connection; run connects again.
func (n *Notifier) reconnect() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.connCancel != nil {
		n.connCancel()
	}
}

func (n *Notifier) run(ctx context.Context) {
	polled := make(chan struct{})
	defer func() {
		<-polled
		close(n.done)
	}()
	go func() {
		defer close(polled)
		n.pollLoop(ctx)
	}()
	if n.cfg.NoListen {
		<-ctx.Done()
		return
	}
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		err := n.listen(ctx)
		if ctx.Err() != nil {
			return
		}
		n.cfg.Logger.Warn("change listener lost its connection; reconnecting (waiting Begins poll meanwhile)", "err", err, "in", backoff)
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
func (n *Notifier) pollLoop(ctx context.Context) {
	t := time.NewTicker(pollEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if n.Polling() {
			n.wakeAll()
		}
	}
}

// listen connects, LISTENs and dispatches notifications until the
// connection fails or ctx ends.
func (n *Notifier) listen(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	n.mu.Lock()
	n.connCancel = cancel
	n.mu.Unlock()
	conn, err := pgx.ConnectConfig(ctx, n.cfg.ConnConfig)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, n.cfg.Statements.Listen); err != nil {
		return err
	}
	// Changes not notified from here on raise the count past this.
	var dropped int64
	if err := conn.QueryRow(ctx, n.cfg.Statements.Dropped).Scan(&dropped); err != nil {
		return err
	}
	n.dropped.Store(dropped)
	// Changes made while no connection listened were missed.
	if n.cfg.OnLost != nil {
		n.cfg.OnLost()
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
		if n.cfg.OnPayload != nil {
			n.cfg.OnPayload(note.Payload)
		}
		n.wake(note.Payload)
	}
}

func (n *Notifier) setConnected(c bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.connected = c
}

// pingPayload is the payload of a ping sent at t, without the drop count
// the ping statement appends.
func (n *Notifier) pingPayload(t time.Time) string {
	return "ping:" + n.nonce + ":" + strconv.FormatInt(t.UnixNano(), 10) + ":"
}

// pinged handles a ping (the payload after "ping:"), of any replica: its
// drop count tells whether changes went un-notified since the last one;
// an own ping also records the listener's delay.
func (n *Notifier) pinged(rest string) {
	parts := strings.Split(rest, ":")
	if len(parts) != 3 {
		return
	}
	if d, err := strconv.ParseInt(parts[2], 10, 64); err == nil {
		if prev := n.dropped.Swap(d); prev >= 0 && d != prev {
			n.pollUntil.Store(time.Now().Add(pollHold).UnixNano())
			n.cfg.Logger.Warn("changes were not notified (the notification queue was over its limit): "+
				"replay cache dropped, waiting Begins poll", "not_notified", d-prev, "poll_for", pollHold)
			if n.cfg.OnLost != nil {
				n.cfg.OnLost()
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

// pingLoop sends a ping every pingEvery until ctx ends, watches the
// notification queue's usage, and reconnects a listener that fell behind.
func (n *Notifier) pingLoop(ctx context.Context) {
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
		err := n.cfg.Pings.QueryRow(pctx, n.cfg.Statements.Ping, Channel, n.pingPayload(sent)).Scan(&ignored, &usage)
		if err != nil {
			// A full queue refuses the ping's notification; read the usage
			// on its own.
			err = n.cfg.Pings.QueryRow(pctx, n.cfg.Statements.QueueUsage).Scan(&usage)
		}
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				n.cfg.Logger.Debug("notification ping failed", "err", err)
			}
			continue
		}
		n.usage.Store(math.Float64bits(usage))
		if usage >= queueWarnAt && time.Since(warned) >= queueWarnEvery {
			warned = time.Now()
			n.cfg.Logger.Warn("PostgreSQL's notification queue is filling: a listening connection is not reading "+
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
// poll; the reconnect runs OnLost.
func (n *Notifier) checkLag(sent time.Time) {
	seen := max(n.lastSeen.Load(), n.connectedAt.Load())
	if lag := sent.Sub(time.Unix(0, seen)); seen > 0 && lag > listenerLagLimit {
		n.cfg.Logger.Warn("change listener fell behind; reconnecting it (replay cache dropped, waiting Begins poll)", "lag", lag)
		n.pollUntil.Store(time.Now().Add(pollHold).UnixNano())
		n.connectedAt.Store(time.Now().UnixNano()) // one reconnect per lag limit
		n.reconnect()
	}
}
