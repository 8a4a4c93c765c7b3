'use strict';
// The deterministic key, as Go's clients.DedupKey and Python's
// idemcoord.dedup_key compute it (see clients/dedup.go for the
// specification; clients/testdata/dedupkey.json holds the shared vectors).

const crypto = require('node:crypto');

// Runs of Unicode White_Space. JavaScript's \s is a different set: it
// lacks U+0085 and has U+FEFF.
const whiteSpace = /\p{White_Space}+/gu;
// A lone surrogate (a UTF-16 string that is not valid Unicode text).
const loneSurrogate = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g;

/**
 * normalizeName is the normalization dedupKey applies to a project name: NFC,
 * every U+FEFF removed, White_Space trimmed, full lower-case mapping
 * (SpecialCasing, Final_Sigma), runs of White_Space folded to one space.
 * A lone surrogate is first replaced by U+FFFD.
 * @param {string} name
 * @returns {string}
 */
function normalizeName(name) {
  let s = String(name ?? '').replace(loneSurrogate, '\uFFFD').normalize('NFC');
  s = s.replaceAll('\uFEFF', '').toLowerCase();
  return s.split(whiteSpace).filter((w) => w !== '').join(' ');
}

/**
 * dedupKey is the deterministic idempotency key for callers that send none:
 * `intent:userId:p:projectId` when projectId is non-empty, else
 * `intent:userId:n:` and the first 16 hex digits of the SHA-256 of the UTF-8
 * of normalizeName(projectName).
 * @param {string} intent
 * @param {string} userId
 * @param {string | null | undefined} projectId
 * @param {string | null | undefined} projectName
 * @returns {string}
 */
function dedupKey(intent, userId, projectId, projectName) {
  if (projectId) {
    return `${intent}:${userId}:p:${projectId}`;
  }
  const sum = crypto.createHash('sha256').update(normalizeName(projectName), 'utf8').digest('hex');
  return `${intent}:${userId}:n:${sum.slice(0, 16)}`;
}

module.exports = { dedupKey, normalizeName };
