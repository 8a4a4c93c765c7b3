package console_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// TestRecordPageShowsCheckpoint: the record page shows the checkpoint's
// phase, time and data (escaped; a hex dump when it is not UTF-8), and
// says when there is none.
func TestRecordPageShowsCheckpoint(t *testing.T) {
	t.Parallel()
	e := newConsoleEnv(t, false)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+opsToken)
	record := func(key, phase string, data []byte) {
		t.Helper()
		b, err := e.client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "s", Key: key, Lease: durationpb.New(time.Minute)})
		if err != nil {
			t.Fatal(err)
		}
		if phase == "" {
			return
		}
		if _, err := e.client.Heartbeat(ctx, &idempotencyv1.HeartbeatRequest{Scope: "s", Key: key, LeaseToken: b.GetLeaseToken(),
			Checkpoint: &idempotencyv1.Checkpoint{Phase: phase, Data: data}}); err != nil {
			t.Fatal(err)
		}
	}
	record("text", "<b>charged</b>", []byte(`{"charge":"<script>x</script>"}`))
	record("binary", "reserved", []byte{0xff, 0xfe, 'A'})
	record("none", "", nil)
	b := e.browser()
	b.login(opsToken)

	r := b.get(recordPath("s", "text"))
	if r.code != http.StatusOK || !strings.Contains(r.body, `id="checkpoint-phase">&lt;b&gt;charged&lt;/b&gt;</code>`) ||
		!strings.Contains(r.body, "&lt;script&gt;x&lt;/script&gt;") || strings.Contains(r.body, "<script>") ||
		!strings.Contains(r.body, "31 bytes") {
		t.Fatalf("record page with a text checkpoint: %d\n%s", r.code, r.body)
	}
	r = b.get(recordPath("s", "binary"))
	if !strings.Contains(r.body, `id="checkpoint-hex"`) || !strings.Contains(r.body, "ff fe 41") {
		t.Fatalf("record page with a binary checkpoint:\n%s", r.body)
	}
	r = b.get(recordPath("s", "none"))
	if !strings.Contains(r.body, `id="no-checkpoint"`) || strings.Contains(r.body, `id="checkpoint"`) {
		t.Fatalf("record page without a checkpoint:\n%s", r.body)
	}
}
