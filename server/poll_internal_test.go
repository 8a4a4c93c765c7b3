package server

import (
	"testing"
	"time"
)

// A waiting Begin that cannot trust notifications re-reads on a backoff:
// 50 ms, doubling, at most a second apart.
func TestNextPollBacksOff(t *testing.T) {
	want := []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond,
		400 * time.Millisecond, 800 * time.Millisecond, time.Second, time.Second}
	var d time.Duration
	for i, w := range want {
		d = nextPoll(d)
		if d != w {
			t.Fatalf("poll %d: %v, want %v", i+1, d, w)
		}
	}
}
