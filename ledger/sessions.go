package ledger

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrSessionNotFound is what Sessions.Touch answers for a session
// that does not exist, has expired, or was revoked.
var ErrSessionNotFound = errors.New("console session not found or expired")

// sweepSessionsBatch bounds how many expired sessions each new session
// deletes: the table holds the live sessions plus a bounded rest.
const sweepSessionsBatch = 100

// Sessions keeps the operator console's sign-in sessions in the ledger's
// database (table idempotency_console_sessions), so that every replica
// over the same database accepts them. It is apart from Store, whose
// surface is the records': a service that uses the ledger as a library
// never needs it. It is safe for concurrent use, and lives as long as the
// Store it was made from.
type Sessions struct {
	store *Store
}

// NewSessions returns the console sessions kept in store's database, read
// and written with store's connections and clock.
func NewSessions(store *Store) *Sessions { return &Sessions{store: store} }

// Session is a signed-in operator console session.
type Session struct {
	// Tenant is the tenant the operator signed in as.
	Tenant string
	// TokenSHA256 is the SHA-256 of the bearer token the operator signed
	// in with.
	TokenSHA256 []byte
	// Credential is what the console stored with the session, as given.
	Credential []byte
	// CreatedAt and LastSeenAt are when the session was created and last
	// used; ExpiresAt is when it lapses unless used again before.
	CreatedAt, LastSeenAt, ExpiresAt time.Time
}

// CreateSessionParams is a new console session.
type CreateSessionParams struct {
	// IDSHA256 is the SHA-256 of the session's random id (the id itself is
	// never stored).
	IDSHA256 []byte
	// Tenant is the tenant the operator signed in as.
	Tenant string
	// TokenSHA256 is the SHA-256 of the bearer token the operator signed
	// in with; Sessions.Revoke finds sessions by it.
	TokenSHA256 []byte
	// Credential is stored as given and returned by Sessions.Touch.
	Credential []byte
	// IdleTimeout ends the session after this long without use;
	// MaxLifetime ends it this long after its creation, used or not.
	// Both must be positive.
	IdleTimeout, MaxLifetime time.Duration
}

// Create stores a new session, created now (the Store's clock). It also deletes a bounded batch of expired sessions, so the
// table does not grow with sessions nobody signed out of.
func (ss *Sessions) Create(ctx context.Context, p *CreateSessionParams) (*Session, error) {
	s := ss.store
	if len(p.IDSHA256) != sha256.Size || len(p.TokenSHA256) != sha256.Size {
		return nil, fmt.Errorf("%w: session id and token hashes must be SHA-256 sums", ErrInvalidArgument)
	}
	if p.IdleTimeout <= 0 || p.MaxLifetime <= 0 {
		return nil, fmt.Errorf("%w: session idle timeout and lifetime must be positive", ErrInvalidArgument)
	}
	return detached(ctx, func(ctx context.Context) (*Session, error) {
		sess := &Session{Tenant: p.Tenant, TokenSHA256: p.TokenSHA256, Credential: p.Credential}
		q := s.sql.sessionCreate(p, s.now(), sweepSessionsBatch)
		err := s.first.QueryRow(ctx, q.sql, q.args...).Scan(&sess.CreatedAt, &sess.LastSeenAt, &sess.ExpiresAt)
		if err != nil {
			return nil, classify(err)
		}
		return sess, nil
	})
}

// Touch returns the live session whose id hashes to
// idSHA256 and records its use now, which moves its idle expiry (never
// past its lifetime). A session that does not exist, has expired or was
// revoked answers ErrSessionNotFound; an expired one is deleted.
func (ss *Sessions) Touch(ctx context.Context, idSHA256 []byte) (*Session, error) {
	s := ss.store
	return detached(ctx, func(ctx context.Context) (*Session, error) {
		now := s.now()
		var sess Session
		q := s.sql.sessionTouch(idSHA256, now)
		err := s.first.QueryRow(ctx, q.sql, q.args...).Scan(
			&sess.Tenant, &sess.TokenSHA256, &sess.Credential, &sess.CreatedAt, &sess.LastSeenAt, &sess.ExpiresAt)
		if errors.Is(err, pgx.ErrNoRows) {
			q := s.sql.sessionDeleteExpired(idSHA256, now)
			if _, err := s.first.Exec(ctx, q.sql, q.args...); err != nil {
				return nil, classify(err)
			}
			return nil, ErrSessionNotFound
		}
		if err != nil {
			return nil, classify(err)
		}
		return &sess, nil
	})
}

// Delete deletes the session whose id hashes to idSHA256
// (sign-out). Deleting a session that does not exist is not an error.
func (ss *Sessions) Delete(ctx context.Context, idSHA256 []byte) error {
	s := ss.store
	_, err := detached(ctx, func(ctx context.Context) (struct{}, error) {
		q := s.sql.sessionDelete(idSHA256)
		_, err := s.first.Exec(ctx, q.sql, q.args...)
		return struct{}{}, classify(err)
	})
	return err
}

// Revoke deletes every session signed in with one of the
// bearer tokens whose SHA-256 sums are given, and returns how many it
// deleted.
func (ss *Sessions) Revoke(ctx context.Context, tokenSHA256s [][]byte) (int64, error) {
	s := ss.store
	if len(tokenSHA256s) == 0 {
		return 0, nil
	}
	return detached(ctx, func(ctx context.Context) (int64, error) {
		q := s.sql.sessionRevoke(tokenSHA256s)
		tag, err := s.first.Exec(ctx, q.sql, q.args...)
		if err != nil {
			return 0, classify(err)
		}
		return tag.RowsAffected(), nil
	})
}
