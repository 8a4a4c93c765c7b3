'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { dedupKey, normalizeName } = require('..');

const vectors = JSON.parse(fs.readFileSync(path.join(__dirname, '..', '..', 'testdata', 'dedupkey.json'), 'utf8')).cases;

test('the shared DedupKey vectors', () => {
  assert.ok(vectors.length >= 40, `${vectors.length} vectors`);
  for (const c of vectors) {
    assert.equal(normalizeName(c.project_name), c.normalized, `${c.comment}: normalizeName(${JSON.stringify(c.project_name)})`);
    assert.equal(dedupKey(c.intent, c.user_id, c.project_id, c.project_name), c.key, c.comment);
  }
});

test('what the seed normalization got wrong', () => {
  // trim().toLowerCase().replace(/\s+/g, ' ') keeps U+0085 and a U+FEFF
  // inside the name, where Go and Python fold and remove them.
  const seed = (s) => s.trim().toLowerCase().replace(/\s+/g, ' ');
  for (const name of ['Flower\u0085Shop', 'Flo\uFEFFwer Shop']) {
    assert.notEqual(seed(name), 'flower shop');
    assert.equal(normalizeName(name), 'flower shop');
  }
});

test('missing names and ids', () => {
  assert.equal(dedupKey('a', 'u', null, null), dedupKey('a', 'u', '', ''));
  assert.equal(dedupKey('a', 'u', undefined, '  '), dedupKey('a', 'u', '', ''));
  assert.equal(dedupKey('rename', 'u1', 'prj_7', 'x'), 'rename:u1:p:prj_7');
});
