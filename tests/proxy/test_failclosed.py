"""The guard wrapper and the one refusal function, on each kind of hook argument.

The addons here raise on purpose: what is under test is what happens then.
"""

from __future__ import annotations

import asyncio

from addons.helpers import events as events_of, make_engine, request_flow
from mitmproxy import options
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.test import tflow, tutils

from egress.policy.matcher import Decision
from egress.proxy.failclosed import CloseClient, guard
from egress.proxy.flowstate import flow_state
from egress.proxy.refusal import Refused, Stage, refuse


class Broken:
    def __init__(self, engine):
        self.engine = engine

    @guard
    def requestheaders(self, flow):
        raise KeyError("x")

    @guard
    async def responseheaders(self, flow):
        raise RuntimeError("y")

    @guard
    def client_connected(self, client):
        raise ValueError

    @guard
    def next_layer(self, nextlayer):
        raise ValueError

    @guard
    def server_connect(self, data):
        raise ValueError


def test_a_request_hook_that_raises_refuses_with_one_event():
    engine = make_engine()
    flow = request_flow("http://allowed.test/")
    Broken(engine).requestheaders(flow)
    assert flow.response.status_code == 403
    assert flow.response.headers["X-Egress-Blocked"] == "allowed.test; reason=guard-error"
    assert [e["detail"] for e in events_of(engine)] == ["Broken.requestheaders: KeyError"]
    Broken(engine).requestheaders(flow)  # raising again: still one event
    assert len(events_of(engine)) == 1


def test_a_response_hook_that_raises_kills_the_flow():
    engine = make_engine()
    flow = request_flow("http://allowed.test/")
    flow.response = tutils.tresp()
    asyncio.run(Broken(engine).responseheaders(flow))
    assert flow.error.msg == "Connection killed." and flow.response.status_code == 200
    assert [e["reason"] for e in events_of(engine)] == ["guard-error"]


def test_a_hook_that_raises_after_the_flow_was_reported_still_kills_it():
    engine = make_engine()
    flow = request_flow("http://allowed.test/")
    flow.response = tutils.tresp()
    flow_state(flow).reported = True  # say, its allow event was written
    asyncio.run(Broken(engine).responseheaders(flow))
    assert flow.error.msg == "Connection killed." and events_of(engine) == []


def test_connection_hooks_that_raise_refuse_the_connection():
    engine = make_engine()
    client = tflow.tclient_conn()
    client.error = None
    Broken(engine).client_connected(client)
    assert client.error == "EGRESS_BLOCKED: Broken.client_connected: ValueError"

    nextlayer = layer.NextLayer(Context(client, options.Options()))
    Broken(engine).next_layer(nextlayer)
    assert isinstance(nextlayer.layer, CloseClient)

    server = tflow.tserver_conn()
    server.error = None
    Broken(engine).server_connect(ServerConnectionHookData(server=server, client=client))
    assert server.error == "EGRESS_BLOCKED: Broken.server_connect: ValueError"


def test_refuse_is_one_event_per_flow_and_the_first_refusal_stands():
    engine = make_engine()
    flow = request_flow("http://allowed.test/")
    first = refuse(engine, flow, Decision("allowed.test", 80, False, "credential", detail="a"))
    second = refuse(engine, flow, Decision("allowed.test", 80, False, "misdirected"), Stage.RESPONSE)
    assert first is flow.response and second is None
    assert flow.response.headers["X-Egress-Blocked"] == "allowed.test; reason=credential"
    assert flow.error is None and flow_state(flow).refused and flow_state(flow).reported
    assert [e["reason"] for e in events_of(engine)] == ["credential"]


def test_refuse_redacts_through_the_recorder():
    engine = make_engine()
    engine.recorder.clean = lambda text: text.replace("sekret", "[redacted:x]")
    flow = request_flow("http://sekret.allowed.test/")
    refuse(engine, flow, Decision("sekret.allowed.test", 80, False, "credential", detail="sekret in the URL"))
    assert b"sekret" not in flow.response.content and "sekret" not in str(flow.response.headers)
    [event] = events_of(engine)
    assert "sekret" not in event["host"] + event["detail"]


def test_refusing_a_connection_without_a_flow_returns_the_answer_to_send():
    engine = make_engine()
    client = tflow.tclient_conn()
    response = refuse(engine, client, Decision("x.test", None, False, "protocol"), Stage.LAYER, status=400,
                      method="GET")
    assert response.status_code == 400 and response.headers["X-Egress-Blocked"] == "x.test; reason=protocol"
    [event] = events_of(engine)
    assert event["method"] == "GET" and event["port"] is None


class Refusing:
    def __init__(self, engine):
        self.engine = engine

    @guard
    async def requestheaders(self, flow):
        raise Refused(Decision("allowed.test", 80, False, "denied"))

    @guard
    def request(self, flow):  # hands mitmproxy work to await (a large body scanned in looks)
        async def scan():
            raise ValueError("the scan broke")
        return scan()

    @guard
    def next_layer(self, nextlayer):
        raise Refused(Decision("x.test", 22, False, "protocol"), Stage.CONNECTION)


def test_a_refusal_raised_in_a_hook_is_carried_out_at_its_stage():
    engine = make_engine()
    flow = request_flow("http://allowed.test/")
    asyncio.run(Refusing(engine).requestheaders(flow))
    assert flow.response.status_code == 403
    assert flow.response.headers["X-Egress-Blocked"] == "allowed.test; reason=denied"
    nextlayer = layer.NextLayer(Context(tflow.tclient_conn(), options.Options()))
    Refusing(engine).next_layer(nextlayer)
    assert nextlayer.layer is not None and list(nextlayer.layer.handle_event(events.Start()))
    assert [(e["method"], e["reason"]) for e in events_of(engine)] == [("GET", "denied"), ("TUNNEL", "protocol")]


def test_work_a_hook_hands_mitmproxy_to_await_fails_closed_too():
    # Before: the awaitable a sync hook returned was awaited by mitmproxy, whose "Addon error"
    # let the request through when it raised.
    engine = make_engine()
    flow = request_flow("http://allowed.test/")
    asyncio.run(Refusing(engine).request(flow))
    assert flow.response.headers["X-Egress-Blocked"] == "allowed.test; reason=guard-error"
    assert [e["detail"] for e in events_of(engine)] == ["Refusing.request: ValueError"]
