"""Keys that survive retries: idemcoord.grpc/aio.ClientInterceptor under grpc's retryPolicy, and the requests adapter.

The gRPC servers and the HTTP server are real ones on 127.0.0.1 that fail
the first attempt (UNAVAILABLE, 503) and record the key of every attempt.
"""

import asyncio
import concurrent.futures
import http.server
import json
import threading
import unittest
import uuid

import grpc
import requests
from urllib3.util.retry import Retry

import idemcoord.aio
import idemcoord.callers
import idemcoord.grpc

SERVICE_CONFIG = json.dumps({"methodConfig": [{"name": [{"service": "shop.Payments"}], "retryPolicy": {
    "maxAttempts": 4, "initialBackoff": "0.01s", "maxBackoff": "0.1s", "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"]}}]})
OPTIONS = [("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]


class FlakyService:
    """shop.Payments/Charge: records each attempt's idempotency-key; the first attempt of a key fails UNAVAILABLE."""

    def __init__(self):
        self.lock = threading.Lock()
        self.keys = []

    def charge(self, request, context):
        key = dict(context.invocation_metadata()).get("idempotency-key", "")
        with self.lock:
            first = key not in self.keys
            self.keys.append(key)
        if first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected: try again")
        return b"charged"

    def start(self):
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("shop.Payments", {
            "Charge": grpc.unary_unary_rpc_method_handler(self.charge)})])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server, "127.0.0.1:%d" % port


class GRPCClientInterceptorTest(unittest.TestCase):
    def setUp(self):
        self.service = FlakyService()
        server, self.addr = self.service.start()
        self.addCleanup(server.stop, None)

    def check(self, keys, explicit=None):
        self.assertEqual(len(keys), 4, keys)  # two calls, each failed once and retried by grpc
        first, second = keys[:2], keys[2:]
        self.assertEqual(first[0], first[1], "one call's attempts carry one key")
        self.assertEqual(second[0], second[1])
        self.assertNotEqual(first[0], second[0], "each call gets its own key")
        uuid.UUID(first[0])
        if explicit is not None:
            self.assertEqual(second[0], explicit)

    def test_sync_interceptor_keeps_the_key_across_grpc_retries(self):
        channel = grpc.intercept_channel(grpc.insecure_channel(self.addr, OPTIONS), idemcoord.grpc.ClientInterceptor())
        self.addCleanup(channel.close)
        stub = channel.unary_unary("/shop.Payments/Charge")
        self.assertEqual(stub(b"order-1", timeout=10), b"charged")
        self.assertEqual(stub(b"order-2", timeout=10), b"charged")
        self.check(self.service.keys)

    def test_sync_interceptor_keeps_a_key_the_caller_set(self):
        channel = grpc.intercept_channel(grpc.insecure_channel(self.addr, OPTIONS), idemcoord.grpc.ClientInterceptor())
        self.addCleanup(channel.close)
        stub = channel.unary_unary("/shop.Payments/Charge")
        stub(b"order-1", timeout=10)
        mine = str(uuid.uuid4())
        stub(b"order-2", timeout=10, metadata=[("idempotency-key", mine)])
        self.check(self.service.keys, explicit=mine)

    def test_aio_interceptor_keeps_the_key_across_grpc_retries(self):
        async def main():
            async with grpc.aio.insecure_channel(self.addr, options=OPTIONS,
                                                 interceptors=[idemcoord.aio.ClientInterceptor()]) as channel:
                stub = channel.unary_unary("/shop.Payments/Charge")
                self.assertEqual(await stub(b"order-1", timeout=10), b"charged")
                self.assertEqual(await stub(b"order-2", timeout=10), b"charged")
        asyncio.run(main())
        self.check(self.service.keys)


class FlakyHTTP(http.server.BaseHTTPRequestHandler):
    keys = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        key = self.headers.get("Idempotency-Key", "")
        first = key not in FlakyHTTP.keys
        FlakyHTTP.keys.append(key)
        self.send_response(503 if first else 201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class RequestsAdapterTest(unittest.TestCase):
    def setUp(self):
        FlakyHTTP.keys = []
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FlakyHTTP)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        self.url = "http://127.0.0.1:%d/charges" % server.server_address[1]

    def test_one_key_before_urllib3_retries(self):
        session = requests.Session()
        self.addCleanup(session.close)
        retry = Retry(total=3, status_forcelist=[503], allowed_methods=None, backoff_factor=0,
                      raise_on_status=False)
        session.mount("http://", idemcoord.callers.IdempotencyKeyAdapter(max_retries=retry))
        first = session.post(self.url, json={"amount": 1}, timeout=10)
        second = session.post(self.url, json={"amount": 2}, timeout=10)
        self.assertEqual((first.status_code, second.status_code), (201, 201))
        keys = FlakyHTTP.keys
        self.assertEqual(len(keys), 4, keys)
        self.assertEqual(keys[0], keys[1], "urllib3's retry carries the key of the first try")
        self.assertEqual(keys[2], keys[3])
        self.assertNotEqual(keys[0], keys[2])
        self.assertEqual(idemcoord.callers.key_of(first), str(uuid.UUID(keys[0].strip('"'))))

    def test_stamp_keeps_a_key_already_set(self):
        headers = {"idempotency-key": '"order-7"'}
        self.assertEqual(idemcoord.callers.stamp_idempotency_key(headers), "order-7")
        self.assertEqual(headers, {"idempotency-key": '"order-7"'})
        fresh = {}
        key = idemcoord.callers.stamp_idempotency_key(fresh)
        self.assertEqual(fresh, {"Idempotency-Key": '"%s"' % key})


if __name__ == "__main__":
    unittest.main()
