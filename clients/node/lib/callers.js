'use strict';
// The calling side: keys that survive retries, as Go's
// clients.UnaryClientInterceptor and clients.StampIdempotencyKey give them.

const crypto = require('node:crypto');
const grpc = require('@grpc/grpc-js');
const { parseIdempotencyKey } = require('./http');

const KEY_METADATA = 'idempotency-key';
const KEY_HEADER = 'Idempotency-Key';

/**
 * clientInterceptor is a grpc-js client interceptor (for a client's or
 * channel's `interceptors` option) that gives every outgoing call without
 * idempotency-key metadata a new UUIDv4 key. grpc-js retries a call (its
 * service config's retryPolicy, transparent retries) below its
 * interceptors, so every attempt of one call carries the same key, and a
 * guarded service runs it once. A call that sets the metadata itself keeps
 * its own key.
 */
function clientInterceptor() {
  return function idempotencyKeyInterceptor(options, nextCall) {
    return new grpc.InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        if (metadata.get(KEY_METADATA).length === 0) {
          metadata.set(KEY_METADATA, crypto.randomUUID());
        }
        next(metadata, listener);
      },
    });
  };
}

/**
 * stampIdempotencyKey gives a fetch request an Idempotency-Key header when
 * it has none (a new UUIDv4, written as a structured-field string:
 * "\"8e03978e-…\"") and returns the key it carries: the new one, or the one
 * it had (parsed as httpMiddleware does; the raw value when it does not
 * parse). target is a Headers, a Request, or a RequestInit (its headers, a
 * Headers, a plain object or an array of pairs, is replaced by a Headers
 * when it is not one). Call it once per operation, before the retry loop,
 * and send the same init on every attempt: the service then runs the
 * operation once.
 */
function stampIdempotencyKey(target) {
  let headers;
  if (target instanceof Headers) {
    headers = target;
  } else if (typeof Request !== 'undefined' && target instanceof Request) {
    headers = target.headers;
  } else if (target && typeof target === 'object') {
    if (!(target.headers instanceof Headers)) {
      target.headers = new Headers(target.headers ?? {});
    }
    headers = target.headers;
  } else {
    throw new TypeError('idemcoord: stampIdempotencyKey takes a Headers, a Request or a RequestInit');
  }
  const had = headers.get(KEY_HEADER);
  if (had) {
    try {
      return parseIdempotencyKey(had);
    } catch {
      return had;
    }
  }
  const key = crypto.randomUUID();
  headers.set(KEY_HEADER, `"${key}"`);
  return key;
}

module.exports = { clientInterceptor, stampIdempotencyKey };
