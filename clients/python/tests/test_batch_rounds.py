"""_core.BatchRounds and the round's request and answers: how calls form Batch RPCs, without I/O."""

import unittest

import grpc

from idemcoord import _api, _core


def item(method="Lookup", size=10, deadline=5.0, **fields):
    fields = fields or {"scope": "s", "key": "k"}
    return _core.BatchItem(method, _api.REQUESTS[method](**fields), size, deadline)


def sent_now(r, it):
    """Queues it; the round a sender started for it sends at once, or None when no slot was free."""
    return r.next_round() if r.reserve(it) else None


class BatchRoundsTest(unittest.TestCase):
    def test_a_call_goes_at_once_while_a_slot_is_free_then_the_rest_wait_together(self):
        r = _core.BatchRounds(2)
        a, b = item(), item()
        self.assertEqual(sent_now(r, a), [a])
        self.assertEqual(sent_now(r, b), [b])
        waiting = [item() for _ in range(5)]
        for it in waiting:
            self.assertIsNone(sent_now(r, it), "sent while both slots were busy")
        self.assertEqual(r.next_round(), waiting)  # the first sender to finish takes them all
        self.assertIsNone(r.next_round())  # that sender's slot frees
        self.assertIsNone(r.next_round())  # and the other's
        self.assertEqual(r.in_flight, 0)
        c = item()
        self.assertEqual(sent_now(r, c), [c])

    def test_a_reserved_slot_sends_what_is_queued_when_its_sender_starts(self):
        r = _core.BatchRounds(2)
        a, b, c = item(), item(), item()
        self.assertTrue(r.reserve(a))
        self.assertTrue(r.reserve(b), "a second slot is free")
        self.assertFalse(r.reserve(c), "both slots are taken")
        self.assertEqual(r.next_round(), [a, b, c])  # the first sender to start takes what is queued
        self.assertIsNone(r.next_round())  # the other finds nothing and frees its slot
        self.assertEqual(r.in_flight, 1)
        d = item()
        self.assertTrue(r.reserve(d))
        self.assertTrue(r.withdraw(d))
        self.assertIsNone(r.next_round(), "a sender whose call was withdrawn before it started")
        self.assertIsNone(r.next_round())
        self.assertEqual(r.in_flight, 0)

    def test_a_sender_about_to_take_the_queue_keeps_the_others_from_starting(self):
        r = _core.BatchRounds(2)
        a, b = item(), item()
        self.assertTrue(r.reserve(a))
        r.taking = True  # as the sync client's sender sets it until it takes the queue
        self.assertFalse(r.reserve(b), "a second sender started for calls the first is about to take")
        r.taking = False
        self.assertEqual(r.next_round(), [a, b])
        self.assertEqual(r.in_flight, 1)

    def test_a_round_holds_at_most_128_calls_and_2_mib(self):
        r = _core.BatchRounds(1)
        sent_now(r, item())
        small = [item() for _ in range(200)]
        for it in small:
            sent_now(r, it)
        self.assertEqual(r.next_round(), small[:128])
        self.assertEqual(r.next_round(), small[128:])
        big = [item(size=60 << 10) for _ in range(40)]
        for it in big:
            sent_now(r, it)
        first = r.next_round()
        self.assertEqual(len(first), (2 << 20) // (60 << 10))
        self.assertEqual(first + r.next_round(), big)

    def test_a_withdrawn_call_is_not_sent(self):
        r = _core.BatchRounds(1)
        sent_now(r, item())
        a, b = item(), item()
        sent_now(r, a)
        sent_now(r, b)
        self.assertTrue(r.withdraw(a))
        self.assertFalse(r.withdraw(a))
        self.assertEqual(r.next_round(), [b])

    def test_what_goes_unary(self):
        r = _core.BatchRounds(2)
        self.assertIsNotNone(r.size_if_batchable("Begin", _api.REQUESTS["Begin"](scope="s", key="k")))
        waiting = _api.REQUESTS["Begin"](scope="s", key="k", wait=_core.duration(1))
        self.assertIsNone(r.size_if_batchable("Begin", waiting), "a Begin that waits")
        big = _api.REQUESTS["Complete"](scope="s", key="k", response=_api.StoredResponse(body=b"x" * (65 << 10)))
        self.assertIsNone(r.size_if_batchable("Complete", big), "a request over 64 KiB")
        r.unary = True
        self.assertIsNone(r.size_if_batchable("Lookup", _api.REQUESTS["Lookup"](scope="s", key="k")))
        self.assertIsNone(_core.BatchRounds(0).size_if_batchable("Lookup", _api.REQUESTS["Lookup"](scope="s", key="k")))

    def test_each_call_carries_its_own_timeout_and_the_rpc_the_latest(self):
        req, timeout = _core.batch_request([item(deadline=1.5), item(deadline=4.0)], now=1.0)
        self.assertEqual([_core.seconds(c.timeout) for c in req.calls], [0.5, 3.0])
        self.assertEqual(timeout, 3.0)
        self.assertEqual(req.calls[0].WhichOneof("call"), "lookup")

    def test_answers_errors_and_calls_to_repeat_alone(self):
        items = [item(), item("Begin"), item("Complete"), item("Lookup")]
        resp = _api.BatchResponse()
        resp.results.add().lookup.record.key = "k"
        resp.results.add().error.CopyFrom(_api.Status(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="big"))
        st = _core.error_info_status(grpc.StatusCode.FAILED_PRECONDITION, "lease lost", "LEASE_LOST")
        resp.results.add().error.CopyFrom(st)
        resp.results.add().begin.lease_token = "not a lookup's"
        again = _core.answer_round(items, resp)
        self.assertEqual(again, [items[1]], "a Begin refused RESOURCE_EXHAUSTED is made again alone")
        self.assertEqual(items[0].answer().record.key, "k")
        err = items[2].outcome
        self.assertIsInstance(err, grpc.RpcError)
        self.assertEqual((err.code(), err.details()), (grpc.StatusCode.FAILED_PRECONDITION, "lease lost"))
        self.assertEqual(list(err.trailing_metadata()), [("grpc-status-details-bin", st.SerializeToString(deterministic=True))])
        self.assertEqual(items[3].outcome.code(), grpc.StatusCode.INTERNAL)
        short = [item(), item()]
        _core.answer_round(short, resp)
        self.assertEqual({it.outcome.code() for it in short}, {grpc.StatusCode.INTERNAL}, "4 results for 2 calls")

    def test_what_a_failed_batch_rpc_means(self):
        def failed(code):
            return _core.round_failed(_core.rpc_error(code, "x"))
        self.assertEqual(failed(grpc.StatusCode.UNIMPLEMENTED), _core.ROUND_UNARY_FOR_GOOD)
        self.assertEqual(failed(grpc.StatusCode.RESOURCE_EXHAUSTED), _core.ROUND_UNARY)
        self.assertEqual(failed(grpc.StatusCode.UNAVAILABLE), _core.ROUND_FAILED)


if __name__ == "__main__":
    unittest.main()
