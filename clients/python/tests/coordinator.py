"""The coordinator the tests run against.

IDEMCOORD_ADDR (and IDEMCOORD_TOKEN) when set, else a throwaway one started
with `go run ./internal/cmd/throwaway-coordinator` (a fresh PostgreSQL and the built binary).
"""

import json
import os
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))


class Coordinator:
    def __init__(self):
        self._proc = None
        if os.environ.get("IDEMCOORD_ADDR"):
            self.addr = os.environ["IDEMCOORD_ADDR"]
            self.token = os.environ.get("IDEMCOORD_TOKEN", "")
            self.auth = bool(self.token)
            return
        try:
            self._proc = subprocess.Popen(["go", "run", "./internal/cmd/throwaway-coordinator"], cwd=ROOT, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE)
        except OSError as err:
            raise RuntimeError("cannot run go to start a coordinator (set IDEMCOORD_ADDR instead): %s" % err)
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("go run ./internal/cmd/throwaway-coordinator exited with %s before the coordinator was ready"
                               % self._proc.wait())
        info = json.loads(line)
        self.addr, self.token, self.auth = info["addr"], info["token"], True

    def stop(self):
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait()
            self._proc.stdout.close()
