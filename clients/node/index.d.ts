// Type declarations of the idemcoord Node client (index.js).
//
// Messages are plain objects with the proto's field names (snake_case), as
// loaded from idempotency.binpb: enums are their names, bytes are Buffers,
// int64 values are strings, and fields the proto gains later appear too.

import type { ChannelCredentials, Interceptor, ChannelOptions } from '@grpc/grpc-js';

// BEGIN proto enums: generated from idempotency.binpb by `node test/proto-types.js --write`; do not edit.
/** idempotency.v1.State, by value name. */
export type State =
  | 'STATE_UNSPECIFIED'
  | 'STATE_IN_PROGRESS'
  | 'STATE_COMPLETED'
  | 'STATE_FAILED_RETRYABLE'
  | 'STATE_FAILED_REPLAYABLE'
  | 'STATE_EXPIRED'
  | 'STATE_UNKNOWN';
/** idempotency.v1.Outcome, by value name. */
export type Outcome =
  | 'OUTCOME_UNSPECIFIED'
  | 'OUTCOME_ACQUIRED'
  | 'OUTCOME_REPLAY'
  | 'OUTCOME_IN_PROGRESS';
/** idempotency.v1.FailureKind, by value name. */
export type FailureKind =
  | 'FAILURE_KIND_UNSPECIFIED'
  | 'FAILURE_KIND_RETRYABLE'
  | 'FAILURE_KIND_REPLAYABLE'
  | 'FAILURE_KIND_UNKNOWN'
  | 'FAILURE_KIND_ABANDONED';
/** idempotency.v1.Resolution, by value name. */
export type Resolution =
  | 'RESOLUTION_UNSPECIFIED'
  | 'RESOLUTION_COMPLETED'
  | 'RESOLUTION_RETRYABLE';
/** idempotency.v1.ErrorReason, by value name. */
export type ErrorReason =
  | 'ERROR_REASON_UNSPECIFIED'
  | 'ERROR_REASON_FINGERPRINT_MISMATCH'
  | 'ERROR_REASON_LEASE_LOST'
  | 'ERROR_REASON_SCHEMA_VERSION_NOT_ACCEPTED'
  | 'ERROR_REASON_KEY_EXPIRED'
  | 'ERROR_REASON_ALREADY_FINISHED'
  | 'ERROR_REASON_ATTEMPTS_EXHAUSTED'
  | 'ERROR_REASON_RESPONSE_TOO_LARGE'
  | 'ERROR_REASON_NOT_UNKNOWN'
  | 'ERROR_REASON_RECORD_UNREADABLE'
  | 'ERROR_REASON_UNKNOWN_HELD'
  | 'ERROR_REASON_KEY_FORMAT'
  | 'ERROR_REASON_CHECKPOINT_RECORDED';
/** An ErrorInfo reason as sent on the wire: an idempotency.v1.ErrorReason name without its ERROR_REASON_ prefix. */
export type ErrorReasonName =
  | 'FINGERPRINT_MISMATCH'
  | 'LEASE_LOST'
  | 'SCHEMA_VERSION_NOT_ACCEPTED'
  | 'KEY_EXPIRED'
  | 'ALREADY_FINISHED'
  | 'ATTEMPTS_EXHAUSTED'
  | 'RESPONSE_TOO_LARGE'
  | 'NOT_UNKNOWN'
  | 'RECORD_UNREADABLE'
  | 'UNKNOWN_HELD'
  | 'KEY_FORMAT'
  | 'CHECKPOINT_RECORDED';
// END proto enums

/** google.protobuf.Duration and Timestamp as decoded. */
export interface Duration { seconds: string | number; nanos?: number }
export type Timestamp = Duration;
/** A duration in a request: milliseconds, or a Duration. */
export type DurationInput = number | Duration | null;
export type Bytes = Buffer | Uint8Array | string;

/** What is stored and replayed byte for byte; every field optional. */
export interface StoredResponse {
  schema_version?: string;
  content_type?: string;
  body?: Buffer | Uint8Array;
  status_code?: number;
  metadata?: Record<string, string>;
}

export interface StoredResponseOut {
  schema_version: string;
  content_type: string;
  body: Buffer;
  status_code: number;
  metadata: Record<string, string>;
}

export interface RecordMessage {
  scope: string;
  key: string;
  state: State;
  fingerprint: Buffer;
  attempt: number;
  generation: number;
  response: StoredResponseOut | null;
  failure_reason: string;
  created_at: Timestamp | null;
  updated_at: Timestamp | null;
  lease_expires_at: Timestamp | null;
  expires_at: Timestamp | null;
  /** Sticky uncertainty (docs/design.md), present once the proto has it. */
  uncertain?: boolean;
  /** The generation's last recovery point (see checkpoint), or null. */
  checkpoint?: CheckpointMessage | null;
  [field: string]: unknown;
}

/** idempotency.v1.Checkpoint as decoded: a recovery point of a record's generation. */
export interface CheckpointMessage {
  phase: string;
  data: Buffer;
  /** Set by the coordinator. */
  at: Timestamp | null;
}

export interface BeginRequest {
  scope: string;
  key: string;
  fingerprint?: Bytes | null;
  ttl?: DurationInput;
  lease?: DurationInput;
  wait?: DurationInput;
  accept_schema_versions?: string[];
  /** Default: a fresh random id, the same on every retry of this call. */
  attempt_id?: string;
}
export interface BeginResponse {
  outcome: Outcome;
  record: RecordMessage | null;
  lease_token: string;
  retry_after: Duration | null;
  previous_state: State;
}
export interface CompleteRequest { scope: string; key: string; lease_token: string; response?: StoredResponse | null }
export interface FailRequest {
  scope: string;
  key: string;
  lease_token: string;
  kind: FailureKind;
  response?: StoredResponse | null;
  reason?: string;
}
export interface LookupRequest { scope: string; key: string }
export interface HeartbeatRequest {
  scope: string;
  key: string;
  lease_token: string;
  lease?: DurationInput;
  /** A recovery point: the step phase (1-128 printable bytes) is done, with data (at most 64 KiB by default). */
  checkpoint?: { phase: string; data?: Bytes | null } | null;
}
export interface RecordAnswer { record: RecordMessage | null }

export interface TlsOptions { rootCerts?: Buffer | null; privateKey?: Buffer | null; certChain?: Buffer | null }

export interface Logger {
  debug?(msg: string, fields?: object): void;
  warn?(msg: string, fields?: object): void;
  error?(msg: string, fields?: object): void;
}

export interface ClientOptions {
  /** Bearer token, sent as `authorization: Bearer <token>`. */
  token?: string;
  /** false (default): plaintext; true: TLS with the system roots; or files, or credentials. */
  tls?: boolean | TlsOptions | ChannelCredentials;
  /** Tries per call while the coordinator answers UNAVAILABLE (default 5). */
  maxAttempts?: number;
  /** First backoff between tries, doubled up to maxBackoffMs (defaults 100 and 2000). */
  backoffMs?: number;
  maxBackoffMs?: number;
  /** Deadline of one try (default 10000; a begin adds its wait). */
  timeoutMs?: number;
  /** The lease once asks for (default: the coordinator's policy). */
  leaseMs?: number;
  channelOptions?: ChannelOptions;
  interceptors?: Interceptor[];
  logger?: Logger;
  /**
   * Concurrent calls share RPCs: begin (without a wait), complete, fail, lookup and heartbeat go to
   * the coordinator's Batch method, at most this many Batch RPCs in flight (2 is a good value; 0, the
   * default, sends every call as its own RPC). Nothing waits for a batch to fill: the calls made while
   * all are in flight go together in the next one. Each call keeps its own answer or error (the same
   * codes and details as alone), its timeoutMs (sent as the call's timeout), signal and retries. A
   * request over 64 KiB and a begin that waits go alone, and every call does once the coordinator
   * answers that it has no Batch (an older version). interceptors see Batch RPCs. A begin given up
   * after its batch was sent settles once the answer is in (at most 3 s, then it is awaited in the
   * background), having released what it acquired.
   */
  callBatching?: number;
}

export interface CallOptions { signal?: AbortSignal; timeoutMs?: number }

/** The acquisition a function run by once holds: enough to fence its own writes. */
export interface Lease {
  readonly scope: string;
  /** The key as stored. */
  readonly key: string;
  /** The fencing token. */
  readonly token: string;
  readonly generation: number;
  readonly attempt: number;
  /** STATE_UNKNOWN: an earlier attempt may have done the side effect; check first. */
  readonly previous: State;
  readonly uncertain: boolean;
}

/** What fn receives. */
export interface Attempt {
  /** Aborted when the caller's signal aborts, the lease is lost (LeaseLostError) or cannot be confirmed (LeaseUnconfirmedError). */
  readonly signal: AbortSignal;
  readonly lease: Lease;
  /** See markSideEffect. */
  markSideEffect(): void;
  /** See checkpoint. */
  checkpoint(phase: string, data?: Bytes | null): Promise<void>;
  /** See checkpointFrom. */
  checkpointFrom(): Checkpoint | null;
}

/** A recovery point as an attempt reads it (checkpointFrom). */
export interface Checkpoint {
  readonly phase: string;
  /** A copy. */
  readonly data: Buffer;
  /** When the coordinator recorded it; null for one this attempt recorded whose answer did not say. */
  readonly at: Timestamp | null;
}

export interface Result {
  /** fn's response when this call ran it, else the stored one. */
  response: StoredResponseOut | StoredResponse;
  /** fn did not run in this call. */
  replayed: boolean;
  state: State;
  /** The attempt that produced response. */
  attempt: number;
}

export interface OnceOptions {
  /**
   * The caller giving up. Before fn starts (during Begin, or while waiting
   * for another holder) once then rejects with signal.reason, fn does not
   * run, and an acquisition the coordinator may already have made for this
   * call is released first; once fn runs, fn's signal aborts with it.
   */
  signal?: AbortSignal;
}

export class Client {
  constructor(address: string, options?: ClientOptions);
  begin(request: BeginRequest, opts?: CallOptions): Promise<BeginResponse>;
  complete(request: CompleteRequest, opts?: CallOptions): Promise<RecordAnswer>;
  fail(request: FailRequest, opts?: CallOptions): Promise<RecordAnswer>;
  lookup(request: LookupRequest, opts?: CallOptions): Promise<RecordAnswer>;
  heartbeat(request: HeartbeatRequest, opts?: CallOptions): Promise<RecordAnswer>;
  /**
   * Runs fn at most once per (scope, key) and resolves with the recorded
   * outcome. A replayable failure rejects with StoredFailureError, a lost
   * lease with LeaseLostError, a key held UNKNOWN with UnknownHeldError;
   * other failures of fn reject with fn's error after it was recorded.
   *
   * When once will not run fn although it sent Begin (opts.signal aborted
   * before fn started, or Begin failed without an answer: UNAVAILABLE after
   * the retries, DEADLINE_EXCEEDED, CANCELLED), it first releases what that
   * Begin may have acquired, within a few seconds of its own (Fail
   * FAILURE_KIND_ABANDONED, reason 'caller gave up before the handler ran'),
   * so the key is as if this call never was and a retry acquires at once.
   * A release that fails is logged, not thrown; the key is then held until
   * its lease runs out.
   */
  once(
    scope: string, key: string, fingerprint: Bytes | null | undefined,
    fn: (attempt: Attempt) => StoredResponse | null | undefined | Promise<StoredResponse | null | undefined>,
    opts?: OnceOptions,
  ): Promise<Result>;
  /** Waits for background completions (at most timeoutMs), then closes. */
  shutdown(opts?: { timeoutMs?: number }): Promise<void>;
  close(): void;
}

/** The deterministic key: same result as Go's clients.DedupKey and Python's idemcoord.dedup_key. */
export function dedupKey(intent: string, userId: string, projectId: string | null | undefined, projectName: string | null | undefined): string;
/** NFC, U+FEFF removed, White_Space trimmed, full lower-case mapping, White_Space runs folded. */
export function normalizeName(name: string | null | undefined): string;
/** Inside fn: the irreversible step starts now; any later error ends the attempt UNKNOWN. No-op outside. */
export function markSideEffect(): void;
/** Inside fn: its lease; null outside. */
export function currentLease(): Lease | null;
/**
 * Inside fn (once, the HTTP middlewares' handlers, the gRPC interceptor's handlers): records that the step
 * phase is done, with data the next attempt needs to resume after it (a Heartbeat with the lease token).
 * Rejects with LeaseLostError when another attempt took the key over, and outside an attempt.
 * An attempt that recorded one is never ended ABANDONED (RETRYABLE instead, which keeps it).
 */
export function checkpoint(phase: string, data?: Bytes | null): Promise<void>;
/** Inside fn: the attempt's last checkpoint, else the one it resumes after (an earlier attempt's); null when none or outside. */
export function checkpointFrom(): Checkpoint | null;

/** Every ErrorInfo reason of domain idempotency.v1 (the enum ErrorReason without its prefix), keyed by itself. */
export const REASONS: Readonly<{ [R in ErrorReasonName]: R }>;
export const REASON_UNKNOWN_HELD: 'UNKNOWN_HELD';
export const SCHEMA_VERSION_STATUS: 'google.rpc.Status';
export const CONTENT_TYPE_PROTO: 'application/x-protobuf';

/**
 * The reasons an attempt's signal is aborted with carry status and statusCode 503: a handler that
 * gives up by throwing its signal's reason is answered 503 by Express's and Fastify's error handlers,
 * which the HTTP middleware records as nothing done (RETRYABLE; UNKNOWN after markSideEffect).
 */
export class LeaseLostError extends Error { status: 503; statusCode: 503 }
export class LeaseUnconfirmedError extends Error { status: 503; statusCode: 503 }
/** The client of a guarded HTTP request went away before its answer was sent (req.idempotency.signal's reason). */
export class ClientGoneError extends Error { status: 503; statusCode: 503 }
export class UnknownHeldError extends Error {
  code: number;
  reason: 'UNKNOWN_HELD';
}
export class FailureError extends Error {
  constructor(kind: FailureKind, opts?: { response?: StoredResponse | null; cause?: unknown; code?: number; message?: string });
  kind: FailureKind;
  response: StoredResponse | null;
  code?: number;
}
export class StoredFailureError extends Error {
  code: number;
  details: string;
  result: Result;
}

// --- HTTP middleware (Express 5 / Connect, Fastify), clients/http.go's semantics ---

import type { IncomingMessage, ServerResponse } from 'node:http';

/** Options of httpMiddleware and fastifyPlugin; each as Go's WithHTTP… option. */
export interface HttpMiddlewareOptions {
  /** How long a request whose key another request holds waits for its result before 409 + Retry-After (default 5000 ms; 0 answers at once). */
  waitMs?: number;
  /** A guarded request without Idempotency-Key answers 400 (problem idempotency-key-missing) instead of running unprotected. */
  requireKey?: boolean;
  /** Run the handler unprotected when the coordinator cannot be reached (default: 503). */
  failOpen?: boolean;
  /**
   * The end user a request acts for, folded into its key (foldPrincipal); a throw answers 400. Whom a
   * key belongs to is a decision: built with neither principal nor withoutPrincipal, the middleware
   * warns (the Client's logger, else process.emitWarning, code IDEMCOORD_UNDECIDED_PRINCIPAL).
   */
  principal?: (req: IncomingMessage) => string | Promise<string>;
  /** Keys are not per end user, on purpose: every request with the same key shares one record. Silences the warning. */
  withoutPrincipal?: boolean;
  /** Guarded methods (default POST and PATCH); others pass through. */
  methods?: string[];
  /**
   * The key of a request that sends no Idempotency-Key header, from the request and its whole body
   * (a field of the payload, say); a header key always wins. The key is used as a header's would be:
   * checked (1-255 bytes of UTF-8, no control characters; else 400 idempotency-key-invalid), echoed in
   * Idempotency-Key, folded with principal. Nothing (undefined, null, '') means no key: the request
   * runs unprotected, or answers 400 with requireKey. A throw answers 400 idempotency-key-invalid and
   * runs nothing. With key set, the body of every guarded request is read (up to maxBodyBytes) first.
   */
  key?: (req: IncomingMessage, body: Buffer) => string | null | undefined | Promise<string | null | undefined>;
  /** The request's fingerprint (default httpFingerprint: method, path with query, body); a throw answers 400. */
  fingerprint?: (req: IncomingMessage, body: Buffer) => Bytes | null | Promise<Bytes | null>;
  /** Response headers stored and replayed besides Content-Type and Location. */
  replayHeaders?: string[];
  /** 4xx statuses stored and replayed like a success (default 404, 409, 422). */
  replayableStatuses?: number[];
  /**
   * One scope for all the records, in place of the default: the operation, method and path
   * ('POST /orders', see httpOperationScope), prefixed by service. scope: DEFAULT_HTTP_SCOPE ('http')
   * keeps the scope of earlier versions.
   */
  scope?: string;
  /**
   * Names the service: the default scope 'POST /orders' becomes 'payments POST /orders', so services
   * that share a coordinator and a tenant never share records. Built with neither service nor scope,
   * the middleware warns (the Client's logger, else process.emitWarning, code IDEMCOORD_UNNAMED_SERVICE).
   */
  service?: string;
  /** Largest body of a request with a key (default 10 MiB); larger answers 413. */
  maxBodyBytes?: number;
  /** Status of a key reused with another request: 422 (default) or 409; any other value throws a RangeError. */
  mismatchStatus?: number;
  /**
   * How long a handler whose client went away may take to end its answer (default 60000 ms). The
   * lease is kept (heartbeats go on) meanwhile and the answer recorded when it ends; after that the
   * lease is left to run out (the record reads UNKNOWN), and an answer that comes later is still
   * recorded unless another attempt took the key over.
   */
  lingerMs?: number;
  /** May refresh per-request fields of a replay; the stored record never changes. */
  onReplay?: (req: IncomingMessage, stored: StoredResponseOut) => StoredResponseOut | null | undefined;
}

/** What a guarded handler finds as req.idempotency (Express) or request.idempotency (Fastify). */
export type IdempotencyAttempt = Attempt;

declare module 'node:http' {
  interface IncomingMessage {
    /** The attempt a guarded handler runs in (httpMiddleware, fastifyPlugin). */
    idempotency?: Attempt;
    /** The raw body the middleware read to fingerprint the request. */
    rawBody?: Buffer;
  }
}

/** Connect/Express 5 middleware: install it before body parsers, after authentication. */
export function httpMiddleware(client: Client, options?: HttpMiddlewareOptions):
  (req: IncomingMessage, res: ServerResponse, next: (err?: unknown) => void) => void;

/** Fastify plugin: `app.register(fastifyPlugin, { client, ...options })`. */
export function fastifyPlugin(
  fastify: { addHook: (...args: any[]) => unknown },
  options: HttpMiddlewareOptions & { client: Client },
  done: (err?: Error) => void,
): void;

/** The key of an Idempotency-Key header value (bare or a structured-field string); throws when invalid. */
export function parseIdempotencyKey(value: string): string;
/** base64url(SHA-256(principal)) ":" key: the key stored for an end user's key, as Go's FoldPrincipal. */
export function foldPrincipal(principal: string, key: string): string;
/** SHA-256 of method, "\n", path with query, "\n", body: the default fingerprint, as Go's HTTPFingerprint. */
export function httpFingerprint(method: string, url: string, body: Buffer): Buffer;
/**
 * The default scope of a request, as Go's HTTPOperationScope: "[service ]METHOD /path" (the path as
 * sent, without the query); longer than 255 bytes, its first 190 bytes, "~" and the base64url SHA-256 of the whole.
 */
export function httpOperationScope(service: string, method: string, path: string): string;
export const HTTP_SCHEMA_VERSION: 'idemcoord.http/1';
/** The one scope of every record before the default became the operation; `scope: DEFAULT_HTTP_SCOPE` keeps it. */
export const DEFAULT_HTTP_SCOPE: 'http';
/** Problem types of the answers the middleware writes itself (the same in every language). */
export const PROBLEMS: Readonly<Record<
  'keyMissing' | 'keyInvalid' | 'keyReused' | 'keyExpired' | 'attemptsExhausted' | 'inProgress' |
  'outcomeUnknown' | 'bodyTooLarge' | 'unavailable' | 'leaseLost' | 'internal', string>>;

// --- gRPC server interceptor (@grpc/grpc-js >= 1.10), clients/interceptor.go's semantics ---

import type { ServerInterceptor, ServiceDefinition, Metadata } from '@grpc/grpc-js';

/** Options of serverInterceptor; each as Go's InterceptorOption of the same name. */
export interface ServerInterceptorOptions {
  /**
   * Descriptors of the server's services (optional): a method marked NO_SIDE_EFFECTS is left unguarded, the
   * output message's full name is the schema version, and the request is re-encoded for the fingerprint.
   * Without them every unary method is guarded, stored and replayed with the call's own codec.
   */
  services?: ServiceDefinition[];
  /** Only these full method names ('/pkg.Service/Method'), or those the function accepts; default every unary method not marked NO_SIDE_EFFECTS. */
  methods?: string[] | ((fullMethod: string) => boolean);
  /** The key of a call (default: its idempotency-key metadata); '' for none. */
  key?: (metadata: Metadata, request: unknown) => string | Promise<string>;
  /** The end user a call acts for, folded into its key (foldPrincipal); with neither this nor withoutPrincipal, it warns as httpMiddleware does. */
  principal?: (metadata: Metadata) => string | Promise<string>;
  /** Keys are not per end user, on purpose; silences the warning. */
  withoutPrincipal?: boolean;
  /** The request's fingerprint (default SHA-256 of the method, "\n" and the request's encoding). */
  fingerprint?: (metadata: Metadata, request: unknown) => Bytes | null | Promise<Bytes | null>;
  /** A call without a key fails INVALID_ARGUMENT instead of running unprotected. */
  requireKey?: boolean;
  /** Wait up to this long (and within the call's deadline) for a running attempt's result; default 0: ABORTED at once. */
  waitMs?: number;
  /** Run the handler unprotected when the coordinator cannot be reached (default UNAVAILABLE). */
  failOpen?: boolean;
  /** Scope of a method's records (default its full name). */
  scope?: (fullMethod: string) => string;
  /** Schema versions of stored responses by full method name (default the output message's full name). */
  schemaVersions?: Record<string, string>;
  /** Metadata keys stored and replayed (default every key but idemcoord's and gRPC's own). */
  replayMetadata?: string[];
  /** How handler errors are recorded, by gRPC code (default the table of docs/go.md, from shared_tables.json). */
  failureKinds?: Record<number, FailureKind>;
}

/** A grpc-js server interceptor: `new grpc.Server({ interceptors: [serverInterceptor(client, { principal })] })`. */
export function serverInterceptor(client: Client, options?: ServerInterceptorOptions): ServerInterceptor;

/**
 * A grpc-js client interceptor (a client's `interceptors` option) that gives every call without
 * idempotency-key metadata a new UUIDv4 key, the same on every retry attempt grpc-js makes of it.
 */
export function clientInterceptor(): Interceptor;

/**
 * Gives a fetch request (a Headers, a Request, or a RequestInit, whose headers become a Headers) an
 * Idempotency-Key header when it has none, a UUIDv4 as a structured-field string, and returns the key it
 * carries. Call it once per operation, before the retry loop.
 */
export function stampIdempotencyKey(target: Headers | Request | { headers?: HeadersInit }): string;
