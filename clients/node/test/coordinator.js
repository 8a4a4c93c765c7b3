'use strict';
// The coordinator the tests run against: IDEMCOORD_ADDR (and
// IDEMCOORD_TOKEN) when set, else a throwaway one started with
// `go run ./internal/cmd/throwaway-coordinator` (a fresh PostgreSQL and the built binary).

const { spawn } = require('node:child_process');
const path = require('node:path');
const readline = require('node:readline');

async function startCoordinator() {
  if (process.env.IDEMCOORD_ADDR) {
    return { addr: process.env.IDEMCOORD_ADDR, token: process.env.IDEMCOORD_TOKEN ?? '', stop: async () => {} };
  }
  const root = path.resolve(__dirname, '..', '..', '..');
  const child = spawn('go', ['run', './internal/cmd/throwaway-coordinator'], { cwd: root, stdio: ['pipe', 'pipe', 'inherit'] });
  const exited = new Promise((resolve) => child.once('exit', resolve));
  const line = await new Promise((resolve, reject) => {
    child.once('error', (err) => reject(new Error(`cannot run go to start a coordinator (set IDEMCOORD_ADDR instead): ${err.message}`)));
    readline.createInterface({ input: child.stdout }).once('line', resolve);
    exited.then((code) => reject(new Error(`go run ./internal/cmd/throwaway-coordinator exited with ${code} before the coordinator was ready`)));
  });
  const { addr, token } = JSON.parse(line);
  return {
    addr,
    token,
    stop: async () => {
      child.stdin.end();
      await exited;
    },
  };
}

/**
 * The environment variable that, set to a number, makes the suites'
 * Clients share RPCs (the callBatching option with that many Batch RPCs
 * in flight), so that every promise tested through them is tested through
 * Batch RPCs too: `IDEMCOORD_TEST_CALL_BATCHING=2 npm test`.
 */
const CALL_BATCHING_ENV = 'IDEMCOORD_TEST_CALL_BATCHING';

/**
 * The options of a suite's Client of coord: its token and options, with
 * callBatching from CALL_BATCHING_ENV when set, unless options name
 * interceptors (the tests' faults act on a unary method by name) or
 * callBatching.
 */
function clientOptions(coord, options = {}) {
  const n = Number(process.env[CALL_BATCHING_ENV]);
  const batching = n > 0 && !options.interceptors && options.callBatching === undefined ? { callBatching: n } : {};
  return { token: coord.token, ...batching, ...options };
}

module.exports = { startCoordinator, clientOptions, CALL_BATCHING_ENV };
