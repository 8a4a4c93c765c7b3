"""Call batching (call_batching=N) in both clients, against a real coordinator (see coordinator.py).

The Batch RPCs are counted by client interceptors, which see them as any
RPC of the channel; a Delay interceptor holds a Batch's answer back to
make a round outlive a caller.
"""

import asyncio
import concurrent.futures
import threading
import time
import unittest
import uuid

import grpc
import grpc.aio

import idemcoord
import idemcoord.aio
from idemcoord import Outcome, State

from .coordinator import Coordinator

COORD = None
ACQUIRED, REPLAY = Outcome.OUTCOME_ACQUIRED, Outcome.OUTCOME_REPLAY


def setUpModule():
    global COORD
    COORD = Coordinator()


def tearDownModule():
    COORD.stop()


def key(prefix="b"):
    return "%s-%s" % (prefix, uuid.uuid4().hex)


def method_of(details):
    m = details.method
    return (m.decode() if isinstance(m, bytes) else m).rsplit("/", 1)[1]


class Refusal(grpc.RpcError, grpc.Call):
    """The error of an RPC refused before it reached the coordinator (an older coordinator, a cut)."""

    def __init__(self, code):
        super().__init__(code.name)
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "refused (test)"

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


class Rpcs(grpc.UnaryUnaryClientInterceptor):
    """Counts the RPCs by method and the calls of each Batch; can hold Batch answers back or refuse Batches."""

    def __init__(self, delay=0.0, refuse=None, refusals=-1):
        self.lock = threading.Lock()
        self.n, self.batch_sizes = {}, []
        self.delay, self.refuse, self.refusals = delay, refuse, refusals

    def note(self, details, request):
        m = method_of(details)
        with self.lock:
            self.n[m] = self.n.get(m, 0) + 1
            if m != "Batch":
                return None
            self.batch_sizes.append(len(request.calls))
            if self.refuse is not None and self.refusals != 0:
                self.refusals -= 1
                return self.refuse
        return None

    def intercept_unary_unary(self, continuation, details, request):
        refuse = self.note(details, request)
        if refuse is not None:
            raise Refusal(refuse)
        out = continuation(details, request)
        if method_of(details) == "Batch" and self.delay:
            out.code()  # answered; the caller hears of it only after the delay
            time.sleep(self.delay)
        return out

    def count(self, method):
        with self.lock:
            return self.n.get(method, 0)


class AioRpcs(grpc.aio.UnaryUnaryClientInterceptor):
    """Rpcs for grpc.aio channels."""

    def __init__(self, delay=0.0, refuse=None, refusals=-1):
        self.rpcs = Rpcs(delay, refuse, refusals)

    async def intercept_unary_unary(self, continuation, details, request):
        refuse = self.rpcs.note(details, request)
        if refuse is not None:
            raise grpc.aio.AioRpcError(refuse, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused (test)")
        call = await continuation(details, request)
        if method_of(details) == "Batch" and self.rpcs.delay:
            await call
            await asyncio.sleep(self.rpcs.delay)
        return call


def status_of(err):
    """What a caller can read of a call's error: code, details and the google.rpc.Status in the trailers."""
    bin_ = [v for k, v in (err.trailing_metadata() or ()) if k == "grpc-status-details-bin"]
    return err.code(), err.details(), bin_


def reasons(err):
    """The ErrorInfo reasons of err's google.rpc.Status."""
    info_cls = idemcoord._api.message_class("google.rpc.ErrorInfo")
    out = []
    for _, v in [kv for kv in (err.trailing_metadata() or ()) if kv[0] == "grpc-status-details-bin"]:
        st = idemcoord._api.Status.FromString(v)
        for d in st.details:
            info = info_cls()
            if d.Unpack(info):
                out.append(info.reason)
    return out


def pair_and_replay(c, k):
    b = c.begin(scope="pay", key=k)
    assert b.outcome == ACQUIRED, b
    body = ("body-" + k).encode()
    c.complete(scope="pay", key=k, lease_token=b.lease_token, response=idemcoord.StoredResponse(body=body))
    r = c.begin(scope="pay", key=k)
    assert r.outcome == REPLAY and r.record.response.body == body, r


async def apair_and_replay(c, k):
    b = await c.begin(scope="pay", key=k)
    assert b.outcome == ACQUIRED, b
    body = ("body-" + k).encode()
    await c.complete(scope="pay", key=k, lease_token=b.lease_token, response=idemcoord.StoredResponse(body=body))
    r = await c.begin(scope="pay", key=k)
    assert r.outcome == REPLAY and r.record.response.body == body, r


def taken_over_token(plain):
    """The lease token of an attempt another attempt has taken over (its 1 s lease ran out)."""
    k = key("lost")
    first = plain.begin(scope="pay", key=k, lease=1)
    for _ in range(600):
        time.sleep(0.1)
        if plain.begin(scope="pay", key=k).outcome == ACQUIRED:
            return k, first.lease_token
    raise AssertionError("the 1 s lease of %s was never taken over" % k)


class SyncBatchingTest(unittest.TestCase):
    def setUp(self):
        self.clients = []
        self.plain = self.client()

    def tearDown(self):
        for c in self.clients:
            c.shutdown(timeout=10)

    def client(self, **kwargs):
        c = idemcoord.Client(COORD.addr, token=COORD.token, **kwargs)
        self.clients.append(c)
        return c

    def test_concurrent_calls_share_batch_rpcs(self):
        rpcs = Rpcs(delay=0.002)
        c = self.client(call_batching=2, interceptors=[rpcs])
        keys = [key() for _ in range(48)]
        errors = []

        def run(k):
            try:
                pair_and_replay(c, k)
            except Exception as err:  # reported below
                errors.append(err)
        threads = [threading.Thread(target=run, args=(k,)) for k in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        calls = sum(rpcs.batch_sizes)
        self.assertEqual(calls, 3 * len(keys))
        self.assertLess(len(rpcs.batch_sizes), calls / 2, "the calls were not shared: %s" % rpcs.batch_sizes)
        for m in ("Begin", "Complete"):
            self.assertEqual(rpcs.count(m), 0, "unary %s RPCs" % m)
        rec = self.plain.lookup(scope="pay", key=keys[7]).record
        self.assertEqual(rec.state, State.STATE_COMPLETED)
        self.assertEqual(rec.response.body, ("body-" + keys[7]).encode())

    def test_the_callers_of_one_answer_share_the_next_rpc(self):
        # 8 callers in lockstep (each calls again as soon as its answer is
        # in): the calls that one Batch's answer woke go together, not the
        # first of them alone in an RPC of its own with the rest behind it
        # (before, 127 to 134 RPCs for 40 steps: 1, 4, 3, 1, 4, 3, ...; now
        # 96 to 98).
        rpcs = Rpcs(delay=0.002)
        c = self.client(call_batching=2, interceptors=[rpcs])
        callers, steps = 8, 40
        errors = []

        def run(i):
            for s in range(steps):
                try:
                    c.lookup(scope="pay", key="lockstep-%d-%d-%s" % (i, s, uuid.uuid4().hex))
                    errors.append("lookup of a missing key answered")
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.NOT_FOUND:
                        errors.append(err)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(sum(rpcs.batch_sizes), callers * steps)
        self.assertLessEqual(len(rpcs.batch_sizes), steps * 14 // 5, "the calls woken by one answer did not go together: %s"
                             % rpcs.batch_sizes)

    def test_each_call_fails_as_its_unary_call_and_alone(self):
        rpcs = Rpcs(delay=0.05)
        c = self.client(call_batching=1, interceptors=[rpcs])
        held = self.plain.begin(scope="pay", key=key("held"))
        lost_key, lost_token = taken_over_token(self.plain)
        cases = {
            "stale token": lambda c: c.complete(scope="pay", key=held.record.key, lease_token="lt1.not-it"),
            "lease lost": lambda c: c.complete(scope="pay", key=lost_key, lease_token=lost_token),
            "invalid request": lambda c: c.begin(scope="pay", key=""),
            "no record": lambda c: c.lookup(scope="pay", key=key("absent")),
            "heartbeat of an ended attempt": lambda c: c.heartbeat(scope="pay", key=held.record.key,
                                                                   lease_token="lt1.not-it"),
        }
        want = {}
        for name, call in cases.items():
            with self.assertRaises(grpc.RpcError, msg=name) as cm:
                call(self.plain)
            want[name] = status_of(cm.exception)
        self.assertEqual(reasons(self._raised(cases["lease lost"], self.plain)), ["LEASE_LOST"])
        # All at once, next to calls that succeed: a first call holds the
        # one RPC slot, the rest go together in the next round.
        got, good = {}, []
        ok_keys = [key("ok") for _ in range(3)]
        with concurrent.futures.ThreadPoolExecutor(len(cases) + len(ok_keys) + 1) as pool:
            first = pool.submit(c.lookup, scope="pay", key=held.record.key)
            futures = {name: pool.submit(self._raised, call, c) for name, call in cases.items()}
            good = [pool.submit(c.begin, scope="pay", key=k) for k in ok_keys]
            first.result()
            for name, f in futures.items():
                got[name] = f.result()
            good = [f.result() for f in good]
        for name in cases:
            self.assertIsInstance(got[name], grpc.RpcError, name)
            self.assertEqual(status_of(got[name]), want[name], name)
        self.assertEqual(reasons(got["lease lost"]), ["LEASE_LOST"])
        self.assertEqual([g.outcome for g in good], [ACQUIRED] * 3)
        self.assertGreater(max(rpcs.batch_sizes), 1, "no round carried more than one call")
        self.assertEqual(rpcs.count("Lookup") + rpcs.count("Begin") + rpcs.count("Complete"), 0)
        # The holder's own Complete, batched, still succeeds.
        c.complete(scope="pay", key=held.record.key, lease_token=held.lease_token)

    @staticmethod
    def _raised(call, c):
        try:
            call(c)
        except grpc.RpcError as err:
            return err
        raise AssertionError("the call did not fail")

    def test_a_call_timeout_ends_that_call_alone(self):
        rpcs = Rpcs(delay=0.5)
        c = self.client(call_batching=1, interceptors=[rpcs])
        k = key("slow")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(c.lookup, scope="pay", key=k)  # holds the slot: the next two share a round
            while rpcs.count("Batch") == 0:
                time.sleep(0.005)
            short = pool.submit(self._raised, lambda c: c.lookup(scope="pay", key=k, timeout=0.05), c)
            long = pool.submit(c.begin, scope="pay", key=k, timeout=30)
            self.assertEqual(short.result().code(), grpc.StatusCode.DEADLINE_EXCEEDED)
            self.assertEqual(long.result().outcome, ACQUIRED)
            with self.assertRaises(grpc.RpcError) as cm:
                first.result()
            self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_giving_up_releases_the_lease(self):
        # A Begin whose timeout ends while its Batch's answer is held back
        # (the coordinator answered within the timeout: 0.5 s is ample; a
        # Begin whose answer the RPC's deadline cuts off is once's to release).
        c = self.client(call_batching=2, interceptors=[Rpcs(delay=1.5)])
        k = key("gone-begin")
        with self.assertRaises(grpc.RpcError) as cm:
            c.begin(scope="pay", key=k, timeout=0.5)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertAbsent(k)
        # once, whose caller sets its cancel_event while the Batch is in
        # flight: no deadline, so the coordinator cannot know.
        c = self.client(call_batching=2, interceptors=[Rpcs(delay=0.3)])
        k = key("gone-once")
        cancel = threading.Event()
        threading.Timer(0.05, cancel.set).start()
        with self.assertRaises(concurrent.futures.CancelledError):
            c.once("pay", k, None, lambda a: self.fail("once ran fn for a caller that had left"), cancel_event=cancel)
        self.assertAbsent(k)

    def assertAbsent(self, k):
        with self.assertRaises(grpc.RpcError) as cm:
            self.plain.lookup(scope="pay", key=k)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND, "the key is held")
        again = self.plain.begin(scope="pay", key=k)
        self.assertEqual((again.outcome, again.record.attempt), (ACQUIRED, 1))

    def test_a_coordinator_without_batch_gets_unary_calls(self):
        rpcs = Rpcs(refuse=grpc.StatusCode.UNIMPLEMENTED)
        c = self.client(call_batching=2, interceptors=[rpcs])
        keys = [key("old") for _ in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: pair_and_replay(c, k), keys))
        batches = rpcs.count("Batch")
        pair_and_replay(c, key("after"))
        self.assertEqual(rpcs.count("Batch"), batches, "Batch tried again after UNIMPLEMENTED")
        self.assertLessEqual(batches, 2)
        self.assertEqual((rpcs.count("Begin"), rpcs.count("Complete")), (18, 9))

    def test_an_unavailable_batch_is_retried_call_by_call(self):
        rpcs = Rpcs(refuse=grpc.StatusCode.UNAVAILABLE, refusals=1)
        c = self.client(call_batching=2, interceptors=[rpcs], backoff=0.01)
        pair_and_replay(c, key("retry"))
        self.assertEqual(rpcs.count("Batch"), 4, "the refused Batch's call was not retried in a Batch")
        rpcs = Rpcs(refuse=grpc.StatusCode.UNAVAILABLE)
        c = self.client(call_batching=2, interceptors=[rpcs], backoff=0.001, max_attempts=3)
        with self.assertRaises(grpc.RpcError) as cm:
            c.lookup(scope="pay", key=key())
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(rpcs.count("Batch"), 3, "a call retries as often as its unary call")

    def test_large_and_waiting_calls_go_unary(self):
        rpcs = Rpcs()
        c = self.client(call_batching=2, interceptors=[rpcs])
        k = key("big")
        b = c.begin(scope="pay", key=k)
        self.assertEqual(rpcs.batch_sizes, [1], "a lone call goes at once, alone")
        c.complete(scope="pay", key=k, lease_token=b.lease_token,
                   response=idemcoord.StoredResponse(body=b"x" * (100 << 10)))
        c.begin(scope="pay", key=key("w"), wait=1)
        self.assertEqual((rpcs.count("Complete"), rpcs.count("Begin"), rpcs.count("Batch")), (1, 1, 1))

    def test_once_runs_once_and_close_ends_the_senders(self):
        c = idemcoord.Client(COORD.addr, token=COORD.token, call_batching=2)
        k, runs = key("dup"), []

        def fn(attempt):
            runs.append(1)
            time.sleep(0.02)
            return idemcoord.StoredResponse(body=b"done")
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda _: c.once("pay", k, None, fn), range(16)))
        self.assertEqual(len(runs), 1)
        self.assertEqual({bytes(r.response.body) for r in results}, {b"done"})
        c.shutdown(timeout=10)
        self.assertEqual([t.name for t in threading.enumerate() if t.name == "idemcoord-batch"], [])


class AioBatchingTest(unittest.IsolatedAsyncioTestCase):
    async def asyncSetUp(self):
        self.clients = []
        self.plain = self.client()

    async def asyncTearDown(self):
        for c in self.clients:
            await c.shutdown(timeout=10)

    def client(self, **kwargs):
        c = idemcoord.aio.Client(COORD.addr, token=COORD.token, **kwargs)
        self.clients.append(c)
        return c

    async def test_concurrent_calls_share_batch_rpcs(self):
        i = AioRpcs()
        c = self.client(call_batching=2, interceptors=[i])
        keys = [key() for _ in range(64)]
        await asyncio.gather(*(apair_and_replay(c, k) for k in keys))
        calls = sum(i.rpcs.batch_sizes)
        self.assertEqual(calls, 3 * len(keys))
        self.assertLess(len(i.rpcs.batch_sizes), calls / 2, "the calls were not shared: %s" % i.rpcs.batch_sizes)
        self.assertEqual(i.rpcs.count("Begin") + i.rpcs.count("Complete"), 0)
        rec = (await self.plain.lookup(scope="pay", key=keys[3])).record
        self.assertEqual(rec.response.body, ("body-" + keys[3]).encode())

    async def test_calls_made_in_one_turn_of_the_loop_share_one_rpc(self):
        i = AioRpcs()
        c = self.client(call_batching=2, interceptors=[i])
        keys = [key() for _ in range(10)]
        got = await asyncio.gather(*(c.begin(scope="pay", key=k) for k in keys))
        self.assertEqual([g.outcome for g in got], [ACQUIRED] * len(keys))
        self.assertEqual(i.rpcs.batch_sizes, [len(keys)], "not one round: the first call went alone")

    async def test_each_call_fails_as_its_unary_call_and_alone(self):
        c = self.client(call_batching=1)
        held = await self.plain.begin(scope="pay", key=key("held"))
        sync_plain = idemcoord.Client(COORD.addr, token=COORD.token)
        try:
            lost_key, lost_token = await asyncio.get_running_loop().run_in_executor(None, taken_over_token, sync_plain)
        finally:
            sync_plain.close()
        cases = {
            "stale token": lambda c: c.complete(scope="pay", key=held.record.key, lease_token="lt1.not-it"),
            "lease lost": lambda c: c.complete(scope="pay", key=lost_key, lease_token=lost_token),
            "invalid request": lambda c: c.begin(scope="pay", key=""),
            "no record": lambda c: c.lookup(scope="pay", key=key("absent")),
        }

        async def raised(call, c):
            try:
                await call(c)
            except grpc.aio.AioRpcError as err:
                return err
            raise AssertionError("the call did not fail")
        want = {name: status_of(await raised(call, self.plain)) for name, call in cases.items()}
        ok = [key("ok") for _ in range(3)]
        got = await asyncio.gather(*(raised(call, c) for call in cases.values()),
                                   *(c.begin(scope="pay", key=k) for k in ok))
        for name, err in zip(cases, got):
            self.assertEqual(status_of(err), want[name], name)
        self.assertEqual(reasons(got[1]), ["LEASE_LOST"])
        self.assertEqual([g.outcome for g in got[len(cases):]], [ACQUIRED] * 3)

    async def test_a_cancelled_begin_releases_what_it_acquired(self):
        c = self.client(call_batching=2, interceptors=[AioRpcs(delay=0.3)])
        for name in ("begin", "once"):
            k = key("gone-" + name)
            if name == "begin":
                task = asyncio.ensure_future(c.begin(scope="pay", key=k))
            else:
                async def fn(attempt):
                    self.fail("once ran fn for a task that was cancelled")
                task = asyncio.ensure_future(c.once("pay", k, None, fn))
            await asyncio.sleep(0.05)
            task.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await task
            with self.assertRaises(grpc.aio.AioRpcError) as cm:
                await self.plain.lookup(scope="pay", key=k)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND, name)
            again = await self.plain.begin(scope="pay", key=k)
            self.assertEqual((again.outcome, again.record.attempt), (ACQUIRED, 1), name)

    async def test_a_call_timeout_ends_that_call_alone(self):
        i = AioRpcs(delay=0.5)
        c = self.client(call_batching=1, interceptors=[i])
        k = key("slow")
        first = asyncio.ensure_future(c.lookup(scope="pay", key=k))
        while i.rpcs.count("Batch") == 0:
            await asyncio.sleep(0.005)
        short = asyncio.ensure_future(c.lookup(scope="pay", key=k, timeout=0.05))
        long = asyncio.ensure_future(c.begin(scope="pay", key=k, timeout=30))
        with self.assertRaises(grpc.aio.AioRpcError) as cm:
            await short
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual((await long).outcome, ACQUIRED)
        with self.assertRaises(grpc.aio.AioRpcError):
            await first

    async def test_a_timed_out_begin_releases_what_it_acquired(self):
        c = self.client(call_batching=2, interceptors=[AioRpcs(delay=0.3)])
        k = key("timed-out")
        waiting = asyncio.ensure_future(c.lookup(scope="pay", key=key("absent")))  # a later deadline, in flight
        with self.assertRaises(grpc.aio.AioRpcError) as cm:
            await c.begin(scope="pay", key=k, timeout=0.1)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        with self.assertRaises(grpc.aio.AioRpcError) as cm:
            await self.plain.lookup(scope="pay", key=k)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
        again = await self.plain.begin(scope="pay", key=k)
        self.assertEqual((again.outcome, again.record.attempt), (ACQUIRED, 1))
        with self.assertRaises(grpc.aio.AioRpcError) as cm:
            await waiting
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    async def test_a_coordinator_without_batch_gets_unary_calls(self):
        i = AioRpcs(refuse=grpc.StatusCode.UNIMPLEMENTED)
        c = self.client(call_batching=2, interceptors=[i])
        await asyncio.gather(*(apair_and_replay(c, key("old")) for _ in range(8)))
        batches = i.rpcs.count("Batch")
        await apair_and_replay(c, key("after"))
        self.assertEqual(i.rpcs.count("Batch"), batches)
        self.assertLessEqual(batches, 2)
        self.assertEqual((i.rpcs.count("Begin"), i.rpcs.count("Complete")), (18, 9))

    async def test_replays_too_large_for_one_answer_are_repeated_alone(self):
        # 8 replays of 1 MB responses do not fit in one Batch's answer (the
        # coordinator answers about 3 MB of them): the calls it refuses to
        # answer in the batch are made again alone, and each gets the whole
        # stored response.
        i = AioRpcs()
        c = self.client(call_batching=1, interceptors=[i])
        body = b"x" * 1_000_000
        keys = [key("big") for _ in range(8)]
        for k in keys:
            b = await self.plain.begin(scope="pay", key=k)
            await self.plain.complete(scope="pay", key=k, lease_token=b.lease_token,
                                      response=idemcoord.StoredResponse(body=body))
        replays = await asyncio.gather(*(c.begin(scope="pay", key=k) for k in keys))  # one turn: one round
        self.assertEqual([(r.outcome, len(r.record.response.body)) for r in replays], [(REPLAY, len(body))] * 8)
        self.assertEqual(i.rpcs.batch_sizes[:1], [8], "the 8 replays did not share a round: %s" % i.rpcs.batch_sizes)
        self.assertGreater(i.rpcs.count("Begin"), 0, "no replay was repeated alone")

    async def test_once_through_a_batching_client(self):
        c = self.client(call_batching=2)
        k, runs = key("dup"), []

        async def fn(attempt):
            runs.append(1)
            await asyncio.sleep(0.02)
            return idemcoord.StoredResponse(body=b"done")
        results = await asyncio.gather(*(c.once("pay", k, None, fn) for _ in range(16)))
        self.assertEqual(len(runs), 1)
        self.assertEqual({bytes(r.response.body) for r in results}, {b"done"})


if __name__ == "__main__":
    unittest.main()
