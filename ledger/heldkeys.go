package ledger

import (
	"sync"
	"time"
)

// heldMemory is how long a key whose Begin met another transaction's lock
// on it is remembered as held (see heldKeys): a little longer than one
// lock wait of a Begin on its own, which marks it again while it waits.
const heldMemory = 2 * singleLockWait

// heldKeysPrune is the number of remembered keys above which marking a
// key also forgets every key whose memory has run out.
const heldKeysPrune = 1024

// heldKeys remembers, for a moment, the keys whose Begins met another
// transaction's lock on their row (a RunTx running fn). A batch sends new
// Begins of those keys on their own at once instead of meeting the lock
// again, so a key held for seconds delays the Begins batched with it once
// (batchLockWait), not at every retry of it. It is safe for concurrent
// use; the zero value is ready.
type heldKeys struct {
	mu    sync.Mutex
	until map[Identity]time.Time
}

// mark remembers id as held until now+heldMemory.
func (h *heldKeys) mark(id Identity, now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.until == nil {
		h.until = map[Identity]time.Time{}
	}
	if len(h.until) >= heldKeysPrune {
		for k, t := range h.until {
			if !now.Before(t) {
				delete(h.until, k)
			}
		}
	}
	h.until[id] = now.Add(heldMemory)
}

// held reports whether id is remembered as held at now.
func (h *heldKeys) held(id Identity, now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	t, ok := h.until[id]
	if ok && !now.Before(t) {
		delete(h.until, id)
		return false
	}
	return ok
}
