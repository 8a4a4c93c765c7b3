'use strict';
// index.d.ts's enum unions are the proto's (idempotency.binpb), not copies.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const protobuf = require('protobufjs');
const descriptor = require('protobufjs/ext/descriptor');
const { render, current } = require('./proto-types');
const { REASONS } = require('..');

test('index.d.ts\'s enum unions are the descriptor set\'s enums', () => {
  assert.equal(current(), render(), 'index.d.ts differs from idempotency.binpb: run `node test/proto-types.js --write`');
  for (const name of Object.keys(REASONS)) {
    assert.match(current(), new RegExp(`'${name}'`), `ErrorReasonName lacks ${name}`);
  }
});

test('a value the proto gains makes the check fail', () => {
  const root = protobuf.Root.fromDescriptor(fs.readFileSync(path.join(__dirname, '..', 'idempotency.binpb')));
  root.lookupEnum('idempotency.v1.State').add('STATE_ON_MARS', 99);
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'idemcoord-types-'));
  try {
    const changed = path.join(dir, 'changed.binpb');
    fs.writeFileSync(changed, descriptor.FileDescriptorSet.encode(root.toDescriptor('proto3')).finish());
    assert.notEqual(current(), render(changed));
    assert.match(render(changed), /'STATE_ON_MARS'/);
  } finally {
    fs.rmSync(dir, { recursive: true });
  }
});
