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
const { ERROR_INFO_DOMAIN } = require('./tables');

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
const errorInfoType = root.lookupType('google.rpc.ErrorInfo');
const ERROR_INFO_TYPE_URL = 'type.googleapis.com/google.rpc.ErrorInfo';
const errorReasonEnum = root.lookupEnum('idempotency.v1.ErrorReason');
const ERROR_REASON_PREFIX = 'ERROR_REASON_';

/**
 * The ErrorInfo reason an idempotency.v1.ErrorReason value is sent as: its
 * name without the ERROR_REASON_ prefix ('ERROR_REASON_LEASE_LOST' is sent
 * as 'LEASE_LOST'). Throws for a name the enum does not have.
 */
function reasonName(valueName) {
  if (!Object.hasOwn(errorReasonEnum.values, valueName) || !valueName.startsWith(ERROR_REASON_PREFIX)) {
    throw new Error(`idemcoord: idempotency.v1.ErrorReason has no value ${valueName}`);
  }
  return valueName.slice(ERROR_REASON_PREFIX.length);
}

/**
 * Every ErrorInfo reason of domain idempotency.v1, from the enum ErrorReason
 * (UNSPECIFIED left out), each keyed by itself: REASONS.LEASE_LOST ===
 * 'LEASE_LOST'.
 */
const REASONS = Object.freeze(Object.fromEntries(Object.entries(errorReasonEnum.values)
  .filter(([, number]) => number !== 0)
  .map(([name]) => [reasonName(name), reasonName(name)])));

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

/**
 * Encodes a google.rpc.Status of code and message whose details are one
 * google.rpc.ErrorInfo of reason (a wire name: 'UNKNOWN_HELD') in the
 * shared ErrorInfo domain.
 */
function encodeErrorInfoStatus(code, message, reason) {
  const info = errorInfoType.encode(errorInfoType.fromObject({ reason, domain: ERROR_INFO_DOMAIN })).finish();
  return encodeStatus({ code, message, details: [{ type_url: ERROR_INFO_TYPE_URL, value: Buffer.from(info) }] });
}

/** The reason of the first google.rpc.ErrorInfo in encoded google.rpc.Status details, '' when none. */
function errorInfoReason(statusBytes) {
  const st = decodeStatus(statusBytes);
  for (const d of st?.details ?? []) {
    if (String(d.type_url ?? '').endsWith('/google.rpc.ErrorInfo')) {
      try {
        return errorInfoType.decode(d.value ?? Buffer.alloc(0)).reason;
      } catch {
        return '';
      }
    }
  }
  return '';
}

/** The ErrorInfo reason in a gRPC error's status details, '' when none. */
function errorReason(err) {
  const raw = err?.metadata?.get?.('grpc-status-details-bin')?.[0];
  return raw ? errorInfoReason(raw) ?? '' : '';
}

/**
 * {...obj, ...fields}, with its keys in the same order, but made with
 * Object.assign: V8 adds each key a spread copy lacks on a slow path (about
 * half a microsecond a key), which every begin and complete paid. An object
 * with an own "__proto__" key (JSON.parse makes those), which
 * Object.assign would hand to Object.prototype's setter, is spread.
 */
function copyWith(obj, fields) {
  if (obj != null && Object.hasOwn(obj, '__proto__')) {
    return { ...obj, ...fields };
  }
  return Object.assign({}, obj, fields);
}

/**
 * A StoredResponse as callers see it, whatever shape it was given in: every
 * field set, body a Buffer (a string is taken as UTF-8, never base64),
 * metadata a plain object.
 */
function storedResponse(resp) {
  const r = resp ?? {};
  let body = r.body ?? Buffer.alloc(0);
  body = typeof body === 'string' ? Buffer.from(body, 'utf8') : Buffer.from(body);
  let metadata = r.metadata ?? {};
  if (Array.isArray(metadata)) {
    metadata = Object.fromEntries(metadata.map((e) => [e.key, e.value]));
  }
  return copyWith(r, {
    schema_version: r.schema_version ?? '',
    content_type: r.content_type ?? '',
    body,
    status_code: r.status_code ?? 0,
    metadata: Object.fromEntries(Object.entries(metadata).map(([k, v]) => [k, String(v)])),
  });
}

// The only map field of the Coordinator API, StoredResponse.metadata, is an
// array of {key, value} entries on the wire (protobufjs loads map fields
// from descriptors as their entry messages); callers see a plain object.
function metadataToWire(resp) {
  if (!resp) {
    return resp;
  }
  const r = storedResponse(resp);
  return copyWith(r, { metadata: Object.entries(r.metadata).map(([key, value]) => ({ key, value })) });
}

function metadataFromWire(resp) {
  if (resp && Array.isArray(resp.metadata)) {
    resp.metadata = Object.fromEntries(resp.metadata.map((e) => [e.key, e.value]));
  }
  return resp;
}

/** Makes the StoredResponse in a request wire-shaped. */
function requestToWire(req) {
  return req && req.response ? copyWith(req, { response: metadataToWire(req.response) }) : req;
}

/** Gives the StoredResponse of an answer's record its plain-object metadata. */
function answerFromWire(res) {
  if (res && res.record) {
    metadataFromWire(res.record.response);
  }
  return res;
}

/** The options the gRPC methods' messages are converted with (as loaded above). */
const OBJECT_OPTIONS = { longs: String, enums: String, bytes: Buffer, defaults: true };

/**
 * For each message type, the fields through which it can hold 64-bit
 * integers: [name, kind] with kind 'long', 'message' or 'messages'
 * (repeated, map entries included); [] when it holds none.
 */
const longPaths = new Map();

function longPathsOf(type) {
  let paths = longPaths.get(type);
  if (paths) {
    return paths;
  }
  paths = [];
  longPaths.set(type, paths); // a recursive type sees itself as holding none until done
  type.resolveAll();
  for (const f of type.fieldsArray) {
    if (f.long) {
      paths.push([f.name, f.repeated ? 'longs' : 'long']);
    } else if (f.resolvedType instanceof protobuf.Type && (f.resolvedType === type || longPathsOf(f.resolvedType).length > 0)) {
      paths.push([f.name, f.repeated ? 'messages' : 'message']);
    }
  }
  return paths;
}

/** A Long's value as a number when that is exact, else the Long. */
function safeLong(v) {
  if (v === null || typeof v !== 'object') {
    return v;
  }
  const n = (v.unsigned ? v.high >>> 0 : v.high) * 4294967296 + (v.low >>> 0);
  return Number.isSafeInteger(n) ? n : v;
}

/** Replaces, in decoded message m of type, every 64-bit integer that a number holds exactly by that number. */
function numbersForLongs(type, m) {
  for (const [name, kind] of longPathsOf(type)) {
    const v = m[name];
    if (v == null || !Object.hasOwn(m, name)) {
      continue; // unset: left to toObject's defaults (a oneof's member gets none)
    }
    if (kind === 'long') {
      m[name] = safeLong(v);
    } else if (kind === 'longs') {
      for (let i = 0; i < v.length; i++) {
        v[i] = safeLong(v[i]);
      }
    } else {
      const sub = type.fields[name].resolvedType;
      if (kind === 'message') {
        numbersForLongs(sub, v);
      } else {
        for (const e of v) {
          numbersForLongs(sub, e);
        }
      }
    }
  }
}

/**
 * The deserializer of a gRPC method's response typeName: the same object
 * as @grpc/proto-loader's (toObject with OBJECT_OPTIONS), made faster. A
 * decoded int64 is a Long, which toObject turns into its decimal string by
 * Long's division, allocating a Long a digit group (the Timestamps of
 * every Record); one that a number holds exactly is handed over as that
 * number, whose String is the same decimal.
 */
function responseDeserializer(typeName) {
  const type = root.lookupType(typeName);
  return (bytes) => {
    const m = type.decode(bytes);
    numbersForLongs(type, m);
    return type.toObject(m, OBJECT_OPTIONS);
  };
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
  REASONS,
  copyWith,
  responseDeserializer,
  reasonName,
  descriptorPath,
  encodeStatus,
  decodeStatus,
  encodeErrorInfoStatus,
  errorInfoReason,
  errorReason,
  requestToWire,
  answerFromWire,
  metadataToWire,
  storedResponse,
  duration,
  millis,
};
