'use strict';
// serverInterceptor: @grpc/grpc-js server interceptor (grpc-js >= 1.10) with
// the semantics of Go's clients.UnaryServerInterceptor
// (clients/interceptor.go). clients/testdata/grpc_conformance.json is the
// suite the Go, Node and Python interceptors run.

const crypto = require('node:crypto');
const grpc = require('@grpc/grpc-js');
const api = require('./api');
const {
  Lease, failReason, answerLost, DEFAULT_FAILURE_KINDS,
} = require('./client');
const { SCHEMA_VERSION_STATUS, CONTENT_TYPE_PROTO, REASON_UNKNOWN_HELD } = require('./errors');

const S = grpc.status;
const RESULT_HEADER = 'idempotency-result';
const PUSHBACK_TRAILER = 'grpc-retry-pushback-ms';
const KEY_METADATA = 'idempotency-key';
const EXPIRES_HEADER = 'idempotency-expires';

/** The method definitions of services (grpc-js ServiceDefinitions) by path. */
function methodsByPath(services) {
  const out = new Map();
  for (const svc of services ?? []) {
    for (const def of Object.values(svc)) {
      if (def && typeof def.path === 'string') {
        out.set(def.path, def);
      }
    }
  }
  return out;
}

/** The schema version of def's responses: the output message's full name, as Go's interceptor stores. */
function defaultSchema(def) {
  const name = def.responseType?.type?.name;
  const pkg = def.path.slice(1, def.path.indexOf('/', 1)).split('.').slice(0, -1).join('.');
  return name ? (pkg ? `${pkg}.${name}` : name) : pathSchema(def.path);
}

/** The schema version of a method's responses when no descriptor of it is known. */
function pathSchema(path) {
  return `${path} response`;
}

/** Bytes handed to the call's serializer, which sends them as they are: a stored response, replayed byte for byte. */
class StoredBytes {
  constructor(bytes) {
    this.bytes = bytes;
  }
}

/**
 * Taps the codec of one grpc-js call: every request message's bytes as
 * read (before the method's deserializer) are kept in tap.requests, and
 * the method's serializer sends StoredBytes as they are. grpc-js hands an
 * interceptor the method's requestDeserialize and responseSerialize only;
 * the bytes themselves are reached through the call's own handler (the
 * innermost call of the interceptor chain), replaced for this call alone.
 * null when the installed grpc-js has no such call.
 */
function tapCodec(call) {
  let c = call;
  for (let depth = 0; c && depth < 64; depth++) {
    const h = c.handler;
    if (h && typeof h.serialize === 'function' && typeof h.deserialize === 'function' && typeof c.serializeMessage === 'function') {
      const tap = { requests: [] };
      c.handler = {
        ...h,
        serialize: (value) => (value instanceof StoredBytes ? value.bytes : h.serialize(value)),
        deserialize: (bytes) => {
          tap.requests.push(Buffer.from(bytes));
          return h.deserialize(bytes);
        },
      };
      return tap;
    }
    c = c.nextCall;
  }
  return null;
}

function statusError(code, details, metadata) {
  return { code, details, metadata: metadata ?? new grpc.Metadata() };
}

/** A status whose google.rpc.Status details (grpc-status-details-bin) carry an ErrorInfo of reason. */
function withErrorInfo(code, details, reason) {
  const md = new grpc.Metadata();
  md.set('grpc-status-details-bin', api.encodeErrorInfoStatus(code, details, reason));
  return statusError(code, details, md);
}

/**
 * serverInterceptor makes every unary method of a grpc-js server
 * idempotent; see index.d.ts for the options. It stores and replays with
 * the call's own codec, so it needs no descriptor; options.services adds
 * what only a descriptor tells (NO_SIDE_EFFECTS methods left unguarded,
 * the output message's full name as schema version, the request
 * re-encoded for the fingerprint).
 */
function serverInterceptor(client, options = {}) {
  if (options.principal && options.withoutPrincipal) {
    throw new TypeError('idemcoord: principal and withoutPrincipal exclude each other');
  }
  if (!options.principal && !options.withoutPrincipal) {
    client._warnUndecidedPrincipal('serverInterceptor', 'principal', 'withoutPrincipal');
  }
  const defs = methodsByPath(options.services);
  let selected = null;
  if (typeof options.methods === 'function') {
    selected = options.methods;
  } else if (options.methods) {
    const names = new Set(options.methods);
    selected = (path) => names.has(path);
    const unaryKnown = [...names].filter((p) => !defs.has(p) || (!defs.get(p).requestStream && !defs.get(p).responseStream));
    if (unaryKnown.length === 0) {
      client._warn(`idemcoord: serverInterceptor built with methods ${JSON.stringify([...names])} guards nothing: ${
        names.size === 0 ? 'the list is empty' : 'every method named is streaming'}; every call passes through unprotected`,
      'IDEMCOORD_GUARDS_NOTHING');
    }
  }
  const kinds = { ...DEFAULT_FAILURE_KINDS, ...(options.failureKinds ?? {}) };
  const scopeOf = options.scope ?? ((path) => path);
  const waitMs = Math.max(options.waitMs ?? 0, 0);
  const replayMetadata = options.replayMetadata ? new Set(options.replayMetadata.map((k) => k.toLowerCase())) : null;
  const notReplayed = new Set([RESULT_HEADER, EXPIRES_HEADER, 'content-type', 'grpc-status-details-bin', PUSHBACK_TRAILER, 'date']);
  const keep = (k) => !notReplayed.has(k) && !k.startsWith('grpc-') && (!replayMetadata || replayMetadata.has(k));
  let untappedLogged = false;

  return function idempotencyInterceptor(descriptor, call) {
    // def: what a descriptor (options.services) says of the method, when one does.
    const def = defs.get(descriptor.path);
    const wrapped = !descriptor.requestStream && !descriptor.responseStream &&
      (selected ? selected(descriptor.path) : def?.options?.idempotency_level !== 'NO_SIDE_EFFECTS');
    if (!wrapped) {
      return new grpc.ServerInterceptingCall(call);
    }
    const tap = tapCodec(call);
    if (!tap && !def) {
      // Neither the call's codec nor a descriptor: the method cannot be
      // guarded, and it is not run unguarded.
      if (!untappedLogged) {
        untappedLogged = true;
        client._log('error', 'idemcoord: this @grpc/grpc-js does not let the interceptor reach a call\'s codec; pass the services option', { method: descriptor.path });
      }
      return new grpc.ServerInterceptingCall(call, {
        start(next) {
          next({});
          call.sendStatus(statusError(S.INTERNAL, 'idempotency interceptor cannot guard this method'));
        },
      });
    }
    const fixedSchema = options.schemaVersions?.[descriptor.path];
    const schema = fixedSchema ?? (def ? defaultSchema(def) : pathSchema(descriptor.path));
    // A method whose descriptor became known later still replays what was stored without it.
    const accepted = fixedSchema || !def ? [schema] : [schema, pathSchema(descriptor.path)];
    const cancel = new AbortController();
    let metadata;
    let message;
    let messageNext;
    // What the handler answers, while it runs under the lease.
    let answered = null;
    const stored = { header: null, trailer: null };
    let bypass = false; // the call goes through untouched (no key, fail open)

    const sendReplay = (rec) => {
      const resp = rec.response ?? {};
      const header = new grpc.Metadata();
      const trailer = new grpc.Metadata();
      for (const [k, v] of Object.entries(resp.metadata ?? {})) {
        const [kind, name] = k.startsWith('trailer:') ? ['t', k.slice(8)] : ['h', k.replace(/^header:/, '')];
        for (const one of String(v).split('\n')) {
          (kind === 't' ? trailer : header).add(name, name.endsWith('-bin') ? Buffer.from(one, 'base64') : one);
        }
      }
      header.set(RESULT_HEADER, 'replayed');
      if (rec.state === 'STATE_FAILED_REPLAYABLE') {
        const st = resp.schema_version === SCHEMA_VERSION_STATUS ? api.decodeStatus(resp.body ?? Buffer.alloc(0)) : null;
        call.sendMetadata(header);
        if (st && st.code !== S.OK) {
          trailer.set('grpc-status-details-bin', Buffer.from(resp.body));
          call.sendStatus(statusError(st.code, st.message, trailer));
        } else {
          call.sendStatus(statusError(S.FAILED_PRECONDITION, rec.failure_reason || 'replayed failure', trailer));
        }
        return;
      }
      if (!accepted.includes(resp.schema_version)) {
        call.sendStatus(statusError(S.INTERNAL, `the stored response for this idempotency key has schema version ${resp.schema_version}`));
        return;
      }
      let out;
      try {
        const body = Buffer.from(resp.body ?? []);
        out = tap ? new StoredBytes(body) : def.responseDeserialize(body);
      } catch {
        call.sendStatus(statusError(S.INTERNAL, 'the stored response for this idempotency key cannot be decoded'));
        return;
      }
      call.sendMetadata(header);
      call.sendMessage(out, () => call.sendStatus({ code: S.OK, details: 'OK', metadata: trailer }));
    };

    const storedMetadata = () => {
      const out = {};
      const add = (prefix, md) => {
        for (const [k, vals] of Object.entries(md?.getMap?.() ? md.toJSON() : {})) {
          if (keep(k)) {
            out[`${prefix}${k}`] = vals.map((v) => (Buffer.isBuffer(v) ? v.toString('base64') : String(v))).join('\n');
          }
        }
      };
      add('header:', stored.header);
      add('trailer:', stored.trailer);
      return out;
    };

    // The handler's header metadata is held until its outcome is recorded,
    // so that "idempotency-result: created" is sent only once it is.
    const releaseHeader = (created) => {
      if (stored.held) {
        const { md, next } = stored.held;
        stored.held = null;
        if (created) {
          md.set(RESULT_HEADER, 'created');
        }
        next(md);
      }
    };

    const run = async (halfCloseNext) => {
      const raw = metadata.get(KEY_METADATA);
      if (raw.length > 1 && new Set(raw.map(String)).size > 1) {
        call.sendStatus(statusError(S.INVALID_ARGUMENT, 'two different idempotency-key values'));
        return;
      }
      let key = raw.length > 0 ? String(raw[0]) : '';
      if (options.key) {
        key = await options.key(metadata, message);
      }
      if (!key) {
        if (options.requireKey) {
          call.sendStatus(statusError(S.INVALID_ARGUMENT, 'this method requires an idempotency-key'));
          return;
        }
        bypass = true;
        messageNext(message);
        halfCloseNext();
        return;
      }
      if (options.principal) {
        const { foldPrincipal } = require('./http');
        key = foldPrincipal(await options.principal(metadata), key);
      }
      const fp = options.fingerprint ? await options.fingerprint(metadata, message)
        : crypto.createHash('sha256').update(`${descriptor.path}\n`).update(def ? def.requestSerialize(message) : tap.requests[0]).digest();
      const breq = {
        scope: scopeOf(descriptor.path), key, fingerprint: Buffer.from(fp ?? []), attempt_id: client._newAttemptId(),
        lease: client._opts.leaseMs > 0 ? api.duration(client._opts.leaseMs) : null,
        accept_schema_versions: [...accepted, SCHEMA_VERSION_STATUS],
      };
      const deadline = call.getDeadline();
      const callEnd = deadline instanceof Date ? deadline.getTime() : (Number.isFinite(deadline) ? deadline : Infinity);
      let res;
      let sent;
      try {
        ({ res, sent } = await client._beginWaiting(breq, cancel.signal, Math.min(Date.now() + waitMs, callEnd - 50)));
      } catch (err) {
        if (cancel.signal.aborted) {
          await client._releaseAcquisition(breq);
          return;
        }
        if (answerLost(err)) {
          client._releaseAcquisition(breq);
        }
        if (err?.code === S.FAILED_PRECONDITION || err?.code === S.INVALID_ARGUMENT) {
          call.sendStatus(statusError(err.code, err.details ?? err.message, err.metadata));
        } else if (err?.code === S.UNAVAILABLE || err?.code === S.DEADLINE_EXCEEDED) {
          if (options.failOpen) {
            bypass = true;
            messageNext(message);
            halfCloseNext();
            return;
          }
          call.sendStatus(statusError(S.UNAVAILABLE, 'idempotency coordinator unavailable; retry later'));
        } else if (err?.code === S.RESOURCE_EXHAUSTED) {
          call.sendStatus(statusError(S.RESOURCE_EXHAUSTED, 'idempotency coordinator rate limit reached; retry later'));
        } else {
          client._log('error', 'idemcoord: coordinator refused Begin', { err: err?.message });
          call.sendStatus(statusError(S.INTERNAL, 'idempotency coordinator refused the call'));
        }
        return;
      }
      const rec = res.record ?? {};
      if (res.outcome === 'OUTCOME_REPLAY') {
        sendReplay(rec);
        return;
      }
      if (res.outcome !== 'OUTCOME_ACQUIRED') {
        if (rec.state === 'STATE_UNKNOWN') {
          call.sendStatus(withErrorInfo(S.FAILED_PRECONDITION,
            'the outcome of an earlier attempt with this idempotency key is unknown and held for an operator', REASON_UNKNOWN_HELD));
          return;
        }
        const retryMs = Math.max(api.millis(res.retry_after), 1);
        const md = new grpc.Metadata();
        md.set(PUSHBACK_TRAILER, String(retryMs));
        call.sendStatus(statusError(S.ABORTED,
          `another attempt with this idempotency key is in progress; retry after ${retryMs} ms`, md));
        return;
      }
      if (cancel.signal.aborted) {
        await client._releaseAcquisition(breq, res.lease_token);
        return;
      }
      const lease = new Lease(client, breq, res, sent);
      const outcome = await lease.run(() => new Promise((resolve, reject) => {
        answered = { resolve, reject };
        messageNext(message);
        halfCloseNext();
      }), cancel.signal);
      if (outcome.gaveUp) {
        await client._releaseAcquisition(breq, lease.token);
        return;
      }
      if (outcome.notStarted) {
        await lease.finish({ kind: 'FAILURE_KIND_ABANDONED', reason: 'the lease could not be confirmed before the handler started' });
        call.sendStatus(statusError(S.UNAVAILABLE, 'idempotency coordinator unavailable; retry later'));
        return;
      }
      const pending = outcome.value ?? outcome.error;
      if (lease.lost) {
        client._log('warn', 'idemcoord: lease lost while the handler ran; its result is not stored', { scope: lease.scope, key: lease.key });
        releaseHeader(false);
        if (outcome.failed) {
          pending.next(statusError(S.ABORTED, 'the idempotency key was taken over by another attempt; retry'));
        } else {
          pending.next(pending.message);
        }
        return;
      }
      if (!outcome.failed) {
        let body;
        try {
          body = descriptor.responseSerialize(pending.message);
        } catch {
          await lease.finish({ kind: 'FAILURE_KIND_UNKNOWN', reason: "the handler's response could not be encoded for storage" });
          releaseHeader(false);
          pending.next(pending.message);
          return;
        }
        const finishErr = await lease.finish({ complete: { schema_version: schema, content_type: CONTENT_TYPE_PROTO, body, metadata: storedMetadata() } });
        releaseHeader(!finishErr);
        pending.next(pending.message);
        return;
      }
      const st = pending.status;
      const err = Object.assign(new Error(st.details), { code: st.code });
      // After markSideEffect every error is UNKNOWN (as Go's endingKind).
      const kind = outcome.marked ? 'FAILURE_KIND_UNKNOWN' : (kinds[st.code] ?? 'FAILURE_KIND_UNKNOWN');
      const ending = { kind, reason: failReason(err.message) };
      if (kind === 'FAILURE_KIND_REPLAYABLE') {
        const details = st.metadata?.get?.('grpc-status-details-bin')?.[0];
        const decoded = details && api.decodeStatus(details);
        ending.response = {
          schema_version: SCHEMA_VERSION_STATUS, content_type: CONTENT_TYPE_PROTO, status_code: st.code,
          body: decoded && decoded.code === st.code ? Buffer.from(details) : api.encodeStatus({ code: st.code, message: st.details ?? '' }),
          metadata: storedMetadata(),
        };
      }
      const finishErr = await lease.finish(ending);
      const out = { ...st, metadata: st.metadata ?? new grpc.Metadata() };
      const created = !finishErr && kind === 'FAILURE_KIND_REPLAYABLE';
      if (created && !stored.held) {
        out.metadata = out.metadata.clone();
        out.metadata.set(RESULT_HEADER, 'created'); // trailers-only: the caller reads it as a header
      }
      releaseHeader(created);
      pending.next(out);
    };

    const responder = {
      start(next) {
        next({
          onReceiveMetadata(md, mdNext) {
            metadata = md;
            mdNext(md);
          },
          onReceiveMessage(msg, msgNext) {
            // Held until Begin answers; read on to the half-close meanwhile.
            message = msg;
            messageNext = msgNext;
            call.startRead();
          },
          onReceiveHalfClose(hcNext) {
            if (message === undefined) {
              hcNext();
              return;
            }
            run(hcNext).catch((err) => {
              client._log('error', 'idemcoord: interceptor failed', { err: err?.message });
              call.sendStatus(statusError(S.INTERNAL, 'idempotency interceptor failed'));
            });
          },
          onCancel() {
            cancel.abort(new Error('idemcoord: the call was cancelled'));
          },
        });
      },
      sendMetadata(md, next) {
        if (!bypass && answered) {
          stored.header = md;
          stored.held = { md, next };
          return;
        }
        next(md);
      },
      sendMessage(msg, next) {
        if (bypass || !answered) {
          next(msg);
          return;
        }
        const a = answered;
        answered = null;
        a.resolve({ message: msg, next });
      },
      sendStatus(st, next) {
        if (bypass || !answered) {
          next(st);
          return;
        }
        const a = answered;
        answered = null;
        stored.trailer = st.metadata;
        a.reject({ status: st, next, message: st.details });
      },
    };
    return new grpc.ServerInterceptingCall(call, responder);
  };
}

module.exports = { serverInterceptor, RESULT_HEADER, PUSHBACK_TRAILER };
