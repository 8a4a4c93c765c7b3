package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrUnavailable wraps every failure to reach the database or to commit:
// connection refused or lost, server shutting down, too many connections.
// Callers may retry: a write that failed this way either committed entirely
// or not at all.
var ErrUnavailable = errors.New("database unavailable")

// ErrUnreadable wraps failures to decode or decrypt a stored row (for
// instance a row encrypted under a key no longer configured). Retrying does
// not help.
var ErrUnreadable = errors.New("stored record cannot be read")

// MaxIdentityBytes bounds a record's identity: tenant, scope and key
// together, in bytes. It is what the primary key's btree index can hold
// (an index entry is at most 2704 bytes on PostgreSQL's 8 KiB pages; the
// rest is the entry's own overhead, with a margin). Servers refuse a
// configuration whose limits would let a longer identity through.
const MaxIdentityBytes = 2600

// ErrIdentityTooLong is returned, before any database work, for an
// identity longer than MaxIdentityBytes. It wraps ErrInvalidArgument.
var ErrIdentityTooLong = fmt.Errorf("%w: tenant, scope and key together are too long to be stored", ErrInvalidArgument)

// checkIdentity refuses an identity the primary key index cannot hold, so
// it never reaches a statement (where it would fail a whole batch).
func checkIdentity(id Identity) error {
	if n := len(id.Tenant) + len(id.Scope) + len(id.Key); n > MaxIdentityBytes {
		return fmt.Errorf("%w: %d bytes, at most %d", ErrIdentityTooLong, n, MaxIdentityBytes)
	}
	return nil
}

// classify turns a pgx error into a context error, ErrUnavailable (wrapped
// with the cause) or, for anything else, the error as is.
func classify(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ErrUnreadable) {
		return err
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case len(pgErr.Code) == 5 && pgErr.Code[:2] == "08", // connection exception
			pgErr.Code == "57P01", pgErr.Code == "57P02", pgErr.Code == "57P03", // shutdown, crash, cannot connect now
			pgErr.Code == "53300",                        // too many connections
			pgErr.Code == "40001", pgErr.Code == "40P01": // serialization failure, deadlock: retry
			return fmt.Errorf("%w: %s (SQLSTATE %s)", ErrUnavailable, pgErr.Message, pgErr.Code)
		}
		return err
	}
	// Anything that is not a server error is a transport failure: dial
	// errors, broken connections, a closed pool.
	return fmt.Errorf("%w: %v", ErrUnavailable, err)
}
