"""ASGI middleware (Starlette, FastAPI) with the semantics of Go's clients.HTTPMiddleware.

    app.add_middleware(idemcoord.asgi.IdempotencyMiddleware, client=client)

A guarded request (POST and PATCH unless methods=...) with an
Idempotency-Key runs the app at most once per key across every service that
shares the coordinator: the first answer is stored (2xx, 3xx, and 404, 409,
422 by default) and replayed byte for byte with "Idempotency-Result:
replayed"; a duplicate waits for the first (wait, default 5 s) and then
answers 409 with Retry-After; a key reused with another request answers
422; 503 when the coordinator cannot be reached (fail_open=True runs the app
unprotected). The app reads the attempt with idemcoord.current_lease() and
calls idemcoord.mark_side_effect() before its first irreversible step, as
in once. docs/python.md has the whole table; the options are
idemcoord._http.Options'.

A client that goes away never strands a key: while Begin is in flight or
waiting, the acquisition is released (Fail ABANDONED); an app that returns
without answering after its client left is recorded FAILURE_KIND_RETRYABLE
(UNKNOWN after mark_side_effect), never a 200. The app learns that its
client left as ASGI says: receive() answers http.disconnect.
"""

import asyncio
import concurrent.futures
import inspect
import threading

import grpc

from . import _api, _http
from .client import Attempt, _answer_lost, _current, _Holder


async def _maybe_await(v):
    return await v if inspect.isawaitable(v) else v


def _target(scope):
    path = scope.get("raw_path") or scope["path"].encode("utf-8")
    qs = scope.get("query_string") or b""
    return (path + (b"?" + qs if qs else b"")).decode("latin-1")


async def _send_problem(send, p, echo):
    body = p.body()
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in p.header_list(body)] + echo
    await send({"type": "http.response.start", "status": p.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class IdempotencyMiddleware:
    """Makes an ASGI app idempotent through client (an idemcoord.Client).

    threads bounds the threads the client's blocking calls run on (a
    waiting duplicate holds one while it waits). Options (keywords, each as
    Go's WithHTTP… option): wait (seconds),
    require_key, fail_open, principal (a function of the ASGI scope, may be
    async), methods, fingerprint (a function of scope and body), replay_headers,
    replayable_statuses, scope, max_body_bytes, mismatch_status, on_replay
    (a function of scope and the StoredResponse).
    """

    def __init__(self, app, client, *, threads=64, **options):
        self.app = app
        self.client = client
        self.o = _http.Options(**options)
        if self.o.undecided_principal:
            _http.warn_undecided_principal("idemcoord.asgi.IdempotencyMiddleware")
        # The client's calls block (a waiting Begin for up to wait): they run
        # on threads of their own, so waiting duplicates never starve the
        # calls that end the attempt they wait for.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="idemcoord-asgi")

    def _thread(self, f, *args, **kwargs):
        return asyncio.get_running_loop().run_in_executor(self._pool, lambda: f(*args, **kwargs))

    async def __call__(self, scope, receive, send):
        o = self.o
        if scope["type"] != "http" or scope["method"] not in o.methods:
            await self.app(scope, receive, send)
            return
        try:
            raw, key = _http.key_of(o, scope["headers"])
        except _http.Problem as p:
            await _send_problem(send, p, [])
            return
        if key is None:
            await self.app(scope, receive, send)
            return
        echo = [(b"idempotency-key", raw)]
        try:
            if o.principal is not None:
                try:
                    key = _http.fold_principal(await _maybe_await(o.principal(scope)), key)
                except Exception as err:
                    raise _http.Problem(400, "about:blank", "Bad Request", "idempotency principal: %s" % err)
            body = bytearray()
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return  # the client went away before anything was sent
                body += msg.get("body", b"")
                if len(body) > o.max_body_bytes:
                    raise _http.too_large(o)
                if not msg.get("more_body", False):
                    break
            body = bytes(body)
            try:
                if o.fingerprint is not None:
                    fp = await _maybe_await(o.fingerprint(scope, body))
                else:
                    fp = _http.http_fingerprint(scope["method"], _target(scope), body)
            except Exception as err:
                raise _http.Problem(400, "about:blank", "Bad Request", "idempotency fingerprint: %s" % err)
        except _http.Problem as p:
            await _send_problem(send, p, echo)
            return

        gone = asyncio.Event()
        cancel_event = threading.Event()  # the client went away, for the client's calls

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel_event.set()
            gone.set()
        watcher = asyncio.ensure_future(watch())
        try:
            await self._guarded(scope, send, key, body, fp, echo, gone, cancel_event)
        finally:
            watcher.cancel()

    async def _guarded(self, scope, send, key, body, fp, echo, gone, cancel_event):
        o, c = self.o, self.client
        breq = _http.begin_request(c, o, key, fp)
        try:
            res, sent = await self._thread(c._begin_waiting, breq, None, cancel_event, _http.wait_until(o))
        except (grpc.RpcError, concurrent.futures.CancelledError) as err:
            if cancel_event.is_set():
                await self._thread(c._release, breq)  # the client has gone: nobody will act on it
                return
            if _answer_lost(err):
                threading.Thread(target=c._release, args=(breq,), daemon=True).start()
            p = _http.begin_failed(c, o, err)
            if p is None:
                await self.app(scope, _replaying(body, gone), send)
            else:
                await _send_problem(send, p, echo)
            return
        if res.outcome == _api.Outcome.OUTCOME_REPLAY:
            status, headers, stored = _http.replay_answer(o, scope, res.record)
            await send({"type": "http.response.start", "status": status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers] + echo})
            await send({"type": "http.response.body", "body": stored, "more_body": False})
            return
        if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
            await _send_problem(send, _http.not_acquired(res), echo)
            return

        holder = _Holder(c, breq, res, sent)
        attempt = Attempt(holder.info, cancel_event)
        stop = await self._thread(holder.start, attempt)
        if stop is None:
            if holder.gave_up:
                await self._thread(c._release, breq, holder.token)
            elif holder.lost:
                await _send_problem(send, _http.lease_lost(), echo)
            else:
                await self._thread(holder.finish, kind="FAILURE_KIND_ABANDONED",
                                        reason="the lease could not be confirmed before the handler started")
                await _send_problem(send, _http.not_started(), echo)
            return

        rec = _http.Recording(o)
        dropped = False

        async def recording_send(msg):
            nonlocal dropped
            if msg["type"] == "http.response.start":
                if holder.lost or dropped:
                    dropped = True  # never a success for a lease lost before the answer
                    return
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])
                           if k.lower() != b"idempotency-key"]
                out = rec.head(msg["status"], headers)
                await send(dict(msg, headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in out] + echo))
                return
            if msg["type"] == "http.response.body":
                if dropped:
                    return
                rec.keep(msg.get("body", b""))
                if not msg.get("more_body", False):
                    rec.ended = True
            await send(msg)

        # The app's receive answers http.disconnect once the client has gone
        # or the attempt was cancelled (lease lost or unconfirmed).
        async def cancelled_watch():
            while not attempt.cancelled.is_set() and not gone.is_set():
                await asyncio.sleep(0.05)
            gone.set()
        canceller = asyncio.ensure_future(cancelled_watch())
        token = _current.set(attempt)
        try:
            await self.app(scope, _replaying(body, gone), recording_send)
        except BaseException as err:
            await self._thread(stop)
            if not holder.lost:
                await self._thread(holder.finish, kind="FAILURE_KIND_UNKNOWN",
                                        reason="the app raised %s" % type(err).__name__)
            raise
        finally:
            _current.reset(token)
            canceller.cancel()
        await self._thread(stop)
        if holder.lost:
            c._log.warning("idemcoord: lease lost while the app ran; its response is not stored (%s/%s)",
                           holder.scope, holder.key)
            if not rec.wrote:
                await _send_problem(send, _http.lease_lost(), echo)
            return
        if not rec.wrote and (cancel_event.is_set() or attempt.cancelled.is_set()):
            cause = attempt.reason
            await self._thread(holder.finish, **_http.silent_ending(attempt._marked, cause))
            await _send_problem(send, _http.silent(cause is not None and type(cause).__name__ == "LeaseUnconfirmed"), echo)
            return
        if not rec.wrote:
            await recording_send({"type": "http.response.start", "status": 200, "headers": []})
            await recording_send({"type": "http.response.body", "body": b"", "more_body": False})
        if not rec.ended:
            await self._thread(holder.finish, kind="FAILURE_KIND_UNKNOWN",
                                    reason="HTTP %d: the answer was cut off before it ended" % rec.status)
            return
        await self._thread(holder.finish, **rec.ending(attempt._marked))


def _replaying(body, gone):
    """The receive the app gets: the body that was read, then http.disconnect once gone is set."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}
    return receive
