'use strict';
// Recovery points (checkpoints) from Node against a real coordinator (see
// coordinator.js): once, an Express handler behind httpMiddleware, fencing,
// the abandon rule and the limits.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const express = require('express');
const grpc = require('@grpc/grpc-js');
const { Client, checkpoint, checkpointFrom, httpMiddleware, LeaseLostError } = require('..');
const { startCoordinator, clientOptions } = require('./coordinator');
const { fault } = require('./fault');

let coord;
const clients = [];

test.before(async () => {
  coord = await startCoordinator();
});

test.after(async () => {
  await Promise.all(clients.map((c) => c.shutdown({ timeoutMs: 10000 })));
  await coord.stop();
});

function newClient(opts = {}) {
  const c = new Client(coord.addr, clientOptions(coord, opts));
  clients.push(c);
  return c;
}

const TIMEOUT = { timeout: 300000 };
const uniqueKey = (prefix) => `${prefix}-${crypto.randomUUID()}`;
const grpcError = (code, message) => Object.assign(new Error(message), { code, details: message });

test('a checkpoint outlives a retryable failure and the next attempt resumes after it', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.checkpoint';
  const key = uniqueKey('order');
  await assert.rejects(c.once(scope, key, null, async (attempt) => {
    assert.equal(attempt.checkpointFrom(), null);
    await checkpoint('charged', Buffer.from('ch_1'));
    const own = checkpointFrom();
    assert.equal(own.phase, 'charged');
    assert.equal(own.data.toString(), 'ch_1');
    throw grpcError(grpc.status.UNAVAILABLE, 'provisioning backend down');
  }), /provisioning backend down/);
  const held = (await c.lookup({ scope, key })).record;
  assert.equal(held.state, 'STATE_FAILED_RETRYABLE');
  assert.equal(held.checkpoint.phase, 'charged');
  assert.equal(Buffer.from(held.checkpoint.data).toString(), 'ch_1');
  assert.ok(held.checkpoint.at, 'the coordinator stamps the checkpoint');

  const res = await c.once(scope, key, null, async (attempt) => {
    assert.equal(attempt.lease.previous, 'STATE_FAILED_RETRYABLE');
    const from = attempt.checkpointFrom();
    assert.equal(from.phase, 'charged');
    assert.equal(from.data.toString(), 'ch_1');
    from.data.fill(0); // a copy: the next read is unchanged
    assert.equal(checkpointFrom().data.toString(), 'ch_1');
    await attempt.checkpoint('provisioned', 'm_7');
    return { body: 'done' };
  });
  assert.equal(res.response.body.toString(), 'done');
  const done = (await c.lookup({ scope, key })).record;
  assert.equal(done.state, 'STATE_COMPLETED');
  assert.equal(done.checkpoint.phase, 'provisioned', 'a completed record keeps its last checkpoint');
});

test('an attempt that recorded a checkpoint is ended RETRYABLE, not ABANDONED', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.checkpoint';
  const key = uniqueKey('order');
  // INVALID_ARGUMENT is a caller mistake: without a checkpoint the attempt
  // is abandoned (no record); after one, the coordinator refuses that.
  await assert.rejects(c.once(scope, key, null, async () => {
    await checkpoint('charged', 'ch_2');
    throw grpcError(grpc.status.INVALID_ARGUMENT, 'bad address');
  }), /bad address/);
  const rec = (await c.lookup({ scope, key })).record;
  assert.equal(rec.state, 'STATE_FAILED_RETRYABLE');
  assert.equal(rec.checkpoint.phase, 'charged');
  // Without a checkpoint the same failure leaves no record.
  const key2 = uniqueKey('order');
  await assert.rejects(c.once(scope, key2, null, () => {
    throw grpcError(grpc.status.INVALID_ARGUMENT, 'bad address');
  }), /bad address/);
  await assert.rejects(c.lookup({ scope, key: key2 }), (err) => err.code === grpc.status.NOT_FOUND);
});

test('a checkpoint after the attempt lost the key is refused with LeaseLostError and changes nothing', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.checkpoint';
  const key = uniqueKey('order');
  await assert.rejects(c.once(scope, key, null, async (attempt) => {
    await attempt.checkpoint('charged', 'ch_3');
    // The attempt is ended behind the library's back (as a takeover would).
    await c.fail({ scope, key, lease_token: attempt.lease.token, kind: 'FAILURE_KIND_RETRYABLE', reason: 'test' });
    await assert.rejects(attempt.checkpoint('provisioned', 'm_3'), (err) => err instanceof LeaseLostError && err.cause?.code === grpc.status.FAILED_PRECONDITION);
    throw grpcError(grpc.status.UNAVAILABLE, 'stop');
  }));
  const rec = (await c.lookup({ scope, key })).record;
  assert.equal(rec.checkpoint.phase, 'charged', 'the refused checkpoint changed nothing');
});

test('bad checkpoints are refused INVALID_ARGUMENT and record nothing; outside an attempt checkpoint rejects', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.checkpoint';
  const key = uniqueKey('order');
  await assert.rejects(checkpoint('charged', 'x'), /outside an attempt/);
  assert.equal(checkpointFrom(), null);
  await c.once(scope, key, null, async () => {
    await assert.rejects(checkpoint('', 'x'), (err) => err.code === grpc.status.INVALID_ARGUMENT);
    await assert.rejects(checkpoint('p'.repeat(129), 'x'), (err) => err.code === grpc.status.INVALID_ARGUMENT);
    await assert.rejects(checkpoint('big', Buffer.alloc(64 * 1024 + 1)), (err) => err.code === grpc.status.INVALID_ARGUMENT);
    assert.equal(checkpointFrom(), null);
    return { body: 'ok' };
  });
  const rec = (await c.lookup({ scope, key })).record;
  assert.equal(rec.state, 'STATE_COMPLETED');
  assert.ok(!rec.checkpoint, 'no checkpoint was recorded');
});

test('checkpoint data is recorded byte for byte, and what checkpointFrom answers is a copy', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.checkpoint';
  const key = uniqueKey('order');
  await c.once(scope, key, null, async () => {
    // An ArrayBuffer: checkpointFrom must not follow later writes to it.
    const ab = new Uint8Array([1, 2, 3]).buffer;
    await checkpoint('charged', ab);
    new Uint8Array(ab).fill(9);
    assert.deepEqual([...checkpointFrom().data], [1, 2, 3]);
    // A view wider than a byte records its bytes, not its elements cut to 8 bits.
    const wide = new Uint16Array([0x0102, 0x0304]);
    await checkpoint('wide', wide);
    assert.deepEqual(checkpointFrom().data, Buffer.from(wide.buffer));
    // A view of part of a buffer records that part only.
    await checkpoint('part', new DataView(new Uint8Array([7, 8, 9, 10]).buffer, 1, 2));
    assert.deepEqual([...checkpointFrom().data], [8, 9]);
    // Anything else is refused before anything is sent.
    for (const bad of [42, [300, -1], { length: 2 }, true]) {
      await assert.rejects(checkpoint('bad', bad), TypeError, `data ${JSON.stringify(bad)}`);
    }
    // A phase that is not a string: checkpointFrom would answer it as given, the next attempt a string.
    for (const bad of [5, Buffer.from('charged'), { toString: () => 'charged' }, null]) {
      await assert.rejects(checkpoint(bad, 'x'), TypeError, `phase ${String(bad)}`);
    }
    assert.equal(checkpointFrom().phase, 'part');
    return { body: 'ok' };
  });
  const rec = (await c.lookup({ scope, key })).record;
  assert.equal(rec.checkpoint.phase, 'part');
  assert.deepEqual([...rec.checkpoint.data], [8, 9]);
});

test('an Express handler behind httpMiddleware records a checkpoint and its retry resumes after it', TIMEOUT, async () => {
  const c = newClient();
  const app = express();
  app.use(httpMiddleware(c, { service: 'node-checkpoint', withoutPrincipal: true }));
  let runs = 0;
  app.post('/orders', async (req, res) => {
    runs++;
    const from = checkpointFrom();
    if (!from) {
      await checkpoint('charged', `ch_${runs}`);
      res.status(503).send('provisioning backend down'); // retryable
      return;
    }
    res.status(201).send(`resumed after ${from.phase} (${from.data})`);
  });
  const server = app.listen(0, '127.0.0.1');
  await new Promise((resolve) => server.once('listening', resolve));
  const url = `http://127.0.0.1:${server.address().port}/orders`;
  const key = uniqueKey('order');
  try {
    const first = await fetch(url, { method: 'POST', headers: { 'Idempotency-Key': key } });
    assert.equal(first.status, 503);
    const second = await fetch(url, { method: 'POST', headers: { 'Idempotency-Key': key } });
    assert.equal(second.status, 201);
    assert.equal(await second.text(), 'resumed after charged (ch_1)');
    const replay = await fetch(url, { method: 'POST', headers: { 'Idempotency-Key': key } });
    assert.equal(replay.headers.get('idempotency-result'), 'replayed');
    assert.equal(runs, 2);
  } finally {
    server.close();
  }
});

test('an ABANDONED refused CHECKPOINT_RECORDED in the background (the coordinator was down) is sent again as RETRYABLE', TIMEOUT, async () => {
  const fails = fault('Fail');
  const c = new Client(coord.addr, { token: coord.token, interceptors: [fails.interceptor], maxAttempts: 1 });
  const scope = 'node.checkpoint';
  const key = uniqueKey('order');
  await assert.rejects(c.once(scope, key, null, async (attempt) => {
    // A checkpoint the library does not know of: the application's own Heartbeat.
    await c.heartbeat({ scope, key, lease_token: attempt.lease.token, checkpoint: { phase: 'charged', data: Buffer.from('ch_own') } });
    fails.cutOff = true; // the end of the attempt cannot reach the coordinator
    throw grpcError(grpc.status.INVALID_ARGUMENT, 'address rejected after the charge');
  }), /address rejected/);
  fails.cutOff = false;
  await c.shutdown(); // waits for the ending retried in the background
  const rec = (await newClient().lookup({ scope, key })).record;
  assert.equal(rec.state, 'STATE_FAILED_RETRYABLE');
  assert.equal(rec.checkpoint.phase, 'charged');
  assert.ok(fails.requests.some((r) => r.kind === 'FAILURE_KIND_ABANDONED'), 'the library first tried ABANDONED');
});

test('of concurrent checkpoints, checkpointFrom keeps the one the coordinator wrote last', TIMEOUT, async () => {
  // The answer of the Heartbeat that records "first" is held back until "second" was answered.
  let markWritten;
  const written = new Promise((resolve) => { markWritten = resolve; });
  let release;
  const released = new Promise((resolve) => { release = resolve; });
  let heldOne = false;
  const holdFirst = (options, nextCall) => {
    let mine = false;
    return new grpc.InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        next(metadata, {
          onReceiveMessage(message, nextMessage) {
            if (!mine) {
              nextMessage(message);
              return;
            }
            markWritten();
            released.then(() => nextMessage(message));
          },
        });
      },
      sendMessage(message, next) {
        if (!heldOne && message?.checkpoint?.phase === 'first') {
          heldOne = true;
          mine = true;
        }
        next(message);
      },
    });
  };
  // Unbatched, so that each Heartbeat is its own call the interceptor sees.
  const c = newClient({ callBatching: 0, interceptors: [holdFirst] });
  const scope = 'node.checkpoint';
  const key = uniqueKey('concurrent');
  let seen;
  await c.once(scope, key, null, async () => {
    const first = checkpoint('first', Buffer.from('1'));
    await written;
    await checkpoint('second', Buffer.from('2'));
    release();
    await first;
    seen = checkpointFrom();
    return { body: 'done' };
  });
  const rec = (await c.lookup({ scope, key })).record;
  assert.equal(rec.checkpoint.phase, 'second', 'the coordinator wrote second last');
  assert.equal(seen.phase, 'second', 'checkpointFrom keeps the checkpoint written last, not the one answered last');
  assert.equal(seen.data.toString(), '2');
});
