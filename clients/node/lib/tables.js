'use strict';
// The tables every client library shares (HTTP header names, problem types, how a gRPC code's
// failure is recorded, the release reason and timings, the ErrorInfo
// domain), loaded from shared_tables.json: a copy of
// clients/testdata/shared_tables.json that `make generate` writes, which
// the Go client's tests hold against its constants.

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');

const tablesPath = path.join(__dirname, '..', 'shared_tables.json');
const raw = JSON.parse(fs.readFileSync(tablesPath, 'utf8'));

const camel = (s) => s.replace(/_([a-z])/g, (_, c) => c.toUpperCase());

/** Problem types (RFC 9457) by camelCase name: PROBLEM_TYPES.keyReused. */
const PROBLEM_TYPES = Object.freeze(Object.fromEntries(
  Object.entries(raw.problem_types).map(([name, urn]) => [camel(name), urn])));

/** The HTTP middleware's header names by name: HTTP_HEADERS.replayed === 'Idempotent-Replayed'. */
const HTTP_HEADERS = Object.freeze({ ...raw.http_headers });

/** How a failure is recorded by its gRPC code (a number): FAILURE_KINDS[14] === 'FAILURE_KIND_RETRYABLE'. */
const FAILURE_KINDS = Object.freeze(Object.fromEntries(
  Object.entries(raw.failure_kind_by_code).map(([code, kind]) => {
    if (!Number.isInteger(grpc.status[code])) {
      throw new Error(`idemcoord: ${tablesPath}: ${code} is not a gRPC status code`);
    }
    return [grpc.status[code], kind];
  })));

module.exports = {
  tablesPath,
  ERROR_INFO_DOMAIN: raw.error_info_domain,
  PROBLEM_TYPES,
  HTTP_HEADERS,
  FAILURE_KINDS,
  RELEASE_REASON: raw.release.reason,
  RELEASE_TIMEOUT_MS: raw.release.timeout_ms,
  DEFAULT_LEASE_MS: raw.timings_ms.default_lease,
  MIN_HEARTBEAT_MS: raw.timings_ms.min_heartbeat,
  FINISH_TIMEOUT_MS: raw.timings_ms.finish_timeout,
  MAX_BEGIN_WAIT_MS: raw.timings_ms.max_begin_wait,
};
