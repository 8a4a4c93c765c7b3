#!/usr/bin/python3
"""Begin -> Complete -> Begin (replay) against an idemcoord coordinator, from Python.

    /usr/bin/python3 examples/python/replay.py 127.0.0.1:50051

It needs only Debian's python3-grpcio and python3-protobuf (protobuf 3.21):
no protoc and no generated code. The API is read from
examples/polyglot/idempotency.binpb, a FileDescriptorSet of proto/ and its
imports (buf/validate/validate.proto, google/protobuf/*) made by

    bin/buf build --as-file-descriptor-set --exclude-source-info -o examples/polyglot/idempotency.binpb

(a Go test fails when it is stale). Set IDEMCOORD_TOKEN when the
coordinator has auth on. It exits 0 only if the second Begin replayed
exactly the response the first attempt stored.
"""

import hashlib
import os
import sys
import uuid

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

HERE = os.path.dirname(os.path.abspath(__file__))
DESCRIPTORS = os.path.join(HERE, "..", "polyglot", "idempotency.binpb")


def load_messages(path):
    """Returns a function from a message's full name to its class."""
    fds = descriptor_pb2.FileDescriptorSet()
    with open(path, "rb") as f:
        fds.ParseFromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for fd in fds.file:  # buf writes every file after its imports
        pool.Add(fd)

    def message(name):
        desc = pool.FindMessageTypeByName(name)
        if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
            return message_factory.GetMessageClass(desc)
        return message_factory.MessageFactory(pool).GetPrototype(desc)

    def enum_value(enum, name):
        return pool.FindEnumTypeByName(enum).values_by_name[name].number

    return message, enum_value


class Coordinator:
    """A minimal client of idempotency.v1.Coordinator."""

    def __init__(self, channel, message, token):
        self.metadata = (("authorization", "Bearer " + token),) if token else ()
        self._calls = {}
        for method in ("Begin", "Complete"):
            resp = message("idempotency.v1.%sResponse" % method)
            self._calls[method] = channel.unary_unary(
                "/idempotency.v1.Coordinator/" + method,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=resp.FromString,
            )

    def call(self, method, request):
        return self._calls[method](request, timeout=10, metadata=self.metadata)


def main(argv):
    if len(argv) != 2:
        print("usage: replay.py HOST:PORT", file=sys.stderr)
        return 2
    message, enum_value = load_messages(DESCRIPTORS)
    BeginRequest = message("idempotency.v1.BeginRequest")
    CompleteRequest = message("idempotency.v1.CompleteRequest")
    StoredResponse = message("idempotency.v1.StoredResponse")
    acquired = enum_value("idempotency.v1.Outcome", "OUTCOME_ACQUIRED")
    replay = enum_value("idempotency.v1.Outcome", "OUTCOME_REPLAY")

    scope = "examples.python.charge"
    key = "python-" + str(uuid.uuid4())
    fingerprint = hashlib.sha256(b"charge 42 EUR to card 4242").digest()

    with grpc.insecure_channel(argv[1]) as channel:
        coord = Coordinator(channel, message, os.environ.get("IDEMCOORD_TOKEN", ""))
        first = coord.call("Begin", BeginRequest(scope=scope, key=key, fingerprint=fingerprint))
        if first.outcome != acquired:
            print("first Begin answered %s, want OUTCOME_ACQUIRED" % first.outcome, file=sys.stderr)
            return 1
        # The operation's result, stored byte for byte (not valid UTF-8 on purpose).
        stored = StoredResponse(
            schema_version="examples.ChargeResponse/1",
            content_type="application/octet-stream",
            body=b"charge ch_42 from python \x00\xff\xfe",
            status_code=201,
            metadata={"x-charge-id": "ch_42"},
        )
        coord.call("Complete", CompleteRequest(scope=scope, key=key, lease_token=first.lease_token, response=stored))

        again = coord.call("Begin", BeginRequest(scope=scope, key=key, fingerprint=fingerprint))
        got = again.record.response
        if again.outcome != replay or got != stored:
            print("second Begin answered outcome %s with %r, want a replay of %r" % (again.outcome, got, stored),
                  file=sys.stderr)
            return 1
    print("replayed %d bytes for %s/%s: %s, status %d" % (len(got.body), scope, key, got.schema_version,
                                                          got.status_code))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except grpc.RpcError as err:
        print("python example failed: gRPC %s: %s" % (err.code().name, err.details()), file=sys.stderr)
        sys.exit(1)
