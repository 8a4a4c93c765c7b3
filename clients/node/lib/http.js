'use strict';
// The HTTP middleware (Express 5 / Connect: httpMiddleware; Fastify:
// fastifyPlugin) with the semantics of Go's clients.HTTPMiddleware
// (clients/http.go): the IETF Idempotency-Key draft's headers and
// statuses, stored replays, markSideEffect, lease data and safe give-ups.
// clients/testdata/http_conformance.json is the suite every stack runs.

const crypto = require('node:crypto');
const { Readable } = require('node:stream');
const grpc = require('@grpc/grpc-js');
const api = require('./api');
const { Lease, answerLost } = require('./client');
const { LeaseLostError, LeaseUnconfirmedError, ClientGoneError } = require('./errors');
const { PROBLEM_TYPES, HTTP_HEADERS } = require('./tables');

const S = grpc.status;

const KEY_HEADER = HTTP_HEADERS.key;
const RESULT_HEADER = HTTP_HEADERS.result;
const REPLAYED_HEADER = HTTP_HEADERS.replayed;
const EXPIRES_HEADER = HTTP_HEADERS.expires;
const HTTP_SCHEMA_VERSION = 'idemcoord.http/1';
// The one scope of every record before the default became the operation;
// `scope: DEFAULT_HTTP_SCOPE` keeps that.
const DEFAULT_HTTP_SCOPE = 'http';
const MAX_SCOPE_BYTES = 255;
const MAX_CAPTURED_BODY = 4 << 20;

/** Problem types (RFC 9457) of the answers the middleware writes itself; the same as Go's (lib/tables.js). */
const PROBLEMS = PROBLEM_TYPES;

class HttpError extends Error {
  constructor(status, type, title, detail, headers = {}) {
    super(detail || title);
    Object.assign(this, { status, type, title, detail, headers });
  }
}

/**
 * The key of an Idempotency-Key header value (as Node gives it: one
 * latin1 character per byte): the value itself or the content of a
 * structured-field string; 1-255 bytes of valid UTF-8 without control
 * characters. Throws an Error saying why not.
 */
function parseIdempotencyKey(value) {
  let v = String(value).replace(/^[ \t]+|[ \t]+$/g, '');
  if (v.length >= 2 && v[0] === '"') {
    let out = '';
    let i = 1;
    for (; i < v.length && v[i] !== '"'; i++) {
      let c = v[i];
      if (c === '\\') {
        i++;
        if (i >= v.length || (v[i] !== '"' && v[i] !== '\\')) {
          throw new Error('Idempotency-Key: a structured-field string escapes only \\" and \\\\');
        }
        c = v[i];
      } else if (c < ' ' || c > '~') {
        throw new Error('Idempotency-Key: a structured-field string holds printable ASCII only');
      }
      out += c;
    }
    if (i !== v.length - 1) {
      throw new Error('Idempotency-Key: unterminated structured-field string, or text after it');
    }
    v = out;
  }
  const bytes = Buffer.from(v, 'latin1');
  if (bytes.length === 0) {
    throw new Error('Idempotency-Key is empty');
  }
  if (bytes.length > 255) {
    throw new Error(`Idempotency-Key is ${bytes.length} bytes long, more than 255`);
  }
  let key;
  try {
    key = new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    throw new Error('Idempotency-Key is not valid UTF-8');
  }
  if (/\p{Cc}/u.test(key)) {
    throw new Error('Idempotency-Key holds a control character');
  }
  return key;
}

/**
 * Why key (a key a key function returned) is not a valid idempotency key,
 * as a phrase ('is empty'), or '' when it is one: 1-255 bytes of valid
 * UTF-8 without control characters, as a header's key must be.
 */
function checkKey(key) {
  const n = Buffer.byteLength(key, 'utf8');
  if (n === 0) {
    return 'is empty';
  }
  if (n > 255) {
    return `is ${n} bytes long, more than 255`;
  }
  if (/\p{Cs}/u.test(key)) {
    return 'is not valid UTF-8'; // a lone surrogate
  }
  if (/\p{Cc}/u.test(key)) {
    return 'holds a control character';
  }
  return '';
}

/** The key stored for principal's key: base64url(SHA-256(principal)) ":" key, as Go's FoldPrincipal. */
function foldPrincipal(principal, key) {
  return `${crypto.createHash('sha256').update(String(principal), 'utf8').digest('base64url')}:${key}`;
}

/** The default request fingerprint: SHA-256 of method, "\n", path with query as sent, "\n", body (as Go's HTTPFingerprint). */
function httpFingerprint(method, url, body) {
  return crypto.createHash('sha256').update(`${method}\n${url}\n`).update(body).digest();
}

/** Canonical header name, as Go's http.CanonicalHeaderKey: "x-extra" → "X-Extra". */
function canonicalHeader(name) {
  return String(name).toLowerCase().replace(/(^|-)([a-z])/g, (_, dash, c) => dash + c.toUpperCase());
}

/** An IMF-fixdate (RFC 9110) of a google.protobuf.Timestamp, '' when unset. */
function imfFixdate(ts) {
  const ms = api.millis(ts);
  return ms > 0 ? new Date(ms).toUTCString() : '';
}

/**
 * The default scope of a request (Go's HTTPOperationScope): "[service ]METHOD
 * /path", the path as sent (percent-encoded) without the query. A scope
 * longer than 255 bytes is its first 190 bytes (never cutting a UTF-8
 * sequence), "~", and the unpadded base64url SHA-256 of the whole.
 */
function httpOperationScope(service, method, path) {
  let s = `${method} ${path}`;
  if (service) {
    s = `${service} ${s}`;
  }
  const b = Buffer.from(s, 'utf8');
  if (b.length <= MAX_SCOPE_BYTES) {
    return s;
  }
  let cut = 190;
  while (cut > 0 && (b[cut] & 0xc0) === 0x80) {
    cut--;
  }
  return `${b.subarray(0, cut).toString('utf8')}~${crypto.createHash('sha256').update(b).digest('base64url')}`;
}

/** The path of a request as sent, without the query. */
function requestPath(req) {
  const url = req.originalUrl ?? req.url ?? '/';
  const q = url.indexOf('?');
  return q < 0 ? url : url.slice(0, q);
}

function problemBody(status, type, title, detail) {
  const p = { type, title, status };
  if (detail) {
    p.detail = detail;
  }
  return Buffer.from(`${JSON.stringify(p)}\n`);
}

/** How long a handler whose client went away may take to end its answer while the middleware keeps its lease. */
const DEFAULT_LINGER_MS = 60000;

/**
 * The options of httpMiddleware and fastifyPlugin, checked: a mismatchStatus
 * other than 409 or 422 throws a RangeError. Warns through client (as Go's
 * HTTPMiddleware) when neither principal nor withoutPrincipal is given.
 */
function normalizeOptions(client, options = {}) {
  const mismatchStatus = options.mismatchStatus ?? 422;
  if (mismatchStatus !== 409 && mismatchStatus !== 422) {
    throw new RangeError(`idemcoord: mismatchStatus takes 409 or 422, not ${mismatchStatus}: a key reused with another request is refused, never answered as a success`);
  }
  if (options.principal && options.withoutPrincipal) {
    throw new TypeError('idemcoord: principal and withoutPrincipal exclude each other');
  }
  if (!options.principal && !options.withoutPrincipal) {
    client._warnUndecidedPrincipal('httpMiddleware', 'principal', 'withoutPrincipal');
  }
  if (!options.scope && !options.service) {
    client._warn('idemcoord: httpMiddleware built without service or scope: its records\' scope is the operation alone ("POST /orders"), the same for every service that shares the coordinator\'s tenant; name the service with service, or give each service a tenant (token) of its own',
      'IDEMCOORD_UNNAMED_SERVICE');
  }
  const methods = new Set((options.methods ?? ['POST', 'PATCH']).map((m) => String(m).toUpperCase()));
  const replayHeaders = ['location'];
  for (const n of options.replayHeaders ?? []) {
    const l = String(n).toLowerCase();
    if (l !== 'content-type' && !replayHeaders.includes(l)) {
      replayHeaders.push(l);
    }
  }
  return {
    waitMs: Math.max(options.waitMs ?? 5000, 0),
    requireKey: Boolean(options.requireKey),
    failOpen: Boolean(options.failOpen),
    principal: options.principal ?? null,
    methods,
    fingerprint: options.fingerprint ?? null,
    replayHeaders,
    replayable: new Set(options.replayableStatuses ?? [404, 409, 422]),
    scope: options.scope || null,
    service: options.service ?? '',
    maxBodyBytes: options.maxBodyBytes ?? 10 << 20,
    mismatchStatus,
    lingerMs: Math.max(options.lingerMs ?? DEFAULT_LINGER_MS, 0),
    onReplay: options.onReplay ?? null,
    key: options.key ?? null,
  };
}

/** How a final status is recorded: '' is stored as a success. */
function kindOf(o, status) {
  if (status < 400) {
    return '';
  }
  if (o.replayable.has(status)) {
    return 'FAILURE_KIND_REPLAYABLE';
  }
  if (status < 500) {
    return 'FAILURE_KIND_ABANDONED';
  }
  if (status === 503) {
    return 'FAILURE_KIND_RETRYABLE';
  }
  return 'FAILURE_KIND_UNKNOWN';
}

function stores(o, status) {
  const k = kindOf(o, status);
  return k === '' || k === 'FAILURE_KIND_REPLAYABLE';
}

/** Reads a request body whole, at most limit bytes (an HttpError 413 past it). */
function readBody(stream, limit) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let n = 0;
    let done = false;
    stream.on('data', (c) => {
      if (done) {
        return;
      }
      n += c.length;
      if (n > limit) {
        done = true;
        stream.resume();
        reject(new HttpError(413, PROBLEMS.bodyTooLarge, 'Request body too large',
          `a request with an Idempotency-Key may have at most ${limit} bytes of body`));
        return;
      }
      chunks.push(Buffer.isBuffer(c) ? c : Buffer.from(c));
    });
    stream.once('end', () => {
      if (!done) {
        done = true;
        resolve(Buffer.concat(chunks));
      }
    });
    stream.once('error', (err) => {
      if (!done) {
        done = true;
        reject(new HttpError(400, 'about:blank', 'Bad Request', `reading the request body: ${err.message}`));
      }
    });
  });
}

/** Makes a consumed IncomingMessage readable again with body, for the body parsers after the middleware. */
function refill(req, body) {
  Readable.call(req, {});
  let sent = false;
  req._read = function read() {
    if (!sent) {
      sent = true;
      if (body.length > 0) {
        this.push(body);
      }
      this.push(null);
    }
  };
  req.rawBody = body;
}

/** An AbortSignal that aborts when the client of res goes away before its answer was sent. */
function disconnectSignal(req, res) {
  const controller = new AbortController();
  const gone = () => {
    if (!res.writableFinished) {
      controller.abort(new ClientGoneError());
    }
  };
  res.once('close', gone);
  req.once('aborted', gone);
  if (req.socket?.destroyed) {
    gone();
  }
  return controller.signal;
}

/**
 * Guards one request. It ends with one of: { pass: true } (run the handler
 * unprotected), { answered: true } (the middleware answered), or
 * { acquired, breq, told } (run the handler under the lease; told is the
 * ttl and failure_ttl Begin told, for Idempotency-Expires).
 */
class Guard {
  constructor(client, o) {
    this.client = client;
    this.o = o;
  }

  /** Sends a problem on res, unless the answer has started. */
  problem(res, status, type, title, detail, headers = {}) {
    if (res.headersSent) {
      if (!res.writableEnded) {
        res.end();
      }
      return;
    }
    for (const [k, v] of Object.entries(headers)) {
      res.setHeader(k, v);
    }
    const body = problemBody(status, type, title, detail);
    res.removeHeader(RESULT_HEADER);
    res.removeHeader(EXPIRES_HEADER);
    res.setHeader('Content-Type', 'application/problem+json');
    res.setHeader('Content-Length', String(body.length));
    res.statusCode = status;
    res.end(body);
  }

  /** Answers a stored response byte for byte. */
  replay(req, res, record) {
    let stored = record?.response ?? {};
    if (this.o.onReplay) {
      stored = this.o.onReplay(req, stored) ?? stored;
    }
    if (stored.content_type) {
      res.setHeader('Content-Type', stored.content_type);
    }
    for (const [name, v] of Object.entries(stored.metadata ?? {})) {
      res.setHeader(canonicalHeader(name), String(v).split('\n'));
    }
    const expires = imfFixdate(record?.expires_at);
    if (expires) {
      res.setHeader(EXPIRES_HEADER, expires);
    }
    res.setHeader(RESULT_HEADER, 'replayed');
    res.setHeader(REPLAYED_HEADER, 'true');
    const body = Buffer.from(stored.body ?? []);
    res.setHeader('Content-Length', String(body.length));
    let code = stored.status_code;
    if (!(code >= 200 && code <= 999)) {
      code = 200;
    }
    res.statusCode = code;
    res.end(body);
  }

  /**
   * The whole body of req: body when the framework read it already (or
   * this guard did), else read from req (at most maxBodyBytes) and put
   * back for the parsers after the middleware. Answers 413 (or 400) when
   * it cannot, and says so with answered.
   */
  async readWholeBody(req, res, body) {
    try {
      if (body == null) {
        const read = await readBody(req, this.o.maxBodyBytes);
        refill(req, read);
        return { body: read };
      }
      if (body.length > this.o.maxBodyBytes) {
        throw new HttpError(413, PROBLEMS.bodyTooLarge, 'Request body too large',
          `a request with an Idempotency-Key may have at most ${this.o.maxBodyBytes} bytes of body`);
      }
      return { body };
    } catch (err) {
      if (err instanceof HttpError) {
        this.problem(res, err.status, err.type, err.title, err.detail);
        return { answered: true };
      }
      throw err;
    }
  }

  /**
   * Everything before the handler: key, principal, body, fingerprint,
   * Begin. body is the raw body when the framework read it already
   * (Fastify), else null (read from req).
   */
  async begin(req, res, body, signal) {
    const o = this.o;
    if (!o.methods.has(req.method)) {
      return { pass: true };
    }
    const raw = req.headersDistinct?.['idempotency-key'] ?? (req.headers['idempotency-key'] != null ? [req.headers['idempotency-key']] : []);
    if (raw.length > 1) {
      this.problem(res, 400, PROBLEMS.keyInvalid, 'Idempotency-Key is invalid', 'send one Idempotency-Key header');
      return { answered: true };
    }
    let key = '';
    let echo = '';
    if (raw.length === 1) {
      try {
        key = parseIdempotencyKey(raw[0]);
      } catch (err) {
        this.problem(res, 400, PROBLEMS.keyInvalid, 'Idempotency-Key is invalid', err.message);
        return { answered: true };
      }
      echo = raw[0];
    } else if (o.key) {
      const read = await this.readWholeBody(req, res, body);
      if (read.answered) {
        return read;
      }
      body = read.body;
      let k;
      try {
        k = await o.key(req, body);
        if (k != null && typeof k !== 'string') {
          throw new TypeError(`the key function returned a ${typeof k}, not a string`);
        }
      } catch (err) {
        this.problem(res, 400, PROBLEMS.keyInvalid, 'Idempotency key is invalid',
          `the idempotency key could not be taken from the request: ${err?.message ?? err}`);
        return { answered: true };
      }
      if (k) {
        const bad = checkKey(k);
        if (bad) {
          this.problem(res, 400, PROBLEMS.keyInvalid, 'Idempotency key is invalid', `the idempotency key taken from the request ${bad}`);
          return { answered: true };
        }
        key = k;
        echo = Buffer.from(k, 'utf8').toString('latin1'); // its UTF-8 bytes, as a header value is sent
      }
    }
    if (!key) {
      if (o.requireKey) {
        this.problem(res, 400, PROBLEMS.keyMissing, 'Idempotency-Key is missing', 'this request requires an Idempotency-Key header');
        return { answered: true };
      }
      return { pass: true };
    }
    res.setHeader(KEY_HEADER, echo);
    if (o.principal) {
      try {
        key = foldPrincipal(await o.principal(req), key);
      } catch (err) {
        this.problem(res, 400, 'about:blank', 'Bad Request', `idempotency principal: ${err?.message ?? err}`);
        return { answered: true };
      }
    }
    const read = await this.readWholeBody(req, res, body);
    if (read.answered) {
      return read;
    }
    body = read.body;
    let fp;
    try {
      fp = o.fingerprint ? await o.fingerprint(req, body) : httpFingerprint(req.method, req.originalUrl ?? req.url, body);
    } catch (err) {
      this.problem(res, 400, 'about:blank', 'Bad Request', `idempotency fingerprint: ${err?.message ?? err}`);
      return { answered: true };
    }
    const c = this.client;
    const breq = {
      scope: o.scope ?? httpOperationScope(o.service, req.method, requestPath(req)), key, fingerprint: fp ? Buffer.from(fp) : Buffer.alloc(0), attempt_id: c._newAttemptId(),
      lease: c._opts.leaseMs > 0 ? api.duration(c._opts.leaseMs) : null,
      accept_schema_versions: [HTTP_SCHEMA_VERSION],
    };
    let res0;
    let sent;
    try {
      ({ res: res0, sent } = await c._beginWaiting(breq, signal, Date.now() + o.waitMs));
    } catch (err) {
      if (signal.aborted) {
        await c._releaseAcquisition(breq); // the client has gone; nothing written reaches anyone
        this.problem(res, 503, PROBLEMS.unavailable, 'Request cancelled', 'the client went away');
        return { answered: true };
      }
      if (answerLost(err)) {
        c._releaseAcquisition(breq); // never rejects; in the background
      }
      return this.beginFailed(req, res, err);
    }
    const rec = res0.record ?? {};
    if (res0.outcome === 'OUTCOME_ACQUIRED') {
      if (signal.aborted) {
        await c._releaseAcquisition(breq, res0.lease_token);
        return { answered: true };
      }
      return { acquired: new Lease(c, breq, res0, sent), breq, told: { ttl: res0.ttl, failureTtl: res0.failure_ttl } };
    }
    if (res0.outcome === 'OUTCOME_REPLAY') {
      this.replay(req, res, rec);
      return { answered: true };
    }
    if (rec.state === 'STATE_UNKNOWN') {
      this.problem(res, 409, PROBLEMS.outcomeUnknown, 'Outcome of an earlier request unknown',
        'an earlier request with this Idempotency-Key may or may not have taken effect; it is held for an operator, and retrying does not help');
      return { answered: true };
    }
    const retryMs = api.millis(res0.retry_after);
    this.problem(res, 409, PROBLEMS.inProgress, 'Request in progress',
      `another request with this Idempotency-Key is in progress; retry after ${retryMs} ms`,
      { 'Retry-After': String(Math.max(Math.ceil(retryMs / 1000), 1)) });
    return { answered: true };
  }

  beginFailed(req, res, err) {
    const code = err?.code;
    if (code === S.UNAVAILABLE || code === S.DEADLINE_EXCEEDED) {
      if (this.o.failOpen) {
        this.client._log('warn', 'idemcoord: coordinator unreachable; running the handler unprotected (fail open)', { err: err.message });
        return { pass: true };
      }
      this.problem(res, 503, PROBLEMS.unavailable, 'Idempotency coordinator unavailable',
        'the request was not processed; retry later with the same Idempotency-Key', { 'Retry-After': '1' });
      return { answered: true };
    }
    if (code === S.RESOURCE_EXHAUSTED) {
      this.problem(res, 503, PROBLEMS.unavailable, 'Idempotency coordinator busy',
        'the request was not processed; retry later with the same Idempotency-Key', { 'Retry-After': '1' });
      return { answered: true };
    }
    if (code === S.FAILED_PRECONDITION) {
      switch (api.errorReason(err)) {
        case 'FINGERPRINT_MISMATCH':
        case 'SCHEMA_VERSION_NOT_ACCEPTED':
          this.problem(res, this.o.mismatchStatus, PROBLEMS.keyReused, 'Idempotency-Key reused',
            'this Idempotency-Key was first used with another request');
          return { answered: true };
        case 'KEY_EXPIRED':
          this.problem(res, 422, PROBLEMS.keyExpired, 'Idempotency-Key expired',
            'the result stored for this Idempotency-Key has expired and the key may not be used again');
          return { answered: true };
        case 'ATTEMPTS_EXHAUSTED':
          this.problem(res, 422, PROBLEMS.attemptsExhausted, 'Idempotency-Key attempts exhausted',
            'requests with this Idempotency-Key failed as many times as allowed');
          return { answered: true };
        default:
      }
    }
    if (code === S.INVALID_ARGUMENT) {
      this.problem(res, 400, PROBLEMS.keyInvalid, 'Idempotency-Key is invalid', err.details ?? err.message);
      return { answered: true };
    }
    this.client._log('error', 'idemcoord: coordinator refused Begin', { err: err?.message });
    this.problem(res, 500, PROBLEMS.internal, 'Internal Server Error', 'the idempotency coordinator refused the call');
    return { answered: true };
  }

  /**
   * Runs the handler (start, called inside the attempt's context) under
   * lease and records the response it writes on res. A handler that may
   * still act is never taken for finished: the attempt is recorded when the
   * handler ends its answer, whether or not its client is still there.
   * Resolves once the attempt is recorded, or once the handler's client has
   * been gone for lingerMs without the handler ending its answer (then the
   * lease is left to run out, UNKNOWN, and an answer that comes later is
   * still recorded if no other attempt took the key over).
   */
  async run(req, res, lease, breq, told, signal, start) {
    const o = this.o;
    const rec = new Recorder(res, o, told);
    let lingering;
    const outcome = await lease.run((attempt) => new Promise((resolve) => {
      req.idempotency = attempt;
      const settle = (why) => {
        clearTimeout(lingering);
        signal.removeEventListener('abort', linger);
        resolve(why);
      };
      // The client gone, the handler has lingerMs to end its answer.
      const linger = () => {
        lingering = setTimeout(() => settle('lingered'), o.lingerMs);
      };
      rec.onEnd = () => settle('ended');
      attempt.signal.addEventListener('abort', () => {
        const why = attempt.signal.reason;
        if (!rec.wrote && (why instanceof LeaseLostError || why instanceof LeaseUnconfirmedError)) {
          // Another attempt may hold the key now: whatever the handler
          // answers from here on is recorded (while the lease is ours)
          // but never sent as this request's success.
          rec.withhold();
        }
      }, { once: true });
      if (signal.aborted) {
        linger();
      } else {
        signal.addEventListener('abort', linger, { once: true });
      }
      try {
        const r = start(attempt);
        if (r && typeof r.then === 'function') {
          r.then(null, () => {}); // the framework answers the error: recorded by its status
        }
      } catch {
        // recorded by the framework's answer to it
      }
    }), signal);
    if (outcome.gaveUp) {
      await this.client._releaseAcquisition(breq, lease.token);
      return;
    }
    if (outcome.notStarted) {
      await lease.finish({ kind: 'FAILURE_KIND_ABANDONED', reason: 'the lease could not be confirmed before the handler started' });
      this.problem(res, 503, PROBLEMS.unavailable, 'Idempotency coordinator unavailable',
        'the request was not processed; retry later with the same Idempotency-Key', { 'Retry-After': '1' });
      return;
    }
    if (lease.lost) {
      this.client._log('warn', 'idemcoord: lease lost while the handler ran; its response is not stored',
        { scope: lease.scope, key: lease.key, status: rec.status });
      if (!rec.wrote || rec.withheld) {
        this.leaseLost(res, rec, ', and nothing was stored for it');
      }
      return;
    }
    if (outcome.value === 'lingered') {
      this.client._log('warn', 'idemcoord: the handler has not answered although its client went away; the lease is left to run out (the record reads UNKNOWN unless the handler ends its answer before another attempt takes the key over)',
        { scope: lease.scope, key: lease.key, lingerMs: o.lingerMs });
      rec.onEnd = () => {
        // Marks made after the lease was left are not seen: what is not
        // stored is recorded UNKNOWN.
        lease.finish(this.ending(rec, true)).then((err) => {
          if (err) {
            this.client._log('warn', 'idemcoord: the late answer of a handler whose client went away was not recorded',
              { scope: lease.scope, key: lease.key, err: err.message });
          }
        });
      };
      return;
    }
    await lease.finish(this.ending(rec, outcome.marked));
    if (rec.withheld) {
      this.leaseLost(res, rec, '');
    }
  }

  /** Answers 503 lease-lost in place of what the handler wrote or will write. */
  leaseLost(res, rec, stored) {
    rec.withhold();
    rec.restore();
    this.problem(res, 503, PROBLEMS.leaseLost, 'Idempotency key taken over',
      `this request lost its hold on the Idempotency-Key before it answered${stored}; retry with the same Idempotency-Key to get the outcome`,
      { 'Retry-After': '1' });
  }

  ending(rec, marked) {
    const reason = `HTTP ${rec.status}`;
    const kind = kindOf(this.o, rec.status);
    if (rec.overflow && (kind === '' || kind === 'FAILURE_KIND_REPLAYABLE')) {
      return { kind: 'FAILURE_KIND_UNKNOWN', reason: `${reason}: response body too large to store` };
    }
    if (kind === '') {
      return { complete: rec.stored() };
    }
    if (kind === 'FAILURE_KIND_REPLAYABLE') {
      return { kind, response: rec.stored(), reason };
    }
    if (marked) {
      return { kind: 'FAILURE_KIND_UNKNOWN', reason: `${reason} after markSideEffect` };
    }
    return { kind, reason };
  }
}

/**
 * A string chunk of write or end (with its encoding in rest) as bytes:
 * Node sends the headers in the encoding of a string first chunk written
 * with them, which would send a header value's bytes above 0x7F (an echoed
 * UTF-8 key) as UTF-8 of their latin1 reading; a Buffer keeps them as set.
 */
function asBytes(chunk, rest) {
  if (typeof chunk !== 'string') {
    return [chunk, rest];
  }
  if (typeof rest[0] === 'string') {
    return [Buffer.from(chunk, rest[0]), rest.slice(1)];
  }
  return [Buffer.from(chunk, 'utf8'), rest];
}

/**
 * Passes the handler's response through res and keeps a copy of what is
 * stored: the status, the replayed headers as they were when the status
 * was written, and the body. Once withheld, what the handler writes is
 * still recorded but no longer sent: the middleware answers instead.
 */
class Recorder {
  constructor(res, o, told = {}) {
    this.res = res;
    this.o = o;
    this.told = told;
    this.wrote = false;
    this.ended = false;
    this.status = 0;
    this.headers = {};
    this.chunks = [];
    this.size = 0;
    this.overflow = false;
    this.withheld = false;
    this.onEnd = null;
    const origWriteHead = res.writeHead;
    const origWrite = res.write;
    const origEnd = res.end;
    this.restore = () => {
      res.writeHead = origWriteHead;
      res.write = origWrite;
      res.end = origEnd;
    };
    const self = this;
    // A withheld write still calls back, as a sent one would.
    const calledBack = (args) => {
      const cb = args.find((a) => typeof a === 'function');
      if (cb) {
        process.nextTick(cb);
      }
    };
    res.writeHead = function writeHead(status, ...rest) {
      if (!self.wrote && status >= 200) {
        self.head(status, rest);
      }
      if (self.withheld) {
        return this;
      }
      return origWriteHead.call(this, status, ...rest);
    };
    res.write = function write(chunk, ...rest) {
      if (!self.wrote && !this.headersSent) {
        self.head(this.statusCode, []);
      }
      [chunk, rest] = asBytes(chunk, rest);
      self.keep(chunk, typeof rest[0] === 'string' ? rest[0] : undefined);
      if (self.withheld) {
        calledBack(rest);
        return true;
      }
      return origWrite.call(this, chunk, ...rest);
    };
    res.end = function end(chunk, ...rest) {
      if (typeof chunk === 'function') {
        rest = [chunk];
        chunk = undefined;
      }
      if (self.ended) {
        return self.withheld ? this : origEnd.call(this, chunk, ...rest);
      }
      if (!self.wrote && !this.headersSent) {
        self.head(this.statusCode, []);
      }
      if (chunk != null) {
        [chunk, rest] = asBytes(chunk, rest);
        self.keep(chunk, undefined);
      }
      self.ended = true;
      let r = this;
      if (self.withheld) {
        calledBack(rest);
      } else {
        r = origEnd.call(this, chunk, ...rest);
      }
      self.onEnd?.();
      return r;
    };
  }

  /** Keeps what the handler writes from now on from the client; it is still recorded. */
  withhold() {
    this.withheld = true;
  }

  /** Records the status and the stored headers, and sets Idempotency-Result. */
  head(status, rest) {
    this.wrote = true;
    this.status = status;
    const res = this.res;
    let extra = rest.find((r) => r && typeof r === 'object');
    if (Array.isArray(extra)) {
      // raw [name, value, name, value, ...]
      const obj = {};
      for (let i = 0; i + 1 < extra.length; i += 2) {
        obj[String(extra[i]).toLowerCase()] = extra[i + 1];
      }
      extra = obj;
    }
    const lowered = Object.fromEntries(Object.entries(extra ?? {}).map(([k, v]) => [k.toLowerCase(), v]));
    for (const name of ['content-type', ...this.o.replayHeaders]) {
      const v = lowered[name] ?? res.getHeader(name);
      if (v != null) {
        this.headers[name] = Array.isArray(v) ? v.map(String) : [String(v)];
      }
    }
    if (stores(this.o, status)) {
      const set = { [RESULT_HEADER]: 'created' };
      const expires = this.expires(kindOf(this.o, status) === 'FAILURE_KIND_REPLAYABLE');
      if (expires) {
        set[EXPIRES_HEADER] = expires;
      } else {
        res.removeHeader(EXPIRES_HEADER);
      }
      if (extra && !Array.isArray(rest.find((r) => r && typeof r === 'object'))) {
        Object.assign(extra, set);
      } else {
        for (const [k, v] of Object.entries(set)) {
          res.setHeader(k, v);
        }
      }
    } else {
      res.removeHeader(RESULT_HEADER);
      res.removeHeader(EXPIRES_HEADER);
    }
  }

  /**
   * Idempotency-Expires of a response stored now (as Go's): now plus the
   * ttl Begin told (failure_ttl for a replayable failure), '' when untold.
   */
  expires(failure) {
    const d = failure ? this.told.failureTtl : this.told.ttl;
    return d ? new Date(Date.now() + api.millis(d)).toUTCString() : '';
  }

  keep(chunk, encoding) {
    if (chunk == null || this.overflow) {
      return;
    }
    const b = Buffer.isBuffer(chunk) ? chunk : (chunk instanceof Uint8Array ? Buffer.from(chunk) : Buffer.from(String(chunk), encoding || 'utf8'));
    if (this.size + b.length > MAX_CAPTURED_BODY) {
      this.overflow = true;
      this.chunks = [];
      return;
    }
    this.chunks.push(b);
    this.size += b.length;
  }

  stored() {
    const resp = { schema_version: HTTP_SCHEMA_VERSION, status_code: this.status, body: Buffer.concat(this.chunks), metadata: {} };
    for (const [name, values] of Object.entries(this.headers)) {
      if (name === 'content-type') {
        resp.content_type = values.join(', ');
      } else {
        resp.metadata[canonicalHeader(name)] = values.join('\n');
      }
    }
    return resp;
  }
}

/**
 * httpMiddleware makes the handlers after it idempotent (Express 5,
 * Connect, or any (req, res, next) stack); see index.d.ts for options.
 * Install it before body parsers: it reads the body to fingerprint it and
 * puts it back (also as req.rawBody).
 */
function httpMiddleware(client, options = {}) {
  const guard = new Guard(client, normalizeOptions(client, options));
  return function idempotency(req, res, next) {
    const signal = disconnectSignal(req, res);
    guard.begin(req, res, req.rawBody ?? null, signal).then((g) => {
      if (g.pass) {
        next();
        return undefined;
      }
      if (g.answered) {
        return undefined;
      }
      return guard.run(req, res, g.acquired, g.breq, g.told, signal, () => next());
    }).catch((err) => next(err));
  };
}

/**
 * fastifyPlugin registers the middleware on a Fastify instance:
 * `app.register(fastifyPlugin, { client, ...options })`. It keeps the raw
 * body in a preParsing hook (the parsers still get it) and guards each
 * request in a preHandler hook; handlers read request.idempotency.
 */
function fastifyPlugin(fastify, opts, done) {
  const { client, ...options } = opts;
  if (!client) {
    done(new Error('idemcoord: fastifyPlugin needs { client }'));
    return;
  }
  let o;
  try {
    o = normalizeOptions(client, options);
  } catch (err) {
    done(err);
    return;
  }
  const guard = new Guard(client, o);
  fastify.addHook('preParsing', async (request, reply, payload) => {
    if (!o.methods.has(request.raw.method) || (request.headers['idempotency-key'] == null && !o.key)) {
      return payload;
    }
    let body;
    try {
      body = await readBody(payload, o.maxBodyBytes);
    } catch (err) {
      // Answered 413 (or 400) in preHandler; the parsers see no body.
      request.idempotencyBodyError = err;
      const empty = Readable.from([]);
      empty.receivedEncodedLength = Number(request.headers['content-length'] ?? 0);
      return empty;
    }
    request.raw.rawBody = body;
    const stream = Readable.from(body.length > 0 ? [body] : []);
    stream.receivedEncodedLength = body.length;
    return stream;
  });
  fastify.addHook('preHandler', (request, reply, next) => {
    const req = request.raw;
    const res = reply.raw;
    const signal = disconnectSignal(req, res);
    if (request.idempotencyBodyError instanceof HttpError) {
      const e = request.idempotencyBodyError;
      reply.hijack();
      guard.problem(res, e.status, e.type, e.title, e.detail);
      return;
    }
    guard.begin(req, res, req.rawBody ?? (o.methods.has(req.method) ? Buffer.alloc(0) : null), signal).then((g) => {
      if (g.pass) {
        next();
        return undefined;
      }
      if (g.answered) {
        reply.hijack(); // answered on reply.raw already
        return undefined;
      }
      return guard.run(req, res, g.acquired, g.breq, g.told, signal, (attempt) => {
        request.idempotency = attempt;
        next();
      });
    }).catch((err) => next(err));
  });
  done();
}
fastifyPlugin[Symbol.for('skip-override')] = true;
fastifyPlugin[Symbol.for('fastify.display-name')] = 'idemcoord';

module.exports = {
  httpMiddleware,
  fastifyPlugin,
  parseIdempotencyKey,
  foldPrincipal,
  httpFingerprint,
  httpOperationScope,
  errorReason: api.errorReason,
  HTTP_SCHEMA_VERSION,
  DEFAULT_HTTP_SCOPE,
  PROBLEMS,
  LeaseLostError,
};
