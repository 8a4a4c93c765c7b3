'use strict';
// The Node client against a real coordinator (see coordinator.js).

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const grpc = require('@grpc/grpc-js');
const {
  Client, markSideEffect, currentLease, FailureError, StoredFailureError, LeaseLostError, LeaseUnconfirmedError,
} = require('..');
const { startCoordinator, clientOptions } = require('./coordinator');
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
  const c = new Client(coord.addr, clientOptions(coord, options));
  clients.push(c);
  return c;
}

// Generous, so that a hang fails instead of blocking (no test waits on time).
const TIMEOUT = { timeout: 300000 };

const uniqueKey = (prefix) => `${prefix}-${crypto.randomUUID()}`;

/** A gRPC error with a status code, as a handler would throw. */
function grpcError(code, message) {
  return Object.assign(new Error(message), { code, details: message });
}

const stored = () => ({
  schema_version: 'examples.ChargeResponse/1',
  content_type: 'application/octet-stream',
  body: Buffer.concat([Buffer.from('charge ch_42 '), crypto.randomBytes(32), Buffer.from([0x00, 0xff, 0xfe])]),
  status_code: 201,
  metadata: { 'x-charge-id': 'ch_42', 'x-empty': '' },
});

function assertSameResponse(got, want) {
  assert.ok(Buffer.isBuffer(got.body));
  assert.ok(got.body.equals(want.body), 'body differs');
  assert.equal(got.schema_version, want.schema_version);
  assert.equal(got.content_type, want.content_type);
  assert.equal(got.status_code, want.status_code);
  assert.deepEqual({ ...got.metadata }, { ...want.metadata });
}

test('begin, complete, then a replay of the same bytes', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.charge';
  const key = uniqueKey('k');
  const fingerprint = crypto.createHash('sha256').update('charge 42').digest();
  const first = await c.begin({ scope, key, fingerprint });
  assert.equal(first.outcome, 'OUTCOME_ACQUIRED');
  assert.equal(first.previous_state, 'STATE_UNSPECIFIED');
  const resp = stored();
  const done = await c.complete({ scope, key, lease_token: first.lease_token, response: resp });
  assert.equal(done.record.state, 'STATE_COMPLETED');
  const again = await c.begin({ scope, key, fingerprint });
  assert.equal(again.outcome, 'OUTCOME_REPLAY');
  assertSameResponse(again.record.response, resp);
  const looked = await c.lookup({ scope, key });
  assertSameResponse(looked.record.response, resp);
  // A repeated Complete with the same token and content is OK.
  await c.complete({ scope, key, lease_token: first.lease_token, response: resp });
  await assert.rejects(c.begin({ scope, key, fingerprint: Buffer.from('other') }),
    (err) => err.code === grpc.status.FAILED_PRECONDITION);
});

test('a begin whose reply was lost is retried with the same attempt_id and gets the same lease', TIMEOUT, async () => {
  const f = fault('Begin');
  const c = newClient({ interceptors: [f.interceptor], backoffMs: 10 });
  const scope = 'node.lost';
  const key = uniqueKey('k');
  f.loseReplies = 1;
  const res = await c.begin({ scope, key });
  assert.equal(res.outcome, 'OUTCOME_ACQUIRED', 'the retry was not recognised as the same attempt');
  assert.equal(f.calls, 2);
  assert.equal(f.requests[0].attempt_id, f.requests[1].attempt_id);
  assert.match(f.requests[0].attempt_id, /^[0-9a-f]{32}$/);
  // Another begin (a new attempt) finds the key held.
  const other = await newClient().begin({ scope, key });
  assert.equal(other.outcome, 'OUTCOME_IN_PROGRESS');
  await c.complete({ scope, key, lease_token: res.lease_token, response: {} });
});

test('calls are retried on UNAVAILABLE, then fail with it', TIMEOUT, async () => {
  const f = fault('Lookup');
  f.cutOff = true;
  const c = newClient({ interceptors: [f.interceptor], maxAttempts: 3, backoffMs: 5 });
  await assert.rejects(c.lookup({ scope: 's', key: 'k' }), (err) => err.code === grpc.status.UNAVAILABLE);
  assert.equal(f.calls, 3);
});

test('once under 20 concurrent callers runs fn once and replays byte for byte', TIMEOUT, async () => {
  const cs = [newClient(), newClient(), newClient(), newClient()];
  const scope = 'node.once';
  const key = uniqueKey('k');
  const fingerprint = Buffer.from('create flower shop');
  const resp = stored();
  let runs = 0;
  let release;
  const gate = new Promise((r) => {
    release = r;
  });
  const fn = async (attempt) => {
    runs++;
    assert.equal(attempt.lease.key, key);
    await gate; // hold the key until every caller has called begin
    return resp;
  };
  const calls = Array.from({ length: 20 }, (_, i) => cs[i % cs.length].once(scope, key, fingerprint, fn));
  await until(() => runs === 1);
  // Every other caller is now waiting on the key (or will find it done).
  setTimeout(release, 200);
  const results = await Promise.all(calls);
  assert.equal(runs, 1);
  assert.equal(results.filter((r) => !r.replayed).length, 1);
  for (const r of results) {
    assert.equal(r.state, 'STATE_COMPLETED');
    assert.equal(r.attempt, 1);
    assertSameResponse(r.response, resp);
  }
  const later = await newClient().once(scope, key, fingerprint, () => assert.fail('fn ran on a replay'));
  assert.equal(later.replayed, true);
  assertSameResponse(later.response, resp);
});

test('once gives fn the lease data; currentLease and markSideEffect work inside it only', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.lease';
  const key = uniqueKey('k');
  assert.equal(currentLease(), null);
  markSideEffect(); // outside an attempt: nothing
  let seen;
  const res = await c.once(scope, key, null, async (attempt) => {
    seen = attempt.lease;
    assert.deepEqual(currentLease(), attempt.lease);
    await new Promise((r) => setImmediate(r));
    assert.deepEqual(currentLease(), attempt.lease);
    return null;
  });
  assert.equal(res.replayed, false);
  assert.equal(res.response.body.length, 0); // an empty response
  assert.deepEqual(res.response.metadata, {});
  assert.equal(seen.scope, scope);
  assert.equal(seen.key, key);
  assert.equal(seen.attempt, 1);
  assert.equal(seen.generation, 1);
  assert.equal(seen.previous, 'STATE_UNSPECIFIED');
  assert.equal(seen.uncertain, false);
  assert.ok(seen.token.length > 0);
  const looked = await c.lookup({ scope, key });
  assert.equal(looked.record.state, 'STATE_COMPLETED');
});

test('errors are recorded by their gRPC code before the mark, UNKNOWN after it', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.mark';
  const key = uniqueKey('k');
  // UNAVAILABLE before the mark: retryable, nothing happened.
  await assert.rejects(c.once(scope, key, null, () => {
    throw grpcError(grpc.status.UNAVAILABLE, 'bank down');
  }), /bank down/);
  assert.equal((await c.lookup({ scope, key })).record.state, 'STATE_FAILED_RETRYABLE');
  // The same error after markSideEffect: the charge may have happened.
  await assert.rejects(c.once(scope, key, null, (attempt) => {
    assert.equal(attempt.lease.previous, 'STATE_FAILED_RETRYABLE');
    markSideEffect();
    throw grpcError(grpc.status.UNAVAILABLE, 'bank timed out after the charge');
  }), /bank timed out/);
  assert.equal((await c.lookup({ scope, key })).record.state, 'STATE_UNKNOWN');
  // The next attempt is told, and may finish the job.
  const res = await c.once(scope, key, null, (attempt) => {
    assert.equal(attempt.lease.previous, 'STATE_UNKNOWN');
    assert.equal(attempt.lease.attempt, 3);
    return { body: 'reconciled' }; // a string body is UTF-8
  });
  assert.equal(res.response.body.toString(), 'reconciled');
  // A FailureError naming ABANDONED after the mark is recorded UNKNOWN too.
  const key2 = uniqueKey('k');
  await assert.rejects(c.once(scope, key2, null, (attempt) => {
    attempt.markSideEffect();
    throw new FailureError('FAILURE_KIND_ABANDONED', { message: 'changed my mind' });
  }), /changed my mind/);
  assert.equal((await c.lookup({ scope, key: key2 })).record.state, 'STATE_UNKNOWN');
});

test('a caller mistake leaves no record; a replayable failure is stored and replayed', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.fail';
  const key = uniqueKey('k');
  await assert.rejects(c.once(scope, key, null, () => {
    throw grpcError(grpc.status.INVALID_ARGUMENT, 'bad name');
  }), /bad name/);
  await assert.rejects(c.lookup({ scope, key }), (err) => err.code === grpc.status.NOT_FOUND);

  let runs = 0;
  const fn = () => {
    runs++;
    throw grpcError(grpc.status.ALREADY_EXISTS, 'project exists');
  };
  const first = await c.once(scope, key, null, fn).then(() => assert.fail('resolved'), (err) => err);
  const second = await c.once(scope, key, null, fn).then(() => assert.fail('resolved'), (err) => err);
  assert.equal(runs, 1);
  for (const err of [first, second]) {
    assert.ok(err instanceof StoredFailureError);
    assert.equal(err.code, grpc.status.ALREADY_EXISTS);
    assert.equal(err.details, 'project exists');
    assert.equal(err.result.state, 'STATE_FAILED_REPLAYABLE');
    assert.equal(err.result.response.schema_version, 'google.rpc.Status');
  }
  assert.equal(first.result.replayed, false);
  assert.equal(second.result.replayed, true);
  assert.ok(first.result.response.body.equals(second.result.response.body));

  // A FailureError with a response of its own, stored as it is.
  const key2 = uniqueKey('k');
  const own = { schema_version: 'problem+json/1', content_type: 'application/problem+json', body: Buffer.from('{"title":"no"}'), status_code: 409 };
  await assert.rejects(c.once(scope, key2, null, () => {
    throw new FailureError('FAILURE_KIND_REPLAYABLE', { response: own, message: 'conflict' });
  }), StoredFailureError);
  const replay = await c.once(scope, key2, null, () => assert.fail('ran')).then(() => assert.fail('resolved'), (err) => err);
  assert.equal(replay.code, grpc.status.FAILED_PRECONDITION); // 409 is no gRPC code
  assert.equal(replay.details, 'conflict');
  assertSameResponse(replay.result.response, { ...own, metadata: {} });
});

test('a response the coordinator refuses to store (too large) leaves the key UNKNOWN', TIMEOUT, async () => {
  const c = newClient();
  const scope = 'node.large';
  const key = uniqueKey('k');
  const big = crypto.randomBytes(2 << 20); // over the 1 MiB limit, under gRPC's 4 MiB
  const res = await c.once(scope, key, null, () => ({ body: big }));
  assert.ok(res.response.body.equals(big)); // the caller still gets fn's result, as in Go
  const rec = (await c.lookup({ scope, key })).record;
  assert.equal(rec.state, 'STATE_UNKNOWN');
  assert.match(rec.failure_reason, /response not stored/);
});

test('once heartbeats while fn runs past its lease, so nobody takes the key over', TIMEOUT, async () => {
  const f = fault('Heartbeat');
  const c = newClient({ interceptors: [f.interceptor], leaseMs: 1000 });
  const scope = 'node.heartbeat';
  const key = uniqueKey('k');
  const res = await c.once(scope, key, null, async () => {
    // Three heartbeats at a third of the lease: more than a lease has passed.
    await until(() => f.statuses.filter((s) => s === grpc.status.OK).length >= 4);
    const other = await newClient().begin({ scope, key });
    assert.equal(other.outcome, 'OUTCOME_IN_PROGRESS');
    return { body: Buffer.from('done') };
  });
  assert.equal(res.response.body.toString(), 'done');
  assert.equal((await c.lookup({ scope, key })).record.state, 'STATE_COMPLETED');
});

test('a caller that waited longer than its lease confirms the lease before fn runs', TIMEOUT, async () => {
  const beats = fault('Heartbeat');
  const begins = fault('Begin');
  const c = newClient({ interceptors: [beats.interceptor, begins.interceptor], leaseMs: 1000 });
  const holder = newClient();
  const scope = 'node.waited';
  const key = uniqueKey('k');
  const first = await holder.begin({ scope, key, lease: 30000 });
  let seen;
  const p = c.once(scope, key, null, async (attempt) => {
    const heartbeatsBefore = beats.calls;
    await new Promise((r) => setTimeout(r, 20)); // let any abort timer fire
    seen = { aborted: attempt.signal.aborted, heartbeatsBefore, attempt: attempt.lease.attempt };
    return { body: Buffer.from('second') };
  });
  await until(() => begins.calls >= 2); // the long poll is in flight
  await new Promise((r) => setTimeout(r, 1500)); // longer than c's lease
  await holder.fail({ scope, key, lease_token: first.lease_token, kind: 'FAILURE_KIND_RETRYABLE' });
  const res = await p;
  assert.deepEqual(seen, { aborted: false, heartbeatsBefore: 1, attempt: 2 });
  assert.equal(res.response.body.toString(), 'second');
});

test('fn is aborted when the lease cannot be confirmed; a marked attempt ends UNKNOWN', TIMEOUT, async () => {
  const f = fault('Heartbeat');
  f.cutOff = true;
  const c = newClient({ interceptors: [f.interceptor], leaseMs: 1000, maxAttempts: 1 });
  const scope = 'node.cutoff';
  const key = uniqueKey('k');
  let reason;
  const err = await c.once(scope, key, null, async (attempt) => {
    attempt.markSideEffect();
    await new Promise((resolve) => attempt.signal.addEventListener('abort', resolve, { once: true }));
    reason = attempt.signal.reason;
    throw reason;
  }).then(() => assert.fail('resolved'), (e) => e);
  assert.ok(reason instanceof LeaseUnconfirmedError, String(reason));
  assert.equal(err, reason);
  assert.ok(f.calls >= 1);
  assert.equal((await c.lookup({ scope, key })).record.state, 'STATE_UNKNOWN');
});

test('a holder whose key was taken over learns it from a heartbeat and records nothing', TIMEOUT, async () => {
  const f = fault('Heartbeat');
  const c = newClient({ interceptors: [f.interceptor], leaseMs: 1000, maxAttempts: 1 });
  const scope = 'node.takeover';
  const key = uniqueKey('k');
  const other = newClient();
  let successor;
  const err = await c.once(scope, key, null, async (attempt) => {
    f.cutOff = true; // partitioned: heartbeats stop reaching the coordinator
    await new Promise((resolve) => attempt.signal.addEventListener('abort', resolve, { once: true }));
    // This fn ignores the abort and goes on. Once the lease ran out on the
    // coordinator, another caller takes the key over.
    for (;;) {
      successor = await other.begin({ scope, key, wait: 5000 });
      if (successor.outcome === 'OUTCOME_ACQUIRED') {
        break;
      }
    }
    f.cutOff = false; // the partition heals: the next heartbeat is refused
    await until(() => f.statuses.includes(grpc.status.FAILED_PRECONDITION));
    return { body: Buffer.from('stale result') };
  }).then(() => assert.fail('resolved'), (e) => e);
  assert.ok(err instanceof LeaseLostError, String(err));
  assert.equal(successor.previous_state, 'STATE_UNKNOWN');
  const rec = (await other.lookup({ scope, key })).record;
  assert.equal(rec.state, 'STATE_IN_PROGRESS');
  assert.equal(rec.attempt, 2);
  await other.complete({ scope, key, lease_token: successor.lease_token, response: { body: Buffer.from('fresh') } });
  assert.equal((await other.lookup({ scope, key })).record.response.body.toString(), 'fresh');
});

/** A promise that resolves when signal aborts. */
const aborted = (signal) => new Promise((resolve) => signal.addEventListener('abort', resolve, { once: true }));

const GAVE_UP = 'caller gave up before the handler ran';

/** Asserts that calls (a fault's requests of Fail) released one acquisition with Fail ABANDONED. */
function assertReleased(fails) {
  assert.equal(fails.requests.length, 1, 'one Fail');
  assert.equal(fails.requests[0].kind, 'FAILURE_KIND_ABANDONED');
  assert.equal(fails.requests[0].reason, GAVE_UP);
}

test('a signal that ends while the first Begin is in flight leaves no record', TIMEOUT, async () => {
  const begins = fault('Begin');
  const fails = fault('Fail');
  const c = newClient({ interceptors: [begins.interceptor, fails.interceptor] });
  const scope = 'node.gaveup.first';
  const key = uniqueKey('k');
  // The coordinator acquires the key for once's Begin; its answer arrives
  // only after the caller's deadline ended, as CANCELLED.
  const signal = AbortSignal.timeout(200);
  begins.hold = { call: 1, until: aborted(signal), lose: true };
  let ran = false;
  const err = await c.once(scope, key, null, () => {
    ran = true;
  }, { signal }).then(() => assert.fail('resolved'), (e) => e);
  assert.equal(ran, false);
  assert.ok(begins.held);
  await assert.rejects(c.lookup({ scope, key }), (e) => e.code === grpc.status.NOT_FOUND, 'the key is held');
  const next = await newClient().begin({ scope, key });
  assert.equal(next.outcome, 'OUTCOME_ACQUIRED');
  assert.equal(next.previous_state, 'STATE_UNSPECIFIED');
  assertReleased(fails);
  assert.equal(err, signal.reason);
});

test('a caller that aborts while waiting releases the key its wait acquired', TIMEOUT, async () => {
  const begins = fault('Begin');
  const fails = fault('Fail');
  const c = newClient({ interceptors: [begins.interceptor, fails.interceptor] });
  const holder = newClient();
  const scope = 'node.gaveup.wait';
  const key = uniqueKey('k');
  const first = await holder.begin({ scope, key, lease: 30000 });
  const ac = new AbortController();
  // The second Begin is the wait: when the holder lets go, the coordinator
  // hands the key to it, but the caller aborts before the answer arrives.
  begins.hold = { call: 2, until: aborted(ac.signal), lose: true };
  let ran = false;
  const p = c.once(scope, key, null, () => {
    ran = true;
  }, { signal: ac.signal }).then(() => assert.fail('resolved'), (e) => e);
  await until(() => begins.calls >= 2);
  await holder.fail({ scope, key, lease_token: first.lease_token, kind: 'FAILURE_KIND_RETRYABLE' });
  await until(() => begins.held);
  ac.abort();
  const err = await p;
  assert.equal(ran, false);
  const next = await newClient().begin({ scope, key });
  assert.equal(next.outcome, 'OUTCOME_ACQUIRED', 'the key is held');
  assert.equal(next.previous_state, 'STATE_FAILED_RETRYABLE');
  assertReleased(fails);
  assert.equal(err, ac.signal.reason);
});

test('an acquisition answered after the caller aborted is released without running fn', TIMEOUT, async () => {
  const begins = fault('Begin');
  const fails = fault('Fail');
  const c = newClient({ interceptors: [begins.interceptor, fails.interceptor] });
  const scope = 'node.gaveup.acquired';
  const key = uniqueKey('k');
  const ac = new AbortController();
  begins.hold = { call: 1, until: aborted(ac.signal), lose: false };
  let ran = false;
  const p = c.once(scope, key, null, () => {
    ran = true;
  }, { signal: ac.signal }).then(() => assert.fail('resolved'), (e) => e);
  await until(() => begins.held);
  ac.abort();
  const err = await p;
  assert.equal(ran, false);
  await assert.rejects(c.lookup({ scope, key }), (e) => e.code === grpc.status.NOT_FOUND, 'the key is held');
  assert.equal((await newClient().begin({ scope, key })).outcome, 'OUTCOME_ACQUIRED');
  assertReleased(fails);
  assert.equal(begins.calls, 1, 'the token was known: no second Begin');
  assert.equal(err, ac.signal.reason);
});

test('a Begin whose every answer was lost is released', TIMEOUT, async () => {
  const begins = fault('Begin');
  const fails = fault('Fail');
  const c = newClient({ interceptors: [begins.interceptor, fails.interceptor], maxAttempts: 3, backoffMs: 5 });
  const scope = 'node.gaveup.lost';
  const key = uniqueKey('k');
  begins.loseReplies = 3; // the coordinator acquires the key; once hears UNAVAILABLE three times
  let ran = false;
  const err = await c.once(scope, key, null, () => {
    ran = true;
  }).then(() => assert.fail('resolved'), (e) => e);
  assert.equal(ran, false);
  assert.equal(err.code, grpc.status.UNAVAILABLE);
  await assert.rejects(c.lookup({ scope, key }), (e) => e.code === grpc.status.NOT_FOUND, 'the key is held');
  assert.equal(begins.calls, 4);
  assert.ok(begins.requests.every((r) => r.attempt_id === begins.requests[0].attempt_id), 'not the same attempt');
  assert.equal(begins.requests[3].wait, null);
  assertReleased(fails);
});

test('a release that cannot reach the coordinator is logged, and once rejects with the error of its Begin', TIMEOUT, async () => {
  const begins = fault('Begin');
  begins.cutOff = true;
  const logged = [];
  const logger = { warn: (msg, fields) => logged.push({ msg, fields }) };
  const c = newClient({ interceptors: [begins.interceptor], maxAttempts: 2, backoffMs: 5, logger });
  const key = uniqueKey('k');
  const err = await c.once('node.gaveup.cutoff', key, null, () => assert.fail('ran')).then(() => assert.fail('resolved'), (e) => e);
  assert.equal(err.code, grpc.status.UNAVAILABLE);
  assert.equal(err.details, 'cut off (test)');
  assert.equal(begins.calls, 4); // two tries, then two tries of the release
  assert.equal(logged.length, 1);
  assert.match(logged[0].msg, /could not release/);
  assert.equal(logged[0].fields.key, key);
});

test('a wrong token is refused with UNAUTHENTICATED when auth is on', { ...TIMEOUT, skip: !coordinatorHasAuth() && 'the coordinator has auth off (IDEMCOORD_TOKEN unset)' }, async () => {
  const c = newClient({ token: 'not-the-token' });
  await assert.rejects(c.begin({ scope: 's', key: uniqueKey('k') }), (err) => err.code === grpc.status.UNAUTHENTICATED);
});

function coordinatorHasAuth() {
  return !process.env.IDEMCOORD_ADDR || Boolean(process.env.IDEMCOORD_TOKEN);
}
