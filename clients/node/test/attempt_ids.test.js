'use strict';
// Attempt ids: each Client cuts them from its own pool of random bytes
// (lib/client.js AttemptIds); no pool is shared through the module.

const test = require('node:test');
const assert = require('node:assert/strict');
const { Client } = require('..');
const { AttemptIds } = require('../lib/client');

test('an AttemptIds source gives 32 hex digits and never repeats across pool refills', () => {
  const ids = new AttemptIds();
  const seen = new Set();
  for (let i = 0; i < 256 * 4 + 3; i++) {
    const id = ids.next();
    assert.match(id, /^[0-9a-f]{32}$/);
    assert.ok(!seen.has(id), `id ${i} repeated`);
    seen.add(id);
  }
});

test('two clients draw from two pools: taking ids from one does not move the other', () => {
  const a = new Client('127.0.0.1:1');
  const b = new Client('127.0.0.1:1');
  try {
    assert.notEqual(a._attemptIds, b._attemptIds);
    const firstOfB = b._attemptIds._offset;
    for (let i = 0; i < 10; i++) {
      a._newAttemptId();
    }
    assert.equal(b._attemptIds._offset, firstOfB);
    assert.equal(a._attemptIds._offset, 10 * 16);
  } finally {
    a.close();
    b.close();
  }
});
