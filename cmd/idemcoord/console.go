package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"github.com/idemcoord/idemcoord/console"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/server"
)

// checkConsoleExposure refuses a console that would send its session cookie
// in plain HTTP off loopback, or serve every record without auth to others,
// unless the operator said so. It passes when --console is off.
func checkConsoleExposure(c *config, authEnabled bool) error {
	if !c.console || isLoopback(c.httpListen) {
		return nil
	}
	if c.tlsCert == "" {
		return fmt.Errorf("--console on --http-listen %s needs TLS (--tls-cert and --tls-key): "+
			"the console's session cookie stands for a signed-in operator, sent in plain HTTP only to a loopback address", c.httpListen)
	}
	if !authEnabled && !c.allowNoAuth {
		return errors.New("--console with auth disabled (no tenants in the config) on a non-loopback --http-listen " +
			"would let anyone who can reach it resolve and forget every record; configure tenants or pass --insecure-allow-no-auth")
	}
	return nil
}

// consoleServerOptions are the server options --console needs: requests
// that are not API calls may carry the console's forms.
func consoleServerOptions(c *config) []server.Option {
	if !c.console {
		return nil
	}
	return []server.Option{server.WithHTTPOtherMaxBodyBytes(console.MaxFormBytes)}
}

// mountConsole adds the operator console under /console/ to the HTTP
// listener's handler. With --tls-cert the listener then serves HTTPS (the
// console's cookies are Secure, and a client certificate signed by
// --tls-client-ca signs an operator in); without TLS it must be a loopback
// address. Operators' sessions are kept in store, shared by every replica.
// It returns the handler and the listener to serve.
func mountConsole(ctx context.Context, c *config, logger *slog.Logger, srv *server.Server, store *ledger.Store, authEnabled bool,
	lis net.Listener) (http.Handler, net.Listener, error) {
	if err := checkConsoleExposure(c, authEnabled); err != nil {
		return nil, nil, err
	}
	cfg, err := tlsConfig(c)
	if err != nil {
		return nil, nil, err
	}
	con := console.New(srv.AdminConn(), console.WithLogger(logger), console.WithSessions(consoleSessions{ledger.NewSessions(store)}), console.WithCounters(func() console.Counters {
		t := srv.CounterTotals()
		return console.Counters{Acquired: t.Acquired, Replayed: t.Replayed, InProgress: t.InProgress, UnknownEntered: t.UnknownEntered}
	}))
	go con.Run(ctx)
	mux := http.NewServeMux()
	mux.Handle("/", srv.HTTPHandler())
	mux.Handle(console.Prefix, con)
	mux.Handle("GET /console", http.RedirectHandler(console.Prefix, http.StatusMovedPermanently))
	scheme := "http"
	if cfg != nil {
		lis = tls.NewListener(lis, cfg)
		scheme = "https"
	}
	logger.Info("operator console enabled", "url", scheme+"://"+lis.Addr().String()+console.Prefix, "auth", authEnabled)
	return mux, lis, nil
}

// consoleSessions keeps the console's sessions in the ledger, so every
// replica over the same database accepts them.
type consoleSessions struct{ sessions *ledger.Sessions }

// CreateSession stores a new session.
func (s consoleSessions) CreateSession(ctx context.Context, n *console.NewSession) error {
	_, err := s.sessions.Create(ctx, &ledger.CreateSessionParams{IDSHA256: n.IDSHA256, Tenant: n.Tenant,
		TokenSHA256: n.TokenSHA256, Credential: n.Credential, IdleTimeout: n.IdleTimeout, MaxLifetime: n.MaxLifetime})
	return err
}

// UseSession returns a live session and records its use, or
// console.ErrNoSession.
func (s consoleSessions) UseSession(ctx context.Context, idSHA256 []byte) (*console.Session, error) {
	got, err := s.sessions.Touch(ctx, idSHA256)
	if errors.Is(err, ledger.ErrSessionNotFound) {
		return nil, console.ErrNoSession
	}
	if err != nil {
		return nil, err
	}
	return &console.Session{Tenant: got.Tenant, Credential: got.Credential}, nil
}

// DeleteSession deletes a session.
func (s consoleSessions) DeleteSession(ctx context.Context, idSHA256 []byte) error {
	return s.sessions.Delete(ctx, idSHA256)
}
