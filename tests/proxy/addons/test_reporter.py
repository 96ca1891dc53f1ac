"""Reporter in process: exactly one event per flow, with what the guards remembered."""

from __future__ import annotations

from mitmproxy import flow as mflow
from mitmproxy.test import tutils

from egress.proxy.addons.policy_guard import PolicyGuard
from egress.proxy.addons.reporter import Reporter
from egress.proxy.flowstate import flow_state

from .helpers import context, events, make_engine, request_flow, run


def test_a_completed_request_is_one_allow_event_with_its_bytes():
    engine = make_engine()
    policy, reporter = PolicyGuard(engine), Reporter(engine)

    async def go():
        with context(policy, reporter):
            flow = request_flow("http://allowed.test/x", method="POST")
            flow.request.raw_content = b"12345"
            await policy.requestheaders(flow)
            reporter.requestheaders(flow)
            reporter.request(flow)
            flow.response = tutils.tresp(content=b"")
            reporter.responseheaders(flow)
            flow.response.stream(b"abc")
            flow.response.stream(b"")
            reporter.response(flow)
            reporter.response(flow)  # a second call must not make a second event
            return flow

    run(go)
    [event] = events(engine)
    assert (event["decision"], event["host"], event["bytes_sent"], event["bytes_received"]) == \
        ("allow", "allowed.test", 5, 3)
    assert event["rule"].startswith("allowed.test (")


def test_a_refused_flow_gets_no_second_event():
    engine = make_engine()
    policy, reporter = PolicyGuard(engine), Reporter(engine)

    async def go():
        with context(policy, reporter):
            flow = request_flow("http://blocked.test/")
            await policy.requestheaders(flow)
            reporter.response(flow)
            flow.error = mflow.Error("connection closed")
            reporter.error(flow)

    run(go)
    assert [e["reason"] for e in events(engine)] == ["not-allowed"]


def test_an_upstream_failure_is_one_error_event():
    engine = make_engine()
    reporter = Reporter(engine)

    async def go():
        with context(reporter):
            flow = request_flow("http://allowed.test/")
            flow_state(flow).upstream_error = "upstream-timeout"
            flow.error = mflow.Error("server closed connection")
            reporter.error(flow)
            reporter.error(flow)

    run(go)
    [event] = events(engine)
    assert (event["decision"], event["reason"]) == ("error", "upstream-timeout")
