'use strict';
// Faults at the seam between a Client and the coordinator: grpc-js client
// interceptors for the tests (client.test.js, http.test.js).

const grpc = require('@grpc/grpc-js');

/** Resolves when cond() is true, checking every 10 ms. */
async function until(cond) {
  while (!cond()) {
    await new Promise((r) => setTimeout(r, 10));
  }
}

/**
 * An interceptor for the named method (e.g. 'Heartbeat'): it counts calls
 * and their statuses and can, per call, hand the call to the coordinator and
 * replace its answer with UNAVAILABLE (the reply was lost), or fail it with
 * UNAVAILABLE without sending it (the coordinator is cut off).
 *
 * With hold = { call, until, lose }, the call numbered call (1 for the
 * first) reaches the coordinator, but its answer is held back (held is set
 * when it arrives) until the promise until settles; it is then delivered,
 * or with lose replaced by CANCELLED: the caller gave up before the answer
 * reached it. With rewrite (a function of the request), what reaches the
 * coordinator is rewrite(request). With resetAtDeadline, the call is not
 * sent and ends CANCELLED just after its deadline, before grpc-js's own
 * deadline timer: what a server that resets the stream at the deadline it
 * was sent looks like when the reset wins that race.
 */
function fault(method) {
  const f = {
    calls: 0, requests: [], statuses: [], loseReplies: 0, cutOff: false, hold: null, held: false, rewrite: null, resetAtDeadline: false,
    interceptor: (options, nextCall) => {
      if (!options.method_definition.path.endsWith(`/${method}`)) {
        return new grpc.InterceptingCall(nextCall(options));
      }
      f.calls++;
      if (f.resetAtDeadline) {
        return new grpc.InterceptingCall(nextCall(options), {
          start(metadata, listener) {
            const deadline = new Date(options.deadline).getTime();
            setTimeout(() => {
              f.statuses.push(grpc.status.CANCELLED);
              listener.onReceiveStatus({ code: grpc.status.CANCELLED, details: 'Call cancelled', metadata: new grpc.Metadata() });
            }, Math.max(deadline - Date.now(), 0) + 5);
          },
          sendMessage() {},
          halfClose() {},
        });
      }
      if (f.cutOff) {
        return new grpc.InterceptingCall(nextCall(options), {
          start(metadata, listener) {
            setImmediate(() => {
              f.statuses.push(grpc.status.UNAVAILABLE);
              listener.onReceiveStatus({ code: grpc.status.UNAVAILABLE, details: 'cut off (test)', metadata: new grpc.Metadata() });
            });
          },
          sendMessage() {},
          halfClose() {},
        });
      }
      const lose = f.loseReplies > 0;
      if (lose) {
        f.loseReplies--;
      }
      const hold = f.hold?.call === f.calls ? f.hold : null;
      return new grpc.InterceptingCall(nextCall(options), {
        sendMessage(message, next) {
          f.requests.push(message);
          next(f.rewrite ? f.rewrite(message) : message);
        },
        start(metadata, listener, next) {
          next(metadata, {
            // A lost reply: the message is passed on (grpc-js holds the
            // status back until it is) but the status turns UNAVAILABLE,
            // so the caller gets an error and never the answer.
            onReceiveStatus(status, nextStatus) {
              if (hold) {
                f.held = true;
                const inFlight = setInterval(() => {}, 1000); // as a call in flight would, keep the process up
                hold.until.finally(() => {
                  clearInterval(inFlight);
                  f.statuses.push(hold.lose ? grpc.status.CANCELLED : status.code);
                  nextStatus(hold.lose ? { code: grpc.status.CANCELLED, details: 'gave up before the answer arrived (test)', metadata: new grpc.Metadata() } : status);
                });
                return;
              }
              f.statuses.push(lose ? grpc.status.UNAVAILABLE : status.code);
              nextStatus(lose ? { code: grpc.status.UNAVAILABLE, details: 'reply lost (test)', metadata: new grpc.Metadata() } : status);
            },
          });
        },
      });
    },
  };
  return f;
}

module.exports = { fault, until };
