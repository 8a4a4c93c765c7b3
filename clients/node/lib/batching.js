'use strict';
// Call batching (the Client's callBatching option): concurrent calls share
// Coordinator.Batch RPCs, each keeping its own answer, error, deadline and
// retries. The same rules as the Go client's clients.WithCallBatching
// (clients/batching.go).

const grpc = require('@grpc/grpc-js');
const protobuf = require('protobufjs');
const api = require('./api');
const { RELEASE_TIMEOUT_MS } = require('./tables');

const S = grpc.status;
const service = api.CoordinatorClient.service;
const deserializeBatch = api.responseDeserializer('idempotency.v1.BatchResponse');

/** The field of idempotency.v1.BatchCall (and BatchResult) that carries each method's request (answer). */
const CALL_FIELDS = { Begin: 1, Complete: 2, Fail: 3, Lookup: 4, Heartbeat: 5 };
/** BatchCall.timeout's field number. */
const TIMEOUT_FIELD = 10;
/** The most calls one Batch RPC carries (the coordinator takes up to 256). */
const MAX_CALLS = 128;
/** The largest encoded request that goes into a batch; a larger one goes as its own unary call. */
const MAX_CALL_BYTES = 64 << 10;
/** The most request bytes of one Batch RPC, well under gRPC's default 4 MiB message limit. */
const MAX_BATCH_BYTES = 2 << 20;
/**
 * The receive limit the channel of a batching Client gets unless its
 * channelOptions set one: a Batch's answer carries the stored responses
 * of its replays.
 */
const MAX_ANSWER_BYTES = 64 << 20;

/** An error shaped as grpc-js shapes a failed call's: code, details, metadata (with the status's details when it has some). */
function statusError(code, details, statusBytes) {
  const metadata = new grpc.Metadata();
  if (statusBytes) {
    metadata.set('grpc-status-details-bin', statusBytes);
  }
  return Object.assign(new Error(`${code} ${S[code]}: ${details}`), { code, details, metadata });
}

/** The error a BatchResult's google.rpc.Status stands for, as the unary call would have failed. */
function resultError(st) {
  const code = Number(st.code) || S.UNKNOWN;
  const details = st.details?.length ? api.encodeStatus(st) : null;
  return statusError(code, st.message ?? '', details);
}

/** A BatchRequest's bytes: each call's request, already encoded, with its timeout when it has one. */
function encodeBatch(batch, now) {
  const w = protobuf.Writer.create();
  for (const it of batch) {
    w.uint32((1 << 3) | 2).fork();
    w.uint32((CALL_FIELDS[it.method] << 3) | 2).bytes(it.bytes);
    if (Number.isFinite(it.deadline)) {
      const ms = Math.max(it.deadline - now, 1);
      const seconds = Math.floor(ms / 1000);
      const nanos = Math.round((ms - seconds * 1000) * 1e6);
      w.uint32((TIMEOUT_FIELD << 3) | 2).fork();
      if (seconds > 0) {
        w.uint32(8).int64(seconds);
      }
      if (nanos > 0) {
        w.uint32(16).int32(nanos);
      }
      w.ldelim();
    }
    w.ldelim();
  }
  return Buffer.from(w.finish());
}

/**
 * Whether a batched call's result asks for it to be made alone: a call
 * that changed nothing (a Lookup, or a Begin, which did not acquire since
 * it failed) answered RESOURCE_EXHAUSTED. The coordinator refuses a batched
 * call whose answer would not fit in the Batch's (a replay of a large
 * response, say); repeating it alone is safe (a Begin keeps its
 * attempt_id). A call the rate limit refused is repeated too, and answers
 * as the rate limit decides then.
 */
function tooLargeToBatch(it, result) {
  return Number(result.error?.code) === S.RESOURCE_EXHAUSTED && (it.method === 'Lookup' || it.method === 'Begin');
}

/** Gathers a Client's concurrent calls into Batch RPCs, at most max in flight. */
class Batcher {
  constructor(client, max) {
    this.client = client;
    this.max = max;
    this.queue = [];
    this.inFlight = 0;
    this.unary = false; // set once the coordinator answered UNIMPLEMENTED for Batch
  }

  /**
   * The encoded request when method's call may go into a batch, else null:
   * a Begin that waits, a request larger than 64 KiB, and every call once
   * the coordinator has no Batch go unary.
   */
  encode(method, request) {
    if (this.unary || !(method in CALL_FIELDS) || (method === 'Begin' && api.millis(request.wait) > 0)) {
      return null;
    }
    const bytes = service[method].requestSerialize(api.requestToWire(request));
    return bytes.length <= MAX_CALL_BYTES ? bytes : null;
  }

  /**
   * Makes one call in a batch; it settles as _invoke's unary call would:
   * with the answer, or with the call's own error, DEADLINE_EXCEEDED at
   * the end of timeoutMs, CANCELLED when signal aborts. A Begin given up
   * after its batch was sent settles once the answer is in (at most
   * RELEASE_TIMEOUT_MS, then the answer is awaited in the background),
   * having released an acquisition the answer carries: the coordinator
   * cannot see that one call of a Batch was given up.
   */
  call(method, request, bytes, signal, timeoutMs) {
    if (this.unary) {
      return this.client._invoke(method, request, signal, timeoutMs);
    }
    return new Promise((resolve, reject) => {
      if (signal?.aborted) {
        reject(signal.reason);
        return;
      }
      const it = { method, request, bytes, size: bytes.length, deadline: Date.now() + timeoutMs };
      it.answered = new Promise((settle) => {
        it.settle = settle;
      });
      let timer;
      let over = false;
      const end = () => {
        over = true;
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
      };
      const giveUp = (err) => {
        if (over) {
          return;
        }
        end();
        if (this._withdraw(it) || method !== 'Begin') {
          reject(err);
          return;
        }
        this._settleGone(it).then(() => reject(err));
      };
      const onAbort = () => giveUp(statusError(S.CANCELLED, 'Cancelled on client'));
      signal?.addEventListener('abort', onAbort, { once: true });
      if (Number.isFinite(it.deadline)) {
        timer = setTimeout(() => giveUp(statusError(S.DEADLINE_EXCEEDED, 'Deadline exceeded')), Math.max(timeoutMs, 0));
      }
      it.answered.then(({ result, err }) => {
        if (over) {
          return;
        }
        end();
        if (err) {
          reject(err);
        } else if (result.error) {
          reject(resultError(result.error));
        } else {
          const answer = result[method.toLowerCase()];
          if (answer) {
            resolve(api.answerFromWire(answer));
          } else {
            reject(statusError(S.INTERNAL, `coordinator answered a Batch call of ${method} with ${Object.keys(result).join(', ') || 'nothing'}`));
          }
        }
      });
      this._enqueue(it);
    });
  }

  /** Takes it out of the queue if it is still there (not sent); reports whether it was. */
  _withdraw(it) {
    const i = this.queue.indexOf(it);
    if (i < 0) {
      return false;
    }
    this.queue.splice(i, 1);
    return true;
  }

  /**
   * Deals with the answer to a Begin whose caller left before it came
   * back: an acquisition it carries is ended with Fail ABANDONED, since
   * nobody will act on it. Waits for the answer for at most
   * RELEASE_TIMEOUT_MS, so that the caller's own release finds the key
   * settled; after that the answer is awaited in the background.
   */
  async _settleGone(it) {
    let timer;
    const late = new Promise((resolve) => {
      timer = setTimeout(() => resolve(null), RELEASE_TIMEOUT_MS);
    });
    const answer = await Promise.race([it.answered, late]);
    clearTimeout(timer);
    if (answer) {
      await this._releaseAnswered(it, answer);
      return;
    }
    this.client._runInBackground(async (bg) => {
      const gone = new Promise((resolve) => bg.addEventListener('abort', () => resolve(null), { once: true }));
      const a = await Promise.race([it.answered, gone]);
      if (a) {
        await this._releaseAnswered(it, a);
      }
    });
  }

  async _releaseAnswered(it, { result, err }) {
    const res = !err && result?.begin;
    if (res?.outcome === 'OUTCOME_ACQUIRED') {
      await this.client._releaseAcquisition(it.request, res.lease_token);
    }
  }

  /** Queues it and, while fewer than max Batch RPCs are in flight, starts one that takes the queue. */
  _enqueue(it) {
    this.queue.push(it);
    if (this.inFlight >= this.max) {
      return;
    }
    this.inFlight++;
    // The queue is taken in a microtask, so that the calls made in the
    // same turn of the event loop go together; nothing waits longer.
    queueMicrotask(() => this._run());
  }

  /** Sends batches until the queue is empty. */
  async _run() {
    for (;;) {
      const batch = this._take();
      if (batch.length === 0) {
        this.inFlight--;
        return;
      }
      try {
        await this._send(batch);
      } catch (err) {
        // Not an RPC's error (those are the calls'): fail the calls
        // rather than leave them waiting.
        for (const it of batch) {
          it.settle({ err });
        }
      }
    }
  }

  /** Removes from the queue the calls of the next Batch RPC: as many as fit the limits, in arrival order. */
  _take() {
    let n = 0;
    let bytes = 0;
    while (n < this.queue.length && n < MAX_CALLS && (n === 0 || bytes + this.queue[n].size <= MAX_BATCH_BYTES)) {
      bytes += this.queue[n].size;
      n++;
    }
    return this.queue.splice(0, n);
  }

  /**
   * Makes one Batch RPC for batch and hands every call its result. The
   * RPC's deadline is the latest of its calls'; each call's own goes as its
   * timeout.
   */
  async _send(batch) {
    if (this.unary) {
      await this._eachUnary(batch);
      return;
    }
    const now = Date.now();
    const deadline = Math.max(...batch.map((it) => it.deadline));
    let resp;
    try {
      resp = await new Promise((resolve, reject) => {
        this.client._rpc.makeUnaryRequest('/idempotency.v1.Coordinator/Batch', (b) => b, deserializeBatch,
          encodeBatch(batch, now), this.client._metadata(), Number.isFinite(deadline) ? { deadline } : {},
          (err, res) => (err ? reject(err) : resolve(res)));
      });
    } catch (err) {
      if (err?.code === S.UNIMPLEMENTED) {
        this.unary = true; // an older coordinator: every call goes unary from now on
        await this._eachUnary(batch);
      } else if (err?.code === S.RESOURCE_EXHAUSTED) {
        // The answer was too large to receive (or the coordinator refused
        // the request's size): ask call by call.
        await this._eachUnary(batch);
      } else {
        for (const it of batch) {
          it.settle({ err });
        }
      }
      return;
    }
    const results = resp?.results ?? [];
    if (results.length !== batch.length) {
      const err = statusError(S.INTERNAL, `coordinator answered ${results.length} results to a Batch of ${batch.length} calls`);
      for (const it of batch) {
        it.settle({ err });
      }
      return;
    }
    const again = [];
    batch.forEach((it, i) => {
      if (tooLargeToBatch(it, results[i])) {
        again.push(it);
      } else {
        it.settle({ result: results[i] });
      }
    });
    await this._eachUnary(again);
  }

  /** Makes each call of batch as its own unary RPC, at once, within its deadline. */
  async _eachUnary(batch) {
    await Promise.all(batch.map(async (it) => {
      try {
        const res = await this.client._invoke(it.method, it.request, undefined, Math.max(it.deadline - Date.now(), 1));
        it.settle({ result: { [it.method.toLowerCase()]: res } });
      } catch (err) {
        it.settle({ err });
      }
    }));
  }
}

module.exports = { Batcher, MAX_ANSWER_BYTES };
