'use strict';
// Express and Fastify behind the middleware run the shared HTTP suite
// (clients/testdata/http_conformance.json) against a real coordinator.

const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const Fastify = require('fastify');
const { Client, httpMiddleware, fastifyPlugin } = require('..');
const { startCoordinator } = require('./coordinator');
const { runHttpConformance, suite } = require('./conformance');

let coord;
let client;

test.before(async () => {
  coord = await startCoordinator();
  client = new Client(coord.addr, { token: coord.token, leaseMs: suite.client_lease_ms });
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

async function startExpress(options, act) {
  const app = express();
  app.use(httpMiddleware(client, options));
  app.all('/items', async (req, res) => {
    const closed = new Promise((resolve) => res.once('close', resolve));
    const answer = await act(req.headers, closed);
    if (answer) {
      res.status(answer.status);
      for (const [k, v] of Object.entries(answer.headers)) res.setHeader(k, v);
      res.end(answer.body);
    }
  });
  app.use((err, req, res, next) => res.status(500).end('internal error')); // eslint-disable-line no-unused-vars
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

async function startFastify(options, act) {
  const app = Fastify();
  app.removeAllContentTypeParsers();
  app.addContentTypeParser('*', { parseAs: 'buffer' }, (req, body, done) => done(null, body));
  await app.register(fastifyPlugin, { client, ...options });
  app.all('/items', async (request, reply) => {
    const closed = new Promise((resolve) => reply.raw.once('close', resolve));
    const answer = await act(request.headers, closed);
    if (!answer) {
      return reply.hijack();
    }
    reply.code(answer.status).headers(answer.headers);
    return reply.send(Buffer.from(answer.body)); // a string would gain '; charset=utf-8'
  });
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
