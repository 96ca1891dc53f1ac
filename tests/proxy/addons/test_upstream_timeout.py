"""UpstreamTimeout in process: a timer per request handed upstream, cancelled by the response."""

from __future__ import annotations

from mitmproxy.test import tutils

from egress.proxy.addons.upstream_timeout import UpstreamTimeout

from .helpers import context, request_flow, run


def test_the_timer_runs_while_upstream_has_not_answered():
    addon = UpstreamTimeout(30)

    async def go():
        with context(addon):
            flow = request_flow("http://allowed.test/")
            addon.request(flow)
            started = set(addon._timers)
            flow.response = tutils.tresp()
            addon.responseheaders(flow)
            return flow, started

    flow, started = run(go)
    assert started == {flow.id} and addon._timers == {}


def test_a_failing_hook_kills_the_flow():
    # Outside an event loop the timer cannot start: the hook raises, and the flow must not go on.
    addon = UpstreamTimeout(30)
    flow = request_flow("http://allowed.test/")
    addon.request(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."
