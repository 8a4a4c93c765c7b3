// Type-checked (not run) by `npm test`: the declarations describe a real use.
import { Client, dedupKey, markSideEffect, currentLease, FailureError, StoredFailureError, Result } from '../..';

async function charge(client: Client, user: string, name: string): Promise<Buffer | undefined> {
  const key = dedupKey('create-project', user, null, name);
  try {
    const res: Result = await client.once('projects.create', key, Buffer.from(name), async (attempt) => {
      if (attempt.lease.previous === 'STATE_UNKNOWN') {
        // check the outside world first
      }
      attempt.signal.throwIfAborted();
      markSideEffect();
      const lease = currentLease();
      return { body: Buffer.from(`created by ${lease?.token}`), metadata: { 'x-id': '1' }, status_code: 201 };
    }, { signal: AbortSignal.timeout(5000) });
    return Buffer.from(res.response.body ?? []);
  } catch (err) {
    if (err instanceof StoredFailureError) {
      return err.result.response.body ? Buffer.from(err.result.response.body) : undefined;
    }
    throw new FailureError('FAILURE_KIND_RETRYABLE', { cause: err });
  }
}

const client = new Client('127.0.0.1:50051', { token: 'secret', tls: false, leaseMs: 30000 });
void charge(client, 'u1', 'Flower Shop');
void client.begin({ scope: 's', key: 'k', lease: 5000, wait: { seconds: 1 } }).then((r) => r.record?.uncertain);
const batching = new Client('127.0.0.1:50051', { callBatching: 2, interceptors: [], logger: console });
void batching.lookup({ scope: 's', key: 'k' }, { timeoutMs: 500 });

// The HTTP middleware, as an Express app and a Fastify app install it.
import { httpMiddleware, fastifyPlugin, foldPrincipal, PROBLEMS, HttpMiddlewareOptions } from '../..';
import * as http from 'node:http';

const opts: HttpMiddlewareOptions = {
  waitMs: 2000, requireKey: true, methods: ['POST'], replayHeaders: ['X-Request-Id'], replayableStatuses: [404],
  principal: (req) => String(req.headers['x-user'] ?? ''), maxBodyBytes: 1 << 20, mismatchStatus: 409,
  onReplay: (_req, stored) => stored,
};
const mw = httpMiddleware(client, opts);
http.createServer((req, res) => mw(req, res, () => {
  req.idempotency?.markSideEffect();
  res.end(`${req.idempotency?.lease.attempt} ${req.rawBody?.length} ${foldPrincipal('u', 'k')} ${PROBLEMS.leaseLost}`);
}));
const fastifyLike = { addHook: (..._args: unknown[]) => undefined };
fastifyPlugin(fastifyLike, { client, waitMs: 0, withoutPrincipal: true, lingerMs: 30000 }, () => {});
// The key from the payload, when no Idempotency-Key header is sent (a Promise works too).
const keyed: HttpMiddlewareOptions = {
  withoutPrincipal: true,
  key: (_req, body) => {
    const id: unknown = JSON.parse(body.toString()).order_id;
    return typeof id === 'string' ? id : undefined;
  },
};
httpMiddleware(client, keyed);
fastifyPlugin(fastifyLike, { client, key: async () => null }, () => {});

// The gRPC server interceptor, as a grpc-js server installs it.
import { serverInterceptor } from '../..';
import * as grpc from '@grpc/grpc-js';

declare const service: grpc.ServiceDefinition;
const server = new grpc.Server({
  interceptors: [serverInterceptor(client, { services: [service], waitMs: 1000, requireKey: true, methods: ['/pkg.S/M'] })],
});
void server;

// The calling side.
import { clientInterceptor, stampIdempotencyKey } from '../..';
const callerInterceptors = [clientInterceptor()];
const stampInit: RequestInit = { method: 'POST' };
const stampedKey: string = stampIdempotencyKey(stampInit);
void callerInterceptors;
void stampedKey;

// Recovery points: resume a multi-step operation after the last finished step.
import { checkpoint, checkpointFrom, Checkpoint } from '../..';

async function provision(client: Client, order: string): Promise<string> {
  const res = await client.once('orders.provision', order, null, async (attempt) => {
    const from: Checkpoint | null = attempt.checkpointFrom() ?? checkpointFrom();
    let charge = from?.phase === 'charged' ? from.data.toString() : '';
    if (!charge) {
      charge = 'ch_1';
      await checkpoint('charged', Buffer.from(charge));
    }
    await attempt.checkpoint('provisioned', 'm_1');
    return { body: Buffer.from(charge) };
  });
  const rec = (await client.lookup({ scope: 'orders.provision', key: order })).record;
  void rec?.checkpoint?.at;
  void client.heartbeat({ scope: 's', key: 'k', lease_token: 't', checkpoint: { phase: 'p', data: 'd' } });
  return Buffer.from(res.response.body ?? []).toString();
}
void provision(client, 'order-1');
