"""WSGI middleware (Flask, any WSGI app) with the semantics of Go's clients.HTTPMiddleware.

    app.wsgi_app = idemcoord.wsgi.IdempotencyMiddleware(app.wsgi_app, client=client)

The same answers, statuses and stored records as idemcoord.asgi and Go's
middleware (clients/testdata/http_conformance.json), with two differences
WSGI imposes: the answer is sent once the app has finished and the outcome
is recorded (it is buffered, not streamed), and WSGI tells an app nothing
when its client goes away, so a request that waits for another one with its
key, or a handler that runs after its client left, goes on to the end. No key
is stranded by that: the outcome is recorded and the client's retry gets it.

A chunked request body (no Content-Length) is read to its end when the
server says it ends the input there (wsgi.input_terminated, as gunicorn and
Werkzeug do); a server that does not gets 411 for it, since the middleware
could not tell where the body ends. A request with both Transfer-Encoding
and Content-Length answers 400, as under Express and Fastify: the two may
disagree on where its body ends. Repeated Idempotency-Key lines, which a
WSGI server joins with commas, answer 400 as in every other stack.
"""

import http
import io
import threading
import urllib.parse
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Dict, Iterable, List, Optional, Tuple

import grpc

from . import _api, _http
from .client import Attempt, Client, _answer_lost, _current, _Holder

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment


def _target(environ: "WSGIEnvironment") -> str:
    uri: Optional[str] = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if uri:
        return uri
    path = urllib.parse.quote(environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", ""), safe="/;=,:@!$&'()*+~")
    qs: str = environ.get("QUERY_STRING", "")
    return path + ("?" + qs if qs else "")


_READ_SIZE = 64 << 10


def _read_body(o: _http.Options, environ: Dict[str, Any]) -> bytes:
    """The whole request body, at most o.max_body_bytes of it (else 413); raises _http.Problem.

    Without Content-Length it reads to the end of the input when the server
    ends the input there (wsgi.input_terminated); a chunked body on a server
    that does not answers 411, and no body is an empty one (PEP 3333). A
    request with both Transfer-Encoding and Content-Length answers 400: the
    two may disagree on where its body ends.
    """
    stream: BinaryIO = environ["wsgi.input"]
    length: str = environ.get("CONTENT_LENGTH") or ""
    if length.strip() and "HTTP_TRANSFER_ENCODING" in environ:
        raise _http.Problem(400, "about:blank", "Bad Request",
                            "a request with both Transfer-Encoding and Content-Length is refused: the two may "
                            "disagree on where its body ends")
    if length.strip():
        try:
            n = int(length)
        except ValueError:
            raise _http.Problem(400, "about:blank", "Bad Request", "Content-Length is not a number") from None
        if n > o.max_body_bytes:
            raise _http.too_large(o)
        return stream.read(n) if n > 0 else b""
    if environ.get("wsgi.input_terminated"):
        body = bytearray()
        while True:
            chunk = stream.read(min(_READ_SIZE, o.max_body_bytes + 1 - len(body)))
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > o.max_body_bytes:
                raise _http.too_large(o)
    if "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
        raise _http.Problem(411, "about:blank", "Length Required",
                            "this server does not tell where a chunked request body ends (wsgi.input_terminated); "
                            "send Content-Length with a request that has an Idempotency-Key")
    return b""


class IdempotencyMiddleware:
    """Makes a WSGI app idempotent through client (an idemcoord.Client).

    Options (keywords, each as Go's WithHTTP… option): wait (seconds),
    require_key, fail_open, principal (a function of the WSGI environ),
    methods, fingerprint (a function of environ and body), replay_headers,
    replayable_statuses, scope, max_body_bytes, mismatch_status, on_replay
    (a function of environ and the StoredResponse), key (a function of
    environ and body: the key of a request sent without an Idempotency-Key
    header, None or "" for none; the header, when sent, wins).
    """

    def __init__(self, app: "WSGIApplication", client: Client, **options: Any):
        self.app = app
        self.client = client
        self.o = _http.Options(**options)
        if self.o.undecided_principal:
            _http.warn_undecided_principal("idemcoord.wsgi.IdempotencyMiddleware")
        if self.o.unnamed_service:
            _http.warn_unnamed_service("idemcoord.wsgi.IdempotencyMiddleware")

    def __call__(self, environ: "WSGIEnvironment", start_response: "StartResponse") -> Iterable[bytes]:
        o = self.o
        if environ.get("REQUEST_METHOD", "GET") not in o.methods:
            return self.app(environ, start_response)
        raw_value = environ.get("HTTP_IDEMPOTENCY_KEY")
        headers = [] if raw_value is None else [(b"idempotency-key", line) for line in _http.joined_lines(raw_value)]
        body: Optional[bytes] = None
        try:
            raw, key = _http.key_of(o, headers)
            if key is None and o.key is not None:
                body = self._body(environ)
                try:
                    found = o.key(environ, body)
                except Exception as err:
                    raise _http.key_failed(err) from err
                finally:
                    environ["wsgi.input"] = io.BytesIO(body)  # the function may have read it
                key = _http.key_from(o, found)
                if key is None:
                    _http.no_key(o)
        except _http.Problem as p:
            return self._problem(start_response, p, [])
        if key is None:
            return self.app(environ, start_response)
        # The key as sent, or as found (its UTF-8 bytes, as a WSGI header value carries them).
        echo = [("Idempotency-Key", raw.decode("latin-1") if raw is not None else key.encode("utf-8").decode("latin-1"))]
        try:
            if o.principal is not None:
                try:
                    key = _http.fold_principal(o.principal(environ), key)
                except Exception as err:
                    raise _http.Problem(400, "about:blank", "Bad Request", "idempotency principal: %s" % err)
            if body is None:
                body = self._body(environ)
            try:
                if o.fingerprint is not None:
                    fp: bytes = o.fingerprint(environ, body)
                else:
                    fp = _http.http_fingerprint(environ["REQUEST_METHOD"], _target(environ), body)
            except Exception as err:
                raise _http.Problem(400, "about:blank", "Bad Request", "idempotency fingerprint: %s" % err)
        except _http.Problem as p:
            return self._problem(start_response, p, echo)
        return self._guarded(environ, start_response, key, fp, echo)

    def _body(self, environ: "WSGIEnvironment") -> bytes:
        """Reads the whole body (see _read_body) and hands it to the app as it was; raises _http.Problem."""
        body = _read_body(self.o, environ)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        return body

    def _problem(self, start_response: "StartResponse", p: _http.Problem, echo: List[Tuple[str, str]]) -> List[bytes]:
        body = p.body()
        start_response("%d %s" % (p.status, p.title), p.header_list(body) + echo)
        return [body]

    def _guarded(self, environ: "WSGIEnvironment", start_response: "StartResponse", key: str, fp: bytes,
                 echo: List[Tuple[str, str]]) -> Iterable[bytes]:
        o, c = self.o, self.client
        breq = _http.begin_request(c, o.scope_of(environ["REQUEST_METHOD"], _target(environ)), key, fp)
        try:
            res, sent = c._begin_waiting(breq, None, None, _http.wait_until(o))
        except grpc.RpcError as err:
            if _answer_lost(err):
                threading.Thread(target=c._release, args=(breq,), daemon=True).start()
            p = _http.begin_failed(c, o, err)
            if p is None:
                return self.app(environ, start_response)
            return self._problem(start_response, p, echo)
        if res.outcome == _api.Outcome.OUTCOME_REPLAY:
            status, headers, stored = _http.replay_answer(o, environ, res.record)
            start_response("%d %s" % (status, _reason(status)), headers + echo)
            return [stored]
        if res.outcome != _api.Outcome.OUTCOME_ACQUIRED:
            return self._problem(start_response, _http.not_acquired(res), echo)

        holder = _Holder(c, breq, res, sent)
        attempt = Attempt(holder.info, holder=holder)
        stop = holder.start(attempt)
        if stop is None:
            if holder.lost:
                return self._problem(start_response, _http.lease_lost(), echo)
            holder.finish(kind="FAILURE_KIND_ABANDONED",
                          reason="the lease could not be confirmed before the handler started")
            return self._problem(start_response, _http.not_started(), echo)

        rec = _http.Recording(o, res)
        answer: Dict[str, Any] = {}  # status, headers
        parts: List[bytes] = []  # the whole answer; rec keeps what is stored

        def write(chunk: bytes) -> None:
            parts.append(chunk)
            rec.keep(chunk)

        def recording_start_response(status: str, headers: List[Tuple[str, str]],
                                     exc_info: Any = None) -> Callable[[bytes], None]:
            answer["status"], answer["headers"] = status, headers
            return write

        token = _current.set(attempt)
        complete = False  # the app gave its whole answer: status and every chunk
        try:
            chunks = self.app(environ, recording_start_response)
            try:
                for chunk in chunks:
                    write(chunk)
                complete = "status" in answer
            finally:
                if hasattr(chunks, "close"):
                    chunks.close()
        except BaseException as err:
            if not (complete and isinstance(err, Exception)):
                stop()
                if not holder.lost:
                    holder.finish(kind="FAILURE_KIND_UNKNOWN", reason="the app raised %s" % type(err).__name__)
                raise
            # What was answered stands: the client gets it and its retry the same.
            c._log.warning("idemcoord: the app raised %s after its answer was complete; the answer is stored "
                           "(%s/%s)", type(err).__name__, holder.scope, holder.key, exc_info=True)
        finally:
            _current.reset(token)
        stop()
        if holder.lost or "status" not in answer:
            if holder.lost:
                c._log.warning("idemcoord: lease lost while the app ran; its response is not stored (%s/%s)",
                               holder.scope, holder.key)
                return self._problem(start_response, _http.lease_lost(), echo)
            answer["status"], answer["headers"] = "200 OK", []
        code = int(answer["status"].split(" ", 1)[0])
        out = rec.head(code, [(k, v) for k, v in answer["headers"] if k.lower() != "idempotency-key"])
        refusal = holder.finish(**rec.ending(attempt._marked))
        if refusal is not None:
            c._log.error("idemcoord: coordinator refused the end of an attempt: %s", refusal)
        start_response(answer["status"], out + echo)
        return [b"".join(parts)]


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""
