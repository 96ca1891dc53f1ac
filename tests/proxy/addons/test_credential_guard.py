"""The credential guard in process, as mitmproxy drives it: real flows (mitmproxy.test.tflow),
the real addon manager (mitmproxy.test.taddons), a real WebSocket layer fed real frames.

The end-to-end tests (tests/scan/test_credentials.py) prove the same through a real proxy;
these pin each seam: one event recorded, the flow refused, the client closed, nothing
relayed that was not scanned. Every token is made up.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import random
import string
import urllib.parse
import zlib
from types import SimpleNamespace

import brotli
import pytest
import wsproto
import wsproto.events as ws_events
import zstandard
from mitmproxy import http
from mitmproxy.addons import proxyserver
from mitmproxy.flow import Error
from mitmproxy.proxy import commands, context, events
from mitmproxy.proxy.layers.http import (
    HttpRequestHeadersHook,
    HttpRequestHook,
    HttpResponseHeadersHook,
    HttpResponseHook,
)
from mitmproxy.proxy.layers.websocket import WebsocketLayer
from mitmproxy.test import taddons, tflow
from mitmproxy.websocket import WebSocketData
from test_body_forms import brotli_with_metadata, gzip_with, zstd_with_skippable

from egress.core.hosts import parse_host
from egress.observe.metrics import Metrics
from egress.policy.loader import policy_from_mapping
from egress.proxy.addons import credential_guard
from egress.proxy.addons.credential_guard import CredentialGuard
from egress.proxy.engine import Engine
from egress.proxy.flowstate import flow_state
from egress.proxy.resolver import Resolver
from egress.scan.credentials import Credentials, StoredSecret

from .helpers import KeepingRecorder

R = random.Random(20261203)
B62 = string.ascii_letters + string.digits


def fake(prefix: str, n: int, alphabet: str = B62) -> str:
    return prefix + "".join(R.choice(alphabet) for _ in range(n))


GITHUB = fake("ghp_", 36)
STORED = fake("", 32)
REAL = fake("ghp_", 36)  # a brokered secret bound to bound.test ...
PLACEHOLDER = fake("ghp_", 36)  # ... and what the command holds instead


def run(coro):
    return asyncio.run(coro)


class Setup:
    """A guard on an engine whose events are kept, inside a taddons context."""

    def __init__(self, action: str = "block", **budget):
        self.engine = Engine(policy_from_mapping({"allow": ["example.test", "bound.test"]}), Resolver(),
                             KeepingRecorder(Metrics()))
        self.events = self.engine.recorder.kept
        secrets = [StoredSecret("MY_SERVICE_TOKEN", STORED),
                   StoredSecret("GITHUB_TOKEN", REAL, hosts=("bound.test",), placeholder=PLACEHOLDER)]
        self.guard = CredentialGuard(self.engine, Credentials(action, secrets), **budget)
        self.proxyserver = proxyserver.Proxyserver()
        self.tctx = taddons.context(self.proxyserver, self.guard)

    async def hook(self, hook_class, flow):
        await self.tctx.master.addons.handle_lifecycle(hook_class(flow))

    def blocks(self):
        return [(e.method, e.reason, e.detail) for e in self.events if e.decision == "block"]


def request(method="GET", url="https://example.test/", body=b"", headers=()) -> http.HTTPFlow:
    """A flow with ``body`` as sent (already in its Content-Encoding)."""
    req = http.Request.make(method, url)
    req.headers = http.Headers(list(headers))  # as written: make() drops a coding it cannot apply
    if body:
        req.raw_content = body
        req.headers["Content-Length"] = str(len(body))
    return tflow.tflow(req=req)


def response(body_headers: dict) -> http.Response:
    resp = http.Response.make(200)
    for name, value in body_headers.items():
        resp.headers[name] = value
    return resp


def assert_refused(setup: Setup, flow, detail: str):
    assert flow.response is not None and flow.response.status_code == 403
    assert "reason=credential" in flow.response.headers["X-Egress-Blocked"]
    assert flow_state(flow).refused is True
    assert len(setup.events) == 1 and setup.blocks()[0][1] == "credential"
    assert detail in setup.blocks()[0][2], setup.blocks()
    for secret in (GITHUB, STORED, REAL):
        assert secret not in flow.response.text and secret not in setup.events[0].detail


# ------------------------------------------------------------ the request head


@pytest.mark.parametrize("method,headers,where", [
    (GITHUB, [], "github-token in the method"),  # curl -X "$TOKEN"
    ("GET", [(GITHUB.encode(), b"1")], "github-token in a header name"),  # curl -H "$TOKEN: 1"
    ("GET", [(STORED.upper().encode(), b"1")], "MY_SERVICE_TOKEN in a header name"),
    ("GET", [(b"X-Key", STORED.upper().encode())], "MY_SERVICE_TOKEN in the X-Key header"),  # any case
    ("GET", [(b"X-Key", f"v={STORED.swapcase()}".encode())], "MY_SERVICE_TOKEN in the X-Key header"),
], ids=["method", "header-name", "stored-in-a-name", "upper-cased-value", "swapcased-value"])
def test_the_method_header_names_and_values_are_scanned(method, headers, where):
    async def scenario():
        setup = Setup()
        flow = request(method, headers=headers)
        await setup.hook(HttpRequestHeadersHook, flow)
        assert_refused(setup, flow, where)
    run(scenario())


def test_a_name_or_method_cannot_be_masked():
    async def scenario():
        setup = Setup(action="mask")
        flow = request(headers=[(GITHUB.encode(), b"1"), (b"X-Key", GITHUB.encode())])
        await setup.hook(HttpRequestHeadersHook, flow)
        assert_refused(setup, flow, "in a header name")
    run(scenario())


# ------------------------------------------------------------ buffered bodies


def _deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


CODINGS = [("", lambda b: b), ("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", _deflate_raw),
           ("br", brotli.compress), ("zstd", zstandard.ZstdCompressor().compress),
           ("gzip, br", lambda b: brotli.compress(gzip.compress(b)))]


@pytest.mark.parametrize("encoding,code", CODINGS, ids=[f"{e or 'identity'}-{i}" for i, (e, _) in enumerate(CODINGS)])
@pytest.mark.parametrize("size", [200, 300_000], ids=["one-slice", "many-slices"])
def test_a_buffered_body_is_scanned_decoded(encoding, code, size):
    async def scenario():
        setup = Setup()
        body = b'{"pad": "' + fake("", size, string.ascii_lowercase).encode() + b'", "t": "' + GITHUB.encode() + b'"}'
        flow = request("POST", body=code(body), headers=[(b"Content-Encoding", encoding.encode())] if encoding else [])
        await setup.hook(HttpRequestHook, flow)
        assert_refused(setup, flow, "github-token in the body")
    run(scenario())


def test_an_unknown_coding_is_refused_before_a_streamed_body_starts():
    async def scenario():
        setup = Setup()
        flow = request("POST", headers=[(b"Content-Encoding", b"x-mystery"), (b"Content-Length", b"5000000")])
        flow.request.stream = True  # what mitmproxy sets for a body over stream_large_bodies
        await setup.hook(HttpRequestHeadersHook, flow)
        assert_refused(setup, flow, "content-encoding 'x-mystery' is unknown")
    run(scenario())


def test_mask_mode_masks_a_buffered_body_in_place():
    async def scenario():
        setup = Setup(action="mask")
        flow = request("POST", body=gzip.compress(f"a {GITHUB} b".encode()), headers=[(b"Content-Encoding", b"gzip")])
        await setup.hook(HttpRequestHook, flow)
        assert flow.response is None and flow.request.content == b"a [redacted:github-token] b"
        assert flow_state(flow).masked == "github-token in the body"
    run(scenario())


# ------------------------------------------------ forms of a body a receiver reads too


# The token in the coding's own fields, which decoders skip: the body decodes to x=1 (or nothing).
AS_SENT = [("gzip", gzip_with(comment=f"c {GITHUB}".encode())),
           ("gzip", gzip_with(name=b"f.txt", extra=f"e {GITHUB} ".encode())),
           ("zstd", zstd_with_skippable(f"s {GITHUB}".encode())),
           ("br", brotli_with_metadata(f"m {GITHUB}".encode()))]
AS_SENT_IDS = ["gzip-comment", "gzip-extra", "zstd-skippable-frame", "brotli-metadata"]


@pytest.mark.parametrize("encoding,body", AS_SENT, ids=AS_SENT_IDS)
@pytest.mark.parametrize("action", ["block", "mask"])
def test_a_coded_body_is_read_as_sent_too(encoding, body, action):
    async def scenario():
        setup = Setup(action=action)  # a token there cannot be masked: refused either way
        flow = request("POST", body=body, headers=[(b"Content-Encoding", encoding.encode())])
        await setup.hook(HttpRequestHook, flow)
        assert_refused(setup, flow, "github-token in the body (in its coded bytes as sent)")
    run(scenario())
    setup = Setup()
    flow = streaming_flow(setup, [(b"Content-Encoding", encoding.encode())])
    relayed = stream(flow, [body[k:k + 5] for k in range(0, len(body), 5)])
    assert setup.blocks() == [("POST", "credential", "github-token in the body (in its coded bytes as sent)")]
    assert GITHUB[:8].encode() not in relayed


def test_a_placeholder_swapped_into_the_body_may_be_in_its_stored_deflate_block():
    # A stored (level 0) block carries the text as it is: the placeholder is there as sent
    # too; the body is coded again from what was swapped, so those bytes never leave.
    setup = Setup()
    secret = setup.guard.secrets[1]
    secret.swap = ("header", "body")
    body = gzip.compress(f"t={PLACEHOLDER}".encode(), compresslevel=0)
    assert PLACEHOLDER.encode() in body
    flow = bound_flow(setup, [(b"Content-Encoding", b"gzip")], method="POST", body=body)
    assert flow.response is None and setup.events == []
    assert flow.request.content == f"t={REAL}".encode() and PLACEHOLDER.encode() not in flow.request.raw_content


WIDE = [
    ("utf-16", ""),  # a byte-order mark
    ("utf-16-le", ""),  # no mark, no label: its NULs
    ("utf-16-be", "application/json; charset=UTF-16"),  # labelled, no mark: the NULs tell the order
    ("utf-32", ""),
    ("utf-32-be", ""),
]


@pytest.mark.parametrize("codec,content_type", WIDE, ids=[c + ("-labelled" if t else "") for c, t in WIDE])
def test_a_utf16_or_utf32_body_is_read_transcoded(codec, content_type):
    text = f'{{"note": "{"ü" * 300}", "token": "{GITHUB}"}}'.encode(codec)
    headers = [(b"Content-Type", content_type.encode())] if content_type else []
    order = "BE" if codec.endswith("be") else "LE"
    where = f"github-token in the body (read as {codec[:6].upper()}{order})"

    async def scenario():
        setup = Setup()
        flow = request("POST", body=text, headers=headers)
        await setup.hook(HttpRequestHook, flow)
        assert_refused(setup, flow, where)
    run(scenario())
    setup = Setup()
    flow = streaming_flow(setup, headers)
    relayed = stream(flow, [text[k:k + 7] for k in range(0, len(text), 7)])  # odd: code units split
    assert setup.blocks() == [("POST", "credential", where)]
    assert GITHUB[:8].encode(codec[:6] + "-" + order.lower()) not in relayed


def test_a_declared_wide_body_is_read_whatever_comes_first():
    # No mark, and Chinese first (no NULs to tell): the label says UTF-16, both orders are read.
    for codec in ("utf-16-le", "utf-16-be"):
        body = ("数据" * 400 + f" {GITHUB}").encode(codec)
        setup = Setup()
        flow = request("POST", body=body, headers=[(b"Content-Type", b"text/plain; charset=utf-16")])
        run(setup.hook(HttpRequestHook, flow))
        assert_refused(setup, flow, f"github-token in the body (read as UTF-16{codec[-2:].upper()})")


def test_an_xml_body_declaring_utf16_is_read_transcoded():
    body = f'<?xml version="1.0" encoding="UTF-16"?>\n<config><key>{STORED}</key></config>'.encode("utf-16-be")
    setup = Setup()
    flow = request("POST", body=gzip.compress(body), headers=[(b"Content-Encoding", b"gzip"),
                                                               (b"Content-Type", b"application/xml")])
    run(setup.hook(HttpRequestHook, flow))
    assert_refused(setup, flow, "MY_SERVICE_TOKEN in the body (read as UTF-16BE)")


@pytest.mark.parametrize("body", [
    "plain ASCII, no NULs at all. " * 100,
    "ü and 数据, clean text in UTF-16 " * 100,
], ids=["ascii", "utf-16"])
def test_clean_text_and_binary_pass_whole(body):
    for data in (body.encode("utf-16") if "UTF-16" in body else body.encode(), R.randbytes(50_000),
                 bytes(range(256)) * 200, b"\0\0\0\x05" * 5000):
        setup = Setup()
        flow = streaming_flow(setup)
        assert stream(flow, [data[k:k + 1001] for k in range(0, len(data), 1001)]) == data
        assert setup.events == []


def test_a_websocket_binary_message_in_utf16_is_read_transcoded():
    rig = WebSocketRig(Setup())
    rig.client_sends(ws_events.BytesMessage(f"token {GITHUB}".encode("utf-16")))
    assert_closed_for_a_credential(rig, "github-token in a WebSocket message (read as UTF-16LE)")


# ------------------------------------------------------------ streamed bodies


def relay(function, chunks) -> bytes:
    """Drive a stream function as mitmproxy does (each chunk, then b"" at the end) and
    return what it would send on. An empty chunk sent on a chunked body ends that body
    ("0\r\n\r\n"): the function must never produce one."""
    sent = []
    for chunk in [*chunks, b""]:
        out = function(chunk)
        out = [out] if isinstance(out, bytes) and (chunk or out) else out
        assert all(out), f"an empty chunk would end a chunked body early: {out!r}"
        sent += out
    return b"".join(sent)


def stream(flow, chunks) -> bytes:
    return relay(flow.request.stream, chunks)


def streaming_flow(setup: Setup, headers=()):
    flow = request("POST", headers=[(b"Content-Length", b"3000000"), *headers])
    flow.request.stream = True
    run(setup.hook(HttpRequestHeadersHook, flow))
    assert callable(flow.request.stream)
    return flow


def test_a_streamed_base64_token_never_leaves_whatever_the_split():
    # The old hand-written window missed 94 of 160 splits of a base64 token.
    head = b'{"file": "'
    body = head + base64.b64encode(R.randbytes(30000) + f" token={GITHUB} ".encode() + R.randbytes(30000)) + b'"}'
    at = len(head) + 30000 * 4 // 3  # where the base64 of " token=ghp_..." starts
    for split in range(at - 40, at + 120):  # 160 splits, through the token's 54 characters
        setup = Setup()
        flow = streaming_flow(setup)
        relayed = stream(flow, [body[:split], body[split:]])[len(head):]
        assert GITHUB[:6].encode() not in base64.b64decode(relayed[:len(relayed) // 4 * 4]), split
        assert setup.blocks() == [("POST", "credential", "github-token in the body")]
        assert flow_state(flow).refused is True


@pytest.mark.parametrize("encoding,code", CODINGS[1:], ids=[e for e, _ in CODINGS[1:]])
def test_a_streamed_coded_body_is_decoded_and_held_back(encoding, code):
    body = fake("", 200_000, string.ascii_lowercase + " ").encode() + f" {GITHUB} ".encode() + b"z" * 1000
    coded = code(body)
    setup = Setup()
    flow = streaming_flow(setup, [(b"Content-Encoding", encoding.encode())])
    relayed = stream(flow, [coded[k:k + 1000] for k in range(0, len(coded), 1000)])
    assert setup.blocks() == [("POST", "credential", "github-token in the body")]
    # what was relayed, decoded as far as it goes, holds no byte of the token
    shown = b"".join(credential_guard.ContentDecoder(encoding).feed(relayed)) if relayed else b""
    assert b"ghp_" not in shown and len(relayed) < len(coded)


def test_one_byte_chunks_are_scanned_linearly_and_pass():
    # 34 KB of one-byte chunks cost two minutes of CPU; now they pass within the budget.
    body = fake("", 34_000, string.ascii_lowercase + " ").encode()
    setup = Setup()
    flow = streaming_flow(setup)
    assert stream(flow, [body[k:k + 1] for k in range(len(body))]) == body
    assert setup.events == [] and not flow_state(flow).refused


@pytest.mark.parametrize("sizes", [(65536,), (16384,), (1, 70000, 3), (300_000,), (262144, 16384, 7)],
                         ids=lambda s: "+".join(map(str, s)))
def test_a_streamed_clean_body_is_relayed_byte_for_byte_whatever_the_chunks(sizes):
    # The relay keeps the chunks it holds as they came and cuts them where the scanner
    # has settled: every byte goes out once, in order, never before it is settled.
    body = fake("", 900_000, string.ascii_lowercase + " /\n").encode()  # clean: no run, no escape
    chunks, k = [], 0
    while k < len(body):
        n = sizes[len(chunks) % len(sizes)]
        chunks.append(body[k:k + n])
        k += n
    setup = Setup()
    flow = streaming_flow(setup)
    function, sent = flow.request.stream, []
    for chunk in chunks:
        out = function(chunk)
        out = [out] if isinstance(out, bytes) else out
        assert all(out)
        sent += out
        assert len(b"".join(sent)) <= getattr(function, "inner", function).scan.releasable
    assert b"".join(sent) + relay(function, []) == body
    assert setup.events == [] and not flow_state(flow).refused


# ------------------------------------------------------------ the time budget


NEAR_MISS = b" ".join([b"ghp_short", b"sk-ant-api03-x", b"AKIAlower", b"eyJnotajwt", b"xoxb-1", b"glpat-",
                       b"-----BEGIN RSA PRIVATE KEY-----", b"://user:@h", b"Basic Zm9v", b"AIza"] * 20) + b"\n"


def test_a_body_over_its_scanning_budget_is_refused_with_a_clear_reason():
    async def scenario():
        setup = Setup(burst=0.0, per_byte=0.0)  # no time at all: the first slice is over it
        flow = request("POST", body=gzip.compress(NEAR_MISS * 2000), headers=[(b"Content-Encoding", b"gzip")])
        await setup.hook(HttpRequestHook, flow)
        assert_refused(setup, flow, "a body that could not be scanned in time")
    run(scenario())


def test_a_streamed_body_over_its_budget_is_cut_off():
    setup = Setup(burst=0.0, per_byte=0.0)
    flow = streaming_flow(setup)
    assert stream(flow, [NEAR_MISS * 100] * 3) == b""
    assert len(setup.events) == 1 and "the body could not be scanned in time" in setup.blocks()[0][2]


def test_other_clients_are_served_while_a_large_body_is_scanned():
    async def scenario():
        setup = Setup(burst=600.0)  # time enough to scan it all on any machine
        flow = request("POST", body=gzip.compress(NEAR_MISS * 3000), headers=[(b"Content-Encoding", b"gzip")])
        scan = asyncio.ensure_future(setup.hook(HttpRequestHook, flow))
        served_meanwhile = 0
        while not scan.done():  # another client's work: it gets the loop between slices
            served_meanwhile += 1
            await asyncio.sleep(0)
        await scan
        assert served_meanwhile > 10
        assert flow.response is None and setup.events == []  # scanned to the end, nothing found
    run(scenario())


def test_a_streamed_body_slow_to_scan_is_scanned_between_reads():
    # mitmproxy calls the stream function synchronously, every other client waiting: a call
    # scanned all its chunk (up to 0.25 s). Now it stops after STREAM_CALL and leaves the rest
    # to a task that gives the loop back after each look; the body still goes out whole.
    setup = Setup(burst=600.0)  # time enough to scan it all on any machine
    flow = streaming_flow(setup)
    relay = flow.request.stream
    body = b"sk-" * 70_000  # the slowest text known to scan: ~0.6 us a byte, ~40 ms a 64 KiB read

    async def scenario():
        sent, deferred, served_meanwhile = [], 0, 0
        for k in range(0, len(body), 65536):
            out = relay(body[k:k + 65536])
            sent += [out] if isinstance(out, bytes) else out
            deferred += relay.task is not None
            while relay.task is not None:  # another client's work: it gets the loop between looks
                served_meanwhile += 1
                await asyncio.sleep(0)
        out = relay(b"")
        sent += [out] if isinstance(out, bytes) else out
        return b"".join(sent), deferred, served_meanwhile

    relayed, deferred, served_meanwhile = run(scenario())
    assert relayed == body and setup.events == []
    assert deferred >= 1 and served_meanwhile > deferred
    assert relay.scan is None  # done with: its scanners let go


# ------------------------------------------------------- brokered: what comes back


def substituted_flow(setup: Setup, response: http.Response):
    flow = request(url="https://bound.test/echo", headers=[(b"Authorization", f"token {PLACEHOLDER}".encode())])
    flow_state(flow).host = parse_host("bound.test")
    run(setup.hook(HttpRequestHeadersHook, flow))
    assert flow.request.headers["Authorization"] == f"token {REAL}" and flow_state(flow).substituted
    flow.response = response
    run(setup.hook(HttpResponseHeadersHook, flow))
    return flow


def response_stream(flow, chunks) -> bytes:
    return relay(flow.response.stream, chunks)


@pytest.mark.parametrize("shown,expected", [
    (REAL, PLACEHOLDER),
    (urllib.parse.quote(REAL), urllib.parse.quote(PLACEHOLDER)),
    (REAL.upper(), PLACEHOLDER),
    ("%67%68%70%5F" + REAL[4:], "%" + "%".join(f"{b:02X}" for b in PLACEHOLDER[:4].encode()) + PLACEHOLDER[4:]),
], ids=["raw", "percent", "upper-cased", "percent-escaped-letters"])
def test_an_echoed_value_is_put_back_to_its_placeholder_in_place(shown, expected):
    setup = Setup()
    body = f'{{"you sent": "token {shown}"}}'.encode()
    flow = substituted_flow(setup, response({"X-Echo": f"token {REAL}", "Content-Length": str(len(body))}))
    assert flow.response.headers["X-Echo"] == f"token {PLACEHOLDER}"
    out = response_stream(flow, [body[:20], body[20:31], body[31:]])
    assert out == f'{{"you sent": "token {expected}"}}'.encode() and len(out) == len(body)
    assert setup.events == []


PAD = fake("", 40_000, string.ascii_lowercase + " ").encode()  # what may be relayed before the echo
ECHO = f"Authorization: token {REAL}\n".encode()


@pytest.mark.parametrize("encoding,body", [
    ("", PAD + b"\n" + base64.b64encode(ECHO)),  # a base64-encoded echo
    ("gzip", gzip.compress(PAD + ECHO)),  # a gzip-compressed echo
    ("br", brotli.compress(PAD + ECHO)),
    ("", PAD + f"\\u0067hp_{REAL[4:]}".encode()),  # a JSON escape: no same-length placeholder
], ids=["base64", "gzip", "br", "json-escape"])
def test_an_echo_the_guard_cannot_put_back_is_refused(encoding, body):
    setup = Setup()
    headers = {"Content-Length": str(len(body))} | ({"Content-Encoding": encoding} if encoding else {})
    flow = substituted_flow(setup, response(headers))
    out = response_stream(flow, [body[k:k + 700] for k in range(0, len(body), 700)])
    assert len(setup.events) == 1 and "GITHUB_TOKEN given back in the response body" in setup.blocks()[0][2]
    assert len(out) < len(body)  # cut off; what was relayed ends before the echo
    shown = b"".join(credential_guard.ContentDecoder(encoding).feed(out)) if encoding else out
    assert len(shown) <= len(PAD) and shown == PAD[:len(shown)]


def test_an_echo_in_an_encoded_header_kills_the_response_before_its_body():
    setup = Setup()
    flow = substituted_flow(setup, response({"X-Echo": base64.b64encode(REAL.encode()).decode()}))
    assert flow.error is not None and flow.error.msg == Error.KILLED_MESSAGE
    assert setup.blocks() == [("GET", "credential", "GITHUB_TOKEN given back in a response header")]


# ------------------------------------------------------------ WebSocket


class WebSocketRig:
    """mitmproxy's real WebsocketLayer between a wsproto client and server, the guard's hooks
    run through the addon manager as the proxy runs them."""

    def __init__(self, setup: Setup, host: str = "example.test", substituted: bool = False):
        self.setup = setup
        self.flow = tflow.twebsocketflow()
        self.flow.websocket = WebSocketData()
        flow_state(self.flow).host = parse_host(host)
        if substituted:
            flow_state(self.flow).substituted = True
        ctx = context.Context(self.flow.client_conn, setup.tctx.options)
        ctx.server = self.flow.server_conn
        self.layer = WebsocketLayer(ctx, self.flow)
        # the layer stack the guard looks the layer up in, as the proxy server holds it
        setup.proxyserver.connections[self.flow.client_conn.id] = SimpleNamespace(layer=self.layer, transports={})
        self.client = wsproto.Connection(wsproto.ConnectionType.CLIENT)
        self.server = wsproto.Connection(wsproto.ConnectionType.SERVER)
        self.to_client, self.to_server, self.closed = [], [], []
        self.event(events.Start())

    def event(self, event) -> None:
        todo = [event]
        while todo:
            for command in self.layer.handle_event(todo.pop(0)):
                if isinstance(command, commands.StartHook):
                    run(self.setup.tctx.master.addons.handle_lifecycle(command))
                    todo.append(events.HookCompleted(command))
                elif isinstance(command, commands.SendData):
                    side = self.client if command.connection is self.flow.client_conn else self.server
                    side.receive_data(command.data)
                    (self.to_client if side is self.client else self.to_server).extend(side.events())
                elif isinstance(command, commands.CloseConnection):
                    self.closed.append("client" if command.connection is self.flow.client_conn else "server")

    def client_sends(self, event) -> None:
        self.event(events.DataReceived(self.flow.client_conn, self.client.send(event)))

    def server_sends(self, event) -> None:
        self.event(events.DataReceived(self.flow.server_conn, self.server.send(event)))


def assert_closed_for_a_credential(rig: WebSocketRig, where: str):
    closes = [e for e in rig.to_client if isinstance(e, ws_events.CloseConnection)]
    assert [c.code for c in closes] == [1008]  # a close frame to the client, policy violation
    assert [e.code for e in rig.to_server if isinstance(e, ws_events.CloseConnection)] == [1008]
    assert sorted(rig.closed) == ["client", "server"]
    assert len(rig.setup.events) == 1 and rig.setup.blocks()[0][:2] == ("WEBSOCKET", "credential")
    assert where in rig.setup.blocks()[0][2]


@pytest.mark.parametrize("frame,where", [
    (ws_events.TextMessage(f"token={GITHUB}"), "github-token in a WebSocket message"),
    (ws_events.BytesMessage(gzip.compress(b"x") + f" {STORED.upper()} ".encode()), "MY_SERVICE_TOKEN in a WebSocket"),
    (ws_events.Ping(GITHUB.encode()), "github-token in a WebSocket control frame"),
    (ws_events.Pong(f"k={STORED}".encode()), "MY_SERVICE_TOKEN in a WebSocket control frame"),
    (ws_events.CloseConnection(1000, f"bye {GITHUB}"), "github-token in a WebSocket control frame"),
], ids=["text", "binary", "ping", "pong", "close-reason"])
def test_a_refused_websocket_frame_closes_the_websocket_properly(frame, where):
    rig = WebSocketRig(Setup())
    rig.client_sends(ws_events.TextMessage("hello"))
    assert [e.data for e in rig.to_server if isinstance(e, ws_events.TextMessage)] == ["hello"]
    rig.client_sends(frame)
    assert_closed_for_a_credential(rig, where)
    relayed = repr(rig.to_server)
    assert GITHUB not in relayed and STORED.upper() not in relayed and STORED not in relayed


def test_a_websocket_message_split_over_frames_is_scanned_whole():
    rig = WebSocketRig(Setup())
    rig.client_sends(ws_events.TextMessage(f"token={GITHUB[:20]}", message_finished=False))
    rig.client_sends(ws_events.TextMessage(GITHUB[20:], message_finished=True))
    assert_closed_for_a_credential(rig, "github-token in a WebSocket message")


def test_a_token_split_across_the_clients_websocket_messages_is_refused():
    # Each message was read alone: a server that joins them got the token.
    rig = WebSocketRig(Setup())
    rig.client_sends(ws_events.TextMessage("x" * 9000))  # more than the tail: only its end is read again
    rig.client_sends(ws_events.TextMessage(f"token={GITHUB[:20]}"))
    assert [e.data for e in rig.to_server if isinstance(e, ws_events.TextMessage)] == ["x" * 9000,
                                                                                        f"token={GITHUB[:20]}"]
    rig.client_sends(ws_events.BytesMessage(GITHUB[20:].encode() + b" and more"))
    assert_closed_for_a_credential(rig, "github-token across WebSocket messages")
    assert GITHUB[20:] not in repr(rig.to_server)


def test_a_server_echoing_a_brokered_value_over_a_websocket():
    rig = WebSocketRig(Setup(), host="bound.test", substituted=True)
    rig.server_sends(ws_events.TextMessage(f"you are {REAL}"))
    assert [e.data for e in rig.to_client if isinstance(e, ws_events.TextMessage)] == [f"you are {PLACEHOLDER}"]
    rig.server_sends(ws_events.TextMessage(base64.b64encode(f"you are {REAL}".encode()).decode()))
    assert_closed_for_a_credential(rig, "GITHUB_TOKEN given back in a WebSocket message")


# ------------------------------------- brokered: swapped where declared, every response read


def bound_flow(setup: Setup, headers=(), url="https://bound.test/", method="GET", body=b"") -> http.HTTPFlow:
    flow = request(method, url=url, body=body, headers=headers)
    flow_state(flow).host = parse_host("bound.test")
    run(setup.hook(HttpRequestHeadersHook, flow))
    if flow.response is None and body:
        run(setup.hook(HttpRequestHook, flow))
    return flow


def test_a_secret_is_swapped_in_its_declared_header_only():
    setup = Setup()
    flow = bound_flow(setup, [(b"authorization", f"Basic {base64.b64encode(f'x:{PLACEHOLDER}'.encode()).decode()}"
                                                 .encode())])
    assert base64.b64decode(flow.request.headers["Authorization"][6:]) == f"x:{REAL}".encode()
    for headers, url, body, where in [
        ([(b"X-Token", PLACEHOLDER.encode())], "https://bound.test/", b"", "the X-Token header"),
        ([], f"https://bound.test/?t={PLACEHOLDER}", b"", "the URL"),
        ([], f"https://bound.test/{PLACEHOLDER}", b"", "the URL"),
        ([], "https://bound.test/", f"t={PLACEHOLDER}".encode(), "the body"),
    ]:
        setup = Setup()
        flow = bound_flow(setup, headers, url, "POST", body)
        assert_refused(setup, flow, f"placeholder:GITHUB_TOKEN in {where} (GITHUB_TOKEN is swapped in the "
                                    f"Authorization header only")
        assert REAL not in str(flow.request.headers) + flow.request.path + flow.request.text


def test_swapping_elsewhere_is_declared_per_secret():
    setup = Setup()
    secret = setup.guard.secrets[1]
    secret.headers, secret.swap = ("X-Token",), ("header", "body", "path")
    flow = bound_flow(setup, [(b"x-token", PLACEHOLDER.encode())], f"https://bound.test/{PLACEHOLDER}/", "POST",
                      f"t={PLACEHOLDER}".encode())
    assert flow.response is None and setup.events == []
    assert (flow.request.headers["X-Token"], flow.request.path, flow.request.text) == (REAL, f"/{REAL}/", f"t={REAL}")
    flow = bound_flow(setup, [(b"Authorization", PLACEHOLDER.encode())])  # no longer its header
    assert_refused(setup, flow, "placeholder:GITHUB_TOKEN in the Authorization header (GITHUB_TOKEN is swapped in "
                                "the X-Token header, the body and the path only")


def plain_flow(setup: Setup, resp: http.Response, host: str = "bound.test") -> http.HTTPFlow:
    """A response to a request that carried no placeholder."""
    flow = request(url=f"https://{host}/fetch")
    flow_state(flow).host = parse_host(host)
    run(setup.hook(HttpRequestHeadersHook, flow))
    assert not flow_state(flow).substituted
    flow.response = resp
    run(setup.hook(HttpResponseHeadersHook, flow))
    return flow


def test_every_response_of_a_bound_host_is_read_whatever_its_request_carried():
    setup = Setup()
    body = f"stored: token {REAL}".encode()
    flow = plain_flow(setup, response({"X-Kept": f"token {REAL}", "Content-Length": str(len(body))}))
    assert flow.response.headers["X-Kept"] == f"token {PLACEHOLDER}"
    assert response_stream(flow, [body[:9], body[9:]]) == f"stored: token {PLACEHOLDER}".encode()
    # another host's responses are not read: it was never sent the value
    other = plain_flow(setup, response({"X-Kept": f"token {REAL}"}), host="example.test")
    assert other.response.stream is False or other.response.stream is None
    assert setup.events == []


@pytest.mark.parametrize("reason,kept", [
    (f"token {REAL}", f"token {PLACEHOLDER}"),
    (base64.b64encode(f"token {REAL}".encode()).decode(), None),
], ids=["raw", "base64"])
def test_the_reason_phrase_is_put_back_or_the_response_killed(reason, kept):
    setup = Setup()
    resp = response({})
    resp.reason = reason
    flow = plain_flow(setup, resp)
    if kept is not None:
        assert flow.response.reason == kept and setup.events == []
    else:
        assert flow.error is not None and flow.error.msg == Error.KILLED_MESSAGE
        assert setup.blocks() == [("GET", "credential", "GITHUB_TOKEN given back in the status line")]


def gzip_commented(comment: bytes, content: bytes = b"x=1") -> bytes:
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return (b"\x1f\x8b\x08\x10\0\0\0\0\0\xff" + comment + b"\0" + deflate.compress(content) + deflate.flush()
            + zlib.crc32(content).to_bytes(4, "little") + len(content).to_bytes(4, "little"))


@pytest.mark.parametrize("encoding,body,form", [
    ("", gzip.compress(PAD + ECHO), "compressed, whatever its headers say"),
    ("", zlib.compress(PAD + ECHO), "compressed, whatever its headers say"),
    ("", zstandard.ZstdCompressor().compress(PAD + ECHO), "compressed, whatever its headers say"),
    ("gzip", gzip_commented(ECHO), "in its coded bytes as sent"),
], ids=["unlabelled-gzip", "unlabelled-zlib", "unlabelled-zstd", "gzip-header-comment"])
def test_a_body_is_read_as_a_client_may_read_it(encoding, body, form):
    setup = Setup()
    headers = {"Content-Length": str(len(body))} | ({"Content-Encoding": encoding} if encoding else {})
    flow = plain_flow(setup, response(headers))
    out = response_stream(flow, [body[k:k + 3] for k in range(0, 12, 3)] + [body[12:]])
    assert setup.blocks() == [("GET", "credential", f"GITHUB_TOKEN given back in the response body ({form})")]
    # what was relayed (its first bytes: the scanner reads in looks), decoded as far as it goes
    zstd = body.startswith(b"\x28\xb5\x2f\xfd")
    shown = (zstandard.ZstdDecompressor().decompressobj() if zstd else zlib.decompressobj(47)).decompress(out)
    assert REAL.encode() not in out and REAL.encode() not in shown


def test_a_bound_hosts_utf16_body_is_read_transcoded():
    # the same reading as a request's: the review's P7 echoed the request in UTF-16
    setup = Setup()
    body = f"you sent: Authorization: token {REAL}".encode("utf-16")
    flow = plain_flow(setup, response({"Content-Length": str(len(body)), "Content-Type": "text/plain; charset=utf-16"}))
    out = response_stream(flow, [body[k:k + 9] for k in range(0, len(body), 9)])
    assert setup.blocks() == [("GET", "credential", "GITHUB_TOKEN given back in the response body (read as UTF-16LE)")]
    assert REAL[:8].encode("utf-16-le") not in out


def test_an_unlabelled_stream_that_decodes_then_breaks_is_cut_off():
    # what a client decodes before the garbage holds the value; the scanner had not read it yet
    setup = Setup()
    body = gzip.compress(ECHO) + b"trailing text, not gzip"
    flow = plain_flow(setup, response({"Content-Length": str(len(body))}))
    out = response_stream(flow, [body])
    assert len(setup.blocks()) == 1 and "a response that cannot be read (it starts like gzip and does not decode: " \
        "trailing garbage" in setup.blocks()[0][2]
    assert out == b""


def test_an_unlabelled_zstd_body_with_a_window_over_the_limit_is_cut_off():
    # Valid zstd that egress will not decode (its window is over RFC 9659's 8 MiB), but a lenient
    # client may: it is not "not compressed", so the plain reading is not enough.
    import zstandard

    setup = Setup()
    params = zstandard.ZstdCompressionParameters(window_log=26, compression_level=3, write_content_size=False)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    body = writer.compress(ECHO + b"\0" * (60 * 2**20)) + writer.flush()
    flow = plain_flow(setup, response({"Content-Length": str(len(body))}))
    out = response_stream(flow, [body])
    assert len(setup.blocks()) == 1 and "it starts like zstd and does not decode: a zstd window of 64 MiB" \
        in setup.blocks()[0][2]
    assert out == b""


def test_text_that_only_looks_compressed_passes_whole():
    setup = Setup()
    body = b"x^ not zlib at all, " + PAD
    flow = plain_flow(setup, response({"Content-Length": str(len(body))}))
    assert response_stream(flow, [body[:1], body[1:5], body[5:]]) == body and setup.events == []


def test_a_value_in_a_response_trailer_is_put_back_or_refused():
    setup = Setup()
    flow = plain_flow(setup, response({}))
    flow.response.trailers = http.Headers([(b"X-Kept", f"token {REAL}".encode())])
    run(setup.hook(HttpResponseHook, flow))
    assert flow.response.trailers["X-Kept"] == f"token {PLACEHOLDER}" and setup.events == []
    flow = plain_flow(setup, response({}))
    flow.response.trailers = http.Headers([(b"X-Kept", base64.b64encode(REAL.encode()))])
    run(setup.hook(HttpResponseHook, flow))
    assert flow.response.trailers is None
    assert setup.blocks() == [("GET", "credential", "GITHUB_TOKEN given back in a response trailer")]


def test_a_value_split_across_a_bound_hosts_websocket_messages_is_refused():
    rig = WebSocketRig(Setup(), host="bound.test")  # no placeholder sent on this connection
    rig.server_sends(ws_events.TextMessage(f"kept: {REAL}"))
    assert [e.data for e in rig.to_client if isinstance(e, ws_events.TextMessage)] == [f"kept: {PLACEHOLDER}"]
    rig.server_sends(ws_events.TextMessage(f"part one {REAL[:20]}"))
    rig.server_sends(ws_events.TextMessage(REAL[20:] + " part two"))
    assert_closed_for_a_credential(rig, "GITHUB_TOKEN given back across WebSocket messages")
    assert REAL[20:] not in repr(rig.to_client)


# ------------------------------------------------------------ what a person or a log reads


def test_clean_keeps_only_short_texts_cached():
    # An upstream's answer quoted in an error can be megabytes: cleaned each time, never kept
    # (the cache held up to 4096 texts of any size, each with its redacted copy).
    setup = Setup()
    short, long = f"host {GITHUB}", "x" * 300 + f" {GITHUB} " + "y" * 5000
    assert setup.guard.clean(short) == "host [redacted:github-token]"
    assert setup.guard.clean(long) == "x" * 300 + " [redacted:github-token] " + "y" * 5000
    assert list(setup.guard._cleaned) == [short]
