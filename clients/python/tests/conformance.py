"""The runner of clients/testdata/http_conformance.json for the Python stacks (ASGI, WSGI).

A stack's test starts a service per scenario with start(options, act) and
calls run_http_conformance; the suite's "about" says what each field means.
"""

import concurrent.futures
import json
import os
import secrets
import threading
import time

import grpc
import httpx

import idemcoord

SUITE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "testdata", "http_conformance.json")
with open(SUITE_PATH, encoding="utf-8") as f:
    SUITE = json.load(f)


def middleware_options(o):
    out = {}
    if "wait_ms" in o:
        out["wait"] = o["wait_ms"] / 1000
    if o.get("require_key"):
        out["require_key"] = True
    if "methods" in o:
        out["methods"] = o["methods"]
    if "replay_headers" in o:
        out["replay_headers"] = o["replay_headers"]
    if "replayable_statuses" in o:
        out["replayable_statuses"] = o["replayable_statuses"]
    if "max_body_bytes" in o:
        out["max_body_bytes"] = o["max_body_bytes"]
    if "principal_header" in o:
        out["principal_header"] = o["principal_header"]
    return out


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
    """Counts the run and returns the X-Conformance action (a dict)."""
    calls.add(headers.get("x-scenario", ""))
    return json.loads(headers.get("x-conformance") or "{}")


def lease_body():
    lease = idemcoord.current_lease()
    return json.dumps({"attempt": lease.attempt, "previous": idemcoord.State.Name(lease.previous)},
                      separators=(",", ":")).encode()


def _send(tc, base, key, st):
    rq = st["request"]
    fill = lambda s: s.replace("{key}", key)  # noqa: E731
    headers = [("X-Scenario", key), ("X-Conformance", json.dumps(st.get("handler", {})))]
    headers += [(k, fill(v)) for k, v in rq.get("headers", {}).items()]
    e = st.get("expect", {})
    timeout = st["timeout_ms"] / 1000 if st.get("timeout_ms") else 30.0
    try:
        with httpx.Client(timeout=timeout) as http:
            resp = http.request(rq["method"], base + rq["path"], headers=headers, content=rq.get("body", "").encode())
    except httpx.TimeoutException:
        if e.get("gave_up"):
            return ""
        raise
    where = "%s %s: got %d %s %r" % (rq["method"], rq["path"], resp.status_code, dict(resp.headers), resp.content)
    tc.assertFalse(e.get("gave_up"), where + "; want the client to give up")
    tc.assertEqual(resp.status_code, e["status"], where)
    for k, v in e.get("headers", {}).items():
        tc.assertEqual(resp.headers.get(k), fill(v), where + ": header " + k)
    for k in e.get("absent_headers", []):
        tc.assertNotIn(k, resp.headers, where)
    for k in e.get("header_present", []):
        tc.assertTrue(resp.headers.get(k), where + ": want " + k)
    if "body" in e:
        tc.assertEqual(resp.content.decode("utf-8", "replace"), e["body"], where)
    if e.get("problem"):
        tc.assertEqual(resp.headers.get("content-type"), "application/problem+json", where)
        p = resp.json()
        tc.assertEqual(p["type"], e["problem"], where)
        tc.assertEqual(p["status"], e["status"], where)
    return resp.headers.get("idempotency-result", "")


def run_http_conformance(tc, stack, client, start):
    """Runs every scenario as a subTest of tc; start(options, calls) returns (base url, close)."""
    calls = Calls()
    ran = 0
    for sc in SUITE["scenarios"]:
        with tc.subTest(stack=stack, scenario=sc["name"]):
            if stack in sc.get("skip", {}):
                tc.skipTest(sc["skip"][stack])
            base, close = start(middleware_options(sc.get("options", {})), calls)
            try:
                _run_scenario(tc, sc, client, base, calls)
                ran += 1
            finally:
                close()
    return ran


def _run_scenario(tc, sc, client, base, calls):
    key = "conf-" + secrets.token_hex(12)

    def lookup():
        try:
            return idemcoord.State.Name(client.lookup(scope="http", key=key).record.state)
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
        res = client.begin(scope="http", key=key, attempt_id="holder")
        tc.assertEqual(res.outcome, idemcoord.Outcome.OUTCOME_ACQUIRED)
        hold = res.lease_token
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
    background = []
    try:
        for st in sc["steps"]:
            if st.get("release_hold"):
                time.sleep(st.get("settle_ms", 0) / 1000)
                client.fail(scope="http", key=key, lease_token=hold, kind="FAILURE_KIND_ABANDONED", reason="released")
                continue
            if "request" not in st:
                want_state(st["state"])
                continue

            def run(st=st):
                time.sleep(st.get("start_after_ms", 0) / 1000)
                futs = [pool.submit(_send, tc, base, key, st) for _ in range(st.get("repeat", 1))]
                results = [f.result() for f in futs]
                if "expect_counts" in st:
                    got = {}
                    for r in results:
                        got[r] = got.get(r, 0) + 1
                    for k, v in st["expect_counts"].items():
                        tc.assertEqual(got.get(k, 0), v, "Idempotency-Result counts %s" % got)
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
