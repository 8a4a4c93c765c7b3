"""The errors of the idemcoord client."""

from typing import Any, Optional

import grpc

from ._api import reason_name

REASON_UNKNOWN_HELD: str = reason_name("ERROR_REASON_UNKNOWN_HELD")
"""The ErrorInfo reason of a key held UNKNOWN for an operator."""
SCHEMA_VERSION_STATUS = "google.rpc.Status"
"""The schema version of a stored failure whose body is a google.rpc.Status."""
CONTENT_TYPE_PROTO = "application/x-protobuf"
"""The content type of stored protobuf bodies."""


class LeaseLost(Exception):
    """A heartbeat learnt that another attempt took the key over (or it ended).

    It is the reason an attempt is cancelled with, and what once raises;
    nothing is recorded (the new holder will).
    """

    def __init__(self, message: str = "idemcoord: the lease on the idempotency key was lost"):
        super().__init__(message)


class LeaseUnconfirmed(Exception):
    """No heartbeat reached the coordinator before the lease would run out by the local clock."""

    def __init__(self, message: str = "idemcoord: the lease could not be confirmed before it ran out"):
        super().__init__(message)


class UnknownHeld(Exception):
    """The key is held UNKNOWN for an operator (policy on_unknown: hold); retrying will not help."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = REASON_UNKNOWN_HELD

    def __init__(self) -> None:
        super().__init__("idemcoord: the outcome of an earlier attempt with this idempotency key is unknown "
                         "and held for an operator")


class FailureError(Exception):
    """Lets fn say how its failure is recorded.

    kind is a FailureKind name ("FAILURE_KIND_REPLAYABLE", ...) or number;
    response (a StoredResponse or a dict of its fields) is stored with a
    REPLAYABLE failure, by default the gRPC status of code (a
    grpc.StatusCode) and the message.
    """

    def __init__(self, kind: Any, message: str = "", response: Any = None, code: Optional[grpc.StatusCode] = None):
        super().__init__(message or "failed (%s)" % kind)
        self.kind = kind
        self.response = response
        self.code = code


class StoredFailure(Exception):
    """The recorded outcome is a replayable failure, recorded now or earlier (a replay).

    code (a grpc.StatusCode) and details are the stored gRPC status; result
    is the Result holding the stored response; __cause__ is fn's exception
    when this call ran fn.
    """

    def __init__(self, code: grpc.StatusCode, details: str, result: Any):
        super().__init__(details or "replayed failure")
        self.code = code
        self.details = details
        self.result = result


class UndecidedPrincipalWarning(UserWarning):
    """A middleware or interceptor was built saying neither whose keys they are nor that keys are shared.

    That is neither principal= (the end user, folded into every key) nor
    without_principal=True (keys are shared on purpose, e.g. unique per
    user already). Two end users who send the same key and request would
    share one record.
    """


class UnnamedServiceWarning(UserWarning):
    """An HTTP middleware was built with neither service= nor scope=.

    Its records' scope is then the operation alone ("POST /orders"), the
    same for every service that shares the coordinator's tenant: name the
    service with service=, or give each service a tenant (token) of its own.
    """


class GuardsNothingWarning(UserWarning):
    """A server interceptor was built with options under which it guards no method: every call passes through."""
