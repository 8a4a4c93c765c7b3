"""The tables every idemcoord client library shares, loaded from shared_tables.json.

shared_tables.json is a copy of clients/testdata/shared_tables.json that
`make generate` writes into the package (`make test` fails when it is
stale); a Go test holds that file against the Go client's constants. Here
are HTTP header names, problem types, how a handler's gRPC code is recorded, the release of an
acquisition nobody will act on, the client's timings and the ErrorInfo
domain. ErrorInfo reasons are the proto's enum (see _api.REASONS).
"""

import json
import os
from typing import Dict, Mapping

import grpc

TABLES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared_tables.json")

with open(TABLES_FILE, encoding="utf-8") as _f:
    _TABLES = json.load(_f)

ERROR_INFO_DOMAIN: str = _TABLES["error_info_domain"]
"""The domain of every google.rpc.ErrorInfo idemcoord sends."""

HTTP_HEADERS: Mapping[str, str] = dict(_TABLES["http_headers"])
"""The HTTP middlewares' header names by name ("key", "result", "replayed", "expires")."""

PROBLEM_TYPES: Mapping[str, str] = dict(_TABLES["problem_types"])
"""The HTTP problem types (application/problem+json "type") by name."""

FAILURE_KINDS: Dict[grpc.StatusCode, str] = {
    getattr(grpc.StatusCode, code): kind for code, kind in _TABLES["failure_kind_by_code"].items()}
"""How a handler's error is recorded, by its gRPC code (a FailureKind name); other codes: FAILURE_KIND_UNKNOWN."""

RELEASE_REASON: str = _TABLES["release"]["reason"]
"""The Fail reason of an acquisition released because nobody will act on it."""
RELEASE_TIMEOUT: float = _TABLES["release"]["timeout_ms"] / 1000
"""Seconds a release may take, all its calls together."""

_TIMINGS = _TABLES["timings_ms"]
DEFAULT_LEASE: float = _TIMINGS["default_lease"] / 1000
"""Seconds of lease assumed when a Begin answer does not tell it."""
MIN_HEARTBEAT: float = _TIMINGS["min_heartbeat"] / 1000
"""The shortest heartbeat interval, in seconds."""
FINISH_TIMEOUT: float = _TIMINGS["finish_timeout"] / 1000
"""Seconds for the Complete or Fail made before an attempt returns."""
MAX_BEGIN_WAIT: float = _TIMINGS["max_begin_wait"] / 1000
"""The longest wait, in seconds, one Begin asks for."""
