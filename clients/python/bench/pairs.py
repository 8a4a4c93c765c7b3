"""A load generator for the Python client: Begin+Complete pairs and replays against a coordinator.

    /usr/bin/python3 clients/python/bench/pairs.py --addr 127.0.0.1:50051 --token "$TOKEN" \
        --callers 64 --duration 10 --call-batching 2

N concurrent callers (asyncio tasks on one idemcoord.aio.Client) each
loop for D seconds: Begin a fresh key (ACQUIRED), Complete it (a pair),
then Begin it again (a replay). At the end it prints one JSON line:
{"callers", "duration_s", "call_batching", "pairs", "replays", "errors",
"pairs_per_s", "replays_per_s", "client_cpu_ms_per_pair"} (the CPU this process
spent per pair and its replay: steadier than the rates on a shared machine);
the exit status is 1 when a call failed.

Flags:
  --addr ADDR           the coordinator's gRPC address (default: $IDEMCOORD_ADDR, else 127.0.0.1:50051)
  --token TOKEN         the bearer token (default: $IDEMCOORD_TOKEN; none when empty)
  --callers N           concurrent callers (default 64)
  --duration D          seconds to run (default 10)
  --call-batching B     idemcoord.aio.Client's call_batching: at most B Batch RPCs in flight; 0 sends
                        every call as its own unary RPC (default 0)
  --scope SCOPE         the records' scope (default "bench.pairs"); keys are random, one per pair

It lives outside the idemcoord package (pyproject.toml packages only
idemcoord), so the wheel does not carry it.
"""

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import idemcoord  # noqa: E402
import idemcoord.aio  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description="Begin+Complete pairs and replays against an idemcoord coordinator.")
    p.add_argument("--addr", default=os.environ.get("IDEMCOORD_ADDR") or "127.0.0.1:50051")
    p.add_argument("--token", default=os.environ.get("IDEMCOORD_TOKEN", ""))
    p.add_argument("--callers", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--call-batching", type=int, default=0)
    p.add_argument("--scope", default="bench.pairs")
    return p.parse_args(argv)


async def caller(client, scope, until, counts):
    prefix = uuid.uuid4().hex
    i = 0
    while time.monotonic() < until:
        i += 1
        key = "%s-%d" % (prefix, i)
        try:
            b = await client.begin(scope=scope, key=key)
            if b.outcome != idemcoord.Outcome.OUTCOME_ACQUIRED:
                raise RuntimeError("Begin of a fresh key answered %s" % idemcoord.Outcome.Name(b.outcome))
            await client.complete(scope=scope, key=key, lease_token=b.lease_token,
                                  response=idemcoord.StoredResponse(body=b"ok"))
            counts["pairs"] += 1
            r = await client.begin(scope=scope, key=key)
            if r.outcome != idemcoord.Outcome.OUTCOME_REPLAY:
                raise RuntimeError("Begin of a completed key answered %s" % idemcoord.Outcome.Name(r.outcome))
            counts["replays"] += 1
        except Exception as err:  # counted; the first few are printed to stderr
            counts["errors"] += 1
            if counts["errors"] <= 3:
                print("pairs.py: %s" % err, file=sys.stderr)


async def run(args):
    counts = {"pairs": 0, "replays": 0, "errors": 0}
    async with idemcoord.aio.Client(args.addr, token=args.token or None, call_batching=args.call_batching) as client:
        start, cpu = time.monotonic(), time.process_time()
        until = start + args.duration
        await asyncio.gather(*(caller(client, args.scope, until, counts) for _ in range(args.callers)))
        elapsed, cpu = time.monotonic() - start, time.process_time() - cpu
    return dict(callers=args.callers, duration_s=round(elapsed, 3), call_batching=args.call_batching, **counts,
                pairs_per_s=round(counts["pairs"] / elapsed, 1), replays_per_s=round(counts["replays"] / elapsed, 1),
                client_cpu_ms_per_pair=round(cpu * 1000 / max(counts["pairs"], 1), 3))


def main(argv=None):
    out = asyncio.run(run(parse_args(argv)))
    print(json.dumps(out, separators=(",", ":")))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
