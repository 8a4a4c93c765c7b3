package server

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/idemcoord/idemcoord/ledger"
)

// revokeTimeout bounds how long a reload waits for the database to revoke
// the console sessions of removed tokens.
const revokeTimeout = 10 * time.Second

// ErrReloadRefused wraps every reason Reload refuses a configuration file.
var ErrReloadRefused = errors.New("config reload refused; the configuration in force stays")

// Reload reads the configuration file at path and puts it in force for the
// calls that start after it returns: all of it or none of it. It refuses,
// keeping the configuration in force and counting the refusal in
// idempotency_config_reload_failures_total, a file that cannot be read, is
// empty (nothing, or only comments: a truncated or half-written file) or
// does not validate, and one that would turn auth on or off or change the
// encryption keys: those take a restart, so a reload can never open the
// door to unauthenticated callers. Every check in checks (for instance the
// start-up exposure check) runs on the new configuration too; any error
// refuses it; nil checks are skipped.
//
// A reload that removes a tenant's token (or gives it to another tenant)
// revokes the operator console sessions signed in with it, in the
// database, so on every replica. Should the database not answer, the
// reload stays in force, the failure is logged, and those sessions stay
// refused on this replica (the console checks the token at each request)
// until they expire.
func (s *Server) Reload(path string, checks ...func(*Policies) error) (*Policies, error) {
	cur := s.policies.Load()
	next, err := s.admissible(cur, path, checks)
	if err == nil && !s.policies.CompareAndSwap(cur, next) {
		err = errors.New("the configuration changed while this reload was being checked; reload again")
	}
	if err != nil {
		s.metrics.reloadFailures.Inc()
		return nil, fmt.Errorf("%w: %w", ErrReloadRefused, err)
	}
	if revoked := revokedTokens(cur, next); len(revoked) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), revokeTimeout)
		defer cancel()
		if n, err := ledger.NewSessions(s.store).Revoke(ctx, revoked); err != nil {
			s.logger.Error("config reload: revoking the console sessions of removed tokens failed; they end when they expire",
				"tokens", len(revoked), "err", err)
		} else {
			s.logger.Info("config reload: console sessions of removed tokens revoked", "tokens", len(revoked), "sessions", n)
		}
	}
	return next, nil
}

// revokedTokens returns the SHA-256 sums of the tokens cur accepts that
// next does not accept for the same tenant: removed, or moved to another
// tenant.
func revokedTokens(cur, next *Policies) [][]byte {
	kept := make(map[string]string, len(next.tenants))
	for _, t := range next.tenants {
		if t.token != nil {
			kept[string(t.token)] = t.name
		}
	}
	var revoked [][]byte
	for _, t := range cur.tenants {
		if name, ok := kept[string(t.token)]; t.token != nil && (!ok || name != t.name) {
			revoked = append(revoked, t.token)
		}
	}
	return revoked
}

// admissible reads the file at path and checks it against cur, the
// configuration in force.
func (s *Server) admissible(cur *Policies, path string, checks []func(*Policies) error) (*Policies, error) {
	data, err := os.ReadFile(path) //nolint:gosec // the operator names this file (flag, environment or config file); reading it is the point
	if err != nil {
		return nil, err
	}
	next, err := ParsePolicies(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if next.empty {
		return nil, fmt.Errorf("%s is empty: a configuration file always says something (a truncated or half-written file is refused)", path)
	}
	var errs []error
	switch {
	case cur.AuthEnabled() && !next.AuthEnabled():
		errs = append(errs, fmt.Errorf("%s has no tenants: turning auth off takes a restart", path))
	case !cur.AuthEnabled() && next.AuthEnabled():
		errs = append(errs, fmt.Errorf("%s lists tenants but auth is off: turning auth on takes a restart", path))
	}
	if !sameKeys(cur, next) {
		errs = append(errs, fmt.Errorf("%s changes the encryption section: the keys are read at start-up only, restart to change them", path))
	}
	for _, check := range checks {
		if check == nil {
			continue
		}
		if err := check(next); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	next.keyring = cur.keyring // the keys in use stay those of start-up
	return next, nil
}

// sameKeys reports whether a and b configure the same encryption key ids
// (or both none).
func sameKeys(a, b *Policies) bool {
	if a.keyring == nil || b.keyring == nil {
		return a.keyring == b.keyring
	}
	return a.keyring.ActiveKeyID() == b.keyring.ActiveKeyID() && slices.Equal(a.keyring.KeyIDs(), b.keyring.KeyIDs()) &&
		a.keyring.AcceptsLegacyRows() == b.keyring.AcceptsLegacyRows()
}
