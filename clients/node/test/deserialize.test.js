'use strict';
// api.responseDeserializer (the Batch answers' deserializer of callBatching)
// makes the very objects @grpc/proto-loader's deserializer makes, int64
// fields included at the edges of what a number holds exactly.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const protobuf = require('protobufjs');
require('protobufjs/ext/descriptor');
const api = require('../lib/api');

const root = protobuf.Root.fromDescriptor(fs.readFileSync(api.descriptorPath));
const batchResponse = root.lookupType('idempotency.v1.BatchResponse');

/** The int64 values tried: small, the Timestamps' range, 2^32 and 2^53 either side, and int64's ends. */
const LONGS = ['0', '1', '-1', '1795883917', '-62135596800', '253402300799', '4294967295', '4294967296', '-4294967296',
  '9007199254740991', '9007199254740992', '-9007199254740991', '-9007199254740993', '9223372036854775807',
  '-9223372036854775808'];

function batchOf(n) {
  const ts = (seconds, nanos) => ({ seconds, nanos });
  const fp = Buffer.alloc(32, 7);
  const results = [];
  for (const n of LONGS) {
    results.push({
      begin: {
        outcome: 1, lease_token: 'lt', ttl: { seconds: n }, failure_ttl: { seconds: '0' }, retry_after: { seconds: n, nanos: 3 },
        record: {
          scope: 's', key: 'k', state: 1, fingerprint: fp, attempt: 3, generation: 2, created_at: ts(n, 5), updated_at: ts(n, 0),
          lease_expires_at: ts('0', 0), checkpoint: { phase: 'p', data: fp, at: ts(n, 1) },
          response: { body: Buffer.from('x'), metadata: [{ key: 'a', value: 'b' }], status_code: 2 },
        },
      },
    });
    results.push({ complete: { record: { scope: 's', key: 'k', state: 2, expires_at: ts(n, 9) } } });
    results.push({ error: { code: 5, message: 'm', details: [{ type_url: 'x', value: fp }] } });
    results.push({ heartbeat: { record: null } }, { lookup: {} }, {});
  }
  return Buffer.from(batchResponse.encode(batchResponse.fromObject({ results: results.slice(0, n) })).finish());
}

test('the Batch answers\' deserializer makes what proto-loader\'s makes', () => {
  const ours = api.responseDeserializer('idempotency.v1.BatchResponse');
  const theirs = api.CoordinatorClient.service.Batch.responseDeserialize;
  for (const bytes of [Buffer.alloc(0), batchOf(1), batchOf(Infinity)]) {
    const want = theirs(bytes);
    const got = ours(bytes);
    assert.deepStrictEqual(got, want);
    assert.equal(JSON.stringify(got), JSON.stringify(want)); // keys in the same order
  }
  const got = ours(batchOf(Infinity));
  assert.equal(got.results[0].begin.record.created_at.seconds, '0');
  assert.equal(got.results[6 * LONGS.indexOf('-9223372036854775808')].begin.ttl.seconds, '-9223372036854775808');
  assert.equal(got.results[6 * LONGS.indexOf('9007199254740992')].begin.record.updated_at.seconds, '9007199254740992');
});
