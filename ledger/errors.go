package ledger

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrUnavailable wraps every failure to reach the database or to commit:
// connection refused or lost, server shutting down, starting up or
// crashed, a node that is read-only (a standby, or a primary fenced during a
// switchover), too many connections. Callers may retry: a write that failed
// this way either committed entirely or not at all.
var ErrUnavailable = errors.New("database unavailable")

// ErrLostAcquisition is what a Begin that offers a lease token of its own
// (BeginParams) answers when it finds the acquisition an earlier Begin
// with that token committed, whose answer was lost, and that acquisition's
// lease has run out: it can no longer be handed over. It wraps
// ErrUnavailable (the caller is told what the lost answer would have
// told it); a caller that waits stops there instead of re-reading.
var ErrLostAcquisition = fmt.Errorf("%w: this call's own acquisition was committed but its answer was lost, and its lease has run out", ErrUnavailable)

// ErrUnreadable wraps failures to decode or decrypt a stored row: a row
// encrypted under a key no longer configured, a row whose sealed columns or
// bound clear columns were altered in the table, or a row in clear where
// encryption is required. Retrying does not help; the error never carries
// the row's contents. The server answers it DATA_LOSS with ErrorInfo
// reason RECORD_UNREADABLE. Only the call that read the row fails.
var ErrUnreadable = errors.New("stored record cannot be read")

// readOnlySQLState is read_only_sql_transaction: the node takes no writes
// (a hot standby, or default_transaction_read_only, as an orchestrator sets
// to fence a demoted primary).
const readOnlySQLState = "25006"

// closeOnReadOnly is a pgconn OnPgError handler: it closes a connection
// that met a read-only node (as the default handler closes one after a
// FATAL error), so the pool's next connection goes through
// target_session_attrs again and finds the primary of a multi-host URL.
func closeOnReadOnly(next pgconn.PgErrorHandler) pgconn.PgErrorHandler {
	return func(c *pgconn.PgConn, pgErr *pgconn.PgError) bool {
		if pgErr.Code == readOnlySQLState {
			return false
		}
		if next == nil {
			return true
		}
		return next(c, pgErr)
	}
}

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

// lockTimeoutCode is SQLSTATE lock_not_available, which a lock wait ended
// by lock_timeout raises.
const lockTimeoutCode = "55P03"

// isLockTimeout reports whether err is a statement's lock wait ended by its
// lock_timeout (the statement wrote nothing).
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == lockTimeoutCode
}

// mayHaveCommitted reports whether a statement that failed with err,
// running in a transaction of its own, may have committed all the same:
// its connection broke after it was sent, or the server ended the session
// (a FATAL error, such as a terminated backend, which can come after a
// local commit that waited for a synchronous standby). Not when
// PostgreSQL refused the statement, nor when it was never sent (a failed
// connect, or pgconn.SafeToRetry).
//
// pgconn.ErrConnClosed counts as sent although pgconn calls it safe to
// retry: pgconn answers it too when the connection broke while the answer
// was awaited (a COMMIT's, say, that PostgreSQL had received);
// TestWaitingRunTxLostCommitThenForgotten met it so.
func mayHaveCommitted(err error) bool {
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		return pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC" || citusNodeFailed(pgErr)
	}
	if errors.Is(err, pgconn.ErrConnClosed) {
		return true
	}
	var connectErr *pgconn.ConnectError
	return !errors.As(err, &connectErr) && !pgconn.SafeToRetry(err)
}

// citusPostCommitFailure is the routine of the error a Citus coordinator
// node raises when a worker failed while it committed a transaction's
// writes there ("could not commit transaction for shard … on at least one
// active node", SQLSTATE XX000): the worker's connection broke during the
// COMMIT, or the COMMIT failed there. Whether the write committed on the
// worker is unknown.
const citusPostCommitFailure = "ErrorIfPostCommitFailedShardPlacements"

// citusPostmasterGone is the message of the error a Citus node raises
// (SQLSTATE XX000, from several routines) when its own postmaster died
// while one of its backends waited on another node: the node is going
// down. With the connections spread over the nodes, a coordinator talks to
// a worker directly, so killing that worker shows it (met by
// TestCitusWorkerKillSpread). The wait may have been for a remote COMMIT,
// so whether the statement committed there is unknown.
const citusPostmasterGone = "postmaster was shut down, exiting"

// citusEssentialConnFailed begins the message of the error (SQLSTATE
// XX000) a Citus node raises when its connection to another node, which
// the transaction needs, failed: the worker went down, or the connection
// was terminated (TestCitusNotifyOverflowOnWorker met it). It can come
// while the transaction commits there, so whether it committed is unknown.
const citusEssentialConnFailed = "failure on connection marked as essential"

// citusNodeFailed reports whether pgErr is one of those errors: a
// statement whose node, or whose connection to another node, failed under
// it, perhaps after its commit.
func citusNodeFailed(pgErr *pgconn.PgError) bool {
	return pgErr.Code == "XX000" && (pgErr.Routine == citusPostCommitFailure || pgErr.Message == citusPostmasterGone ||
		strings.HasPrefix(pgErr.Message, citusEssentialConnFailed))
}

// answerLostError is ErrUnavailable for a statement that may have committed
// all the same (mayHaveCommitted): its answer was lost, perhaps not its
// write. Its message is that of the error it wraps.
type answerLostError struct{ error }

func (e answerLostError) Unwrap() error { return e.error }

// answerLost reports whether err is ErrUnavailable for a statement whose
// answer was lost after it may have committed (answerLostError).
func answerLost(err error) bool {
	var lost answerLostError
	return errors.As(err, &lost)
}

// uncommitted classifies the failure of a statement of a transaction
// that has not reached its COMMIT: nothing of the transaction can have
// committed, so an answer lost then is ErrUnavailable, but no lost commit
// (answerLost), whatever became of the connection.
func uncommitted(err error) error {
	err = classify(err)
	if lost, ok := errors.AsType[answerLostError](err); ok {
		return lost.error
	}
	return err
}

// classify turns a pgx error into a context error, ErrUnavailable (wrapped
// with the cause) or, for anything else, the error as is.
func classify(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ErrUnreadable) ||
		errors.Is(err, ErrUnavailable) {
		return err
	}
	if _, ok := errors.AsType[shardsFailedError](err); ok {
		return err // the workers' errors, already as text
	}
	var unavailable error
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		switch {
		case len(pgErr.Code) == 5 && pgErr.Code[:2] == "08", // connection exception
			pgErr.Code == "57P01", pgErr.Code == "57P02", pgErr.Code == "57P03", // shutdown, crash, cannot connect now
			pgErr.Code == readOnlySQLState,               // a standby or a fenced primary
			pgErr.Code == "53300",                        // too many connections
			pgErr.Code == "40001", pgErr.Code == "40P01", // serialization failure, deadlock: retry
			citusNodeFailed(pgErr): // a Citus node failed under the statement
			unavailable = fmt.Errorf("%w: %s (SQLSTATE %s)", ErrUnavailable, pgErr.Message, pgErr.Code)
		default:
			return err
		}
	} else {
		// Anything that is not a server error is a transport failure: dial
		// errors, broken connections, a closed pool.
		unavailable = fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	// A broken connection or an ended session may have lost the answer of
	// a statement that committed.
	if mayHaveCommitted(err) {
		return answerLostError{unavailable}
	}
	return unavailable
}
