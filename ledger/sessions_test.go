package ledger_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/ledger"
)

func sum(s string) []byte {
	b := sha256.Sum256([]byte(s))
	return b[:]
}

// newSession creates a session with id and token (their hashes stored).
func newSession(t *testing.T, s *ledger.Store, id, token string, idle, lifetime time.Duration) {
	t.Helper()
	if _, err := ledger.NewSessions(s).Create(context.Background(), &ledger.CreateSessionParams{IDSHA256: sum(id),
		Tenant: "ops", TokenSHA256: sum(token), Credential: []byte("sealed " + id), IdleTimeout: idle, MaxLifetime: lifetime}); err != nil {
		t.Fatal(err)
	}
}

// TestConsoleSessionExpiry: a session lives while it is used within its
// idle timeout, never past its lifetime; an expired one is gone.
func TestConsoleSessionExpiry(t *testing.T) {
	t.Parallel()
	s, clock, _ := newClockedStore(t)
	ctx := context.Background()
	newSession(t, s, "a", "tok", 30*time.Minute, 12*time.Hour)
	got, err := ledger.NewSessions(s).Touch(ctx, sum("a"))
	if err != nil || got.Tenant != "ops" || !bytes.Equal(got.Credential, []byte("sealed a")) || !bytes.Equal(got.TokenSHA256, sum("tok")) ||
		!got.ExpiresAt.Equal(clock.Now().Add(30*time.Minute)) {
		t.Fatalf("touch: %+v %v", got, err)
	}
	// Used every 29 minutes it lasts its 12 hours, and not a minute more.
	for elapsed := 29 * time.Minute; elapsed < 12*time.Hour; elapsed += 29 * time.Minute {
		clock.Advance(29 * time.Minute)
		if _, err := ledger.NewSessions(s).Touch(ctx, sum("a")); err != nil {
			t.Fatalf("after %v: %v", elapsed, err)
		}
	}
	clock.Advance(29 * time.Minute)
	if _, err := ledger.NewSessions(s).Touch(ctx, sum("a")); !errors.Is(err, ledger.ErrSessionNotFound) {
		t.Fatalf("past the lifetime: %v", err)
	}

	newSession(t, s, "b", "tok", 30*time.Minute, 12*time.Hour)
	clock.Advance(30 * time.Minute)
	if _, err := ledger.NewSessions(s).Touch(ctx, sum("b")); !errors.Is(err, ledger.ErrSessionNotFound) {
		t.Fatalf("idle for 30 minutes: %v", err)
	}
	if _, err := ledger.NewSessions(s).Touch(ctx, sum("never")); !errors.Is(err, ledger.ErrSessionNotFound) {
		t.Fatalf("unknown session: %v", err)
	}
	if _, err := ledger.NewSessions(s).Create(ctx, &ledger.CreateSessionParams{IDSHA256: []byte("short"), TokenSHA256: sum("t"),
		IdleTimeout: time.Minute, MaxLifetime: time.Hour}); !errors.Is(err, ledger.ErrInvalidArgument) {
		t.Fatalf("malformed id hash: %v", err)
	}
}

// TestConsoleSessionRevocation: sign-out deletes one session; revoking a
// token deletes every session signed in with it and no other.
func TestConsoleSessionRevocation(t *testing.T) {
	t.Parallel()
	s, _, _ := newClockedStore(t)
	ctx := context.Background()
	newSession(t, s, "a1", "tok-a", time.Hour, time.Hour)
	newSession(t, s, "a2", "tok-a", time.Hour, time.Hour)
	newSession(t, s, "b1", "tok-b", time.Hour, time.Hour)
	if err := ledger.NewSessions(s).Delete(ctx, sum("b1")); err != nil {
		t.Fatal(err)
	}
	if _, err := ledger.NewSessions(s).Touch(ctx, sum("b1")); !errors.Is(err, ledger.ErrSessionNotFound) {
		t.Fatalf("after sign-out: %v", err)
	}
	newSession(t, s, "b2", "tok-b", time.Hour, time.Hour)
	n, err := ledger.NewSessions(s).Revoke(ctx, [][]byte{sum("tok-a"), sum("tok-c")})
	if err != nil || n != 2 {
		t.Fatalf("revoke: %d %v", n, err)
	}
	for id, live := range map[string]bool{"a1": false, "a2": false, "b2": true} {
		if _, err := ledger.NewSessions(s).Touch(ctx, sum(id)); (err == nil) != live {
			t.Errorf("session %s: %v, want live %v", id, err, live)
		}
	}
}

// TestConsoleSessionsBounded: expired sessions nobody signed out of are
// deleted, so the table does not grow with them.
func TestConsoleSessionsBounded(t *testing.T) {
	t.Parallel()
	s, clock, url := newClockedStore(t)
	for i := range 150 {
		newSession(t, s, "old"+string(rune('a'+i/26))+string(rune('a'+i%26)), "tok", time.Minute, time.Hour)
	}
	clock.Advance(time.Hour)
	newSession(t, s, "new1", "tok", time.Minute, time.Hour)
	newSession(t, s, "new2", "tok", time.Minute, time.Hour)
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_console_sessions`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Fatalf("%d sessions in the table, want the 2 live ones", n)
	}
	var raw int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_console_sessions
		WHERE id_sha256 = $1 OR id_sha256 = $2`, []byte("new1"), []byte("new2")).Scan(&raw); err != nil || raw != 0 {
		t.Fatalf("a session id is stored as is: %d %v", raw, err)
	}
}
