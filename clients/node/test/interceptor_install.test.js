'use strict';
// serverInterceptor(client) alone, the one-line install, guards a grpc-js
// server's unary methods with the call's own codec: here a service whose
// messages are JSON (custom serializers, no descriptor in the library's pool).

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const grpc = require('@grpc/grpc-js');
const { Client, serverInterceptor } = require('..');
const { startCoordinator, clientOptions } = require('./coordinator');

const json = {
  serialize: (o) => Buffer.from(JSON.stringify(o)),
  // The raw bytes are kept, so the test can compare replays byte for byte.
  deserialize: (b) => Object.defineProperty(JSON.parse(b.toString()), 'raw', { value: Buffer.from(b) }),
};
const unary = (path) => ({
  path, requestStream: false, responseStream: false,
  requestSerialize: json.serialize, requestDeserialize: json.deserialize,
  responseSerialize: json.serialize, responseDeserialize: json.deserialize,
});
const Payments = {
  Charge: unary('/shop.v1.Payments/Charge'),
  Watch: { ...unary('/shop.v1.Payments/Watch'), responseStream: true },
};

let coord;
let client;

test.before(async () => {
  coord = await startCoordinator();
  client = new Client(coord.addr, clientOptions(coord));
});

test.after(async () => {
  await client.shutdown({ timeoutMs: 10000 });
  await coord.stop();
});

async function serve(interceptor, impl) {
  const server = new grpc.Server({ interceptors: [interceptor] });
  server.addService(Payments, impl);
  const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(),
    (err, p) => (err ? reject(err) : resolve(p))));
  const Stub = grpc.makeGenericClientConstructor(Payments, 'Payments');
  const stub = new Stub(`127.0.0.1:${port}`, grpc.credentials.createInsecure());
  return { stub, close: () => { stub.close(); server.forceShutdown(); } };
}

function charge(stub, key, request) {
  return new Promise((resolve) => {
    const md = new grpc.Metadata();
    md.set('idempotency-key', key);
    let header = new grpc.Metadata();
    const call = stub.Charge(request, md, (err, res) => resolve({ err, res, result: String(header.get('idempotency-result')[0] ?? '') }));
    call.on('metadata', (m) => { header = m; });
  });
}

test('serverInterceptor(client) alone guards every unary method with the call\'s own codec', async () => {
  let runs = 0;
  const { stub, close } = await serve(serverInterceptor(client, { withoutPrincipal: true }), {
    Charge(call, callback) {
      runs++;
      // An answer that differs on every run: a replay must be the stored bytes.
      setTimeout(() => callback(null, { charged: call.request.amount, nonce: crypto.randomUUID() }), 300);
    },
    Watch(call) {
      call.write({ n: 1 });
      call.end();
    },
  });
  try {
    const key = `install-${crypto.randomUUID()}`;
    const answers = await Promise.all(Array.from({ length: 10 }, () => charge(stub, key, { amount: 42 })));
    assert.equal(runs, 1, 'the handler ran once for 10 concurrent duplicates');
    const created = answers.filter((a) => !a.err);
    assert.equal(created.length, 1, JSON.stringify(answers.map((a) => a.err?.code ?? a.result)));
    assert.equal(created[0].result, 'created');
    for (const a of answers.filter((x) => x.err)) {
      assert.equal(a.err.code, grpc.status.ABORTED, `a duplicate in progress is told so: ${a.err.details}`);
    }

    const again = await charge(stub, key, { amount: 42 });
    assert.equal(again.err, null);
    assert.equal(again.result, 'replayed');
    assert.deepEqual(again.res.raw, created[0].res.raw, 'the replay is the stored answer byte for byte');
    assert.equal(runs, 1);

    const changed = await charge(stub, key, { amount: 43 });
    assert.equal(changed.err?.code, grpc.status.FAILED_PRECONDITION, 'a changed request with the same key is refused');
    assert.equal(runs, 1);

    // A streaming method is not guarded: it runs as it is.
    const streamed = await new Promise((resolve, reject) => {
      const got = [];
      const call = stub.Watch({});
      call.on('data', (m) => got.push(m.n));
      call.on('error', reject);
      call.on('end', () => resolve(got));
    });
    assert.deepEqual(streamed, [1]);
  } finally {
    close();
  }
});

test('an interceptor that would guard nothing says so when built', () => {
  const warnings = [];
  const logger = { warn: (msg) => warnings.push(msg) };
  const quiet = new Client(coord.addr, clientOptions(coord, { logger }));
  try {
    serverInterceptor(quiet, { withoutPrincipal: true });
    assert.deepEqual(warnings, [], 'the one-line install guards every unary method: nothing to warn about');
    serverInterceptor(quiet, { withoutPrincipal: true, methods: [] });
    assert.equal(warnings.length, 1);
    assert.match(warnings[0], /guards nothing/);
    serverInterceptor(quiet, { withoutPrincipal: true, services: [Payments], methods: ['/shop.v1.Payments/Watch'] });
    assert.equal(warnings.length, 2);
    assert.match(warnings[1], /streaming/);
  } finally {
    quiet.close();
  }
});
