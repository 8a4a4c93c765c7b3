'use strict';
// The tables the three libraries share come from one file,
// clients/testdata/shared_tables.json (Go's tests hold it against Go's
// constants); the package ships a copy, shared_tables.json.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protobuf = require('protobufjs');
require('protobufjs/ext/descriptor');
const idemcoord = require('..');
const tables = require('../lib/tables');
const api = require('../lib/api');
const { DEFAULT_FAILURE_KINDS, RELEASE_REASON } = require('../lib/client');

const shared = JSON.parse(fs.readFileSync(path.join(__dirname, '..', '..', 'testdata', 'shared_tables.json'), 'utf8'));

test('the package\'s tables are clients/testdata/shared_tables.json', () => {
  assert.deepEqual(JSON.parse(fs.readFileSync(tables.tablesPath, 'utf8')), shared,
    'shared_tables.json differs from clients/testdata/shared_tables.json: run `make generate`');
  assert.deepEqual(Object.values(idemcoord.PROBLEMS).sort(), Object.values(shared.problem_types).sort());
  assert.equal(idemcoord.PROBLEMS.leaseLost, shared.problem_types.lease_lost);
  assert.deepEqual(Object.fromEntries(Object.entries(DEFAULT_FAILURE_KINDS).map(([code, kind]) => [
    Object.keys(grpc.status).find((k) => grpc.status[k] === Number(code)), kind])), shared.failure_kind_by_code);
  assert.equal(RELEASE_REASON, shared.release.reason);
  assert.equal(tables.RELEASE_TIMEOUT_MS, shared.release.timeout_ms);
  assert.equal(tables.ERROR_INFO_DOMAIN, 'idempotency.v1');
});

test('ErrorInfo details are google.rpc.ErrorInfo of the descriptor set, in domain idempotency.v1', () => {
  const root = protobuf.Root.fromDescriptor(fs.readFileSync(api.descriptorPath));
  const Status = root.lookupType('google.rpc.Status');
  const ErrorInfo = root.lookupType('google.rpc.ErrorInfo');
  const bytes = api.encodeErrorInfoStatus(grpc.status.FAILED_PRECONDITION, 'held', idemcoord.REASON_UNKNOWN_HELD);
  const st = Status.decode(bytes);
  assert.equal(st.details.length, 1);
  assert.equal(st.details[0].type_url, 'type.googleapis.com/google.rpc.ErrorInfo');
  const info = ErrorInfo.decode(st.details[0].value);
  assert.equal(info.reason, 'UNKNOWN_HELD');
  assert.equal(info.domain, shared.error_info_domain);
  // As sent by Go: a reason with metadata and another detail before it.
  const other = { type_url: 'type.googleapis.com/google.rpc.RetryInfo', value: Buffer.from([0x0a, 0x00]) };
  const goLike = Status.encode(Status.fromObject({
    code: 9, message: 'x', details: [other, { type_url: 'type.googleapis.com/google.rpc.ErrorInfo',
      value: ErrorInfo.encode(ErrorInfo.fromObject({ reason: 'LEASE_LOST', domain: 'idempotency.v1', metadata: [{ key: 'a', value: 'b' }] })).finish() }],
  })).finish();
  assert.equal(api.errorInfoReason(Buffer.from(goLike)), 'LEASE_LOST');
  assert.equal(api.errorInfoReason(api.encodeStatus({ code: 9, message: 'no details' })), '');
});
