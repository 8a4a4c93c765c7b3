'use strict';
// The runner of clients/testdata/http_conformance.json for the Node
// stacks (Express, Fastify): it starts a service per scenario with
// startService(options, handler) and checks the answers, the record
// (Lookup) and the handler's runs. The suite's "about" says what each
// field means.

const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const { markSideEffect, currentLease } = require('..');

/** The suite clients/testdata/<name>. */
const loadSuite = (name) => JSON.parse(fs.readFileSync(path.join(__dirname, '..', '..', 'testdata', name), 'utf8'));
const suite = loadSuite('http_conformance.json');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** The middleware options of a scenario's options. */
function middlewareOptions(o = {}) {
  const out = {};
  if (o.wait_ms !== undefined) out.waitMs = o.wait_ms;
  if (o.require_key) out.requireKey = true;
  if (o.methods) out.methods = o.methods;
  if (o.replay_headers) out.replayHeaders = o.replay_headers;
  if (o.replayable_statuses) out.replayableStatuses = o.replayable_statuses;
  if (o.max_body_bytes) out.maxBodyBytes = o.max_body_bytes;
  if (o.service) out.service = o.service;
  if (o.key_from_json_field) {
    const field = o.key_from_json_field;
    // A body that is not a JSON object has no key.
    out.key = (req, body) => {
      let fields;
      try {
        fields = JSON.parse(body.toString('utf8'));
      } catch {
        return undefined;
      }
      const k = fields?.[field];
      return typeof k === 'string' && k !== '' ? k : undefined;
    };
  }
  if (o.principal_header) {
    const h = o.principal_header.toLowerCase();
    out.principal = (req) => req.headers[h] ?? '';
  } else {
    out.withoutPrincipal = true;
  }
  return out;
}

/**
 * The suite's handler, framework-neutral: act(req, closed) returns what to
 * answer ({status, headers, body}) or null to answer nothing; it throws
 * for throw. closed resolves when the client has gone.
 */
function makeHandler(calls) {
  return async function act(headers, closed) {
    const scenario = headers['x-scenario'] ?? '';
    calls.set(scenario, (calls.get(scenario) ?? 0) + 1);
    const a = JSON.parse(headers['x-conformance'] || '{}');
    if (a.sleep_ms) await sleep(a.sleep_ms);
    if (a.mark) markSideEffect();
    if (a.throw) throw new Error('the conformance handler throws');
    if (a.until_disconnect) {
      await Promise.race([closed, sleep(5000)]);
      return null;
    }
    if (a.echo_lease) {
      const l = currentLease();
      return { status: 200, headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ attempt: l.attempt, previous: l.previous }) };
    }
    return { status: a.status || 200, headers: a.headers ?? {}, body: a.body ?? '' };
  };
}

async function send(base, key, st) {
  const fill = (s) => s.replaceAll('{key}', key);
  const rq = st.request;
  const headers = { 'X-Scenario': key, 'X-Conformance': JSON.stringify(st.handler ?? {}) };
  for (const [k, v] of Object.entries(rq.headers ?? {})) headers[k] = fill(v);
  const init = { method: rq.method, headers, body: typeof rq.body === 'string' ? fill(rq.body) : rq.body };
  if (st.timeout_ms) init.signal = AbortSignal.timeout(st.timeout_ms);
  const e = st.expect ?? {};
  let resp;
  try {
    resp = await fetch(base + rq.path, init);
  } catch (err) {
    if (e.gave_up) return '';
    throw err;
  }
  const body = await resp.text().catch((err) => {
    if (e.gave_up) return '';
    throw err;
  });
  const where = `${rq.method} ${rq.path}: got ${resp.status} ${JSON.stringify([...resp.headers])} ${body}`;
  assert.ok(!e.gave_up, `${where}; want the client to give up`);
  assert.equal(resp.status, e.status, where);
  for (const [k, v] of Object.entries(e.headers ?? {})) assert.equal(resp.headers.get(k), fill(v), `${where}: header ${k}`);
  for (const k of e.absent_headers ?? []) assert.ok(!resp.headers.has(k), `${where}: want no ${k}`);
  for (const k of e.header_present ?? []) assert.ok(resp.headers.get(k), `${where}: want a ${k}`);
  if (e.body !== undefined) assert.equal(body, e.body, where);
  if (e.problem) {
    assert.equal(resp.headers.get('content-type'), 'application/problem+json', where);
    const p = JSON.parse(body);
    assert.equal(p.type, e.problem, where);
    assert.equal(p.status, e.status, where);
  }
  return resp.headers.get('idempotency-result') ?? '';
}

/**
 * Runs scenario sc of either suite (HTTP, gRPC) and checks its outcome; its
 * key is recorded in scope by client. send(key, st) makes step st's call,
 * checks the answer and resolves with its idempotency-result;
 * checksState(st): st only checks the record's state; countsLabel names the
 * idempotency-result counts in a failure; holdMustAcquire: the scenario's
 * hold of the key is checked to acquire it. calls counts the handler's runs
 * by key.
 */
async function runScenario({ client, scope, sc, calls, send: sendStep, checksState, countsLabel, holdMustAcquire }) {
  const key = `conf-${crypto.randomBytes(12).toString('hex')}`;
  // The record the state is read from: the scenario's key, else the run's.
  const recordKey = (sc.key ?? '{key}').replaceAll('{key}', key);
  const lookup = async () => {
    try {
      return (await client.lookup({ scope, key: recordKey })).record.state;
    } catch (err) {
      if (err.code === 5) return 'absent'; // NOT_FOUND
      throw err;
    }
  };
  const wantState = async (want) => {
    const deadline = Date.now() + 10000;
    let got = await lookup();
    while (got !== want && Date.now() < deadline) {
      await sleep(50);
      got = await lookup();
    }
    assert.equal(got, want, 'state');
  };
  let holdToken;
  if (sc.hold_key) {
    const res = await client.begin({ scope, key, attempt_id: 'holder' });
    if (holdMustAcquire) assert.equal(res.outcome, 'OUTCOME_ACQUIRED');
    holdToken = res.lease_token;
  }
  const background = [];
  for (const st of sc.steps) {
    if (st.release_hold) {
      await sleep(st.settle_ms ?? 0);
      await client.fail({ scope, key, lease_token: holdToken, kind: 'FAILURE_KIND_ABANDONED', reason: 'released' });
      continue;
    }
    if (checksState(st)) {
      await wantState(st.state);
      continue;
    }
    const run = async () => {
      await sleep(st.start_after_ms ?? 0);
      const results = await Promise.all(Array.from({ length: st.repeat ?? 1 }, () => sendStep(key, st)));
      if (st.expect_counts) {
        const got = {};
        for (const r of results) got[r] = (got[r] ?? 0) + 1;
        for (const [k, v] of Object.entries(st.expect_counts)) assert.equal(got[k] ?? 0, v, `${countsLabel} ${JSON.stringify(got)}`);
      }
    };
    if (st.background) background.push(run());
    else await run();
  }
  await Promise.all(background);
  if (sc.state) await wantState(sc.state);
  if (sc.handler_calls !== undefined) assert.equal(calls.get(key) ?? 0, sc.handler_calls, 'handler runs');
}

/**
 * Runs every scenario as a subtest of t. startService(options, act)
 * resolves with { url, close }.
 */
async function runHttpConformance(t, stack, client, startService) {
  const calls = new Map();
  const act = makeHandler(calls);
  let ran = 0;
  for (const sc of suite.scenarios) {
    await t.test(sc.name, async (t) => {
      if (sc.skip?.[stack]) {
        t.skip(sc.skip[stack]);
        return;
      }
      const svc = await startService(middlewareOptions(sc.options), act);
      try {
        await runScenario({
          client, scope: sc.scope ?? 'POST /items', sc, calls, send: (key, st) => send(svc.url, key, st),
          checksState: (st) => !st.request, countsLabel: 'Idempotency-Result counts', holdMustAcquire: true,
        });
        ran++;
      } finally {
        await svc.close();
      }
    });
  }
  return ran;
}

module.exports = { runHttpConformance, runScenario, loadSuite, suite };
