// The Node retrying client of chaos/retryclients_test.go: axios with
// axios-retry (pinned by package-lock.json), sending POST /projects to the
// HTTP demo through a fault-injecting proxy.
//
//   node client.js PLAN.json faults|replay
//
// PLAN.json (written by the test): {url, user, concurrency, retries,
// normal_timeout_ms, ops: [{key, name, timeout_ms}]}. Each operation sets
// its Idempotency-Key once (as a structured-field string) and axios-retry
// reuses the request, key included, on every retry: network errors, time-outs
// and 5xx/429. In "faults" an operation is sent with its own time-out, and
// sent once more with the normal one when the first send got no answer (a
// user pressing "retry"); in "replay" it is sent once with the normal
// time-out. One JSON line per operation on stdout:
// {"i": N, "sends": [{"status": 201, "body": "<base64>", "result": "created", "error": ""}]}.
'use strict';

const fs = require('node:fs');
const axios = require('axios');
const axiosRetry = require('axios-retry').default;
const { isNetworkError, isRetryableError, retryAfter } = require('axios-retry');

async function main() {
  const [planFile, phase] = process.argv.slice(2);
  const plan = JSON.parse(fs.readFileSync(planFile, 'utf8'));
  const http = axios.create({
    responseType: 'arraybuffer', // the body byte for byte
    transitional: { clarifyTimeoutError: false },
  });
  axiosRetry(http, {
    retries: plan.retries,
    shouldResetTimeout: true, // the time-out is per try
    retryCondition: (err) => isNetworkError(err) || isRetryableError(err) || err.code === 'ECONNABORTED',
    retryDelay: (n, err) => Math.max(retryAfter(err), 10 * 2 ** n) + Math.random() * 10,
  });

  async function send(op, timeout) {
    let retries = 0;
    try {
      const resp = await http.post(plan.url, JSON.stringify({ name: op.name, prompt: 'from axios' }), {
        timeout,
        'axios-retry': { onRetry: () => { retries++; } },
        headers: {
          'Content-Type': 'application/json',
          'Idempotency-Key': `"${op.key}"`,
          'X-User-Id': plan.user,
        },
      });
      return { status: resp.status, body: Buffer.from(resp.data).toString('base64'),
        result: resp.headers['idempotency-result'] || '', error: '', retries };
    } catch (err) {
      if (err.response) {
        const r = err.response;
        return { status: r.status, body: Buffer.from(r.data || []).toString('base64'),
          result: r.headers['idempotency-result'] || '', error: '', retries };
      }
      return { status: 0, body: '', result: '', error: `${err.code || ''} ${err.message}`.trim(), retries };
    }
  }

  let next = 0;
  async function worker() {
    for (;;) {
      const i = next++;
      if (i >= plan.ops.length) return;
      const op = plan.ops[i];
      const sends = [];
      if (phase === 'faults') {
        sends.push(await send(op, op.timeout_ms));
        if (sends[0].status === 0) sends.push(await send(op, plan.normal_timeout_ms));
      } else {
        sends.push(await send(op, plan.normal_timeout_ms));
      }
      process.stdout.write(JSON.stringify({ i, sends }) + '\n');
    }
  }
  await Promise.all(Array.from({ length: plan.concurrency }, worker));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
