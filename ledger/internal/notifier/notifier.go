package notifier

import (
	"context"
	"crypto/md5" //nolint:gosec // md5 names a record in LISTEN payloads (a non-cryptographic hash the SQL trigger computes too)
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"math"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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
	// Prepare, when not empty, runs on each other node (Config.Nodes)
	// before its LISTEN: it creates there what Dropped and Ping read.
	Prepare string
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
	// Nodes, when set, lists the other database nodes on which record
	// changes notify (a Citus cluster's workers), as connection
	// configurations. The Notifier listens and pings on each as on
	// ConnConfig, each with its own trust: notifications are trusted
	// only while they are on every node. It calls Nodes every
	// nodesEvery, follows nodes added and removed, and does not trust
	// notifications while the latest call failed or is older than the
	// freshness asked of Fresh.
	Nodes func(ctx context.Context) ([]*pgx.ConnConfig, error)
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
	// nodesEvery is how often Config.Nodes is called.
	nodesEvery = pingEvery
)

// Notifier keeps one dedicated connection LISTENing on Channel on each
// node (the database of ConnConfig, and those Config.Nodes lists) and wakes
// the subscribers of the record each notification names. It reconnects by
// itself; after a reconnect it wakes every subscriber, since notifications
// may have been missed. While it cannot trust notifications (a node's
// listener is not connected, its pings do not come back, or the node
// reported changes it did not notify), it wakes every subscriber every
// pollEvery: waiting Begins poll. It is safe for concurrent use.
type Notifier struct {
	cfg   Config
	nonce string
	// main is the node of ConnConfig, pinged through Pings.
	main *node
	// nodesRead is when Config.Nodes last answered (UnixNano; 0 never, or
	// after a failure).
	nodesRead atomic.Int64

	// stopPing ends the ping loop, which closes pingDone.
	stopPing context.CancelFunc
	pingDone chan struct{}

	mu      sync.Mutex
	subs    map[string]map[*subscription]struct{}
	others  map[string]*node // by host:port/database, from Config.Nodes
	started bool
	cancel  context.CancelFunc
	done    chan struct{}
	wg      sync.WaitGroup // the other nodes' goroutines
}

// node is one database's listener and its trust.
type node struct {
	n     *Notifier
	name  string
	conn  *pgx.ConnConfig
	pings Querier
	// prepare is Statements.Prepare for the other nodes, "" for main.
	prepare string
	// closePings closes the other nodes' ping pool.
	closePings func()
	// stop ends an other node's listener and pings.
	stop context.CancelFunc

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
	connected  bool
	connCancel context.CancelFunc // ends the current listening connection
}

func (n *Notifier) newNode(name string, conn *pgx.ConnConfig, pings Querier, prepare string) *node {
	nd := &node{n: n, name: name, conn: conn, pings: pings, prepare: prepare}
	nd.dropped.Store(-1)
	return nd
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
		nonce: hex.EncodeToString(b[:]), others: map[string]*node{}}
	n.main = n.newNode("", cfg.ConnConfig, cfg.Pings, "")
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

// Stats reports the state of change notifications: the highest queue
// usage and the sum of the drop counts over the nodes (-1 while one is
// unknown).
func (n *Notifier) Stats() Stats {
	st := Stats{Polling: n.Polling()}
	for _, nd := range n.nodes() {
		st.QueueUsage = max(st.QueueUsage, math.Float64frombits(nd.usage.Load()))
		d := nd.dropped.Load()
		if d < 0 || st.Dropped < 0 {
			st.Dropped = -1
		} else {
			st.Dropped += d
		}
	}
	return st
}

// nodes returns main and the other nodes.
func (n *Notifier) nodes() []*node {
	n.mu.Lock()
	defer n.mu.Unlock()
	nodes := []*node{n.main}
	for _, nd := range n.others {
		nodes = append(nodes, nd)
	}
	return nodes
}

// Polling reports whether notifications cannot be trusted now: on some
// node, or because the list of nodes is not known.
func (n *Notifier) Polling() bool {
	if n.cfg.Nodes != nil && time.Now().UnixNano()-n.nodesRead.Load() > int64(pingStaleAfter) {
		return true
	}
	for _, nd := range n.nodes() {
		if nd.polling() {
			return true
		}
	}
	return false
}

func (nd *node) polling() bool {
	nd.mu.Lock()
	connected := nd.connected
	nd.mu.Unlock()
	now := time.Now().UnixNano()
	seen := max(nd.lastSeen.Load(), nd.connectedAt.Load())
	return !connected || now < nd.pollUntil.Load() || now-seen > int64(pingStaleAfter)
}

// Fresh reports whether, on every node, an own ping came back within d
// and notifications can be trusted (and, with Config.Nodes, the list of
// nodes was read within d): the replay cache is served only then.
func (n *Notifier) Fresh(d time.Duration) bool {
	if n.cfg.Nodes != nil && time.Since(time.Unix(0, n.nodesRead.Load())) >= d {
		return false
	}
	for _, nd := range n.nodes() {
		if !nd.fresh(d) {
			return false
		}
	}
	return true
}

func (nd *node) fresh(d time.Duration) bool {
	return time.Since(time.Unix(0, nd.lastSeen.Load())) < d && time.Now().UnixNano() >= nd.pollUntil.Load()
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
			n.main.pingLoop(pctx)
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
	n.mu.Unlock()
	if n.main.isConnected() {
		// Tell the new subscriber the listener is up, as a reconnect would.
		sub.notify()
	}
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
	n.wg.Wait()
	n.mu.Lock()
	defer n.mu.Unlock()
	for name, nd := range n.others {
		nd.closePings()
		delete(n.others, name)
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

// reconnect ends the current listening connection; the listen loop
// connects again.
func (nd *node) reconnect() {
	nd.mu.Lock()
	defer nd.mu.Unlock()
	if nd.connCancel != nil {
		nd.connCancel()
	}
}

func (nd *node) isConnected() bool {
	nd.mu.Lock()
	defer nd.mu.Unlock()
	return nd.connected
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
	if n.cfg.Nodes != nil {
		n.wg.Go(func() { n.nodesLoop(ctx) })
	}
	n.main.listenLoop(ctx)
}

// listenLoop listens on the node until ctx ends, reconnecting after
// failures.
func (nd *node) listenLoop(ctx context.Context) {
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		err := nd.listen(ctx)
		if ctx.Err() != nil {
			return
		}
		nd.n.cfg.Logger.Warn("change listener lost its connection; reconnecting (waiting Begins poll meanwhile)",
			"node", nd.label(), "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}

// label names the node in logs.
func (nd *node) label() string {
	if nd.name == "" {
		return "database"
	}
	return nd.name
}

// nodesLoop calls Config.Nodes every nodesEvery and starts and stops the
// other nodes' listeners to match.
func (n *Notifier) nodesLoop(ctx context.Context) {
	t := time.NewTicker(nodesEvery)
	defer t.Stop()
	for {
		qctx, cancel := context.WithTimeout(ctx, pingStaleAfter)
		confs, err := n.cfg.Nodes(qctx)
		cancel()
		if err != nil {
			n.nodesRead.Store(0)
			if ctx.Err() == nil {
				n.cfg.Logger.Debug("listing the database nodes failed", "err", err)
			}
		} else if n.syncNodes(ctx, confs) {
			n.nodesRead.Store(time.Now().UnixNano())
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// syncNodes starts a listener on each node of confs not listened on yet
// and stops those of nodes no longer listed. It reports false when a new
// node's ping pool could not be made.
func (n *Notifier) syncNodes(ctx context.Context, confs []*pgx.ConnConfig) bool {
	want := map[string]*pgx.ConnConfig{}
	for _, c := range confs {
		want[net.JoinHostPort(c.Host, strconv.Itoa(int(c.Port)))+"/"+c.Database] = c
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	ok := true
	for name, nd := range n.others {
		if _, keep := want[name]; !keep {
			n.cfg.Logger.Info("no longer listening for changes on a node removed from the cluster", "node", name)
			nd.stop()
			nd.closePings()
			delete(n.others, name)
		}
	}
	for name, c := range want {
		if n.others[name] != nil {
			continue
		}
		pcfg, err := pgxpool.ParseConfig("")
		if err != nil {
			ok = false
			continue
		}
		pcfg.ConnConfig = c.Copy()
		pcfg.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			ok = false
			continue
		}
		nd := n.newNode(name, c, pool, n.cfg.Statements.Prepare)
		nd.closePings = pool.Close
		nctx, cancel := context.WithCancel(ctx)
		nd.stop = cancel
		n.others[name] = nd
		n.wg.Go(func() { nd.listenLoop(nctx) })
		n.wg.Go(func() { nd.pingLoop(nctx) })
	}
	return ok
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
func (nd *node) listen(ctx context.Context) error {
	n := nd.n
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	nd.mu.Lock()
	nd.connCancel = cancel
	nd.mu.Unlock()
	conn, err := pgx.ConnectConfig(ctx, nd.conn)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if nd.prepare != "" {
		if _, err := conn.Exec(ctx, nd.prepare); err != nil {
			return err
		}
	}
	if _, err := conn.Exec(ctx, n.cfg.Statements.Listen); err != nil {
		return err
	}
	// Changes not notified from here on raise the count past this.
	var dropped int64
	if err := conn.QueryRow(ctx, n.cfg.Statements.Dropped).Scan(&dropped); err != nil {
		return err
	}
	nd.dropped.Store(dropped)
	// Changes made while no connection listened were missed.
	if n.cfg.OnLost != nil {
		n.cfg.OnLost()
	}
	nd.connectedAt.Store(time.Now().UnixNano())
	nd.connects.Add(1)
	nd.setConnected(true)
	defer nd.setConnected(false)
	n.wakeAll()
	for {
		note, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if rest, ok := strings.CutPrefix(note.Payload, "ping:"); ok {
			nd.pinged(rest)
			continue
		}
		if n.cfg.OnPayload != nil {
			n.cfg.OnPayload(note.Payload)
		}
		n.wake(note.Payload)
	}
}

func (nd *node) setConnected(c bool) {
	nd.mu.Lock()
	defer nd.mu.Unlock()
	nd.connected = c
}

// pingPayload is the payload of a ping sent at t, without the drop count
// the ping statement appends.
func (nd *node) pingPayload(t time.Time) string {
	n := nd.n
	return "ping:" + n.nonce + ":" + strconv.FormatInt(t.UnixNano(), 10) + ":"
}

// pinged handles a ping (the payload after "ping:"), of any replica: its
// drop count tells whether changes went un-notified since the last one;
// an own ping also records the listener's delay.
func (nd *node) pinged(rest string) {
	n := nd.n
	parts := strings.Split(rest, ":")
	if len(parts) != 3 {
		return
	}
	if d, err := strconv.ParseInt(parts[2], 10, 64); err == nil {
		if prev := nd.dropped.Swap(d); prev >= 0 && d != prev {
			nd.pollUntil.Store(time.Now().Add(pollHold).UnixNano())
			n.cfg.Logger.Warn("changes were not notified (the notification queue was over its limit): "+
				"replay cache dropped, waiting Begins poll", "node", nd.label(), "not_notified", d-prev, "poll_for", pollHold)
			if n.cfg.OnLost != nil {
				n.cfg.OnLost()
			}
			n.wakeAll()
		}
	}
	if parts[0] != n.nonce {
		return
	}
	if ns, err := strconv.ParseInt(parts[1], 10, 64); err == nil && ns > nd.lastSeen.Load() {
		nd.lastSeen.Store(ns)
	}
}

// pingLoop sends a ping every pingEvery until ctx ends, watches the
// notification queue's usage, and reconnects a listener that fell behind.
func (nd *node) pingLoop(ctx context.Context) {
	n := nd.n
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
		err := nd.pings.QueryRow(pctx, n.cfg.Statements.Ping, Channel, nd.pingPayload(sent)).Scan(&ignored, &usage)
		if err != nil {
			// A full queue refuses the ping's notification; read the usage
			// on its own.
			err = nd.pings.QueryRow(pctx, n.cfg.Statements.QueueUsage).Scan(&usage)
		}
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				n.cfg.Logger.Debug("notification ping failed", "node", nd.label(), "err", err)
			}
			continue
		}
		nd.usage.Store(math.Float64bits(usage))
		if usage >= queueWarnAt && time.Since(warned) >= queueWarnEvery {
			warned = time.Now()
			n.cfg.Logger.Warn("PostgreSQL's notification queue is filling: a listening connection is not reading "+
				"(a stalled replica?); past idemcoord.notify_queue_limit (default 50%) changes are no longer notified "+
				"and every replica polls", "node", nd.label(), "usage", usage)
		}
		nd.checkLag(sent)
	}
}

// checkLag reconnects the listener when the own pings sent up to sent (the
// latest sent fine) have not come back for listenerLagLimit: it has fallen
// behind, and holds PostgreSQL's queue back for every replica. Until the
// new connection is up, the replay cache is not served and waiting Begins
// poll; the reconnect runs OnLost.
func (nd *node) checkLag(sent time.Time) {
	seen := max(nd.lastSeen.Load(), nd.connectedAt.Load())
	if lag := sent.Sub(time.Unix(0, seen)); seen > 0 && lag > listenerLagLimit {
		nd.n.cfg.Logger.Warn("change listener fell behind; reconnecting it (replay cache dropped, waiting Begins poll)",
			"node", nd.label(), "lag", lag)
		nd.pollUntil.Store(time.Now().Add(pollHold).UnixNano())
		nd.connectedAt.Store(time.Now().UnixNano()) // one reconnect per lag limit
		nd.reconnect()
	}
}
