"""What the ASGI and WSGI middlewares share: Go's clients.HTTPMiddleware semantics (clients/http.go).

Names on the wire (headers, problem types, the stored schema version) are
the same in every language; clients/testdata/http_conformance.json is the
suite every stack runs.
"""

import base64
import email.utils
import hashlib
import json
import math
import re
import time
import unicodedata
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import grpc

from . import _api
from ._tables import HTTP_HEADERS, PROBLEM_TYPES
from ._core import _C
from ._core import fold_principal as fold_principal  # noqa: F401 (re-exported: the middlewares fold with it)
from ._core import warn_undecided_principal as warn_undecided_principal  # noqa: F401 (re-exported)
from ._core import warn_unnamed_service as warn_unnamed_service  # noqa: F401 (re-exported)
from ._core import code_of_error as _code
from ._core import new_attempt_id as _new_attempt_id

if TYPE_CHECKING:
    from .client import _Settings

Headers = List[Tuple[str, str]]

KEY_HEADER = HTTP_HEADERS["key"]
RESULT_HEADER = HTTP_HEADERS["result"]
REPLAYED_HEADER = HTTP_HEADERS["replayed"]
EXPIRES_HEADER = HTTP_HEADERS["expires"]
HTTP_SCHEMA_VERSION = "idemcoord.http/1"
DEFAULT_HTTP_SCOPE = "http"
"""The one scope of every record before the default became the operation; scope=DEFAULT_HTTP_SCOPE keeps it."""
MAX_SCOPE_BYTES = 255
MAX_CAPTURED_BODY = 4 << 20

PROBLEM_KEY_MISSING = PROBLEM_TYPES["key_missing"]
PROBLEM_KEY_INVALID = PROBLEM_TYPES["key_invalid"]
PROBLEM_KEY_REUSED = PROBLEM_TYPES["key_reused"]
PROBLEM_KEY_EXPIRED = PROBLEM_TYPES["key_expired"]
PROBLEM_ATTEMPTS_EXHAUSTED = PROBLEM_TYPES["attempts_exhausted"]
PROBLEM_IN_PROGRESS = PROBLEM_TYPES["in_progress"]
PROBLEM_OUTCOME_UNKNOWN = PROBLEM_TYPES["outcome_unknown"]
PROBLEM_BODY_TOO_LARGE = PROBLEM_TYPES["body_too_large"]
PROBLEM_UNAVAILABLE = PROBLEM_TYPES["unavailable"]
PROBLEM_LEASE_LOST = PROBLEM_TYPES["lease_lost"]
PROBLEM_INTERNAL = PROBLEM_TYPES["internal"]


class Problem(Exception):
    """An answer the middleware writes itself (RFC 9457 application/problem+json)."""

    def __init__(self, status: int, type_: str, title: str, detail: str = "",
                 headers: Optional[Mapping[str, str]] = None):
        super().__init__(detail or title)
        self.status, self.type, self.title, self.detail = status, type_, title, detail
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        p: Dict[str, Any] = {"type": self.type, "title": self.title, "status": self.status}
        if self.detail:
            p["detail"] = self.detail
        return (json.dumps(p, separators=(",", ":")) + "\n").encode()

    def header_list(self, body: bytes) -> Headers:
        h = [(k, v) for k, v in self.headers.items()]
        h += [("Content-Type", "application/problem+json"), ("Content-Length", str(len(body)))]
        return h


def parse_idempotency_key(value: Union[bytes, str]) -> str:
    """The key of an Idempotency-Key header value (bytes as sent, or a latin-1 str).

    The value itself, or the content of a structured-field string; 1-255
    bytes of valid UTF-8 without control characters. Raises ValueError.
    """
    raw = value if isinstance(value, bytes) else value.encode("latin-1")
    v = raw.strip(b" \t")
    if len(v) >= 2 and v[:1] == b'"':
        out = bytearray()
        i = 1
        while i < len(v) and v[i] != 0x22:
            c = v[i]
            if c == 0x5C:
                i += 1
                if i >= len(v) or v[i] not in (0x22, 0x5C):
                    raise ValueError('Idempotency-Key: a structured-field string escapes only \\" and \\\\')
                c = v[i]
            elif c < 0x20 or c > 0x7E:
                raise ValueError("Idempotency-Key: a structured-field string holds printable ASCII only")
            out.append(c)
            i += 1
        if i != len(v) - 1:
            raise ValueError("Idempotency-Key: unterminated structured-field string, or text after it")
        v = bytes(out)
    try:
        return checked_key(v)
    except ValueError as err:
        raise ValueError("Idempotency-Key %s" % err) from None


def checked_key(v: bytes) -> str:
    """v as a key: 1-255 bytes of valid UTF-8 without control characters; raises ValueError saying which it is not."""
    if not v:
        raise ValueError("is empty")
    if len(v) > 255:
        raise ValueError("is %d bytes long, more than 255" % len(v))
    try:
        key = v.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("is not valid UTF-8") from None
    if any(unicodedata.category(ch) == "Cc" for ch in key):
        raise ValueError("holds a control character")
    return key


def http_fingerprint(method: str, target: str, body: bytes) -> bytes:
    """The default fingerprint: SHA-256 of method, "\\n", path with query as sent, "\\n", body (Go's HTTPFingerprint)."""
    h = hashlib.sha256()
    h.update(method.encode("latin-1") + b"\n" + target.encode("latin-1") + b"\n")
    h.update(body)
    return h.digest()


def http_operation_scope(service: str, method: str, path: str) -> str:
    """The default scope of a request (Go's HTTPOperationScope): "[service ]METHOD /path".

    path is as sent (percent-encoded), without the query. A scope longer
    than 255 bytes is its first 190 bytes (never cutting a UTF-8 sequence),
    "~", and the unpadded base64url SHA-256 of the whole.
    """
    s = "%s %s" % (method, path)
    if service:
        s = "%s %s" % (service, s)
    b = s.encode("utf-8")
    if len(b) <= MAX_SCOPE_BYTES:
        return s
    cut = 190
    while cut > 0 and b[cut] & 0xC0 == 0x80:
        cut -= 1
    digest = base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode()
    return b[:cut].decode("utf-8") + "~" + digest


def canonical_header(name: str) -> str:
    """Go's http.CanonicalHeaderKey: "x-extra" -> "X-Extra"."""
    return re.sub(r"(^|-)([a-z])", lambda m: m.group(1) + m.group(2).upper(), name.lower())


def imf_fixdate(ts: Any) -> Optional[str]:
    """An IMF-fixdate of a google.protobuf.Timestamp, None when unset."""
    if ts is None or (ts.seconds == 0 and ts.nanos == 0):
        return None
    return email.utils.formatdate(ts.seconds, usegmt=True)


def error_reason(err: object) -> str:
    """The google.rpc.ErrorInfo reason in a gRPC error's status details, "" when none."""
    trailing = getattr(err, "trailing_metadata", None)
    md = trailing() if callable(trailing) else None
    for k, v in md or ():
        if k == "grpc-status-details-bin":
            st = _api.Status()
            try:
                st.ParseFromString(v)
            except Exception:
                return ""
            info = _api.message_class("google.rpc.ErrorInfo")()
            for d in st.details:
                if d.Is(info.DESCRIPTOR):
                    try:
                        d.Unpack(info)
                    except Exception:
                        return ""
                    return str(info.reason)
    return ""


MISMATCH_STATUSES = (409, 422)


class Options:
    """The middleware's options; each is Go's WithHTTP… option of the same name.

    without_principal=True says on purpose that keys are not per end user
    (Go's WithoutHTTPPrincipal); with neither it nor principal, building a
    middleware warns (UndecidedPrincipalWarning). scope=None (the default)
    records each request in its operation's scope, "POST /orders", prefixed
    by service= when given; with neither service= nor scope=, building a
    middleware warns (UnnamedServiceWarning). mismatch_status is 409 or
    422; any other value raises ValueError. key (Go's WithHTTPKeyFunc) is
    a function of the request and its body that gives the key of a
    request sent without an Idempotency-Key header (see key_from).
    """

    def __init__(self, *, wait: float = 5.0, require_key: bool = False, fail_open: bool = False,
                 principal: Optional[Callable[[Any], Any]] = None, methods: Iterable[str] = ("POST", "PATCH"),
                 fingerprint: Optional[Callable[[Any, bytes], Any]] = None, replay_headers: Iterable[str] = (),
                 replayable_statuses: Iterable[int] = (404, 409, 422), scope: Optional[str] = None,
                 max_body_bytes: int = 10 << 20, mismatch_status: int = 422,
                 on_replay: Optional[Callable[[Any, Any], Any]] = None, without_principal: bool = False,
                 service: str = "", key: Optional[Callable[[Any, bytes], Any]] = None):
        if mismatch_status not in MISMATCH_STATUSES or isinstance(mismatch_status, bool):
            raise ValueError("idemcoord: mismatch_status takes 409 or 422 (the answer to a key reused with another "
                             "request), not %r" % (mismatch_status,))
        if principal is not None and without_principal:
            raise ValueError("idemcoord: principal= and without_principal=True contradict each other")
        self.undecided_principal = principal is None and not without_principal
        self.wait = max(float(wait), 0.0)
        self.require_key = require_key
        self.fail_open = fail_open
        self.principal = principal
        self.methods = {m.upper() for m in methods}
        self.fingerprint = fingerprint
        self.replay_headers = ["location"] + [h.lower() for h in replay_headers if h.lower() not in ("content-type", "location")]
        self.replayable = set(replayable_statuses)
        self.scope = scope or None
        self.service = service
        self.unnamed_service = not scope and not service
        self.max_body_bytes = max_body_bytes
        self.mismatch_status = mismatch_status
        self.on_replay = on_replay
        self.key = key

    def scope_of(self, method: str, target: str) -> str:
        """The scope of a request's record: scope=, else its operation (target is the path with the query, as sent)."""
        if self.scope is not None:
            return self.scope
        return http_operation_scope(self.service, method, target.split("?", 1)[0])

    def kind(self, status: int) -> Optional[str]:
        """How a final status is recorded: None is stored as a success."""
        if status < 400:
            return None
        if status in self.replayable:
            return "FAILURE_KIND_REPLAYABLE"
        if status < 500:
            return "FAILURE_KIND_ABANDONED"
        if status == 503:
            return "FAILURE_KIND_RETRYABLE"
        return "FAILURE_KIND_UNKNOWN"

    def stores(self, status: int) -> bool:
        return self.kind(status) in (None, "FAILURE_KIND_REPLAYABLE")


def key_of(o: Options, headers: Iterable[Tuple[bytes, bytes]]) -> Tuple[Optional[bytes], Optional[str]]:
    """The raw header value and key of a request, from its headers [(name lower-case bytes, value bytes)].

    Returns (None, None) without the header (o.key may then find one);
    raises Problem.
    """
    raw = [v for k, v in headers if k == b"idempotency-key"]
    if not raw:
        if o.key is None:
            no_key(o)
        return None, None
    if len(raw) > 1:
        raise Problem(400, PROBLEM_KEY_INVALID, "Idempotency-Key is invalid", "send one Idempotency-Key header")
    try:
        return raw[0], parse_idempotency_key(raw[0])
    except ValueError as err:
        raise Problem(400, PROBLEM_KEY_INVALID, "Idempotency-Key is invalid", str(err)) from None


def key_from(o: Options, found: Any) -> Optional[str]:
    """The key that o.key found (what it returned) in a request sent without an Idempotency-Key header.

    None or "" is no key (the request runs unprotected, or answers 400
    when a key is required: see no_key). Any other value (a str, or bytes
    as UTF-8) is used as a header's key would be: 1-255 bytes of UTF-8
    without control characters, else 400 key-invalid. Raises Problem.
    """
    if found is None or found == "" or found == b"":
        return None
    raw = found if isinstance(found, bytes) else str(found).encode("utf-8", "surrogatepass")
    try:
        return checked_key(raw)
    except ValueError as err:
        raise Problem(400, PROBLEM_KEY_INVALID, "Idempotency key is invalid",
                      "the idempotency key taken from the request %s" % err) from None


def key_failed(err: BaseException) -> Problem:
    """The answer when o.key raised err: 400 key-invalid; nothing runs."""
    return Problem(400, PROBLEM_KEY_INVALID, "Idempotency key is invalid",
                   "the idempotency key could not be taken from the request: %s" % err)


def no_key(o: Options) -> None:
    """A request without a key: raises the 400 of require_key, else returns (the handler runs unprotected)."""
    if o.require_key:
        raise Problem(400, PROBLEM_KEY_MISSING, "Idempotency-Key is missing",
                      "this request requires an Idempotency-Key header")


def joined_lines(value: str) -> List[bytes]:
    """The Idempotency-Key header lines a CGI-style environ (WSGI) joined into value with commas.

    A WSGI server hands repeated header lines over as one value joined by
    ",", so an unquoted value with a comma is taken for several lines (a key
    holding a comma is sent as a structured-field string, "quoted").
    """
    raw = value.encode("latin-1")
    if raw.strip(b" \t")[:1] != b'"' and b"," in raw:
        return raw.split(b",")
    return [raw]


def too_large(o: Options) -> Problem:
    return Problem(413, PROBLEM_BODY_TOO_LARGE, "Request body too large",
                   "a request with an Idempotency-Key may have at most %d bytes of body" % o.max_body_bytes)


def begin_request(client: "_Settings", scope: str, key: str, fp: Optional[bytes]) -> Dict[str, Any]:
    req: Dict[str, Any] = dict(scope=scope, key=key, fingerprint=bytes(fp or b""), attempt_id=_new_attempt_id(),
               accept_schema_versions=[HTTP_SCHEMA_VERSION])
    if client._lease is not None:
        req["lease"] = client._lease
    return req


def wait_until(o: Options) -> float:
    return time.monotonic() + o.wait


def begin_failed(client: "_Settings", o: Options, err: BaseException) -> Optional[Problem]:
    """The answer to a Begin that failed: a Problem, or None to run the handler unprotected (fail open)."""
    code = _code(err)
    if code in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED):
        if o.fail_open:
            client._log.warning("idemcoord: coordinator unreachable; running the handler unprotected (fail open): %s", err)
            return None
        return Problem(503, PROBLEM_UNAVAILABLE, "Idempotency coordinator unavailable",
                       "the request was not processed; retry later with the same Idempotency-Key", {"Retry-After": "1"})
    if code == _C.RESOURCE_EXHAUSTED:
        return Problem(503, PROBLEM_UNAVAILABLE, "Idempotency coordinator busy",
                       "the request was not processed; retry later with the same Idempotency-Key", {"Retry-After": "1"})
    if code == _C.FAILED_PRECONDITION:
        reason = error_reason(err)
        if reason in ("FINGERPRINT_MISMATCH", "SCHEMA_VERSION_NOT_ACCEPTED"):
            return Problem(o.mismatch_status, PROBLEM_KEY_REUSED, "Idempotency-Key reused",
                           "this Idempotency-Key was first used with another request")
        if reason == "KEY_EXPIRED":
            return Problem(422, PROBLEM_KEY_EXPIRED, "Idempotency-Key expired",
                           "the result stored for this Idempotency-Key has expired and the key may not be used again")
        if reason == "ATTEMPTS_EXHAUSTED":
            return Problem(422, PROBLEM_ATTEMPTS_EXHAUSTED, "Idempotency-Key attempts exhausted",
                           "requests with this Idempotency-Key failed as many times as allowed")
    if code == _C.INVALID_ARGUMENT:
        details = err.details() if isinstance(err, grpc.RpcError) else str(err)
        return Problem(400, PROBLEM_KEY_INVALID, "Idempotency-Key is invalid", details)
    client._log.error("idemcoord: coordinator refused Begin: %s", err)
    return Problem(500, PROBLEM_INTERNAL, "Internal Server Error", "the idempotency coordinator refused the call")


def not_acquired(res: Any) -> Problem:
    """The Problem for a Begin answer that is neither ACQUIRED nor REPLAY."""
    if res.record.state == _api.State.STATE_UNKNOWN:
        return Problem(409, PROBLEM_OUTCOME_UNKNOWN, "Outcome of an earlier request unknown",
                       "an earlier request with this Idempotency-Key may or may not have taken effect; it is held "
                       "for an operator, and retrying does not help")
    retry = res.retry_after.seconds + res.retry_after.nanos / 1e9
    return Problem(409, PROBLEM_IN_PROGRESS, "Request in progress",
                   "another request with this Idempotency-Key is in progress; retry after %.3f s" % retry,
                   {"Retry-After": str(max(int(math.ceil(retry)), 1))})


def lease_lost() -> Problem:
    return Problem(503, PROBLEM_LEASE_LOST, "Idempotency key taken over",
                   "this request lost its hold on the Idempotency-Key before it answered, and nothing was stored for "
                   "it; retry with the same Idempotency-Key to get the outcome", {"Retry-After": "1"})


def not_started() -> Problem:
    return Problem(503, PROBLEM_UNAVAILABLE, "Idempotency coordinator unavailable",
                   "the request was not processed; retry later with the same Idempotency-Key", {"Retry-After": "1"})


def silent(unconfirmed: bool) -> Problem:
    if unconfirmed:
        return Problem(503, PROBLEM_UNAVAILABLE, "Idempotency coordinator unavailable",
                       "the request was not completed; retry later with the same Idempotency-Key", {"Retry-After": "1"})
    return Problem(503, "about:blank", "Service Unavailable",
                   "the request ended before the handler answered; retry with the same Idempotency-Key",
                   {"Retry-After": "1"})


def replay_answer(o: Options, request: Any, record: Any) -> Tuple[int, Headers, bytes]:
    """(status, [(name, value)], body) of a stored response, as replayed."""
    stored = record.response
    if o.on_replay is not None:
        stored = o.on_replay(request, stored) or stored
    headers: Headers = []
    if stored.content_type:
        headers.append(("Content-Type", stored.content_type))
    for name, v in stored.metadata.items():
        for one in v.split("\n"):
            headers.append((canonical_header(name), one))
    expires = imf_fixdate(record.expires_at if record.HasField("expires_at") else None)
    if expires:
        headers.append((EXPIRES_HEADER, expires))
    headers.append((RESULT_HEADER, "replayed"))
    headers.append((REPLAYED_HEADER, "true"))
    headers.append(("Content-Length", str(len(stored.body))))
    code = stored.status_code if 200 <= stored.status_code <= 999 else 200
    return code, headers, bytes(stored.body)


class Recording:
    """The copy of the handler's response that is stored: status, stored headers, body.

    begun is Begin's answer (its ttl and failure_ttl give a created answer's Idempotency-Expires).
    """

    def __init__(self, o: Options, begun: Any = None):
        self.o = o
        self.ttl = _seconds(begun, "ttl")
        self.failure_ttl = _seconds(begun, "failure_ttl")
        self.wrote = False
        self.status = 0
        self.headers: Dict[str, List[str]] = {}
        self.body = bytearray()
        self.overflow = False
        self.ended = False

    def head(self, status: int, headers: Iterable[Tuple[str, str]]) -> Headers:
        """Records the status and headers [(name str, value str)]; returns the headers to send."""
        self.wrote, self.status = True, status
        keep = ["content-type"] + self.o.replay_headers
        out: Headers = []
        for name, value in headers:
            lname = name.lower()
            if lname in (RESULT_HEADER.lower(), EXPIRES_HEADER.lower()):
                continue
            if lname in keep:
                self.headers.setdefault(lname, []).append(value)
            out.append((name, value))
        if self.o.stores(status):
            out.append((RESULT_HEADER, "created"))
            ttl = self.failure_ttl if self.o.kind(status) == "FAILURE_KIND_REPLAYABLE" else self.ttl
            if ttl is not None:
                out.append((EXPIRES_HEADER, email.utils.formatdate(time.time() + ttl, usegmt=True)))
        return out

    def keep(self, chunk: bytes) -> None:
        if self.overflow or not chunk:
            return
        if len(self.body) + len(chunk) > MAX_CAPTURED_BODY:
            self.overflow = True
            self.body = bytearray()
            return
        self.body += chunk

    def stored(self) -> Any:
        resp = _api.StoredResponse(schema_version=HTTP_SCHEMA_VERSION, status_code=self.status, body=bytes(self.body))
        for name, values in self.headers.items():
            if name == "content-type":
                resp.content_type = ", ".join(values)
            else:
                resp.metadata[canonical_header(name)] = "\n".join(values)
        return resp

    def ending(self, marked: bool) -> Dict[str, Any]:
        """The finish() arguments of the recorded response."""
        reason = "HTTP %d" % self.status
        kind = self.o.kind(self.status)
        if self.overflow and kind in (None, "FAILURE_KIND_REPLAYABLE"):
            return dict(kind="FAILURE_KIND_UNKNOWN", reason=reason + ": response body too large to store")
        if kind is None:
            return dict(complete=self.stored())
        if kind == "FAILURE_KIND_REPLAYABLE":
            return dict(kind=kind, response=self.stored(), reason=reason)
        if marked:
            return dict(kind="FAILURE_KIND_UNKNOWN", reason=reason + " after mark_side_effect")
        return dict(kind=kind, reason=reason)


def _seconds(begun: Any, field: str) -> Optional[float]:
    """The Duration field of Begin's answer in seconds, None when unset."""
    if begun is None or not begun.HasField(field):
        return None
    d = getattr(begun, field)
    return float(d.seconds + d.nanos / 1e9)


def silent_ending(marked: bool, cause: object) -> Dict[str, Any]:
    reason = "the handler wrote no response after its request ended: %s" % (cause or "the client went away")
    if marked:
        return dict(kind="FAILURE_KIND_UNKNOWN", reason=reason + " (after mark_side_effect)")
    return dict(kind="FAILURE_KIND_RETRYABLE", reason=reason)
