'use strict';
// The calling side: clientInterceptor stamps one idempotency-key per call,
// the same on every attempt grpc-js's retry policy makes; stampIdempotencyKey
// stamps a fetch request once, before its retry loop.

const test = require('node:test');
const assert = require('node:assert/strict');
const http = require('node:http');
const grpc = require('@grpc/grpc-js');
const { Client, clientInterceptor, stampIdempotencyKey, httpMiddleware } = require('..');
const { startCoordinator, clientOptions } = require('./coordinator');

const json = { serialize: (o) => Buffer.from(JSON.stringify(o)), deserialize: (b) => JSON.parse(b.toString()) };
const Orders = {
  Create: {
    path: '/shop.v1.Orders/Create', requestStream: false, responseStream: false,
    requestSerialize: json.serialize, requestDeserialize: json.deserialize,
    responseSerialize: json.serialize, responseDeserialize: json.deserialize,
  },
};
const Stub = grpc.makeGenericClientConstructor(Orders, 'Orders');

// A service config whose retryPolicy retries UNAVAILABLE, as Go's test has.
const retryConfig = JSON.stringify({
  methodConfig: [{
    name: [{ service: 'shop.v1.Orders' }],
    retryPolicy: { maxAttempts: 4, initialBackoff: '0.01s', maxBackoff: '0.05s', backoffMultiplier: 2, retryableStatusCodes: ['UNAVAILABLE'] },
  }],
});

async function serve(interceptors, impl) {
  const server = new grpc.Server({ interceptors });
  server.addService(Orders, impl);
  const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(),
    (err, p) => (err ? reject(err) : resolve(p))));
  return { port, server };
}

function create(stub, md = new grpc.Metadata()) {
  return new Promise((resolve) => stub.Create({ item: 'book' }, md, (err, res) => resolve({ err, res })));
}

test('clientInterceptor stamps one key per call, the same on every retry of grpc-js\'s retry policy', async () => {
  const seen = [];
  let failNext = 0;
  const { port, server } = await serve([], {
    Create(call, callback) {
      seen.push(call.metadata.get('idempotency-key').map(String));
      if (failNext > 0) {
        failNext--;
        callback({ code: grpc.status.UNAVAILABLE, details: 'injected' });
        return;
      }
      callback(null, { ok: true });
    },
  });
  const stub = new Stub(`127.0.0.1:${port}`, grpc.credentials.createInsecure(), {
    interceptors: [clientInterceptor()], 'grpc.service_config': retryConfig, 'grpc.enable_retries': 1,
  });
  try {
    failNext = 2;
    const first = await create(stub);
    assert.equal(first.err, null, first.err?.message);
    assert.equal(seen.length, 3, 'two injected UNAVAILABLE answers, then the retry policy\'s third attempt succeeds');
    assert.equal(seen[0].length, 1);
    assert.match(seen[0][0], /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
    assert.deepEqual(seen[1], seen[0]);
    assert.deepEqual(seen[2], seen[0]);

    const second = await create(stub);
    assert.equal(second.err, null);
    assert.notEqual(seen[3][0], seen[0][0], 'another call gets another key');

    const md = new grpc.Metadata();
    md.set('idempotency-key', 'order-7');
    await create(stub, md);
    assert.deepEqual(seen[4], ['order-7'], 'a key the caller set is kept');
  } finally {
    stub.close();
    server.forceShutdown();
  }
});

test('stampIdempotencyKey stamps a fetch request once, before its retry loop', async () => {
  const coord = await startCoordinator();
  const client = new Client(coord.addr, clientOptions(coord));
  const guard = httpMiddleware(client, { withoutPrincipal: true });
  let runs = 0;
  let failures = 1;
  const keys = [];
  const server = http.createServer((req, res) => {
    keys.push(req.headers['idempotency-key']);
    guard(req, res, () => {
      runs++;
      res.setHeader('content-type', 'application/json');
      res.end(JSON.stringify({ order: runs }));
    });
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const url = `http://127.0.0.1:${server.address().port}/orders`;
  try {
    const init = { method: 'POST', body: '{"item":"book"}', headers: { 'content-type': 'application/json' } };
    const key = stampIdempotencyKey(init);
    assert.match(init.headers.get('Idempotency-Key'), /^"[0-9a-f-]{36}"$/);
    assert.equal(init.headers.get('Idempotency-Key'), `"${key}"`);
    assert.equal(stampIdempotencyKey(init), key, 'a stamped request keeps its key');
    let answer;
    for (let attempt = 0; attempt < 3; attempt++) {
      try {
        const r = await fetch(url, init);
        if (failures > 0) {
          failures--;
          throw new Error('the answer was lost'); // as if the connection broke after the service ran
        }
        answer = { result: r.headers.get('idempotency-result'), body: await r.json() };
        break;
      } catch {
        // retry with the same init, so the same key
      }
    }
    assert.deepEqual(answer, { result: 'replayed', body: { order: 1 } });
    assert.equal(runs, 1);
    assert.deepEqual(keys, [`"${key}"`, `"${key}"`]);

    const headers = new Headers({ 'Idempotency-Key': 'order-9' });
    assert.equal(stampIdempotencyKey(headers), 'order-9', 'a key already there is kept');
  } finally {
    server.close();
    await client.shutdown({ timeoutMs: 10000 });
    await coord.stop();
  }
});
