package coalescer_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idemcoord/idemcoord/ledger/internal/coalescer"
)

// TestCloseAnswersEveryone closes a coalescer with a batch in flight and
// requests queued: the batch's context is cancelled, every queued request
// is rejected (answered), and later submits are refused.
func TestCloseAnswersEveryone(t *testing.T) {
	t.Parallel()
	started := make(chan struct{})
	var ran, rejected sync.Map
	c := coalescer.New(1, 4, time.Minute, func(ctx context.Context, batch []int) {
		for _, r := range batch {
			ran.Store(r, true)
		}
		close(started)
		<-ctx.Done() // a statement that only ends when cancelled
	}, func(r int) { rejected.Store(r, true) })
	if !c.Submit(context.Background(), 0) {
		t.Fatal("submit refused")
	}
	<-started
	for i := 1; i <= 3; i++ {
		if !c.Submit(context.Background(), i) {
			t.Fatal("submit refused")
		}
	}
	c.Close()
	for i := 1; i <= 3; i++ {
		if _, ok := rejected.Load(i); !ok {
			t.Errorf("queued request %d was not answered", i)
		}
	}
	if _, ok := ran.Load(0); !ok {
		t.Error("the batch in flight did not run")
	}
	if c.Submit(context.Background(), 9) {
		t.Error("submit after close was accepted")
	}
}
