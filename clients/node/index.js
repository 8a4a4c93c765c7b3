'use strict';
// idemcoord: the Node client of the idemcoord idempotency coordinator.
// Types are in index.d.ts; docs/node.md in the repository shows
// a whole service.

const { Client, markSideEffect, currentLease, checkpoint, checkpointFrom } = require('./lib/client');
const { dedupKey, normalizeName } = require('./lib/dedup');
const errors = require('./lib/errors');
const http = require('./lib/http');
const { serverInterceptor } = require('./lib/grpc');
const { clientInterceptor, stampIdempotencyKey } = require('./lib/callers');

module.exports = {
  Client,
  dedupKey,
  normalizeName,
  markSideEffect,
  currentLease,
  checkpoint,
  checkpointFrom,
  httpMiddleware: http.httpMiddleware,
  fastifyPlugin: http.fastifyPlugin,
  serverInterceptor,
  clientInterceptor,
  stampIdempotencyKey,
  parseIdempotencyKey: http.parseIdempotencyKey,
  foldPrincipal: http.foldPrincipal,
  httpFingerprint: http.httpFingerprint,
  httpOperationScope: http.httpOperationScope,
  HTTP_SCHEMA_VERSION: http.HTTP_SCHEMA_VERSION,
  DEFAULT_HTTP_SCOPE: http.DEFAULT_HTTP_SCOPE,
  PROBLEMS: http.PROBLEMS,
  ...errors,
};
