"""The idempotency.v1 API, loaded at run time from idempotency.binpb.

idempotency.binpb is a FileDescriptorSet of proto/ and its imports that
`make generate` writes (`make test` fails when it is stale): no protoc and
no generated code, so Debian's python3-protobuf is enough, and a field the
proto gains (Record.uncertain, say) appears without a change here.
"""

import os
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import enum_type_wrapper

DESCRIPTORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "idempotency.binpb")


def _load() -> Any:
    fds = descriptor_pb2.FileDescriptorSet()
    with open(DESCRIPTORS, "rb") as f:
        fds.ParseFromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for fd in fds.file:  # buf writes every file after its imports
        pool.Add(fd)
    return pool


POOL = _load()


def message_class(full_name: str) -> Any:
    """The class of a message of the descriptor set, by full name."""
    desc = POOL.FindMessageTypeByName(full_name)
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(POOL).GetPrototype(desc)


def enum(full_name: str) -> Any:
    """An enum of the descriptor set: .Name(number), .Value(name), and each value as an attribute."""
    return enum_type_wrapper.EnumTypeWrapper(POOL.FindEnumTypeByName(full_name))


State = enum("idempotency.v1.State")
Outcome = enum("idempotency.v1.Outcome")
FailureKind = enum("idempotency.v1.FailureKind")
ErrorReason = enum("idempotency.v1.ErrorReason")

_ERROR_REASON_PREFIX = "ERROR_REASON_"


def reason_name(value_name: str) -> str:
    """The ErrorInfo reason an ErrorReason value is sent as: its name without the ERROR_REASON_ prefix.

    "ERROR_REASON_LEASE_LOST" is sent as "LEASE_LOST". Raises ValueError for
    a name the enum does not have.
    """
    ErrorReason.Value(value_name)
    if not value_name.startswith(_ERROR_REASON_PREFIX):
        raise ValueError("idempotency.v1.ErrorReason value %r lacks the %s prefix" % (value_name, _ERROR_REASON_PREFIX))
    return value_name[len(_ERROR_REASON_PREFIX):]


# Every ErrorInfo reason of domain idempotency.v1 (UNSPECIFIED left out).
REASONS = frozenset(reason_name(n) for n in ErrorReason.keys() if ErrorReason.Value(n) != 0)

StoredResponse = message_class("idempotency.v1.StoredResponse")
Record = message_class("idempotency.v1.Record")
Status = message_class("google.rpc.Status")
Duration = message_class("google.protobuf.Duration")

SERVICE = "idempotency.v1.Coordinator"
METHODS = ("Begin", "Complete", "Fail", "Lookup", "Heartbeat")
REQUESTS = {m: message_class("idempotency.v1.%sRequest" % m) for m in METHODS}
RESPONSES = {m: message_class("idempotency.v1.%sResponse" % m) for m in METHODS}
BatchRequest = message_class("idempotency.v1.BatchRequest")
BatchResponse = message_class("idempotency.v1.BatchResponse")
BatchCall = message_class("idempotency.v1.BatchCall")
