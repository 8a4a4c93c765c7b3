package server_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/server"
)

type lockedBuilder struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuilder) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuilder) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestCallLogsCarryContextNeverSecrets checks the structured call log: it
// names tenant, scope and outcome, and never contains a stored body or a
// lease token.
func TestCallLogsCarryContextNeverSecrets(t *testing.T) {
	t.Parallel()
	var logs lockedBuilder
	logger := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	c := coordtest.Start(t, coordtest.Options{ServerOptions: []server.Option{server.WithLogger(logger)}})
	client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
	ctx := context.Background()
	b, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "payments", Key: "order-1"})
	if err != nil {
		t.Fatal(err)
	}
	resp := &idempotencyv1.StoredResponse{Body: []byte("SECRET-BODY-4111111111111111"), Metadata: map[string]string{"x": "SECRET-META"}}
	if _, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "payments", Key: "order-1", LeaseToken: b.GetLeaseToken(), Response: resp}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "payments", Key: "order-1"}); err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	for _, secret := range []string{"SECRET-BODY", "SECRET-META", b.GetLeaseToken()} {
		if strings.Contains(out, secret) {
			t.Fatalf("log contains %q:\n%s", secret, out)
		}
	}
	for _, want := range []string{`"tenant":"default"`, `"scope":"payments"`, `"outcome":"acquired"`, `"outcome":"replay"`, `"grpc.method":"Complete"`} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %s:\n%s", want, out)
		}
	}
}
