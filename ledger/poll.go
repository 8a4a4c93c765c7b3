package ledger

import (
	"sync"
	"time"
)

// Polling intervals of a subscription without notifications.
const (
	pollFirst = 50 * time.Millisecond
	pollMax   = time.Second
)

// pollSubscription is Subscribe without a change listener
// (WithoutNotifications): its channel receives a value at once and then
// after 50 ms, 100 ms, … up to once a second, so that a waiting caller
// reads the record again; the function ends it.
func pollSubscription() (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	stop := make(chan struct{})
	ch <- struct{}{}
	go func() {
		t := time.NewTimer(pollFirst)
		defer t.Stop()
		for d := pollFirst; ; d = min(2*d, pollMax) {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			select {
			case ch <- struct{}{}:
			default:
			}
			t.Reset(d)
		}
	}()
	var once sync.Once
	return ch, func() { once.Do(func() { close(stop) }) }
}
