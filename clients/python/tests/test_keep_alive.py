"""_core.keep_alive, the one heartbeat loop of the sync and asyncio holders, driven by a fake clock (no I/O)."""

import unittest

from idemcoord import _core


class Refused(Exception):
    """A heartbeat the coordinator refused because the lease is gone."""


class Unanswered(Exception):
    """A heartbeat that got no answer."""


class Drive:
    """Runs keep_alive on a fake clock: a Pause moves the clock, a Beat is answered by answer(now).

    A CancelAttempt cancels the attempt (cancelled() is then true), as the
    holders' _cancel does; cancelled_before says it was cancelled from the start.
    """

    def __init__(self, length, stop_when_unconfirmed, answer, cancelled_before=False):
        self.now = 0.0
        self.timer = _core.LeaseTimer(length, 0.0)
        assert self.timer.start(0.0)
        self.steps = _core.keep_alive(self.timer, lambda: self.now, lambda e: isinstance(e, Refused),
                                      lambda: cancelled_before or bool(self.cancels), stop_when_unconfirmed)
        self.answer = answer
        self.beats, self.cancels = [], []

    def run(self, until):
        """Steps until the clock passes until or the loop ends; whether it ended."""
        reply = None
        while self.now <= until:
            try:
                step = self.steps.send(reply)
            except StopIteration:
                return True
            reply = None
            if isinstance(step, _core.Pause):
                self.now += step.seconds
            elif isinstance(step, _core.Beat):
                self.beats.append((round(self.now, 3), step.timeout))
                reply = self.answer(self.now)
            else:
                self.cancels.append((round(self.now, 3), step.lost))
        self.steps.close()
        return False


class KeepAliveTest(unittest.TestCase):
    def test_beats_a_third_of_the_lease_after_each_confirmation(self):
        d = Drive(3.0, True, lambda now: 3.0)
        self.assertFalse(d.run(10))
        self.assertEqual([t for t, _ in d.beats], [1.0 * i for i in range(1, 11)])
        self.assertEqual({timeout for _, timeout in d.beats}, {1.0})
        self.assertEqual(d.cancels, [])

    def test_an_unanswered_beat_is_tried_again_sooner(self):
        d = Drive(12.0, True, lambda now: Unanswered() if now < 5 else 12.0)
        d.run(10)
        # 4 s (a third), then 1 s (a twelfth) later, answered at 5 s; then 4 s after that.
        self.assertEqual([t for t, _ in d.beats], [4.0, 5.0, 9.0])
        self.assertEqual(d.cancels, [])

    def test_a_refused_beat_cancels_as_lost_and_ends(self):
        d = Drive(3.0, False, lambda now: Refused() if now >= 2 else 3.0)
        self.assertTrue(d.run(100))
        self.assertEqual(d.cancels, [(2.0, True)])
        self.assertEqual(len(d.beats), 2)

    def test_unconfirmed_lease_cancels_at_the_margin(self):
        # Lease 10 s, margin 1 s: no beat is answered, so the attempt is
        # cancelled at 9 s; asyncio's loop ends there.
        d = Drive(10.0, True, lambda now: Unanswered())
        self.assertTrue(d.run(100))
        self.assertEqual(d.cancels, [(9.0, False)])

    def test_a_thread_heartbeats_on_after_an_unconfirmed_lease(self):
        d = Drive(10.0, False, lambda now: Unanswered() if now < 12 else 10.0)
        self.assertFalse(d.run(20))
        self.assertEqual(d.cancels, [(9.0, False)], "not cancelled once at the margin")
        self.assertGreaterEqual(d.beats[-1][0], 12.0, "no heartbeat after the cancellation")

    def test_an_attempt_cancelled_already_is_not_cancelled_again(self):
        d = Drive(10.0, False, lambda now: Unanswered(), cancelled_before=True)
        self.assertFalse(d.run(30))
        self.assertEqual(d.cancels, [])


if __name__ == "__main__":
    unittest.main()
