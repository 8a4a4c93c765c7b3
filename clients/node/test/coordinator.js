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

module.exports = { startCoordinator };
