#!/usr/bin/env node
// Begin -> Complete -> Begin (replay) against an idemcoord coordinator, from
// Node with @grpc/grpc-js. @grpc/proto-loader loads the API from
// examples/polyglot/idempotency.binpb, a FileDescriptorSet of proto/ and its
// imports (buf/validate/validate.proto, google/protobuf/*) made by
//   bin/buf build --as-file-descriptor-set --exclude-source-info -o examples/polyglot/idempotency.binpb
// (a Go test fails when it is stale). It does not parse the .proto files:
// protobufjs cannot read the list-valued options in validate.proto.
//
//   cd examples/node && npm ci && node replay.js 127.0.0.1:50051
//
// Set IDEMCOORD_TOKEN when the coordinator has auth on. It exits 0 only if
// the second Begin replayed exactly the response the first attempt stored.
'use strict';

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const descriptors = path.join(__dirname, '..', 'polyglot', 'idempotency.binpb');

function loadAPI() {
  const def = protoLoader.loadFileDescriptorSetFromBuffer(fs.readFileSync(descriptors), {
    keepCase: true,
    longs: String,
    enums: String, // enum values as their names, e.g. 'OUTCOME_REPLAY'
    bytes: Buffer,
    defaults: true,
  });
  return grpc.loadPackageDefinition(def).idempotency.v1;
}

// sortedEntries lists a map field's entries as [key, value] pairs by key.
function sortedEntries(entries) {
  return (entries || []).map((e) => [e.key, e.value]).sort();
}

// call makes a unary call and resolves with its response.
function call(client, method, request, md) {
  return new Promise((resolve, reject) => {
    client[method](request, md, { deadline: Date.now() + 10000 }, (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

async function main() {
  const addr = process.argv[2];
  if (!addr) {
    console.error('usage: node replay.js HOST:PORT');
    process.exit(2);
  }
  const api = loadAPI();
  const client = new api.Coordinator(addr, grpc.credentials.createInsecure());
  const md = new grpc.Metadata();
  if (process.env.IDEMCOORD_TOKEN) {
    md.set('authorization', `Bearer ${process.env.IDEMCOORD_TOKEN}`);
  }
  const scope = 'examples.node.charge';
  const key = `node-${crypto.randomUUID()}`;
  const fingerprint = crypto.createHash('sha256').update('charge 42 EUR to card 4242').digest();

  const first = await call(client, 'Begin', { scope, key, fingerprint }, md);
  if (first.outcome !== 'OUTCOME_ACQUIRED') {
    throw new Error(`first Begin answered ${first.outcome}, want OUTCOME_ACQUIRED`);
  }
  // The operation's result, stored byte for byte (not valid UTF-8 on purpose).
  const stored = {
    schema_version: 'examples.ChargeResponse/1',
    content_type: 'application/octet-stream',
    body: Buffer.concat([Buffer.from('charge ch_42 from node '), Buffer.from([0x00, 0xff, 0xfe])]),
    status_code: 201,
    // Loaded from descriptors, a map field is its repeated entry messages.
    metadata: [{ key: 'x-charge-id', value: 'ch_42' }],
  };
  await call(client, 'Complete', { scope, key, lease_token: first.lease_token, response: stored }, md);

  const again = await call(client, 'Begin', { scope, key, fingerprint }, md);
  const got = again.record && again.record.response;
  const same = again.outcome === 'OUTCOME_REPLAY' && got &&
    Buffer.compare(got.body, stored.body) === 0 &&
    got.schema_version === stored.schema_version &&
    got.content_type === stored.content_type &&
    got.status_code === stored.status_code &&
    JSON.stringify(sortedEntries(got.metadata)) === JSON.stringify(sortedEntries(stored.metadata));
  if (!same) {
    throw new Error(`second Begin answered ${again.outcome} with ${JSON.stringify(got)}, want a replay of ${JSON.stringify(stored)}`);
  }
  console.log(`replayed ${got.body.length} bytes for ${scope}/${key}: ${got.schema_version}, status ${got.status_code}`);
  client.close();
}

main().catch((err) => {
  console.error(`node example failed: ${err.code !== undefined ? `gRPC code ${err.code}: ${err.details}` : err.message}`);
  process.exit(1);
});
