"""The asyncio client of idemcoord, on grpc.aio: typed calls with retries and `async once`.

    async with idemcoord.aio.Client("127.0.0.1:50051", token="...") as client:
        result = await client.once("projects.create", key, fingerprint, create)

It behaves as idemcoord.Client (see Client.once there), with asyncio's
cancellation for the caller giving up: cancelling the task that awaits once
while Begin is in flight or waiting releases what that Begin may have
acquired (Fail ABANDONED, reason "caller gave up before the handler ran",
shielded from the cancellation, at most a few seconds) before the
cancellation goes on, so the key is as if the call never was. fn is an async
function of the Attempt; it is cancelled when the lease is lost or cannot be
confirmed (the attempt's reason says which). idemcoord.mark_side_effect()
and idemcoord.current_lease() work inside it.
"""

import asyncio
import logging
import math
import random
import time
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import grpc
import grpc.aio

import idemcoord.client

from . import _api, _core
from ._core import (LEASE_LOST_ANSWER, NOT_STARTED_REASON, PASS_THROUGH, RESULT_HEADER, UNAVAILABLE_ANSWER, Answer,
                    Guard, Method, Replayed, Request, StoredBytes)
from ._tables import FINISH_TIMEOUT, RELEASE_TIMEOUT
from ._core import _C
from ._core import code_of_error as _code
from ._core import duration as _duration
from ._core import lease_length as _lease_length
from ._core import seconds as _seconds
from .client import (Attempt, Result, _HolderBase, _Settings, _begin_fields, _begin_outcome, _channel_options,
                     _configure, _credentials, _current, _lease_gone, _once_ending, _once_request, _once_result,
                     _release_fail, _unreachable, _without_wait)
from .errors import LeaseLost, LeaseUnconfirmed
from .grpc import new_key, with_key


async def checkpoint(phase: str, data: "bytes | bytearray | memoryview | str" = b"") -> None:
    """Records a recovery point of the asyncio attempt in progress: idemcoord.checkpoint for asyncio code.

    Inside a coroutine function this module's Client.once runs, an app
    behind the ASGI middleware, or a handler behind this module's
    ServerInterceptor. Raises LeaseLost when another attempt took the key
    over, INVALID_ARGUMENT for a bad phase or data over the limit, and
    RuntimeError outside an attempt. idemcoord.checkpoint_from reads it.
    """
    attempt = _current.get()
    if attempt is None:
        raise RuntimeError("idemcoord: checkpoint outside an attempt (no handler or once function with an idempotency key)")
    await attempt.checkpoint_async(phase, data)


def _answer_lost(err: object) -> bool:
    return isinstance(err, asyncio.CancelledError) or _code(err) in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED, _C.CANCELLED)


class Client(_Settings):
    """Calls an idemcoord coordinator from asyncio code; arguments as idemcoord.Client's.

    interceptors are grpc.aio client interceptors of the channel (with
    call_batching they see the Batch RPCs). call_batching=N behaves as
    idemcoord.Client's: the calls the tasks of
    the event loop make concurrently share Batch RPCs, at most N in
    flight, each call with its own answer, error, timeout and retries. A
    Begin whose task is cancelled after it was sent waits (shielded, at
    most a few seconds) for its answer and releases what it acquired
    before the cancellation goes on.
    """

    def __init__(self, address: str, token: Optional[str] = None, tls: Any = None, *, max_attempts: int = 5,
                 backoff: float = 0.1, max_backoff: float = 2.0, timeout: float = 10.0, lease: Any = None,
                 options: Sequence[Tuple[str, Any]] = (), logger: Optional[logging.Logger] = None,
                 call_batching: int = 0, interceptors: Sequence[Any] = ()):
        options = _channel_options(options)
        creds = _credentials(tls)
        chain = list(interceptors) or None
        self._channel = (grpc.aio.secure_channel(address, creds, options, interceptors=chain) if creds
                         else grpc.aio.insecure_channel(address, options, interceptors=chain))
        _configure(self, self._channel, token, max_attempts, backoff, max_backoff, timeout, lease, logger,
                   call_batching)
        self._background: Set["asyncio.Future[None]"] = set()
        # Call batching's timeouts: the batched calls waiting for their answer, and one timer, at the earliest of
        # their deadlines (a monotonic time; inf: none set), which ends those whose deadline passed.
        self._waiting: Dict[_core.BatchItem, None] = {}
        self._expiry: Optional[asyncio.TimerHandle] = None
        self._expiry_at = math.inf

    @classmethod
    def like(cls, client: "idemcoord.client.Client") -> "Client":
        """An asyncio client to the same coordinator with the same settings as client (an idemcoord.Client).

        Call it inside the event loop that will use it (a grpc.aio channel
        belongs to one). The sync client's interceptors are not carried
        over: they are grpc's synchronous kind.
        """
        return cls(**client._settings)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def _call(self, method: str, fields: Mapping[str, Any], timeout: Optional[float] = None,
                    extra: float = 0.0) -> Any:
        request = _api.REQUESTS[method](**fields)
        timeout = (self._timeout if timeout is None else timeout) + extra
        delay = self._backoff
        for attempt in range(1, self._max_attempts + 1):
            try:
                size = self._rounds.size_if_batchable(method, request) if self._rounds is not None else None
                if size is not None:
                    return await self._batched(method, request, size, timeout)
                return await self._stubs[method](request, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                if err.code() != _C.UNAVAILABLE or attempt >= self._max_attempts:
                    raise
                await asyncio.sleep(delay / 2 + random.random() * delay / 2)
                delay = min(delay * 2, self._max_backoff)

    # Call batching (call_batching=N): each try of a call is an item of a round, formed on the event loop.

    async def _batched(self, method: str, request: Any, size: int, timeout: float) -> Any:
        """One try of a call, in a Batch RPC: its answer, or what its unary call raises."""
        assert self._rounds is not None
        loop = asyncio.get_running_loop()
        it = _core.BatchItem(method, request, size, time.monotonic() + timeout, loop.create_future())
        self._waiting[it] = None
        if it.deadline < self._expiry_at:
            self._expire_at(loop, it.deadline)
        if self._rounds.reserve(it):
            self._run_in_background(self._send_rounds())
        try:
            # Set by the sender when the call is answered, or by _expire when its deadline passed first (a timer
            # per client, not one per call: asyncio.wait's timer and callbacks were a fifth of a call's CPU).
            await it.waiter
        except asyncio.CancelledError:
            del self._waiting[it]
            await asyncio.shield(self._batched_gone(it))
            raise
        del self._waiting[it]
        if not it.answered:
            await asyncio.shield(self._batched_gone(it))
            raise _core.rpc_error(_C.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return it.answer()

    def _expire_at(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """(Re)sets the timer of the batched calls' timeouts to deadline (a time.monotonic() value)."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = deadline
        self._expiry = loop.call_at(loop.time() + (deadline - time.monotonic()), self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer: wakes the batched calls whose deadline passed unanswered, and sets itself for the next one."""
        self._expiry, self._expiry_at = None, math.inf
        now, soonest = time.monotonic(), math.inf
        for it in self._waiting:
            if it.deadline <= now:
                if not it.waiter.done():
                    it.waiter.set_result(None)  # not answered: the caller raises DEADLINE_EXCEEDED
            elif it.deadline < soonest:
                soonest = it.deadline
        if soonest < math.inf:
            self._expire_at(loop, soonest)

    async def _batched_gone(self, it: _core.BatchItem) -> None:
        """Its caller gave up on it: out of the queue if it is still there, else a Begin's acquisition is released.

        That waits for the Begin's answer for at most RELEASE_TIMEOUT
        (normally milliseconds), so that the caller's own release finds the
        key settled; after that it goes on in the background.
        """
        assert self._rounds is not None
        if self._rounds.withdraw(it) or it.method != "Begin":
            return

        async def release() -> None:
            if not it.answered:  # its first waiter is done (timed out) or cancelled: the sender sets this one
                it.waiter = asyncio.get_running_loop().create_future()
                await it.waiter
            token = it.acquired_token()
            if token:
                await self._release(dict(scope=it.request.scope, key=it.request.key), token)
        settle = asyncio.ensure_future(release())
        self._background.add(settle)
        settle.add_done_callback(self._background.discard)
        await asyncio.wait({settle}, timeout=RELEASE_TIMEOUT)

    async def _send_rounds(self) -> None:
        """A sender: sends rounds while calls are queued, then ends (its RPC slot is free again).

        Its first round is what is queued at its first turn: the call that
        started it and those made in the same turn of the loop (a round of
        one, taken at once, left them waiting for the next RPC).
        """
        assert self._rounds is not None
        round_ = self._rounds.next_round()
        while round_ is not None:
            await self._send_round(round_)
            round_ = self._rounds.next_round()

    async def _send_round(self, items: List[_core.BatchItem]) -> None:
        """Sends one round as a Batch RPC (or its calls unary) and answers each of its calls."""
        assert self._rounds is not None
        try:
            if self._rounds.unary:
                await self._each_unary(items)
                return
            req, timeout = _core.batch_request(items, time.monotonic())
            try:
                resp = await self._batch_stub(req, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                how = _core.round_failed(err)
                if how == _core.ROUND_FAILED:
                    _core.fail_round(items, err)
                    return
                if how == _core.ROUND_UNARY_FOR_GOOD:
                    self._rounds.unary = True
                await self._each_unary(items)
                return
            await self._each_unary(_core.answer_round(items, resp))
        except BaseException as err:  # cancelled at shutdown, a closed channel: no caller waits forever
            _core.fail_round([it for it in items if it.outcome is None],
                             _core.rpc_error(_C.CANCELLED, "idemcoord: the batch could not be sent: %r" % err))
            if isinstance(err, asyncio.CancelledError):
                raise
        finally:
            for it in items:
                it.answered = True
                if not it.waiter.done():
                    it.waiter.set_result(None)

    async def _each_unary(self, items: Sequence[_core.BatchItem]) -> None:
        """Makes each call as its own unary RPC, all at once."""
        async def one(it: _core.BatchItem) -> None:
            try:
                it.outcome = await self._stubs[it.method](it.request, timeout=max(it.deadline - time.monotonic(), 0.001),
                                                          metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                it.outcome = err
        await asyncio.gather(*(one(it) for it in items))

    async def begin(self, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        """Claims a key; as idemcoord.Client.begin."""
        _begin_fields(fields)
        return await self._call("Begin", fields, timeout, _seconds(fields.get("wait")))

    async def complete(self, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        return await self._call("Complete", fields, timeout)

    async def fail(self, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        try:
            return await self._call("Fail", fields, timeout)
        except grpc.aio.AioRpcError as err:
            if fields.get("kind") == "FAILURE_KIND_ABANDONED" and err.code() == _C.NOT_FOUND:
                return _api.RESPONSES["Fail"]()
            raise

    async def lookup(self, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        return await self._call("Lookup", fields, timeout)

    async def heartbeat(self, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        if fields.get("lease") is not None:
            fields["lease"] = _duration(fields["lease"])
        return await self._call("Heartbeat", fields, timeout)

    async def once(self, scope: str, key: str, fingerprint: Optional[bytes], fn: Callable[[Attempt], Awaitable[Any]],
                   *, wait_until: Optional[float] = None) -> Result:
        """Runs the async fn(attempt) at most once per (scope, key); as idemcoord.Client.once.

        wait_until (a time.monotonic() value) bounds the wait for another
        attempt (then TimeoutError); cancel the awaiting task to give up.
        """
        breq = _once_request(scope, key, fingerprint, self._lease)
        try:
            res, sent = await self._begin_waiting(breq, wait_until)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as err:
            if _answer_lost(err):
                await asyncio.shield(self._release(breq))
            raise
        replayed = _begin_outcome(res)
        if replayed is not None:
            return replayed
        holder = _AsyncHolder(self, breq, res, sent)
        try:
            value, error, marked, started = await holder.run(fn)
        except asyncio.CancelledError:
            if not holder.started:
                await asyncio.shield(self._release(breq, holder.token))
            else:  # the caller gave up while fn ran: it may have done the side effect
                await asyncio.shield(holder.finish(kind="FAILURE_KIND_UNKNOWN", reason="the caller gave up while the function ran"))
            raise
        if holder.lost:
            raise LeaseLost()
        if not started:
            await holder.finish(kind="FAILURE_KIND_ABANDONED",
                                reason="the lease could not be confirmed before the attempt started")
            raise LeaseUnconfirmed()
        ending, outcome = _once_ending(value, error, marked, res.record.attempt)
        return _once_result(error, outcome, await holder.finish(**ending))

    async def _begin_waiting(self, req: Dict[str, Any], wait_until: Optional[float] = None) -> Tuple[Any, float]:
        """Begin, then Begin's long poll while another attempt holds the key, until wait_until (None: no limit)."""
        steps = _core.begin_waiting(req, None, wait_until, time.monotonic, lambda: False)
        step = next(steps)
        while True:
            if isinstance(step, _core.Pause):
                await asyncio.sleep(step.seconds)
                answer = None
            else:
                answer = await self.begin(**step.fields)
            try:
                step = steps.send(answer)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    async def _release(self, req: Mapping[str, Any], token: Optional[str] = None) -> None:
        """As idemcoord.Client._release: ends with Fail ABANDONED what a Begin nobody will act on acquired; never raises."""
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT) if hasattr(asyncio, "timeout") else _Nothing():
                if not token:
                    res = await self.begin(**_without_wait(req), timeout=RELEASE_TIMEOUT)
                    if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
                        return
                    token = str(res.lease_token)
                await self.fail(**_release_fail(req, token), timeout=RELEASE_TIMEOUT)
        except Exception as err:
            self._log.warning("idemcoord: could not release an acquisition nobody will act on of %s/%s; the key "
                              "stays held until its lease runs out: %s", req["scope"], req["key"], err)

    def _run_in_background(self, coro: Awaitable[None]) -> None:
        t = asyncio.ensure_future(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def shutdown(self, timeout: Optional[float] = None) -> None:
        """Waits for background endings (at most timeout seconds), then closes the channel."""
        if self._background:
            _, pending = await asyncio.wait(list(self._background), timeout=timeout)
            for t in pending:
                t.cancel()
        await self._channel.close()

    close = shutdown


class _Nothing:
    async def __aenter__(self) -> "_Nothing":
        return self

    async def __aexit__(self, *exc: object) -> bool:
        return False


class _AsyncHolder(_HolderBase):
    """An acquisition this task holds: heartbeats while fn runs, then ends it."""

    client: Client

    def __init__(self, client: Client, req: Mapping[str, Any], res: Any, sent: float):
        super().__init__(client, req, res, sent)
        self.started = False

    async def heartbeat(self, timeout: Optional[float] = None) -> float:
        res = await self.client.heartbeat(timeout=timeout, **self._heartbeat_fields())
        return _lease_length(res.record)

    async def checkpoint_async(self, phase: str, data: bytes) -> None:
        """Records a checkpoint (see checkpoint)."""
        try:
            res = await self.client.heartbeat(**self._checkpoint_fields(phase, data))
        except grpc.aio.AioRpcError as err:
            if _lease_gone(err):
                self.lost = True
                raise LeaseLost() from err
            raise
        self._recorded(phase, data, res)

    async def start(self, attempt: Attempt,
                    on_cancel: Callable[[], None]) -> Optional[Callable[[], Awaitable[None]]]:
        """Starts the heartbeats of attempt; returns the coroutine function that stops them, or None when fn must not run.

        None when the lease was lost (lost) or cannot be confirmed for long
        enough to start (a Begin that waited long is confirmed with a
        heartbeat first). While it runs, a refused heartbeat or a lease that
        could not be confirmed before it would run out cancels attempt (its
        reason says which) and calls on_cancel. The ASGI middleware runs its
        app between start and stop; run runs fn so.
        """
        timer = self.timer
        if timer.needs_confirmation(time.monotonic()):
            sent = time.monotonic()
            try:
                timer.confirmed_before_start(sent, await self.heartbeat(timeout=timer.beat_timeout))
            except grpc.aio.AioRpcError as err:
                if _lease_gone(err):
                    self.lost = True
                    return None
        if not timer.start(time.monotonic()):
            return None
        self.started = True
        beats = asyncio.ensure_future(self._keep_alive(attempt, on_cancel))

        async def stop() -> None:
            beats.cancel()
            try:
                await beats
            except asyncio.CancelledError:
                pass
        return stop

    async def run(self, fn: Callable[[Attempt], Awaitable[Any]]) -> Tuple[Any, Optional[BaseException], bool, bool]:
        """Runs fn(attempt) with heartbeats; returns (value, error, marked, started)."""
        attempt = Attempt(self.info, holder=self)
        task: "Optional[asyncio.Future[Any]]" = None

        def cancel_fn() -> None:
            if task is not None:
                task.cancel()
        stop = await self.start(attempt, cancel_fn)
        if stop is None:
            return None, None, False, False
        token = _current.set(attempt)
        try:
            task = asyncio.ensure_future(fn(attempt))
        finally:
            _current.reset(token)
        value = None
        error: Optional[BaseException] = None
        try:
            value = await task
        except asyncio.CancelledError:
            if attempt.reason is None:  # the caller's cancellation, not ours
                raise
            error = attempt.reason
        except Exception as err:
            error = err
        finally:
            await stop()
        return value, error, attempt._marked, True

    async def _keep_alive(self, attempt: Attempt, on_cancel: Callable[[], None]) -> None:
        """Heartbeats while fn runs (_core.keep_alive decides when); a lost or unconfirmed lease cancels attempt."""
        steps = _core.keep_alive(self.timer, time.monotonic, _lease_gone, lambda: False, stop_when_unconfirmed=True)
        answer: Any = None
        try:
            while True:
                step = steps.send(answer)
                answer = None
                if isinstance(step, _core.Pause):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, _core.Beat):
                    try:
                        answer = await self.heartbeat(timeout=step.timeout)
                    except grpc.aio.AioRpcError as err:
                        answer = err
                else:
                    self._cancel(attempt, step.lost)
                    on_cancel()
        except StopIteration:
            return
        finally:
            steps.close()

    async def _send(self, ending: Mapping[str, Any], timeout: float) -> Any:
        method, fields = self._ending_call(ending)
        return await getattr(self.client, method)(timeout=timeout, **fields)

    async def finish(self, **ending: Any) -> Optional[BaseException]:
        """Ends the attempt; None when done or retrying in the background, else the refusal."""
        try:
            await self._send(ending, FINISH_TIMEOUT)
            return None
        except grpc.aio.AioRpcError as err:
            if _unreachable(err):
                self.client._run_in_background(self._finish_later(ending))
                return None
            instead = self._unstored(err, ending)
            if instead is not None:
                return await self.finish(**instead)
            refusal: BaseException = err
            return refusal

    async def _finish_later(self, ending: Mapping[str, Any]) -> None:
        give_up = time.monotonic() + self.length
        delay = 0.1
        while time.monotonic() < give_up:
            await asyncio.sleep(delay)
            try:
                await self._send(ending, FINISH_TIMEOUT)
                return
            except grpc.aio.AioRpcError as err:
                instead = None if _unreachable(err) else self._unstored(err, ending)
                if instead is not None:
                    ending = instead  # as finish does when the coordinator answers at once
                    continue
                if not _unreachable(err):
                    self.client._log.error("idemcoord: coordinator refused the end of an attempt: %s", err)
                    return
            try:
                await self.heartbeat(timeout=FINISH_TIMEOUT)
            except grpc.aio.AioRpcError:
                pass
            delay = min(delay * 2, 2.0)
        self.client._log.error("idemcoord: gave up ending an attempt on %s/%s; the record will read UNKNOWN once "
                               "its lease runs out", self.scope, self.key)


async def _abort(context: Any, answer: Answer) -> None:
    # grpc.aio's abort replaces the trailing metadata with its own argument
    await context.abort(answer.code, answer.details, answer.trailing)


class ServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The asyncio twin of idemcoord.grpc.ServerInterceptor, for grpc.aio servers; client is an idemcoord.aio.Client.

    Options are idemcoord.grpc.ServerInterceptor's, with the same decisions
    (one core drives both). A call cancelled while Begin is in flight or
    waiting releases what that Begin acquired.
    """

    def __init__(self, client: Client, **options: Any):
        self.client = client
        self.guard = Guard("idemcoord.aio.ServerInterceptor", log=client._log, **options)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        guarded_method = self.guard.method(handler_call_details.method, handler)
        if guarded_method is None:
            return handler
        m: Method = guarded_method
        behavior = handler.unary_unary

        async def guarded(request: Request, context: Any) -> Any:
            return await self._guard(m, behavior, request, context)
        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=Guard.request_deserializer(handler),
                                                   response_serializer=Guard.response_serializer(handler))

    async def _guard(self, m: Method, behavior: Callable[[Any, Any], Awaitable[Any]], request: Request,
                     context: Any) -> Any:
        g, c = self.guard, self.client
        key = g.key_of(request, context, context.invocation_metadata())
        if isinstance(key, Answer):
            await _abort(context, key)
        if not key:
            return await behavior(request.message, context)
        breq = g.begin_request(m, str(key), request, context, c._lease)
        wait = g.wait_for(context.time_remaining())
        try:
            res, sent = await c._begin_waiting(breq, time.monotonic() + wait)
        except asyncio.CancelledError:
            await asyncio.shield(c._release(breq))
            raise
        except grpc.aio.AioRpcError as err:
            if _answer_lost(err):
                c._run_in_background(c._release(breq))
            answer = g.begin_failed(err)
            if answer is PASS_THROUGH:
                return await behavior(request.message, context)
            assert isinstance(answer, Answer)
            await _abort(context, answer)
        decided = g.begun(m, res)
        if isinstance(decided, Answer):
            await _abort(context, decided)
        if isinstance(decided, Replayed):
            await context.send_initial_metadata([(RESULT_HEADER, "replayed")])
            return StoredBytes(decided.body)
        holder = _AsyncHolder(c, breq, res, sent)
        hctx = _HandlerContext(context)
        running = asyncio.ensure_future(holder.run(lambda attempt: behavior(request.message, hctx)))
        try:
            # The call's cancellation (its deadline passed, its caller left)
            # does not reach the handler: like a Go handler that ignores its
            # context, it runs on, and what it ends with is recorded then.
            response, error, marked, started = await asyncio.shield(running)
        except asyncio.CancelledError:
            if not holder.started:  # the handler never started: nobody will act on the acquisition
                running.cancel()
                await asyncio.shield(c._release(breq, holder.token))
            else:
                c._run_in_background(self._record_later(m, holder, hctx, running, context))
            raise
        return await self._record(m, holder, hctx, context, response, error, marked, started)

    async def _record_later(self, m: Method, holder: "_AsyncHolder", hctx: "_HandlerContext",
                            running: "asyncio.Future[Any]", context: Any) -> None:
        """Records the outcome of a handler that runs on after its call was cancelled; answers nobody."""
        try:
            response, error, marked, started = await running
            await self._record(m, holder, hctx, context, response, error, marked, started)
        except Exception:  # the call is gone: what _record would answer reaches no one
            pass

    async def _record(self, m: Method, holder: "_AsyncHolder", hctx: "_HandlerContext", context: Any, response: Any,
                      error: Optional[BaseException], marked: bool, started: bool) -> Any:
        """Records the handler's outcome, then answers it (returns the response, or aborts)."""
        g = self.guard
        if holder.lost:
            if error is not None:
                await _abort(context, LEASE_LOST_ANSWER)
            return response
        if not started:
            await holder.finish(kind="FAILURE_KIND_ABANDONED", reason=NOT_STARTED_REASON)
            await _abort(context, UNAVAILABLE_ANSWER)
        code = _core.code_of(hctx)
        if error is None and code in (None, _C.OK):
            ending = g.stored_success(m, response)
            if await holder.finish(**ending) is None and "complete" in ending:
                await context.send_initial_metadata([(RESULT_HEADER, "created")])
            if "complete" in ending:  # the bytes stored are the bytes sent: a replay is byte for byte the same
                return StoredBytes(bytes(ending["complete"].body))
            return response
        details = _core.details_of(hctx) or str(error or "")
        code, ending = g.failure(code, details, marked)
        err = await holder.finish(**ending)
        trailing = hctx.aborted[2] if hctx.aborted else _core.trailing_of(context)
        if err is None and ending["kind"] == "FAILURE_KIND_REPLAYABLE":
            trailing += ((RESULT_HEADER, "created"),)
        if error is not None and hctx.aborted is None:
            raise error  # an exception, answered UNKNOWN by the server
        # grpc.aio takes one abort per call, with its trailers: the
        # handler's abort was held (_HandlerContext) and is made here.
        await context.abort(code, details, trailing)


class ClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """idemcoord.grpc.ClientInterceptor for grpc.aio channels: one idempotency-key per call, the same on every retry.

        channel = grpc.aio.insecure_channel(address, interceptors=[idemcoord.aio.ClientInterceptor()])
    """

    def __init__(self, key: Callable[[], str] = new_key):
        self._key = key

    async def intercept_unary_unary(self, continuation: Callable[[Any, Any], Any], client_call_details: Any,
                                    request: Any) -> Any:
        md = with_key(client_call_details.metadata, self._key)
        if md is not None:
            d = client_call_details
            client_call_details = grpc.aio.ClientCallDetails(d.method, d.timeout, grpc.aio.Metadata(*md),
                                                             d.credentials, d.wait_for_ready)
        return await continuation(client_call_details, request)


class _HandlerAbort(Exception):
    """The handler's context.abort, held by _HandlerContext until the outcome is recorded."""


class _HandlerContext:
    """The grpc.aio ServicerContext the handler sees: everything passes through but abort, which is held.

    grpc.aio sends an abort with the trailers given to it (one abort per
    call), so the interceptor makes the abort itself once it knows whether
    to add "idempotency-result: created".
    """

    def __init__(self, context: Any):
        self._context = context
        self.aborted: Optional[Tuple[Any, str, _core.Metadata]] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: Any, details: str = "", trailing_metadata: _core.Metadata = ()) -> None:
        self.aborted = (code, details, tuple(trailing_metadata or ()))
        raise _HandlerAbort(details)

    def code(self) -> Any:
        return self.aborted[0] if self.aborted else self._context.code()

    def details(self) -> Any:
        return self.aborted[1] if self.aborted else self._context.details()
