// Package keyring is the ledger's encryption at rest: the AES-256-GCM keys
// that seal a record's sensitive columns, the associated data that binds a
// ciphertext to its record, column and counters, and the keyed hashes that
// fingerprints are stored as.
//
// It knows nothing of SQL or of the ledger's types (a record is an ID).
// It imports only the standard library.
package keyring
