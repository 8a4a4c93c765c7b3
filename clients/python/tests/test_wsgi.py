"""Flask behind idemcoord.wsgi.IdempotencyMiddleware runs the shared HTTP suite.

The app is served by a threading wsgiref server on 127.0.0.1 and reached
over real HTTP; the coordinator is a real one (see coordinator.py).
"""

import io
import logging
import os
import socket
import socketserver
import threading
import typing
import unittest
import uuid
import warnings
import wsgiref.simple_server

import httpx

import idemcoord

from idemcoord import _http
from idemcoord.wsgi import IdempotencyMiddleware

from . import conformance, scaffold

try:
    import flask
except ImportError as err:  # Debian: python3-flask python3-httpx
    if os.environ.get("CI") == "true":
        raise
    raise unittest.SkipTest("WSGI stack missing: %s" % err)

COORD = None
CLIENT = None
setUpModule, tearDownModule = scaffold.coordinator_module(globals(), conformance.SUITE["client_lease_ms"])


class _Server(socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer):
    daemon_threads = True


class _Quiet(wsgiref.simple_server.WSGIRequestHandler):
    def log_message(self, *args):
        pass


def serve(app):
    server = wsgiref.simple_server.make_server("127.0.0.1", 0, app, server_class=_Server, handler_class=_Quiet)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()

    def close():
        server.shutdown()
        server.server_close()
    return "http://127.0.0.1:%d" % server.server_port, close


def serve_werkzeug(app):
    """Serves app with Werkzeug's threaded server, which ends chunked input (wsgi.input_terminated)."""
    import werkzeug.serving
    server = werkzeug.serving.make_server("127.0.0.1", 0, app, threaded=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()

    def close():
        server.shutdown()
        server.server_close()
    return "http://127.0.0.1:%d" % server.server_port, close


def start_flask(options, calls):
    options = dict(options)
    header = options.pop("principal_header", None)
    if header:
        key = "HTTP_" + header.upper().replace("-", "_")
        options["principal"] = lambda environ: environ.get(key, "")
    else:
        options["without_principal"] = True
    app = flask.Flask("conformance")
    app.logger.setLevel(logging.CRITICAL)

    @app.route("/items", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    @app.route("/orders", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def items():
        a = scaffold.action({k.lower(): v for k, v in flask.request.headers.items()}, calls)
        flask.request.get_data()
        scaffold.begin_action(a)
        if a.get("echo_lease"):
            return flask.Response(conformance.lease_body(), 200, content_type="application/json")
        resp = flask.Response(a.get("body", "").encode(), a.get("status") or 200)
        del resp.headers["Content-Type"]
        for k, v in a.get("headers", {}).items():
            resp.headers[k] = v
        return resp
    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, client=CLIENT, **options)
    return serve(app)


class WSGIConformanceTest(unittest.TestCase):
    def test_flask_passes_the_http_suite(self):
        self.assertGreater(conformance.run_http_conformance(self, "wsgi", CLIENT, start_flask), 0)


def echo_app(environ, start_response):
    """Answers 201 with the body it read (as a WSGI app reads it: Content-Length bytes)."""
    n = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(n) if n else b""
    start_response("201 Created", [("Content-Type", "application/octet-stream"), ("Content-Length", str(len(body)))])
    return [body]


def chunks(*parts):
    """A request body httpx sends chunked (no Content-Length)."""
    def gen():
        yield from parts
    return gen()


class WSGIBodyAndKeyTest(unittest.TestCase):
    def guarded(self, serve_with, app=echo_app, **options):
        base, close = serve_with(IdempotencyMiddleware(app, client=CLIENT, without_principal=True, **options))
        self.addCleanup(close)
        return base + "/pay"

    def test_a_chunked_body_reaches_the_app_whole_and_a_changed_one_is_refused(self):
        url = self.guarded(serve_werkzeug)
        key = {"Idempotency-Key": "chunked-" + uuid.uuid4().hex}
        first = httpx.post(url, content=chunks(b"amount=", b"10"), headers=key)
        self.assertEqual((first.status_code, first.content), (201, b"amount=10"), first.headers)
        self.assertEqual(first.headers.get("idempotency-result"), "created")
        replay = httpx.post(url, content=chunks(b"amount=10"), headers=key)
        self.assertEqual((replay.status_code, replay.content), (201, b"amount=10"))
        self.assertEqual(replay.headers.get("idempotency-result"), "replayed")
        changed = httpx.post(url, content=chunks(b"amount=", b"99"), headers=key)
        self.assertEqual(changed.status_code, 422, changed.content)
        self.assertEqual(changed.json()["type"], "urn:idemcoord:problem:idempotency-key-reused")

    def test_a_chunked_body_over_the_cap_answers_413(self):
        url = self.guarded(serve_werkzeug, max_body_bytes=10)
        resp = httpx.post(url, content=chunks(b"0123456", b"789a"), headers={"Idempotency-Key": uuid.uuid4().hex})
        self.assertEqual(resp.status_code, 413, resp.content)
        self.assertEqual(resp.json()["type"], "urn:idemcoord:problem:request-body-too-large")

    def test_a_chunked_body_the_server_does_not_end_answers_411(self):
        url = self.guarded(serve)  # wsgiref passes chunked framing through, without wsgi.input_terminated
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        # One write of the whole request: the server answers before reading
        # the body, and a body still unsent then would meet a closed socket.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n9\r\namount=10\r\n0\r\n\r\n" % uuid.uuid4().hex.encode())
            answer = b""
            while True:
                part = conn.recv(65536)
                if not part:
                    break
                answer += part
        self.assertTrue(answer.startswith(b"HTTP/1.0 411 ") or answer.startswith(b"HTTP/1.1 411 "), answer)

    def test_transfer_encoding_with_content_length_answers_400(self) -> None:
        runs: "list[bytes]" = []

        def app(environ: "dict[str, object]", start_response: "typing.Callable[..., object]") -> "list[bytes]":
            body: bytes = environ["wsgi.input"].read()  # type: ignore[attr-defined]
            runs.append(body)
            return echo_app(dict(environ, **{"wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body))}),
                            start_response)
        url = self.guarded(serve_werkzeug, app=app)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        key = uuid.uuid4().hex.encode()

        def send(framing: bytes, body: bytes) -> bytes:
            """The raw answer to one POST with key (httpx will not send both framings)."""
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                conn.sendall(b"POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\n%sConnection: close\r\n\r\n%s"
                             % (key, framing, body))
                answer = b""
                while True:
                    part = conn.recv(65536)
                    if not part:
                        return answer
                    answer += part
        chunked = b"a\r\n{\"amount\":\r\n11\r\n100,\"to\":\"alice\"}\r\n0\r\n\r\n"
        both = send(b"Transfer-Encoding: chunked\r\nContent-Length: 10\r\n", chunked)
        self.assertTrue(both.startswith(b"HTTP/1.1 400 ") or both.startswith(b"HTTP/1.0 400 "), both)
        self.assertIn(b"application/problem+json", both)
        self.assertIn(b"Transfer-Encoding", both.partition(b"\r\n\r\n")[2])
        reordered = send(b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n", chunked)
        self.assertTrue(reordered.startswith(b"HTTP/1.1 400 ") or reordered.startswith(b"HTTP/1.0 400 "), reordered)
        self.assertEqual(runs, [])
        # Nothing was recorded for the key: a well-framed request with it runs the app on its whole body.
        alone = send(b"Transfer-Encoding: chunked\r\n", chunked)
        self.assertTrue(alone.startswith(b"HTTP/1.1 201 ") or alone.startswith(b"HTTP/1.0 201 "), alone)
        self.assertIn(b"Idempotency-Result: created", alone)
        self.assertEqual(runs, [b"{\"amount\":100,\"to\":\"alice\"}"])

    def test_two_key_lines_answer_400(self):
        url = self.guarded(serve)
        resp = httpx.post(url, content=b"x", headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")])
        self.assertEqual(resp.status_code, 400, resp.content)
        self.assertEqual(resp.json()["type"], "urn:idemcoord:problem:idempotency-key-invalid")
        quoted = httpx.post(url, content=b"x", headers={"Idempotency-Key": '"a,b-%s"' % uuid.uuid4().hex})
        self.assertEqual(quoted.status_code, 201, quoted.content)  # a comma inside a structured-field string

    def test_an_exception_after_the_whole_answer_stores_it(self):
        class Closing:
            """An answer whose close() raises (as after-response work may)."""

            def __init__(self, environ, start_response):
                start_response("201 Created", [("Content-Type", "text/plain")])

            def __iter__(self):
                yield b"charged"

            def close(self):
                raise RuntimeError("after-response work failed")
        url = self.guarded(serve, app=Closing)
        key = {"Idempotency-Key": "closing-" + uuid.uuid4().hex}
        with self.assertLogs("idemcoord", "WARNING"):
            first = httpx.post(url, content=b"x", headers=key)
        self.assertEqual((first.status_code, first.content), (201, b"charged"))
        state = CLIENT.lookup(scope="POST /pay", key=key["Idempotency-Key"]).record.state
        self.assertEqual(idemcoord.State.Name(state), "STATE_COMPLETED")
        replay = httpx.post(url, content=b"x", headers=key)
        self.assertEqual((replay.status_code, replay.content, replay.headers.get("idempotency-result")),
                         (201, b"charged", "replayed"))


class WSGIKeyFromPayloadTest(unittest.TestCase):
    """key=: the key of a request sent without an Idempotency-Key header, from the request and its body."""

    def guarded(self, key, **options):
        runs = []

        def app(environ, start_response):
            runs.append(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
            return echo_app({**environ, "wsgi.input": io.BytesIO(runs[-1])}, start_response)
        options.setdefault("without_principal", True)
        base, close = serve(IdempotencyMiddleware(app, client=CLIENT, key=key, **options))
        self.addCleanup(close)
        return base + "/pay", runs

    def test_a_key_function_that_raises_answers_400_and_runs_nothing(self):
        def broken(environ, body):
            raise ValueError("no order id in %r" % body)
        url, runs = self.guarded(broken)
        resp = httpx.post(url, content=b"{}")
        self.assertEqual(resp.status_code, 400, resp.content)
        self.assertEqual(resp.json()["type"], "urn:idemcoord:problem:idempotency-key-invalid")
        self.assertIn("could not be taken from the request: no order id in b'{}'", resp.json()["detail"])
        self.assertNotIn("idempotency-key", resp.headers)
        self.assertEqual(runs, [])

    def test_a_found_key_is_checked_as_a_header_key(self):
        url, runs = self.guarded(lambda environ, body: body.decode())
        for bad, why in (("x" * 256, "is 256 bytes long"), ("a\x01b", "holds a control character")):
            resp = httpx.post(url, content=bad.encode())
            self.assertEqual(resp.status_code, 400, resp.content)
            self.assertEqual(resp.json()["type"], "urn:idemcoord:problem:idempotency-key-invalid")
            self.assertIn("the idempotency key taken from the request " + why, resp.json()["detail"])
        self.assertEqual(runs, [])

    def test_no_key_found_runs_unprotected_with_the_body_or_answers_400_when_required(self):
        url, runs = self.guarded(lambda environ, body: None)
        resp = httpx.post(url, content=b"amount=10")
        self.assertEqual((resp.status_code, resp.content), (201, b"amount=10"))
        self.assertNotIn("idempotency-result", resp.headers)
        url, runs = self.guarded(lambda environ, body: "", require_key=True)
        resp = httpx.post(url, content=b"amount=10")
        self.assertEqual(resp.status_code, 400, resp.content)
        self.assertEqual(resp.json()["type"], "urn:idemcoord:problem:idempotency-key-missing")
        self.assertEqual(runs, [])

    def test_a_found_key_is_echoed_and_folded_with_the_principal(self):
        k = "ordre-é-" + uuid.uuid4().hex
        url, runs = self.guarded(lambda environ, body: body.decode(), without_principal=False,
                                 principal=lambda environ: "u1")
        first = httpx.post(url, content=k.encode())
        self.assertEqual(first.status_code, 201, first.content)
        self.assertEqual(first.headers.raw[[n.lower() for n, _ in first.headers.raw].index(b"idempotency-key")][1],
                         k.encode())
        rec = CLIENT.lookup(scope="POST /pay", key=_http.fold_principal("u1", k)).record
        self.assertEqual(idemcoord.State.Name(rec.state), "STATE_COMPLETED")
        again = httpx.post(url, content=k.encode())
        self.assertEqual(again.headers.get("idempotency-result"), "replayed")
        self.assertEqual(runs, [k.encode()])


class WSGIOptionsTest(unittest.TestCase):
    def test_mismatch_status_other_than_409_or_422_is_refused(self):
        for status in (200, 400, 500, True):
            with self.assertRaisesRegex(ValueError, "409 or 422"):
                IdempotencyMiddleware(echo_app, client=CLIENT, without_principal=True, mismatch_status=status)
        IdempotencyMiddleware(echo_app, client=CLIENT, without_principal=True, mismatch_status=409)

    def test_warns_when_no_principal_is_decided(self):
        with self.assertWarns(idemcoord.UndecidedPrincipalWarning):
            IdempotencyMiddleware(echo_app, client=CLIENT, service="svc")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            IdempotencyMiddleware(echo_app, client=CLIENT, without_principal=True, service="svc")
            IdempotencyMiddleware(echo_app, client=CLIENT, principal=lambda environ: "u1", scope="http")

    def test_warns_when_the_service_is_not_named(self):
        with self.assertWarns(idemcoord.UnnamedServiceWarning):
            IdempotencyMiddleware(echo_app, client=CLIENT, without_principal=True)

    def test_operation_scope(self):
        self.assertEqual(_http.http_operation_scope("", "POST", "/orders"), "POST /orders")
        self.assertEqual(_http.http_operation_scope("payments", "POST", "/orders"), "payments POST /orders")
        self.assertEqual(_http.Options(service="payments").scope_of("POST", "/orders?page=2"), "payments POST /orders")
        self.assertEqual(_http.Options(scope="http").scope_of("POST", "/orders"), "http")
        long = _http.http_operation_scope("", "POST", "/" + "a" * 300)
        self.assertLessEqual(len(long.encode()), 255)
        self.assertTrue(long.startswith("POST /aaa"))
        self.assertTrue(long.endswith("a~Kp-qwHhV0wj3-SyZ0O5Xk4eZHUE1-0MDl5n_zy6niBg"), long)  # Go's vector
        self.assertNotEqual(long, _http.http_operation_scope("", "POST", "/" + "a" * 299 + "b"))
        self.assertLessEqual(len(_http.http_operation_scope("é" * 100, "POST", "/x").encode()), 255)


if __name__ == "__main__":
    unittest.main()
