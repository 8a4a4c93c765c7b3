'use strict';

const crypto = require('node:crypto');
const { AsyncLocalStorage } = require('node:async_hooks');
const grpc = require('@grpc/grpc-js');
const api = require('./api');
const { Batcher, MAX_ANSWER_BYTES } = require('./batching');
const {
  SCHEMA_VERSION_STATUS, CONTENT_TYPE_PROTO, LeaseLostError, LeaseUnconfirmedError, UnknownHeldError,
  FailureError, StoredFailureError,
} = require('./errors');

const S = grpc.status;

// Timings, the release and the failure table are the ones every library
// shares (lib/tables.js).
const {
  DEFAULT_LEASE_MS, MIN_HEARTBEAT_MS, FINISH_TIMEOUT_MS, MAX_BEGIN_WAIT_MS, RELEASE_TIMEOUT_MS, RELEASE_REASON,
  FAILURE_KINDS,
} = require('./tables');
const MAX_REASON_BYTES = 1024;

/** The attempt a function run by once is in (see markSideEffect, currentLease). */
const currentAttempt = new AsyncLocalStorage();

/** How fn's errors are recorded by gRPC code: the table of docs/go.md, from lib/tables.js. */
const DEFAULT_FAILURE_KINDS = FAILURE_KINDS;

// Attempt ids are cut from a pool of random bytes, refilled 256 ids at a
// time: one crypto.randomBytes call per id costs more than the rest of
// begin's own work (as crypto.randomUUID keeps a pool too). Each Client
// keeps its own pool; the module keeps no mutable state.
const ATTEMPT_ID_BYTES = 16;
const ATTEMPT_ID_POOL_BYTES = 256 * ATTEMPT_ID_BYTES;

/** A source of new attempt_ids: 16 random bytes (crypto.randomBytes) as 32 hex digits each. */
class AttemptIds {
  constructor() {
    this._pool = Buffer.alloc(0);
    this._offset = 0;
  }

  /** The next attempt_id; never repeats one this source gave. */
  next() {
    if (this._offset + ATTEMPT_ID_BYTES > this._pool.length) {
      this._pool = crypto.randomBytes(ATTEMPT_ID_POOL_BYTES);
      this._offset = 0;
    }
    const id = this._pool.toString('hex', this._offset, this._offset + ATTEMPT_ID_BYTES);
    this._offset += ATTEMPT_ID_BYTES;
    return id;
  }
}

function channelCredentials(tls) {
  if (tls instanceof grpc.ChannelCredentials) {
    return tls;
  }
  if (tls === true) {
    return grpc.credentials.createSsl();
  }
  if (tls && typeof tls === 'object') {
    return grpc.credentials.createSsl(tls.rootCerts ?? null, tls.privateKey ?? null, tls.certChain ?? null);
  }
  return grpc.credentials.createInsecure();
}

/**
 * v as a new Buffer: a string as UTF-8, the bytes of an ArrayBuffer or of
 * any view of one (a Uint16Array's bytes, not its elements cut to 8 bits),
 * copied; null as empty.
 */
function toBytes(v) {
  if (v == null) {
    return Buffer.alloc(0);
  }
  if (typeof v === 'string') {
    return Buffer.from(v, 'utf8');
  }
  if (ArrayBuffer.isView(v)) {
    return Buffer.from(new Uint8Array(v.buffer, v.byteOffset, v.byteLength));
  }
  if (v instanceof ArrayBuffer || v instanceof SharedArrayBuffer) {
    return Buffer.from(new Uint8Array(v));
  }
  return Buffer.from(v);
}

/** A checkpoint's data as a new Buffer (see toBytes); a TypeError for anything but bytes, a string or null. */
function checkpointBytes(data) {
  const bytesLike = data == null || typeof data === 'string' || ArrayBuffer.isView(data) ||
    data instanceof ArrayBuffer || data instanceof SharedArrayBuffer;
  if (!bytesLike) {
    throw new TypeError(`idemcoord: checkpoint data must be a Buffer, a Uint8Array or a string, not ${Array.isArray(data) ? 'an array' : typeof data}`);
  }
  return toBytes(data);
}

/** Resolves after ms, or rejects with signal's reason when it aborts first. */
function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

/** Whether err means the coordinator could not be reached or answer in time. */
function unreachable(err) {
  return [S.UNAVAILABLE, S.DEADLINE_EXCEEDED, S.RESOURCE_EXHAUSTED, S.CANCELLED].includes(err?.code);
}

/**
 * Whether a call that failed with err may have been carried out without its
 * answer reaching us: cut off, timed out or cancelled (also while waiting
 * to retry, when signal aborted).
 */
function answerLost(err, signal) {
  return [S.UNAVAILABLE, S.DEADLINE_EXCEEDED, S.CANCELLED].includes(err?.code) || (signal?.aborted && err === signal.reason);
}

/** The lease a Begin or Heartbeat answer granted: updated_at to lease_expires_at (0 when not told). */
function leaseLength(rec) {
  if (!rec?.lease_expires_at || !rec?.updated_at) {
    return 0;
  }
  return api.millis(rec.lease_expires_at) - api.millis(rec.updated_at);
}

/** Whether a Heartbeat's error means this attempt no longer holds the key. */
/**
 * Whether err is the coordinator's refusal of ending, a Fail ABANDONED,
 * because the attempt recorded a checkpoint this library did not send (the
 * application's own Heartbeat): it is then ended RETRYABLE instead, which
 * keeps the checkpoint.
 */
function abandonRefused(ending, err) {
  return ending.kind === 'FAILURE_KIND_ABANDONED' && err?.code === S.FAILED_PRECONDITION &&
    api.errorReason(err) === api.REASONS.CHECKPOINT_RECORDED;
}

function leaseGone(err) {
  return err?.code === S.FAILED_PRECONDITION || err?.code === S.NOT_FOUND;
}

/** err's message as a valid Fail reason: valid UTF-8, no NUL, at most 1 KiB. */
function failReason(msg) {
  const buf = Buffer.from(String(msg ?? '').replaceAll('\0', ''), 'utf8'); // lone surrogates become U+FFFD
  let cut = Math.min(buf.length, MAX_REASON_BYTES);
  while (cut < buf.length && cut > 0 && (buf[cut] & 0xc0) === 0x80) {
    cut--;
  }
  return buf.subarray(0, cut).toString('utf8');
}

/** The google.rpc.Status of an error, stored for a replayable failure. */
function statusResponse(err) {
  const details = err?.metadata?.get?.('grpc-status-details-bin')?.[0];
  const code = typeof err?.code === 'number' ? err.code : S.UNKNOWN;
  let body;
  const decoded = details && api.decodeStatus(details);
  if (decoded && decoded.code === code) {
    body = Buffer.from(details);
  } else {
    body = api.encodeStatus({ code, message: String(err?.details ?? err?.message ?? '') });
  }
  return { schema_version: SCHEMA_VERSION_STATUS, content_type: CONTENT_TYPE_PROTO, body, status_code: code };
}

/** The error once answers for a stored replayable failure. */
function storedFailure(record, result, cause) {
  const resp = record?.response ?? {};
  let code = S.FAILED_PRECONDITION;
  const details = record?.failure_reason || 'replayed failure';
  if (resp.schema_version === SCHEMA_VERSION_STATUS) {
    const st = api.decodeStatus(resp.body ?? Buffer.alloc(0));
    if (st && st.code !== S.OK) {
      return new StoredFailureError({ code: st.code, details: st.message, result, cause });
    }
  }
  if (resp.status_code > 0 && resp.status_code <= S.UNAUTHENTICATED) {
    code = resp.status_code;
  }
  return new StoredFailureError({ code, details, result, cause });
}

/**
 * Client calls an idemcoord coordinator. Every call is retried with backoff
 * while the coordinator answers UNAVAILABLE, since each is safe to repeat:
 * begin carries an attempt_id (the same on each retry), and the coordinator
 * answers a repeated complete or fail with the same token and content OK.
 */
class Client {
  /**
   * @param {string} address host:port of the coordinator
   * @param {object} [options] token, tls, maxAttempts, backoffMs,
   *   maxBackoffMs, timeoutMs, leaseMs, channelOptions, interceptors, logger,
   *   callBatching (see index.d.ts)
   */
  constructor(address, options = {}) {
    const {
      token = '', tls = false, maxAttempts = 5, backoffMs = 100, maxBackoffMs = 2000, timeoutMs = 10000,
      leaseMs = 0, channelOptions = {}, interceptors, logger = null, callBatching = 0,
    } = options;
    this._token = token;
    this._opts = { maxAttempts: Math.max(1, maxAttempts), backoffMs, maxBackoffMs, timeoutMs, leaseMs };
    this._logger = logger;
    this._attemptIds = new AttemptIds();
    const chan = { ...channelOptions };
    if (interceptors) {
      chan.interceptors = interceptors;
    }
    const batching = Math.max(Math.floor(Number(callBatching) || 0), 0);
    if (batching > 0) {
      chan['grpc.max_receive_message_length'] ??= MAX_ANSWER_BYTES;
    }
    this._rpc = new api.CoordinatorClient(address, channelCredentials(tls), chan);
    this._batcher = batching > 0 ? new Batcher(this, batching) : null;
    this._background = new Set();
    this._bg = new AbortController();
  }

  _log(level, msg, fields) {
    this._logger?.[level]?.(msg, fields);
  }

  /**
   * Warns, through logger or else process.emitWarning, that guard (a
   * middleware or interceptor) was built without saying whom a key belongs
   * to: neither the option named withOpt nor the one named withoutOpt.
   */
  _warnUndecidedPrincipal(guard, withOpt, withoutOpt) {
    this._warn(`idemcoord: ${guard} built without ${withOpt} or ${withoutOpt}: two end users who send the same idempotency key and request share one record; fold the end user in with ${withOpt}, or say ${withoutOpt}: true`,
      'IDEMCOORD_UNDECIDED_PRINCIPAL');
  }

  /** A new attempt_id from this client's pool (see AttemptIds). */
  _newAttemptId() {
    return this._attemptIds.next();
  }

  /** Warns through logger, or else process.emitWarning with code. */
  _warn(msg, code) {
    if (this._logger?.warn) {
      this._logger.warn(msg);
    } else {
      process.emitWarning(msg, { code });
    }
  }

  _metadata() {
    const md = new grpc.Metadata();
    if (this._token) {
      md.set('authorization', `Bearer ${this._token}`);
    }
    return md;
  }

  /**
   * One unary call, cancelled when signal aborts. A call cut off with
   * CANCELLED that signal did not ask for, once its deadline has passed,
   * fails with DEADLINE_EXCEEDED: a server resets the stream at the
   * deadline it was sent, and that can reach us before our own timer fires
   * (grpc-go's client makes the same correction).
   */
  _invoke(method, request, signal, timeoutMs) {
    return new Promise((resolve, reject) => {
      if (signal?.aborted) {
        reject(signal.reason);
        return;
      }
      const deadline = Date.now() + timeoutMs;
      const call = this._rpc[method](api.requestToWire(request), this._metadata(), { deadline },
        (err, res) => {
          signal?.removeEventListener('abort', onAbort);
          if (err?.code === S.CANCELLED && !signal?.aborted && Date.now() >= deadline) {
            err.code = S.DEADLINE_EXCEEDED;
          }
          if (err) {
            reject(err);
          } else {
            resolve(api.answerFromWire(res));
          }
        });
      const onAbort = () => call.cancel();
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }

  /**
   * A call retried on UNAVAILABLE with exponential backoff and jitter: a
   * unary RPC, or with callBatching a call in a Batch RPC (each try of it
   * in the next batch).
   */
  async _call(method, request, opts = {}, extraMs = 0) {
    const timeoutMs = (opts.timeoutMs ?? this._opts.timeoutMs) + extraMs;
    const batched = this._batcher?.encode(method, request);
    let delay = this._opts.backoffMs;
    for (let attempt = 1; ; attempt++) {
      try {
        if (batched) {
          return await this._batcher.call(method, request, batched, opts.signal, timeoutMs);
        }
        return await this._invoke(method, request, opts.signal, timeoutMs);
      } catch (err) {
        if (err?.code !== S.UNAVAILABLE || attempt >= this._opts.maxAttempts || opts.signal?.aborted) {
          throw err;
        }
        this._log('debug', 'idemcoord: retrying coordinator call', { method, attempt, err: err.message });
        await sleep(delay / 2 + Math.random() * delay / 2, opts.signal);
        delay = Math.min(delay * 2, this._opts.maxBackoffMs);
      }
    }
  }

  /**
   * Claims a key. Without request.attempt_id, a fresh random one is sent,
   * the same on each retry of this call, so a retried begin whose reply was
   * lost gets the same lease token back. ttl, lease and wait may be
   * milliseconds or Duration objects.
   */
  begin(request, opts = {}) {
    const req = api.copyWith(request, {
      fingerprint: toBytes(request.fingerprint),
      ttl: api.duration(request.ttl),
      lease: api.duration(request.lease),
      wait: api.duration(request.wait),
      attempt_id: request.attempt_id || this._newAttemptId(),
    });
    return this._call('Begin', req, opts, api.millis(req.wait));
  }

  /** Stores the response and ends the record COMPLETED. */
  complete(request, opts = {}) {
    return this._call('Complete', request, opts);
  }

  /**
   * Ends the attempt with a failure. An ABANDONED fail that finds no record
   * answers {record: null}: the abandoned first attempt deleted it, which is
   * what a retried fail whose first reply was lost asked for.
   */
  async fail(request, opts = {}) {
    try {
      return await this._call('Fail', request, opts);
    } catch (err) {
      if (request.kind === 'FAILURE_KIND_ABANDONED' && err?.code === S.NOT_FOUND) {
        return { record: null };
      }
      throw err;
    }
  }

  /** Reads a record as in effect now. */
  lookup(request, opts = {}) {
    return this._call('Lookup', request, opts);
  }

  /** Extends the current attempt's lease (lease: milliseconds or a Duration). */
  heartbeat(request, opts = {}) {
    return this._call('Heartbeat', api.copyWith(request, { lease: api.duration(request.lease) }), opts);
  }

  /**
   * Runs fn at most once per (scope, key) across every process that shares
   * the coordinator and resolves with the recorded outcome; see index.d.ts.
   */
  async once(scope, key, fingerprint, fn, opts = {}) {
    const signal = opts.signal;
    if (signal?.aborted) {
      throw signal.reason; // nothing sent
    }
    const breq = {
      scope, key, fingerprint: toBytes(fingerprint), attempt_id: this._newAttemptId(),
      lease: this._opts.leaseMs > 0 ? api.duration(this._opts.leaseMs) : null,
    };
    let res;
    let sent;
    try {
      ({ res, sent } = await this._beginWaiting(breq, signal));
    } catch (err) {
      if (answerLost(err, signal)) {
        await this._releaseAcquisition(breq);
      }
      throw signal?.aborted ? signal.reason : err;
    }
    const rec = res.record ?? {};
    if (res.outcome === 'OUTCOME_REPLAY') {
      const result = { response: rec.response, replayed: true, state: rec.state, attempt: rec.attempt };
      if (rec.state === 'STATE_FAILED_REPLAYABLE') {
        throw storedFailure(rec, result);
      }
      return result;
    }
    if (res.outcome !== 'OUTCOME_ACQUIRED') {
      if (rec.state === 'STATE_UNKNOWN') {
        throw new UnknownHeldError();
      }
      throw signal?.reason ?? new Error('idemcoord: another attempt with this idempotency key is in progress');
    }

    const lease = new Lease(this, breq, res, sent);
    const { value, error, failed, marked, notStarted, gaveUp } = await lease.run(fn, signal);
    if (lease.lost) {
      throw new LeaseLostError();
    }
    if (gaveUp) {
      await this._releaseAcquisition(breq, lease.token);
      throw signal.reason;
    }
    if (notStarted) {
      // fn never ran: the key goes back to how it was.
      throw joinFinish(new LeaseUnconfirmedError(), await lease.finish({
        kind: 'FAILURE_KIND_ABANDONED', reason: 'the lease could not be confirmed before the attempt started',
      }));
    }
    if (!failed) {
      const response = api.storedResponse(value);
      const result = { response, replayed: false, state: 'STATE_COMPLETED', attempt: rec.attempt };
      const finishErr = await lease.finish({ complete: response });
      if (finishErr) {
        throw finishErr;
      }
      return result;
    }
    const ending = { kind: failureKind(error, marked), reason: failReason(error?.message ?? error) };
    if (ending.kind !== 'FAILURE_KIND_REPLAYABLE') {
      throw joinFinish(error, await lease.finish(ending));
    }
    ending.response = error instanceof FailureError && error.response ? error.response : statusResponse(error);
    const stored = api.storedResponse(ending.response);
    const result = { response: stored, replayed: false, state: 'STATE_FAILED_REPLAYABLE', attempt: rec.attempt };
    const finishErr = await lease.finish(ending);
    const failure = storedFailure({ response: stored, failure_reason: ending.reason }, result, error);
    throw joinFinish(failure, finishErr);
  }

  /**
   * Calls Begin and, while another attempt holds the key, waits for it with
   * Begin's long poll until signal aborts. The first Begin asks for no
   * wait, so a key held UNKNOWN is answered at once. sent is when the last
   * Begin was sent: a lease it granted runs at least until sent plus the
   * lease, by the local clock. It answers the last answer it read (in
   * progress when signal aborted between two Begins), and rejects when a
   * Begin did (cancelled when signal aborted during one): that Begin may
   * have acquired the key (see _releaseAcquisition). With deadline (a
   * Date.now() value), it stops waiting then and answers the last answer.
   */
  async _beginWaiting(req, signal, deadline = Infinity) {
    let sent = Date.now();
    let res = await this.begin(req, { signal });
    while (res.outcome === 'OUTCOME_IN_PROGRESS' && res.record?.state !== 'STATE_UNKNOWN') {
      const left = deadline - Date.now();
      if (signal?.aborted || left <= 0) {
        return { res, sent };
      }
      const asked = Math.min(MAX_BEGIN_WAIT_MS, left);
      const start = Date.now();
      sent = start;
      res = await this.begin(api.copyWith(req, { wait: asked }), { signal });
      if (res.outcome === 'OUTCOME_IN_PROGRESS' && Date.now() - start < asked / 2) {
        await sleep(Math.min(api.millis(res.retry_after) || 100, asked), signal).catch(() => {});
      }
    }
    return { res, sent };
  }

  /**
   * Releases the acquisition that a Begin of req may have made when nobody
   * will act on it: the caller gave up, or the Begin's answer was lost.
   * Without token it re-sends Begin with req's attempt_id and no wait,
   * which answers the acquisition again if there is one; it ends it with
   * Fail ABANDONED, so the key is as if that attempt never was. It is bound
   * to no caller's signal, takes at most RELEASE_TIMEOUT_MS, and never
   * rejects: a failure is logged, and the key then stays held until its
   * lease runs out.
   */
  async _releaseAcquisition(req, token = '') {
    const opts = { signal: AbortSignal.timeout(RELEASE_TIMEOUT_MS), timeoutMs: RELEASE_TIMEOUT_MS };
    try {
      if (!token) {
        const res = await this.begin(api.copyWith(req, { wait: null }), opts);
        if (res.outcome !== 'OUTCOME_ACQUIRED') {
          return; // another attempt holds the key, or it has an outcome
        }
        token = res.lease_token;
      }
      await this.fail({
        scope: req.scope, key: req.key, lease_token: token, kind: 'FAILURE_KIND_ABANDONED', reason: RELEASE_REASON,
      }, opts);
    } catch (err) {
      this._log('warn', 'idemcoord: could not release an acquisition nobody will act on; the key stays held until its lease runs out',
        { scope: req.scope, key: req.key, err: err?.message ?? String(err) });
    }
  }

  /** Runs f in the background, where shutdown waits for it. */
  _runInBackground(f) {
    const p = f(this._bg.signal).catch((err) => this._log('error', 'idemcoord: background work failed', { err: err?.message }));
    this._background.add(p);
    p.finally(() => this._background.delete(p));
  }

  /**
   * Waits until the background work of once (a complete or fail that could
   * not reach the coordinator, retried for up to one lease) has finished,
   * then closes the channel. With timeoutMs, it cancels that work when the
   * time runs out.
   */
  async shutdown({ timeoutMs } = {}) {
    let timer;
    if (timeoutMs !== undefined) {
      timer = setTimeout(() => this._bg.abort(new Error('idemcoord: shutdown timed out')), timeoutMs);
    }
    while (this._background.size > 0) {
      await Promise.allSettled([...this._background]);
    }
    clearTimeout(timer);
    this.close();
  }

  /** Closes the channel at once. */
  close() {
    this._rpc.close();
  }
}

/** How a failure of fn is recorded; after markSideEffect, UNKNOWN unless it names REPLAYABLE. */
function failureKind(err, marked) {
  if (err instanceof FailureError && err.kind && err.kind !== 'FAILURE_KIND_UNSPECIFIED') {
    if (marked && err.kind !== 'FAILURE_KIND_REPLAYABLE') {
      return 'FAILURE_KIND_UNKNOWN';
    }
    return err.kind;
  }
  if (marked) {
    return 'FAILURE_KIND_UNKNOWN';
  }
  return DEFAULT_FAILURE_KINDS[err?.code] ?? 'FAILURE_KIND_UNKNOWN';
}

function joinFinish(err, finishErr) {
  if (!finishErr) {
    return err;
  }
  return new AggregateError([err, finishErr], `${err?.message ?? err}; and recording the outcome failed: ${finishErr.message}`);
}

/** An acquisition this process holds: heartbeats while fn runs, then ends it. */
class Lease {
  constructor(client, req, res, sentAt) {
    this.client = client;
    this.scope = req.scope;
    this.key = req.key;
    this.token = res.lease_token;
    this.request = req.lease;
    const rec = res.record ?? {};
    this.length = req.lease ? api.millis(req.lease) : leaseLength(rec);
    if (!(this.length > 0)) {
      this.length = DEFAULT_LEASE_MS;
    }
    this.info = Object.freeze({
      scope: this.scope, key: this.key, token: this.token,
      generation: rec.generation ?? 0, attempt: rec.attempt ?? 0,
      previous: res.previous_state ?? 'STATE_UNSPECIFIED', uncertain: Boolean(rec.uncertain),
    });
    this.sentAt = sentAt;
    this.lost = false;
    // The checkpoint the attempt resumes after (an earlier attempt's,
    // returned by the Begin that acquired the key), and the last one this
    // attempt recorded (see checkpoint).
    this.resumed = copyCheckpoint(rec.checkpoint);
    this.own = null;
  }

  /**
   * Records that the attempt finished the step phase, with data the next
   * attempt needs to resume after it: a Heartbeat with the lease token and
   * the checkpoint, which also extends the lease. Rejects with
   * LeaseLostError when another attempt took the key over (nothing was
   * recorded), and with the coordinator's error for a phase that is not
   * 1-128 printable bytes or data over its limit (64 KiB by default).
   */
  async checkpoint(phase, data) {
    if (typeof phase !== 'string') {
      throw new TypeError(`idemcoord: a checkpoint's phase must be a string, not ${typeof phase}`);
    }
    const cp = { phase, data: checkpointBytes(data) };
    let res;
    try {
      res = await this.client.heartbeat({ scope: this.scope, key: this.key, lease_token: this.token, lease: this.request, checkpoint: cp });
    } catch (err) {
      if (leaseGone(err)) {
        this.lost = true;
        const lost = new LeaseLostError();
        lost.cause = err;
        throw lost;
      }
      throw err;
    }
    this.own = laterCheckpoint(this.own, { phase: cp.phase, data: cp.data, at: res?.record?.checkpoint?.at ?? null });
  }

  /** The attempt's last own checkpoint, else the one it resumes after, else null; data is a copy. */
  checkpointFrom() {
    return copyCheckpoint(this.own ?? this.resumed);
  }

  /** How long before the lease would run out, by the local clock, fn is aborted unless a heartbeat confirmed it. */
  get margin() {
    return Math.max(this.length / 10, MIN_HEARTBEAT_MS);
  }

  /**
   * Runs fn with heartbeats; settles with fn's outcome once heartbeats
   * stopped. When the Begin that granted the lease took long (a wait for
   * another attempt), it first confirms the lease with a heartbeat; if the
   * lease cannot be confirmed for long enough to start fn, fn does not run
   * (notStarted). Nor does it when outer has aborted before fn would start
   * (gaveUp).
   */
  async run(fn, outer) {
    if (outer?.aborted) {
      return { gaveUp: true };
    }
    let confirmed = this.sentAt;
    if (Date.now() - confirmed > this.length / 3) {
      const sent = Date.now();
      try {
        const length = await this.heartbeat({ timeoutMs: Math.max(this.length / 3, MIN_HEARTBEAT_MS) });
        confirmed = sent;
        if (length > 0) {
          this.length = length;
        }
      } catch (err) {
        if (leaseGone(err)) {
          this.lost = true;
          return {};
        }
      }
    }
    if (outer?.aborted) {
      return { gaveUp: true };
    }
    if (Date.now() >= confirmed + this.length - this.margin) {
      return { notStarted: true };
    }
    const controller = new AbortController();
    const onOuterAbort = () => controller.abort(outer.reason);
    outer?.addEventListener('abort', onOuterAbort, { once: true });
    let marked = false;
    const attempt = Object.freeze({
      signal: controller.signal,
      lease: this.info,
      markSideEffect: () => {
        marked = true;
      },
      checkpoint: (phase, data) => this.checkpoint(phase, data),
      checkpointFrom: () => this.checkpointFrom(),
    });
    const stop = this._keepAlive(controller, confirmed);
    let value;
    let error;
    let failed = false;
    try {
      value = await currentAttempt.run(attempt, () => fn(attempt));
    } catch (err) {
      failed = true;
      error = err;
    } finally {
      outer?.removeEventListener('abort', onOuterAbort);
      await stop();
    }
    return { value, error, failed, marked };
  }

  /**
   * Heartbeats a third of the lease after the last confirmation (more often
   * while the coordinator cannot be reached) until the returned stop is
   * awaited. Aborts fn's signal with LeaseLostError when a heartbeat is
   * refused, and with LeaseUnconfirmedError when no heartbeat confirmed the
   * lease before it would run out by the local clock (less the margin), so
   * two holders never run at once because one was cut off.
   */
  _keepAlive(controller, confirmed) {
    let stopped = false;
    let inFlight = Promise.resolve();
    let beatTimer;
    let expiryTimer;
    let until = confirmed + this.length - this.margin;
    const armExpiry = () => {
      clearTimeout(expiryTimer);
      expiryTimer = setTimeout(() => {
        if (stopped) {
          return;
        }
        if (Date.now() < until) {
          armExpiry();
          return;
        }
        if (!controller.signal.aborted) {
          this.client._log('warn', 'idemcoord: could not confirm the lease before it would run out; aborting the function',
            { scope: this.scope, key: this.key });
        }
        controller.abort(new LeaseUnconfirmedError());
      }, Math.max(0, until - Date.now()));
    };
    const beat = () => {
      if (stopped) {
        return;
      }
      const sent = Date.now();
      let next = Math.max(this.length / 12, MIN_HEARTBEAT_MS); // unreachable: try again soon
      inFlight = this.heartbeat({ timeoutMs: Math.max(this.length / 3, MIN_HEARTBEAT_MS) }).then((length) => {
        const granted = length > 0 ? length : this.length;
        until = sent + granted - this.margin;
        next = Math.max(sent + Math.max(granted / 3, MIN_HEARTBEAT_MS) - Date.now(), 0);
      }, (err) => {
        if (leaseGone(err)) {
          this.lost = true;
          stopped = true;
          clearTimeout(expiryTimer);
          controller.abort(new LeaseLostError());
        }
      }).finally(() => {
        if (!stopped) {
          beatTimer = setTimeout(beat, next);
        }
      });
    };
    armExpiry();
    beatTimer = setTimeout(beat, Math.max(confirmed + Math.max(this.length / 3, MIN_HEARTBEAT_MS) - Date.now(), 0));
    return async () => {
      stopped = true;
      clearTimeout(beatTimer);
      clearTimeout(expiryTimer);
      await inFlight;
    };
  }

  /** Extends the lease; resolves with the lease it was extended by (0 when not told). */
  async heartbeat(opts = {}) {
    const res = await this.client.heartbeat({ scope: this.scope, key: this.key, lease_token: this.token, lease: this.request }, opts);
    return leaseLength(res.record);
  }

  _send(ending, opts) {
    const base = { scope: this.scope, key: this.key, lease_token: this.token };
    if (ending.complete) {
      return this.client.complete(api.copyWith(base, { response: ending.complete }), opts);
    }
    return this.client.fail(api.copyWith(base, { kind: ending.kind, response: ending.response ?? null, reason: ending.reason ?? '' }), opts);
  }

  /**
   * Ends the attempt. Answers null when done, or when the coordinator cannot
   * be reached (then it keeps trying in the background for up to one
   * lease); a response the coordinator refuses to store records the attempt
   * UNKNOWN instead; other refusals are answered.
   */
  async finish(ending) {
    if (ending.kind === 'FAILURE_KIND_ABANDONED' && this.own) {
      // An attempt that recorded a checkpoint has acted: the coordinator
      // refuses to abandon it. RETRYABLE keeps the checkpoint for the next.
      ending = { ...ending, kind: 'FAILURE_KIND_RETRYABLE' };
    }
    try {
      await this._send(ending, { timeoutMs: FINISH_TIMEOUT_MS });
      return null;
    } catch (err) {
      if (abandonRefused(ending, err)) {
        return this.finish({ ...ending, kind: 'FAILURE_KIND_RETRYABLE' });
      }
      if (unreachable(err)) {
        this.client._log('warn', 'idemcoord: coordinator unreachable at the end of an attempt; retrying in the background',
          { scope: this.scope, key: this.key, err: err.message });
        this.client._runInBackground((signal) => this._finishLater(ending, signal));
        return null;
      }
      if (err?.code === S.INVALID_ARGUMENT && (ending.complete || ending.response)) {
        return this.finish({ kind: 'FAILURE_KIND_UNKNOWN', reason: failReason(`response not stored: ${err.message}`) });
      }
      return err;
    }
  }

  async _finishLater(ending, signal) {
    const giveUp = Date.now() + this.length;
    let delay = 100;
    while (Date.now() < giveUp && !signal.aborted) {
      await sleep(delay, signal).catch(() => {});
      try {
        await this._send(ending, { timeoutMs: FINISH_TIMEOUT_MS, signal });
        return;
      } catch (err) {
        if (abandonRefused(ending, err)) {
          ending = { ...ending, kind: 'FAILURE_KIND_RETRYABLE' };
          continue;
        }
        if (!unreachable(err)) {
          this.client._log('error', 'idemcoord: coordinator refused the end of an attempt', { err: err.message });
          return;
        }
      }
      // Keep the key held meanwhile. A refused heartbeat (ALREADY_FINISHED
      // when the ending did land and only its reply was lost) decides
      // nothing: the next try of the ending tells.
      await this.heartbeat({ signal }).catch(() => {});
      delay = Math.min(delay * 2, 2000);
    }
    this.client._log('error', 'idemcoord: gave up ending an attempt; the record will read UNKNOWN once its lease runs out',
      { scope: this.scope, key: this.key });
  }
}

/**
 * Marks, inside a function once runs, that its first irreversible step is
 * about to happen: after it, any error ends the attempt FAILURE_KIND_UNKNOWN
 * (a FailureError naming FAILURE_KIND_REPLAYABLE is still stored as such).
 * Outside such a function it does nothing.
 */
function markSideEffect() {
  currentAttempt.getStore()?.markSideEffect();
}

/** The lease of the attempt a function run by once is in, or null outside one. */
function currentLease() {
  return currentAttempt.getStore()?.lease ?? null;
}

/**
 * Records a recovery point of the attempt in progress (inside a function
 * once runs, a handler of the HTTP middlewares or of the gRPC interceptor):
 * the step phase is done, with data the next attempt needs to resume after
 * it (a charge id, say). If this attempt dies, the next attempt of the key
 * reads it with checkpointFrom and skips the steps before it. Call it after
 * the step's effect is durable; markSideEffect still applies to the work
 * after it. Rejects with LeaseLostError when another attempt took the key
 * over, and outside an attempt.
 */
async function checkpoint(phase, data) {
  const attempt = currentAttempt.getStore();
  if (!attempt) {
    throw new Error('idemcoord: checkpoint outside an attempt (no handler or once function with an idempotency key)');
  }
  return attempt.checkpoint(phase, data);
}

/**
 * The checkpoint of the attempt in progress, { phase, data, at }: the last
 * one it recorded, else the one it resumes after (an earlier attempt's);
 * null when there is none, and outside an attempt.
 */
function checkpointFrom() {
  return currentAttempt.getStore()?.checkpointFrom() ?? null;
}

/** A copy of a Checkpoint message (null for none). */
/**
 * Of an attempt's checkpoint so far (own) and one just answered (next), the one the coordinator
 * wrote last: concurrent checkpoint() calls may be answered in another order than they were
 * written, and a checkpoint's `at` is the coordinator's time of writing it.
 */
function laterCheckpoint(own, next) {
  if (!own || !own.at || !next.at) {
    return next;
  }
  const s1 = BigInt(own.at.seconds ?? 0), s2 = BigInt(next.at.seconds ?? 0);
  const before = s2 < s1 || (s2 === s1 && (next.at.nanos ?? 0) < (own.at.nanos ?? 0));
  return before ? own : next;
}

function copyCheckpoint(c) {
  if (!c || !c.phase) {
    return null;
  }
  return { phase: c.phase, data: Buffer.from(c.data ?? []), at: c.at ?? null };
}

module.exports = {
  Client, markSideEffect, currentLease, checkpoint, checkpointFrom, DEFAULT_FAILURE_KINDS,
  // For the middlewares and the interceptor (lib/http.js, lib/grpc.js).
  Lease, currentAttempt, failReason, answerLost, RELEASE_REASON,
  // For the tests.
  laterCheckpoint, AttemptIds,
};
