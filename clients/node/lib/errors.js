'use strict';

const grpc = require('@grpc/grpc-js');
const { REASONS, reasonName } = require('./api');

/** The ErrorInfo reason of a key held UNKNOWN for an operator. */
const REASON_UNKNOWN_HELD = reasonName('ERROR_REASON_UNKNOWN_HELD');
/** The schema version of a stored failure whose body is a google.rpc.Status. */
const SCHEMA_VERSION_STATUS = 'google.rpc.Status';
/** The content type of stored protobuf bodies. */
const CONTENT_TYPE_PROTO = 'application/x-protobuf';

// The reasons an attempt's signal is aborted with carry status and
// statusCode 503: a handler that gives up by throwing its signal's reason
// (signal.throwIfAborted(), an aborted fetch) is answered 503 by Express's
// and Fastify's error handlers, which the HTTP middleware records as
// nothing done (FAILURE_KIND_RETRYABLE; UNKNOWN after markSideEffect).

/**
 * LeaseLostError: a heartbeat learnt that another attempt took the key over
 * (or it ended or was forgotten). It is the reason fn's signal is aborted
 * with, and what once rejects with; nothing is recorded (the new holder will).
 */
class LeaseLostError extends Error {
  constructor(message = 'idemcoord: the lease on the idempotency key was lost') {
    super(message);
    this.name = 'LeaseLostError';
    this.status = 503;
    this.statusCode = 503;
  }
}

/**
 * LeaseUnconfirmedError: no heartbeat reached the coordinator before the
 * lease would run out by the local clock, so another attempt may take the
 * key over. fn's signal is aborted with it.
 */
class LeaseUnconfirmedError extends Error {
  constructor(message = 'idemcoord: the lease could not be confirmed before it ran out') {
    super(message);
    this.name = 'LeaseUnconfirmedError';
    this.status = 503;
    this.statusCode = 503;
  }
}

/**
 * ClientGoneError: the client of a guarded HTTP request went away before
 * its answer was sent. The handler's signal (req.idempotency.signal) is
 * aborted with it; the handler may still end its answer, which is recorded.
 */
class ClientGoneError extends Error {
  constructor(message = 'idemcoord: the client went away') {
    super(message);
    this.name = 'ClientGoneError';
    this.status = 503;
    this.statusCode = 503;
  }
}

/**
 * UnknownHeldError: the key is held UNKNOWN for an operator (policy
 * on_unknown: hold); retrying will not help. code is FAILED_PRECONDITION.
 */
class UnknownHeldError extends Error {
  constructor() {
    super('idemcoord: the outcome of an earlier attempt with this idempotency key is unknown and held for an operator');
    this.name = 'UnknownHeldError';
    this.code = grpc.status.FAILED_PRECONDITION;
    this.reason = REASON_UNKNOWN_HELD;
  }
}

/**
 * FailureError lets fn say how its failure is recorded: kind is a
 * FailureKind name ('FAILURE_KIND_REPLAYABLE', ...); response is stored with
 * a REPLAYABLE failure (default: the gRPC status of cause, or of this error).
 */
class FailureError extends Error {
  constructor(kind, { response = null, cause, code, message } = {}) {
    super(message ?? (cause instanceof Error ? cause.message : `failed (${kind})`), cause === undefined ? undefined : { cause });
    this.name = 'FailureError';
    this.kind = kind;
    this.response = response;
    if (code !== undefined) {
      this.code = code;
    } else if (cause && typeof cause.code === 'number') {
      this.code = cause.code;
    }
  }
}

/**
 * StoredFailureError: the recorded outcome is a replayable failure, recorded
 * now (cause is fn's error) or earlier (a replay). code and details are the
 * stored gRPC status; result is the Result with the stored response.
 */
class StoredFailureError extends Error {
  constructor({ code, details, result, cause }) {
    super(details || 'replayed failure', cause === undefined ? undefined : { cause });
    this.name = 'StoredFailureError';
    this.code = code;
    this.details = details;
    this.result = result;
  }
}

module.exports = {
  REASONS,
  REASON_UNKNOWN_HELD,
  SCHEMA_VERSION_STATUS,
  CONTENT_TYPE_PROTO,
  LeaseLostError,
  LeaseUnconfirmedError,
  ClientGoneError,
  UnknownHeldError,
  FailureError,
  StoredFailureError,
};
