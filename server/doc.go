// Package server implements idemcoord's gRPC services: the
// idempotency.v1.Coordinator API over a ledger.Store, request validation,
// per-scope policy, the one mapping from domain errors to gRPC status, and
// the wiring of interceptors, health and reflection.
//
// It imports ledger, statemachine and the generated API; nothing imports it
// but the server binary and tests.
package server
