"""ProtocolGuard in process, as mitmproxy drives it (mitmproxy.test.taddons/tflow): after an
HTTP 101 only a WebSocket may follow, and a refused upgrade is one event, not two.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from mitmproxy import http
from mitmproxy.addons import proxyserver
from mitmproxy.flow import Error
from mitmproxy.proxy import context
from mitmproxy.proxy.layers.http import HttpErrorHook, HttpResponseHeadersHook
from mitmproxy.proxy.layers.websocket import WebsocketLayer
from mitmproxy.test import taddons, tflow

from egress.observe.metrics import Metrics
from egress.policy.loader import policy_from_mapping
from egress.proxy.addons.reporter import Reporter
from egress.proxy.addons.tunnels import ProtocolGuard
from egress.proxy.engine import Engine
from egress.proxy.mitm import websocket_layer
from egress.proxy.resolver import Resolver

from .helpers import KeepingRecorder


def engine_and_events():
    engine = Engine(policy_from_mapping({"allow": ["example.test"]}), Resolver(), KeepingRecorder(Metrics()))
    return engine, engine.recorder.kept


def upgrade(request_headers: dict, response_headers: dict) -> http.HTTPFlow:
    flow = tflow.tflow(req=http.Request.make("GET", "https://example.test/ws", b"", request_headers))
    flow.response = http.Response.make(101, b"", response_headers)
    return flow


WS_REQUEST = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
              "Sec-WebSocket-Version": "13"}
WS_RESPONSE = {"Upgrade": "websocket", "Connection": "Upgrade"}


@pytest.mark.parametrize("request_headers,response_headers,detail", [
    ({"Upgrade": "foo", "Connection": "Upgrade"}, {"Upgrade": "foo"}, "upgrade to 'foo'"),
    # mitmproxy makes these raw TCP relays: never scanned
    ({**WS_REQUEST, "Sec-WebSocket-Version": ""}, WS_RESPONSE, "would relay as raw TCP"),
    ({k: v for k, v in WS_REQUEST.items() if k != "Sec-WebSocket-Version"}, WS_RESPONSE, "would relay as raw TCP"),
    ({**WS_REQUEST, "Sec-WebSocket-Version": "8"}, WS_RESPONSE, "would relay as raw TCP"),
    (WS_REQUEST, {"Upgrade": "h2c"}, "would relay as raw TCP"),
], ids=["other-protocol", "empty-version", "no-version", "old-version", "answered-another-protocol"])
def test_a_101_that_would_not_be_a_websocket_is_refused_once(request_headers, response_headers, detail):
    async def scenario():
        engine, events = engine_and_events()
        with taddons.context(ProtocolGuard(engine), Reporter(engine)) as tctx:
            flow = upgrade(request_headers, response_headers)
            await tctx.master.addons.handle_lifecycle(HttpResponseHeadersHook(flow))
            assert flow.error is not None and flow.error.msg == Error.KILLED_MESSAGE  # nothing relayed
            # mitmproxy then runs the error hook for the killed flow: no second event
            await tctx.master.addons.handle_lifecycle(HttpErrorHook(flow))
            assert [(e.decision, e.reason) for e in events] == [("block", "protocol")]
            assert detail in events[0].detail
    asyncio.run(scenario())


def test_a_real_websocket_upgrade_passes():
    async def scenario():
        engine, events = engine_and_events()
        with taddons.context(ProtocolGuard(engine)) as tctx:
            flow = upgrade(WS_REQUEST, WS_RESPONSE)
            await tctx.master.addons.handle_lifecycle(HttpResponseHeadersHook(flow))
            assert flow.error is None and events == []
    asyncio.run(scenario())


def test_websocket_layer_is_found_in_the_connection_layer_stack():
    flow = tflow.twebsocketflow()
    with taddons.context(server := proxyserver.Proxyserver()) as tctx:
        ws = WebsocketLayer(context.Context(flow.client_conn, tctx.options), flow)
        other = WebsocketLayer(context.Context(flow.client_conn, tctx.options), tflow.twebsocketflow())
        # as mitmproxy nests them: a NextLayer's .layer, a mode handing its events to a
        # child, an HTTP layer's streams, a stream's child_layer
        stream = SimpleNamespace(child_layer=ws)
        http_layer = SimpleNamespace(streams={1: SimpleNamespace(child_layer=other), 3: stream})
        root = SimpleNamespace(layer=SimpleNamespace(child_layer=http_layer))
        server.connections[flow.client_conn.id] = SimpleNamespace(layer=root)
        assert websocket_layer(flow) is ws
        del server.connections[flow.client_conn.id]
        assert websocket_layer(flow) is None
