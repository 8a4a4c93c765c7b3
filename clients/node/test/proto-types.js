'use strict';
// The part of index.d.ts that the proto decides: a union of names for each
// top-level enum of idempotency.v1, read from idempotency.binpb.
// test/proto-types.test.js fails when index.d.ts differs from it;
// `node test/proto-types.js --write` rewrites that part.

const fs = require('node:fs');
const path = require('node:path');
const protobuf = require('protobufjs');
require('protobufjs/ext/descriptor');

const dtsPath = path.join(__dirname, '..', 'index.d.ts');
const BEGIN = '// BEGIN proto enums: generated from idempotency.binpb by `node test/proto-types.js --write`; do not edit.';
const END = '// END proto enums';

function union(name, values, doc) {
  const lines = [`/** ${doc} */`, `export type ${name} =`];
  for (const v of values) {
    lines.push(`  | '${v}'`);
  }
  lines[lines.length - 1] += ';';
  return lines.join('\n');
}

/** The generated block, from the descriptor set at descriptorPath. */
function render(descriptorPath = path.join(__dirname, '..', 'idempotency.binpb')) {
  const root = protobuf.Root.fromDescriptor(fs.readFileSync(descriptorPath));
  const pkg = root.lookup('idempotency.v1');
  const blocks = [];
  for (const e of Object.values(pkg.nested).filter((x) => x instanceof protobuf.Enum)) {
    const names = Object.entries(e.values).sort((a, b) => a[1] - b[1]).map(([n]) => n);
    blocks.push(union(e.name, names, `idempotency.v1.${e.name}, by value name.`));
    if (e.name === 'ErrorReason') {
      blocks.push(union('ErrorReasonName', names.filter((n) => e.values[n] !== 0).map((n) => n.replace(/^ERROR_REASON_/, '')),
        'An ErrorInfo reason as sent on the wire: an idempotency.v1.ErrorReason name without its ERROR_REASON_ prefix.'));
    }
  }
  return [BEGIN, ...blocks, END].join('\n');
}

/** The generated block as index.d.ts has it now. */
function current(text = fs.readFileSync(dtsPath, 'utf8')) {
  const a = text.indexOf(BEGIN);
  const b = text.indexOf(END);
  return a < 0 || b < a ? null : text.slice(a, b + END.length);
}

if (require.main === module && process.argv.includes('--write')) {
  const text = fs.readFileSync(dtsPath, 'utf8');
  const old = current(text);
  if (old === null) {
    throw new Error(`index.d.ts has no block between "${BEGIN}" and "${END}"`);
  }
  fs.writeFileSync(dtsPath, text.replace(old, render()));
}

module.exports = { render, current, dtsPath };
