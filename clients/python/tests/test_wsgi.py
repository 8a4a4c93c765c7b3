"""Flask behind idemcoord.wsgi.IdempotencyMiddleware runs the shared HTTP suite.

The app is served by a threading wsgiref server on 127.0.0.1 and reached
over real HTTP; the coordinator is a real one (see coordinator.py).
"""

import logging
import os
import socketserver
import threading
import unittest
import wsgiref.simple_server

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


def start_flask(options, calls):
    options = dict(options)
    header = options.pop("principal_header", None)
    if header:
        key = "HTTP_" + header.upper().replace("-", "_")
        options["principal"] = lambda environ: environ.get(key, "")
    app = flask.Flask("conformance")
    app.logger.setLevel(logging.CRITICAL)

    @app.route("/items", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
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


if __name__ == "__main__":
    unittest.main()
