// Package notifier is the ledger's change listener: one connection that
// LISTENs for the records trigger's notifications and wakes the callers
// waiting on a record, pings that measure whether notifications can be
// trusted, and polling while they cannot.
//
// It knows records only by the payload the trigger sends (RecordHash). It
// imports pgx and the standard library, never the ledger.
package notifier
