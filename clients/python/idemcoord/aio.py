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
import random
import time
from typing import Any, Awaitable, Callable, Optional

import grpc
import grpc.aio

import idemcoord.client

from . import _api
from .client import (MAX_BEGIN_WAIT, MIN_HEARTBEAT, RELEASE_TIMEOUT, Attempt, _C, _HolderBase, _begin_fields,
                     _begin_outcome, _channel_options, _configure, _code, _credentials, _current, _duration, _fail_reason, _lease_gone,
                     _lease_length, _new_attempt_id, _once_ending, _once_request, _once_result, _release_fail,
                     _seconds, _status_response, _unreachable, _without_wait)
from .errors import LeaseLost, LeaseUnconfirmed

FINISH_TIMEOUT = 5.0


def _answer_lost(err):
    return isinstance(err, asyncio.CancelledError) or _code(err) in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED, _C.CANCELLED)


class Client:
    """Calls an idemcoord coordinator from asyncio code; arguments as idemcoord.Client's."""

    def __init__(self, address, token=None, tls=None, *, max_attempts=5, backoff=0.1, max_backoff=2.0, timeout=10.0,
                 lease=None, options=(), logger=None):
        options = _channel_options(options)
        creds = _credentials(tls)
        self._channel = (grpc.aio.secure_channel(address, creds, options) if creds
                         else grpc.aio.insecure_channel(address, options))
        _configure(self, self._channel, token, max_attempts, backoff, max_backoff, timeout, lease, logger)
        self._background = set()

    @classmethod
    def like(cls, client: "idemcoord.client.Client") -> "Client":
        """An asyncio client to the same coordinator with the same settings as client (an idemcoord.Client).

        Call it inside the event loop that will use it (a grpc.aio channel
        belongs to one). The sync client's interceptors are not carried
        over: they are grpc's synchronous kind.
        """
        return cls(**client._settings)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.shutdown()

    async def _call(self, method, fields, timeout=None, extra=0.0):
        request = _api.REQUESTS[method](**fields)
        timeout = (self._timeout if timeout is None else timeout) + extra
        delay = self._backoff
        for attempt in range(1, self._max_attempts + 1):
            try:
                return await self._stubs[method](request, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                if err.code() != _C.UNAVAILABLE or attempt >= self._max_attempts:
                    raise
                await asyncio.sleep(delay / 2 + random.random() * delay / 2)
                delay = min(delay * 2, self._max_backoff)

    async def begin(self, *, timeout=None, **fields):
        """Claims a key; as idemcoord.Client.begin."""
        _begin_fields(fields)
        return await self._call("Begin", fields, timeout, _seconds(fields.get("wait")))

    async def complete(self, *, timeout=None, **fields):
        return await self._call("Complete", fields, timeout)

    async def fail(self, *, timeout=None, **fields):
        try:
            return await self._call("Fail", fields, timeout)
        except grpc.aio.AioRpcError as err:
            if fields.get("kind") == "FAILURE_KIND_ABANDONED" and err.code() == _C.NOT_FOUND:
                return _api.RESPONSES["Fail"]()
            raise

    async def lookup(self, *, timeout=None, **fields):
        return await self._call("Lookup", fields, timeout)

    async def heartbeat(self, *, timeout=None, **fields):
        if fields.get("lease") is not None:
            fields["lease"] = _duration(fields["lease"])
        return await self._call("Heartbeat", fields, timeout)

    async def once(self, scope, key, fingerprint, fn, *, wait_until=None):
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

    async def _begin_waiting(self, req, wait_until=None):
        """Begin, then Begin's long poll while another attempt holds the key, until wait_until (None: no limit)."""
        sent = time.monotonic()
        res = await self.begin(**req)
        while res.outcome == _api.Outcome.OUTCOME_IN_PROGRESS and res.record.state != _api.State.STATE_UNKNOWN:
            left = MAX_BEGIN_WAIT if wait_until is None else min(MAX_BEGIN_WAIT, wait_until - time.monotonic())
            if left <= 0:
                return res, sent
            start = sent = time.monotonic()
            res = await self.begin(**dict(req, wait=left))
            if res.outcome == _api.Outcome.OUTCOME_IN_PROGRESS and time.monotonic() - start < left / 2:
                await asyncio.sleep(min(_seconds(res.retry_after) or 0.1, left))
        return res, sent

    async def _release(self, req, token=None):
        """As idemcoord.Client._release: ends with Fail ABANDONED what a Begin nobody will act on acquired; never raises."""
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT) if hasattr(asyncio, "timeout") else _Nothing():
                if not token:
                    res = await self.begin(**_without_wait(req), timeout=RELEASE_TIMEOUT)
                    if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
                        return
                    token = res.lease_token
                await self.fail(**_release_fail(req, token), timeout=RELEASE_TIMEOUT)
        except Exception as err:
            self._log.warning("idemcoord: could not release an acquisition nobody will act on of %s/%s; the key "
                              "stays held until its lease runs out: %s", req["scope"], req["key"], err)

    def _run_in_background(self, coro):
        t = asyncio.ensure_future(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def shutdown(self, timeout=None):
        """Waits for background endings (at most timeout seconds), then closes the channel."""
        if self._background:
            _, pending = await asyncio.wait(list(self._background), timeout=timeout)
            for t in pending:
                t.cancel()
        await self._channel.close()

    close = shutdown


class _Nothing:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class _AsyncHolder(_HolderBase):
    """An acquisition this task holds: heartbeats while fn runs, then ends it."""

    def __init__(self, client, req, res, sent):
        super().__init__(client, req, res, sent)
        self.started = False

    async def heartbeat(self, timeout=None):
        res = await self.client.heartbeat(timeout=timeout, **self._heartbeat_fields())
        return _lease_length(res.record)

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
        confirmed = self.sent
        if time.monotonic() - confirmed > self.length / 3:
            sent = time.monotonic()
            try:
                length = await self.heartbeat(timeout=max(self.length / 3, MIN_HEARTBEAT))
                confirmed = sent
                if length > 0:
                    self.length = length
            except grpc.aio.AioRpcError as err:
                if _lease_gone(err):
                    self.lost = True
                    return None
        if time.monotonic() >= confirmed + self.length - self.margin:
            return None
        self.started = True
        beats = asyncio.ensure_future(self._keep_alive(attempt, on_cancel, confirmed))

        async def stop() -> None:
            beats.cancel()
            try:
                await beats
            except asyncio.CancelledError:
                pass
        return stop

    async def run(self, fn):
        """Runs fn(attempt) with heartbeats; returns (value, error, marked, started)."""
        attempt = Attempt(self.info)
        task = None

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
        value = error = None
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

    async def _keep_alive(self, attempt: Attempt, on_cancel: Callable[[], None], confirmed: float) -> None:
        until = confirmed + self.length - self.margin
        next_beat = confirmed + max(self.length / 3, MIN_HEARTBEAT)
        while True:
            now = time.monotonic()
            if now >= until:
                attempt.cancel(LeaseUnconfirmed())
                on_cancel()
                return
            await asyncio.sleep(max(0.0, min(next_beat, until) - now))
            if time.monotonic() < next_beat:
                continue
            sent = time.monotonic()
            try:
                length = await self.heartbeat(timeout=max(self.length / 3, MIN_HEARTBEAT))
                granted = length if length > 0 else self.length
                until = sent + granted - self.margin
                next_beat = sent + max(granted / 3, MIN_HEARTBEAT)
            except grpc.aio.AioRpcError as err:
                if _lease_gone(err):
                    self.lost = True
                    attempt.cancel(LeaseLost())
                    on_cancel()
                    return
                next_beat = time.monotonic() + max(self.length / 12, MIN_HEARTBEAT)

    async def _send(self, ending, timeout):
        method, fields = self._ending_call(ending)
        return await getattr(self.client, method)(timeout=timeout, **fields)

    async def finish(self, **ending):
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
            return err

    async def _finish_later(self, ending):
        give_up = time.monotonic() + self.length
        delay = 0.1
        while time.monotonic() < give_up:
            await asyncio.sleep(delay)
            try:
                await self._send(ending, FINISH_TIMEOUT)
                return
            except grpc.aio.AioRpcError as err:
                if not _unreachable(err):
                    return
            try:
                await self.heartbeat(timeout=FINISH_TIMEOUT)
            except grpc.aio.AioRpcError:
                pass
            delay = min(delay * 2, 2.0)
        self.client._log.error("idemcoord: gave up ending an attempt on %s/%s; the record will read UNKNOWN once "
                               "its lease runs out", self.scope, self.key)


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """The asyncio twin of idemcoord.grpc.ServerInterceptor, for grpc.aio servers; client is an idemcoord.aio.Client.

    Options are idemcoord.grpc.ServerInterceptor's. A call cancelled while
    Begin is in flight or waiting releases what that Begin acquired.
    """

    def __init__(self, client, **options):
        from . import grpc as _sync  # idemcoord.grpc: options and method resolution, shared
        self.client = client
        self._sync = _sync
        if options.get("principal") is None and not options.get("without_principal"):
            from ._http import warn_undecided_principal
            warn_undecided_principal("idemcoord.aio.ServerInterceptor")
            options["without_principal"] = True  # warned once, here
        self._r = _sync.ServerInterceptor(client, **options)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        m = self._r._method(handler_call_details.method)
        if m is None:
            return handler
        full_method = handler_call_details.method
        behavior = handler.unary_unary

        async def guarded(request, context):
            return await self._guard(full_method, m, behavior, request, context)
        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)

    async def _guard(self, full_method, m, behavior, request, context):
        r, c, s = self._r, self.client, self._sync
        keys = {v for k, v in context.invocation_metadata() if k == s.KEY_METADATA}
        if len(keys) > 1:
            await context.abort(_C.INVALID_ARGUMENT, "two different idempotency-key values")
        key = r.key(request, context) if r.key else (next(iter(keys)) if keys else "")
        if not key:
            if r.require_key:
                await context.abort(_C.INVALID_ARGUMENT, "this method requires an idempotency-key")
            return await behavior(request, context)
        if r.principal is not None:
            key = s.fold_principal(r.principal(context), key)
        if r.fingerprint is not None:
            fp = r.fingerprint(request, context)
        else:
            fp = s.hashlib.sha256(full_method.encode() + b"\n" + request.SerializeToString(deterministic=True)).digest()
        breq = dict(scope=r.scope(full_method), key=key, fingerprint=bytes(fp or b""), attempt_id=_new_attempt_id(),
                    accept_schema_versions=[m.schema, s.SCHEMA_VERSION_STATUS])
        if c._lease is not None:
            breq["lease"] = c._lease
        remaining = context.time_remaining()
        wait = r.wait if remaining is None else max(min(r.wait, remaining - 0.05), 0.0)
        try:
            res, sent = await c._begin_waiting(breq, time.monotonic() + wait)
        except asyncio.CancelledError:
            await asyncio.shield(c._release(breq))
            raise
        except grpc.aio.AioRpcError as err:
            if _answer_lost(err):
                c._run_in_background(c._release(breq))
            code = err.code()
            if code in (_C.FAILED_PRECONDITION, _C.INVALID_ARGUMENT):
                # grpc.aio's abort replaces the trailing metadata with its own argument
                await context.abort(code, err.details(), tuple((k, v) for k, v in (err.trailing_metadata() or ())
                                                               if k == "grpc-status-details-bin"))
            if code in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED):
                if r.fail_open:
                    return await behavior(request, context)
                await context.abort(_C.UNAVAILABLE, "idempotency coordinator unavailable; retry later")
            if code == _C.RESOURCE_EXHAUSTED:
                await context.abort(_C.RESOURCE_EXHAUSTED, "idempotency coordinator rate limit reached; retry later")
            await context.abort(_C.INTERNAL, "idempotency coordinator refused the call")
        rec = res.record
        if res.outcome == _api.Outcome.OUTCOME_REPLAY:
            return await self._replay(m, rec, context)
        if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
            if rec.state == _api.State.STATE_UNKNOWN:
                st = _api.Status(code=_C.FAILED_PRECONDITION.value[0],
                                 message="the outcome of an earlier attempt with this idempotency key is unknown "
                                         "and held for an operator")
                st.details.add(type_url="type.googleapis.com/google.rpc.ErrorInfo",
                               value=s._error_info(s.REASON_UNKNOWN_HELD))
                await context.abort(_C.FAILED_PRECONDITION, st.message,
                                    (("grpc-status-details-bin", st.SerializeToString()),))
            retry_ms = max(int(_seconds(res.retry_after) * 1000), 1)
            await context.abort(_C.ABORTED, "another attempt with this idempotency key is in progress; retry after %d ms"
                                % retry_ms, ((s.PUSHBACK_TRAILER, str(retry_ms)),))
        holder = _AsyncHolder(c, breq, res, sent)
        hctx = _HandlerContext(context)
        running = asyncio.ensure_future(holder.run(lambda attempt: behavior(request, hctx)))
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

    async def _record_later(self, m, holder: "_AsyncHolder", hctx: "_HandlerContext", running: "asyncio.Future[Any]",
                            context: Any) -> None:
        """Records the outcome of a handler that runs on after its call was cancelled; answers nobody."""
        try:
            response, error, marked, started = await running
            await self._record(m, holder, hctx, context, response, error, marked, started)
        except Exception:  # the call is gone: what _record would answer reaches no one
            pass

    async def _record(self, m, holder: "_AsyncHolder", hctx: "_HandlerContext", context: Any, response: Any,
                      error: Optional[BaseException], marked: bool, started: bool) -> Any:
        """Records the handler's outcome, then answers it (returns the response, or aborts)."""
        r, s = self._r, self._sync
        if holder.lost:
            if error is not None:
                await context.abort(_C.ABORTED, "the idempotency key was taken over by another attempt; retry")
            return response
        if not started:
            await holder.finish(kind="FAILURE_KIND_ABANDONED", reason="the lease could not be confirmed before the handler started")
            await context.abort(_C.UNAVAILABLE, "idempotency coordinator unavailable; retry later")
        code = s._code_of(hctx)
        if error is None and code in (None, _C.OK):
            try:
                body = response.SerializeToString(deterministic=True)
            except Exception:
                await holder.finish(kind="FAILURE_KIND_UNKNOWN", reason="the handler's response could not be encoded for storage")
                return response
            err = await holder.finish(complete=_api.StoredResponse(schema_version=m.schema,
                                                                   content_type=s.CONTENT_TYPE_PROTO, body=body))
            if err is None:
                await context.send_initial_metadata([(s.RESULT_HEADER, "created")])
            return response
        if code in (None, _C.OK):
            code = _C.UNKNOWN
        details = s._details_of(hctx) or str(error or "")
        kind = "FAILURE_KIND_UNKNOWN" if marked else r.kinds.get(code, "FAILURE_KIND_UNKNOWN")
        ending = dict(kind=kind, reason=_fail_reason(details))
        if kind == "FAILURE_KIND_REPLAYABLE":
            ending["response"] = _status_response(s._StatusCarrier(code, details))
        err = await holder.finish(**ending)
        trailing = hctx.aborted[2] if hctx.aborted else tuple(s._trailing(context))
        if err is None and kind == "FAILURE_KIND_REPLAYABLE":
            trailing += ((s.RESULT_HEADER, "created"),)
        if error is not None and hctx.aborted is None:
            raise error  # an exception, answered UNKNOWN by the server
        # grpc.aio takes one abort per call, with its trailers: the
        # handler's abort was held (_HandlerContext) and is made here.
        await context.abort(code, details, trailing)

    async def _replay(self, m, rec, context):
        s = self._sync
        stored = rec.response
        if rec.state == _api.State.STATE_FAILED_REPLAYABLE:
            code, message = _C.FAILED_PRECONDITION, rec.failure_reason or "replayed failure"
            trailing = [(s.RESULT_HEADER, "replayed")]
            if stored.schema_version == s.SCHEMA_VERSION_STATUS:
                st = _api.Status()
                st.ParseFromString(stored.body)
                if st.code != 0:
                    code, message = s._CODES.get(st.code, _C.UNKNOWN), st.message
                    trailing.append(("grpc-status-details-bin", bytes(stored.body)))
            await context.abort(code, message, tuple(trailing))
        if stored.schema_version != m.schema:
            await context.abort(_C.INTERNAL, "the stored response for this idempotency key has schema version "
                                + stored.schema_version)
        out = m.output_class.FromString(stored.body)
        await context.send_initial_metadata([(s.RESULT_HEADER, "replayed")])
        return out


class _HandlerAbort(Exception):
    """The handler's context.abort, held by _HandlerContext until the outcome is recorded."""


class _HandlerContext:
    """The grpc.aio ServicerContext the handler sees: everything passes through but abort, which is held.

    grpc.aio sends an abort with the trailers given to it (one abort per
    call), so the interceptor makes the abort itself once it knows whether
    to add "idempotency-result: created".
    """

    def __init__(self, context):
        self._context = context
        self.aborted = None

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def abort(self, code, details="", trailing_metadata=()):
        self.aborted = (code, details, tuple(trailing_metadata or ()))
        raise _HandlerAbort(details)

    def code(self):
        return self.aborted[0] if self.aborted else self._context.code()

    def details(self):
        return self.aborted[1] if self.aborted else self._context.details()
