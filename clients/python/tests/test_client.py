"""The Python client against a real coordinator (see coordinator.py)."""

import concurrent.futures
import hashlib
import logging
import os
import threading
import unittest
import uuid

import grpc

import idemcoord
from idemcoord import State

from .coordinator import Coordinator, fixture_options

COORD = None
CLIENTS = []


def setUpModule():
    global COORD
    COORD = Coordinator()


def tearDownModule():
    for c in CLIENTS:
        c.shutdown(timeout=10)
    COORD.stop()


def new_client(**kwargs):
    kwargs.setdefault("token", COORD.token)
    c = idemcoord.Client(COORD.addr, **fixture_options(**kwargs))
    CLIENTS.append(c)
    return c


def unique_key(prefix="k"):
    return "%s-%s" % (prefix, uuid.uuid4())


class GrpcError(grpc.RpcError, grpc.Call):
    """A gRPC error with a status code, as a handler or a broken network gives."""

    def __init__(self, code, details):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

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


class Fault(grpc.UnaryUnaryClientInterceptor):
    """Counts the calls of one method and their codes; can lose replies or cut the method off."""

    def __init__(self, method):
        self.method = method
        self.lock = threading.Lock()
        self.calls, self.requests, self.codes = 0, [], []
        self.lose_replies, self.cut_off = 0, False

    def intercept_unary_unary(self, continuation, details, request):
        if not details.method.endswith("/" + self.method):
            return continuation(details, request)
        with self.lock:
            self.calls += 1
            self.requests.append(request)
            lose = self.lose_replies > 0
            if lose:
                self.lose_replies -= 1
            cut = self.cut_off
        if cut:
            with self.lock:
                self.codes.append(grpc.StatusCode.UNAVAILABLE)
            raise GrpcError(grpc.StatusCode.UNAVAILABLE, "cut off (test)")
        out = continuation(details, request)
        code = out.code()
        with self.lock:
            self.codes.append(grpc.StatusCode.UNAVAILABLE if lose else code)
        if lose:  # the coordinator did the work; the caller never hears of it
            raise GrpcError(grpc.StatusCode.UNAVAILABLE, "reply lost (test)")
        return out

    def count(self, code):
        with self.lock:
            return self.codes.count(code)


class Sent(grpc.UnaryUnaryClientInterceptor):
    """Counts the calls of one method, and lets them go on as they are (Fault waits for their answers)."""

    def __init__(self, method):
        self.method, self.calls = method, 0

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/" + self.method):
            self.calls += 1
        return continuation(details, request)


class HoldReply(grpc.UnaryUnaryClientInterceptor):
    """Holds back the answer of one call of a method: the coordinator has answered, the caller has not heard.

    The call numbered call (1 for the first) of method reaches the
    coordinator; its answer is held (held is set when it arrives) until
    release is set, then delivered, or with lose replaced by CANCELLED (the
    caller gave up before it arrived). If the call's own deadline passes
    first, it fails DEADLINE_EXCEEDED.
    """

    def __init__(self, method, call, release, lose=True):
        self.method, self.call, self.release, self.lose = method, call, release, lose
        self.lock = threading.Lock()
        self.calls = 0
        self.held = threading.Event()

    def intercept_unary_unary(self, continuation, details, request):
        if not details.method.endswith("/" + self.method):
            return continuation(details, request)
        with self.lock:
            self.calls += 1
            hold = self.calls == self.call
        out = continuation(details, request)
        if not hold:
            return out
        out.code()  # the answer arrived
        self.held.set()
        if not self.release.wait(details.timeout):
            raise GrpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "the answer came after the deadline (test)")
        if self.lose:
            raise GrpcError(grpc.StatusCode.CANCELLED, "gave up before the answer arrived (test)")
        return out


def stored():
    return idemcoord.StoredResponse(schema_version="examples.ChargeResponse/1",
                                    content_type="application/octet-stream",
                                    body=b"charge ch_42 " + os.urandom(32) + b"\x00\xff\xfe", status_code=201,
                                    metadata={"x-charge-id": "ch_42", "x-empty": ""})


def wait_until(cond, what):
    """Waits until cond() is true, checking every 10 ms (generously bounded: a hang fails, not a slow machine)."""
    ev = threading.Event()
    for _ in range(30000):
        if cond():
            return
        ev.wait(0.01)
    raise AssertionError("gave up waiting until " + what)


class ClientTest(unittest.TestCase):
    def assertSameResponse(self, got, want):
        self.assertEqual(got.SerializeToString(deterministic=True), want.SerializeToString(deterministic=True))
        self.assertEqual(got.body, want.body)
        self.assertEqual(dict(got.metadata), dict(want.metadata))

    def test_begin_complete_replay(self):
        c = new_client()
        scope, key = "python.charge", unique_key()
        fp = hashlib.sha256(b"charge 42").digest()
        first = c.begin(scope=scope, key=key, fingerprint=fp)
        self.assertEqual(first.outcome, idemcoord.Outcome.OUTCOME_ACQUIRED)
        self.assertEqual(first.previous_state, State.STATE_UNSPECIFIED)
        resp = stored()
        done = c.complete(scope=scope, key=key, lease_token=first.lease_token, response=resp)
        self.assertEqual(done.record.state, State.STATE_COMPLETED)
        again = c.begin(scope=scope, key=key, fingerprint=fp)
        self.assertEqual(again.outcome, idemcoord.Outcome.OUTCOME_REPLAY)
        self.assertSameResponse(again.record.response, resp)
        self.assertSameResponse(c.lookup(scope=scope, key=key).record.response, resp)
        c.complete(scope=scope, key=key, lease_token=first.lease_token, response=resp)  # a repeat is OK
        with self.assertRaises(grpc.RpcError) as cm:
            c.begin(scope=scope, key=key, fingerprint=b"other")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)

    def test_lost_begin_reply_is_retried_with_the_same_attempt_id(self):
        f = Fault("Begin")
        c = new_client(interceptors=[f], backoff=0.01)
        scope, key = "python.lost", unique_key()
        f.lose_replies = 1
        res = c.begin(scope=scope, key=key)
        self.assertEqual(res.outcome, idemcoord.Outcome.OUTCOME_ACQUIRED, "the retry was not the same attempt")
        self.assertEqual(f.calls, 2)
        self.assertEqual(f.requests[0].attempt_id, f.requests[1].attempt_id)
        self.assertRegex(f.requests[0].attempt_id, "^[0-9a-f]{32}$")
        self.assertEqual(new_client().begin(scope=scope, key=key).outcome, idemcoord.Outcome.OUTCOME_IN_PROGRESS)
        c.complete(scope=scope, key=key, lease_token=res.lease_token)

    def test_calls_are_retried_on_unavailable(self):
        f = Fault("Lookup")
        f.cut_off = True
        c = new_client(interceptors=[f], max_attempts=3, backoff=0.005)
        with self.assertRaises(grpc.RpcError) as cm:
            c.lookup(scope="s", key="k")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(f.calls, 3)

    def test_once_under_20_concurrent_callers(self):
        clients = [new_client() for _ in range(4)]
        scope, key = "python.once", unique_key()
        fp = b"create flower shop"
        resp = stored()
        runs = []
        gate = threading.Event()

        def fn(attempt):
            runs.append(attempt.lease.key)
            gate.wait()  # hold the key while the others call begin
            return resp

        results, errors = [None] * 20, []

        def call(i):
            try:
                results[i] = clients[i % 4].once(scope, key, fp, fn)
            except Exception as err:  # reported below
                errors.append(err)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        wait_until(lambda: len(runs) == 1, "fn runs")
        threading.Timer(0.2, gate.set).start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(len(runs), 1)
        self.assertEqual(sum(1 for r in results if not r.replayed), 1)
        for r in results:
            self.assertEqual(r.state, State.STATE_COMPLETED)
            self.assertEqual(r.attempt, 1)
            self.assertSameResponse(r.response, resp)
        later = new_client().once(scope, key, fp, lambda a: self.fail("fn ran on a replay"))
        self.assertTrue(later.replayed)
        self.assertSameResponse(later.response, resp)

    def test_lease_data_and_current_lease(self):
        c = new_client()
        scope, key = "python.lease", unique_key()
        self.assertIsNone(idemcoord.current_lease())
        idemcoord.mark_side_effect()  # outside an attempt: nothing
        seen = []

        def fn(attempt):
            seen.append(attempt.lease)
            self.assertEqual(idemcoord.current_lease(), attempt.lease)

        res = c.once(scope, key, None, fn)
        self.assertFalse(res.replayed)
        self.assertEqual(res.response.SerializeToString(), b"")
        lease = seen[0]
        self.assertEqual((lease.scope, lease.key, lease.attempt, lease.generation), (scope, key, 1, 1))
        self.assertEqual(lease.previous, State.STATE_UNSPECIFIED)
        self.assertFalse(lease.uncertain)
        self.assertTrue(lease.token)
        self.assertIsNone(idemcoord.current_lease())
        self.assertEqual(c.lookup(scope=scope, key=key).record.state, State.STATE_COMPLETED)

    def test_errors_by_code_before_the_mark_unknown_after(self):
        c = new_client()
        scope, key = "python.mark", unique_key()

        def down(attempt):
            raise GrpcError(grpc.StatusCode.UNAVAILABLE, "bank down")

        with self.assertRaisesRegex(grpc.RpcError, "bank down"):
            c.once(scope, key, None, down)
        self.assertEqual(c.lookup(scope=scope, key=key).record.state, State.STATE_FAILED_RETRYABLE)

        def charged(attempt):
            self.assertEqual(attempt.lease.previous, State.STATE_FAILED_RETRYABLE)
            idemcoord.mark_side_effect()
            raise GrpcError(grpc.StatusCode.UNAVAILABLE, "bank timed out after the charge")

        with self.assertRaisesRegex(grpc.RpcError, "timed out"):
            c.once(scope, key, None, charged)
        self.assertEqual(c.lookup(scope=scope, key=key).record.state, State.STATE_UNKNOWN)

        def reconcile(attempt):
            self.assertEqual(attempt.lease.previous, State.STATE_UNKNOWN)
            self.assertEqual(attempt.lease.attempt, 3)
            return {"body": b"reconciled"}

        self.assertEqual(c.once(scope, key, None, reconcile).response.body, b"reconciled")

        key2 = unique_key()

        def abandon_after_mark(attempt):
            attempt.mark_side_effect()
            raise idemcoord.FailureError("FAILURE_KIND_ABANDONED", "changed my mind")

        with self.assertRaisesRegex(idemcoord.FailureError, "changed my mind"):
            c.once(scope, key2, None, abandon_after_mark)
        self.assertEqual(c.lookup(scope=scope, key=key2).record.state, State.STATE_UNKNOWN)

    def test_caller_mistake_and_replayable_failure(self):
        c = new_client()
        scope, key = "python.fail", unique_key()

        def bad(attempt):
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad name")

        with self.assertRaisesRegex(grpc.RpcError, "bad name"):
            c.once(scope, key, None, bad)
        with self.assertRaises(grpc.RpcError) as cm:
            c.lookup(scope=scope, key=key)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

        runs = []

        def exists(attempt):
            runs.append(1)
            raise GrpcError(grpc.StatusCode.ALREADY_EXISTS, "project exists")

        errs = []
        for _ in range(2):
            with self.assertRaises(idemcoord.StoredFailure) as cm:
                c.once(scope, key, None, exists)
            errs.append(cm.exception)
        self.assertEqual(len(runs), 1)
        for err in errs:
            self.assertEqual(err.code, grpc.StatusCode.ALREADY_EXISTS)
            self.assertEqual(err.details, "project exists")
            self.assertEqual(err.result.state, State.STATE_FAILED_REPLAYABLE)
            self.assertEqual(err.result.response.schema_version, "google.rpc.Status")
        self.assertFalse(errs[0].result.replayed)
        self.assertTrue(errs[1].result.replayed)
        self.assertEqual(errs[0].result.response.body, errs[1].result.response.body)

        key2 = unique_key()
        own = idemcoord.StoredResponse(schema_version="problem+json/1", content_type="application/problem+json",
                                       body=b'{"title":"no"}', status_code=409)

        def conflict(attempt):
            raise idemcoord.FailureError("FAILURE_KIND_REPLAYABLE", "conflict", response=own)

        with self.assertRaises(idemcoord.StoredFailure):
            c.once(scope, key2, None, conflict)
        with self.assertRaises(idemcoord.StoredFailure) as cm:
            c.once(scope, key2, None, lambda a: self.fail("ran"))
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)  # 409 is no gRPC code
        self.assertEqual(cm.exception.details, "conflict")
        self.assertSameResponse(cm.exception.result.response, own)

    def test_response_too_large_leaves_the_key_unknown(self):
        c = new_client()
        scope, key = "python.large", unique_key()
        big = os.urandom(2 << 20)  # over the 1 MiB limit, under gRPC's 4 MiB
        res = c.once(scope, key, None, lambda attempt: {"body": big})
        self.assertEqual(res.response.body, big)  # the caller still gets fn's result, as in Go
        rec = c.lookup(scope=scope, key=key).record
        self.assertEqual(rec.state, State.STATE_UNKNOWN)
        self.assertIn("response not stored", rec.failure_reason)

    def test_heartbeats_keep_the_key_past_its_lease(self):
        f = Fault("Heartbeat")
        c = new_client(interceptors=[f], lease=1)
        scope, key = "python.heartbeat", unique_key()

        def fn(attempt):
            wait_until(lambda: f.count(grpc.StatusCode.OK) >= 4, "four heartbeats")
            other = new_client().begin(scope=scope, key=key)
            self.assertEqual(other.outcome, idemcoord.Outcome.OUTCOME_IN_PROGRESS)
            return {"body": b"done"}

        self.assertEqual(c.once(scope, key, None, fn).response.body, b"done")
        self.assertEqual(c.lookup(scope=scope, key=key).record.state, State.STATE_COMPLETED)

    def test_waiter_confirms_its_lease_before_fn_runs(self):
        beats, begins = Fault("Heartbeat"), Fault("Begin")
        c = new_client(interceptors=[beats, begins], lease=1)
        holder = new_client()
        scope, key = "python.waited", unique_key()
        first = holder.begin(scope=scope, key=key, lease=30)
        seen, out = [], []

        def fn(attempt):
            before = beats.calls
            seen.append((attempt.cancelled.wait(0.05), before, attempt.lease.attempt))
            return {"body": b"second"}

        t = threading.Thread(target=lambda: out.append(c.once(scope, key, None, fn)))
        t.start()
        wait_until(lambda: begins.calls >= 2, "the long poll")
        threading.Event().wait(1.5)  # longer than c's lease
        holder.fail(scope=scope, key=key, lease_token=first.lease_token, kind="FAILURE_KIND_RETRYABLE")
        t.join()
        self.assertEqual(seen, [(False, 1, 2)])
        self.assertEqual(out[0].response.body, b"second")

    def test_unconfirmed_lease_cancels_and_marked_attempt_ends_unknown(self):
        f = Fault("Heartbeat")
        f.cut_off = True
        c = new_client(interceptors=[f], lease=1, max_attempts=1)
        scope, key = "python.cutoff", unique_key()
        reasons = []

        def fn(attempt):
            attempt.mark_side_effect()
            wait_until(attempt.cancelled.is_set, "the attempt is cancelled")
            reasons.append(attempt.reason)
            attempt.raise_if_cancelled()

        with self.assertRaises(idemcoord.LeaseUnconfirmed):
            c.once(scope, key, None, fn)
        self.assertIsInstance(reasons[0], idemcoord.LeaseUnconfirmed)
        self.assertGreaterEqual(f.calls, 1)
        self.assertEqual(c.lookup(scope=scope, key=key).record.state, State.STATE_UNKNOWN)

    def test_taken_over_holder_records_nothing(self):
        f = Fault("Heartbeat")
        c = new_client(interceptors=[f], lease=1, max_attempts=1)
        other = new_client()
        scope, key = "python.takeover", unique_key()
        successor = []

        def fn(attempt):
            f.cut_off = True  # partitioned
            wait_until(attempt.cancelled.is_set, "the attempt is cancelled")
            # This fn ignores the cancellation. Once the lease ran out on the
            # coordinator, another caller takes the key over.
            while True:
                res = other.begin(scope=scope, key=key, wait=5)
                if res.outcome == idemcoord.Outcome.OUTCOME_ACQUIRED:
                    successor.append(res)
                    break
            f.cut_off = False  # healed: the next heartbeat is refused
            wait_until(lambda: f.count(grpc.StatusCode.FAILED_PRECONDITION) >= 1, "a refused heartbeat")
            return {"body": b"stale result"}

        with self.assertRaises(idemcoord.LeaseLost):
            c.once(scope, key, None, fn)
        self.assertEqual(successor[0].previous_state, State.STATE_UNKNOWN)
        rec = other.lookup(scope=scope, key=key).record
        self.assertEqual((rec.state, rec.attempt), (State.STATE_IN_PROGRESS, 2))
        other.complete(scope=scope, key=key, lease_token=successor[0].lease_token,
                       response=idemcoord.StoredResponse(body=b"fresh"))
        self.assertEqual(other.lookup(scope=scope, key=key).record.response.body, b"fresh")

    def assertAbsent(self, c, scope, key):
        try:
            rec = c.lookup(scope=scope, key=key).record
        except grpc.RpcError as err:
            self.assertEqual(err.code(), grpc.StatusCode.NOT_FOUND)
            return
        self.fail("the key is held: %s" % State.Name(rec.state))

    def assertReleased(self, fails):
        """fails (a Fault of Fail) saw one Fail ABANDONED with the reason of a caller that gave up."""
        self.assertEqual(len(fails.requests), 1)
        self.assertEqual(fails.requests[0].kind, idemcoord.FailureKind.FAILURE_KIND_ABANDONED)
        self.assertEqual(fails.requests[0].reason, "caller gave up before the handler ran")

    def test_timeout_during_the_first_begin_leaves_no_record(self):
        # The coordinator acquires the key for once's Begin; its answer
        # arrives only after the caller's timeout ended.
        begins = HoldReply("Begin", 1, threading.Event())
        fails = Fault("Fail")
        c = new_client(interceptors=[begins, fails], timeout=2)
        scope, key = "python.gaveup.first", unique_key()
        runs = []
        with self.assertRaises(grpc.RpcError) as cm:
            c.once(scope, key, None, runs.append, timeout=0.3)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(runs, [])
        self.assertTrue(begins.held.is_set())
        self.assertAbsent(c, scope, key)
        nxt = new_client().begin(scope=scope, key=key)
        self.assertEqual(nxt.outcome, idemcoord.Outcome.OUTCOME_ACQUIRED)
        self.assertEqual(nxt.previous_state, State.STATE_UNSPECIFIED)
        self.assertReleased(fails)

    def test_cancel_while_waiting_releases_what_the_wait_acquired(self):
        cancel = threading.Event()
        # The second Begin is the wait: when the holder lets go, the
        # coordinator hands the key to it, but the caller cancels before the
        # answer arrives.
        begins = HoldReply("Begin", 2, cancel)
        fails = Fault("Fail")
        c = new_client(interceptors=[begins, fails])
        holder = new_client()
        scope, key = "python.gaveup.wait", unique_key()
        first = holder.begin(scope=scope, key=key, lease=30)
        runs, errors = [], []

        def call():
            try:
                c.once(scope, key, None, runs.append, cancel_event=cancel)
            except Exception as err:  # checked below
                errors.append(err)

        t = threading.Thread(target=call)
        t.start()
        wait_until(lambda: begins.calls >= 2, "the wait")
        holder.fail(scope=scope, key=key, lease_token=first.lease_token, kind="FAILURE_KIND_RETRYABLE")
        wait_until(begins.held.is_set, "the wait's answer")
        cancel.set()
        t.join()
        self.assertEqual(runs, [])
        nxt = new_client().begin(scope=scope, key=key)
        self.assertEqual(nxt.outcome, idemcoord.Outcome.OUTCOME_ACQUIRED, "the key is held")
        self.assertEqual(nxt.previous_state, State.STATE_FAILED_RETRYABLE)
        self.assertReleased(fails)
        self.assertEqual(len(errors), 1)
        self.assertIsInstance(errors[0], concurrent.futures.CancelledError)

    def test_acquisition_answered_after_cancel_is_released_without_running_fn(self):
        cancel = threading.Event()
        begins = HoldReply("Begin", 1, cancel, lose=False)
        fails = Fault("Fail")
        c = new_client(interceptors=[begins, fails])
        scope, key = "python.gaveup.acquired", unique_key()
        runs, errors = [], []

        def call():
            try:
                c.once(scope, key, None, runs.append, cancel_event=cancel)
            except Exception as err:  # checked below
                errors.append(err)

        t = threading.Thread(target=call)
        t.start()
        wait_until(begins.held.is_set, "the answer")
        cancel.set()
        t.join()
        self.assertEqual(runs, [])
        self.assertAbsent(c, scope, key)
        self.assertEqual(new_client().begin(scope=scope, key=key).outcome, idemcoord.Outcome.OUTCOME_ACQUIRED)
        self.assertReleased(fails)
        self.assertEqual(begins.calls, 1, "the token was known: no second Begin")
        self.assertEqual(len(errors), 1)
        self.assertIsInstance(errors[0], concurrent.futures.CancelledError)

    def test_cancel_stops_a_wait_at_once(self):
        cancel = threading.Event()
        begins = Sent("Begin")
        c = new_client(interceptors=[begins])
        holder = new_client()
        scope, key = "python.gaveup.stop", unique_key()
        first = holder.begin(scope=scope, key=key, lease=30)
        errors = []

        def call():
            try:
                c.once(scope, key, None, lambda a: self.fail("ran"), cancel_event=cancel)
            except Exception as err:  # checked below
                errors.append(err)

        t = threading.Thread(target=call)
        t.start()
        wait_until(lambda: begins.calls >= 2, "the wait")
        cancel.set()
        t.join(10)  # the wait itself asks for 30 s
        self.assertFalse(t.is_alive(), "once still waits after cancel_event was set")
        self.assertEqual(len(errors), 1)
        self.assertIsInstance(errors[0], concurrent.futures.CancelledError)
        holder.fail(scope=scope, key=key, lease_token=first.lease_token, kind="FAILURE_KIND_RETRYABLE")
        self.assertEqual(new_client().begin(scope=scope, key=key).outcome, idemcoord.Outcome.OUTCOME_ACQUIRED)

    def test_begin_whose_every_answer_was_lost_is_released(self):
        begins, fails = Fault("Begin"), Fault("Fail")
        c = new_client(interceptors=[begins, fails], max_attempts=3, backoff=0.005)
        scope, key = "python.gaveup.lost", unique_key()
        begins.lose_replies = 3  # the coordinator acquires the key; once hears UNAVAILABLE three times
        runs = []
        with self.assertRaises(grpc.RpcError) as cm:
            c.once(scope, key, None, runs.append)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(runs, [])
        self.assertAbsent(c, scope, key)
        self.assertEqual(begins.calls, 4)
        self.assertEqual({r.attempt_id for r in begins.requests}, {begins.requests[0].attempt_id})
        self.assertFalse(begins.requests[3].HasField("wait"))
        self.assertReleased(fails)

    def test_release_that_cannot_reach_the_coordinator_is_logged(self):
        begins = Fault("Begin")
        begins.cut_off = True
        logger = logging.getLogger("idemcoord.test.%s" % uuid.uuid4())
        logger.propagate = False
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        c = new_client(interceptors=[begins], max_attempts=2, backoff=0.005, logger=logger)
        key = unique_key()
        with self.assertRaises(grpc.RpcError) as cm:
            c.once("python.gaveup.cutoff", key, None, lambda a: self.fail("ran"))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(cm.exception.details(), "cut off (test)")
        self.assertEqual(begins.calls, 4)  # two tries, then two tries of the release
        warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn("could not release", warnings[0])
        self.assertIn(key, warnings[0])

    def test_wrong_token_is_unauthenticated(self):
        if not COORD.auth:
            self.skipTest("the coordinator has auth off (IDEMCOORD_TOKEN unset)")
        with self.assertRaises(grpc.RpcError) as cm:
            new_client(token="not-the-token").begin(scope="s", key=unique_key())
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED)


if __name__ == "__main__":
    unittest.main()
