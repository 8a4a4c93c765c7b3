"""The coordinator the tests run against.

IDEMCOORD_ADDR (and IDEMCOORD_TOKEN) when set, else a throwaway one started
with `go run ./internal/cmd/throwaway-coordinator` (a fresh PostgreSQL and the built binary).
Coordinator(own=True) always starts a throwaway one, which stop_serving and
start_serving restart on the same address and database.
"""

import json
import os
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))


class Coordinator:
    def __init__(self, own=False):
        self._proc = None
        if os.environ.get("IDEMCOORD_ADDR") and not own:
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

    def stop_serving(self):
        """Stops the coordinator process (SIGTERM); returns once it exited."""
        self._command("stop", "stopped")

    def start_serving(self):
        """Starts the coordinator again on the same address and database; returns once it is ready."""
        self._command("start", "serving")

    def _command(self, command, state):
        if self._proc is None:
            raise RuntimeError("only a Coordinator(own=True) can be stopped and started")
        self._proc.stdin.write(command.encode() + b"\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line or json.loads(line).get("state") != state:
            raise RuntimeError("throwaway-coordinator answered %r to %s" % (line, command))

    def stop(self):
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait()
            self._proc.stdout.close()


# IDEMCOORD_TEST_CALL_BATCHING, set to a number, makes the fixtures' clients
# share RPCs (call_batching with that many Batch RPCs in flight), as the Go
# client's tests read it: a second run of the suite with it tests every
# promise tested through a fixture through Batch RPCs too. Clients built
# with fault-injecting interceptors that watch one method's unary RPCs
# stay unary.
CALL_BATCHING_ENV = "IDEMCOORD_TEST_CALL_BATCHING"


def fixture_options(**kwargs):
    """kwargs, with call_batching when IDEMCOORD_TEST_CALL_BATCHING asks for it (and no interceptors are given)."""
    try:
        n = int(os.environ.get(CALL_BATCHING_ENV, ""))
    except ValueError:
        n = 0
    if n > 0 and not kwargs.get("interceptors"):
        kwargs.setdefault("call_batching", n)
    return kwargs
