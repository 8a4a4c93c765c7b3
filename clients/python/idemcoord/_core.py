"""The decisions of once, of a lease's holder, of call batching and of the gRPC server interceptors, without I/O.

idemcoord.Client and idemcoord.grpc (threads) and idemcoord.aio (asyncio)
drive the same code here, as _http is shared by the ASGI and WSGI
middlewares: the wait for another attempt's result is a generator that
yields the calls and pauses to make (begin_waiting), a lease's heartbeat
timing is LeaseTimer and its loop the generator keep_alive, which calls
share which Batch RPC is BatchRounds' (with batch_request and answer_round
for the RPC's request and answers), and an interceptor's choices (which
methods, the key, the Begin request, what to answer for each outcome, how
an ending is recorded) are Guard's. Nothing here calls the coordinator,
sleeps or touches a ServicerContext.
"""

import base64
import dataclasses
import datetime
import hashlib
import logging
import os
import warnings
from typing import (Any, Callable, Dict, Generator, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union)

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

from . import _api, _tables
from .errors import (CONTENT_TYPE_PROTO, REASON_UNKNOWN_HELD, SCHEMA_VERSION_STATUS, GuardsNothingWarning,
                     UndecidedPrincipalWarning, UnnamedServiceWarning)

_C = grpc.StatusCode
CODES: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}

RESULT_HEADER = "idempotency-result"
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"
KEY_METADATA = "idempotency-key"
STATUS_DETAILS = "grpc-status-details-bin"

Metadata = Tuple[Tuple[str, Union[str, bytes]], ...]


def duration(v: Any) -> Any:
    """v (seconds, a timedelta, a Duration or None) as a google.protobuf.Duration (None stays None)."""
    if v is None or isinstance(v, _api.Duration):
        return v
    d = _api.Duration()
    d.FromTimedelta(v if isinstance(v, datetime.timedelta) else datetime.timedelta(seconds=v))
    return d


def seconds(d: Any) -> float:
    """A Duration in seconds (0 for None)."""
    return float(d.seconds + d.nanos / 1e9) if d is not None else 0.0


def new_attempt_id() -> str:
    return os.urandom(16).hex()


def in_progress(res: Any) -> bool:
    """Whether a Begin answer says another attempt holds the key (and it is not held UNKNOWN)."""
    return bool(res.outcome == _api.Outcome.OUTCOME_IN_PROGRESS and res.record.state != _api.State.STATE_UNKNOWN)


def code_of_error(err: object) -> Optional[grpc.StatusCode]:
    """The grpc.StatusCode an exception carries, or None."""
    code = getattr(err, "code", None)
    if callable(code):
        try:
            code = code()
        except TypeError:
            return None
    if isinstance(code, int) and not isinstance(code, bool):
        code = CODES.get(code)
    return code if isinstance(code, grpc.StatusCode) else None


def fold_principal(principal: object, key: str) -> str:
    """The key stored for an end user's key: base64url(SHA-256(principal)) ":" key, as Go's FoldPrincipal."""
    digest = hashlib.sha256(str(principal).encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() + ":" + key


def warn_undecided_principal(guard: str) -> None:
    """Warns that guard was built with neither principal= nor without_principal=True (as Go logs it)."""
    warnings.warn("idemcoord: %s built without principal= or without_principal=True: two end users who send the "
                  "same idempotency key and request share one record; fold the end user in with principal=, or "
                  "say without_principal=True" % guard, UndecidedPrincipalWarning, stacklevel=3)


def warn_unnamed_service(guard: str) -> None:
    """Warns that guard was built with neither service= nor scope= (as Go logs it)."""
    warnings.warn("idemcoord: %s built without service= or scope=: its records' scope is the operation alone "
                  "(\"POST /orders\"), the same for every service that shares the coordinator's tenant; name the "
                  "service with service=, or give each service a tenant (token) of its own" % guard,
                  UnnamedServiceWarning, stacklevel=3)


# The wait for another attempt's result.

@dataclasses.dataclass(frozen=True)
class BeginCall:
    """Send Begin with fields; wait: the seconds of Begin's own long poll (0: none), to add to the call's timeout."""

    fields: Dict[str, Any]
    wait: float


@dataclasses.dataclass(frozen=True)
class Pause:
    """Sleep this many seconds (or until the caller gives up) before the next step."""

    seconds: float


BeginSteps = Generator[Union[BeginCall, Pause], Any, Tuple[Any, float]]


def begin_waiting(req: Dict[str, Any], give_up: Optional[float], wait_until: Optional[float],
                  now: Callable[[], float], cancelled: Callable[[], bool]) -> BeginSteps:
    """Begin, then, while another attempt holds the key, Begin's long poll until give_up, wait_until or cancelled().

    A generator: it yields BeginCall (send back the answer) and Pause (send
    back None), and returns (the last answer, when the Begin that gave it
    was sent): a lease that answer granted runs at least until then plus
    the lease, by the local clock. give_up and wait_until are now() values
    (None: no limit); it returns the in-progress answer when the time ran
    out or cancelled() between two Begins.
    """
    sent = now()
    res = yield BeginCall(req, 0.0)
    while in_progress(res):
        left = _tables.MAX_BEGIN_WAIT if give_up is None else min(_tables.MAX_BEGIN_WAIT, give_up - now())
        if wait_until is not None:
            left = min(left, wait_until - now())
        if left <= 0 or cancelled():
            return res, sent
        start = sent = now()
        res = yield BeginCall(dict(req, wait=duration(left)), left)
        if in_progress(res) and now() - start < left / 2:  # answered early: pause before asking again
            yield Pause(min(seconds(res.retry_after) or 0.1, left))
    return res, sent


# A lease's heartbeat timing.

def lease_length(rec: Any) -> float:
    """The lease a Begin or Heartbeat answer granted, in seconds: updated_at to lease_expires_at (0 when not told)."""
    if not (rec.HasField("lease_expires_at") and rec.HasField("updated_at")):
        return 0.0
    return float(rec.lease_expires_at.ToNanoseconds() - rec.updated_at.ToNanoseconds()) / 1e9


class LeaseTimer:
    """When a holder heartbeats and when it must stop trusting its lease, by the local clock.

    length is the lease in seconds; a heartbeat goes out a third of it after
    the last confirmation (a twelfth while the coordinator is unreachable);
    the attempt is cancelled at until, a margin (a tenth) before the lease
    would run out.
    """

    def __init__(self, length: float, sent: float):
        self.length = length if length > 0 else _tables.DEFAULT_LEASE
        self.sent = sent  # when the Begin that granted the lease was sent
        self.until = 0.0
        self.next_beat = 0.0

    @property
    def margin(self) -> float:
        """How long before the lease would run out, by the local clock, the attempt is cancelled unless confirmed."""
        return max(self.length / 10, _tables.MIN_HEARTBEAT)

    @property
    def beat_timeout(self) -> float:
        """The timeout of one heartbeat."""
        return max(self.length / 3, _tables.MIN_HEARTBEAT)

    def needs_confirmation(self, now: float) -> bool:
        """Whether the Begin that granted the lease took long (a wait): confirm it with a heartbeat before starting."""
        return now - self.sent > self.length / 3

    def confirmed_before_start(self, sent: float, granted: float) -> None:
        """A heartbeat sent at sent confirmed the lease before the start (granted: its length, 0 when not told)."""
        self.sent = sent
        if granted > 0:
            self.length = granted

    def start(self, now: float) -> bool:
        """Sets the first deadlines; False when the lease is too close to running out to start."""
        if now >= self.sent + self.length - self.margin:
            return False
        self.until = self.sent + self.length - self.margin
        self.next_beat = self.sent + max(self.length / 3, _tables.MIN_HEARTBEAT)
        return True

    def beat_confirmed(self, sent: float, granted: float) -> None:
        """A heartbeat sent at sent extended the lease by granted seconds (0 when not told)."""
        granted = granted if granted > 0 else self.length
        self.until = sent + granted - self.margin
        self.next_beat = sent + max(granted / 3, _tables.MIN_HEARTBEAT)

    def beat_unanswered(self, now: float) -> None:
        """A heartbeat got no answer: try again sooner."""
        self.next_beat = now + max(self.length / 12, _tables.MIN_HEARTBEAT)

    def expired(self, now: float) -> bool:
        """Whether the lease can no longer be trusted: the attempt must be cancelled."""
        return now >= self.until


@dataclasses.dataclass(frozen=True)
class Beat:
    """Send a heartbeat with this timeout; send back the lease it granted in seconds (0: not told), or its exception."""

    timeout: float


@dataclasses.dataclass(frozen=True)
class CancelAttempt:
    """Cancel the attempt: lost, a heartbeat was refused (LeaseLost); else the lease went unconfirmed (LeaseUnconfirmed)."""

    lost: bool


KeepAliveSteps = Generator[Union[Pause, Beat, CancelAttempt], Any, None]


def keep_alive(timer: LeaseTimer, now: Callable[[], float], lease_gone: Callable[[BaseException], bool],
               cancelled: Callable[[], bool], stop_when_unconfirmed: bool) -> KeepAliveSteps:
    """The heartbeats of a holder while its attempt runs, after timer.start: the one loop of both clients.

    A generator: it yields Pause (sleep, then send back None; a holder
    that stops its heartbeats closes the generator instead), Beat (send
    back the granted lease or the exception) and CancelAttempt (send back
    None). A heartbeat goes out a third of the lease after the last
    confirmation, sooner after one went unanswered; a heartbeat refused
    because the lease is gone (lease_gone) cancels the attempt as lost and
    ends the loop. A lease that no heartbeat confirmed before it would run
    out (less the margin) cancels the attempt as unconfirmed, unless
    cancelled() says it is cancelled already; then the loop ends when
    stop_when_unconfirmed (asyncio cancels the attempt's task), else it
    goes on heartbeating (a thread cannot be stopped: the key stays held
    while it runs on).
    """
    while True:
        t = now()
        if timer.expired(t) and not cancelled():
            yield CancelAttempt(lost=False)
            if stop_when_unconfirmed:
                return
        wake = timer.next_beat if cancelled() else min(timer.next_beat, timer.until)
        yield Pause(max(0.0, wake - t))
        if now() < timer.next_beat:
            continue
        sent = now()
        answer = yield Beat(timer.beat_timeout)
        if isinstance(answer, BaseException):
            if lease_gone(answer):
                yield CancelAttempt(lost=True)
                return
            timer.beat_unanswered(now())
        else:
            timer.beat_confirmed(sent, float(answer))


# The server interceptors.

@dataclasses.dataclass(frozen=True)
class Answer:
    """An answer the interceptor makes without (or instead of) the handler's: a status with trailers."""

    code: grpc.StatusCode
    details: str
    trailing: Metadata = ()


@dataclasses.dataclass(frozen=True)
class Replayed:
    """A stored response, sent as it is (the call's own serializer is bypassed) with idempotency-result: replayed."""

    body: bytes


class StoredBytes:
    """Bytes a guarded method's response serializer sends as they are."""

    __slots__ = ("body",)

    def __init__(self, body: bytes):
        self.body = body


@dataclasses.dataclass(frozen=True)
class Request:
    """A guarded call's request: as its method decodes it, and its bytes on the wire."""

    raw: bytes
    message: Any


@dataclasses.dataclass(frozen=True)
class Method:
    """What the interceptor knows of a guarded method."""

    full_name: str
    schema: str  # the schema version its responses are stored with
    accepted: Tuple[str, ...]  # the schema versions a replay accepts
    described: bool  # a descriptor of the method is known: requests re-encoded deterministically for the fingerprint
    serialize: Optional[Callable[[Any], bytes]]  # the method's own response serializer


def path_schema(full_method: str) -> str:
    """The schema version of a method's responses when no descriptor of it is known."""
    return "%s response" % full_method


PASS_THROUGH = object()
"""begin_failed's answer when the handler runs unprotected (fail open)."""

LEASE_LOST_ANSWER = Answer(_C.ABORTED, "the idempotency key was taken over by another attempt; retry")
UNAVAILABLE_ANSWER = Answer(_C.UNAVAILABLE, "idempotency coordinator unavailable; retry later")
CANCELLED_ANSWER = Answer(_C.CANCELLED, "the call was cancelled")
NOT_STARTED_REASON = "the lease could not be confirmed before the handler started"


def error_info_status(code: grpc.StatusCode, message: str, reason: str) -> Any:
    """A google.rpc.Status with one google.rpc.ErrorInfo (domain as every library sends) in its details."""
    st = _api.Status(code=code.value[0], message=message)
    info = _api.message_class("google.rpc.ErrorInfo")(reason=reason, domain=_tables.ERROR_INFO_DOMAIN)
    st.details.add().Pack(info)
    return st


def status_response(code: grpc.StatusCode, details: str) -> Any:
    """The StoredResponse of a replayable failure: the google.rpc.Status of code and details."""
    body = _api.Status(code=code.value[0], message=details or "").SerializeToString(deterministic=True)
    return _api.StoredResponse(schema_version=SCHEMA_VERSION_STATUS, content_type=CONTENT_TYPE_PROTO, body=body,
                               status_code=code.value[0])


def fail_reason(msg: object) -> str:
    raw = str(msg).replace("\0", "").encode("utf-8", "replace")[:1024]
    return raw.decode("utf-8", "ignore")


def _message_output_class(desc: Any) -> Any:
    from google.protobuf import message_factory
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(desc.file.pool).GetPrototype(desc)


class Guard:
    """The options and decisions of idemcoord.grpc.ServerInterceptor and idemcoord.aio.ServerInterceptor."""

    def __init__(self, owner: str, *, wait: float = 0.0, require_key: bool = False, fail_open: bool = False,
                 principal: Optional[Callable[[Any], str]] = None,
                 key: Optional[Callable[[Any, Any], str]] = None,
                 fingerprint: Optional[Callable[[Any, Any], bytes]] = None,
                 methods: Optional[Iterable[str]] = None, scope: Optional[Callable[[str], str]] = None,
                 schema_versions: Optional[Mapping[str, str]] = None,
                 failure_kinds: Optional[Mapping[grpc.StatusCode, str]] = None, pool: Any = None,
                 without_principal: bool = False, log: Optional[logging.Logger] = None):
        if principal is not None and without_principal:
            raise ValueError("idemcoord: principal= and without_principal=True contradict each other")
        if principal is None and not without_principal:
            warn_undecided_principal(owner)
        self.wait = max(float(wait), 0.0)
        self.require_key, self.fail_open = require_key, fail_open
        self.principal, self.key, self.fingerprint = principal, key, fingerprint
        self.methods: Optional[Set[str]] = set(methods) if methods is not None else None
        self.scope: Callable[[str], str] = scope or (lambda full_method: full_method)
        self.schema_versions = dict(schema_versions or {})
        self.kinds: Dict[grpc.StatusCode, str] = dict(_tables.FAILURE_KINDS)
        self.kinds.update(failure_kinds or {})
        self.pool = pool or descriptor_pool.Default()
        self.log = log or logging.getLogger("idemcoord")
        if self.methods is not None and not any(self._unary_or_unknown(m) for m in self.methods):
            warnings.warn("idemcoord: %s built with methods=%r guards nothing: %s; every call passes through "
                          "unprotected" % (owner, sorted(self.methods), "the list is empty" if not self.methods
                                           else "every method named is streaming"), GuardsNothingWarning,
                          stacklevel=3)

    def _descriptor(self, full_method: str) -> Any:
        try:
            return self.pool.FindMethodByName(full_method.lstrip("/").replace("/", ".", 1))
        except KeyError:
            return None

    def _unary_or_unknown(self, full_method: str) -> bool:
        md = self._descriptor(full_method)
        return md is None or not (md.client_streaming or md.server_streaming)

    def method(self, full_method: str, handler: Any) -> Optional[Method]:
        """What guards handler's method, or None when its calls pass through.

        Every unary method is guarded, described or not (the call's own
        serializers store and replay it), unless its descriptor says
        NO_SIDE_EFFECTS or methods leaves it out.
        """
        if handler is None or handler.request_streaming or handler.response_streaming:
            return None
        if self.methods is not None and full_method not in self.methods:
            return None
        md = self._descriptor(full_method)
        fixed = self.schema_versions.get(full_method)
        if md is None:
            schema = fixed or path_schema(full_method)
            return Method(full_method, schema, (schema,), False, handler.response_serializer)
        if self.methods is None and md.GetOptions().idempotency_level == descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS:
            return None
        schema = fixed or md.output_type.full_name
        accepted = (schema,) if fixed else (schema, path_schema(full_method))
        return Method(full_method, schema, accepted, True, handler.response_serializer)

    @staticmethod
    def request_deserializer(handler: Any) -> Callable[[bytes], Request]:
        """The guarded method's request deserializer: it keeps the request's bytes next to the decoded request."""
        decode = handler.request_deserializer

        def deserialize(raw: bytes) -> Request:
            return Request(raw, decode(raw) if decode is not None else raw)
        return deserialize

    @staticmethod
    def response_serializer(handler: Any) -> Callable[[Any], bytes]:
        """The guarded method's response serializer: a replayed response's stored bytes go out as they are."""
        encode = handler.response_serializer

        def serialize(response: Any) -> bytes:
            if isinstance(response, StoredBytes):
                return response.body
            return bytes(encode(response)) if encode is not None else bytes(response)
        return serialize

    def key_of(self, request: Request, context: Any, metadata: Sequence[Tuple[str, Any]]) -> Union[str, Answer]:
        """The call's key (folded with the principal), "" to pass through, or the Answer refusing the call."""
        keys = {v for k, v in metadata if k == KEY_METADATA}
        if len(keys) > 1:
            return Answer(_C.INVALID_ARGUMENT, "two different idempotency-key values")
        key = self.key(request.message, context) if self.key else (next(iter(keys)) if keys else "")
        if not key:
            if self.require_key:
                return Answer(_C.INVALID_ARGUMENT, "this method requires an idempotency-key")
            return ""
        if self.principal is not None:
            key = fold_principal(self.principal(context), key)
        return str(key)

    def begin_request(self, m: Method, key: str, request: Request, context: Any, lease: Any) -> Dict[str, Any]:
        """The Begin the interceptor sends for a call with key."""
        if self.fingerprint is not None:
            fp = self.fingerprint(request.message, context)
        else:
            body = request.raw
            if m.described and hasattr(request.message, "SerializeToString"):
                body = request.message.SerializeToString(deterministic=True)
            fp = hashlib.sha256(m.full_name.encode() + b"\n" + body).digest()
        req = dict(scope=self.scope(m.full_name), key=key, fingerprint=bytes(fp or b""), attempt_id=new_attempt_id(),
                   accept_schema_versions=list(m.accepted) + [SCHEMA_VERSION_STATUS])
        if lease is not None:
            req["lease"] = lease
        return req

    def wait_for(self, time_remaining: Optional[float]) -> float:
        """How long to wait for another attempt's result, within the call's deadline."""
        return self.wait if time_remaining is None else max(min(self.wait, time_remaining - 0.05), 0.0)

    def begin_failed(self, err: BaseException) -> Union[Answer, object]:
        """The answer when Begin raised err, or PASS_THROUGH (fail open: the handler runs unprotected)."""
        code = err.code() if isinstance(err, grpc.RpcError) and callable(getattr(err, "code", None)) else None
        if code in (_C.FAILED_PRECONDITION, _C.INVALID_ARGUMENT):
            trailing = tuple((k, v) for k, v in (getattr(err, "trailing_metadata", lambda: ())() or ())
                             if k == STATUS_DETAILS)
            return Answer(code, err.details() or "", trailing)  # type: ignore[attr-defined]
        if code in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED):
            if self.fail_open:
                self.log.warning("idemcoord: coordinator unreachable; running the handler unprotected (fail open)")
                return PASS_THROUGH
            return UNAVAILABLE_ANSWER
        if code == _C.RESOURCE_EXHAUSTED:
            return Answer(_C.RESOURCE_EXHAUSTED, "idempotency coordinator rate limit reached; retry later")
        self.log.error("idemcoord: coordinator refused Begin: %s", err)
        return Answer(_C.INTERNAL, "idempotency coordinator refused the call")

    @staticmethod
    def begun(m: Method, res: Any) -> Union[Answer, Replayed, None]:
        """What a Begin answer decides: None when it acquired the key (run the handler), else the answer."""
        rec = res.record
        if res.outcome == _api.Outcome.OUTCOME_REPLAY:
            stored = rec.response
            if rec.state == _api.State.STATE_FAILED_REPLAYABLE:
                code, message = _C.FAILED_PRECONDITION, rec.failure_reason or "replayed failure"
                trailing: List[Tuple[str, Union[str, bytes]]] = [(RESULT_HEADER, "replayed")]
                if stored.schema_version == SCHEMA_VERSION_STATUS:
                    st = _api.Status()
                    st.ParseFromString(stored.body)
                    if st.code != 0:
                        code, message = CODES.get(st.code, _C.UNKNOWN), st.message
                        trailing.append((STATUS_DETAILS, bytes(stored.body)))
                return Answer(code, message, tuple(trailing))
            if stored.schema_version not in m.accepted:
                return Answer(_C.INTERNAL, "the stored response for this idempotency key has schema version "
                              + stored.schema_version)
            return Replayed(bytes(stored.body))
        if res.outcome == _api.Outcome.OUTCOME_ACQUIRED:
            return None
        if rec.state == _api.State.STATE_UNKNOWN:
            st = error_info_status(_C.FAILED_PRECONDITION, "the outcome of an earlier attempt with this idempotency "
                                   "key is unknown and held for an operator", REASON_UNKNOWN_HELD)
            return Answer(_C.FAILED_PRECONDITION, st.message, ((STATUS_DETAILS, st.SerializeToString()),))
        retry_ms = max(int(seconds(res.retry_after) * 1000), 1)
        return Answer(_C.ABORTED, "another attempt with this idempotency key is in progress; retry after %d ms"
                      % retry_ms, ((PUSHBACK_TRAILER, str(retry_ms)),))

    @staticmethod
    def stored_success(m: Method, response: Any) -> Dict[str, Any]:
        """The ending of a handler that answered response: Complete with its bytes (Fail UNKNOWN when they cannot be made)."""
        try:
            if m.described and hasattr(response, "SerializeToString"):
                body = response.SerializeToString(deterministic=True)
            elif m.serialize is not None:
                body = m.serialize(response)
            else:
                body = bytes(response)
        except Exception:
            return dict(kind="FAILURE_KIND_UNKNOWN", reason="the handler's response could not be encoded for storage")
        return dict(complete=_api.StoredResponse(schema_version=m.schema, content_type=CONTENT_TYPE_PROTO, body=body))

    def failure(self, code: Optional[grpc.StatusCode], details: str, marked: bool
                ) -> Tuple[grpc.StatusCode, Dict[str, Any]]:
        """The code a failed handler is answered with (UNKNOWN for an exception) and how it is recorded."""
        if code in (None, _C.OK):
            code = _C.UNKNOWN
        assert code is not None
        # After mark_side_effect every error is UNKNOWN (as Go's endingKind).
        kind = "FAILURE_KIND_UNKNOWN" if marked else self.kinds.get(code, "FAILURE_KIND_UNKNOWN")
        ending: Dict[str, Any] = dict(kind=kind, reason=fail_reason(details))
        if kind == "FAILURE_KIND_REPLAYABLE":
            ending["response"] = status_response(code, details)
        return code, ending


def code_of(context: Any) -> Optional[grpc.StatusCode]:
    """The status code the handler set on context, as a grpc.StatusCode (grpc.aio gives an int)."""
    code = getattr(context, "code", None)
    try:
        code = code() if callable(code) else None
    except Exception:
        return None
    if isinstance(code, int) and not isinstance(code, bool):
        return CODES.get(code, _C.UNKNOWN)
    return code if isinstance(code, grpc.StatusCode) else None


def details_of(context: Any) -> str:
    details = getattr(context, "details", None)
    try:
        d = details() if callable(details) else None
    except Exception:
        return ""
    return d.decode() if isinstance(d, bytes) else str(d or "")


def trailing_of(context: Any) -> Metadata:
    tm = getattr(context, "trailing_metadata", None)
    try:
        return tuple(tm() or ()) if callable(tm) else ()
    except Exception:
        return ()


# Call batching: the rounds of Batch RPCs, shared by Client and idemcoord.aio.Client.

BATCH_MAX_CALLS = 128
"""The most calls one Batch RPC carries (the coordinator takes up to 256)."""
BATCH_MAX_CALL_BYTES = 64 << 10
"""The largest request that goes into a batch; a larger one (a Complete with a big response) goes unary."""
BATCH_MAX_BYTES = 2 << 20
"""What the requests of one Batch RPC add up to at most, well under gRPC's default 4 MiB message limit."""
BATCH_FIELDS = {"Begin": "begin", "Complete": "complete", "Fail": "fail", "Lookup": "lookup", "Heartbeat": "heartbeat"}
"""The methods a batch carries, with their field in BatchCall and BatchResult."""


def rpc_error(code: grpc.StatusCode, details: str, status: Optional[bytes] = None) -> grpc.RpcError:
    """The exception a unary call raises for code and details; status: the google.rpc.Status sent with details.

    grpc.aio.AioRpcError, a grpc.RpcError with code(), details() and
    trailing_metadata() (grpc-status-details-bin when status is given), as
    both clients' unary calls raise.
    """
    import grpc.aio
    trailing = grpc.aio.Metadata((STATUS_DETAILS, status)) if status else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def status_error(st: Any) -> grpc.RpcError:
    """The exception of a google.rpc.Status a batched call failed with: what its unary call raises."""
    return rpc_error(CODES.get(st.code, _C.UNKNOWN), st.message,
                     st.SerializeToString(deterministic=True) if len(st.details) else None)


class BatchItem:
    """One call waiting for its Batch: its method, request, size and deadline (a monotonic time), then its answer.

    waiter is the client's own (a threading.Event, an asyncio.Future);
    answered and outcome (the response, or the exception to raise) are set
    once by the client's answer.
    """

    __slots__ = ("method", "request", "size", "deadline", "outcome", "answered", "waiter")

    def __init__(self, method: str, request: Any, size: int, deadline: float, waiter: Any = None):
        self.method, self.request, self.size, self.deadline, self.waiter = method, request, size, deadline, waiter
        self.outcome: Any = None
        self.answered = False

    def answer(self) -> Any:
        """The response, or raises the call's error."""
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def acquired_token(self) -> Optional[str]:
        """The lease token of an answered Begin that acquired the key, else None."""
        if self.method != "Begin" or not self.answered or isinstance(self.outcome, BaseException):
            return None
        if self.outcome.outcome != _api.Outcome.OUTCOME_ACQUIRED:
            return None
        return str(self.outcome.lease_token)


class BatchRounds:
    """Which calls go together in which Batch RPC, without I/O: not thread-safe (the sync client holds a lock).

    Nothing waits for a batch to fill: while fewer than max_in_flight
    Batch RPCs are in flight (and no sender is about to take the queue:
    taking), a call takes a free slot for a sender to start, which sends
    what is queued by then; the calls that arrive while all are in flight
    go together in the next RPC of whichever finishes first. reserve says
    whether a call took a slot, and next_round, called by a sender when it
    starts and when its RPC is answered, the round it must send (None:
    stop, its slot is free).
    """

    def __init__(self, max_in_flight: int):
        self.max = max(int(max_in_flight), 0)
        self.queue: List[BatchItem] = []
        self.in_flight = 0
        # A sender is about to take the queue: reserve starts no other (the sync client sets it; see Client._send_rounds).
        self.taking = False
        self.unary = False  # the coordinator answered UNIMPLEMENTED for Batch: every call goes unary

    def size_if_batchable(self, method: str, request: Any) -> Optional[int]:
        """The request's size when this call may go into a batch, else None (it goes as its own unary RPC)."""
        if self.max <= 0 or self.unary or method not in BATCH_FIELDS:
            return None
        if method == "Begin" and request.HasField("wait") and seconds(request.wait) > 0:
            return None  # a batched Begin never waits
        size = int(request.ByteSize())
        return size if size <= BATCH_MAX_CALL_BYTES else None

    def reserve(self, item: BatchItem) -> bool:
        """Queues item; whether it took a free RPC slot, for a sender to start that takes its first round with next_round.

        The asyncio client's sender is a task: by its first turn, the calls
        that the loop's other tasks made in the same turn of the loop (the
        callers a Batch's answer woke, say) are queued too, and go in that
        round rather than waiting behind a round of one.
        """
        self.queue.append(item)
        if self.in_flight >= self.max or self.taking:
            return False
        self.in_flight += 1
        return True

    def next_round(self) -> Optional[List[BatchItem]]:
        """The round a sender whose RPC was answered sends next, or None: the queue is empty, the slot is free."""
        if not self.queue:
            self.in_flight -= 1
            return None
        return self._take()

    def withdraw(self, item: BatchItem) -> bool:
        """Takes item out of the queue if it is still there (not sent); whether it was."""
        for i, q in enumerate(self.queue):
            if q is item:
                del self.queue[i]
                return True
        return False

    def _take(self) -> List[BatchItem]:
        n, size = 0, 0
        while (n < len(self.queue) and n < BATCH_MAX_CALLS
               and (n == 0 or size + self.queue[n].size <= BATCH_MAX_BYTES)):
            size += self.queue[n].size
            n += 1
        taken, self.queue = self.queue[:n], self.queue[n:]
        return taken


def batch_request(items: Sequence[BatchItem], now: float) -> Tuple[Any, float]:
    """The BatchRequest of a round and its RPC's timeout: the latest of its calls' deadlines.

    Each call's own deadline goes as its timeout (at least a millisecond):
    the coordinator ends the call at it, as the deadline of a unary call.
    """
    req = _api.BatchRequest()
    for it in items:
        call = req.calls.add()
        getattr(call, BATCH_FIELDS[it.method]).CopyFrom(it.request)
        t = max(it.deadline - now, 0.001)
        call.timeout.seconds, call.timeout.nanos = int(t), int((t - int(t)) * 1e9)
    return req, max(max(it.deadline for it in items) - now, 0.001)


ROUND_UNARY_FOR_GOOD = "unimplemented"
"""round_failed: the coordinator has no Batch method; this round and every later call go unary."""
ROUND_UNARY = "unary"
"""round_failed: this round's calls go unary (the answer was too large to receive)."""
ROUND_FAILED = "failed"
"""round_failed: each call fails with the Batch RPC's error, as its unary call would have (and retries as it)."""


def round_failed(err: BaseException) -> str:
    """What becomes of a round whose Batch RPC raised err: ROUND_UNARY_FOR_GOOD, ROUND_UNARY or ROUND_FAILED."""
    code = code_of_error(err)
    if code == _C.UNIMPLEMENTED:
        return ROUND_UNARY_FOR_GOOD
    if code == _C.RESOURCE_EXHAUSTED:
        return ROUND_UNARY
    return ROUND_FAILED


def answer_round(items: Sequence[BatchItem], response: Any) -> List[BatchItem]:
    """Sets each item's outcome from a Batch's answer; returns the items to make again alone, unary.

    Those are calls that changed nothing (a Lookup, a Begin, which did not
    acquire since it failed) answered RESOURCE_EXHAUSTED: the coordinator
    refuses a batched call whose answer would not fit in the Batch's (a
    replay of a large response), and such a call is repeated alone, which
    is safe (a Begin keeps its attempt_id); a call refused by the rate
    limit is repeated too, and answers as the rate limit decides then.
    """
    results = response.results
    if len(results) != len(items):
        err = rpc_error(_C.INTERNAL, "coordinator answered %d results to a Batch of %d calls" % (len(results), len(items)))
        for it in items:
            it.outcome = err
        return []
    again = []
    for it, res in zip(items, results):
        which = res.WhichOneof("result")
        if which == "error":
            if res.error.code == _C.RESOURCE_EXHAUSTED.value[0] and it.method in ("Begin", "Lookup"):
                again.append(it)
                continue
            it.outcome = status_error(res.error)
        elif which != BATCH_FIELDS[it.method]:
            it.outcome = rpc_error(_C.INTERNAL, "coordinator answered a Batch call %s with %s" % (it.method, which))
        else:
            it.outcome = getattr(res, which)
    return again


def fail_round(items: Sequence[BatchItem], err: BaseException) -> None:
    """Sets each item's outcome to the error of the Batch RPC that carried it."""
    for it in items:
        it.outcome = err
