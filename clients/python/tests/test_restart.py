"""A coordinator restart: the clients serve again within seconds, and a handler that finished meanwhile is recorded.

The coordinator is this module's own throwaway one (coordinator.py,
Coordinator(own=True), even when IDEMCOORD_ADDR is set). It is stopped while
the client keeps calling it, as a serving process does; meanwhile the test
listens on its address and closes every connection the client opens there,
so it sees when the client tries to connect. The first try at least DOWN
seconds in (past the first steps of gRPC's default reconnect backoff: 1,
1.6, 2.56, 4.1, 6.5 s) is the restart's cue: the coordinator is started
again on the same address and database, and the client must be served
within SERVE_AGAIN_WITHIN seconds (under gRPC's default backoff its next try
came 8 s or more later).
"""

import asyncio
import io
import socket
import threading
import time
import unittest
import uuid

import grpc

import idemcoord
import idemcoord.aio
from idemcoord import _api
from idemcoord.wsgi import IdempotencyMiddleware

from .coordinator import Coordinator, fixture_options

DOWN = 12.0  # seconds the coordinator is stopped at least
SERVE_AGAIN_WITHIN = 5.0  # seconds after it is ready again (Go's and Node's clients take 3-4 s)
LEASE = 30.0  # the handlers' lease: it outlasts DOWN, so their endings can still land
CALL_EVERY = 0.25  # how often the client calls while the coordinator is down

COORD = None


def setUpModule():
    global COORD
    COORD = Coordinator(own=True)


def tearDownModule():
    COORD.stop()


def _down_until_a_late_connect(on_stopped):
    """Stops the coordinator and calls on_stopped(); returns when the client tried to connect DOWN seconds or more later (the times of its tries).

    Meanwhile the coordinator's address is listened on, and every
    connection opened there is closed at once: a failed try to the client.
    """
    host, port = COORD.addr.rsplit(":", 1)
    COORD.stop_serving()
    stopped = time.monotonic()
    on_stopped()
    watcher = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    watcher.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    watcher.bind((host, int(port)))
    watcher.listen(16)
    watcher.settimeout(0.05)
    tries = []
    try:
        while time.monotonic() - stopped < DOWN + 30:
            try:
                conn, _ = watcher.accept()
            except socket.timeout:
                continue
            conn.close()
            tries.append(round(time.monotonic() - stopped, 2))
            if tries[-1] >= DOWN:
                return tries
        raise AssertionError("the client tried to connect at %s s, never %s s or more after the stop" % (tries, DOWN))
    finally:
        watcher.close()


def _wsgi_environ(key, body):
    return {"REQUEST_METHOD": "POST", "PATH_INFO": "/orders", "QUERY_STRING": "", "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1", "CONTENT_LENGTH": str(len(body)),
            "HTTP_IDEMPOTENCY_KEY": key, "wsgi.input": io.BytesIO(body), "wsgi.url_scheme": "http",
            "wsgi.errors": io.StringIO(), "wsgi.multithread": True, "wsgi.multiprocess": False,
            "wsgi.run_once": False, "wsgi.version": (1, 0)}


def _call_wsgi(app, environ):
    answer = {}

    def start_response(status, headers, exc_info=None):
        answer["status"], answer["headers"] = status, dict(headers)
        return lambda chunk: None
    answer["body"] = b"".join(app(environ, start_response))
    return answer


class SyncRestartTest(unittest.TestCase):
    def test_serves_soon_and_records_a_handler_that_finished_while_down(self):
        client = idemcoord.Client(COORD.addr, **fixture_options(token=COORD.token, lease=LEASE))
        self.addCleanup(client.shutdown, 10)
        scope = "restart-sync-" + uuid.uuid4().hex
        client.begin(scope=scope, key="warm", fingerprint=b"f")  # the channel is connected

        down = threading.Event()
        runs = []

        def app(environ, start_response):
            runs.append(1)
            down.wait(30)
            time.sleep(1)  # it finishes while the coordinator is down
            start_response("201 Created", [("Content-Type", "text/plain")])
            return [b"order 1 created"]
        middleware = IdempotencyMiddleware(app, client, scope=scope, without_principal=True)
        answers = []
        request = threading.Thread(
            target=lambda: answers.append(_call_wsgi(middleware, _wsgi_environ("order-1", b"{}"))))
        request.start()
        while not runs:
            time.sleep(0.01)  # the handler holds the key

        calling = threading.Event()

        def keep_calling():
            while not calling.wait(CALL_EVERY):
                try:
                    client.lookup(scope=scope, key="warm", timeout=1)
                except grpc.RpcError:
                    pass
        caller = threading.Thread(target=keep_calling)
        caller.start()
        try:
            tries = _down_until_a_late_connect(down.set)
        finally:
            calling.set()
            caller.join()
        request.join(10)
        self.assertEqual([a["status"] for a in answers], ["201 Created"], "the handler's answer, sent while down")
        COORD.start_serving()

        ready = time.monotonic()
        served = None
        while served is None and time.monotonic() - ready < 60:
            try:
                client.begin(scope=scope, key="after", fingerprint=b"f", timeout=1)
                served = time.monotonic() - ready
            except grpc.RpcError:
                time.sleep(0.05)
        print("\nidemcoord.Client: tries to connect while down at %s s; served again %.2f s after the coordinator "
              "was ready" % (tries, served or -1))
        self.assertIsNotNone(served, "no Begin served within 60 s of the restart")
        self.assertLess(served, SERVE_AGAIN_WITHIN)

        rec = _settled(lambda: client.lookup(scope=scope, key="order-1", timeout=1))
        print("idemcoord.wsgi: the handler's record read %s %.2f s after the coordinator was ready"
              % (_api.State.Name(rec.state), time.monotonic() - ready))
        self.assertEqual(_api.State.Name(rec.state), "STATE_COMPLETED")
        again = _call_wsgi(middleware, _wsgi_environ("order-1", b"{}"))
        self.assertEqual((again["status"], again["body"], len(runs)), ("201 Created", b"order 1 created", 1))
        self.assertEqual(again["headers"].get("Idempotency-Result"), "replayed")


def _settled(lookup, within=LEASE + 10):
    """The record once it is no longer in progress (or the last one read after within seconds)."""
    until = time.monotonic() + within
    rec = None
    while time.monotonic() < until:
        try:
            rec = lookup().record
        except grpc.RpcError:
            pass
        if rec is not None and rec.state != _api.State.STATE_IN_PROGRESS:
            break
        time.sleep(0.2)
    return rec


class AsyncRestartTest(unittest.TestCase):
    def test_serves_soon_and_records_a_handler_that_finished_while_down(self):
        asyncio.run(self._run())

    async def _run(self):
        loop = asyncio.get_running_loop()
        client = idemcoord.aio.Client(COORD.addr, **fixture_options(token=COORD.token, lease=LEASE))
        try:
            scope = "restart-aio-" + uuid.uuid4().hex
            await client.begin(scope=scope, key="warm", fingerprint=b"f")
            down = asyncio.Event()

            async def handler(attempt):
                await down.wait()
                await asyncio.sleep(1)  # it finishes while the coordinator is down
                return dict(body=b"order 1 created")
            once = asyncio.ensure_future(client.once(scope, "order-1", b"f", handler))
            await asyncio.sleep(0.5)  # the handler holds the key

            async def keep_calling():
                while True:
                    try:
                        await client.lookup(scope=scope, key="warm", timeout=1)
                    except grpc.RpcError:
                        pass
                    await asyncio.sleep(CALL_EVERY)
            caller = asyncio.ensure_future(keep_calling())
            try:
                tries = await loop.run_in_executor(None, _down_until_a_late_connect,
                                                   lambda: loop.call_soon_threadsafe(down.set))
            finally:
                caller.cancel()
            result = await asyncio.wait_for(once, 10)
            self.assertEqual((result.response.body, result.replayed), (b"order 1 created", False))
            await loop.run_in_executor(None, COORD.start_serving)

            ready = time.monotonic()
            served = None
            while served is None and time.monotonic() - ready < 60:
                try:
                    await client.begin(scope=scope, key="after", fingerprint=b"f", timeout=1)
                    served = time.monotonic() - ready
                except grpc.RpcError:
                    await asyncio.sleep(0.05)
            print("\nidemcoord.aio.Client: tries to connect while down at %s s; served again %.2f s after the "
                  "coordinator was ready" % (tries, served or -1))
            self.assertIsNotNone(served, "no Begin served within 60 s of the restart")
            self.assertLess(served, SERVE_AGAIN_WITHIN)

            until = time.monotonic() + LEASE + 10
            rec = None
            while time.monotonic() < until:
                try:
                    rec = (await client.lookup(scope=scope, key="order-1", timeout=1)).record
                except grpc.RpcError:
                    pass
                if rec is not None and rec.state != _api.State.STATE_IN_PROGRESS:
                    break
                await asyncio.sleep(0.2)
            self.assertIsNotNone(rec)
            print("idemcoord.aio: the handler's record read %s %.2f s after the coordinator was ready"
                  % (_api.State.Name(rec.state), time.monotonic() - ready))
            self.assertEqual(_api.State.Name(rec.state), "STATE_COMPLETED")
            replay = await client.once(scope, "order-1", b"f", handler)
            self.assertEqual((replay.response.body, replay.replayed), (b"order 1 created", True))
        finally:
            await client.shutdown(timeout=10)


if __name__ == "__main__":
    unittest.main()
