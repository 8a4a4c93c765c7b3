package console

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// ErrNoSession is what a SessionStore answers for a session that does not
// exist, has expired or was revoked.
var ErrNoSession = errors.New("console: no such session")

// SessionStore keeps the console's sign-in sessions where every replica
// of the coordinator finds them (the server binary keeps them in
// PostgreSQL). The store decides expiry with its own clock, so replicas
// agree and tests move time without sleeping.
type SessionStore interface {
	// CreateSession stores a new session, created now.
	CreateSession(ctx context.Context, s *NewSession) error
	// UseSession returns the live session whose id hashes to idSHA256
	// and records its use now, which moves its idle expiry (never past
	// its lifetime), or ErrNoSession.
	UseSession(ctx context.Context, idSHA256 []byte) (*Session, error)
	// DeleteSession deletes the session whose id hashes to idSHA256 (no
	// error when there is none).
	DeleteSession(ctx context.Context, idSHA256 []byte) error
}

// NewSession is a session to create.
type NewSession struct {
	// IDSHA256 is the SHA-256 of the session's random id; the id itself
	// is only in the browser's cookie and must not be stored.
	IDSHA256 []byte
	// Tenant is the tenant the operator signed in as.
	Tenant string
	// TokenSHA256 is the SHA-256 of the bearer token the operator signed
	// in with, as tenants list it in the config: removing the token
	// revokes the session.
	TokenSHA256 []byte
	// Credential is opaque to the store: what the console needs to act for
	// the session, sealed under a key only the session id gives.
	Credential []byte
	// IdleTimeout ends the session after this long without use;
	// MaxLifetime ends it this long after sign-in.
	IdleTimeout, MaxLifetime time.Duration
}

// Session is a live session, as UseSession finds it.
type Session struct {
	// Tenant is the tenant the operator signed in as.
	Tenant string
	// Credential is NewSession.Credential, as stored.
	Credential []byte
}

const (
	// sessionIDBytes is the length of a session id (random bytes); its
	// cookie is the id in base64url.
	sessionIDBytes = 32
	// credentialInfo separates the key that seals a session's credential
	// from every other use of the session id.
	credentialInfo = "idemcoord console session credential v1" //nolint:gosec // an HKDF info label, not a credential
)

// sessionKey is the request context key of the request's activeSession.
type sessionKey struct{}

// activeSession is the session a request came with, opened.
type activeSession struct {
	idSHA256 []byte
	tenant   string
	token    string
}

// sessionOf returns the request's session, if it came with a live one.
func sessionOf(r *http.Request) (*activeSession, bool) {
	s, ok := r.Context().Value(sessionKey{}).(*activeSession)
	return s, ok
}

// sessionID returns the session id of the request's cookie, when it has a
// well-formed one.
func sessionID(r *http.Request) ([]byte, bool) {
	ck, err := r.Cookie(sessionCookie)
	if err != nil {
		return nil, false
	}
	id, err := base64.RawURLEncoding.DecodeString(ck.Value)
	if err != nil || len(id) != sessionIDBytes {
		return nil, false
	}
	return id, true
}

func hashID(id []byte) []byte {
	sum := sha256.Sum256(id)
	return sum[:]
}

// credentialAEAD returns the cipher that seals the credential of the
// session with id.
func credentialAEAD(id []byte) (cipher.AEAD, error) {
	key, err := hkdf.Key(sha256.New, id, nil, credentialInfo, 32)
	if err != nil {
		return nil, err
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCMWithRandomNonce(block)
}

// sealToken seals token as the credential of the session with id.
func sealToken(id []byte, token string) ([]byte, error) {
	aead, err := credentialAEAD(id)
	if err != nil {
		return nil, err
	}
	return aead.Seal(nil, nil, []byte(token), hashID(id)), nil //nolint:gosec // NewGCMWithRandomNonce draws the nonce itself and refuses any other
}

// openToken opens the credential of the session with id.
func openToken(id, sealed []byte) (string, error) {
	aead, err := credentialAEAD(id)
	if err != nil {
		return "", err
	}
	token, err := aead.Open(nil, nil, sealed, hashID(id))
	if err != nil {
		return "", fmt.Errorf("console: session credential does not open: %w", err)
	}
	return string(token), nil
}

// withSession serves r with its session, if its cookie names a live one,
// in its context. A cookie that names none is cleared; a session store
// that cannot answer gets 503.
func (c *Console) withSession(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, ok := sessionID(r)
		if !ok || c.opts.sessions == nil {
			next.ServeHTTP(w, r)
			return
		}
		s, err := c.opts.sessions.UseSession(r.Context(), hashID(id))
		var token string
		if err == nil {
			if token, err = openToken(id, s.Credential); err != nil {
				// Only a changed row does this: no session, and none to keep.
				c.opts.logger.Warn("console: a session's stored credential does not open; ending the session", "err", err)
				if err := c.opts.sessions.DeleteSession(r.Context(), hashID(id)); err != nil {
					c.opts.logger.Warn("console: ending the session failed", "err", err)
				}
				err = ErrNoSession
			}
		}
		switch {
		case errors.Is(err, ErrNoSession):
			setCookie(w, r, sessionCookie, "", -1)
			next.ServeHTTP(w, r)
			return
		case err != nil:
			c.opts.logger.Error("console: session store failed", "path", r.URL.Path, "err", err)
			c.renderError(w, r, http.StatusServiceUnavailable, "The console cannot check your session now; try again shortly.")
			return
		}
		as := &activeSession{idSHA256: hashID(id), tenant: s.Tenant, token: token}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), sessionKey{}, as)))
	})
}

// startSession creates a session for an operator who signed in with token
// as tenant, and sets its cookie; it ends the session the request came
// with, if any.
func (c *Console) startSession(w http.ResponseWriter, r *http.Request, tenant, token string) error {
	if c.opts.sessions == nil {
		return errors.New("console: no session store configured")
	}
	id := make([]byte, sessionIDBytes)
	_, _ = rand.Read(id)
	sealed, err := sealToken(id, token)
	if err != nil {
		return err
	}
	tokenSum := sha256.Sum256([]byte(token))
	if err := c.opts.sessions.CreateSession(r.Context(), &NewSession{IDSHA256: hashID(id), Tenant: tenant, TokenSHA256: tokenSum[:],
		Credential: sealed, IdleTimeout: c.opts.sessionIdle, MaxLifetime: c.opts.sessionTTL}); err != nil {
		return err
	}
	if old, ok := sessionOf(r); ok {
		if err := c.opts.sessions.DeleteSession(r.Context(), old.idSHA256); err != nil {
			c.opts.logger.Warn("console: ending the previous session failed; it expires by itself", "err", err)
		}
	}
	setCookie(w, r, sessionCookie, base64.RawURLEncoding.EncodeToString(id), c.opts.sessionTTL)
	return nil
}

// endSession deletes the request's session, if it has one, and clears its
// cookie.
func (c *Console) endSession(w http.ResponseWriter, r *http.Request) error {
	setCookie(w, r, sessionCookie, "", -1)
	s, ok := sessionOf(r)
	if !ok {
		return nil
	}
	return c.opts.sessions.DeleteSession(r.Context(), s.idSHA256)
}
