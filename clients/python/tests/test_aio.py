"""idemcoord.aio: the asyncio client's once against a real coordinator (see coordinator.py)."""

import asyncio
import time
import unittest
import uuid

import grpc

import idemcoord
import idemcoord.aio

from .coordinator import Coordinator, fixture_options

COORD = None


def setUpModule():
    global COORD
    COORD = Coordinator()


def tearDownModule():
    COORD.stop()


def key(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex)


class AioOnceTest(unittest.IsolatedAsyncioTestCase):
    async def asyncSetUp(self):
        self.client = idemcoord.aio.Client(COORD.addr, **fixture_options(token=COORD.token, lease=2))

    async def asyncTearDown(self):
        await self.client.shutdown(timeout=10)

    async def state(self, scope, k):
        try:
            return idemcoord.State.Name((await self.client.lookup(scope=scope, key=k)).record.state)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return "absent"
            raise

    async def test_ten_concurrent_duplicates_run_once(self):
        k, runs = key("aio-dup"), []

        async def charge(attempt):
            runs.append(attempt.lease.attempt)
            idemcoord.mark_side_effect()
            await asyncio.sleep(0.3)
            return {"body": b"charged", "status_code": 201}
        results = await asyncio.gather(*[self.client.once("aio", k, b"fp", charge) for _ in range(10)])
        self.assertEqual(runs, [1])
        self.assertEqual({bytes(r.response.body) for r in results}, {b"charged"})
        self.assertEqual(sum(not r.replayed for r in results), 1)
        self.assertTrue((await self.client.once("aio", k, b"fp", charge)).replayed)

    async def test_handler_outlives_its_lease_with_heartbeats(self):
        k = key("aio-slow")

        async def slow(attempt):
            await asyncio.sleep(3)
            return {"body": b"slow"}
        self.assertEqual(bytes((await self.client.once("aio", k, b"", slow)).response.body), b"slow")
        self.assertEqual(await self.state("aio", k), "STATE_COMPLETED")

    async def test_mark_then_failure_is_unknown(self):
        k = key("aio-mark")

        async def half(attempt):
            idemcoord.mark_side_effect()
            raise RuntimeError("half done")
        with self.assertRaises(RuntimeError):
            await self.client.once("aio", k, b"", half)
        self.assertEqual(await self.state("aio", k), "STATE_UNKNOWN")

    async def test_replayable_failure_is_stored(self):
        k = key("aio-replayable")

        async def missing(attempt):
            raise idemcoord.FailureError("FAILURE_KIND_REPLAYABLE", "no such project", code=grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(idemcoord.StoredFailure):
            await self.client.once("aio", k, b"", missing)
        with self.assertRaises(idemcoord.StoredFailure) as replay:
            await self.client.once("aio", k, b"", missing)
        self.assertTrue(replay.exception.result.replayed)
        self.assertEqual(await self.state("aio", k), "STATE_FAILED_REPLAYABLE")

    async def test_caller_gives_up_during_begin_and_strands_nothing(self):
        k = key("aio-gaveup")
        hold = await self.client.begin(scope="aio", key=k, attempt_id="holder")
        runs = []

        async def fn(attempt):
            runs.append(1)
            return {"body": b"ran"}
        task = asyncio.ensure_future(self.client.once("aio", k, b"", fn))
        await asyncio.sleep(0.5)
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        await self.client.fail(scope="aio", key=k, lease_token=hold.lease_token, kind="FAILURE_KIND_ABANDONED",
                               reason="released")
        deadline = time.monotonic() + 10
        while await self.state("aio", k) != "absent" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.assertEqual(await self.state("aio", k), "absent")
        self.assertEqual(runs, [])
        self.assertFalse((await self.client.once("aio", k, b"", fn)).replayed)
        self.assertEqual(runs, [1])


if __name__ == "__main__":
    unittest.main()
