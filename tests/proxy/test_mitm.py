"""egress.proxy.mitm against the installed mitmproxy: each reach into its internals, pinned.

egress/proxy/mitm.py is the only module that uses mitmproxy beyond its documented addon
API. Each test here drives one of its functions on a real master, in this process,
with real sockets on 127.0.0.1, so a mitmproxy release that renames or reshapes the
internal it relies on fails here, by name.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import socket
import time
import types
import typing
from pathlib import Path

import pytest
from mitmproxy import connection, exceptions, http
from mitmproxy.options import Options
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import DNSLayer, HttpLayer, TCPLayer, UDPLayer
from mitmproxy.proxy.layers.http import HTTPMode

from egress.proxy import mitm
from egress.proxy.ca import ca_dir, ensure_ca


@pytest.fixture(scope="module")
def confdir(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    ensure_ca(state)
    return ca_dir(state)


def run_master(confdir, body, *addons, listen: bool = True):
    """Start a master (own addons + ``addons``) listening on 127.0.0.1:0 (or nowhere), await
    ``body(master, addresses)``, stop it; returns what body returned."""

    async def main():
        master, own = mitm.new_master(listen_host="127.0.0.1", listen_port=0, mode=["regular"], server=listen)
        master.addons.add(own.core, own.proxyserver, own.next_layer, own.tls_config, *addons)
        master.options.update(confdir=str(confdir), connection_strategy="lazy")
        addresses = await mitm.start(master, own.proxyserver)
        try:
            return await body(master, own, addresses)
        finally:
            mitm.stop(master)
            await mitm.stopped(master)
            await mitm.done(master)

    return asyncio.run(main())


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` to 127.0.0.1:port; everything received until the proxy closes (or 20 s idle)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(request)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return data


def get(url: str) -> bytes:
    return f"GET {url} HTTP/1.1\r\nHost: {url.split('/')[2]}\r\nConnection: close\r\n\r\n".encode()


class Answer:
    """Answers every request itself (nothing is dialled)."""

    def request(self, flow: http.HTTPFlow) -> None:
        flow.response = http.Response.make(200, b"answered by the addon")


class AnswerAtTheHead:
    """Answers at requestheaders, as egress's refusals do, and marks the body for streaming
    (what mitmproxy's stream_large_bodies does for a body over its size)."""

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        flow.response = http.Response.make(403, b"refused at the head")
        flow.request.stream = True


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_answer_set_at_the_head_of_a_streamed_body_is_sent_at_once(confdir, framing):
    # mitmproxy alone raised "Can't set a response and enable streaming" once per chunk and never
    # answered (egress.proxy.mitm._answer_before_body). Its own HttpStream, as new_master patches it:
    # a mitmproxy upgrade that renames or reshapes start_request_stream fails here first.
    from mitmproxy.proxy.layers.http import HttpStream

    body = b"x" * (2 * 2**20)
    if framing == "chunked":
        framed = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in
                         (body[k:k + 65536] for k in range(0, len(body), 65536))) + b"0\r\n\r\n"
        head = b"Transfer-Encoding: chunked\r\n"
    else:
        framed, head = body, b"Content-Length: %d\r\n" % len(body)

    async def body_of(master, own, addresses):
        port = addresses[0][1]
        request = b"POST http://upload.test/ HTTP/1.1\r\nHost: upload.test\r\n" + head + b"\r\n" + framed
        return await asyncio.to_thread(exchange, port, request)

    answer = run_master(confdir, body_of, AnswerAtTheHead())
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 403 Forbidden", answer[:200]
    assert b"connection: close" in rest.lower().split(b"\r\n\r\n")[0]
    assert answer.endswith(b"refused at the head")
    assert hasattr(HttpStream.start_request_stream, "egress_original")


# ----------------------------------------------------------------- the master


def test_a_master_listens_where_asked_reports_it_and_stops(confdir):
    async def body(master, own, addresses):
        assert addresses and addresses[0][0] == "127.0.0.1" and addresses[0][1] > 0
        assert [a[:2] for a in mitm.listen_addrs()] == addresses  # as addons see it, through ctx
        return await asyncio.to_thread(exchange, addresses[0][1], get("http://a.test/"))

    assert b"answered by the addon" in run_master(confdir, body, Answer())


def test_a_port_in_use_is_a_listen_error(confdir):
    async def main():
        master, own = mitm.new_master(listen_host="127.0.0.1", listen_port=port, mode=["regular"])
        master.addons.add(own.core, own.proxyserver, own.next_layer, own.tls_config)
        master.options.update(confdir=str(confdir))
        with pytest.raises(mitm.ListenError) as error:
            await mitm.start(master, own.proxyserver)
        await mitm.done(master)
        return str(error.value)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = asyncio.run(main())
    assert message and "address" in message.lower()


def test_a_handed_over_socket_is_served_by_a_master_that_listens_nowhere(confdir):
    handed = socket.socket()
    handed.bind(("127.0.0.1", 0))
    handed.listen()
    port = handed.getsockname()[1]

    accepted = []

    async def body(master, own, addresses):
        assert addresses == []
        server = await mitm.serve_socket(own.proxyserver, handed, on_accept=lambda: accepted.append(1))
        try:
            return await asyncio.to_thread(exchange, port, get("http://a.test/"))
        finally:
            server.close()

    try:
        assert b"answered by the addon" in run_master(confdir, body, Answer(), listen=False)
    finally:
        handed.close()
    assert accepted == [1]


def test_the_ca_is_loaded_once_per_file_version(tmp_path):
    # TlsConfig loads the CA on configure and again on running; egress.proxy.mitm makes both (and every
    # later master's) the same store, until the CA file changes.
    state = tmp_path / "state"
    ensure_ca(state)

    async def store():
        master, own = mitm.new_master(listen_host="127.0.0.1", listen_port=0, mode=["regular"], server=False)
        master.addons.add(own.core, own.proxyserver, own.next_layer, own.tls_config)
        master.options.update(confdir=str(ca_dir(state)))
        configured = own.tls_config.certstore
        await mitm.start(master, own.proxyserver)  # the running hook configures it again
        try:
            assert own.tls_config.certstore is configured
            return configured
        finally:
            mitm.stop(master)
            await mitm.done(master)

    first = asyncio.run(store())
    assert asyncio.run(store()) is first
    key = Path(ca_dir(state)) / "mitmproxy-ca.pem"
    key.write_bytes(key.read_bytes())  # a new version of the file (mtime): loaded anew
    later = asyncio.run(store())
    assert later is not first and later.default_ca.serial == first.default_ca.serial


def test_stop_serving_ends_every_connection_and_stops_listening(confdir, http_upstream):
    disconnected = []

    class Hold:
        def client_disconnected(self, client) -> None:
            disconnected.append(client.peername)

    async def body(master, own, addresses):
        port = addresses[0][1]
        # one waiting on an upstream that never answers, one with half a request head
        waiting = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port))
        waiting.sendall(get(http_upstream.url("127.0.0.1", "/hang")))
        idle = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port))
        idle.sendall(b"GET http://a.test/ HTTP/1.1\r\n")
        while len(own.proxyserver.connections) < 2:
            await asyncio.sleep(0.01)
        left = await mitm.stop_serving(own.proxyserver, 5.0)
        closed = [await asyncio.to_thread(sock.recv, 1024) for sock in (waiting, idle)]
        for sock in (waiting, idle):
            sock.close()
        refused = await asyncio.to_thread(lambda: socket.socket().connect_ex(("127.0.0.1", port)))
        return left, closed, refused

    left, closed, refused = run_master(confdir, body, Hold())
    assert left == 0 and len(disconnected) == 2  # each ended through mitmproxy's own hooks
    assert closed == [b"", b""]
    assert refused != 0  # no longer listening


def test_egress_http1_sides_serve_the_client_and_read_the_upstream(confdir, http_upstream):
    # egress.proxy.addons.limits puts its StrictHttp1Server in for each client (serve_clients_with,
    # at next_layer) and its StrictHttp1Client under mitmproxy's name (read_upstreams_with).
    from mitmproxy.proxy.layers import http as http_layers
    from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Server

    used = []

    class Server(Http1Server):
        def __init__(self, context, http_layer):
            super().__init__(context)
            used.append(("server", type(http_layer).__name__))

    class Client(Http1Client):
        def __init__(self, context):
            super().__init__(context)
            used.append(("client", None))

    class Strict:
        def next_layer(self, nextlayer) -> None:
            served = mitm.serve_clients_with(nextlayer.layer, Server)
            again = mitm.serve_clients_with(nextlayer.layer, Server)  # a client has one server side
            used.append(("placed", (served, again)))

    before = http_layers.Http1Client
    mitm.read_upstreams_with(Client)
    try:
        answer = run_master(confdir, lambda master, own, addresses: asyncio.to_thread(
            exchange, addresses[0][1], get(http_upstream.url("127.0.0.1", "/"))), Strict())
    finally:
        mitm.read_upstreams_with(before)
    assert answer.startswith(b"HTTP/1.1 404 Not Found")  # the upstream's own answer, read by Client
    assert ("placed", (True, False)) in used
    assert [u for u in used if u[0] != "placed"] == [("server", "HttpLayer"), ("client", None)]
    assert mitm.serve_clients_with(None, Server) is False  # no layer chosen yet: nothing to serve


def test_verify_result_is_openssls_code_for_a_failed_handshake(test_ca, tmp_path):
    from OpenSSL import SSL

    cert = test_ca.issue_cert("a.test")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    server_context = SSL.Context(SSL.TLS_SERVER_METHOD)
    server_context.use_certificate_file(str(tmp_path / "cert.pem"))
    server_context.use_privatekey_file(str(tmp_path / "key.pem"))
    client_context = SSL.Context(SSL.TLS_CLIENT_METHOD)
    client_context.set_verify(SSL.VERIFY_PEER, None)  # and trusts no CA
    client, server = SSL.Connection(client_context), SSL.Connection(server_context)
    client.set_connect_state()
    server.set_accept_state()
    with pytest.raises(SSL.Error):
        for _ in range(10):  # memory BIOs: shuttle the handshake until the client gives up
            for sender, receiver in ((client, server), (server, client)):
                try:
                    sender.do_handshake()
                except SSL.WantReadError:
                    pass
                try:
                    receiver.bio_write(sender.bio_read(65536))
                except SSL.WantReadError:
                    pass
    assert mitm.verify_result(client) == 20  # X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY
    assert mitm.verify_result(None) == 0


# ---------------------------------------------------------- live connections


def test_close_connections_ends_a_live_flow_at_the_socket(confdir, http_upstream):
    seen = []

    class Close:
        def request(self, flow: http.HTTPFlow) -> None:
            seen.append(mitm.connection_handler(flow) is not None)
            seen.append(mitm.close_connections(flow, flow.client_conn))

    async def body(master, own, addresses):
        return await asyncio.to_thread(exchange, addresses[0][1], get(http_upstream.url("127.0.0.1")))

    answer = run_master(confdir, body, Close())
    assert seen == [True, True]
    assert answer == b""  # closed before any response


def test_client_connection_helpers_drive_the_live_connection(confdir, http_upstream):
    seen = {}

    class Probe:
        def request(self, flow: http.HTTPFlow) -> None:
            client = flow.client_conn
            seen["handler"] = mitm.client_handler(client) is not None
            seen["open"] = mitm.is_open(client)
            seen["unsent"] = mitm.unsent_bytes(client)
            seen["timeout"] = mitm.set_idle_timeout(client, 123.0)
            seen["watchdog"] = mitm.client_handler(client).timeout_watchdog.timeout
            seen["cancel"] = mitm.cancel(client, client, reason="closed by the test")

    async def body(master, own, addresses):
        return await asyncio.to_thread(exchange, addresses[0][1], get(http_upstream.url("127.0.0.1")))

    answer = run_master(confdir, body, Probe())
    assert seen == {"handler": True, "open": True, "unsent": 0, "timeout": True, "watchdog": 123.0, "cancel": True}
    assert answer == b""  # cancelled before any response
    gone = connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), timestamp_start=time.time())
    assert (mitm.client_handler(gone), mitm.is_open(gone), mitm.cancel(gone, gone, reason="x")) == (None, False, False)


def test_feed_server_response_arrives_as_the_servers_own(confdir, http_upstream):
    flows = []

    class Keep:
        def request(self, flow: http.HTTPFlow) -> None:
            flows.append(flow)

    async def body(master, own, addresses):
        client = asyncio.create_task(asyncio.to_thread(
            exchange, addresses[0][1], get(http_upstream.url("127.0.0.1", "/hang"))))
        deadline = time.monotonic() + 30
        while not any(r["path"] == "/hang" for r in http_upstream.requests):  # the request is upstream
            assert time.monotonic() < deadline, "the request never reached the upstream"
            await asyncio.sleep(0.02)
        fed = mitm.feed_server_response(flows[0], http.Response.make(504, b"fed", {"Connection": "close"}))
        answer = await client
        return fed, answer

    fed, answer = run_master(confdir, body, Keep())
    assert fed is True
    assert answer.startswith(b"HTTP/1.1 504") and answer.endswith(b"fed")


def test_relabel_server_address_bypasses_the_open_connection_guard():
    server = connection.Server(address=("127.0.0.1", 8443))
    server.state = connection.ConnectionState.OPEN
    server.peername = ("127.0.0.1", 8443)
    # mitmproxy refuses this on an open connection; that refusal is why the helper exists.
    with pytest.raises(RuntimeError):
        server.address = ("example.test", 8443)
    mitm.relabel_server_address(server, ("example.test", 8443))
    assert server.address == ("example.test", 8443) and server.peername == ("127.0.0.1", 8443)


# ------------------------------------------------------------ protocol layers


@pytest.fixture
def context():
    client = connection.Client(peername=("127.0.0.1", 50000), sockname=("127.0.0.1", 8080), timestamp_start=0)
    return Context(client, Options())


def test_opaque_relay_is_an_untracked_tcp_relay(context):
    relay = mitm.opaque_relay(context)
    assert isinstance(relay, TCPLayer) and relay.flow is None


def test_a_passthrough_relay_is_spliced_after_its_first_chunk_and_counts_every_byte(confdir):
    # The internals splice() relies on (ConnectionHandler.transports, asyncio's StreamReader
    # buffer, transport.set_protocol) are pinned here: if they change, the relay stays on
    # mitmproxy's own path (spliced stays False) and this fails by name.
    relays, counts = [], {True: 0, False: 0}

    def count(from_client: bool, n: int) -> None:
        counts[from_client] += n

    class Relay:
        def next_layer(self, nextlayer) -> None:
            if nextlayer.context.server.address is not None and not nextlayer.context.client.tls:
                nextlayer.layer = mitm.opaque_relay(nextlayer.context, count)
                relays.append(nextlayer.layer)

    upstream = socket.create_server(("127.0.0.1", 0))
    port = upstream.getsockname()[1]
    sent = bytes(range(256)) * 4096  # 1 MiB
    reply = b"pong" * 100_000

    def serve() -> None:
        conn, _ = upstream.accept()
        with conn:
            got = b""
            while len(got) < len(sent):
                got += conn.recv(1 << 20)
            conn.sendall(reply if got == sent else b"corrupted")

    def client(proxy_port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", proxy_port), timeout=20) as sock:
            sock.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1)
            sock.sendall(sent[:100])  # the first chunk takes mitmproxy's path, then the splice
            time.sleep(0.2)
            sock.sendall(sent[100:])
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            return data

    async def body(master, own, addresses):
        server = asyncio.create_task(asyncio.to_thread(serve))
        answer = await asyncio.to_thread(client, addresses[0][1])
        await server
        return answer

    try:
        answer = run_master(confdir, body, Relay())
    finally:
        upstream.close()
    assert answer == reply
    assert [r.spliced for r in relays] == [True]
    assert counts == {True: len(sent), False: len(reply)}


@pytest.mark.parametrize(("make", "opaque"), [
    (lambda c: TCPLayer(c), True),  # what NextLayer picks for non-HTTP bytes: it has a flow
    (lambda c: TCPLayer(c, ignore=True), False),  # a passthrough relay is not refused
    (lambda c: DNSLayer(c), True),
    (lambda c: UDPLayer(c), True),
    (lambda c: HttpLayer(c, HTTPMode.regular), False),
    (lambda c: None, False),
], ids=["tcp", "tcp-ignored", "dns", "udp", "http", "undecided"])
def test_is_opaque(context, make, opaque):
    assert mitm.is_opaque(make(context)) is opaque


def test_closing_layer_closes_the_client_and_nothing_else(context):
    layer = mitm.closing_layer(context)
    [command] = layer.handle_event(events.Start())
    assert type(command) is commands.CloseConnection and command.connection is context.client
    assert list(layer.handle_event(events.DataReceived(context.client, b"more"))) == []


# ------------------------------------------------------- message type checks

_CHECKS = [  # (value, type) as mitmproxy's MessageData fields take them, fitting and not
    (b"x", bytes), ("x", bytes), (None, bytes), (b"x", bytes | None), (None, bytes | None), ("x", bytes | None),
    (1.5, float), (3, float), (True, float), ("1", float), (None, float | None), (2, float | None),
    (b"1", float | None), (80, int), (80.0, int), ("x", str), (b"x", str),
    (http.Headers(), http.Headers), ({}, http.Headers), (None, http.Headers | None),
    (http.Headers(), http.Headers | None), ([], http.Headers | None),
    # what the fast path leaves to mitmproxy's own function
    ((1, "a"), tuple[int, str]), ((1, 2), tuple[int, str]), (["a"], typing.Sequence[str]),
    ([1], typing.Sequence[str]), ("anything", typing.Any),
    (None, typing.Optional[typing.Sequence[str]]),  # noqa: UP045 -- the form under test, as mitmproxy declares it
]


@pytest.mark.parametrize(("value", "typeinfo"), _CHECKS, ids=[f"{v!r}-{t}" for v, t in _CHECKS])
def test_the_message_typecheck_answers_as_mitmproxys_own(value, typeinfo):
    from mitmproxy.utils import typecheck

    def outcome(check):
        try:
            check("field", value, typeinfo)
        except TypeError as e:
            return str(e)
        return None

    assert outcome(mitm._FieldTypecheck(typecheck.check_option_type).check_option_type) == \
        outcome(typecheck.check_option_type)


def test_messages_are_built_without_exception_cycles_once_a_master_exists(confdir):
    import gc

    async def make() -> None:
        mitm.new_master()

    asyncio.run(make())
    assert isinstance(http.typecheck, mitm._FieldTypecheck)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(20):
            http.Request.make("GET", "http://a.test/", b"")
            http.Response.make(200, b"ok")
        with pytest.raises(TypeError, match="timestamp_start"):  # a wrong type is still refused
            http.Request("a.test", 80, b"GET", b"http", b"a.test", b"/", b"HTTP/1.1", http.Headers(), None, None,
                         "not a float", None)
        gc.collect()
        leftovers = [type(o).__name__ for o in gc.garbage if isinstance(o, TypeError)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert leftovers.count("TypeError") <= 1  # only the refusal above


# ------------------------------------------------------------- hook dispatch


class _Probe:
    def __init__(self, name: str, calls: list, nested=(), fail: bool = False, halt: bool = False,
                 asynchronous: bool = False):
        self.name, self.calls, self.fail, self.halt = name, calls, fail, halt
        if nested:
            self.addons = list(nested)
        if asynchronous:
            self.requestheaders = self._later

    def requestheaders(self, flow) -> None:
        self.calls.append((self.name, flow.request.path))
        if self.fail:
            raise ValueError(f"{self.name} failed")
        if self.halt:
            raise exceptions.AddonHalt()

    async def _later(self, flow) -> None:
        await asyncio.sleep(0)
        self.calls.append((self.name + " (async)", flow.request.path))


def _dispatch(table: bool) -> tuple[list, list]:
    """The same addons and events through mitmproxy's AddonManager or egress's table."""
    from mitmproxy import master as mitmproxy_master
    from mitmproxy.proxy.layers.http import HttpRequestHeadersHook

    calls, errors = [], []

    class Errors(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Addon error"):
                errors.append(re.sub(r" at 0x[0-9a-f]+", "", record.getMessage()))

    def flow(path: str) -> http.HTTPFlow:
        f = http.HTTPFlow(connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2),
                                            timestamp_start=0), connection.Server(address=None))
        f.request = http.Request.make("GET", f"http://a.test{path}")
        return f

    async def main():
        if table:
            master, _ = mitm.new_master()
        else:
            master = mitmproxy_master.Master(Options())
        master.addons.add(_Probe("a", calls), _Probe("b", calls, nested=[_Probe("b1", calls, fail=True),
                                                                        _Probe("b2", calls)]),
                          _Probe("c", calls, asynchronous=True), _Probe("d", calls, fail=True), _Probe("e", calls))
        await master.addons.trigger_event(HttpRequestHeadersHook(flow("/1")))
        master.addons.add(_Probe("f", calls, halt=True), _Probe("g", calls))  # the table must see them
        await master.addons.trigger_event(HttpRequestHeadersHook(flow("/2")))
        master.addons.remove(master.addons.get("f"))
        await master.addons.trigger_event(HttpRequestHeadersHook(flow("/3")))
        odd = _Probe("h", calls)
        odd.requestheaders = 5  # not callable: mitmproxy's walk reports it
        master.addons.add(odd)
        await master.addons.trigger_event(HttpRequestHeadersHook(flow("/4")))
        await mitm.done(master)  # takes mitmproxy's log handler off this loop

    handler = Errors()
    logging.getLogger().addHandler(handler)
    try:
        asyncio.run(main())
    finally:
        logging.getLogger().removeHandler(handler)
    return calls, errors


def test_the_hook_table_dispatches_as_mitmproxys_own_walk():
    mitmproxy_calls, mitmproxy_errors = _dispatch(table=False)
    calls, errors = _dispatch(table=True)
    assert calls == mitmproxy_calls
    assert errors == mitmproxy_errors
    # and what that is: nested addons after their parent, a failure ends its addon's group
    # (b1 failed: b2 skipped) but not the event, AddonHalt ends the event
    assert [c for c in calls if c[1] == "/2"] == [("a", "/2"), ("b", "/2"), ("b1", "/2"), ("c (async)", "/2"),
                                                  ("d", "/2"), ("e", "/2"), ("f", "/2")]
    assert ("g", "/3") in calls and ("h", "/4") not in calls
    assert len(errors) == 4 * 2 + 1  # b1 and d each time, and h's handler that is not callable


def test_the_event_lock_is_the_one_each_client_event_is_handled_under():
    # credential_guard scans a streamed body between reads while it holds this lock, so the
    # connection is read no further meanwhile (mitm.event_lock).
    from mitmproxy.proxy import server

    source = inspect.getsource(server.ConnectionHandler)
    assert "self._server_event_lock = asyncio.Lock()" in source
    assert "async with self._server_event_lock:" in inspect.getsource(server.ConnectionHandler.server_event)
    assert mitm.event_lock(types.SimpleNamespace(client_conn=types.SimpleNamespace(id="none"))) is None
