'use strict';
// The package as users get it: `npm pack`, installed into an empty project
// beside @grpc/grpc-js, run from ESM and from CommonJS against a real
// coordinator, and type-checked from an ES module.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { execFileSync } = require('node:child_process');
const { startCoordinator } = require('./coordinator');

const pkgDir = path.join(__dirname, '..');
const pkg = JSON.parse(fs.readFileSync(path.join(pkgDir, 'package.json'), 'utf8'));
const npm = process.platform === 'win32' ? 'npm.cmd' : 'npm';

test('the ES module exports every CommonJS export, by name', async () => {
  const cjs = require('..');
  const esm = await import(require('node:url').pathToFileURL(path.join(pkgDir, 'index.mjs')).href);
  assert.deepEqual(Object.keys(esm).filter((k) => k !== 'default').sort(), Object.keys(cjs).sort());
  assert.equal(esm.LeaseLostError, cjs.LeaseLostError);
  assert.equal(esm.default, cjs);
});

test('npm pack installs into an empty project and runs from ESM and CommonJS', { timeout: 300000 }, async () => {
  const coord = await startCoordinator();
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'idemcoord-pack-'));
  try {
    const out = execFileSync(npm, ['pack', '--json', '--pack-destination', dir], { cwd: pkgDir, encoding: 'utf8' });
    const [{ filename, files }] = JSON.parse(out);
    const packed = files.map((f) => f.path);
    for (const f of ['index.js', 'index.mjs', 'index.d.ts', 'idempotency.binpb', 'shared_tables.json', 'lib/grpc.js', 'lib/batching.js']) {
      assert.ok(packed.includes(f), `the tarball holds ${f}: ${packed.join(' ')}`);
    }
    assert.ok(!packed.some((f) => f.startsWith('test/')), 'the tests stay out of the tarball');
    assert.ok(!packed.some((f) => f.startsWith('bench/')), 'the load generator stays out of the tarball');

    const app = path.join(dir, 'app');
    fs.mkdirSync(app);
    fs.writeFileSync(path.join(app, 'package.json'), JSON.stringify({ name: 'app', private: true }));
    execFileSync(npm, ['install', '--prefer-offline', '--no-audit', '--no-fund', path.join(dir, filename),
      `@grpc/grpc-js@${pkg.devDependencies['@grpc/grpc-js']}`], { cwd: app, stdio: 'pipe' });
    assert.ok(!fs.existsSync(path.join(app, 'node_modules', 'idemcoord', 'node_modules', '@grpc', 'grpc-js')),
      'idemcoord uses the application\'s @grpc/grpc-js, not a copy of its own');

    const body = (importLine) => `${importLine}
const client = new Client(process.env.IDEMCOORD_ADDR, { token: process.env.IDEMCOORD_TOKEN });
const key = dedupKey('pack', process.argv[2], null, 'Project ' + process.argv[2]);
let runs = 0;
const fn = async () => { runs++; return { body: Buffer.from('made ' + process.argv[2]), status_code: 201 }; };
const first = await client.once('pack.test', key, 'fp', fn);
const second = await client.once('pack.test', key, 'fp', fn);
const err = new LeaseLostError();
console.log(JSON.stringify({ runs, first: first.replayed, second: second.replayed, body: second.response.body.toString(),
  lease: err instanceof Error && err.name, reasons: REASONS.LEASE_LOST, problem: PROBLEMS.keyReused,
  interceptor: typeof serverInterceptor(client, { withoutPrincipal: true }) }));
client.close();
`;
    fs.writeFileSync(path.join(app, 'esm.mjs'), body(
      "import { Client, dedupKey, LeaseLostError, REASONS, PROBLEMS, serverInterceptor } from 'idemcoord';"));
    fs.writeFileSync(path.join(app, 'cjs.cjs'), `(async () => {\n${body(
      "const { Client, dedupKey, LeaseLostError, REASONS, PROBLEMS, serverInterceptor } = require('idemcoord');")}})();\n`);
    const env = { ...process.env, IDEMCOORD_ADDR: coord.addr, IDEMCOORD_TOKEN: coord.token };
    for (const [file, name] of [['esm.mjs', 'esm'], ['cjs.cjs', 'cjs']]) {
      const got = JSON.parse(execFileSync(process.execPath, [file, `${name}-${process.pid}-${Date.now()}`], { cwd: app, env, encoding: 'utf8' }));
      assert.deepEqual({ ...got, body: got.body.replace(/ .*/, '') }, {
        runs: 1, first: false, second: true, body: 'made', lease: 'LeaseLostError', reasons: 'LEASE_LOST',
        problem: 'urn:idemcoord:problem:idempotency-key-reused', interceptor: 'function',
      }, file);
    }

    // The types, as an ES module of a TypeScript project sees them.
    fs.writeFileSync(path.join(app, 'usage.mts'), `import { Client, LeaseLostError, type State, type ErrorReasonName } from 'idemcoord';
const c: Client = new Client('127.0.0.1:50051');
const s: State = 'STATE_COMPLETED';
const r: ErrorReasonName = 'LEASE_LOST';
const e: Error = new LeaseLostError();
void [c, s, r, e];
`);
    fs.writeFileSync(path.join(app, 'tsconfig.json'), JSON.stringify({
      compilerOptions: {
        strict: true, noEmit: true, target: 'es2022', module: 'nodenext', moduleResolution: 'nodenext',
        types: ['node'], typeRoots: [path.join(pkgDir, 'node_modules', '@types')],
      },
      files: ['usage.mts'],
    }));
    execFileSync(process.execPath, [path.join(pkgDir, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', app], { cwd: app, encoding: 'utf8' });
  } catch (err) {
    assert.fail(`${err.message}\n${err.stdout ?? ''}${err.stderr ?? ''}`);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
    await coord.stop();
  }
});
