package ledger

import (
	"container/list"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemcoord/idemcoord/statemachine"
)

// Replay cache tuning.
const (
	// cacheFreshness is how recent the last notification round trip must
	// be for cached records to be served: a record changed or forgotten on
	// any replica stops being served here within this time.
	cacheFreshness = 900 * time.Millisecond
	// cacheExpiryMargin sends a Begin to the database when the cached
	// record expires within this time, so expiry is decided by the
	// database's clock.
	cacheExpiryMargin = time.Second
	// cacheEntryOverhead approximates the memory of an entry beyond its
	// response.
	cacheEntryOverhead = 256
	// cacheMaxInvalidations bounds the remembered invalidations.
	cacheMaxInvalidations = 1 << 16
)

// replayCache keeps COMPLETED and FAILED_REPLAYABLE records, which change
// only by expiry, Forget or an operator, so Begins that replay them need no
// database round trip. It is only served while the change notifications of
// every replica are known to arrive within cacheFreshness; every
// notification evicts its record, and a record read before an invalidation
// is never inserted after it.
type replayCache struct {
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
	// within cacheFreshness (see notifier.fresh).
	fresh func() bool
}

type cacheEntry struct {
	hash string
	rec  statemachine.Record
	size int64
}

func newReplayCache(maxBytes int64, fresh func() bool) *replayCache {
	return &replayCache{maxBytes: maxBytes, lru: list.New(), entries: map[string]*list.Element{},
		inval: map[string]uint64{}, fresh: fresh}
}

// snapshot returns the invalidation sequence to pass to put for a read
// that starts now.
func (c *replayCache) snapshot() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.seq
}

// get returns the cached record id, if it may be served.
func (c *replayCache) get(id Identity) (statemachine.Record, bool) {
	if !c.fresh() {
		return statemachine.Record{}, false
	}
	h := recordHash(id)
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.entries[h]
	if !ok {
		return statemachine.Record{}, false
	}
	c.lru.MoveToFront(el)
	return el.Value.(*cacheEntry).rec, true
}

// CacheStats counts the replay cache's lookups that answered a Begin (hits)
// and those that went on to the database (misses, including lookups while
// the cache is not fresh).
type CacheStats struct {
	Hits, Misses int64
	// Bytes is the memory the cached records take, approximately.
	Bytes int64
}

// CacheStats reports the replay cache's counters (zero when it is off).
func (s *Store) CacheStats() CacheStats {
	if s.cache == nil {
		return CacheStats{}
	}
	s.cache.mu.Lock()
	defer s.cache.mu.Unlock()
	return CacheStats{Hits: s.cache.hits.Load(), Misses: s.cache.misses.Load(), Bytes: s.cache.bytes}
}

// put caches rec, read from the database after snapshot returned seq,
// unless the record was invalidated since.
func (c *replayCache) put(id Identity, rec statemachine.Record, seq uint64) {
	if !rec.State.Replayable() || rec.Response == nil || rec.ExpiresAt.IsZero() {
		return
	}
	h := recordHash(id)
	size := int64(cacheEntryOverhead + len(rec.Response.Body) + len(rec.Response.SchemaVersion) +
		len(rec.Response.ContentType) + len(rec.Fingerprint) + len(rec.FailureReason))
	for k, v := range rec.Response.Metadata {
		size += int64(len(k) + len(v))
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

func (c *replayCache) remove(el *list.Element) {
	e := c.lru.Remove(el).(*cacheEntry)
	delete(c.entries, e.hash)
	c.bytes -= e.size
}

// invalidate evicts the record with hash h and rejects older reads of it.
func (c *replayCache) invalidate(h string) {
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

// invalidateAll empties the cache and rejects every read started before.
func (c *replayCache) invalidateAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	c.lru.Init()
	clear(c.entries)
	clear(c.inval)
	c.bytes = 0
	c.floor = c.seq
}

// notified handles a record notification: it invalidates its record.
func (c *replayCache) notified(payload string) {
	c.invalidate(payload)
}
