"""Limits in process: the per-client cap, the strict HTTP/1 head (driven as mitmproxy's HttpLayer would)."""

from __future__ import annotations

import mmap

import pytest
from mitmproxy import options
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HttpLayer, HTTPMode
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import RequestHeaders
from mitmproxy.test import tflow

from egress.proxy.addons.limits import Limits, StrictHttp1Server

from .helpers import context, events as audit_events, make_engine, run


def test_connections_past_the_cap_are_refused_and_their_place_given_back():
    engine = make_engine()
    limits = Limits(engine)

    async def go():
        with context(limits) as tctx:
            tctx.configure(limits, egress_max_client_connections=2)
            clients = [tflow.tclient_conn() for _ in range(3)]
            for client in clients:
                client.error = None
                limits.client_connected(client)
            refused = [c.error for c in clients]
            limits.client_disconnected(clients[0])
            limits.client_disconnected(clients[2])  # the refused one: gives nothing back
            again = tflow.tclient_conn()
            again.error = None
            limits.client_connected(again)
            return refused, again.error, dict(limits.per_client)

    refused, again, per_client = run(go)
    assert refused[:2] == [None, None] and refused[2].startswith("more than 2 connections from")
    assert again is None and per_client == {"127.0.0.1": 2}
    assert engine.recorder.metrics.connections_limited.labels("client-connections")._value.get() == 1


def strict_server(engine, **limit_options):
    """A StrictHttp1Server put in place by Limits.next_layer, as for a real client connection."""
    limits = Limits(engine)
    client = tflow.tclient_conn()
    context_ = Context(client, options.Options())
    http_layer = HttpLayer(context_, HTTPMode.regular)
    nextlayer = layer.NextLayer(context_)
    nextlayer.layer = http_layer

    async def go():
        with context(limits) as tctx:
            if limit_options:
                tctx.configure(limits, **limit_options)
            limits.next_layer(nextlayer)
            return http_layer.connections[client]

    server = run(go)
    assert isinstance(server, StrictHttp1Server)
    list(server.handle_event(events.Start()))
    return server


def feed(server, data: bytes) -> list:
    return list(server.handle_event(events.DataReceived(server.conn, data)))


def answer(produced) -> bytes:
    return b"".join(c.data for c in produced if isinstance(c, commands.SendData))


def test_a_well_formed_head_goes_on_to_mitmproxy():
    engine = make_engine()
    server = strict_server(engine)
    produced = feed(server, b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    headers = [c.event for c in produced if isinstance(c, ReceiveHttp)][0]
    assert isinstance(headers, RequestHeaders) and headers.request.host == "allowed.test"
    assert audit_events(engine) == [] and engine.conn(server.context.client).waiting_since is None


@pytest.mark.parametrize(("line", "detail"), [
    (b"X-A: a\r\n b", "obs-fold (a header line starting with whitespace) in the request head"),
    (b"X-A: a\rb", "a bare CR in the request head"),
    (b"X-A: a\x00b", "a NUL byte in the request head"),
], ids=["obs-fold", "bare-cr", "nul"])
def test_an_odd_head_is_answered_400_with_one_event_and_closed(line, detail):
    engine = make_engine()
    server = strict_server(engine)
    produced = feed(server, b"GET http://allowed.test/ HTTP/1.1\r\n" + line + b"\r\n\r\n")
    assert answer(produced).startswith(b"HTTP/1.1 400")
    assert any(isinstance(c, commands.CloseConnection) for c in produced)
    assert not any(isinstance(c, ReceiveHttp) for c in produced)  # mitmproxy never sees it
    [event] = audit_events(engine)
    assert (event["reason"], event["host"], event["detail"]) == ("protocol", "allowed.test", detail)


def test_a_head_past_the_cap_is_answered_431_without_waiting_for_its_end():
    engine = make_engine()
    server = strict_server(engine, egress_max_head_bytes=2048)
    assert feed(server, b"GET http://allowed.test/ HTTP/1.1\r\nX-Pad: " + b"a" * 1900) == []
    produced = feed(server, b"a" * 200)
    assert answer(produced).startswith(b"HTTP/1.1 431")
    assert len(server.buf) == 0  # nothing more is kept
    assert [e["reason"] for e in audit_events(engine)] == ["protocol"]


def test_an_unparsable_request_line_is_egress_refusal_not_mitmproxys_bare_400():
    engine = make_engine()
    server = strict_server(engine)
    produced = feed(server, b"GET http://exa!mple.test/ HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"X-Egress-Blocked: exa!mple.test; reason=invalid-host" in answer(produced)
    [event] = audit_events(engine)
    assert event["method"] == "GET"


def test_every_upstream_response_is_read_by_the_strict_client():
    # mitmproxy makes its Http1Client by its module-level name (pinned in tests/proxy/test_mitm.py)
    from mitmproxy.proxy.layers import http as http_layers

    from egress.proxy.addons.limits import StrictHttp1Client

    Limits(make_engine())
    assert http_layers.Http1Client is StrictHttp1Client


def test_memory_that_still_lives_costs_one_collection_not_one_a_look():
    # The reclaim by size collects when the resident size has grown by half again (64 MiB at least);
    # what is still alive afterwards is the new floor, so live memory is not collected for again.
    from egress.proxy.reclaim import GROWTH, GROWTH_SHARE, Reclaimer, resident_bytes

    start = resident_bytes()
    if start is None:
        pytest.skip("no /proc/self/statm: the reclaim by size does not run here")
    reclaimer = Reclaimer()
    assert reclaimer.check() is False and reclaimer.floor == start  # the first look sets the floor
    # Pages of their own, touched: resident whatever freed memory this (long-lived) process's heap
    # holds (buffers from the heap reused it in an xdist worker, and the size did not grow).
    size = (int(max(GROWTH, start * GROWTH_SHARE)) // (1 << 20) + 16) << 20
    live = mmap.mmap(-1, size)
    for page in range(0, size, mmap.PAGESIZE):
        live[page] = 1
    assert reclaimer.check() is True  # grown past the bound: one collection (it frees nothing here)
    # the floor is what lives after that collection, the buffers included (the collection may have freed
    # other garbage of this process, so it is not measured against the start)
    assert reclaimer.floor >= size * 0.9
    assert abs(reclaimer.floor - resident_bytes()) < 16 << 20
    assert reclaimer.check() is False  # alive: not collected for again
    live.close()
