// A load generator of the Node client: callers concurrent callers, each in
// a loop, through one Client (with callBatching when --batching > 0):
//
//   pairs:   begin on a new key, then complete it (a response of
//            --body-bytes bytes);
//   replays: begin on one of the COMPLETED keys replay-0 … replay-<n-1>
//            (--replay-keys n), which must answer OUTCOME_REPLAY with the
//            stored body; missing ones are completed first;
//   both:    pairs, then replays, each for the warm-up and the duration.
//
// Records, fingerprint and stored response are the ones bench/'s Go driver
// writes (scope "bench", fingerprint SHA-256 of "idemcoord bench request"),
// so its replay keys serve here too. It is a development tool: the npm
// package leaves bench/ out (package.json "files").
//
//   node clients/node/bench/pairs.mjs [flags]
//     --target host:port   the coordinator (default $IDEMCOORD_ADDR, else 127.0.0.1:50051)
//     --token t            bearer token (default $IDEMCOORD_TOKEN; none: auth off)
//     --callers n          concurrent callers (default 64)
//     --mode m             pairs, replays or both (default both)
//     --warmup s           seconds run before measuring, not counted (default 1)
//     --duration s         seconds measured, per mode (default 5)
//     --batching n         the Client's callBatching: Batch RPCs in flight, 0 unary (default 0)
//     --replay-keys n      COMPLETED keys the replays cycle through (default 1024)
//     --body-bytes n       bytes of each stored response (default 150)
//     --scope s            scope of every record (default bench)
//
// Output: a line "measuring" when a measured window starts; at the end one
// JSON line of the iterations that started and ended inside the window(s):
// pairs_per_s and/or replays_per_s, and (for the last window measured)
// ops, errors, seconds, first_error, begin_p50_ms, begin_p99_ms, which is
// what bench/ (-paths node) reads. The exit status is 1 when any iteration
// failed.

import crypto from 'node:crypto';
import { parseArgs } from 'node:util';
import { Client } from '../index.mjs';

const { values: flags } = parseArgs({
  options: {
    target: { type: 'string', default: process.env.IDEMCOORD_ADDR || '127.0.0.1:50051' },
    token: { type: 'string', default: process.env.IDEMCOORD_TOKEN || '' },
    callers: { type: 'string', default: '64' },
    mode: { type: 'string', default: 'both' },
    warmup: { type: 'string', default: '1' },
    duration: { type: 'string', default: '5' },
    batching: { type: 'string', default: '0' },
    'replay-keys': { type: 'string', default: '1024' },
    'body-bytes': { type: 'string', default: '150' },
    scope: { type: 'string', default: 'bench' },
  },
  strict: true,
});

function number(name, min) {
  const n = Number(flags[name]);
  if (!Number.isFinite(n) || n < min) {
    throw new RangeError(`--${name} must be a number of at least ${min}, got ${flags[name]}`);
  }
  return n;
}

const callers = Math.floor(number('callers', 1));
const warmupMs = number('warmup', 0) * 1000;
const durationMs = number('duration', 0.001) * 1000;
const batching = Math.floor(number('batching', 0));
const replayKeys = Math.floor(number('replay-keys', 1));
const bodyBytes = Math.floor(number('body-bytes', 0));
const { scope, mode } = flags;
if (!['pairs', 'replays', 'both'].includes(mode)) {
  throw new RangeError(`--mode is pairs, replays or both, not ${mode}`);
}

const fingerprint = crypto.createHash('sha256').update('idemcoord bench request').digest();
const body = Buffer.alloc(bodyBytes);
for (let i = 0; i < bodyBytes; i++) {
  body[i] = 0x61 + (i % 26);
}
const response = { schema_version: 'bench.v1.Response/1', content_type: 'application/x-protobuf', body };

const client = new Client(flags.target, { token: flags.token, callBatching: batching });

// A new key: 32 random hex digits (bench/'s Go driver draws its keys from
// a math/rand PCG), cut from a pool of random bytes, since a
// crypto.randomBytes call per key would count the generator's own cost as
// the client's: a real caller's keys come with its requests.
let keyPool = Buffer.alloc(0);
let keyOffset = 0;
function newKey() {
  if (keyOffset + 16 > keyPool.length) {
    keyPool = crypto.randomBytes(4096);
    keyOffset = 0;
  }
  keyOffset += 16;
  return keyPool.toString('hex', keyOffset - 16, keyOffset);
}

async function pair() {
  const key = newKey();
  const t0 = performance.now();
  const b = await client.begin({ scope, key, fingerprint });
  const began = performance.now() - t0;
  if (b.outcome !== 'OUTCOME_ACQUIRED') {
    throw new Error(`begin on a new key answered ${b.outcome}`);
  }
  await client.complete({ scope, key, lease_token: b.lease_token, response });
  return began;
}

async function replay() {
  const key = `replay-${crypto.randomInt(replayKeys)}`;
  const t0 = performance.now();
  const b = await client.begin({ scope, key, fingerprint });
  const began = performance.now() - t0;
  if (b.outcome !== 'OUTCOME_REPLAY' || b.record?.response?.body?.length !== bodyBytes) {
    throw new Error(`begin on a completed key answered ${b.outcome}`);
  }
  return began;
}

/** Completes the replay keys that are not yet (as bench/'s driver does), 64 at a time. */
async function prepareReplayKeys() {
  for (let i = 0; i < replayKeys; i += 64) {
    await Promise.all(Array.from({ length: Math.min(64, replayKeys - i) }, async (_, j) => {
      const key = `replay-${i + j}`;
      const b = await client.begin({ scope, key, fingerprint });
      if (b.outcome === 'OUTCOME_ACQUIRED') {
        await client.complete({ scope, key, lease_token: b.lease_token, response });
      } else if (b.outcome !== 'OUTCOME_REPLAY') {
        throw new Error(`preparing ${key}: begin answered ${b.outcome}`);
      }
    }));
  }
}

function quantile(sorted, q) {
  if (sorted.length === 0) {
    return 0;
  }
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}

/**
 * Runs op in callers loops for the warm-up and then the measured window,
 * and returns what happened inside the window.
 */
async function measure(op) {
  const start = performance.now();
  const windowStart = start + warmupMs;
  const windowEnd = windowStart + durationMs;
  let ops = 0;
  let errors = 0;
  let firstError = '';
  const latencies = [];
  let announced = false;
  const announce = () => {
    if (!announced) {
      announced = true;
      process.stdout.write('measuring\n');
    }
  };
  const timer = setTimeout(announce, warmupMs);
  await Promise.all(Array.from({ length: callers }, async () => {
    while (performance.now() < windowEnd) {
      const t0 = performance.now();
      let began = 0;
      let err = null;
      try {
        began = await op();
      } catch (e) {
        err = e;
      }
      const t1 = performance.now();
      if (t0 < windowStart || t1 > windowEnd) {
        continue; // not wholly inside the window
      }
      if (err) {
        errors++;
        firstError ||= String(err?.message ?? err);
      } else {
        ops++;
        latencies.push(began);
      }
    }
  }));
  clearTimeout(timer);
  announce();
  latencies.sort((a, b) => a - b);
  const seconds = durationMs / 1000;
  return {
    ops, errors, seconds, first_error: firstError,
    begin_p50_ms: quantile(latencies, 0.5), begin_p99_ms: quantile(latencies, 0.99),
    per_s: ops / seconds,
  };
}

const out = { callers, batching };
let last;
let failed = 0;
if (mode === 'pairs' || mode === 'both') {
  last = await measure(pair);
  out.pairs_per_s = last.per_s;
  failed += last.errors;
}
if (mode === 'replays' || mode === 'both') {
  await prepareReplayKeys();
  last = await measure(replay);
  out.replays_per_s = last.per_s;
  failed += last.errors;
}
delete last.per_s;
process.stdout.write(`${JSON.stringify({ ...out, ...last })}\n`);
await client.shutdown({ timeoutMs: 10000 });
process.exitCode = failed > 0 ? 1 : 0;
