'use strict';
// The idempotency.v1 API, loaded at run time from idempotency.binpb: a
// FileDescriptorSet of proto/ and its imports that `make generate` writes
// (`make test` fails when it is stale). Messages are plain objects with the
// proto's field names (snake_case), enums are their names
// ('OUTCOME_REPLAY'), bytes are Buffers, int64 are strings, and a field the
// proto gains (Record.uncertain, say) appears without a change here.

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
require('protobufjs/ext/descriptor');

const descriptorPath = path.join(__dirname, '..', 'idempotency.binpb');
const descriptors = fs.readFileSync(descriptorPath);

const packageDefinition = protoLoader.loadFileDescriptorSetFromBuffer(descriptors, {
  longs: String,
  enums: String,
  bytes: Buffer,
  defaults: true,
});

/** The generated client constructor of idempotency.v1.Coordinator. */
const CoordinatorClient = grpc.makeGenericClientConstructor(packageDefinition['idempotency.v1.Coordinator'], 'Coordinator');

const root = protobuf.Root.fromDescriptor(descriptors);
const statusType = root.lookupType('google.rpc.Status');

/** Encodes a google.rpc.Status ({code, message, details}) to bytes. */
function encodeStatus(st) {
  return Buffer.from(statusType.encode(statusType.fromObject(st)).finish());
}

/** Decodes google.rpc.Status bytes; null when they are not one. */
function decodeStatus(bytes) {
  try {
    return statusType.toObject(statusType.decode(bytes), { defaults: true });
  } catch {
    return null;
  }
}

// The only map field of the Coordinator API, StoredResponse.metadata, is an
// array of {key, value} entries on the wire (protobufjs loads map fields
// from descriptors as their entry messages); callers see a plain object.
function metadataToWire(resp) {
  if (!resp || Array.isArray(resp.metadata) || resp.metadata == null) {
    return resp;
  }
  return { ...resp, metadata: Object.entries(resp.metadata).map(([key, value]) => ({ key, value: String(value) })) };
}

function metadataFromWire(resp) {
  if (resp && Array.isArray(resp.metadata)) {
    resp.metadata = Object.fromEntries(resp.metadata.map((e) => [e.key, e.value]));
  }
  return resp;
}

/** Makes the StoredResponse in a request wire-shaped. */
function requestToWire(req) {
  return req && req.response ? { ...req, response: metadataToWire(req.response) } : req;
}

/** Gives the StoredResponse of an answer's record its plain-object metadata. */
function answerFromWire(res) {
  if (res && res.record) {
    metadataFromWire(res.record.response);
  }
  return res;
}

/** Converts milliseconds (or a Duration object) to a google.protobuf.Duration. */
function duration(v) {
  if (v == null || typeof v === 'object') {
    return v ?? null;
  }
  const ms = Number(v);
  if (!Number.isFinite(ms) || ms < 0) {
    throw new RangeError(`invalid duration ${v} ms`);
  }
  const seconds = Math.floor(ms / 1000);
  return { seconds: String(seconds), nanos: Math.round((ms - seconds * 1000) * 1e6) };
}

/** Converts a google.protobuf.Duration or Timestamp to milliseconds. */
function millis(d) {
  if (!d) {
    return 0;
  }
  return Number(d.seconds || 0) * 1000 + Math.floor((d.nanos || 0) / 1e6);
}

module.exports = {
  CoordinatorClient,
  descriptorPath,
  encodeStatus,
  decodeStatus,
  requestToWire,
  answerFromWire,
  metadataToWire,
  duration,
  millis,
};
