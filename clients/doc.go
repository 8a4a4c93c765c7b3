// Package clients is the Go side of idemcoord: a client for the
// idempotency.v1 Coordinator, a unary gRPC server interceptor that makes the
// methods of any Go gRPC service idempotent with one line, and helpers for
// deterministic idempotency keys.
//
// Three entry points:
//
//   - New wraps a connection to the coordinator in a Client. Its typed calls
//     (Begin, Complete, Fail, Lookup, Heartbeat) retry on UNAVAILABLE with
//     backoff, since each is safe to repeat; Begin always carries an
//     attempt_id so a retried Begin whose reply was lost gets the same lease
//     token back. Client.Once runs a function at most once per key.
//   - UnaryServerInterceptor installs the same guarantee on the unary
//     methods of a gRPC server.
//   - DedupKey builds a key for callers that send none.
//
// The interceptor goes after authentication and inside recovery:
//
//	grpc.ChainUnaryInterceptor(recovery, auth, clients.UnaryServerInterceptor(c))
//
// What the interceptor stores is the handler's response message (or, for
// replayable failures, its gRPC status); a retry with the same key gets that
// stored result decoded, never a second run of the handler. The
// idempotency-result response header says which happened ("created" or
// "replayed").
//
// The package imports the generated API (gen/idempotency/v1), grpc,
// protobuf, genproto and go-grpc-middleware; it must never import the
// server, the ledger or a database driver: it knows nothing of PostgreSQL.
package clients
