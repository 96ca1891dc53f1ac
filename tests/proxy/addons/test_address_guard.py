"""AddressGuard in process: resolve once, refuse special addresses, pin, dial the pinned address."""

from __future__ import annotations

import ipaddress

from mitmproxy.addons import proxyserver
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.test import tflow

from egress.proxy.addons.address_guard import AddressGuard
from egress.proxy.addons.policy_guard import PolicyGuard
from egress.proxy.flowstate import flow_state

from .helpers import context, events, make_engine, request_flow, run


def through_guards(url: str):
    engine = make_engine()
    policy, address = PolicyGuard(engine), AddressGuard(engine)

    async def go():
        with context(proxyserver.Proxyserver(), policy, address):
            flow = request_flow(url)
            await policy.requestheaders(flow)
            await address.requestheaders(flow)
            return flow

    return engine, address, run(go)


def test_allowed_private_name_is_pinned_for_the_connection():
    engine, _, flow = through_guards("http://allowed.test/")
    assert flow.response is None and events(engine) == []
    assert engine.conn(flow.client_conn).pins == {"allowed.test": ipaddress.ip_address("127.0.0.1")}


def test_private_address_is_one_refusal():
    engine, _, flow = through_guards("http://private.test/")
    assert flow.response.status_code == 403
    assert flow.response.headers["X-Egress-Blocked"] == "private.test; reason=private-address"
    [event] = events(engine)
    assert event["reason"] == "private-address"
    # the address, its class, and the policy line that would allow it
    assert event["detail"] == ('resolves to 10.1.2.3, private; to allow it, add "10.1.2.3" to the policy\'s '
                               'allow_private list: allow_private = ["10.1.2.3"]')
    assert flow.response.text.splitlines()[0] == f"EGRESS_BLOCKED private.test: {event['detail']}"
    assert flow_state(flow).refused and engine.conn(flow.client_conn).pins == {}


def test_a_name_resolving_to_siit_is_refused():
    # ::ffff:0:7f00:1 is 127.0.0.1 through SIIT: it was classed public and dialled.
    engine, _, flow = through_guards("http://siit.test/")
    assert flow.response.status_code == 403
    [event] = events(engine)
    assert event["detail"].startswith("resolves to ::ffff:0:7f00:1, IPv4-translated IPv6 (SIIT); to allow it")


def test_server_connect_dials_the_pinned_address_and_keeps_the_name_for_tls():
    engine, address, flow = through_guards("https://allowed.test/")

    async def go():
        with context(proxyserver.Proxyserver(), address):
            server = tflow.tserver_conn()
            server.address, server.sni, server.error = ("allowed.test", 443), None, None
            data = ServerConnectionHookData(server=server, client=flow.client_conn)
            await address.server_connect(data)
            return server

    server = run(go)
    assert server.error is None
    assert server.address == ("127.0.0.1", 443) and server.sni == "allowed.test"


def test_server_connect_that_fails_inside_fails_the_connection():
    # No proxy server addon: looking up this proxy's own ports raises; the connection must not open.
    engine, address, flow = through_guards("https://allowed.test/")

    async def go():
        with context(address):
            server = tflow.tserver_conn()
            server.address, server.error = ("allowed.test", 443), None
            await address.server_connect(ServerConnectionHookData(server=server, client=flow.client_conn))
            return server

    server = run(go)
    assert server.error == "EGRESS_BLOCKED: AddressGuard.server_connect: AttributeError"


def test_after_a_reload_a_request_in_a_tunnel_has_its_pinned_address_checked_again():
    # The tunnel's address was pinned at the CONNECT; mitmproxy reuses its server connection for
    # every request inside. Before: requests in a tunnel were never checked by the address guard,
    # so a reload that withdrew allow_private left the tunnel reaching 127.0.0.1. (serve's reload
    # also closes such a tunnel at once: egress.proxy.addons.tunnels; this is the request's own check.)
    from egress.policy.loader import policy_from_mapping

    from .helpers import POLICY, connect_flow

    engine = make_engine()
    policy, address = PolicyGuard(engine), AddressGuard(engine)

    async def go():
        with context(proxyserver.Proxyserver(), policy, address):
            connect = connect_flow("allowed.test")
            await policy.http_connect(connect)  # the CONNECT decision: its address pinned (egress.proxy.connect)
            assert connect.response is None
            inside = request_flow("https://allowed.test/", client_conn=connect.client_conn)
            await policy.requestheaders(inside)
            await address.requestheaders(inside)
            assert inside.response is None  # the same policy: the pin stands, nothing looked up
            engine.replace_policy(policy_from_mapping({**POLICY, "allow_private": []}))
            again = request_flow("https://allowed.test/", client_conn=connect.client_conn)
            await policy.requestheaders(again)
            await address.requestheaders(again)
            return again

    flow = run(go)
    assert flow.response.status_code == 403
    assert flow.response.headers["X-Egress-Blocked"] == "allowed.test; reason=private-address"
    assert flow.response.headers["Connection"] == "close"
    assert [e["reason"] for e in events(engine)] == ["private-address"]
    assert engine.conn(flow.client_conn).pins == {}


def test_a_dial_refused_at_server_connect_is_answered_with_the_refusal_not_an_upstream_error():
    # A connection no request pinned (should not happen) is checked at its dial: refused there
    # (Stage.SERVER_CONNECT), the flow that waited on it is refused with one event and answered
    # 403 by egress's HTTP/1 side. Before: server.error only, filed by UpstreamErrors as
    # connect-failed, a 502 EGRESS_UPSTREAM_ERROR.
    from types import SimpleNamespace

    from mitmproxy.proxy.layers.http._events import ResponseProtocolError

    from egress.proxy.addons.reporter import Reporter
    from egress.proxy.addons.upstream_errors import UpstreamErrors

    from .test_limits import answer, strict_server

    engine = make_engine()
    address, errors, reporter = AddressGuard(engine), UpstreamErrors(engine), Reporter(engine)
    flow = request_flow("http://private.test/")  # allowed, resolves to 10.1.2.3: not allow_private
    server = tflow.tserver_conn()
    server.address, server.error = ("private.test", 80), None

    async def go():
        with context(proxyserver.Proxyserver(), address, errors, reporter):
            data = ServerConnectionHookData(server=server, client=flow.client_conn)
            await address.server_connect(data)
            errors.server_connect_error(data)
            flow.error = tflow.terr(f"Connection killed: {server.error}")
            errors.error(flow)
            reporter.error(flow)

    run(go)
    assert server.error.startswith("EGRESS_BLOCKED private.test: resolves to 10.1.2.3, private;")
    assert engine.conn(flow.client_conn).open_failure is None  # not an upstream failure
    assert flow_state(flow).refused_dial and flow_state(flow).upstream_error is None
    [event] = events(engine)
    assert (event["method"], event["host"], event["decision"], event["reason"]) == (
        "GET", "private.test", "block", "private-address")
    # egress's HTTP/1 side answers the flow's connection error with the refusal
    http1 = strict_server(engine)
    http1.http_layer.streams[1] = SimpleNamespace(flow=flow)
    sent = answer(list(http1.send(ResponseProtocolError(1, f"Connection killed: {server.error}", 502))))
    assert sent.startswith(b"HTTP/1.1 403") and b"X-Egress-Blocked: private.test; reason=private-address" in sent
    assert b"EGRESS_UPSTREAM_ERROR" not in sent
