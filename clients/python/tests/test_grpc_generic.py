"""The server interceptors guard methods no descriptor describes: generic handlers with their own serializers.

A grpc.server (and a grpc.aio server) serves shop.Payments/Charge through
grpc.method_handlers_generic_handler with JSON serializers; no descriptor
pool knows the method. The interceptor stores and replays with the
method's own serializers; the coordinator is a real one (coordinator.py).
"""

import asyncio
import concurrent.futures
import json
import threading
import time
import unittest
import uuid
import warnings

import grpc

import idemcoord
import idemcoord.aio
import idemcoord.grpc

from .coordinator import Coordinator, fixture_options

COORD = None
METHOD = "/shop.Payments/Charge"


def setUpModule():
    global COORD
    COORD = Coordinator()


def tearDownModule():
    COORD.stop()


def decode(raw):
    return json.loads(raw.decode())


def encode(obj):
    # A fresh nonce in every encoding: a replay that re-encoded the
    # response would not be the bytes the first call sent.
    return json.dumps(dict(obj, nonce=uuid.uuid4().hex)).encode()


class Runs:
    def __init__(self):
        self.lock = threading.Lock()
        self.n = 0

    def add(self):
        with self.lock:
            self.n += 1


def charge(runs):
    def handler(request, context):
        runs.add()
        time.sleep(0.3)
        return {"charged": request["amount"]}
    return handler


def async_charge(runs):
    async def handler(request, context):
        runs.add()
        await asyncio.sleep(0.3)
        return {"charged": request["amount"]}
    return handler


def generic(handler):
    return grpc.method_handlers_generic_handler("shop.Payments", {
        "Charge": grpc.unary_unary_rpc_method_handler(handler, request_deserializer=decode, response_serializer=encode)})


def result_of(call):
    return dict(call.initial_metadata() or ()).get("idempotency-result", "")


class GenericHandlerChecks:
    """The checks, run against a server that start() starts; it returns (port, runs, stop)."""

    def check_guarded(self, port, runs):
        channel = grpc.insecure_channel("127.0.0.1:%d" % port)
        self.addCleanup(channel.close)
        stub = channel.unary_unary(METHOD)  # raw bytes both ways
        key = "generic-" + uuid.uuid4().hex
        body = json.dumps({"amount": 42}).encode()
        with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
            answers = list(pool.map(lambda _: stub.with_call(body, metadata=[("idempotency-key", key)], timeout=30),
                                    range(10)))
        self.assertEqual(runs.n, 1, "handler runs for 10 concurrent duplicates")
        self.assertEqual(len({resp for resp, _ in answers}), 1, "every answer is the first one's bytes")
        self.assertEqual(decode(answers[0][0])["charged"], 42)
        results = sorted(result_of(call) for _, call in answers)
        self.assertEqual(results, ["created"] + ["replayed"] * 9)
        again, call = stub.with_call(body, metadata=[("idempotency-key", key)], timeout=30)
        self.assertEqual(again, answers[0][0])
        self.assertEqual(result_of(call), "replayed")
        with self.assertRaises(grpc.RpcError) as cm:
            stub(json.dumps({"amount": 43}).encode(), metadata=[("idempotency-key", key)], timeout=30)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(runs.n, 1)
        record = self.lookup(METHOD, key)
        self.assertEqual(idemcoord.State.Name(record.state), "STATE_COMPLETED")
        self.assertEqual(record.response.schema_version, METHOD + " response")
        self.assertEqual(bytes(record.response.body), answers[0][0])


class SyncGenericHandlerTest(GenericHandlerChecks, unittest.TestCase):
    def setUp(self):
        self.client = idemcoord.Client(COORD.addr, **fixture_options(token=COORD.token, lease=5))
        self.addCleanup(self.client.shutdown, 10)

    def lookup(self, scope, key):
        return self.client.lookup(scope=scope, key=key).record

    def test_generic_handler_with_custom_serializers_runs_once_and_replays_its_bytes(self):
        runs = Runs()
        interceptor = idemcoord.grpc.ServerInterceptor(self.client, wait=20, without_principal=True)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16), interceptors=[interceptor])
        server.add_generic_rpc_handlers([generic(charge(runs))])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.addCleanup(server.stop, None)
        self.check_guarded(port, runs)

    def test_an_interceptor_that_guards_nothing_says_so(self):
        for cls in (idemcoord.grpc.ServerInterceptor, idemcoord.aio.ServerInterceptor):
            with self.assertWarns(idemcoord.GuardsNothingWarning):
                cls(self.client, methods=[], without_principal=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                cls(self.client, methods=[METHOD], without_principal=True)
                cls(self.client, without_principal=True)


class AioGenericHandlerTest(GenericHandlerChecks, unittest.TestCase):
    def setUp(self):
        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        thread.start()
        self.sync = idemcoord.Client(COORD.addr, **fixture_options(token=COORD.token))
        self.addCleanup(self.sync.shutdown, 10)

        def stop_loop():
            self.loop.call_soon_threadsafe(self.loop.stop)
            thread.join(10)
            self.loop.close()
        self.addCleanup(stop_loop)

    def lookup(self, scope, key):
        return self.sync.lookup(scope=scope, key=key).record

    def run_in_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def test_generic_handler_with_custom_serializers_runs_once_and_replays_its_bytes(self):
        runs = Runs()

        async def start():
            client = idemcoord.aio.Client(COORD.addr, **fixture_options(token=COORD.token, lease=5))
            interceptor = idemcoord.aio.ServerInterceptor(client, wait=20, without_principal=True)
            server = grpc.aio.server(interceptors=[interceptor])
            server.add_generic_rpc_handlers([generic(async_charge(runs))])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return client, server, port

        async def stop(client, server):
            await server.stop(None)
            await client.shutdown(timeout=10)
        client, server, port = self.run_in_loop(start())
        self.addCleanup(lambda: self.run_in_loop(stop(client, server)))
        self.check_guarded(port, runs)


if __name__ == "__main__":
    unittest.main()
