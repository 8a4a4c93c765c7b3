"""The Client: typed calls with retries, and once."""

import concurrent.futures
import contextvars
import dataclasses
import datetime
import logging
import random
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import grpc

from . import _api
from .errors import (CONTENT_TYPE_PROTO, SCHEMA_VERSION_STATUS, FailureError, LeaseLost, LeaseUnconfirmed,
                     StoredFailure, UnknownHeld)

from . import _core, _tables
from ._core import _C, CODES as _CODES, duration as _duration, fail_reason as _fail_reason, seconds as _seconds
from ._core import code_of_error as _code, lease_length as _lease_length, new_attempt_id as _new_attempt_id
from ._http import error_reason as _error_reason
from ._tables import (DEFAULT_LEASE, FINISH_TIMEOUT, MAX_BEGIN_WAIT, MIN_HEARTBEAT, RELEASE_REASON,  # noqa: F401
                      RELEASE_TIMEOUT)

CANCEL_POLL = 0.05  # how often a call made for once looks at the caller's cancel_event

# How fn's errors are recorded by gRPC code (shared_tables.json, as every library records them).
DEFAULT_FAILURE_KINDS = _tables.FAILURE_KINDS

_current: "contextvars.ContextVar[Optional[Attempt]]" = contextvars.ContextVar("idemcoord_attempt", default=None)


@dataclasses.dataclass(frozen=True)
class Lease:
    """The acquisition a function run by once holds: enough to fence its own writes."""

    scope: str
    key: str  # as stored
    token: str  # the fencing token
    generation: int
    attempt: int
    previous: int  # a State; STATE_UNKNOWN: an earlier attempt may have done the side effect
    uncertain: bool


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A recovery point: the step phase of a multi-step operation is done, with the data the next attempt needs.

    See checkpoint and checkpoint_from.
    """

    phase: str
    data: bytes
    at: Optional[datetime.datetime]  # when the coordinator recorded it (UTC); None when not told


def _checkpoint_of(rec: Any) -> Optional[Checkpoint]:
    """The checkpoint of a Record message, or None."""
    if rec is None or not rec.HasField("checkpoint") or not rec.checkpoint.phase:
        return None
    c = rec.checkpoint
    at = c.at.ToDatetime(tzinfo=datetime.timezone.utc) if c.HasField("at") else None
    return Checkpoint(str(c.phase), bytes(c.data), at)


def _later_checkpoint(own: Optional[Checkpoint], new: Checkpoint) -> Checkpoint:
    """Of an attempt's checkpoint so far and one just answered, the one the coordinator wrote last.

    Concurrent checkpoint calls may be answered in another order than they were written; a
    checkpoint's ``at`` is the coordinator's time of writing it.
    """
    if own is None or own.at is None or new.at is None or new.at >= own.at:
        return new
    return own


def _checkpoint_phase(phase: str) -> str:
    """phase, or TypeError when it is not a str (protobuf would take bytes, and checkpoint_from answer them)."""
    if not isinstance(phase, str):
        raise TypeError("idemcoord: a checkpoint's phase must be a str, not %s" % type(phase).__name__)
    return phase


def _checkpoint_data(data: Union[bytes, bytearray, memoryview, str]) -> bytes:
    """A checkpoint's data as bytes (a str is UTF-8); TypeError for anything else.

    bytes() alone would take an int as a length (42 becomes 42 NUL bytes)
    and an iterable of ints as the bytes themselves.
    """
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError("idemcoord: checkpoint data must be bytes, bytearray, memoryview or str, not %s" % type(data).__name__)


@dataclasses.dataclass
class Result:
    """The recorded outcome of a key, as once returns it."""

    response: object  # a StoredResponse: fn's when this call ran it, else the stored one
    replayed: bool  # fn did not run in this call
    state: int  # STATE_COMPLETED or STATE_FAILED_REPLAYABLE
    attempt: int  # the attempt that produced response


class Attempt:
    """What fn receives: the lease, the side-effect mark and the cancellation.

    Python cannot stop a running function: fn checks cancelled (or calls
    raise_if_cancelled) between its steps. It is set when the caller's
    cancel event is set, when the lease was lost (reason LeaseLost) and when
    it cannot be confirmed before it runs out (reason LeaseUnconfirmed).
    """

    def __init__(self, lease: Lease, cancel_event: Optional[threading.Event] = None,
                 holder: "Optional[_HolderBase]" = None):
        self.lease = lease
        self.cancelled = threading.Event()
        self.reason: Optional[BaseException] = None
        self._marked = False
        self._outer = cancel_event
        self._holder = holder

    def mark_side_effect(self) -> None:
        """See idemcoord.mark_side_effect."""
        self._marked = True

    def checkpoint(self, phase: str, data: Union[bytes, bytearray, memoryview, str] = b"") -> None:
        """See idemcoord.checkpoint (in an asyncio attempt: await idemcoord.aio.checkpoint)."""
        if self._holder is None:
            raise RuntimeError("idemcoord: this attempt cannot record checkpoints")
        self._holder.checkpoint_sync(_checkpoint_phase(phase), _checkpoint_data(data))

    async def checkpoint_async(self, phase: str, data: Union[bytes, bytearray, memoryview, str] = b"") -> None:
        """See idemcoord.aio.checkpoint."""
        if self._holder is None:
            raise RuntimeError("idemcoord: this attempt cannot record checkpoints")
        await self._holder.checkpoint_async(_checkpoint_phase(phase), _checkpoint_data(data))

    def checkpoint_from(self) -> Optional[Checkpoint]:
        """See idemcoord.checkpoint_from."""
        return self._holder.checkpoint_from() if self._holder is not None else None

    def cancel(self, reason: BaseException) -> None:
        if not self.cancelled.is_set():
            self.reason = reason
            self.cancelled.set()

    def raise_if_cancelled(self) -> None:
        """Raises the reason when the attempt was cancelled."""
        if self._outer is not None and self._outer.is_set():
            self.cancel(self.reason or RuntimeError("idemcoord: cancelled by the caller"))
        if self.cancelled.is_set():
            assert self.reason is not None  # cancel sets it first
            raise self.reason


def mark_side_effect() -> None:
    """Marks, inside a function once runs, that its first irreversible step is about to happen.

    After it, any exception ends the attempt FAILURE_KIND_UNKNOWN (a
    FailureError naming FAILURE_KIND_REPLAYABLE is still stored as such).
    Outside such a function it does nothing.
    """
    attempt = _current.get()
    if attempt is not None:
        attempt.mark_side_effect()


def current_lease() -> Optional[Lease]:
    """The Lease of the attempt a function run by once is in, or None outside one."""
    attempt = _current.get()
    return attempt.lease if attempt is not None else None


def checkpoint(phase: str, data: Union[bytes, bytearray, memoryview, str] = b"") -> None:
    """Records a recovery point of the attempt in progress: the step phase is done, with data (a str is UTF-8).

    Inside a function once runs, a handler of the WSGI middleware or of the
    gRPC guard (in asyncio code: await idemcoord.aio.checkpoint). It sends a
    Heartbeat with the lease token and the checkpoint, which also extends
    the lease. If this attempt dies, the next attempt of the key reads it
    with checkpoint_from and skips the steps before it. Call it after the
    step's effect is durable; mark_side_effect still applies to the work
    after it. Raises LeaseLost when another attempt took the key over
    (nothing recorded), the coordinator's INVALID_ARGUMENT for a phase that
    is not 1-128 printable bytes or data over its limit (64 KiB by
    default), and RuntimeError outside an attempt. An attempt that recorded
    a checkpoint is never ended ABANDONED by the library: RETRYABLE
    instead, which keeps the checkpoint.
    """
    attempt = _current.get()
    if attempt is None:
        raise RuntimeError("idemcoord: checkpoint outside an attempt (no handler or once function with an idempotency key)")
    attempt.checkpoint(phase, data)


def checkpoint_from() -> Optional[Checkpoint]:
    """The checkpoint of the attempt in progress: the last one it recorded, else the one it resumes after.

    The one it resumes after is an earlier attempt's, returned by the Begin
    that acquired the key. None when there is none, and outside an attempt.
    """
    attempt = _current.get()
    return attempt.checkpoint_from() if attempt is not None else None


def _unreachable(err: object) -> bool:
    return _code(err) in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED, _C.RESOURCE_EXHAUSTED, _C.CANCELLED)


def _answer_lost(err: object) -> bool:
    """Whether a call that raised err may have been carried out without its answer reaching us."""
    return isinstance(err, concurrent.futures.CancelledError) or _code(err) in (
        _C.UNAVAILABLE, _C.DEADLINE_EXCEEDED, _C.CANCELLED)


def _cancelled() -> concurrent.futures.CancelledError:
    return concurrent.futures.CancelledError("idemcoord: cancelled by the caller before the function started")


def _lease_gone(err: object) -> bool:
    return _code(err) in (_C.FAILED_PRECONDITION, _C.NOT_FOUND)


def _credentials(tls: Any) -> Any:
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, dict):
        return grpc.ssl_channel_credentials(**tls)
    return None


def _status_response(err: BaseException) -> Any:
    code = _code(err) or _C.UNKNOWN
    details = err.details() if isinstance(err, grpc.RpcError) and callable(getattr(err, "details", None)) else str(err)
    body = _api.Status(code=code.value[0], message=details or "").SerializeToString(deterministic=True)
    return _api.StoredResponse(schema_version=SCHEMA_VERSION_STATUS, content_type=CONTENT_TYPE_PROTO, body=body,
                               status_code=code.value[0])


def _stored_failure(record: Any, result: "Result") -> StoredFailure:
    resp = record.response
    if resp.schema_version == SCHEMA_VERSION_STATUS:
        st = _api.Status()
        try:
            st.ParseFromString(resp.body)
        except Exception:  # not a google.rpc.Status after all
            st = None
        if st is not None and st.code != 0:
            return StoredFailure(_CODES.get(st.code, _C.UNKNOWN), st.message, result)
    code = _C.FAILED_PRECONDITION
    if 0 < resp.status_code <= 16:
        code = _CODES[resp.status_code]
    return StoredFailure(code, record.failure_reason or "replayed failure", result)


def _failure_kind(err: BaseException, marked: bool) -> str:
    if isinstance(err, FailureError) and err.kind:
        kind: str = err.kind if isinstance(err.kind, str) else _api.FailureKind.Name(err.kind)
        if kind != "FAILURE_KIND_UNSPECIFIED":
            return "FAILURE_KIND_UNKNOWN" if marked and kind != "FAILURE_KIND_REPLAYABLE" else kind
    if marked:
        return "FAILURE_KIND_UNKNOWN"
    return DEFAULT_FAILURE_KINDS.get(_code(err), "FAILURE_KIND_UNKNOWN")


# The I/O-free parts of once, shared by Client and idemcoord.aio.Client.

def _begin_fields(fields: Dict[str, Any]) -> Dict[str, Any]:
    """Begin's fields as sent: durations as Durations, and a fresh attempt_id unless one is given."""
    for name in ("ttl", "lease", "wait"):
        if fields.get(name) is not None:
            fields[name] = _duration(fields[name])
    if not fields.get("attempt_id"):
        fields["attempt_id"] = _new_attempt_id()
    return fields


def _once_request(scope: str, key: str, fingerprint: Optional[bytes], lease: Any) -> Dict[str, Any]:
    """The Begin request once sends."""
    breq: Dict[str, Any] = dict(scope=scope, key=key, fingerprint=bytes(fingerprint or b""), attempt_id=_new_attempt_id())
    if lease is not None:
        breq["lease"] = lease
    return breq


def _begin_outcome(res: Any, cancel_event: Optional[threading.Event] = None) -> Optional["Result"]:
    """What once makes of Begin's last answer: the Result of a replay, or None when it acquired the key.

    Raises the stored failure of a replayed one, UnknownHeld, and, while
    another attempt holds the key, concurrent.futures.CancelledError when
    cancel_event is set, else TimeoutError.
    """
    rec = res.record
    if res.outcome == _api.Outcome.OUTCOME_REPLAY:
        result = Result(rec.response, True, rec.state, rec.attempt)
        if rec.state == _api.State.STATE_FAILED_REPLAYABLE:
            raise _stored_failure(rec, result)
        return result
    if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
        if rec.state == _api.State.STATE_UNKNOWN:
            raise UnknownHeld()
        if cancel_event is not None and cancel_event.is_set():
            raise _cancelled()
        raise TimeoutError("idemcoord: another attempt with this idempotency key is still in progress")
    return None


def _stored_response(response: Any) -> Any:
    return _api.StoredResponse(**response) if isinstance(response, dict) else response


def _once_ending(value: Any, error: Optional[BaseException], marked: bool, attempt: int
                 ) -> Tuple[Dict[str, Any], Union["Result", BaseException]]:
    """How once ends an attempt whose fn returned value or raised error.

    Returns (ending, outcome): ending, the keywords of the holder's finish;
    outcome, the Result to return, or the exception to raise (error itself,
    or the StoredFailure of a replayable error).
    """
    if error is None:
        response = _stored_response(value if value is not None else _api.StoredResponse())
        return dict(complete=response), Result(response, False, _api.State.STATE_COMPLETED, attempt)
    kind = _failure_kind(error, marked)
    reason = _fail_reason(error)
    if kind != "FAILURE_KIND_REPLAYABLE":
        return dict(kind=kind, reason=reason), error
    if isinstance(error, FailureError) and error.response is not None:
        response = _stored_response(error.response)
    else:
        response = _status_response(error)
    result = Result(response, False, _api.State.STATE_FAILED_REPLAYABLE, attempt)
    failure = _stored_failure(_api.Record(response=response, failure_reason=reason), result)
    return dict(kind=kind, response=response, reason=reason), failure


def _once_result(error: Optional[BaseException], outcome: Union["Result", BaseException],
                 finish_err: Optional[BaseException]) -> "Result":
    """Returns or raises what once does once the ending (see _once_ending) was sent, refused with finish_err or not."""
    if finish_err is not None:
        if error is None:
            raise finish_err
        raise finish_err from error
    if isinstance(outcome, Result):
        return outcome
    if outcome is error:
        raise error
    raise outcome from error


def _without_wait(req: Mapping[str, Any]) -> Dict[str, Any]:
    """The Begin a release re-sends: req without its wait."""
    return {k: v for k, v in req.items() if k != "wait"}


def _release_fail(req: Mapping[str, Any], token: str) -> Dict[str, Any]:
    """The Fail fields that release the acquisition token of req's key."""
    return dict(scope=req["scope"], key=req["key"], lease_token=token, kind="FAILURE_KIND_ABANDONED",
                reason=RELEASE_REASON)


# How soon a channel tries again to connect to a coordinator it lost (a
# restart, a failover), in milliseconds. gRPC's own backoff grows to two
# minutes; with it a client took about 13 s to serve again after a restart,
# while the lease of an attempt in flight ran out.
RECONNECT_BACKOFF_MS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                        ("grpc.max_reconnect_backoff_ms", 1000))


def _channel_options(options: Sequence[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    """options with the reconnect backoff of RECONNECT_BACKOFF_MS where options do not set it."""
    given = {name for name, _ in options}
    return list(options) + [(name, v) for name, v in RECONNECT_BACKOFF_MS if name not in given]


class _Settings:
    """What Client and idemcoord.aio.Client share: the call settings and the stubs, set by _configure."""

    _metadata: Tuple[Tuple[str, str], ...]
    _max_attempts: int
    _backoff: float
    _max_backoff: float
    _timeout: float
    _lease: Any  # a google.protobuf.Duration, or None: the coordinator's default
    _log: logging.Logger
    _stubs: Dict[str, Any]
    _batch_stub: Any
    _rounds: Optional[_core.BatchRounds]  # None without call_batching


def _configure(client: _Settings, channel: Any, token: Optional[str], max_attempts: int, backoff: float,
               max_backoff: float, timeout: float, lease: Any, logger: Optional[logging.Logger],
               call_batching: int = 0) -> None:
    """Sets what Client and idemcoord.aio.Client share: the call settings, and the stubs on channel."""
    client._metadata = (("authorization", "Bearer " + token),) if token else ()
    client._max_attempts = max(1, max_attempts)
    client._backoff, client._max_backoff, client._timeout = backoff, max_backoff, timeout
    client._lease = _duration(lease)
    client._log = logger or logging.getLogger("idemcoord")
    client._stubs = {
        m: channel.unary_unary("/%s/%s" % (_api.SERVICE, m), request_serializer=lambda r: r.SerializeToString(),
                               response_deserializer=_api.RESPONSES[m].FromString)
        for m in _api.METHODS
    }
    client._batch_stub = channel.unary_unary("/%s/Batch" % _api.SERVICE, request_serializer=lambda r: r.SerializeToString(),
                                             response_deserializer=_api.BatchResponse.FromString)
    client._rounds = _core.BatchRounds(call_batching) if call_batching > 0 else None


class Client(_Settings):
    """Calls an idemcoord coordinator. Safe for concurrent use from many threads.

    Every call is retried with backoff while the coordinator answers
    UNAVAILABLE, since each is safe to repeat: begin carries an attempt_id
    (the same on each retry), and the coordinator answers a repeated
    complete or fail with the same token and content OK.

    token is sent as "authorization: Bearer <token>". tls: None or False for
    plaintext, True for TLS with the system roots, a dict of
    grpc.ssl_channel_credentials arguments, or grpc.ChannelCredentials.
    Durations (ttl, lease, wait, timeout, backoff) are seconds or timedeltas.

    call_batching=N (N > 0) makes concurrent calls share RPCs: begin
    (without a wait), complete, fail, lookup and heartbeat calls, from any
    thread, go to the coordinator's Batch method, at most N Batch RPCs at a
    time. Nothing waits for a batch to fill: while fewer than N are in
    flight a call is sent at once; the calls that arrive meanwhile go
    together in the next one. Each call keeps its own answer or error (the
    same exception, code, details and trailing metadata as its unary
    call), its own timeout, and its own retries (a Batch RPC that fails
    UNAVAILABLE fails each of its calls so, and each retries as its unary
    call would). A Begin with a wait, or a request over 64 KiB, goes
    unary; every call does once the coordinator answers that it has no
    Batch method. A Begin whose caller gives up (its timeout, its
    cancel_event) after it was sent waits for its answer (at most a few
    seconds) and releases what it acquired (Fail ABANDONED), since the
    coordinator cannot see that one call of a Batch was given up. 2 is a
    good value; 0 (the default) sends every call as its own RPC. Client
    interceptors see the Batch RPCs. The threads that send the rounds
    (at most N) end when nothing is queued, and shutdown waits for them.
    """

    def __init__(self, address: str, token: Optional[str] = None, tls: Any = None, *, max_attempts: int = 5,
                 backoff: float = 0.1, max_backoff: float = 2.0, timeout: float = 10.0, lease: Any = None,
                 interceptors: Sequence[Any] = (), options: Sequence[Tuple[str, Any]] = (),
                 logger: Optional[logging.Logger] = None, call_batching: int = 0):
        options = _channel_options(options)
        # What an asyncio twin of this client is built from (idemcoord.aio.Client.like).
        self._settings: Dict[str, Any] = dict(address=address, token=token, tls=tls, max_attempts=max_attempts, backoff=backoff,
                              max_backoff=max_backoff, timeout=timeout, lease=lease, options=options, logger=logger,
                              call_batching=call_batching)
        creds = _credentials(tls)
        channel = grpc.secure_channel(address, creds, options) if creds else grpc.insecure_channel(address, options)
        self._channel = channel
        if interceptors:
            channel = grpc.intercept_channel(channel, *interceptors)
        _configure(self, channel, token, max_attempts, backoff, max_backoff, timeout, lease, logger, call_batching)
        self._rounds_lock = threading.Lock()
        self._senders: Set[threading.Thread] = set()
        self._background: Set[threading.Thread] = set()
        self._bg_lock = threading.Lock()
        self._bg_stop = threading.Event()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _call(self, method: str, request: Any, fields: Mapping[str, Any], timeout: Optional[float], extra: float = 0.0,
              *, deadline: Optional[float] = None, cancel_event: Optional[threading.Event] = None) -> Any:
        """One call of method, retried on UNAVAILABLE with backoff.

        Each try is bounded by timeout (+ extra) and, with deadline (a
        time.monotonic() value), by deadline, past which it is not retried;
        with cancel_event, setting it cancels the call and raises
        concurrent.futures.CancelledError.
        """
        cls = _api.REQUESTS[method]
        if request is None:
            request = cls(**fields)
        elif isinstance(request, dict):
            request = cls(**dict(request, **fields))
        elif fields:
            merged = cls()
            merged.CopyFrom(request)
            merged.MergeFrom(cls(**fields))
            request = merged
        timeout = (self._timeout if timeout is None else timeout) + extra
        delay = self._backoff
        attempt = 1
        while True:
            try:
                return self._invoke(method, request, timeout, deadline, cancel_event)
            except grpc.RpcError as err:
                pause = delay / 2 + random.random() * delay / 2
                if (_code(err) != _C.UNAVAILABLE or attempt >= self._max_attempts
                        or (deadline is not None and time.monotonic() + pause >= deadline)):
                    raise
                self._log.debug("idemcoord: retrying %s (attempt %d): %s", method, attempt, err)
                if cancel_event is None:
                    time.sleep(pause)
                elif cancel_event.wait(pause):
                    raise _cancelled() from err
                delay = min(delay * 2, self._max_backoff)
                attempt += 1

    def _invoke(self, method: str, request: Any, timeout: float, deadline: Optional[float],
                cancel_event: Optional[threading.Event]) -> Any:
        """One try of _call."""
        if deadline is not None:
            timeout = min(timeout, max(deadline - time.monotonic(), 0.001))
        if self._rounds is not None:
            with self._rounds_lock:
                size = self._rounds.size_if_batchable(method, request)
            if size is not None:
                return self._batched(method, request, size, timeout, cancel_event)
        stub = self._stubs[method]
        if cancel_event is None:
            return stub(request, timeout=timeout, metadata=self._metadata)
        if cancel_event.is_set():
            raise _cancelled()
        call = stub.future(request, timeout=timeout, metadata=self._metadata)
        while True:
            try:
                return call.result(CANCEL_POLL)
            except grpc.FutureTimeoutError:
                if cancel_event.is_set():
                    call.cancel()
                    raise _cancelled() from None

    # Call batching (call_batching=N): each try of a call is an item of a round.

    def _batched(self, method: str, request: Any, size: int, timeout: float,
                 cancel_event: Optional[threading.Event]) -> Any:
        """One try of a call, in a Batch RPC: its answer, or what its unary call raises."""
        if cancel_event is not None and cancel_event.is_set():
            raise _cancelled()
        assert self._rounds is not None
        it = _core.BatchItem(method, request, size, time.monotonic() + timeout, threading.Event())
        with self._rounds_lock:
            start = self._rounds.reserve(it)
            if start:
                self._rounds.taking = True
        if start:
            self._start_sender()
        while True:
            left = max(it.deadline - time.monotonic(), 0.0)
            if it.waiter.wait(left if cancel_event is None else min(left, CANCEL_POLL)):
                return it.answer()
            if cancel_event is not None and cancel_event.is_set():
                self._batched_gone(it)
                raise _cancelled()
            if time.monotonic() >= it.deadline:
                self._batched_gone(it)
                raise _core.rpc_error(_C.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _batched_gone(self, it: _core.BatchItem) -> None:
        """Its caller gave up on it: out of the queue if it is still there, else a Begin's acquisition is released.

        That release waits for the Begin's answer for at most
        RELEASE_TIMEOUT (normally milliseconds), so that the caller's own
        release finds the key settled; after that it goes on in the
        background.
        """
        assert self._rounds is not None
        with self._rounds_lock:
            if self._rounds.withdraw(it):
                return
        if it.method != "Begin":
            return
        if it.waiter.wait(RELEASE_TIMEOUT):
            self._release_answered(it)
            return

        def later(stop: threading.Event) -> None:
            while not stop.is_set():
                if it.waiter.wait(CANCEL_POLL):
                    self._release_answered(it)
                    return
        self._run_in_background(later)

    def _release_answered(self, it: _core.BatchItem) -> None:
        token = it.acquired_token()
        if token:
            self._release(dict(scope=it.request.scope, key=it.request.key), token)

    def _start_sender(self) -> None:
        t = threading.Thread(target=self._send_rounds, name="idemcoord-batch", daemon=True)
        with self._rounds_lock:
            self._senders.add(t)
        t.start()

    def _send_rounds(self) -> None:
        """A sender: sends rounds while calls are queued, then ends (its RPC slot is free again).

        It takes the queue only after the other threads that are ready have
        had the interpreter (time.sleep(0)): the callers that one answer woke
        call again at nearly the same time, and their calls then go in one
        RPC, where sending the first of them at once put it alone in an RPC
        of its own, with the rest in another behind it. While a sender is
        about to take the queue (BatchRounds.taking, set before the callers
        of an answer are woken), those callers start no second sender.
        """
        assert self._rounds is not None
        while True:
            time.sleep(0)
            with self._rounds_lock:
                self._rounds.taking = False
                round_ = self._rounds.next_round()
                if round_ is None:
                    self._senders.discard(threading.current_thread())
                    return
            sent = False
            try:
                self._send_round(round_)
                sent = True
            finally:
                with self._rounds_lock:
                    # Done when another sender will take the queue, or
                    # when an exception ends this one.
                    done = self._rounds.taking or not sent
                    if done:
                        self._rounds.in_flight -= 1
                        self._senders.discard(threading.current_thread())
                    else:
                        self._rounds.taking = True
                for it in round_:
                    it.answered = True
                    it.waiter.set()
            if done:
                return

    def _send_round(self, items: List[_core.BatchItem]) -> None:
        """Sends one round as a Batch RPC (or its calls unary) and sets each of its calls' answer (the sender wakes them)."""
        assert self._rounds is not None
        try:
            if self._rounds.unary:
                self._each_unary(items)
                return
            req, timeout = _core.batch_request(items, time.monotonic())
            try:
                resp = self._batch_stub(req, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as err:
                how = _core.round_failed(err)
                if how == _core.ROUND_FAILED:
                    _core.fail_round(items, err)
                    return
                if how == _core.ROUND_UNARY_FOR_GOOD:
                    self._rounds.unary = True
                self._each_unary(items)
                return
            self._each_unary(_core.answer_round(items, resp))
        except Exception as err:  # a closed channel, say: no caller waits for an answer that will not come
            _core.fail_round([it for it in items if it.outcome is None],
                             _core.rpc_error(_C.CANCELLED, "idemcoord: the batch could not be sent: %s" % err))

    def _each_unary(self, items: Sequence[_core.BatchItem]) -> None:
        """Makes each call as its own unary RPC, all at once."""
        calls = [(it, self._stubs[it.method].future(it.request, timeout=max(it.deadline - time.monotonic(), 0.001),
                                                    metadata=self._metadata)) for it in items]
        for it, call in calls:
            try:
                it.outcome = call.result()
            except grpc.RpcError as err:
                it.outcome = err

    def begin(self, request: Any = None, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        """Claims a key (idempotency.v1.Coordinator.Begin).

        Takes a BeginRequest, a dict, or its fields as keywords; ttl, lease
        and wait may be seconds or timedeltas. Without attempt_id a fresh
        random one is sent, the same on each retry of this call, so a
        retried begin whose reply was lost gets the same lease token back.
        """
        if request is not None:
            fields = dict(_as_dict(request), **fields)
        _begin_fields(fields)
        return self._call("Begin", None, fields, timeout, _seconds(fields.get("wait")))

    def complete(self, request: Any = None, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        """Stores the response and ends the record COMPLETED."""
        return self._call("Complete", request, fields, timeout)

    def fail(self, request: Any = None, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        """Ends the attempt with a failure (kind: a FailureKind name or number).

        An ABANDONED fail that finds no record answers an empty FailResponse:
        the abandoned first attempt deleted it, which is what a retried fail
        whose first reply was lost asked for.
        """
        if request is not None:
            fields = dict(_as_dict(request), **fields)
        try:
            return self._call("Fail", None, fields, timeout)
        except grpc.RpcError as err:
            kind = fields.get("kind")
            if _code(err) == _C.NOT_FOUND and kind in ("FAILURE_KIND_ABANDONED", _api.FailureKind.FAILURE_KIND_ABANDONED):
                return _api.RESPONSES["Fail"]()
            raise

    def lookup(self, request: Any = None, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        """Reads a record as in effect now."""
        return self._call("Lookup", request, fields, timeout)

    def heartbeat(self, request: Any = None, *, timeout: Optional[float] = None, **fields: Any) -> Any:
        """Extends the current attempt's lease (lease: seconds or a timedelta)."""
        if request is not None:
            fields = dict(_as_dict(request), **fields)
        if fields.get("lease") is not None:
            fields["lease"] = _duration(fields["lease"])
        return self._call("Heartbeat", None, fields, timeout)

    def once(self, scope: str, key: str, fingerprint: Optional[bytes], fn: Callable[[Attempt], Any], *,
             timeout: Optional[float] = None, cancel_event: Optional[threading.Event] = None) -> Result:
        """Runs fn at most once per (scope, key) and returns the recorded outcome.

        fn(attempt) runs in this thread when this call acquires the key,
        while a thread heartbeats every third of the lease. It returns a
        StoredResponse, a dict of its fields, or None (an empty response),
        which is stored with Complete. An exception is recorded with Fail of
        the kind a FailureError names or, by default, of the kind its gRPC
        code maps to (no code: UNKNOWN; after mark_side_effect: UNKNOWN), and
        raised again. A replayable failure raises StoredFailure (now and on
        every replay). When the key already has an outcome, once returns it
        without running fn (replayed=True); while another attempt holds the
        key it waits for its outcome; a key held UNKNOWN raises UnknownHeld.
        If a heartbeat learns that the lease was lost, once raises LeaseLost
        and records nothing.

        The caller may give up before fn starts: timeout (seconds, None for
        no limit) bounds the Begin calls and the wait together, and setting
        cancel_event (a threading.Event) cancels them. When the time runs
        out, once raises the DEADLINE_EXCEEDED of Begin, or TimeoutError
        while another attempt still holds the key; when cancel_event is set,
        concurrent.futures.CancelledError, and fn does not run. Once fn runs,
        cancel_event cancels its attempt (see Attempt). When once will not
        run fn although it sent Begin (the caller gave up, or Begin got no
        answer: UNAVAILABLE after the retries, DEADLINE_EXCEEDED, CANCELLED),
        it first releases what that Begin may have acquired, within a few
        seconds of its own (Fail FAILURE_KIND_ABANDONED, reason "caller gave
        up before the handler ran"), so the key is as if this call never was
        and a retry acquires it at once. A release that fails is logged, not
        raised; the key is then held until its lease runs out.
        """
        if cancel_event is not None and cancel_event.is_set():
            raise _cancelled()  # nothing sent
        breq = _once_request(scope, key, fingerprint, self._lease)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            res, sent = self._begin_waiting(breq, deadline, cancel_event)
        except (grpc.RpcError, concurrent.futures.CancelledError) as err:
            if _answer_lost(err):
                self._release(breq)
            if isinstance(err, grpc.RpcError) and cancel_event is not None and cancel_event.is_set():
                raise _cancelled() from err
            raise
        replayed = _begin_outcome(res, cancel_event)
        if replayed is not None:
            return replayed

        lease = _Holder(self, breq, res, sent)
        attempt = Attempt(lease.info, cancel_event, lease)
        value, error, marked, started = lease.run(fn, attempt)
        if lease.lost:
            raise LeaseLost()
        if lease.gave_up:
            self._release(breq, lease.token)
            raise _cancelled()
        if not started:  # fn never ran: the key goes back to how it was
            finish_err = lease.finish(kind="FAILURE_KIND_ABANDONED",
                                      reason="the lease could not be confirmed before the attempt started")
            if finish_err is not None:
                raise finish_err from LeaseUnconfirmed()
            raise LeaseUnconfirmed()
        ending, outcome = _once_ending(value, error, marked, res.record.attempt)
        return _once_result(error, outcome, lease.finish(**ending))

    def _begin_waiting(self, req: Dict[str, Any], give_up: Optional[float], cancel_event: Optional[threading.Event],
                       wait_until: Optional[float] = None) -> Tuple[Any, float]:
        """Begin, then, while another attempt holds the key, Begin's long poll until give_up or cancel_event.

        Returns the last answer and when its Begin was sent: a lease it
        granted runs at least until then plus the lease, by the local clock.
        It returns the last answer it read (in progress when the time ran
        out or cancel_event was set between two Begins), and raises what a
        Begin raised (concurrent.futures.CancelledError when cancel_event
        was set during one): that Begin may have acquired the key (see
        _release). With wait_until (a time.monotonic() value) it waits no
        longer than that, without bounding the calls by it (the middlewares).
        """
        steps = _core.begin_waiting(req, give_up, wait_until, time.monotonic,
                                    lambda: cancel_event is not None and cancel_event.is_set())
        step = next(steps)
        while True:
            if isinstance(step, _core.Pause):
                if cancel_event is not None:
                    cancel_event.wait(step.seconds)
                else:
                    time.sleep(step.seconds)
                answer = None
            else:
                answer = self._call("Begin", None, step.fields, None, step.wait, deadline=give_up,
                                    cancel_event=cancel_event)
            try:
                step = steps.send(answer)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    def _release(self, req: Mapping[str, Any], token: Optional[str] = None) -> None:
        """Releases the acquisition a Begin of req may have made when nobody will act on it.

        That is when the caller gave up or the Begin's answer was lost.
        Without token it re-sends Begin with req's attempt_id and no wait,
        which answers the acquisition again if there is one; it ends it with
        Fail ABANDONED, so the key is as if that attempt never was. It is
        bound to no caller's timeout or cancellation, takes at most
        RELEASE_TIMEOUT seconds, and never raises: a failure is logged, and
        the key then stays held until its lease runs out.
        """
        deadline = time.monotonic() + RELEASE_TIMEOUT
        try:
            if not token:
                res = self._call("Begin", None, _without_wait(req), RELEASE_TIMEOUT, deadline=deadline)
                if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
                    return  # another attempt holds the key, or it has an outcome
                token = str(res.lease_token)
            self._call("Fail", None, _release_fail(req, token), RELEASE_TIMEOUT, deadline=deadline)
        except Exception as err:  # logged: the caller gets its own error
            if token and _code(err) == _C.NOT_FOUND:
                return  # the abandoned record is deleted already
            self._log.warning("idemcoord: could not release an acquisition nobody will act on of %s/%s; the key "
                              "stays held until its lease runs out: %s", req["scope"], req["key"], err)

    def _run_in_background(self, f: Callable[[threading.Event], None]) -> None:
        t = threading.Thread(target=self._background_main, args=(f,), daemon=True)
        with self._bg_lock:
            self._background.add(t)
        t.start()

    def _background_main(self, f: Callable[[threading.Event], None]) -> None:
        try:
            f(self._bg_stop)
        except Exception:  # logged; the record reads UNKNOWN once its lease runs out
            self._log.exception("idemcoord: background work failed")
        finally:
            with self._bg_lock:
                self._background.discard(threading.current_thread())

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Waits for the background work of once (at most timeout seconds), then closes the channel.

        That work is a complete or fail that could not reach the coordinator,
        retried for up to one lease; when timeout runs out it is cancelled.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._bg_lock:
                pending = list(self._background)
            if not pending:
                break
            for t in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                t.join(left)
                if deadline is not None and time.monotonic() >= deadline:
                    self._bg_stop.set()
        with self._rounds_lock:
            senders = list(self._senders)
        for t in senders:  # each RPC ends by its calls' deadlines
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._channel.close()
        for t in senders:  # the channel's close cancelled what was still in flight
            t.join()

    close = shutdown


def _as_dict(msg: Any) -> Dict[str, Any]:
    if isinstance(msg, dict):
        return dict(msg)
    return {f.name: v for f, v in msg.ListFields()}


class _HolderBase:
    """What _Holder and idemcoord.aio's _AsyncHolder share: the acquisition's state and the calls that end it."""

    def __init__(self, client: _Settings, req: Mapping[str, Any], res: Any, sent: float):
        self.client = client
        self.scope, self.key = req["scope"], req["key"]
        self.token = res.lease_token
        self.request = req.get("lease")
        rec = res.record
        self.timer = _core.LeaseTimer(_seconds(self.request) if self.request is not None else _lease_length(rec), sent)
        self.info = Lease(self.scope, self.key, self.token, rec.generation, rec.attempt, res.previous_state,
                          bool(getattr(rec, "uncertain", False)))
        self.lost = False
        # The checkpoint the attempt resumes after (an earlier attempt's),
        # and the last one this attempt recorded.
        self.resumed = _checkpoint_of(rec)
        self.own: Optional[Checkpoint] = None

    def checkpoint_from(self) -> Optional[Checkpoint]:
        """The attempt's last own checkpoint, else the one it resumes after."""
        return self.own or self.resumed

    def checkpoint_sync(self, phase: str, data: bytes) -> None:
        """Records a checkpoint from synchronous code (see idemcoord.checkpoint)."""
        raise TypeError("idemcoord: an asyncio attempt records checkpoints with await idemcoord.aio.checkpoint(...)")

    async def checkpoint_async(self, phase: str, data: bytes) -> None:
        """Records a checkpoint from asyncio code (see idemcoord.aio.checkpoint)."""
        raise TypeError("idemcoord: a synchronous attempt records checkpoints with idemcoord.checkpoint(...)")

    def _checkpoint_fields(self, phase: str, data: bytes) -> Dict[str, Any]:
        fields = self._heartbeat_fields()
        fields["checkpoint"] = _api.message_class("idempotency.v1.Checkpoint")(phase=phase, data=data)
        return fields

    def _recorded(self, phase: str, data: bytes, res: Any) -> None:
        at = _checkpoint_of(getattr(res, "record", None))
        self.own = _later_checkpoint(self.own, Checkpoint(phase, data, at.at if at is not None and at.phase == phase else None))

    @property
    def length(self) -> float:
        """The lease in seconds."""
        return self.timer.length

    def _heartbeat_fields(self) -> Dict[str, Any]:
        return dict(scope=self.scope, key=self.key, lease_token=self.token, lease=self.request)

    def _ending_call(self, ending: Mapping[str, Any]) -> Tuple[str, Dict[str, Any]]:
        """The client method that sends ending ("complete" or "fail") and its fields."""
        base = dict(scope=self.scope, key=self.key, lease_token=self.token)
        if "complete" in ending:
            return "complete", dict(response=ending["complete"], **base)
        kind = ending["kind"]
        if kind == "FAILURE_KIND_ABANDONED" and self.own is not None:
            # An attempt that recorded a checkpoint has acted: the coordinator
            # refuses to abandon it. RETRYABLE keeps the checkpoint.
            kind = "FAILURE_KIND_RETRYABLE"
        return "fail", dict(kind=kind, response=ending.get("response"), reason=ending.get("reason", ""), **base)

    def _cancel(self, attempt: Attempt, lost: bool) -> None:
        """Cancels attempt as _core.keep_alive's CancelAttempt says: the lease was lost, or went unconfirmed."""
        if lost:
            self.lost = True
            attempt.cancel(LeaseLost())
            return
        self.client._log.warning("idemcoord: could not confirm the lease of %s/%s before it would run out; "
                                 "cancelling the attempt", self.scope, self.key)
        attempt.cancel(LeaseUnconfirmed())

    @staticmethod
    def _unstored(err: BaseException, ending: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        """The ending to send instead when the coordinator refused ending with err, else None.

        A response it refused to store: UNKNOWN. An ABANDONED it refused
        because the attempt recorded a checkpoint (one this library did not
        send): RETRYABLE, which keeps it.
        """
        if _code(err) == _C.INVALID_ARGUMENT and ("complete" in ending or ending.get("response") is not None):
            return dict(kind="FAILURE_KIND_UNKNOWN", reason=_fail_reason("response not stored: %s" % err))
        if (ending.get("kind") == "FAILURE_KIND_ABANDONED" and _code(err) == _C.FAILED_PRECONDITION
                and _error_reason(err) == "CHECKPOINT_RECORDED"):
            return dict(ending, kind="FAILURE_KIND_RETRYABLE")
        return None


class _Holder(_HolderBase):
    """An acquisition this process holds: heartbeats while fn runs, then ends it."""

    client: Client

    def __init__(self, client: Client, req: Mapping[str, Any], res: Any, sent: float):
        super().__init__(client, req, res, sent)
        self.gave_up = False

    def run(self, fn: Callable[[Attempt], Any], attempt: Attempt) -> Tuple[Any, Optional[Exception], bool, bool]:
        """Runs fn(attempt) with heartbeats; returns (value, error, marked, started) once they stopped.

        When the Begin that granted the lease took long (a wait for another
        attempt), it first confirms the lease with a heartbeat; if the lease
        cannot be confirmed for long enough to start fn, fn does not run.
        Nor does it when the caller's cancel_event is set before fn would
        start (gave_up).
        """
        stop = self.start(attempt)
        if stop is None:
            return None, None, False, False
        token = _current.set(attempt)
        value = None
        error: Optional[Exception] = None
        try:
            value = fn(attempt)
        except Exception as err:  # recorded, then raised again by once
            error = err
        finally:
            _current.reset(token)
            stop()
        return value, error, attempt._marked, True

    def start(self, attempt: Attempt) -> Optional[Callable[[], None]]:
        """Starts the heartbeats of attempt; returns the function that stops them, or None when fn must not run.

        None when the caller gave up (gave_up), the lease was lost (lost) or
        cannot be confirmed for long enough to start fn. The middlewares
        (asgi, wsgi) run their handler between start and stop.
        """
        if self._caller_gone(attempt):
            return None
        timer = self.timer
        if timer.needs_confirmation(time.monotonic()):
            sent = time.monotonic()
            try:
                timer.confirmed_before_start(sent, self.heartbeat(timeout=timer.beat_timeout))
            except grpc.RpcError as err:
                if _lease_gone(err):
                    self.lost = True
                    return None
        if self._caller_gone(attempt):
            return None
        if not timer.start(time.monotonic()):
            return None
        stop = threading.Event()
        beats = threading.Thread(target=self._keep_alive, args=(attempt, stop), daemon=True)
        beats.start()

        def stop_beats() -> None:
            stop.set()
            beats.join()
        return stop_beats

    def _caller_gone(self, attempt: Attempt) -> bool:
        self.gave_up = attempt._outer is not None and attempt._outer.is_set()
        return self.gave_up

    def _keep_alive(self, attempt: Attempt, stop: threading.Event) -> None:
        """Heartbeats while fn runs (_core.keep_alive decides when), until stop is set.

        Cancels the attempt with LeaseLost when a heartbeat is refused, and
        with LeaseUnconfirmed when no heartbeat confirmed the lease before it
        would run out by the local clock (less the margin); after that it
        goes on heartbeating while fn runs on. Setting the caller's
        cancel_event cancels the attempt.
        """
        def cancelled() -> bool:
            outer = attempt._outer
            if outer is not None and outer.is_set():
                attempt.cancel(attempt.reason or RuntimeError("idemcoord: cancelled by the caller"))
            return attempt.cancelled.is_set()
        steps = _core.keep_alive(self.timer, time.monotonic, _lease_gone, cancelled, stop_when_unconfirmed=False)
        answer: Any = None
        try:
            while True:
                step = steps.send(answer)
                answer = None
                if isinstance(step, _core.Pause):
                    if stop.wait(step.seconds):
                        return
                elif isinstance(step, _core.Beat):
                    try:
                        answer = self.heartbeat(timeout=step.timeout)
                    except grpc.RpcError as err:
                        answer = err
                else:
                    self._cancel(attempt, step.lost)
        except StopIteration:
            return
        finally:
            steps.close()

    def heartbeat(self, timeout: Optional[float] = None) -> float:
        """Extends the lease; returns the lease it was extended by in seconds (0 when not told)."""
        res = self.client.heartbeat(timeout=timeout, **self._heartbeat_fields())
        return _lease_length(res.record)

    def checkpoint_sync(self, phase: str, data: bytes) -> None:
        """Records a checkpoint (see idemcoord.checkpoint)."""
        try:
            res = self.client.heartbeat(**self._checkpoint_fields(phase, data))
        except grpc.RpcError as err:
            if _lease_gone(err):
                self.lost = True
                raise LeaseLost() from err
            raise
        self._recorded(phase, data, res)

    def _send(self, ending: Mapping[str, Any], timeout: float) -> Any:
        method, fields = self._ending_call(ending)
        return getattr(self.client, method)(timeout=timeout, **fields)

    def finish(self, **ending: Any) -> Optional[BaseException]:
        """Ends the attempt; returns None when done or retrying in the background, else the refusal."""
        try:
            self._send(ending, FINISH_TIMEOUT)
            return None
        except grpc.RpcError as err:
            if _unreachable(err):
                self.client._log.warning("idemcoord: coordinator unreachable at the end of an attempt on %s/%s; "
                                         "retrying in the background", self.scope, self.key)
                self.client._run_in_background(lambda stop: self._finish_later(ending, stop))
                return None
            instead = self._unstored(err, ending)
            if instead is not None:
                return self.finish(**instead)
            refusal: BaseException = err
            return refusal

    def _finish_later(self, ending: Mapping[str, Any], stop: threading.Event) -> None:
        give_up = time.monotonic() + self.length
        delay = 0.1
        while time.monotonic() < give_up and not stop.wait(delay):
            try:
                self._send(ending, FINISH_TIMEOUT)
                return
            except grpc.RpcError as err:
                instead = None if _unreachable(err) else self._unstored(err, ending)
                if instead is not None:
                    ending = instead  # as finish does when the coordinator answers at once
                    continue
                if not _unreachable(err):
                    self.client._log.error("idemcoord: coordinator refused the end of an attempt: %s", err)
                    return
            # Keep the key held meanwhile. A refused heartbeat (ALREADY_FINISHED
            # when the ending did land and only its reply was lost) decides
            # nothing: the next try of the ending tells.
            try:
                self.heartbeat(timeout=FINISH_TIMEOUT)
            except grpc.RpcError:
                pass
            delay = min(delay * 2, 2.0)
        self.client._log.error("idemcoord: gave up ending an attempt on %s/%s; the record will read UNKNOWN "
                               "once its lease runs out", self.scope, self.key)
