// Package coalescer gathers concurrent requests of one kind into batches
// run by a few workers, as the ledger does with Begins and Completes so
// that many callers share one statement and one commit.
//
// It knows nothing of records or SQL: the ledger gives it the function
// that runs a batch. It imports only the standard library.
package coalescer
