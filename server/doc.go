// Package server implements idemcoord's gRPC services: the
// idempotency.v1.Coordinator API over a ledger.Store, request validation,
// per-scope policy, the one mapping from domain errors to gRPC status, the
// wiring of interceptors, health and reflection, and the HTTP listener's
// handler (metrics, health, and the API as HTTP/JSON through the same
// grpc.Server).
//
// It imports ledger, statemachine and the generated API; nothing imports it
// but the server binary and tests.
package server
