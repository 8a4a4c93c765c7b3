"""The runner of clients/testdata/http_conformance.json for the Python stacks (ASGI, WSGI).

A stack's test starts a service per scenario with start(options, act) and
calls run_http_conformance; the suite's "about" says what each field means.
"""

import json

import httpx

import idemcoord

from . import scaffold

SUITE = scaffold.load_suite("http_conformance.json")


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
    if "service" in o:
        out["service"] = o["service"]
    if "principal_header" in o:
        out["principal_header"] = o["principal_header"]
    if "key_from_json_field" in o:
        out["key"] = json_field_key(o["key_from_json_field"])
    return out


def json_field_key(field):
    """The key= function of key_from_json_field: the field of a JSON object body when it is a non-empty string."""
    def key(request, body):
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        v = doc.get(field) if isinstance(doc, dict) else None
        return v if isinstance(v, str) and v else None
    return key


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
            resp = http.request(rq["method"], base + rq["path"], headers=headers, content=fill(rq.get("body", "")).encode())
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
    return scaffold.run_suite(tc, stack, SUITE, lambda options, calls: start(middleware_options(options), calls),
                              lambda tc, sc, base, calls: _run_scenario(tc, sc, client, base, calls))


def _run_scenario(tc, sc, client, base, calls):
    scaffold.run_steps(tc, sc, client, sc.get("scope", "POST /items"), calls, lambda key, st: _send(tc, base, key, st),
                       checks_state=lambda st: "request" not in st, counts_label="Idempotency-Result counts",
                       hold_must_acquire=True)
