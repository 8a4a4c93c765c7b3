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
import random
import time

import grpc
import grpc.aio

from . import _api
from .client import (DEFAULT_LEASE, MAX_BEGIN_WAIT, MIN_HEARTBEAT, RELEASE_REASON, RELEASE_TIMEOUT, Attempt, Lease,
                     Result, _C, _code, _credentials, _current, _duration, _fail_reason, _failure_kind,
                     _lease_gone, _lease_length, _new_attempt_id, _seconds, _status_response, _stored_failure,
                     _unreachable)
from .errors import FailureError, LeaseLost, LeaseUnconfirmed, UnknownHeld

FINISH_TIMEOUT = 5.0


def _answer_lost(err):
    return isinstance(err, asyncio.CancelledError) or _code(err) in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED, _C.CANCELLED)


class Client:
    """Calls an idemcoord coordinator from asyncio code; arguments as idemcoord.Client's."""

    def __init__(self, address, token=None, tls=None, *, max_attempts=5, backoff=0.1, max_backoff=2.0, timeout=10.0,
                 lease=None, options=(), logger=None):
        creds = _credentials(tls)
        self._channel = (grpc.aio.secure_channel(address, creds, options) if creds
                         else grpc.aio.insecure_channel(address, options))
        self._metadata = (("authorization", "Bearer " + token),) if token else ()
        self._max_attempts = max(1, max_attempts)
        self._backoff, self._max_backoff, self._timeout = backoff, max_backoff, timeout
        self._lease = _duration(lease)
        self._log = logger or logging.getLogger("idemcoord")
        self._stubs = {
            m: self._channel.unary_unary("/%s/%s" % (_api.SERVICE, m), request_serializer=lambda r: r.SerializeToString(),
                                         response_deserializer=_api.RESPONSES[m].FromString)
            for m in _api.METHODS
        }
        self._background = set()

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
        for name in ("ttl", "lease", "wait"):
            if fields.get(name) is not None:
                fields[name] = _duration(fields[name])
        fields.setdefault("attempt_id", _new_attempt_id())
        if not fields["attempt_id"]:
            fields["attempt_id"] = _new_attempt_id()
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
        breq = dict(scope=scope, key=key, fingerprint=bytes(fingerprint or b""), attempt_id=_new_attempt_id())
        if self._lease is not None:
            breq["lease"] = self._lease
        try:
            res, sent = await self._begin_waiting(breq, wait_until)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as err:
            if _answer_lost(err):
                await asyncio.shield(self._release(breq))
            raise
        rec = res.record
        if res.outcome == _api.Outcome.OUTCOME_REPLAY:
            result = Result(rec.response, True, rec.state, rec.attempt)
            if rec.state == _api.State.STATE_FAILED_REPLAYABLE:
                raise _stored_failure(rec, result)
            return result
        if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
            if rec.state == _api.State.STATE_UNKNOWN:
                raise UnknownHeld()
            raise TimeoutError("idemcoord: another attempt with this idempotency key is still in progress")
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
        if error is None:
            response = value if value is not None else _api.StoredResponse()
            if isinstance(response, dict):
                response = _api.StoredResponse(**response)
            err = await holder.finish(complete=response)
            if err is not None:
                raise err
            return Result(response, False, _api.State.STATE_COMPLETED, rec.attempt)
        kind = _failure_kind(error, marked)
        reason = _fail_reason(error)
        if kind != "FAILURE_KIND_REPLAYABLE":
            err = await holder.finish(kind=kind, reason=reason)
            if err is not None:
                raise err from error
            raise error
        if isinstance(error, FailureError) and error.response is not None:
            response = error.response
            if isinstance(response, dict):
                response = _api.StoredResponse(**response)
        else:
            response = _status_response(error)
        result = Result(response, False, _api.State.STATE_FAILED_REPLAYABLE, rec.attempt)
        err = await holder.finish(kind=kind, response=response, reason=reason)
        if err is not None:
            raise err from error
        raise _stored_failure(_api.Record(response=response, failure_reason=reason), result) from error

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
                    res = await self.begin(**{k: v for k, v in req.items() if k != "wait"}, timeout=RELEASE_TIMEOUT)
                    if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
                        return
                    token = res.lease_token
                await self.fail(scope=req["scope"], key=req["key"], lease_token=token, kind="FAILURE_KIND_ABANDONED",
                                reason=RELEASE_REASON, timeout=RELEASE_TIMEOUT)
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


class _AsyncHolder:
    """An acquisition this task holds: heartbeats while fn runs, then ends it."""

    def __init__(self, client, req, res, sent):
        self.client = client
        self.scope, self.key = req["scope"], req["key"]
        self.token = res.lease_token
        self.request = req.get("lease")
        rec = res.record
        self.length = _seconds(self.request) if self.request is not None else _lease_length(rec)
        if self.length <= 0:
            self.length = DEFAULT_LEASE
        self.info = Lease(self.scope, self.key, self.token, rec.generation, rec.attempt, res.previous_state,
                          bool(getattr(rec, "uncertain", False)))
        self.sent = sent
        self.lost = False
        self.started = False

    @property
    def margin(self):
        return max(self.length / 10, MIN_HEARTBEAT)

    async def heartbeat(self, timeout=None):
        res = await self.client.heartbeat(scope=self.scope, key=self.key, lease_token=self.token, lease=self.request,
                                          timeout=timeout)
        return _lease_length(res.record)

    async def run(self, fn):
        """Runs fn(attempt) with heartbeats; returns (value, error, marked, started)."""
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
                    return None, None, False, False
        if time.monotonic() >= confirmed + self.length - self.margin:
            return None, None, False, False
        attempt = Attempt(self.info)
        self.started = True
        token = _current.set(attempt)
        try:
            task = asyncio.ensure_future(fn(attempt))
        finally:
            _current.reset(token)
        beats = asyncio.ensure_future(self._keep_alive(attempt, task, confirmed))
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
            beats.cancel()
            try:
                await beats
            except asyncio.CancelledError:
                pass
        return value, error, attempt._marked, True

    async def _keep_alive(self, attempt, task, confirmed):
        until = confirmed + self.length - self.margin
        next_beat = confirmed + max(self.length / 3, MIN_HEARTBEAT)
        while True:
            now = time.monotonic()
            if now >= until:
                attempt.cancel(LeaseUnconfirmed())
                task.cancel()
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
                    task.cancel()
                    return
                next_beat = time.monotonic() + max(self.length / 12, MIN_HEARTBEAT)

    async def _send(self, ending, timeout):
        base = dict(scope=self.scope, key=self.key, lease_token=self.token)
        if "complete" in ending:
            return await self.client.complete(response=ending["complete"], timeout=timeout, **base)
        return await self.client.fail(kind=ending["kind"], response=ending.get("response"),
                                      reason=ending.get("reason", ""), timeout=timeout, **base)

    async def finish(self, **ending):
        """Ends the attempt; None when done or retrying in the background, else the refusal."""
        try:
            await self._send(ending, FINISH_TIMEOUT)
            return None
        except grpc.aio.AioRpcError as err:
            if _unreachable(err):
                self.client._run_in_background(self._finish_later(ending))
                return None
            if err.code() == _C.INVALID_ARGUMENT and ("complete" in ending or ending.get("response") is not None):
                return await self.finish(kind="FAILURE_KIND_UNKNOWN", reason=_fail_reason("response not stored: %s" % err))
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
