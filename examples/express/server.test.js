'use strict';
// The example against a real coordinator: duplicates book one charge.

const test = require('node:test');
const assert = require('node:assert/strict');
const { Client } = require('idemcoord');
const { startCoordinator } = require('../../clients/node/test/coordinator');
const { createApp } = require('./server');

test('a charge sent ten times at once and retried books once', { timeout: 120000 }, async () => {
  const coord = await startCoordinator();
  const client = new Client(coord.addr, { token: coord.token });
  const { app, charges } = createApp(client);
  const server = app.listen(0, '127.0.0.1');
  await new Promise((resolve) => server.once('listening', resolve));
  const url = `http://127.0.0.1:${server.address().port}/charges`;
  try {
    const charge = () => fetch(url, {
      method: 'POST', headers: { 'Idempotency-Key': `order-${Date.now()}`, 'Content-Type': 'application/json' }, body: '{"amount":500}',
    });
    const key = `order-${Date.now()}`;
    const send = () => fetch(url, {
      method: 'POST', headers: { 'Idempotency-Key': key, 'Content-Type': 'application/json' }, body: '{"amount":500}',
    });
    const answers = await Promise.all(Array.from({ length: 10 }, send));
    const retry = await send();
    const bodies = await Promise.all([...answers, retry].map((r) => r.text()));
    assert.ok(answers.every((r) => r.status === 201), 'every duplicate answers 201');
    assert.ok(bodies.every((b) => b === bodies[0]), 'every duplicate gets the same charge');
    assert.equal(retry.headers.get('idempotency-result'), 'replayed');
    assert.equal(charges.length, 1, 'one charge booked');
    const missing = await fetch(url, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: '{"amount":1}' });
    assert.equal(missing.status, 400);
    assert.equal((await charge()).status, 201);
    assert.equal(charges.length, 2);
  } finally {
    server.closeAllConnections();
    server.close();
    await client.shutdown({ timeoutMs: 10000 });
    await coord.stop();
  }
});
