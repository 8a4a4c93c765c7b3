// Package replaycache is the ledger's replay cache: finished records
// (COMPLETED, FAILED_REPLAYABLE) kept in memory, so that a Begin that
// replays one needs no database round trip, invalidated by the change
// notifications of every replica.
//
// It names records by their notifications' hash and knows nothing of SQL.
// It imports statemachine and the standard library, never the ledger.
package replaycache
