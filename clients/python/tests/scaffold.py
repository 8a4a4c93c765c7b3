"""What the conformance tests share: the suites, the coordinator per module, the handler's counting and the runner.

conformance.py (HTTP: ASGI, WSGI) and test_grpc.py (grpc, grpc.aio) run
clients/testdata/http_conformance.json and grpc_conformance.json with it;
a suite's "about" says what each field means.
"""

import asyncio
import concurrent.futures
import json
import os
import secrets
import threading
import time

import grpc

import idemcoord

from .coordinator import Coordinator, fixture_options

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "testdata")


def load_suite(name):
    """The suite clients/testdata/<name>."""
    with open(os.path.join(TESTDATA, name), encoding="utf-8") as f:
        return json.load(f)


def coordinator_module(module_globals, lease_ms):
    """The setUpModule and tearDownModule of a test module whose globals COORD and CLIENT are the coordinator
    (see coordinator.py) and an idemcoord.Client on it with a lease of lease_ms."""
    def setUpModule():
        module_globals["COORD"] = coord = Coordinator()
        module_globals["CLIENT"] = idemcoord.Client(coord.addr, **fixture_options(token=coord.token, lease=lease_ms / 1000))

    def tearDownModule():
        module_globals["CLIENT"].shutdown(timeout=10)
        module_globals["COORD"].stop()
    return setUpModule, tearDownModule


class Calls:
    """The handler's runs by X-Scenario."""

    def __init__(self):
        self._lock = threading.Lock()
        self._n = {}

    def add(self, scenario):
        with self._lock:
            self._n[scenario] = self._n.get(scenario, 0) + 1

    def get(self, scenario):
        with self._lock:
            return self._n.get(scenario, 0)


def action(headers, calls):
    """Counts the run and returns the x-conformance action (a dict); headers: lower-case names."""
    calls.add(headers.get("x-scenario", ""))
    return json.loads(headers.get("x-conformance") or "{}")


def _marks_or_throws(a):
    if a.get("mark"):
        idemcoord.mark_side_effect()
    if a.get("throw"):
        raise RuntimeError("the conformance handler throws")


def begin_action(a):
    """The start every suite handler makes of action a: sleep_ms, mark, throw."""
    if a.get("sleep_ms"):
        time.sleep(a["sleep_ms"] / 1000)
    _marks_or_throws(a)


async def begin_action_async(a):
    """begin_action for an async handler."""
    if a.get("sleep_ms"):
        await asyncio.sleep(a["sleep_ms"] / 1000)
    _marks_or_throws(a)


def run_suite(tc, stack, suite, start, run_scenario):
    """Runs every scenario of suite not skipped for stack as a subTest of tc; returns how many ran.

    start(options, calls) starts the stack for a scenario and returns (target, close);
    run_scenario(tc, sc, target, calls) runs the scenario against it.
    """
    calls = Calls()
    ran = 0
    for sc in suite["scenarios"]:
        with tc.subTest(stack=stack, scenario=sc["name"]):
            if stack in sc.get("skip", {}):
                tc.skipTest(sc["skip"][stack])
            target, close = start(sc.get("options", {}), calls)
            try:
                run_scenario(tc, sc, target, calls)
                ran += 1
            finally:
                close()
    return ran


def run_steps(tc, sc, client, scope, calls, send, checks_state, counts_label, hold_must_acquire):
    """Runs scenario sc's steps and checks its outcome; its key is recorded in scope by client.

    send(key, st) makes step st's call, checks the answer and returns its
    idempotency-result; checks_state(st): st only checks the record's state;
    counts_label names the idempotency-result counts in a failure;
    hold_must_acquire: the scenario's hold of the key is checked to acquire it.
    """
    key = "conf-" + secrets.token_hex(12)
    record_key = sc.get("key", "{key}").replace("{key}", key)  # the record's key, when not the header's

    def lookup():
        try:
            return idemcoord.State.Name(client.lookup(scope=scope, key=record_key).record.state)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return "absent"
            raise

    def want_state(want):
        deadline = time.monotonic() + 10
        got = lookup()
        while got != want and time.monotonic() < deadline:
            time.sleep(0.05)
            got = lookup()
        tc.assertEqual(got, want, "state of %s" % sc["name"])

    hold = None
    if sc.get("hold_key"):
        res = client.begin(scope=scope, key=key, attempt_id="holder")
        if hold_must_acquire:
            tc.assertEqual(res.outcome, idemcoord.Outcome.OUTCOME_ACQUIRED)
        hold = res.lease_token
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
    background = []
    try:
        for st in sc["steps"]:
            if st.get("release_hold"):
                time.sleep(st.get("settle_ms", 0) / 1000)
                client.fail(scope=scope, key=key, lease_token=hold, kind="FAILURE_KIND_ABANDONED", reason="released")
                continue
            if checks_state(st):
                want_state(st["state"])
                continue

            def run(st=st):
                time.sleep(st.get("start_after_ms", 0) / 1000)
                futs = [pool.submit(send, key, st) for _ in range(st.get("repeat", 1))]
                results = [f.result() for f in futs]
                if "expect_counts" in st:
                    got = {}
                    for r in results:
                        got[r] = got.get(r, 0) + 1
                    for k, v in st["expect_counts"].items():
                        tc.assertEqual(got.get(k, 0), v, "%s %s" % (counts_label, got))
            if st.get("background"):
                background.append(pool.submit(run))
            else:
                run()
        for b in background:
            b.result()
    finally:
        pool.shutdown(wait=True)
    if "state" in sc:
        want_state(sc["state"])
    if "handler_calls" in sc:
        tc.assertEqual(calls.get(key), sc["handler_calls"], "handler runs of %s" % sc["name"])
