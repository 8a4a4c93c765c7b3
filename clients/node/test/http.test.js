'use strict';
// Express and Fastify behind the middleware run the shared HTTP suite
// (clients/testdata/http_conformance.json) against a real coordinator.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const express = require('express');
const Fastify = require('fastify');
const grpc = require('@grpc/grpc-js');
const {
  Client, httpMiddleware, fastifyPlugin, serverInterceptor, PROBLEMS, httpOperationScope, foldPrincipal,
} = require('..');
const { startCoordinator, clientOptions } = require('./coordinator');
const { runHttpConformance, suite } = require('./conformance');
const { fault } = require('./fault');

let coord;
let client;

test.before(async () => {
  coord = await startCoordinator();
  client = new Client(coord.addr, clientOptions(coord, { leaseMs: suite.client_lease_ms }));
});

test.after(async () => {
  await client.shutdown({ timeoutMs: 10000 });
  await coord.stop();
});

const TIMEOUT = { timeout: 300000 };

function listen(server) {
  return new Promise((resolve) => {
    server.listen(0, '127.0.0.1', () => resolve(`http://127.0.0.1:${server.address().port}`));
  });
}

async function startExpress(options, act, c = client) {
  const app = express();
  app.use(httpMiddleware(c, options));
  app.all(['/items', '/orders'], async (req, res) => {
    const closed = new Promise((resolve) => res.once('close', resolve));
    const answer = await act(req.headers, closed);
    if (!answer) {
      // Giving up the Node way: throw the signal's reason (status 503).
      req.idempotency?.signal.throwIfAborted();
      return;
    }
    res.status(answer.status);
    for (const [k, v] of Object.entries(answer.headers)) res.setHeader(k, v);
    res.end(answer.body);
  });
  app.use((err, req, res, next) => res.status(err.status ?? 500).end('internal error')); // eslint-disable-line no-unused-vars
  const server = app.listen(0, '127.0.0.1');
  await new Promise((resolve) => server.once('listening', resolve));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    close: () => new Promise((resolve) => {
      server.closeAllConnections();
      server.close(resolve);
    }),
  };
}

async function startFastify(options, act, c = client) {
  const app = Fastify();
  app.removeAllContentTypeParsers();
  app.addContentTypeParser('*', { parseAs: 'buffer' }, (req, body, done) => done(null, body));
  await app.register(fastifyPlugin, { client: c, ...options });
  const items = async (request, reply) => {
    const closed = new Promise((resolve) => reply.raw.once('close', resolve));
    const answer = await act(request.headers, closed);
    if (!answer) {
      // Giving up the Node way: throw the signal's reason (status 503).
      request.idempotency?.signal.throwIfAborted();
      return reply.hijack();
    }
    reply.code(answer.status).headers(answer.headers);
    return reply.send(Buffer.from(answer.body)); // a string would gain '; charset=utf-8'
  };
  app.all('/items', items);
  app.all('/orders', items);
  const url = await app.listen({ port: 0, host: '127.0.0.1' });
  return {
    url,
    close: async () => {
      app.server.closeAllConnections();
      await app.close();
    },
  };
}

test('Express passes the HTTP conformance suite', TIMEOUT, async (t) => {
  const ran = await runHttpConformance(t, 'express', client, startExpress);
  assert.ok(ran > 0);
});

test('Fastify passes the HTTP conformance suite', TIMEOUT, async (t) => {
  const ran = await runHttpConformance(t, 'fastify', client, startFastify);
  assert.ok(ran > 0);
});

test('body parsers after the middleware still get the body', TIMEOUT, async () => {
  const app = express();
  app.use(httpMiddleware(client));
  app.use(express.json());
  app.post('/echo', (req, res) => res.status(201).json({ got: req.body, raw: req.rawBody.toString() }));
  const server = app.listen(0, '127.0.0.1');
  await new Promise((resolve) => server.once('listening', resolve));
  try {
    const url = `http://127.0.0.1:${server.address().port}/echo`;
    const init = { method: 'POST', headers: { 'Idempotency-Key': `parsers-${Date.now()}`, 'Content-Type': 'application/json' }, body: '{"a":1}' };
    const first = await fetch(url, init);
    assert.equal(first.status, 201);
    assert.deepEqual(await first.json(), { got: { a: 1 }, raw: '{"a":1}' });
    const again = await fetch(url, init);
    assert.equal(again.headers.get('idempotency-result'), 'replayed');
    assert.deepEqual(await again.json(), { got: { a: 1 }, raw: '{"a":1}' });
  } finally {
    server.closeAllConnections();
    server.close();
  }
});

module.exports = { listen };

test('mismatchStatus, onReplay and Idempotency-Expires on a replay', TIMEOUT, async () => {
  const app = express();
  app.use(httpMiddleware(client, {
    mismatchStatus: 409,
    onReplay: (req, stored) => ({ ...stored, metadata: { ...stored.metadata, 'X-Replayed-For': String(req.headers['x-request-id']) } }),
  }));
  app.post('/things', (req, res) => res.status(201).end('made'));
  const server = app.listen(0, '127.0.0.1');
  await new Promise((resolve) => server.once('listening', resolve));
  try {
    const url = `http://127.0.0.1:${server.address().port}/things`;
    const key = `opts-${Date.now()}`;
    const send = (body, id) => fetch(url, { method: 'POST', headers: { 'Idempotency-Key': key, 'X-Request-Id': id }, body });
    assert.equal((await send('a', 'r1')).status, 201);
    const replay = await send('a', 'r2');
    assert.equal(replay.headers.get('idempotency-result'), 'replayed');
    assert.equal(replay.headers.get('x-replayed-for'), 'r2');
    assert.match(replay.headers.get('idempotency-expires') ?? '', /^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$/);
    assert.equal(await replay.text(), 'made');
    const changed = await send('b', 'r3');
    assert.equal(changed.status, 409);
    assert.equal((await changed.json()).type, 'urn:idemcoord:problem:idempotency-key-reused');
  } finally {
    server.closeAllConnections();
    server.close();
  }
});

const STACKS = { express: startExpress, fastify: startFastify };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * A careless handler: it ignores its signal, sleeps ms and answers 201
 * "charged once"; calls counts its runs.
 */
function carelessHandler(ms) {
  const h = {
    calls: 0,
    act: async () => {
      h.calls++;
      await sleep(ms);
      return { status: 201, headers: { 'Content-Type': 'text/plain' }, body: 'charged once' };
    },
  };
  return h;
}

/** The states Lookup reads for key every 50 ms until done settles, each change once, in order. */
async function statesWhile(c, key, done) {
  const seen = [];
  let over = false;
  done.finally(() => { over = true; });
  while (!over) {
    let state;
    try {
      state = (await c.lookup({ scope: 'POST /items', key })).record.state;
    } catch (err) {
      state = err.code === grpc.status.NOT_FOUND ? 'absent' : `error ${err.code}`;
    }
    if (seen.at(-1) !== state) seen.push(state);
    await sleep(50);
  }
  return seen;
}

/** Waits up to 10 s for the record of key to read want. */
async function wantState(c, key, want) {
  const deadline = Date.now() + 10000;
  let got;
  do {
    got = (await c.lookup({ scope: 'POST /items', key })).record.state;
    if (got === want) return;
    await sleep(50);
  } while (Date.now() < deadline);
  assert.equal(got, want, `state of ${key}`);
}

async function assertLeaseLost(resp) {
  const body = await resp.text();
  const where = `got ${resp.status} ${JSON.stringify([...resp.headers])} ${body}`;
  assert.equal(resp.status, 503, where);
  assert.equal(resp.headers.get('content-type'), 'application/problem+json', where);
  assert.equal(JSON.parse(body).type, PROBLEMS.leaseLost, where);
  assert.equal(resp.headers.get('retry-after'), '1', where);
  assert.equal(resp.headers.get('idempotency-result'), null, where);
}

for (const [stack, start] of Object.entries(STACKS)) {
  test(`${stack}: the lease cannot be confirmed while a careless handler runs: nothing is recorded RETRYABLE, the client gets 503 lease-lost, the handler's answer is recorded`, TIMEOUT, async () => {
    const beats = fault('Heartbeat');
    beats.cutOff = true; // no heartbeat reaches the coordinator
    const c = new Client(coord.addr, clientOptions(coord));
    const served = new Client(coord.addr, clientOptions(coord, { leaseMs: 1000, maxAttempts: 1, interceptors: [beats.interceptor] }));
    const h = carelessHandler(2500);
    const svc = await start({ withoutPrincipal: true }, h.act, served);
    try {
      const key = `unconfirmed-${crypto.randomUUID()}`;
      const send = () => fetch(`${svc.url}/items`, { method: 'POST', headers: { 'Idempotency-Key': key }, body: 'x' });
      const first = send();
      const seen = await statesWhile(c, key, first);
      await assertLeaseLost(await first);
      assert.ok(beats.calls >= 1, 'no heartbeat was tried');
      assert.ok(!seen.includes('STATE_FAILED_RETRYABLE'), `states while the handler ran: ${seen}`);
      // No other attempt took the key over: the handler's answer is recorded.
      await wantState(c, key, 'STATE_COMPLETED');
      const again = await send();
      assert.equal(again.status, 201);
      assert.equal(again.headers.get('idempotency-result'), 'replayed');
      assert.equal(await again.text(), 'charged once');
      assert.equal(h.calls, 1);
    } finally {
      await svc.close();
      await served.shutdown({ timeoutMs: 5000 });
      c.close();
    }
  });

  test(`${stack}: a heartbeat is refused while a careless handler runs: nothing is recorded, the client gets 503 lease-lost, not the handler's 201`, TIMEOUT, async () => {
    const beats = fault('Heartbeat');
    beats.rewrite = (req) => ({ ...req, lease_token: 'not-the-holders-token' }); // the coordinator refuses it
    const c = new Client(coord.addr, clientOptions(coord));
    const served = new Client(coord.addr, clientOptions(coord, { leaseMs: 1000, interceptors: [beats.interceptor] }));
    const h = carelessHandler(2000);
    const svc = await start({ withoutPrincipal: true }, h.act, served);
    try {
      const key = `refused-${crypto.randomUUID()}`;
      const first = fetch(`${svc.url}/items`, { method: 'POST', headers: { 'Idempotency-Key': key }, body: 'x' });
      const seen = await statesWhile(c, key, first);
      await assertLeaseLost(await first);
      assert.ok(beats.statuses.includes(grpc.status.FAILED_PRECONDITION), `heartbeat statuses ${beats.statuses}`);
      assert.ok(!seen.includes('STATE_FAILED_RETRYABLE') && !seen.includes('STATE_COMPLETED'), `states: ${seen}`);
      // Nothing recorded: the lease runs out and the record reads UNKNOWN.
      await wantState(c, key, 'STATE_UNKNOWN');
      assert.equal(h.calls, 1);
    } finally {
      await svc.close();
      await served.shutdown({ timeoutMs: 5000 });
      c.close();
    }
  });

  test(`${stack}: a handler that has not answered lingerMs after its client went away leaves the lease to run out (UNKNOWN), and its late answer is still recorded`, TIMEOUT, async () => {
    const c = new Client(coord.addr, clientOptions(coord));
    const served = new Client(coord.addr, clientOptions(coord, { leaseMs: 1000 }));
    const h = carelessHandler(3000);
    const svc = await start({ withoutPrincipal: true, lingerMs: 200 }, h.act, served);
    try {
      const key = `linger-${crypto.randomUUID()}`;
      const send = (init = {}) => fetch(`${svc.url}/items`, { method: 'POST', headers: { 'Idempotency-Key': key }, body: 'x', ...init });
      const gaveUp = send({ signal: AbortSignal.timeout(300) }).then(() => assert.fail('answered'), () => {});
      const seen = await statesWhile(c, key, Promise.all([gaveUp, sleep(2000)]));
      // Held while the handler may act, then left to run out; never released or RETRYABLE.
      assert.deepEqual(seen.filter((st, i) => !(i === 0 && st === 'absent')), ['STATE_IN_PROGRESS', 'STATE_UNKNOWN'], `states: ${seen}`);
      await wantState(c, key, 'STATE_COMPLETED');
      const again = await send();
      assert.equal(again.headers.get('idempotency-result'), 'replayed');
      assert.equal(await again.text(), 'charged once');
      assert.equal(h.calls, 1);
    } finally {
      await svc.close();
      await served.shutdown({ timeoutMs: 5000 });
      c.close();
    }
  });
}

test('mismatchStatus takes 409 or 422 only: another status is refused when the middleware is built', TIMEOUT, async () => {
  for (const mismatchStatus of [200, 201, 400, 500]) {
    assert.throws(() => httpMiddleware(client, { withoutPrincipal: true, mismatchStatus }), RangeError);
    const app = Fastify();
    await assert.rejects(async () => app.register(fastifyPlugin, { client, withoutPrincipal: true, mismatchStatus }), RangeError);
    await app.close().catch(() => {});
  }
  for (const mismatchStatus of [409, 422]) {
    assert.equal(typeof httpMiddleware(client, { withoutPrincipal: true, mismatchStatus }), 'function');
  }
});

test('httpOperationScope: [service ]METHOD /path; a scope longer than 255 bytes is cut and hashed as in Go', () => {
  assert.equal(httpOperationScope('', 'POST', '/orders'), 'POST /orders');
  assert.equal(httpOperationScope('payments', 'POST', '/orders'), 'payments POST /orders');
  const long = httpOperationScope('', 'POST', `/${'a'.repeat(300)}`);
  assert.ok(Buffer.byteLength(long) <= 255 && long.startsWith('POST /aaa'));
  assert.ok(long.endsWith('a~Kp-qwHhV0wj3-SyZ0O5Xk4eZHUE1-0MDl5n_zy6niBg'), long);
});

test('built without principal or withoutPrincipal, or without service or scope, the middlewares and the interceptor warn (logger, else a process warning)', TIMEOUT, async () => {
  const warned = [];
  const logged = new Client(coord.addr, clientOptions(coord, { logger: { warn: (msg) => warned.push(msg) } }));
  try {
    httpMiddleware(logged, { service: 'svc' });
    assert.equal(warned.length, 1);
    assert.match(warned[0], /httpMiddleware built without principal or withoutPrincipal/);
    httpMiddleware(logged, { withoutPrincipal: true, service: 'svc' });
    httpMiddleware(logged, { principal: (req) => String(req.headers['x-user']), scope: 'http' });
    assert.equal(warned.length, 1, 'either option silences the warning');
    const app = Fastify();
    await app.register(fastifyPlugin, { client: logged, service: 'svc' });
    await app.close();
    assert.equal(warned.length, 2);
    serverInterceptor(logged, { services: [] });
    assert.match(warned[2] ?? '', /serverInterceptor built without principal or withoutPrincipal/);
    serverInterceptor(logged, { services: [], withoutPrincipal: true });
    assert.equal(warned.length, 3);
    httpMiddleware(logged, { withoutPrincipal: true });
    assert.equal(warned.length, 4);
    assert.match(warned[3], /httpMiddleware built without service or scope/);
    assert.throws(() => httpMiddleware(logged, { principal: () => 'u', withoutPrincipal: true }), TypeError);
  } finally {
    logged.close();
  }
  const warnings = [];
  const onWarning = (w) => warnings.push(w);
  process.on('warning', onWarning);
  try {
    httpMiddleware(client); // client has no logger
    await new Promise((r) => setImmediate(r));
  } finally {
    process.off('warning', onWarning);
  }
  assert.deepEqual(warnings.map((w) => w.code), ['IDEMCOORD_UNDECIDED_PRINCIPAL', 'IDEMCOORD_UNNAMED_SERVICE']);
});

test('a Begin slower than timeoutMs, cut off CANCELLED after its deadline, is the coordinator unreachable: 503 + Retry-After, or the handler runs with failOpen', TIMEOUT, async () => {
  const begins = fault('Begin');
  begins.resetAtDeadline = true;
  const slow = new Client(coord.addr, clientOptions(coord, { timeoutMs: 200, interceptors: [begins.interceptor] }));
  const ran = [];
  const apps = [];
  const start = async (options) => {
    const app = express();
    app.use(httpMiddleware(slow, { withoutPrincipal: true, ...options }));
    app.post('/items', (req, res) => {
      ran.push(options.failOpen ?? false);
      res.status(201).end('ran');
    });
    const server = app.listen(0, '127.0.0.1');
    apps.push(server);
    await new Promise((resolve) => server.once('listening', resolve));
    return `http://127.0.0.1:${server.address().port}/items`;
  };
  try {
    const closed = await start({});
    const resp = await fetch(closed, { method: 'POST', headers: { 'Idempotency-Key': `slow-${crypto.randomUUID()}` }, body: 'x' });
    const body = await resp.text();
    assert.equal(resp.status, 503, body);
    assert.equal(JSON.parse(body).type, PROBLEMS.unavailable, body);
    assert.equal(resp.headers.get('retry-after'), '1');
    assert.ok(begins.statuses.includes(grpc.status.CANCELLED));
    const open = await start({ failOpen: true });
    const unprotected = await fetch(open, { method: 'POST', headers: { 'Idempotency-Key': `slow-${crypto.randomUUID()}` }, body: 'x' });
    assert.equal(unprotected.status, 201);
    assert.equal(await unprotected.text(), 'ran');
    assert.deepEqual(ran, [true]);
  } finally {
    for (const server of apps) {
      server.closeAllConnections();
      server.close();
    }
    slow.close();
  }
});

/**
 * Starts stack (startExpress or startFastify) with the key option key (and
 * options) and a handler that counts its runs and echoes the body it got.
 */
async function startKeyed(stack, key, options = {}) {
  let runs = 0;
  const svc = await stack({ withoutPrincipal: true, service: 'keyed', key, ...options }, async () => {
    runs++;
    return { status: 201, headers: { 'Content-Type': 'application/json' }, body: `{"run":${runs}}` };
  });
  return { ...svc, runs: () => runs };
}

/** A key function over the JSON body's order_id (a string), as the conformance runner maps key_from_json_field. */
const orderId = (req, body) => {
  try {
    const id = JSON.parse(body.toString()).order_id;
    return typeof id === 'string' ? id : undefined;
  } catch {
    return undefined;
  }
};

/** The state of the record of key in the keyed service's scope once its ending landed (it may land after the answer). */
async function settledState(key) {
  for (let i = 0; ; i++) {
    const { state } = (await client.lookup({ scope: 'keyed POST /items', key })).record;
    if (state !== 'STATE_IN_PROGRESS' || i >= 200) {
      return state;
    }
    await new Promise((r) => setTimeout(r, 50));
  }
}

const post = (url, body, headers = {}) => fetch(`${url}/items`, { method: 'POST', headers: { 'Content-Type': 'application/json', ...headers }, body });

async function problemOf(resp) {
  assert.equal(resp.headers.get('content-type'), 'application/problem+json');
  return resp.json();
}

for (const [name, stack] of [['Express', startExpress], ['Fastify', startFastify]]) {
  test(`${name}: the key option takes the key from the payload, checked, echoed and folded as a header's`, TIMEOUT, async () => {
    const svc = await startKeyed(stack, async (req, body) => orderId(req, body)); // a Promise works too
    const plain = await startKeyed(stack, orderId, { withoutPrincipal: false, principal: (req) => req.headers['x-user'] ?? '' });
    try {
      const id = `ключ-${crypto.randomUUID()}`; // not ASCII: echoed as its UTF-8 bytes
      const body = JSON.stringify({ order_id: id });
      const first = await post(svc.url, body);
      assert.equal(first.status, 201);
      assert.equal(first.headers.get('idempotency-result'), 'created');
      assert.equal(Buffer.from(first.headers.get('idempotency-key'), 'latin1').toString('utf8'), id);
      const again = await post(svc.url, body);
      assert.equal(again.headers.get('idempotency-result'), 'replayed');
      assert.equal(await again.text(), '{"run":1}');
      assert.equal(svc.runs(), 1);
      assert.equal(await settledState(id), 'STATE_COMPLETED');

      // Folded with the principal as a header key is.
      const folded = await post(plain.url, body, { 'X-User': 'u1' });
      assert.equal(folded.status, 201);
      assert.equal(await settledState(foldPrincipal('u1', id)), 'STATE_COMPLETED');
    } finally {
      await svc.close();
      await plain.close();
    }
  });

  test(`${name}: a key function that throws, or returns an invalid key, answers 400 key-invalid and runs nothing`, TIMEOUT, async () => {
    const cases = [
      [() => { throw new Error('no order here'); }, 'could not be taken from the request: no order here'],
      [async () => { throw new Error('async refusal'); }, 'async refusal'],
      [() => 'x'.repeat(256), 'is 256 bytes long, more than 255'],
      [() => 'tab\there', 'holds a control character'],
      [() => 'lone \ud800', 'is not valid UTF-8'],
      [() => 42, 'returned a number, not a string'],
    ];
    for (const [key, detail] of cases) {
      const svc = await startKeyed(stack, key);
      try {
        const resp = await post(svc.url, '{}');
        assert.equal(resp.status, 400);
        const p = await problemOf(resp);
        assert.equal(p.type, PROBLEMS.keyInvalid);
        assert.ok(p.detail.includes(detail), `${p.detail} lacks ${detail}`);
        assert.equal(resp.headers.get('idempotency-key'), null);
        assert.equal(svc.runs(), 0);
      } finally {
        await svc.close();
      }
    }
  });

  test(`${name}: a key function that returns nothing leaves the request unprotected, or 400 with requireKey; a header key wins`, TIMEOUT, async () => {
    const svc = await startKeyed(stack, orderId);
    const strict = await startKeyed(stack, orderId, { requireKey: true });
    try {
      for (const body of ['{"other":1}', 'not json', '{"order_id":""}']) {
        const resp = await post(svc.url, body);
        assert.equal(resp.status, 201);
        assert.equal(resp.headers.get('idempotency-result'), null);
        assert.equal(resp.headers.get('idempotency-key'), null);
        const refused = await post(strict.url, body);
        assert.equal(refused.status, 400);
        assert.equal((await problemOf(refused)).type, PROBLEMS.keyMissing);
      }
      assert.equal(svc.runs(), 3);
      assert.equal(strict.runs(), 0);

      const header = `hdr-${crypto.randomUUID()}`;
      const payload = `pay-${crypto.randomUUID()}`;
      const resp = await post(svc.url, JSON.stringify({ order_id: payload }), { 'Idempotency-Key': header });
      assert.equal(resp.headers.get('idempotency-key'), header);
      assert.equal(await settledState(header), 'STATE_COMPLETED');
      await assert.rejects(client.lookup({ scope: 'keyed POST /items', key: payload }), (err) => err.code === grpc.status.NOT_FOUND);
    } finally {
      await svc.close();
      await strict.close();
    }
  });
}

test('Express: with a key option, body parsers after the middleware still get the body of an unprotected request', TIMEOUT, async () => {
  const app = express();
  app.use(httpMiddleware(client, { withoutPrincipal: true, service: 'keyed', key: orderId }));
  app.use(express.json());
  app.post('/echo', (req, res) => res.status(201).json({ got: req.body }));
  const server = app.listen(0, '127.0.0.1');
  await new Promise((resolve) => server.once('listening', resolve));
  try {
    const resp = await fetch(`http://127.0.0.1:${server.address().port}/echo`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: '{"a":1}' });
    assert.equal(resp.status, 201);
    assert.deepEqual(await resp.json(), { got: { a: 1 } });
  } finally {
    server.closeAllConnections();
    server.close();
  }
});
