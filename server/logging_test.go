package server_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/testkit"
	"github.com/idemcoord/idemcoord/server"
)

// capturedLogs returns a buffer and the server option that logs into it,
// as JSON lines, from level up.
func capturedLogs(level slog.Level) (*testkit.LogBuffer, server.Option) {
	logs := &testkit.LogBuffer{}
	return logs, server.WithLogger(slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: level})))
}

// TestCallLogsCarryContextNeverSecrets checks the structured call log: it
// names tenant, scope and outcome, and never contains a stored body or a
// lease token.
func TestCallLogsCarryContextNeverSecrets(t *testing.T) {
	t.Parallel()
	logs, withLogs := capturedLogs(slog.LevelDebug)
	c := coordtest.Start(t, coordtest.Options{ServerOptions: []server.Option{withLogs}})
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

// callLines returns the "finished call" lines of a JSON log, decoded.
func callLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for l := range strings.SplitSeq(strings.TrimSpace(out), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		if m["msg"] == "finished call" {
			lines = append(lines, m)
		}
	}
	return lines
}

// TestCallLogKeepsFailuresAndSlowCallsDropsFastSuccesses checks which calls
// are logged at info level: a failed call always, with its code, error,
// tenant and scope; a successful call only when it took the slow-call threshold or
// longer, or when the threshold is 0.
func TestCallLogKeepsFailuresAndSlowCallsDropsFastSuccesses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		threshold time.Duration
		wantBegin bool
	}{
		// A threshold no call reaches, not the default: on a busy machine
		// (CI, Citus) a Begin can take longer than 250 ms.
		{"threshold not reached", time.Hour, false},
		{"every call is slow", time.Nanosecond, true},
		{"threshold 0 logs every call", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			logs, withLogs := capturedLogs(slog.LevelInfo)
			sopts := []server.Option{withLogs}
			sopts = append(sopts, server.WithSlowCallThreshold(tc.threshold))
			c := coordtest.Start(t, coordtest.Options{ServerOptions: sopts})
			client := idempotencyv1.NewCoordinatorClient(c.Dial(t))
			ctx := context.Background()
			if _, err := client.Begin(ctx, &idempotencyv1.BeginRequest{Scope: "payments", Key: "order-1"}); err != nil {
				t.Fatal(err)
			}
			_, err := client.Complete(ctx, &idempotencyv1.CompleteRequest{Scope: "payments", Key: "order-1", LeaseToken: "not-the-token"})
			if status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("Complete with a wrong token: %v, want FAILED_PRECONDITION", err)
			}
			var sawBegin, sawComplete bool
			for _, m := range callLines(t, logs.String()) {
				switch m["grpc.method"] {
				case "Begin":
					sawBegin = true
					if m["level"] != "INFO" || m["outcome"] != "acquired" || m["grpc.time_ms"] == nil || m["grpc.start_time"] == nil {
						t.Errorf("Begin's line lacks its level, outcome or timing: %v", m)
					}
				case "Complete":
					sawComplete = true
					if m["grpc.code"] != "FailedPrecondition" || m["grpc.error"] == nil || m["grpc.time_ms"] == nil ||
						m["tenant"] != "default" || m["scope"] != "payments" {
						t.Errorf("failed Complete's line lacks its code, error, timing, tenant or scope: %v", m)
					}
				}
			}
			if sawBegin != tc.wantBegin {
				t.Errorf("successful Begin logged: %v, want %v:\n%s", sawBegin, tc.wantBegin, logs.String())
			}
			if !sawComplete {
				t.Errorf("failed Complete not logged:\n%s", logs.String())
			}
		})
	}
}
