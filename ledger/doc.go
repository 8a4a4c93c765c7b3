// Package ledger is idemcoord's PostgreSQL store: embedded migrations, the
// queries and transactions that apply statemachine decisions to records, and
// change notifications for waiting callers.
//
// The database decides every race: the primary key on (tenant, scope, key)
// settles concurrent Begins of a new key, and every other write happens under
// a row lock. Batched statements take their row locks in one global order
// (tenant, scope, key), so concurrent batches never deadlock, and a batch
// answers each caller on its own: one unreadable row fails only its
// caller. Every write is committed before the method that made it
// returns. Errors are the statemachine's refusals, ErrUnavailable when the
// database cannot be reached, or context errors; no pgx type leaves the
// package, except the transaction RunTx lends to its function.
//
// High availability: the database URL may be pgx's multi-host form with
// target_session_attrs=read-write; every connection then follows a
// failover. A read-only or unreachable node is ErrUnavailable. A commit
// never follows its caller's cancellation (a cancelled wait for a
// synchronous standby would commit on the primary only); it runs to its
// end under a bound of its own, and a caller that gives up gets its
// context's error at once. Behind a transaction-pooling PgBouncer, see
// WithNotifyDatabaseURL and WithoutNotifications.
//
// Same-transaction mode: a Go service whose side effect is a write to its
// own PostgreSQL applies Migrate to that database, opens a Store on it with
// Open, and runs each request through Store.RunTx, which commits the record
// with the service's own writes. The coordinator can serve the same table.
//
// Store's surface is the records': what a RunTx user and the coordinator
// need (Begin, BeginWait, Finish, Lookup, RunTx; admin, maintenance and
// statistics). The operator console's sign-in sessions are kept apart, by
// Sessions.
//
// Its parts live under ledger/internal, one concern each, and none imports
// the ledger: notifier (the change listener: LISTEN/NOTIFY, pings,
// polling), coalescer (the batching of concurrent Begins and Completes),
// replaycache (finished records served without a round trip) and keyring
// (encryption at rest).
//
// It imports statemachine, pgx and golang-migrate, never gRPC, the server
// or the console.
package ledger
