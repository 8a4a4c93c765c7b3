"""Recovery points (checkpoints) from Python against a real coordinator (see coordinator.py).

once (sync and asyncio), the abandon rule, fencing, the limits, a WSGI app
and an ASGI app whose retry resumes after the checkpoint.
"""

import asyncio
import contextvars
import logging
import os
import threading
import unittest
import uuid

import grpc

import idemcoord
import idemcoord.aio
from idemcoord import State

from .coordinator import Coordinator
from .test_client import Fault, GrpcError

COORD = None
CLIENTS = []


def setUpModule():
    global COORD
    COORD = Coordinator()


def tearDownModule():
    for c in CLIENTS:
        c.shutdown(timeout=10)
    COORD.stop()


def new_client():
    c = idemcoord.Client(COORD.addr, token=COORD.token)
    CLIENTS.append(c)
    return c


def unique_key(prefix="order"):
    return "%s-%s" % (prefix, uuid.uuid4())


SCOPE = "py.checkpoint"


class CheckpointTest(unittest.TestCase):
    def test_a_checkpoint_outlives_a_retryable_failure_and_the_next_attempt_resumes_after_it(self):
        c = new_client()
        key = unique_key()

        def first(attempt):
            self.assertIsNone(attempt.checkpoint_from())
            idemcoord.checkpoint("charged", b"ch_1")
            own = idemcoord.checkpoint_from()
            self.assertEqual((own.phase, own.data), ("charged", b"ch_1"))
            raise GrpcError(grpc.StatusCode.UNAVAILABLE, "provisioning backend down")
        with self.assertRaises(grpc.RpcError):
            c.once(SCOPE, key, None, first)
        rec = c.lookup(scope=SCOPE, key=key).record
        self.assertEqual(rec.state, State.STATE_FAILED_RETRYABLE)
        self.assertEqual((rec.checkpoint.phase, rec.checkpoint.data), ("charged", b"ch_1"))
        self.assertTrue(rec.checkpoint.HasField("at"), "the coordinator stamps the checkpoint")

        def second(attempt):
            self.assertEqual(attempt.lease.previous, State.STATE_FAILED_RETRYABLE)
            resumed = attempt.checkpoint_from()
            self.assertEqual((resumed.phase, resumed.data), ("charged", b"ch_1"))
            self.assertIsNotNone(resumed.at)
            attempt.checkpoint("provisioned", "m_7")  # a str is UTF-8
            return idemcoord.StoredResponse(body=b"done")
        res = c.once(SCOPE, key, None, second)
        self.assertEqual(res.response.body, b"done")
        rec = c.lookup(scope=SCOPE, key=key).record
        self.assertEqual(rec.state, State.STATE_COMPLETED)
        self.assertEqual((rec.checkpoint.phase, rec.checkpoint.data), ("provisioned", b"m_7"),
                         "a completed record keeps its last checkpoint")

    def test_an_attempt_that_recorded_a_checkpoint_is_ended_retryable_not_abandoned(self):
        c = new_client()
        key = unique_key()

        def fn(attempt):
            idemcoord.checkpoint("charged", b"ch_2")
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad address")
        with self.assertRaises(grpc.RpcError):
            c.once(SCOPE, key, None, fn)
        rec = c.lookup(scope=SCOPE, key=key).record
        self.assertEqual(rec.state, State.STATE_FAILED_RETRYABLE)
        self.assertEqual(rec.checkpoint.phase, "charged")
        # Without a checkpoint the same failure leaves no record.
        key2 = unique_key()

        def plain(attempt):
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad address")
        with self.assertRaises(grpc.RpcError):
            c.once(SCOPE, key2, None, plain)
        with self.assertRaises(grpc.RpcError) as ctx:
            c.lookup(scope=SCOPE, key=key2)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_a_checkpoint_after_the_attempt_lost_the_key_raises_lease_lost_and_changes_nothing(self):
        c = new_client()
        key = unique_key()

        def fn(attempt):
            attempt.checkpoint("charged", b"ch_3")
            # The attempt is ended behind the library's back, as a takeover would.
            c.fail(scope=SCOPE, key=key, lease_token=attempt.lease.token, kind="FAILURE_KIND_RETRYABLE", reason="test")
            with self.assertRaises(idemcoord.LeaseLost) as ctx:
                attempt.checkpoint("provisioned", b"m_3")
            self.assertEqual(ctx.exception.__cause__.code(), grpc.StatusCode.FAILED_PRECONDITION)
            raise GrpcError(grpc.StatusCode.UNAVAILABLE, "stop")
        with self.assertRaises(Exception):
            c.once(SCOPE, key, None, fn)
        rec = c.lookup(scope=SCOPE, key=key).record
        self.assertEqual(rec.checkpoint.phase, "charged", "the refused checkpoint changed nothing")

    def test_bad_checkpoints_are_refused_and_record_nothing(self):
        c = new_client()
        key = unique_key()
        with self.assertRaises(RuntimeError):
            idemcoord.checkpoint("charged", b"x")
        self.assertIsNone(idemcoord.checkpoint_from())

        def fn(attempt):
            for phase, data in (("", b"x"), ("p" * 129, b"x"), ("big", b"\0" * (64 * 1024 + 1))):
                with self.assertRaises(grpc.RpcError) as ctx:
                    idemcoord.checkpoint(phase, data)
                self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIsNone(idemcoord.checkpoint_from())
            return idemcoord.StoredResponse(body=b"ok")
        c.once(SCOPE, key, None, fn)
        rec = c.lookup(scope=SCOPE, key=key).record
        self.assertEqual(rec.state, State.STATE_COMPLETED)
        self.assertFalse(rec.HasField("checkpoint"), "no checkpoint was recorded")

    def test_data_that_is_not_bytes_or_str_is_refused_before_sending(self):
        # bytes(42) is 42 NUL bytes and bytes([1, 2]) is b"\x01\x02": neither
        # may be recorded as a checkpoint's data.
        c = new_client()
        key = unique_key()

        def fn(attempt):
            for data in (42, 10 ** 9, [1, 2], {3: 4}, None, 1.5):
                with self.assertRaises(TypeError, msg=repr(data)):
                    idemcoord.checkpoint("charged", data)
            # A phase that is not a str: checkpoint_from would answer bytes, the next attempt a str.
            for phase in (b"charged", 5, None):
                with self.assertRaises(TypeError, msg=repr(phase)):
                    idemcoord.checkpoint(phase, b"x")
            self.assertIsNone(idemcoord.checkpoint_from())
            buf = bytearray(b"ch_1")
            idemcoord.checkpoint("charged", buf)
            buf[:] = b"XXXX"  # the recorded data is a copy
            self.assertEqual(idemcoord.checkpoint_from().data, b"ch_1")
            idemcoord.checkpoint("shipped", memoryview(b"sh_1"))
            idemcoord.checkpoint("mixed", "é")
            self.assertEqual(idemcoord.checkpoint_from().data, "é".encode())
            return idemcoord.StoredResponse(body=b"ok")
        c.once(SCOPE, key, None, fn)
        rec = c.lookup(scope=SCOPE, key=key).record
        self.assertEqual((rec.checkpoint.phase, rec.checkpoint.data), ("mixed", "é".encode()))

    def test_asyncio_data_that_is_not_bytes_or_str_is_refused(self):
        key = unique_key()

        async def run():
            async with idemcoord.aio.Client(COORD.addr, token=COORD.token) as c:
                async def fn(attempt):
                    with self.assertRaises(TypeError):
                        await idemcoord.aio.checkpoint("charged", 42)
                    self.assertIsNone(idemcoord.checkpoint_from())
                    return idemcoord.StoredResponse(body=b"ok")
                await c.once(SCOPE, key, None, fn)
                rec = (await c.lookup(scope=SCOPE, key=key)).record
                self.assertFalse(rec.HasField("checkpoint"))
        asyncio.run(run())

    def test_an_abandoned_refused_in_the_background_is_sent_again_as_retryable(self):
        # The end of the attempt cannot reach the coordinator, so the library
        # retries it in the background; the ABANDONED it sends once it can is
        # refused CHECKPOINT_RECORDED (a checkpoint of the application's own
        # Heartbeat), and it must then send RETRYABLE, as finish does.
        fails = Fault("Fail")
        c = idemcoord.Client(COORD.addr, token=COORD.token, interceptors=[fails], max_attempts=1)
        key = unique_key()

        def fn(attempt):
            c.heartbeat(scope=SCOPE, key=key, lease_token=attempt.lease.token,
                        checkpoint=dict(phase="charged", data=b"ch_own"))
            fails.cut_off = True
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "address rejected after the charge")
        with self.assertRaises(grpc.RpcError):
            c.once(SCOPE, key, None, fn)
        fails.cut_off = False
        c.shutdown(timeout=60)  # waits for the ending retried in the background
        rec = new_client().lookup(scope=SCOPE, key=key).record
        self.assertEqual((rec.state, rec.checkpoint.phase), (State.STATE_FAILED_RETRYABLE, "charged"))
        self.assertIn("FAILURE_KIND_ABANDONED", [idemcoord.FailureKind.Name(r.kind) for r in fails.requests])

    def test_asyncio_an_abandoned_refused_in_the_background_is_sent_again_as_retryable(self):
        key = unique_key()

        async def run():
            c = idemcoord.aio.Client(COORD.addr, token=COORD.token, max_attempts=1)
            fail, cut, kinds = c.fail, [False], []

            async def cut_off_fail(**fields):
                kinds.append(fields.get("kind"))
                if cut[0]:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               "cut off (test)")
                return await fail(**fields)
            c.fail = cut_off_fail

            async def fn(attempt):
                await c.heartbeat(scope=SCOPE, key=key, lease_token=attempt.lease.token,
                                  checkpoint=dict(phase="charged", data=b"ch_own"))
                cut[0] = True
                raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "address rejected after the charge")
            with self.assertRaises(grpc.RpcError):
                await c.once(SCOPE, key, None, fn)
            cut[0] = False
            await c.shutdown(timeout=60)
            self.assertIn("FAILURE_KIND_ABANDONED", kinds)
        asyncio.run(run())
        rec = new_client().lookup(scope=SCOPE, key=key).record
        self.assertEqual((rec.state, rec.checkpoint.phase), (State.STATE_FAILED_RETRYABLE, "charged"))

    def test_asyncio_once_records_and_resumes(self):
        key = unique_key()

        async def run():
            async with idemcoord.aio.Client(COORD.addr, token=COORD.token) as c:
                async def first(attempt):
                    with self.assertRaises(TypeError):  # the synchronous call in an asyncio attempt
                        attempt.checkpoint("charged", b"ch_4")
                    await idemcoord.aio.checkpoint("charged", b"ch_4")
                    raise GrpcError(grpc.StatusCode.UNAVAILABLE, "down")
                with self.assertRaises(grpc.RpcError):
                    await c.once(SCOPE, key, None, first)

                async def second(attempt):
                    resumed = idemcoord.checkpoint_from()
                    self.assertEqual((resumed.phase, resumed.data), ("charged", b"ch_4"))
                    await attempt.checkpoint_async("provisioned", b"m_4")
                    return idemcoord.StoredResponse(body=b"done")
                res = await c.once(SCOPE, key, None, second)
                self.assertEqual(res.response.body, b"done")
                rec = (await c.lookup(scope=SCOPE, key=key)).record
                self.assertEqual((rec.state, rec.checkpoint.phase), (State.STATE_COMPLETED, "provisioned"))
        asyncio.run(run())


class MiddlewareCheckpointTest(unittest.TestCase):
    """A handler records a checkpoint, answers 503 (retryable); its retry resumes after it."""

    def post_twice(self, base):
        import httpx
        key = {"Idempotency-Key": unique_key()}
        first = httpx.post(base + "/orders", headers=key)
        self.assertEqual(first.status_code, 503)
        second = httpx.post(base + "/orders", headers=key)
        self.assertEqual((second.status_code, second.text), (201, "resumed after charged (ch_1)"))
        replay = httpx.post(base + "/orders", headers=key)
        self.assertEqual(replay.headers.get("idempotency-result"), "replayed")

    def test_wsgi(self):
        try:
            import httpx  # noqa: F401
        except ImportError as err:
            if os.environ.get("CI") == "true":
                raise
            self.skipTest("httpx missing: %s" % err)
        from idemcoord.wsgi import IdempotencyMiddleware
        from .test_wsgi import serve_werkzeug
        runs = []

        def app(environ, start_response):
            runs.append(1)
            resumed = idemcoord.checkpoint_from()
            if resumed is None:
                idemcoord.checkpoint("charged", b"ch_%d" % len(runs))
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"provisioning backend down"]
            start_response("201 Created", [("Content-Type", "text/plain")])
            return [b"resumed after %s (%s)" % (resumed.phase.encode(), resumed.data)]
        base, close = serve_werkzeug(IdempotencyMiddleware(app, client=new_client(), service="py-checkpoint",
                                                           without_principal=True))
        self.addCleanup(close)
        self.post_twice(base)
        self.assertEqual(len(runs), 2)

    def test_asgi(self):
        try:
            import starlette.applications
            import starlette.responses
            import starlette.routing
        except ImportError as err:
            if os.environ.get("CI") == "true":
                raise
            self.skipTest("ASGI stack missing: %s" % err)
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
        from idemcoord.asgi import IdempotencyMiddleware
        from .test_asgi import serve
        runs = []

        async def orders(request):
            runs.append(1)
            resumed = idemcoord.checkpoint_from()
            if resumed is None:
                await idemcoord.aio.checkpoint("charged", b"ch_%d" % len(runs))
                return starlette.responses.PlainTextResponse("provisioning backend down", 503)
            return starlette.responses.PlainTextResponse("resumed after %s (%s)" % (resumed.phase, resumed.data.decode()), 201)
        # A synchronous Client: the middleware builds an asyncio one like it
        # on the server's loop, so the app's attempt is an asyncio one.
        client = new_client()
        app = starlette.applications.Starlette(routes=[starlette.routing.Route("/orders", orders, methods=["POST"])])
        base, close = serve(IdempotencyMiddleware(app, client=client, service="py-checkpoint", without_principal=True))
        self.addCleanup(close)
        self.post_twice(base)
        self.assertEqual(len(runs), 2)


class _HoldFirstAnswer(grpc.UnaryUnaryClientInterceptor):
    """Holds back the answer of the first Heartbeat recording phase "first" until released."""

    def __init__(self):
        self.written = threading.Event()
        self.release = threading.Event()
        self._held = False
        self._lock = threading.Lock()

    def intercept_unary_unary(self, continuation, client_call_details, request):
        outcome = continuation(client_call_details, request)
        ck = getattr(request, "checkpoint", None)
        if ck is not None and request.HasField("checkpoint") and ck.phase == "first":
            with self._lock:
                mine, self._held = not self._held, True
            if mine:
                outcome.result()  # the coordinator has written it
                self.written.set()
                self.release.wait(30)
        return outcome


class ConcurrentCheckpointTest(unittest.TestCase):
    def test_of_concurrent_checkpoints_checkpoint_from_keeps_the_one_written_last(self):
        hold = _HoldFirstAnswer()
        c = idemcoord.Client(COORD.addr, token=COORD.token, interceptors=[hold])
        CLIENTS.append(c)
        key = unique_key("concurrent")
        seen = []

        def fn(attempt):
            errors = []

            def first():
                try:
                    idemcoord.checkpoint("first", b"1")
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            t = threading.Thread(target=contextvars.copy_context().run, args=(first,))
            t.start()
            self.assertTrue(hold.written.wait(30), "the first checkpoint was not written")
            idemcoord.checkpoint("second", b"2")
            hold.release.set()
            t.join(30)
            self.assertEqual(errors, [])
            own = idemcoord.checkpoint_from()
            seen.append((own.phase, own.data))
            return idemcoord.StoredResponse(body=b"done")

        c.once(SCOPE, key, None, fn)
        rec = c.lookup(scope=SCOPE, key=key).record
        self.assertEqual(rec.checkpoint.phase, "second")
        self.assertEqual(seen, [("second", b"2")], "checkpoint_from keeps the checkpoint written last, not the one answered last")
