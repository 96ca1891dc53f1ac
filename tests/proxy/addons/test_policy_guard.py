"""PolicyGuard in process: decisions, misdirection, mitmproxy's own refusals, one event each."""

from __future__ import annotations

import pytest
from mitmproxy import flow as mflow
from mitmproxy.addons import proxyserver

from egress.proxy.addons.policy_guard import PolicyGuard
from egress.proxy.flowstate import flow_state

from .helpers import connect_flow, context, events, make_engine, request_flow, run


def check(flow_factory, hook: str = "requestheaders"):
    engine = make_engine()
    guard = PolicyGuard(engine)

    async def go():
        with context(proxyserver.Proxyserver(), guard):  # a CONNECT's address must not be the proxy's own
            flow = flow_factory(engine)
            await getattr(guard, hook)(flow)
            return flow

    return engine, run(go)


def test_allowed_plain_request_is_remembered_not_answered():
    engine, flow = check(lambda e: request_flow("http://Allowed.Test./x"))
    state = flow_state(flow)
    assert flow.response is None and not state.refused and not state.reported
    assert state.host.name == "allowed.test" and str(state.rule).startswith("allowed.test (")
    assert events(engine) == []


@pytest.mark.parametrize(("url", "reason"), [
    ("http://blocked.test/", "not-allowed"),
    ("http://denied.allowed.test/", "denied"),
], ids=["not-allowed", "denied"])
def test_refusal_is_one_event_and_the_403(url, reason):
    engine, flow = check(lambda e: request_flow(url))
    assert flow.response.status_code == 403
    assert flow.response.headers["X-Egress-Blocked"].endswith(f"reason={reason}")
    assert flow_state(flow).refused
    assert [e["reason"] for e in events(engine)] == [reason]


def test_connect_opens_a_tunnel_on_the_connection():
    engine, flow = check(lambda e: connect_flow("allowed.test", 8443), hook="http_connect")
    assert flow.response is None
    host, port = engine.conn(flow.client_conn).tunnel
    assert (host.name, port) == ("allowed.test", 8443)


def tunnelled(url: str, host_header: str | None = "allowed.test", sni: str | None = "allowed.test"):
    def make(engine):
        flow = request_flow(url, headers={"Host": host_header} if host_header else {})
        flow.client_conn.sni = sni
        engine.conn(flow.client_conn).tunnel = (make.host, 443)
        return flow
    from egress.core.hosts import parse_host

    make.host = parse_host("allowed.test")
    return make


@pytest.mark.parametrize(("url", "host_header", "sni", "names"), [
    ("https://evil.test/", "allowed.test", "allowed.test", "request target"),  # absolute form (issue 9)
    ("https://allowed.test/", "evil.test", "allowed.test", "Host header"),
    ("https://allowed.test/", "allowed.test", "evil.test", "TLS SNI"),
    ("https://allowed.test/", "allowed.test:" + "1" * 5000, "allowed.test", "Host header"),  # crashed before
], ids=["absolute-form", "host", "sni", "5000-digit-port"])
def test_inside_a_tunnel_everything_must_name_the_tunnel_host(url, host_header, sni, names):
    engine, flow = check(tunnelled(url, host_header, sni))
    assert flow.response.status_code == 403
    assert flow.response.headers["X-Egress-Blocked"] == "allowed.test; reason=misdirected"
    [event] = events(engine)
    assert event["reason"] == "misdirected" and event["detail"].startswith(names)


def test_origin_form_inside_a_tunnel_passes():
    def make(engine):
        flow = tunnelled("https://allowed.test/")(engine)
        flow.request.authority = ""  # origin form: no target authority
        return flow
    engine, flow = check(make)
    assert flow.response is None and events(engine) == []


def test_a_request_mitmproxy_refused_itself_is_reported_once():
    def make(engine):
        flow = request_flow("http://allowed.test/")
        flow.error = mflow.Error("Received message with both transfer-encoding and content-length headers "
                                 "from client, refusing to prevent request smuggling attacks.")
        return flow
    engine, flow = check(make)
    [event] = events(engine)
    assert event["reason"] == "protocol" and "transfer-encoding" in event["detail"]
    assert flow_state(flow).refused and flow_state(flow).reported


def test_a_guard_that_raises_refuses_instead_of_passing(monkeypatch):
    engine = make_engine()
    guard = PolicyGuard(engine)

    def broken(*args):
        raise ValueError("boom")

    monkeypatch.setattr(engine.policy, "decide", broken)  # the policy, not the guard under test, breaks

    async def go():
        with context(guard):
            flow = request_flow("http://allowed.test/")
            await guard.requestheaders(flow)
            return flow

    flow = run(go)
    assert flow.response.status_code == 403
    assert flow.response.headers["X-Egress-Blocked"] == "allowed.test; reason=guard-error"
    [event] = events(engine)
    assert event["reason"] == "guard-error" and event["detail"] == "PolicyGuard.requestheaders: ValueError"


def test_ip_literals_and_localhost_names_are_never_offered_for_a_grant():
    # Loopback by definition (RFC 6761) like an IP literal: asking would offer what the address
    # guard refuses anyway. NeverAsk says its notice the first time it is asked anything.
    from egress.host.control import RunState
    from egress.run.ask import NeverAsk

    said: list[str] = []
    engine = make_engine()
    engine.asker = NeverAsk(RunState("t", ["cmd"]), say=said.append)
    guard = PolicyGuard(engine)

    async def go(url):
        with context(guard):
            flow = request_flow(url)
            await guard.requestheaders(flow)
            return flow

    for url in ("http://localhost/", "http://api.localhost/", "http://127.0.0.1/", "http://[::1]/"):
        assert run(lambda url=url: go(url)).response.status_code == 403
    assert said == []
    assert run(lambda: go("http://blocked.test/")).response.status_code == 403
    assert len(said) == 1  # a name: asked (and, headless, kept blocked)
