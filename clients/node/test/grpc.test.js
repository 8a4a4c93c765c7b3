'use strict';
// The grpc-js server interceptor runs the shared gRPC suite
// (clients/testdata/grpc_conformance.json) against a real coordinator. The
// guarded method is /idempotency.v1.Coordinator/Begin of a test server.

const test = require('node:test');
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const { Client, serverInterceptor, markSideEffect, currentLease } = require('..');
const api = require('../lib/api');
const { startCoordinator, clientOptions } = require('./coordinator');
const { loadSuite, runScenario } = require('./conformance');

const suite = loadSuite('grpc_conformance.json');
const METHOD = '/idempotency.v1.Coordinator/Begin';
const codeName = (c) => Object.keys(grpc.status).find((k) => grpc.status[k] === c);

let coord;
let client;
const calls = new Map();

test.before(async () => {
  coord = await startCoordinator();
  client = new Client(coord.addr, clientOptions(coord, { leaseMs: suite.client_lease_ms }));
});

test.after(async () => {
  await client.shutdown({ timeoutMs: 10000 });
  await coord.stop();
});

function begin(call, callback) {
  const md = call.metadata;
  const scenario = String(md.get('x-scenario')[0] ?? '');
  calls.set(scenario, (calls.get(scenario) ?? 0) + 1);
  const a = JSON.parse(String(md.get('x-conformance')[0] ?? '{}'));
  const answer = () => {
    if (a.mark) markSideEffect();
    if (a.throw) throw new Error('the conformance handler throws');
    if (a.until_cancelled) {
      const t = setTimeout(() => callback({ code: grpc.status.CANCELLED, details: 'cancelled' }), 5000);
      call.on('cancelled', () => { clearTimeout(t); callback({ code: grpc.status.CANCELLED, details: 'cancelled' }); });
      return;
    }
    if (a.code) {
      callback({ code: grpc.status[a.code], details: a.message ?? '' });
      return;
    }
    if (a.echo_lease) {
      const l = currentLease();
      callback(null, { lease_token: `${l.attempt} ${l.previous}` });
      return;
    }
    callback(null, { lease_token: a.token ?? '' });
  };
  if (a.sleep_ms) {
    // markSideEffect must run in the attempt's context: the timer keeps it.
    setTimeout(() => {
      try { answer(); } catch (err) { callback({ code: grpc.status.UNKNOWN, details: err.message }); }
    }, a.sleep_ms);
    return;
  }
  answer();
}

async function startServer(o) {
  const server = new grpc.Server({
    interceptors: [serverInterceptor(client, {
      services: [api.CoordinatorClient.service], waitMs: o.wait_ms ?? 0, requireKey: Boolean(o.require_key), withoutPrincipal: true,
    })],
  });
  server.addService(api.CoordinatorClient.service, { Begin: begin });
  const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(),
    (err, p) => (err ? reject(err) : resolve(p))));
  const stub = new api.CoordinatorClient(`127.0.0.1:${port}`, grpc.credentials.createInsecure());
  return { stub, close: () => { stub.close(); server.forceShutdown(); } };
}

function callOnce(stub, key, st) {
  return new Promise((resolve) => {
    const md = new grpc.Metadata();
    md.set('x-scenario', key);
    md.set('x-conformance', JSON.stringify(st.handler ?? {}));
    for (const [k, v] of Object.entries(st.metadata ?? {})) md.set(k, v.replaceAll('{key}', key));
    const opts = st.timeout_ms ? { deadline: Date.now() + st.timeout_ms } : {};
    let header = new grpc.Metadata();
    const call = stub.Begin({ scope: st.request_scope, key: 'k' }, md, opts, (err, res) => {
      resolve({ err, res, header });
    });
    call.on('metadata', (m) => { header = m; });
    call.on('status', (s) => { resolve.trailer = s.metadata; });
  });
}

async function send(stub, key, st) {
  const { err, res, header } = await callOnce(stub, key, st);
  const e = st.expect;
  const got = err ? codeName(err.code) : 'OK';
  const result = String(header.get('idempotency-result')[0] ?? err?.metadata?.get('idempotency-result')[0] ?? '');
  const where = `got ${got} ${err?.details ?? ''} result ${result} response ${JSON.stringify(res)}`;
  assert.ok(e.code.split('|').includes(got), `want ${e.code}; ${where}`);
  if (e.message !== undefined) assert.equal(err?.details, e.message, where);
  if (e.token !== undefined) assert.equal(res?.lease_token, e.token, where);
  if (e.result !== undefined) assert.equal(result, e.result, where);
  if (e.pushback) assert.ok(err?.metadata?.get('grpc-retry-pushback-ms').length > 0, `want a pushback trailer; ${where}`);
  return result;
}

test('the grpc-js server interceptor passes the gRPC conformance suite', { timeout: 300000 }, async (t) => {
  for (const sc of suite.scenarios) {
    await t.test(sc.name, async (t) => {
      if (sc.skip?.node) {
        t.skip(sc.skip.node);
        return;
      }
      const { stub, close } = await startServer(sc.options ?? {});
      try {
        await runScenario({
          client, scope: METHOD, sc, calls, send: (key, st) => send(stub, key, st),
          checksState: (st) => Boolean(st.state), countsLabel: 'counts', holdMustAcquire: false,
        });
      } finally {
        close();
      }
    });
  }
});
