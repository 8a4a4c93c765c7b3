"""gRPC server interceptor (grpc.server) with the semantics of Go's clients.UnaryServerInterceptor.

    server = grpc.server(executor, interceptors=[idemcoord.grpc.ServerInterceptor(client)])

Every unary method whose proto does not say idempotency_level =
NO_SIDE_EFFECTS (or the methods named) runs at most once per
idempotency-key metadata value: the response is stored and replayed with
"idempotency-result: replayed"; handler errors are recorded by code as the
Go interceptor records them; a running attempt answers ABORTED with the
grpc-retry-pushback-ms trailer (or waits, wait=seconds); a key held UNKNOWN
answers FAILED_PRECONDITION with reason UNKNOWN_HELD. The handler reads
idemcoord.current_lease() and calls idemcoord.mark_side_effect().
clients/testdata/grpc_conformance.json is the suite it runs.
"""

import hashlib
import threading
import time

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

from . import _api
from .client import (DEFAULT_FAILURE_KINDS, Attempt, _answer_lost, _C, _current, _fail_reason, _Holder,
                     _new_attempt_id, _status_response)
from .errors import CONTENT_TYPE_PROTO, REASON_UNKNOWN_HELD, SCHEMA_VERSION_STATUS
from ._http import fold_principal, warn_undecided_principal

RESULT_HEADER = "idempotency-result"
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"
KEY_METADATA = "idempotency-key"


class _Method:
    def __init__(self, output_class, schema):
        self.output_class, self.schema = output_class, schema


class ServerInterceptor(grpc.ServerInterceptor):
    """Makes a grpc.server's unary methods idempotent through client (an idemcoord.Client).

    Options, each as Go's InterceptorOption: wait (seconds to wait for a
    running attempt's result, default 0), require_key, fail_open, principal
    (a function of the ServicerContext), key (of request and context),
    fingerprint (of request and context), methods (full method names),
    scope (a function of the full method name), schema_versions,
    failure_kinds ({grpc.StatusCode: FailureKind name}), pool (the
    descriptor pool the services' messages are in; default the default pool).
    Methods without a descriptor in pool pass through. without_principal=True
    says that keys are shared by every caller on purpose (Go's
    WithoutPrincipal); with neither it nor principal, building the
    interceptor warns (idemcoord.UndecidedPrincipalWarning).
    """

    def __init__(self, client, *, wait=0.0, require_key=False, fail_open=False, principal=None, key=None,
                 fingerprint=None, methods=None, scope=None, schema_versions=None, failure_kinds=None, pool=None,
                 without_principal: bool = False):
        if principal is not None and without_principal:
            raise ValueError("idemcoord: principal= and without_principal=True contradict each other")
        if principal is None and not without_principal:
            warn_undecided_principal(type(self).__module__ + "." + type(self).__qualname__)
        self.client = client
        self.wait = max(float(wait), 0.0)
        self.require_key, self.fail_open = require_key, fail_open
        self.principal, self.key, self.fingerprint = principal, key, fingerprint
        self.methods = set(methods) if methods is not None else None
        self.scope = scope or (lambda full_method: full_method)
        self.schema_versions = dict(schema_versions or {})
        self.kinds = dict(DEFAULT_FAILURE_KINDS, **(failure_kinds or {}))
        self.pool = pool or descriptor_pool.Default()
        self._resolved = {}
        self._lock = threading.Lock()

    def _method(self, full_method):
        with self._lock:
            if full_method in self._resolved:
                return self._resolved[full_method]
        m = None
        if self.methods is None or full_method in self.methods:
            name = full_method.lstrip("/").replace("/", ".", 1)
            try:
                md = self.pool.FindMethodByName(name)
            except KeyError:
                md = None
            if md is not None:
                opts = md.GetOptions()
                no_side_effects = opts.idempotency_level == descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS
                if self.methods is not None or not no_side_effects:
                    m = _Method(_api.message_class(md.output_type.full_name) if self.pool is _api.POOL
                                else _message_class(md.output_type),
                                self.schema_versions.get(full_method, md.output_type.full_name))
        with self._lock:
            self._resolved[full_method] = m
        return m

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        m = self._method(handler_call_details.method)
        if m is None:
            return handler
        full_method = handler_call_details.method
        behavior = handler.unary_unary

        def guarded(request, context):
            return self._guard(full_method, m, behavior, request, context)
        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)

    def _guard(self, full_method, m, behavior, request, context):
        c = self.client
        md = context.invocation_metadata()
        keys = {v for k, v in md if k == KEY_METADATA}
        if len(keys) > 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "two different idempotency-key values")
        key = self.key(request, context) if self.key else (next(iter(keys)) if keys else "")
        if not key:
            if self.require_key:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this method requires an idempotency-key")
            return behavior(request, context)
        if self.principal is not None:
            key = fold_principal(self.principal(context), key)
        if self.fingerprint is not None:
            fp = self.fingerprint(request, context)
        else:
            fp = hashlib.sha256(full_method.encode() + b"\n" + request.SerializeToString(deterministic=True)).digest()
        breq = dict(scope=self.scope(full_method), key=key, fingerprint=bytes(fp or b""), attempt_id=_new_attempt_id(),
                    accept_schema_versions=[m.schema, SCHEMA_VERSION_STATUS])
        if c._lease is not None:
            breq["lease"] = c._lease
        cancel_event = threading.Event()
        context.add_callback(cancel_event.set)
        remaining = context.time_remaining()
        wait = self.wait if remaining is None else max(min(self.wait, remaining - 0.05), 0.0)
        try:
            res, sent = c._begin_waiting(breq, None, cancel_event, time.monotonic() + wait)
        except Exception as err:
            if cancel_event.is_set():
                c._release(breq)
                context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
            if _answer_lost(err):
                threading.Thread(target=c._release, args=(breq,), daemon=True).start()
            code = err.code() if isinstance(err, grpc.RpcError) else None
            if code in (_C.FAILED_PRECONDITION, _C.INVALID_ARGUMENT):
                context.set_trailing_metadata([(k, v) for k, v in (err.trailing_metadata() or ())
                                               if k == "grpc-status-details-bin"])
                context.abort(code, err.details())
            if code in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED):
                if self.fail_open:
                    c._log.warning("idemcoord: coordinator unreachable; running the handler unprotected (fail open)")
                    return behavior(request, context)
                context.abort(_C.UNAVAILABLE, "idempotency coordinator unavailable; retry later")
            if code == _C.RESOURCE_EXHAUSTED:
                context.abort(_C.RESOURCE_EXHAUSTED, "idempotency coordinator rate limit reached; retry later")
            c._log.error("idemcoord: coordinator refused Begin: %s", err)
            context.abort(_C.INTERNAL, "idempotency coordinator refused the call")
        rec = res.record
        if res.outcome == _api.Outcome.OUTCOME_REPLAY:
            return self._replay(m, rec, context)
        if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
            if rec.state == _api.State.STATE_UNKNOWN:
                st = _api.Status(code=_C.FAILED_PRECONDITION.value[0],
                                 message="the outcome of an earlier attempt with this idempotency key is unknown "
                                         "and held for an operator")
                st.details.add(type_url="type.googleapis.com/google.rpc.ErrorInfo",
                               value=_error_info(REASON_UNKNOWN_HELD))
                context.set_trailing_metadata([("grpc-status-details-bin", st.SerializeToString())])
                context.abort(_C.FAILED_PRECONDITION, st.message)
            retry_ms = max(int((res.retry_after.seconds + res.retry_after.nanos / 1e9) * 1000), 1)
            context.set_trailing_metadata([(PUSHBACK_TRAILER, str(retry_ms))])
            context.abort(_C.ABORTED, "another attempt with this idempotency key is in progress; retry after %d ms"
                          % retry_ms)
        if cancel_event.is_set():
            c._release(breq, res.lease_token)
            context.abort(_C.CANCELLED, "the call was cancelled")

        holder = _Holder(c, breq, res, sent)
        attempt = Attempt(holder.info, cancel_event)
        stop = holder.start(attempt)
        if stop is None:
            if holder.gave_up:
                c._release(breq, holder.token)
                context.abort(_C.CANCELLED, "the call was cancelled")
            if holder.lost:
                context.abort(_C.ABORTED, "the idempotency key was taken over by another attempt; retry")
            holder.finish(kind="FAILURE_KIND_ABANDONED", reason="the lease could not be confirmed before the handler started")
            context.abort(_C.UNAVAILABLE, "idempotency coordinator unavailable; retry later")
        token = _current.set(attempt)
        error = None
        try:
            response = behavior(request, context)
        except Exception as err:  # recorded, then raised again
            error = err
        finally:
            _current.reset(token)
            stop()
        code = _code_of(context)
        if error is None and code in (None, _C.OK):
            if holder.lost:
                return response
            try:
                body = response.SerializeToString(deterministic=True)
            except Exception:
                holder.finish(kind="FAILURE_KIND_UNKNOWN", reason="the handler's response could not be encoded for storage")
                return response
            err = holder.finish(complete=_api.StoredResponse(schema_version=m.schema, content_type=CONTENT_TYPE_PROTO,
                                                             body=body))
            if err is None:
                context.send_initial_metadata([(RESULT_HEADER, "created")])
            return response
        if holder.lost:
            context.abort(_C.ABORTED, "the idempotency key was taken over by another attempt; retry")
        if code in (None, _C.OK):
            code = _C.UNKNOWN  # an exception the server answers UNKNOWN
        details = _details_of(context) or str(error or "")
        # After mark_side_effect every error is UNKNOWN (as Go's endingKind).
        kind = "FAILURE_KIND_UNKNOWN" if attempt._marked else self.kinds.get(code, "FAILURE_KIND_UNKNOWN")
        ending = dict(kind=kind, reason=_fail_reason(details))
        if kind == "FAILURE_KIND_REPLAYABLE":
            fake = _StatusCarrier(code, details)
            ending["response"] = _status_response(fake)
        err = holder.finish(**ending)
        if err is None and kind == "FAILURE_KIND_REPLAYABLE":
            context.set_trailing_metadata(tuple(_trailing(context)) + ((RESULT_HEADER, "created"),))
        if error is not None and _code_of(context) in (None, _C.OK):
            raise error
        context.abort(code, details)

    def _replay(self, m, rec, context):
        stored = rec.response
        if rec.state == _api.State.STATE_FAILED_REPLAYABLE:
            code, message = _C.FAILED_PRECONDITION, rec.failure_reason or "replayed failure"
            trailing = [(RESULT_HEADER, "replayed")]
            if stored.schema_version == SCHEMA_VERSION_STATUS:
                st = _api.Status()
                st.ParseFromString(stored.body)
                if st.code != 0:
                    code, message = _CODES.get(st.code, _C.UNKNOWN), st.message
                    trailing.append(("grpc-status-details-bin", bytes(stored.body)))
            context.set_trailing_metadata(trailing)
            context.abort(code, message)
        if stored.schema_version != m.schema:
            context.abort(_C.INTERNAL, "the stored response for this idempotency key has schema version "
                          + stored.schema_version)
        try:
            out = m.output_class.FromString(stored.body)
        except Exception:
            context.abort(_C.INTERNAL, "the stored response for this idempotency key cannot be decoded")
        context.send_initial_metadata([(RESULT_HEADER, "replayed")])
        return out


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _StatusCarrier(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code = code


def _code_of(context):
    """The status code the handler set on context, as a grpc.StatusCode (grpc.aio gives an int)."""
    code = getattr(context, "code", None)
    try:
        code = code() if callable(code) else None
    except Exception:
        return None
    if isinstance(code, int) and not isinstance(code, bool):
        return _CODES.get(code, _C.UNKNOWN)
    return code


def _details_of(context):
    details = getattr(context, "details", None)
    try:
        d = details() if callable(details) else None
    except Exception:
        return ""
    return d.decode() if isinstance(d, bytes) else (d or "")


def _trailing(context):
    tm = getattr(context, "trailing_metadata", None)
    try:
        return tuple(tm() or ()) if callable(tm) else ()
    except Exception:
        return ()


def _error_info(reason):
    r = reason.encode()
    d = b"idemcoord"
    return bytes([0x0A, len(r)]) + r + bytes([0x12, len(d)]) + d


def _message_class(desc):
    from google.protobuf import message_factory
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(desc.file.pool).GetPrototype(desc)
