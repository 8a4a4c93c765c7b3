"""The Python retrying client of chaos/retryclients_test.go: requests with
urllib3's Retry (Debian's python3-requests), sending POST /projects to the
HTTP demo through a fault-injecting proxy.

    /usr/bin/python3 client.py PLAN.json faults|replay

PLAN.json (written by the test): {url, user, concurrency, retries,
normal_timeout_ms, ops: [{key, name, timeout_ms}]}. Each operation sets its
Idempotency-Key header once and urllib3 resends the same request, key
included, on every retry: connection errors, read time-outs and 502/503/504,
for every method (POST included). In "faults" an operation is sent with its
own time-out, and sent once more with the normal one when the first send got
no answer (a user pressing "retry"); in "replay" it is sent once with the
normal time-out. One JSON line per operation on stdout:
{"i": N, "sends": [{"status": 201, "body": "<base64>", "result": "created", "error": ""}]}.
"""

import base64
import concurrent.futures
import json
import sys
import threading

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry


def main():
    plan_file, phase = sys.argv[1], sys.argv[2]
    with open(plan_file) as f:
        plan = json.load(f)
    local = threading.local()
    out = threading.Lock()

    def session():
        if not hasattr(local, "session"):
            s = requests.Session()
            retry = Retry(
                total=plan["retries"],
                connect=plan["retries"],
                read=plan["retries"],
                status=plan["retries"],
                status_forcelist=(502, 503, 504),
                allowed_methods=None,  # retry every method: the key makes POST safe
                backoff_factor=0.01,
                respect_retry_after_header=True,
                raise_on_status=False,
            )
            s.mount("http://", HTTPAdapter(max_retries=retry))
            local.session = s
        return local.session

    def send(op, timeout_ms):
        try:
            r = session().post(
                plan["url"],
                data=json.dumps({"name": op["name"], "prompt": "from requests"}),
                headers={
                    "Content-Type": "application/json",
                    "Idempotency-Key": op["key"],
                    "X-User-Id": plan["user"],
                },
                timeout=timeout_ms / 1000.0,
            )
            retries = getattr(r.raw, "retries", None)
            return {"status": r.status_code, "body": base64.b64encode(r.content).decode(),
                    "result": r.headers.get("Idempotency-Result", ""), "error": "",
                    "retries": len(retries.history) if retries else 0}
        except requests.RequestException as e:
            return {"status": 0, "body": "", "result": "", "error": f"{type(e).__name__}: {e}"}

    def run(i):
        op = plan["ops"][i]
        if phase == "faults":
            sends = [send(op, op["timeout_ms"])]
            if sends[0]["status"] == 0:
                sends.append(send(op, plan["normal_timeout_ms"]))
        else:
            sends = [send(op, plan["normal_timeout_ms"])]
        line = json.dumps({"i": i, "sends": sends})
        with out:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    with concurrent.futures.ThreadPoolExecutor(max_workers=plan["concurrency"]) as pool:
        list(pool.map(run, range(len(plan["ops"]))))


if __name__ == "__main__":
    main()
