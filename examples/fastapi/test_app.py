"""The example against a real coordinator: duplicates book one charge.

Run from examples/fastapi: PYTHONPATH=../../clients/python /usr/bin/python3 -m unittest -v
"""

import concurrent.futures
import os
import socket
import sys
import threading
import time
import unittest
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

import idemcoord  # noqa: E402
from tests.coordinator import Coordinator  # noqa: E402  (clients/python/tests)

import app as example  # noqa: E402


class ChargesTest(unittest.TestCase):
    def test_a_charge_sent_ten_times_at_once_and_retried_books_once(self):
        coord = Coordinator()
        self.addCleanup(coord.stop)
        client = idemcoord.Client(coord.addr, token=coord.token)
        self.addCleanup(client.shutdown, 10)
        app = example.create_app(client)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
        t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        t.start()
        while not server.started:
            time.sleep(0.01)
        self.addCleanup(t.join, 10)
        self.addCleanup(setattr, server, "should_exit", True)
        url = "http://127.0.0.1:%d/charges" % sock.getsockname()[1]
        key = "order-" + uuid.uuid4().hex

        def send(k=key, amount=500):
            return httpx.post(url, headers={"Idempotency-Key": k}, json={"amount": amount}, timeout=30)
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: send(), range(10)))
        retry = send()
        self.assertEqual({a.status_code for a in answers}, {201})
        self.assertEqual({a.content for a in answers + [retry]}, {answers[0].content})
        self.assertEqual(retry.headers["Idempotency-Result"], "replayed")
        self.assertEqual(len(app.state.charges), 1)
        self.assertEqual(httpx.post(url, json={"amount": 1}).status_code, 400)  # the key is required
        self.assertEqual(send(k="order-" + uuid.uuid4().hex).status_code, 201)
        self.assertEqual(len(app.state.charges), 2)


if __name__ == "__main__":
    unittest.main()
