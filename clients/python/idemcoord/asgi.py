"""ASGI middleware (Starlette, FastAPI) with the semantics of Go's clients.HTTPMiddleware.

    app.add_middleware(idemcoord.asgi.IdempotencyMiddleware, client=client)

client is an idemcoord.aio.Client or an idemcoord.Client (then the
middleware builds an asyncio client like it in its event loop): it waits on
asyncio, never on a thread.

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
client left as ASGI says: receive() answers http.disconnect. An app that
goes on after that and answers is recorded by its answer.

The answer is recorded (and the lease let go) as soon as its last body
message is sent, while the app may still run background tasks: a retry
then gets the replay, and an app process that dies in a background task
does not run the handler again. An exception raised after the complete
answer (a background task's) is logged and raised on; the answer stays.
"""

import asyncio
import inspect
import warnings
import weakref
from typing import Any, Awaitable, Callable, Dict, List, MutableMapping, Optional, Tuple, TypeVar, Union, cast

import grpc

from . import _api, _http
from . import aio as _aio
from ._tables import FINISH_TIMEOUT
from .client import Attempt, Client, _current
from .errors import LeaseUnconfirmed

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
RawHeaders = List[Tuple[bytes, bytes]]

_T = TypeVar("_T")


async def _maybe_await(v: Union[_T, Awaitable[_T]]) -> _T:
    if inspect.isawaitable(v):
        return await cast(Awaitable[_T], v)
    return cast(_T, v)


def _target(scope: Scope) -> str:
    path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    qs: bytes = scope.get("query_string") or b""
    return (path + (b"?" + qs if qs else b"")).decode("latin-1")


async def _send_problem(send: Send, p: _http.Problem, echo: RawHeaders) -> None:
    body = p.body()
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in p.header_list(body)] + echo
    await send({"type": "http.response.start", "status": p.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class IdempotencyMiddleware:
    """Makes an ASGI app idempotent through client (an idemcoord.aio.Client, or an idemcoord.Client).

    It runs on asyncio alone: a duplicate that waits for the first request
    waits on the event loop, holding no thread. Given an idemcoord.Client,
    it builds an idemcoord.aio.Client like it (idemcoord.aio.Client.like:
    same coordinator, token, TLS, retries, lease and channel options) in
    each event loop it serves, and closes it at the ASGI lifespan's
    shutdown; an idemcoord.aio.Client is used as given (its owner closes it).

    Options (keywords, each as Go's WithHTTP… option): wait (seconds),
    require_key, fail_open, principal (a function of the ASGI scope, may be
    async) or without_principal=True, methods, fingerprint (a function of
    scope and body), replay_headers, replayable_statuses, scope,
    max_body_bytes, mismatch_status (409 or 422), on_replay (a function of
    scope and the StoredResponse), key (a function of scope and body, may
    be async: the key of a request sent without an Idempotency-Key
    header, None or "" for none; the header, when sent, wins).
    """

    def __init__(self, app: App, client: Union[Client, _aio.Client], *, threads: Optional[int] = None, **options: Any):
        self.app = app
        self.client = client
        self.o = _http.Options(**options)
        if self.o.undecided_principal:
            _http.warn_undecided_principal("idemcoord.asgi.IdempotencyMiddleware")
        if self.o.unnamed_service:
            _http.warn_unnamed_service("idemcoord.asgi.IdempotencyMiddleware")
        if threads is not None:
            warnings.warn("idemcoord.asgi.IdempotencyMiddleware: threads= is no longer used (the middleware "
                          "runs on asyncio)", DeprecationWarning, stacklevel=2)
        if not isinstance(client, (Client, _aio.Client)):
            raise TypeError("idemcoord.asgi.IdempotencyMiddleware takes an idemcoord.Client or an "
                            "idemcoord.aio.Client, not %s" % type(client).__name__)
        # The asyncio clients built from a sync client, one per event loop.
        self._owned: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _aio.Client]" = weakref.WeakKeyDictionary()

    def _client(self) -> _aio.Client:
        """The asyncio client of the running loop."""
        if isinstance(self.client, _aio.Client):
            return self.client
        loop = asyncio.get_running_loop()
        c = self._owned.get(loop)
        if c is None:
            c = self._owned[loop] = _aio.Client.like(self.client)
        return c

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Passes the lifespan on; at its shutdown, closes the loop's own client (pending endings first)."""
        async def on_shutdown() -> Message:
            msg = await receive()
            if msg["type"] == "lifespan.shutdown":
                owned = self._owned.pop(asyncio.get_running_loop(), None)
                if owned is not None:
                    await owned.shutdown(timeout=FINISH_TIMEOUT)
            return msg
        await self.app(scope, on_shutdown, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        o = self.o
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http" or scope["method"] not in o.methods:
            await self.app(scope, receive, send)
            return
        body: Optional[bytes] = None
        try:
            raw, key = _http.key_of(o, scope["headers"])
            if key is None and o.key is not None:
                body = await self._body(receive)
                if body is None:
                    return  # the client went away before anything was sent
                try:
                    found = await _maybe_await(o.key(scope, body))
                except Exception as err:
                    raise _http.key_failed(err) from err
                key = _http.key_from(o, found)
                if key is None:
                    _http.no_key(o)
        except _http.Problem as p:
            await _send_problem(send, p, [])
            return
        if key is None:
            await self.app(scope, receive if body is None else _then(body, receive), send)
            return
        echo = [(b"idempotency-key", raw if raw is not None else key.encode("utf-8"))]
        try:
            if o.principal is not None:
                try:
                    key = _http.fold_principal(await _maybe_await(o.principal(scope)), key)
                except Exception as err:
                    raise _http.Problem(400, "about:blank", "Bad Request", "idempotency principal: %s" % err)
            if body is None:
                body = await self._body(receive)
                if body is None:
                    return  # the client went away before anything was sent
            try:
                if o.fingerprint is not None:
                    fp: bytes = await _maybe_await(o.fingerprint(scope, body))
                else:
                    fp = _http.http_fingerprint(scope["method"], _target(scope), body)
            except Exception as err:
                raise _http.Problem(400, "about:blank", "Bad Request", "idempotency fingerprint: %s" % err)
        except _http.Problem as p:
            await _send_problem(send, p, echo)
            return

        left = asyncio.Event()  # the client went away
        gone = asyncio.Event()  # the app's receive answers http.disconnect: the client left, or the attempt was cancelled

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()
            gone.set()
        watcher = asyncio.ensure_future(watch())
        try:
            await self._guarded(scope, send, key, body, fp, echo, left, gone)
        finally:
            watcher.cancel()

    async def _body(self, receive: Receive) -> Optional[bytes]:
        """The whole request body (at most max_body_bytes, else raises _http.Problem), None when the client left."""
        received = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            received += msg.get("body", b"")
            if len(received) > self.o.max_body_bytes:
                raise _http.too_large(self.o)
            if not msg.get("more_body", False):
                return bytes(received)

    async def _begin(self, c: _aio.Client, breq: Dict[str, Any],
                     left: asyncio.Event) -> Optional[Tuple[Any, float]]:
        """Begin's answer and when it was sent (see idemcoord.aio.Client._begin_waiting), None when the client left first.

        When the client leaves (or this task is cancelled) while Begin is in
        flight or waiting, what that Begin may have acquired is released
        before it returns. Raises what Begin raised.
        """
        waiting = asyncio.ensure_future(c._begin_waiting(breq, _http.wait_until(self.o)))
        leaving = asyncio.ensure_future(left.wait())
        try:
            await asyncio.wait({waiting, leaving}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            waiting.cancel()
            await asyncio.shield(c._release(breq))
            raise
        finally:
            leaving.cancel()
        if waiting.done():
            return waiting.result()
        waiting.cancel()
        await asyncio.wait({waiting})
        await c._release(breq)
        return None

    async def _guarded(self, scope: Scope, send: Send, key: str, body: bytes, fp: bytes, echo: RawHeaders,
                       left: asyncio.Event, gone: asyncio.Event) -> None:
        o, c = self.o, self._client()
        breq = _http.begin_request(c, o.scope_of(scope["method"], _target(scope)), key, fp)
        try:
            begun = await self._begin(c, breq, left)
        except grpc.RpcError as err:
            if _aio._answer_lost(err):
                c._run_in_background(c._release(breq))
            p = _http.begin_failed(c, o, err)
            if p is None:
                await self.app(scope, _replaying(body, gone), send)
            else:
                await _send_problem(send, p, echo)
            return
        if begun is None:
            return  # the client has gone: nobody will act on it
        res, sent = begun
        if res.outcome == _api.Outcome.OUTCOME_REPLAY:
            status, headers, stored = _http.replay_answer(o, scope, res.record)
            await send({"type": "http.response.start", "status": status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers] + echo})
            await send({"type": "http.response.body", "body": stored, "more_body": False})
            return
        if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
            await _send_problem(send, _http.not_acquired(res), echo)
            return

        holder = _aio._AsyncHolder(c, breq, res, sent)
        if left.is_set():  # the client left as the key was acquired
            await c._release(breq, holder.token)
            return
        attempt = Attempt(holder.info, holder=holder)
        # A lost or unconfirmed lease shows the app a disconnect, as a client that left does.
        stop = await holder.start(attempt, gone.set)
        if stop is None:
            if holder.lost:
                await _send_problem(send, _http.lease_lost(), echo)
            else:
                await holder.finish(kind="FAILURE_KIND_ABANDONED",
                                    reason="the lease could not be confirmed before the handler started")
                await _send_problem(send, _http.not_started(), echo)
            return

        rec = _http.Recording(o, res)
        dropped = False
        recorded = False  # the complete answer was recorded; the app may still run (background tasks)
        stop_beats: Callable[[], Awaitable[None]] = stop

        async def record_answer() -> None:
            """Records the answer the client now has whole and lets the lease go, while the app may go on."""
            nonlocal recorded
            recorded = True
            await stop_beats()
            if holder.lost:
                c._log.warning("idemcoord: lease lost while the app ran; its response is not stored (%s/%s)",
                               holder.scope, holder.key)
                return
            await holder.finish(**rec.ending(attempt._marked))

        async def recording_send(msg: Message) -> None:
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
                    await asyncio.shield(record_answer())
                    return
            await send(msg)

        token = _current.set(attempt)
        leaving = asyncio.ensure_future(_cancel_when_left(left, attempt))
        try:
            await self.app(scope, _replaying(body, gone), recording_send)
        except BaseException as err:
            await asyncio.shield(self._after_raise(c, holder, stop, rec, attempt, err, recorded))
            raise
        finally:
            _current.reset(token)
            leaving.cancel()
        if left.is_set():
            # The app may have seen the disconnect and returned before the
            # task that cancels the attempt on it ran: the attempt ended
            # with its request all the same.
            attempt.cancel(attempt.reason or RuntimeError("idemcoord: the client went away"))
        if recorded:
            return
        await stop()
        if holder.lost:
            c._log.warning("idemcoord: lease lost while the app ran; its response is not stored (%s/%s)",
                           holder.scope, holder.key)
            if not rec.wrote:
                await _send_problem(send, _http.lease_lost(), echo)
            return
        if not rec.wrote and attempt.cancelled.is_set():
            cause = attempt.reason
            await holder.finish(**_http.silent_ending(attempt._marked, cause))
            await _send_problem(send, _http.silent(isinstance(cause, LeaseUnconfirmed)), echo)
            return
        if not rec.wrote:
            await recording_send({"type": "http.response.start", "status": 200, "headers": []})
            await recording_send({"type": "http.response.body", "body": b"", "more_body": False})
            if recorded:
                return
        if not rec.ended:
            await holder.finish(kind="FAILURE_KIND_UNKNOWN",
                                reason="HTTP %d: the answer was cut off before it ended" % rec.status)
            return
        await holder.finish(**rec.ending(attempt._marked))

    @staticmethod
    async def _after_raise(c: _aio.Client, holder: "_aio._AsyncHolder", stop: Callable[[], Awaitable[None]],
                           rec: _http.Recording, attempt: Attempt, err: BaseException, recorded: bool) -> None:
        """Records an attempt whose app raised err: what it answered when the answer was complete, else UNKNOWN.

        recorded: the complete answer was already recorded as it was sent;
        then err (a background task's, say) is only logged.
        """
        if recorded:
            if isinstance(err, Exception) and not holder.lost:
                c._log.warning("idemcoord: the app raised %s after its answer was complete; the answer is stored "
                               "(%s/%s)", type(err).__name__, holder.scope, holder.key)
            return
        await stop()
        if holder.lost:
            return
        if rec.ended and isinstance(err, Exception):
            # The client has its whole answer (a background task, say,
            # raised after it): what was answered is what happened.
            c._log.warning("idemcoord: the app raised %s after its answer was complete; the answer is stored "
                           "(%s/%s)", type(err).__name__, holder.scope, holder.key)
            await holder.finish(**rec.ending(attempt._marked))
            return
        await holder.finish(kind="FAILURE_KIND_UNKNOWN", reason="the app raised %s" % type(err).__name__)


async def _cancel_when_left(left: asyncio.Event, attempt: Attempt) -> None:
    """Cancels attempt (Attempt.cancelled) once the client has left."""
    await left.wait()
    attempt.cancel(RuntimeError("idemcoord: the client went away"))


def _then(body: bytes, receive: Receive) -> Receive:
    """The receive an unprotected app gets after the middleware read the body: that body, then receive's messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _replaying(body: bytes, gone: asyncio.Event) -> Receive:
    """The receive the app gets: the body that was read, then http.disconnect once gone is set."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}
    return receive
