"""gRPC interceptors for grpc.server and grpc channels, with the semantics of Go's clients interceptors.

    server = grpc.server(executor, interceptors=[idemcoord.grpc.ServerInterceptor(client)])
    channel = grpc.intercept_channel(grpc.insecure_channel(address), idemcoord.grpc.ClientInterceptor())

ServerInterceptor: every unary method whose descriptor does not say
idempotency_level = NO_SIDE_EFFECTS (or the methods named) runs at most once
per idempotency-key metadata value, described or not: the response is
stored and replayed, byte for byte, with the method's own serializers and
"idempotency-result: replayed"; handler errors are recorded by code as the
Go interceptor records them; a running attempt answers ABORTED with the
grpc-retry-pushback-ms trailer (or waits, wait=seconds); a key held UNKNOWN
answers FAILED_PRECONDITION with reason UNKNOWN_HELD. The handler reads
idemcoord.current_lease() and calls idemcoord.mark_side_effect().
clients/testdata/grpc_conformance.json is the suite it runs.

ClientInterceptor gives every outgoing unary call without idempotency-key
metadata one new key, the same on every retry attempt grpc makes of that
call (a service config's retryPolicy included).
"""

import threading
import time
import uuid
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import grpc

from . import _core
from ._core import (CANCELLED_ANSWER, KEY_METADATA, LEASE_LOST_ANSWER, NOT_STARTED_REASON, PASS_THROUGH,
                    PUSHBACK_TRAILER, RESULT_HEADER, UNAVAILABLE_ANSWER, Answer, Guard, Method, Replayed, Request,
                    StoredBytes)
from .client import Attempt, Client, _answer_lost, _current, _Holder

__all__ = ["ClientInterceptor", "KEY_METADATA", "PUSHBACK_TRAILER", "RESULT_HEADER", "ServerInterceptor"]

_C = grpc.StatusCode


def _abort(context: Any, answer: Answer) -> None:
    if answer.trailing:
        context.set_trailing_metadata(answer.trailing)
    context.abort(answer.code, answer.details)


class ServerInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Makes a grpc.server's unary methods idempotent through client (an idemcoord.Client).

    Options, each as Go's InterceptorOption: wait (seconds to wait for a
    running attempt's result, default 0), require_key, fail_open, principal
    (a function of the ServicerContext), key (of request and context),
    fingerprint (of request and context), methods (full method names),
    scope (a function of the full method name), schema_versions,
    failure_kinds ({grpc.StatusCode: FailureKind name}), pool (the
    descriptor pool the services' messages are in; default the default
    pool). A method without a descriptor in pool is guarded too: its
    fingerprint hashes the request's bytes as received and its responses are
    stored as its serializer writes them (schema version "<method> response").
    methods that leave nothing to guard warn (idemcoord.GuardsNothingWarning).
    without_principal=True says that keys are shared by every caller on
    purpose (Go's WithoutPrincipal); with neither it nor principal, building
    the interceptor warns (idemcoord.UndecidedPrincipalWarning).
    """

    def __init__(self, client: Client, **options: Any):
        self.client = client
        self.guard = Guard("idemcoord.grpc.ServerInterceptor", log=client._log, **options)

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        guarded_method = self.guard.method(handler_call_details.method, handler)
        if guarded_method is None:
            return handler
        m: Method = guarded_method
        behavior = handler.unary_unary

        def guarded(request: Request, context: Any) -> Any:
            return self._guard(m, behavior, request, context)
        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=Guard.request_deserializer(handler),
                                                   response_serializer=Guard.response_serializer(handler))

    def _guard(self, m: Method, behavior: Callable[[Any, Any], Any], request: Request, context: Any) -> Any:
        g, c = self.guard, self.client
        key = g.key_of(request, context, context.invocation_metadata())
        if isinstance(key, Answer):
            _abort(context, key)
        if not key:
            return behavior(request.message, context)
        breq = g.begin_request(m, str(key), request, context, c._lease)
        cancel_event = threading.Event()
        context.add_callback(cancel_event.set)
        wait = g.wait_for(context.time_remaining())
        try:
            res, sent = c._begin_waiting(breq, None, cancel_event, time.monotonic() + wait)
        except Exception as err:
            if cancel_event.is_set():
                c._release(breq)
                _abort(context, CANCELLED_ANSWER)
            if _answer_lost(err):
                threading.Thread(target=c._release, args=(breq,), daemon=True).start()
            answer = g.begin_failed(err)
            if answer is PASS_THROUGH:
                return behavior(request.message, context)
            assert isinstance(answer, Answer)
            _abort(context, answer)
        decided = g.begun(m, res)
        if isinstance(decided, Answer):
            _abort(context, decided)
        if isinstance(decided, Replayed):
            context.send_initial_metadata([(RESULT_HEADER, "replayed")])
            return StoredBytes(decided.body)
        if cancel_event.is_set():
            c._release(breq, res.lease_token)
            _abort(context, CANCELLED_ANSWER)

        holder = _Holder(c, breq, res, sent)
        attempt = Attempt(holder.info, cancel_event, holder)
        stop = holder.start(attempt)
        if stop is None:
            if holder.gave_up:
                c._release(breq, holder.token)
                _abort(context, CANCELLED_ANSWER)
            if holder.lost:
                _abort(context, LEASE_LOST_ANSWER)
            holder.finish(kind="FAILURE_KIND_ABANDONED", reason=NOT_STARTED_REASON)
            _abort(context, UNAVAILABLE_ANSWER)
        token = _current.set(attempt)
        error: Optional[Exception] = None
        response = None
        try:
            response = behavior(request.message, context)
        except Exception as err:  # recorded, then raised again
            error = err
        finally:
            _current.reset(token)
            if stop is not None:
                stop()
        code = _core.code_of(context)
        if error is None and code in (None, _C.OK):
            if holder.lost:
                return response
            ending = g.stored_success(m, response)
            if holder.finish(**ending) is None and "complete" in ending:
                context.send_initial_metadata([(RESULT_HEADER, "created")])
            if "complete" in ending:  # the bytes stored are the bytes sent: a replay is byte for byte the same
                return StoredBytes(bytes(ending["complete"].body))
            return response
        if holder.lost:
            _abort(context, LEASE_LOST_ANSWER)
        details = _core.details_of(context) or str(error or "")
        code, ending = g.failure(code, details, attempt._marked)
        if holder.finish(**ending) is None and ending["kind"] == "FAILURE_KIND_REPLAYABLE":
            context.set_trailing_metadata(_core.trailing_of(context) + ((RESULT_HEADER, "created"),))
        if error is not None and _core.code_of(context) in (None, _C.OK):
            raise error
        context.abort(code, details)


class _CallDetails(NamedTuple):
    method: str
    timeout: Optional[float]
    metadata: Optional[Sequence[Tuple[str, Any]]]
    credentials: Any
    wait_for_ready: Optional[bool]
    compression: Any


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):  # type: ignore[misc]
    pass


def new_key() -> str:
    """A new idempotency key: a random UUID (version 4)."""
    return str(uuid.uuid4())


def with_key(metadata: Optional[Sequence[Tuple[str, Any]]], make_key: Callable[[], str]
             ) -> Optional[Sequence[Tuple[str, Any]]]:
    """metadata with an idempotency-key of make_key() added when it has none; None when it has one."""
    md = list(metadata or ())
    if any(k == KEY_METADATA for k, _ in md):
        return None
    md.append((KEY_METADATA, make_key()))
    return md


class ClientInterceptor(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Gives every outgoing unary call without idempotency-key metadata a new key (new_key: a UUIDv4).

    It runs once per call, above grpc's retries: every attempt of a call
    that grpc's retry policy (a service config's retryPolicy) makes carries
    the same key, so the service runs the call at most once. A key the
    caller sends in the call's metadata is kept.

        channel = grpc.intercept_channel(grpc.insecure_channel(address), idemcoord.grpc.ClientInterceptor())
    """

    def __init__(self, key: Callable[[], str] = new_key):
        self._key = key

    def intercept_unary_unary(self, continuation: Callable[[Any, Any], Any], client_call_details: Any,
                              request: Any) -> Any:
        md = with_key(client_call_details.metadata, self._key)
        if md is not None:
            d = client_call_details
            client_call_details = _ClientCallDetails(d.method, d.timeout, md, d.credentials,
                                                     getattr(d, "wait_for_ready", None), getattr(d, "compression", None))
        return continuation(client_call_details, request)
