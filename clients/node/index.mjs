// idemcoord as an ES module: the CommonJS package's exports, by name.
// test/package.test.js fails when a CommonJS export is missing here.
import idemcoord from './index.js';

export const {
  Client,
  dedupKey,
  normalizeName,
  markSideEffect,
  currentLease,
  checkpoint,
  checkpointFrom,
  httpMiddleware,
  fastifyPlugin,
  serverInterceptor,
  clientInterceptor,
  stampIdempotencyKey,
  parseIdempotencyKey,
  foldPrincipal,
  httpFingerprint,
  httpOperationScope,
  HTTP_SCHEMA_VERSION,
  DEFAULT_HTTP_SCOPE,
  PROBLEMS,
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
} = idemcoord;

export default idemcoord;
