'use strict';
// Call batching (the Client's callBatching option) against a real
// coordinator: calls share Batch RPCs, and each keeps what its unary call
// has (answer, error, deadline, retries, the release of a given-up Begin).

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const grpc = require('@grpc/grpc-js');
const { Client, REASONS } = require('..');
const api = require('../lib/api');
const { startCoordinator } = require('./coordinator');
const { fault, until } = require('./fault');

let coord;
const clients = [];

test.before(async () => {
  coord = await startCoordinator();
});

test.after(async () => {
  await Promise.all(clients.map((c) => c.shutdown({ timeoutMs: 10000 })));
  await coord.stop();
});

function newClient(options = {}) {
  const c = new Client(coord.addr, { token: coord.token, ...options });
  clients.push(c);
  return c;
}

/**
 * A batching Client (2 Batch RPCs in flight) whose RPCs are counted: batch
 * is fault('Batch') (with its holds and lost replies), unary counts every
 * other RPC by method.
 */
function batchingClient(options = {}) {
  const batch = fault('Batch');
  const unary = {};
  const flight = { now: 0, most: 0 }; // Batch RPCs in flight
  const count = (opts, nextCall) => {
    const method = opts.method_definition.path.split('/').pop();
    if (method !== 'Batch') {
      unary[method] = (unary[method] ?? 0) + 1;
      return new grpc.InterceptingCall(nextCall(opts));
    }
    return new grpc.InterceptingCall(nextCall(opts), {
      start(metadata, listener, next) {
        flight.most = Math.max(flight.most, ++flight.now);
        next(metadata, {
          onReceiveStatus(status, nextStatus) {
            flight.now--;
            nextStatus(status);
          },
        });
      },
    });
  };
  const c = newClient({ callBatching: 2, ...options, interceptors: [count, batch.interceptor, ...(options.interceptors ?? [])] });
  return { c, batch, unary, flight };
}

const TIMEOUT = { timeout: 300000 };
const uniqueKey = (prefix) => `${prefix}-${crypto.randomUUID()}`;
const SCOPE = 'batching';

/** The ErrorInfo reason of a gRPC error ('' when none). */
function reasonOf(err) {
  const raw = err?.metadata?.get?.('grpc-status-details-bin')?.[0];
  return raw ? api.errorInfoReason(raw) : '';
}

/** What p rejected with (fails when it resolved). */
async function rejection(p) {
  try {
    await p;
  } catch (err) {
    return err;
  }
  assert.fail('resolved, want a rejection');
}

test('concurrent calls share Batch RPCs, at most callBatching in flight, each with its own answer', TIMEOUT, async () => {
  const { c, batch, unary, flight } = batchingClient();
  const keys = Array.from({ length: 64 }, () => uniqueKey('pair'));
  await Promise.all(keys.map(async (key) => {
    const b = await c.begin({ scope: SCOPE, key });
    assert.equal(b.outcome, 'OUTCOME_ACQUIRED');
    const body = Buffer.from(`body-${key}`);
    await c.complete({ scope: SCOPE, key, lease_token: b.lease_token, response: { body, metadata: { 'x-key': key } } });
    const r = await c.begin({ scope: SCOPE, key });
    assert.equal(r.outcome, 'OUTCOME_REPLAY');
    assert.ok(r.record.response.body.equals(body), 'replayed another call\'s body');
    assert.deepEqual({ ...r.record.response.metadata }, { 'x-key': key });
  }));
  assert.deepEqual(unary, {}, 'no call went unary');
  assert.ok(batch.calls < (3 * keys.length) / 2, `${3 * keys.length} calls took ${batch.calls} Batch RPCs: they were not shared`);
  assert.ok(flight.most <= 2, `${flight.most} Batch RPCs in flight at once`);
  // What the batched client answered is what a unary client reads.
  const plain = newClient();
  const rec = await plain.lookup({ scope: SCOPE, key: keys[7] });
  assert.equal(rec.record.state, 'STATE_COMPLETED');
  assert.equal(rec.record.response.body.toString(), `body-${keys[7]}`);
});

test('a batched call fails as its unary call does, without failing the others of its batch', TIMEOUT, async () => {
  const { c, batch } = batchingClient();
  const plain = newClient();
  const key = uniqueKey('errors');
  const held = await c.begin({ scope: SCOPE, key });
  const before = batch.calls;
  const [good, invalid, lost, missing] = await Promise.allSettled([
    c.begin({ scope: SCOPE, key: uniqueKey('good') }),
    c.begin({ scope: SCOPE, key: '' }),
    c.complete({ scope: SCOPE, key, lease_token: 'not-the-token', response: {} }),
    c.lookup({ scope: SCOPE, key: uniqueKey('missing') }),
  ]);
  assert.equal(batch.calls, before + 1, 'the four calls went in one Batch RPC');
  assert.equal(good.status, 'fulfilled');
  assert.equal(good.value.outcome, 'OUTCOME_ACQUIRED');
  const unary = await Promise.allSettled([
    plain.begin({ scope: SCOPE, key: '' }),
    plain.complete({ scope: SCOPE, key, lease_token: 'not-the-token', response: {} }),
    plain.lookup({ scope: SCOPE, key: uniqueKey('missing') }),
  ]);
  for (const [i, got] of [invalid, lost, missing].entries()) {
    const want = unary[i];
    assert.equal(got.status, 'rejected');
    assert.equal(want.status, 'rejected');
    assert.equal(got.reason.code, want.reason.code);
    assert.equal(got.reason.message, want.reason.message);
    assert.equal(reasonOf(got.reason), reasonOf(want.reason));
  }
  assert.equal(invalid.reason.code, grpc.status.INVALID_ARGUMENT);
  assert.equal(reasonOf(lost.reason), REASONS.LEASE_LOST);
  assert.equal(lost.reason.code, grpc.status.FAILED_PRECONDITION);
  assert.equal(missing.reason.code, grpc.status.NOT_FOUND);
  // The refused Complete changed nothing: the key is still held.
  await c.complete({ scope: SCOPE, key, lease_token: held.lease_token, response: { body: 'ok' } });
});

test('a batched call\'s deadline ends it alone', TIMEOUT, async () => {
  const { c, batch } = batchingClient();
  let release;
  batch.hold = { call: batch.calls + 1, until: new Promise((r) => { release = r; }) };
  const key = uniqueKey('deadline');
  const short = c.lookup({ scope: SCOPE, key: uniqueKey('short') }, { timeoutMs: 200 });
  const long = c.begin({ scope: SCOPE, key }, { timeoutMs: 60000 });
  try {
    const err = await rejection(short); // while their Batch's answer is held back
    assert.equal(err.code, grpc.status.DEADLINE_EXCEEDED);
    assert.ok(batch.held, 'both calls went in the held Batch');
  } finally {
    release();
  }
  assert.equal((await long).outcome, 'OUTCOME_ACQUIRED');
});

test('a caller that gives up on a batched Begin releases what it acquired', TIMEOUT, async () => {
  const { c, batch } = batchingClient();
  const plain = newClient();
  let release;
  batch.hold = { call: batch.calls + 1, until: new Promise((r) => { release = r; }) };
  const key = uniqueKey('give-up');
  const abort = new AbortController();
  const given = c.begin({ scope: SCOPE, key }, { signal: abort.signal });
  await until(() => batch.held); // the coordinator has acquired; its answer is held back
  abort.abort(new Error('caller gave up'));
  release();
  const err = await rejection(given);
  assert.equal(err.code, grpc.status.CANCELLED);
  // Released with Fail ABANDONED before the rejection: another attempt acquires at once.
  const again = await plain.begin({ scope: SCOPE, key });
  assert.equal(again.outcome, 'OUTCOME_ACQUIRED');
});

test('a batched Begin whose answer comes later than the release timeout is released in the background', TIMEOUT, async () => {
  const { c, batch } = batchingClient();
  const plain = newClient();
  let release;
  batch.hold = { call: batch.calls + 1, until: new Promise((r) => { release = r; }) };
  const key = uniqueKey('late');
  const abort = new AbortController();
  const given = c.begin({ scope: SCOPE, key }, { signal: abort.signal });
  await until(() => batch.held);
  abort.abort(new Error('caller gave up'));
  const err = await rejection(given); // after the release timeout, the answer still held back
  assert.equal(err.code, grpc.status.CANCELLED);
  assert.equal((await plain.lookup({ scope: SCOPE, key })).record.state, 'STATE_IN_PROGRESS');
  release();
  await c.shutdown({ timeoutMs: 30000 }); // waits for the background release
  await assert.rejects(plain.lookup({ scope: SCOPE, key }), (e) => e.code === grpc.status.NOT_FOUND);
});

test('once through a batching Client: a caller that gives up while its Begin is in flight leaves the key free', TIMEOUT, async () => {
  const { c, batch } = batchingClient();
  const plain = newClient();
  let release;
  batch.hold = { call: batch.calls + 1, until: new Promise((r) => { release = r; }) };
  const key = uniqueKey('once-give-up');
  const abort = new AbortController();
  let ran = false;
  const given = c.once(SCOPE, key, 'fp', async () => {
    ran = true;
    return { body: 'x' };
  }, { signal: abort.signal });
  await until(() => batch.held);
  abort.abort(new Error('caller gave up'));
  release();
  assert.equal((await rejection(given)).message, 'caller gave up');
  assert.equal(ran, false);
  assert.equal((await plain.begin({ scope: SCOPE, key, fingerprint: Buffer.from('fp') })).outcome, 'OUTCOME_ACQUIRED');
});

test('once runs fn once among 16 concurrent callers through a batching Client', TIMEOUT, async () => {
  const { c, batch } = batchingClient();
  const key = uniqueKey('once');
  let runs = 0;
  const results = await Promise.allSettled(Array.from({ length: 16 }, () => c.once(SCOPE, key, 'fp', async () => {
    runs++;
    await new Promise((r) => setTimeout(r, 50));
    return { body: 'done' };
  }, { signal: AbortSignal.timeout(60000) })));
  assert.equal(runs, 1);
  for (const r of results) {
    assert.equal(r.status, 'fulfilled', r.reason?.message);
    assert.equal(r.value.response.body.toString(), 'done');
  }
  assert.ok(batch.calls > 0);
});

test('with callBatching 1, one Batch RPC is in flight at a time and the calls made meanwhile go in the next', TIMEOUT, async () => {
  const { c, batch, flight } = batchingClient({ callBatching: 1 });
  let release;
  batch.hold = { call: batch.calls + 1, until: new Promise((r) => { release = r; }) };
  const first = c.lookup({ scope: SCOPE, key: uniqueKey('first') }).catch((err) => err);
  await until(() => batch.held);
  const later = Array.from({ length: 10 }, () => c.begin({ scope: SCOPE, key: uniqueKey('later') }));
  try {
    await new Promise((r) => setTimeout(r, 50)); // nothing is sent while the first is in flight
    assert.equal(batch.calls, 1);
  } finally {
    release();
  }
  assert.equal((await first).code, grpc.status.NOT_FOUND);
  for (const b of await Promise.all(later)) {
    assert.equal(b.outcome, 'OUTCOME_ACQUIRED');
  }
  assert.equal(batch.calls, 2, 'the ten calls made meanwhile went in one Batch');
  assert.equal(flight.most, 1);
});

test('with callBatching 2, a call made while one Batch RPC is in flight goes at once in a second', TIMEOUT, async () => {
  const { c, batch, flight } = batchingClient({ callBatching: 2 });
  let release;
  batch.hold = { call: batch.calls + 1, until: new Promise((r) => { release = r; }) };
  const first = c.lookup({ scope: SCOPE, key: uniqueKey('first') }).catch((err) => err);
  await until(() => batch.held);
  try {
    const second = await Promise.race([
      c.begin({ scope: SCOPE, key: uniqueKey('second') }), // answered while the first is held
      new Promise((r) => setTimeout(r, 60000, 'waited for the first')),
    ]);
    assert.equal(second.outcome, 'OUTCOME_ACQUIRED');
    assert.equal(flight.most, 2);
  } finally {
    release();
  }
  assert.equal((await first).code, grpc.status.NOT_FOUND);
});

test('a Batch RPC whose reply was lost is retried by each of its calls', TIMEOUT, async () => {
  const { c, batch, unary } = batchingClient();
  const keys = Array.from({ length: 8 }, () => uniqueKey('lost'));
  batch.loseReplies = 1;
  const begun = await Promise.all(keys.map((key) => c.begin({ scope: SCOPE, key, attempt_id: `a-${key}` })));
  assert.ok(batch.statuses.includes(grpc.status.UNAVAILABLE), 'a Batch reply was lost');
  for (const b of begun) {
    assert.equal(b.outcome, 'OUTCOME_ACQUIRED'); // the retry, with the same attempt_id, gets the same acquisition
  }
  await Promise.all(keys.map((key, i) => c.complete({ scope: SCOPE, key, lease_token: begun[i].lease_token, response: { body: key } })));
  assert.deepEqual(unary, {});
});

test('a Batch RPC that keeps failing UNAVAILABLE fails each call with it', TIMEOUT, async () => {
  const { c, batch } = batchingClient({ maxAttempts: 2, backoffMs: 1 });
  batch.cutOff = true;
  const results = await Promise.allSettled([c.lookup({ scope: SCOPE, key: 'a' }), c.lookup({ scope: SCOPE, key: 'b' })]);
  for (const r of results) {
    assert.equal(r.status, 'rejected');
    assert.equal(r.reason.code, grpc.status.UNAVAILABLE);
  }
  assert.ok(batch.calls >= 2, 'each try went as a Batch');
});

test('a large Complete and a waiting Begin go unary', TIMEOUT, async () => {
  const { c, batch, unary } = batchingClient();
  const key = uniqueKey('large');
  const b = await c.begin({ scope: SCOPE, key });
  const before = batch.calls;
  await c.complete({ scope: SCOPE, key, lease_token: b.lease_token, response: { body: crypto.randomBytes(100 << 10) } });
  assert.equal(unary.Complete, 1);
  const other = uniqueKey('wait');
  await c.begin({ scope: SCOPE, key: other, wait: 100 });
  assert.equal(unary.Begin, 1);
  assert.equal(batch.calls, before);
});

test('against a coordinator without Batch, every call goes unary', TIMEOUT, async () => {
  // A coordinator of an older version answers Batch UNIMPLEMENTED.
  const noBatch = (opts, nextCall) => {
    if (!opts.method_definition.path.endsWith('/Batch')) {
      return new grpc.InterceptingCall(nextCall(opts));
    }
    return new grpc.InterceptingCall(nextCall(opts), {
      start(metadata, listener) {
        setImmediate(() => listener.onReceiveStatus({ code: grpc.status.UNIMPLEMENTED, details: 'unknown method Batch', metadata: new grpc.Metadata() }));
      },
      sendMessage() {},
      halfClose() {},
    });
  };
  const { c, batch, unary } = batchingClient({ interceptors: [noBatch] });
  const keys = Array.from({ length: 8 }, () => uniqueKey('old'));
  const begun = await Promise.all(keys.map((key) => c.begin({ scope: SCOPE, key })));
  await Promise.all(keys.map((key, i) => c.complete({ scope: SCOPE, key, lease_token: begun[i].lease_token, response: { body: key } })));
  assert.equal(batch.calls, 1, 'Batch was asked for once');
  assert.equal(unary.Begin, keys.length);
  assert.equal(unary.Complete, keys.length);
});

test('replays too large to share one Batch answer are asked for alone', TIMEOUT, async () => {
  const { c, unary } = batchingClient();
  const plain = newClient();
  const body = crypto.randomBytes(900 << 10);
  const keys = Array.from({ length: 6 }, () => uniqueKey('big'));
  for (const key of keys) {
    const b = await plain.begin({ scope: SCOPE, key });
    await plain.complete({ scope: SCOPE, key, lease_token: b.lease_token, response: { body } });
  }
  const replays = await Promise.all(keys.map((key) => c.begin({ scope: SCOPE, key })));
  for (const r of replays) {
    assert.equal(r.outcome, 'OUTCOME_REPLAY');
    assert.ok(r.record.response.body.equals(body));
  }
  assert.ok(unary.Begin > 0, 'the answers that did not fit were asked for unary');
});

test('a call through a closed batching Client rejects instead of waiting', TIMEOUT, async () => {
  const { c } = batchingClient();
  c.close();
  await assert.rejects(c.lookup({ scope: SCOPE, key: uniqueKey('closed') }, { timeoutMs: 60000 }), /closed|shut down/i);
});
