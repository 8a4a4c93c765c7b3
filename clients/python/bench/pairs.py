"""A load generator of the Python client: pairs and replays against a coordinator, with or without call batching.

callers concurrent callers (asyncio tasks), each in a loop, through one
idemcoord.aio.Client (with call_batching when --batching > 0):

  pairs:   Begin on a new key, then Complete it (a response of --body-bytes bytes);
  replays: Begin on one of the COMPLETED keys replay-0 ... replay-<n-1>
           (--replay-keys n), which must answer OUTCOME_REPLAY with the
           stored body; missing ones are completed first;
  both:    pairs, then replays, each for the warm-up and the duration.

Records, fingerprint and stored response are the ones bench/'s Go driver
and clients/node/bench/pairs.mjs write (scope "bench", fingerprint SHA-256
of "idemcoord bench request"), so their replay keys serve here too. It is a
development tool, outside the idemcoord package: pyproject.toml packages
only idemcoord, so the wheel leaves it out.

    /usr/bin/python3 clients/python/bench/pairs.py [flags]
      --target host:port   the coordinator (default $IDEMCOORD_ADDR, else 127.0.0.1:50051)
      --token t            bearer token (default $IDEMCOORD_TOKEN; none: auth off)
      --callers n          concurrent callers (default 64)
      --mode m             pairs, replays or both (default both)
      --warmup s           seconds run before measuring, not counted (default 1)
      --duration s         seconds measured, per mode (default 5)
      --batching n         the client's call_batching: Batch RPCs in flight, 0 unary (default 0)
      --replay-keys n      COMPLETED keys the replays cycle through (default 1024)
      --body-bytes n       bytes of each stored response (default 150)
      --scope s            scope of every record (default bench)

Output: a line "measuring" when a measured window starts; at the end one
JSON line of the iterations that started and ended inside the window(s):
pairs_per_s and/or replays_per_s, and (for the last window measured) ops,
errors, seconds, first_error, begin_p50_ms, begin_p99_ms, which is what
bench/ (-paths python) reads. The exit status is 1 when any iteration
failed.
"""

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import idemcoord  # noqa: E402
import idemcoord.aio  # noqa: E402

FINGERPRINT = hashlib.sha256(b"idemcoord bench request").digest()
ACQUIRED, REPLAY = idemcoord.Outcome.OUTCOME_ACQUIRED, idemcoord.Outcome.OUTCOME_REPLAY


def parse_args(argv):
    def at_least(kind, low):
        def parse(v):
            n = kind(v)
            if n < low:
                raise argparse.ArgumentTypeError("must be at least %s, got %s" % (low, v))
            return n
        return parse
    p = argparse.ArgumentParser(description="Pairs and replays against an idemcoord coordinator.")
    p.add_argument("--target", default=os.environ.get("IDEMCOORD_ADDR") or "127.0.0.1:50051")
    p.add_argument("--token", default=os.environ.get("IDEMCOORD_TOKEN", ""))
    p.add_argument("--callers", type=at_least(int, 1), default=64)
    p.add_argument("--mode", choices=("pairs", "replays", "both"), default="both")
    p.add_argument("--warmup", type=at_least(float, 0), default=1.0)
    p.add_argument("--duration", type=at_least(float, 0.001), default=5.0)
    p.add_argument("--batching", type=at_least(int, 0), default=0)
    p.add_argument("--replay-keys", type=at_least(int, 1), default=1024)
    p.add_argument("--body-bytes", type=at_least(int, 0), default=150)
    p.add_argument("--scope", default="bench")
    return p.parse_args(argv)


class Load:
    def __init__(self, args, client):
        self.args, self.client = args, client
        body = bytes(0x61 + i % 26 for i in range(args.body_bytes))
        self.response = idemcoord.StoredResponse(schema_version="bench.v1.Response/1",
                                                 content_type="application/x-protobuf", body=body)

    async def pair(self):
        """Begin on a new key and Complete it; returns Begin's latency in ms."""
        key = os.urandom(16).hex()
        t0 = time.monotonic()
        b = await self.client.begin(scope=self.args.scope, key=key, fingerprint=FINGERPRINT)
        began = (time.monotonic() - t0) * 1000
        if b.outcome != ACQUIRED:
            raise RuntimeError("begin on a new key answered %s" % idemcoord.Outcome.Name(b.outcome))
        await self.client.complete(scope=self.args.scope, key=key, lease_token=b.lease_token, response=self.response)
        return began

    async def replay(self):
        """Begin on a completed key; returns its latency in ms."""
        key = "replay-%d" % random.randrange(self.args.replay_keys)
        t0 = time.monotonic()
        b = await self.client.begin(scope=self.args.scope, key=key, fingerprint=FINGERPRINT)
        began = (time.monotonic() - t0) * 1000
        if b.outcome != REPLAY or len(b.record.response.body) != self.args.body_bytes:
            raise RuntimeError("begin on a completed key answered %s" % idemcoord.Outcome.Name(b.outcome))
        return began

    async def prepare_replay_keys(self):
        """Completes the replay keys that are not yet (as bench/'s driver does), 64 at a time."""
        async def one(key):
            b = await self.client.begin(scope=self.args.scope, key=key, fingerprint=FINGERPRINT)
            if b.outcome == ACQUIRED:
                await self.client.complete(scope=self.args.scope, key=key, lease_token=b.lease_token,
                                           response=self.response)
            elif b.outcome != REPLAY:
                raise RuntimeError("preparing %s: begin answered %s" % (key, idemcoord.Outcome.Name(b.outcome)))
        n = self.args.replay_keys
        for i in range(0, n, 64):
            await asyncio.gather(*(one("replay-%d" % j) for j in range(i, min(i + 64, n))))

    async def measure(self, op):
        """Runs op in the callers' loops for the warm-up and the measured window; returns what happened inside it."""
        start = time.monotonic()
        window_start = start + self.args.warmup
        window_end = window_start + self.args.duration
        out = {"ops": 0, "errors": 0, "first_error": ""}
        latencies = []
        announced = []

        def announce():
            if not announced:
                announced.append(True)
                print("measuring", flush=True)
        timer = asyncio.get_running_loop().call_later(self.args.warmup, announce)

        async def caller():
            while time.monotonic() < window_end:
                t0 = time.monotonic()
                began, err = 0.0, None
                try:
                    began = await op()
                except Exception as e:  # counted
                    err = e
                t1 = time.monotonic()
                if t0 < window_start or t1 > window_end:
                    continue  # not wholly inside the window
                if err is not None:
                    out["errors"] += 1
                    out["first_error"] = out["first_error"] or str(err)
                else:
                    out["ops"] += 1
                    latencies.append(began)
        await asyncio.gather(*(caller() for _ in range(self.args.callers)))
        timer.cancel()
        announce()
        latencies.sort()

        def quantile(q):
            return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0
        out.update(seconds=self.args.duration, begin_p50_ms=quantile(0.5), begin_p99_ms=quantile(0.99))
        return out


async def run(args):
    out = {"callers": args.callers, "batching": args.batching}
    failed = 0
    last = {}
    async with idemcoord.aio.Client(args.target, token=args.token or None, call_batching=args.batching) as client:
        load = Load(args, client)
        if args.mode in ("pairs", "both"):
            last = await load.measure(load.pair)
            out["pairs_per_s"] = last["ops"] / last["seconds"]
            failed += last["errors"]
        if args.mode in ("replays", "both"):
            await load.prepare_replay_keys()
            last = await load.measure(load.replay)
            out["replays_per_s"] = last["ops"] / last["seconds"]
            failed += last["errors"]
    out.update(last)
    print(json.dumps(out, separators=(",", ":")), flush=True)
    return 1 if failed else 0


def main(argv=None):
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
