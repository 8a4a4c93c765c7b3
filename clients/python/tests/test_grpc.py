"""idemcoord.grpc.ServerInterceptor on a grpc.server runs the shared gRPC suite.

The guarded method is /idempotency.v1.Coordinator/Begin of a test server
(clients/testdata/grpc_conformance.json says why); the coordinator is a
real one (see coordinator.py).
"""

import asyncio
import concurrent.futures
import json
import time
import unittest

import grpc

import idemcoord
import idemcoord.aio
from idemcoord import _api
from idemcoord.grpc import ServerInterceptor

from . import scaffold
from .coordinator import fixture_options

SUITE = scaffold.load_suite("grpc_conformance.json")
METHOD = "/idempotency.v1.Coordinator/Begin"
BeginRequest, BeginResponse = _api.REQUESTS["Begin"], _api.RESPONSES["Begin"]

COORD = None
CLIENT = None
setUpModule, tearDownModule = scaffold.coordinator_module(globals(), SUITE["client_lease_ms"])


def begin_handler(calls):
    def begin(request, context):
        a = scaffold.action(dict(context.invocation_metadata()), calls)
        scaffold.begin_action(a)
        if a.get("until_cancelled"):
            deadline = time.monotonic() + 5
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(0.02)
            context.abort(grpc.StatusCode.CANCELLED, "cancelled")
        if a.get("code"):
            context.abort(getattr(grpc.StatusCode, a["code"]), a.get("message", ""))
        if a.get("echo_lease"):
            lease = idemcoord.current_lease()
            return BeginResponse(lease_token="%d %s" % (lease.attempt, idemcoord.State.Name(lease.previous)))
        return BeginResponse(lease_token=a.get("token", ""))
    return begin


def start_server(options, calls, interceptor_class=ServerInterceptor):
    interceptor = interceptor_class(CLIENT, pool=_api.POOL, wait=options.get("wait_ms", 0) / 1000,
                                    require_key=bool(options.get("require_key")), without_principal=True)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=32), interceptors=[interceptor])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("idempotency.v1.Coordinator", {
        "Begin": grpc.unary_unary_rpc_method_handler(begin_handler(calls), request_deserializer=BeginRequest.FromString,
                                                     response_serializer=BeginResponse.SerializeToString)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel("127.0.0.1:%d" % port)
    stub = channel.unary_unary(METHOD, request_serializer=BeginRequest.SerializeToString,
                               response_deserializer=BeginResponse.FromString)

    def close():
        channel.close()
        server.stop(None)
    return stub, close


def call(tc, stub, key, st):
    md = [("x-scenario", key), ("x-conformance", json.dumps(st.get("handler", {})))]
    md += [(k, v.replace("{key}", key)) for k, v in st.get("metadata", {}).items()]
    timeout = st["timeout_ms"] / 1000 if st.get("timeout_ms") else 30
    e = st["expect"]
    try:
        resp, c = stub.with_call(BeginRequest(scope=st["request_scope"], key="k"), metadata=md, timeout=timeout)
        code, details, header, trailer = "OK", "", c.initial_metadata() or (), c.trailing_metadata() or ()
    except grpc.RpcError as err:
        resp = None
        code, details = err.code().name, err.details()
        header, trailer = err.initial_metadata() or (), err.trailing_metadata() or ()
    result = dict(header).get("idempotency-result", dict(trailer).get("idempotency-result", ""))
    where = "got %s %r header %r trailer %r response %r" % (code, details, header, trailer, resp)
    tc.assertIn(code, e["code"].split("|"), where)
    if "message" in e:
        tc.assertEqual(details, e["message"], where)
    if "token" in e:
        tc.assertEqual(resp.lease_token if resp is not None else None, e["token"], where)
    if "result" in e:
        tc.assertEqual(result, e["result"], where)
    if e.get("pushback"):
        tc.assertIn("grpc-retry-pushback-ms", dict(trailer), where)
    return result


def run_grpc_conformance(tc, stack, start):
    return scaffold.run_suite(tc, stack, SUITE, start, run_scenario)


def run_scenario(tc, sc, stub, calls):
    scaffold.run_steps(tc, sc, CLIENT, METHOD, calls, lambda key, st: call(tc, stub, key, st),
                       checks_state=lambda st: "state" in st, counts_label="counts", hold_must_acquire=False)


def async_begin_handler(calls):
    async def begin(request, context):
        a = scaffold.action(dict(context.invocation_metadata()), calls)
        await scaffold.begin_action_async(a)
        if a.get("code"):
            await context.abort(getattr(grpc.StatusCode, a["code"]), a.get("message", ""))
        if a.get("echo_lease"):
            lease = idemcoord.current_lease()
            return BeginResponse(lease_token="%d %s" % (lease.attempt, idemcoord.State.Name(lease.previous)))
        return BeginResponse(lease_token=a.get("token", ""))
    return begin


def aio_starter(loop):
    """start(options, calls) for a grpc.aio server with idemcoord.aio.ServerInterceptor on loop (the main thread's)."""
    def start(options, calls):
        async def create():
            client = idemcoord.aio.Client(COORD.addr, **fixture_options(token=COORD.token, lease=SUITE["client_lease_ms"] / 1000))
            interceptor = idemcoord.aio.ServerInterceptor(client, pool=_api.POOL,
                                                          wait=options.get("wait_ms", 0) / 1000,
                                                          require_key=bool(options.get("require_key")), without_principal=True)
            server = grpc.aio.server(interceptors=[interceptor])
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("idempotency.v1.Coordinator", {
                "Begin": grpc.unary_unary_rpc_method_handler(async_begin_handler(calls),
                                                             request_deserializer=BeginRequest.FromString,
                                                             response_serializer=BeginResponse.SerializeToString)})])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return client, server, port

        async def stop(client, server):
            await server.stop(None)
            await client.shutdown(timeout=10)
        client, server, port = asyncio.run_coroutine_threadsafe(create(), loop).result(30)
        channel = grpc.insecure_channel("127.0.0.1:%d" % port)
        stub = channel.unary_unary(METHOD, request_serializer=BeginRequest.SerializeToString,
                                   response_deserializer=BeginResponse.FromString)

        def close():
            channel.close()
            asyncio.run_coroutine_threadsafe(stop(client, server), loop).result(30)
        return stub, close
    return start


class GRPCConformanceTest(unittest.TestCase):
    def test_aio_server_interceptor_passes_the_grpc_suite(self):
        # grpc.aio serves on the main thread's event loop; the suite's
        # blocking calls run on a worker thread.
        async def main():
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, run_grpc_conformance, self, "python-aio", aio_starter(loop))
        self.assertGreater(asyncio.run(main()), 0)

    def test_server_interceptor_passes_the_grpc_suite(self):
        self.assertGreater(run_grpc_conformance(self, "python", start_server), 0)


class InterceptorOptionsTest(unittest.TestCase):
    def test_warns_when_no_principal_is_decided(self):
        import warnings
        for cls in (ServerInterceptor, idemcoord.aio.ServerInterceptor):
            with self.assertWarns(idemcoord.UndecidedPrincipalWarning):
                cls(CLIENT, pool=_api.POOL)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                cls(CLIENT, pool=_api.POOL, without_principal=True)
                cls(CLIENT, pool=_api.POOL, principal=lambda context: "u1")


if __name__ == "__main__":
    unittest.main()
