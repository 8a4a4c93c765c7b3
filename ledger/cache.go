package ledger

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
	st := s.cache.Stats()
	return CacheStats{Hits: st.Hits, Misses: st.Misses, Bytes: st.Bytes}
}
