'use strict';
// idemcoord: the Node client of the idemcoord idempotency coordinator.
// Types are in index.d.ts; docs/node.md in the repository shows
// a whole service.

const { Client, markSideEffect, currentLease } = require('./lib/client');
const { dedupKey, normalizeName } = require('./lib/dedup');
const errors = require('./lib/errors');

module.exports = {
  Client,
  dedupKey,
  normalizeName,
  markSideEffect,
  currentLease,
  ...errors,
};
