package ledger

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// notifyChannel is the channel the records trigger notifies on.
const notifyChannel = "idemcoord_records"

// notifier keeps one dedicated connection LISTENing on notifyChannel and
// wakes the subscribers of the record each notification names. It starts
// with the first subscription and reconnects by itself; after a reconnect it
// wakes every subscriber, since notifications may have been missed.
type notifier struct {
	connConfig *pgx.ConnConfig
	logger     *slog.Logger

	// onPayload, if set, sees every notification; onConnect runs each
	// time the listener (re)connects, before waking subscribers.
	onPayload func(string)
	onConnect func()

	mu        sync.Mutex
	subs      map[string]map[*subscription]struct{}
	connected bool
	started   bool
	cancel    context.CancelFunc
	done      chan struct{}
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
	return &notifier{connConfig: cfg, logger: logger, subs: map[string]map[*subscription]struct{}{}}
}

// recordHash is the payload the trigger sends for a record: md5 of tenant,
// scope and key joined by U+001F, which printable names never contain.
func recordHash(id Identity) string {
	sum := md5.Sum([]byte(id.Tenant + "\x1f" + id.Scope + "\x1f" + id.Key))
	return hex.EncodeToString(sum[:])
}

// Subscribe returns a channel that receives a value after every committed
// change of the record id (and whenever the listener (re)connects, or at
// once if it is connected), and a function that ends the subscription. Subscribe before reading the record,
// so no change between the read and the wait is missed.
func (s *Store) Subscribe(id Identity) (<-chan struct{}, func()) {
	if s.notifier == nil {
		return pollSubscription() // WithoutNotifications
	}
	return s.notifier.subscribe(recordHash(id))
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

func (n *notifier) setConnected(c bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.connected = c
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

func (n *notifier) run(ctx context.Context) {
	defer close(n.done)
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		err := n.listen(ctx)
		if ctx.Err() != nil {
			return
		}
		n.logger.Warn("change listener lost its connection; reconnecting", "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}

// listen connects, LISTENs and dispatches notifications until the
// connection fails or ctx ends.
func (n *notifier) listen(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, n.connConfig)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+notifyChannel); err != nil {
		return err
	}
	// Changes made while no connection listened were missed.
	if n.onConnect != nil {
		n.onConnect()
	}
	n.setConnected(true)
	defer n.setConnected(false)
	n.wakeAll()
	for {
		note, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.onPayload != nil {
			n.onPayload(note.Payload)
		}
		n.wake(note.Payload)
	}
}
