// Package clients is the Go side of idemcoord: a client for the
// idempotency.v1 Coordinator, a unary gRPC server interceptor that makes the
// methods of any Go gRPC service idempotent with one line, the same for
// net/http services as Idempotency-Key middleware, and helpers for
// deterministic idempotency keys.
//
// Four entry points:
//
//   - New wraps a connection to the coordinator in a Client. Its typed calls
//     (Begin, Complete, Fail, Lookup, Heartbeat) retry on UNAVAILABLE with
//     backoff, since each is safe to repeat; Begin always carries an
//     attempt_id so a retried Begin whose reply was lost gets the same lease
//     token back. Client.Once runs a function at most once per key.
//   - UnaryServerInterceptor installs the same guarantee on the unary
//     methods of a gRPC server.
//   - HTTPMiddleware installs it on the POST and PATCH requests with an
//     Idempotency-Key header of a net/http service.
//   - DedupKey builds a key for callers that send none.
//
// The interceptor goes after authentication and inside recovery, with the
// end user folded into the key (or WithoutPrincipal, said on purpose):
//
//	grpc.ChainUnaryInterceptor(recovery, auth,
//		clients.UnaryServerInterceptor(c, clients.WithPrincipal(userID)))
//
// What the interceptor stores is the handler's response message (or, for
// replayable failures, its gRPC status) with the headers and trailers the
// handler set; a retry with the same key gets that stored result decoded,
// never a second run of the handler. The idempotency-result response header
// says which happened ("created" or "replayed"); nothing else differs.
//
// Recovery a handler can trust:
//
//   - AttemptFrom and LeaseFrom tell a handler (or a function Once runs)
//     which attempt it is, what the key was before (STATE_UNKNOWN: an
//     earlier attempt may have done the side effect, check the outside world
//     first), and the lease token, key as stored and generation, with which
//     it can fence its own write under a unique constraint;
//   - MarkSideEffect, called just before the first irreversible step, makes
//     every later error or panic of the attempt end it UNKNOWN, whatever its
//     code: a failure after the charge is never taken for "nothing
//     happened";
//   - uncertainty is sticky on the coordinator: once an attempt may have
//     acted, every later attempt of the generation is told STATE_UNKNOWN,
//     even after a retryable or abandoned attempt in between;
//   - a holder that cannot confirm its lease (the coordinator is cut off)
//     has its context cancelled with cause ErrLeaseUnconfirmed before the
//     lease would run out by the local clock, so two holders never run at
//     once;
//   - giving up is safe: a caller whose context ends before the handler
//     runs (during Begin, while waiting, or just after the key was
//     acquired) leaves the key as if it had never come, since the library
//     releases the acquisition with Fail ABANDONED (ReleaseReason), and no
//     success is claimed for work not done (see Client.Once,
//     UnaryServerInterceptor and HTTPMiddleware).
//
// The package imports the generated API (gen/idempotency/v1), grpc,
// protobuf, genproto and go-grpc-middleware; it must never import the
// server, the ledger or a database driver: it knows nothing of PostgreSQL.
package clients
