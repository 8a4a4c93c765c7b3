package replaycache

import (
	"container/list"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemcoord/idemcoord/statemachine"
)

// Replay cache tuning.
const (
	// Freshness is how recent the last notification round trip must
	// be for cached records to be served: a record changed or forgotten on
	// any replica stops being served here within this time.
	Freshness = 900 * time.Millisecond
	// ExpiryMargin sends a Begin to the database when the cached
	// record expires within this time, so expiry is decided by the
	// database's clock.
	ExpiryMargin = time.Second
	// cacheEntryOverhead approximates the memory of an entry beyond its
	// response.
	cacheEntryOverhead = 256
	// cacheMaxInvalidations bounds the remembered invalidations.
	cacheMaxInvalidations = 1 << 16
)

// Cache keeps COMPLETED and FAILED_REPLAYABLE records, which change
// only by expiry, Forget or an operator, so Begins that replay them need no
// database round trip. It is only served while the change notifications of
// every replica are known to arrive within Freshness; every
// notification evicts its record, and a record read before an invalidation
// is never inserted after it.
type Cache struct {
	maxBytes int64

	mu      sync.Mutex
	bytes   int64
	lru     *list.List // of *cacheEntry; front is most recently used
	entries map[string]*list.Element
	// seq counts invalidations; inval remembers the seq of the latest
	// invalidation per record, and floor rejects every read older than the
	// last time inval was cleared.
	seq   uint64
	inval map[string]uint64
	floor uint64

	hits, misses atomic.Int64

	// fresh reports whether change notifications are known to arrive
	// within Freshness (see notifier.Notifier.Fresh).
	fresh func() bool
}

type cacheEntry struct {
	hash string
	rec  statemachine.Record
	size int64
}

// New returns an empty cache of at most maxBytes (approximately), served
// only while fresh reports that change notifications arrive within
// Freshness.
func New(maxBytes int64, fresh func() bool) *Cache {
	return &Cache{maxBytes: maxBytes, lru: list.New(), entries: map[string]*list.Element{},
		inval: map[string]uint64{}, fresh: fresh}
}

// Snapshot returns the invalidation sequence to pass to put for a read
// that starts now.
func (c *Cache) Snapshot() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.seq
}

// Get returns the cached record named h (its notifications' hash), if it
// may be served.
func (c *Cache) Get(h string) (statemachine.Record, bool) {
	if !c.fresh() {
		return statemachine.Record{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.entries[h]
	if !ok {
		return statemachine.Record{}, false
	}
	c.lru.MoveToFront(el)
	return el.Value.(*cacheEntry).rec, true //nolint:forcetypeassert // the list holds only *cacheEntry
}

// Stats are the cache's counters.
type Stats struct {
	// Hits and Misses count the lookups that answered a Begin and those
	// that went on to the database.
	Hits, Misses int64
	// Bytes is the memory the cached records take, approximately.
	Bytes int64
}

// Stats reports the cache's counters.
func (c *Cache) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return Stats{Hits: c.hits.Load(), Misses: c.misses.Load(), Bytes: c.bytes}
}

// Hit counts a lookup that answered a Begin; Miss one that went on to the
// database.
func (c *Cache) Hit() { c.hits.Add(1) }

// Miss counts a lookup that went on to the database.
func (c *Cache) Miss() { c.misses.Add(1) }

// Put caches rec, named h, read from the database after Snapshot
// returned seq, unless the record was invalidated since. Only replayable
// records with a response and an expiry are kept.
func (c *Cache) Put(h string, rec statemachine.Record, seq uint64) {
	if !rec.State.Replayable() || rec.Response == nil || rec.ExpiresAt.IsZero() {
		return
	}
	size := int64(cacheEntryOverhead + len(rec.Response.Body) + len(rec.Response.SchemaVersion) +
		len(rec.Response.ContentType) + len(rec.Fingerprint) + len(rec.FailureReason))
	for k, v := range rec.Response.Metadata {
		size += int64(len(k) + len(v))
	}
	if c := rec.Checkpoint; c != nil {
		size += int64(len(c.Phase) + len(c.Data))
	}
	if size > c.maxBytes/16 {
		return // one huge response must not flush the cache
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if seq < c.floor || c.inval[h] > seq {
		return
	}
	if el, ok := c.entries[h]; ok {
		c.remove(el)
	}
	c.entries[h] = c.lru.PushFront(&cacheEntry{hash: h, rec: rec, size: size})
	c.bytes += size
	for c.bytes > c.maxBytes {
		c.remove(c.lru.Back())
	}
}

func (c *Cache) remove(el *list.Element) {
	e := c.lru.Remove(el).(*cacheEntry) //nolint:forcetypeassert // the list holds only *cacheEntry
	delete(c.entries, e.hash)
	c.bytes -= e.size
}

// Invalidate evicts the record with hash h and rejects older reads of it.
func (c *Cache) Invalidate(h string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	if el, ok := c.entries[h]; ok {
		c.remove(el)
	}
	if len(c.inval) >= cacheMaxInvalidations {
		clear(c.inval)
		c.floor = c.seq
	}
	c.inval[h] = c.seq
}

// InvalidateAll empties the cache and rejects every read started before.
func (c *Cache) InvalidateAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	c.lru.Init()
	clear(c.entries)
	clear(c.inval)
	c.bytes = 0
	c.floor = c.seq
}
