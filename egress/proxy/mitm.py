"""Every reach into mitmproxy beyond its documented addon API, in one place.

mitmproxy documents hooks, flows, connections, ``ctx``, ``proxy.context``,
``proxy.mode_specs`` and ``proxy.server_hooks``. egress also embeds a master with
a chosen set of mitmproxy's own addons, serves sockets it did not open, closes or
feeds live connections, and picks protocol layers. Those parts of mitmproxy are
internal and may change in any release, so they are used only through the
functions below, and tests/proxy/test_mitm.py pins each one against the installed
mitmproxy (an upgrade that changes one fails there, not in production).

Imported only when a proxy starts: importing mitmproxy costs ~0.5 s.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import wsproto.handshake
from mitmproxy import (
    addonmanager as _addonmanager,
    certs,
    connection,
    ctx,
    exceptions as _exceptions,
    http,
    master as _master,
    options as _options,
)
from mitmproxy.addons import core, next_layer, proxyserver, tlsconfig
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import DNSLayer, TCPLayer, UDPLayer
from mitmproxy.proxy.layers.websocket import WebsocketLayer
from mitmproxy.proxy.mode_servers import ServerInstance
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.utils import typecheck


class ListenError(Exception):
    """The proxy could not listen where it was asked to."""


# ------------------------------------------------------------------ the master


class _FieldTypecheck:
    """mitmproxy.http's view of mitmproxy.utils.typecheck, with a fast path that gives the
    same answers.

    Every Request and Response mitmproxy builds type-checks its fields (MessageData's
    __post_init__). typecheck.check_option_type formats a TypeError before it looks, and
    for an Optional field holding None (content, trailers, timestamp_end of every message
    under way) raises and catches it: measured under a wrk load, 3 exceptions per message
    whose tracebacks hold their frames, i.e. 74% of the reference cycles the collector had
    to find (~40 of ~58 objects per request), and most of check_option_type's 3-6% of the
    CPU. Here a value that is an instance of a plain class the field allows (or an int for
    a float, as mitmproxy allows) passes without either; everything else, every refusal
    included, goes to mitmproxy's own function.
    """

    def __init__(self, original):
        self._original = original
        self._plain: dict = {}

    def check_option_type(self, name: str, value, typeinfo) -> None:
        plain = self._plain.get(typeinfo)
        if plain is None:
            plain = self._plain[typeinfo] = _plain_classes(typeinfo)
        if plain and (isinstance(value, plain) or (float in plain and isinstance(value, int))):
            return
        self._original(name, value, typeinfo)

    def __getattr__(self, name: str):
        return getattr(typecheck, name)


def _plain_classes(typeinfo) -> tuple:
    """The classes a plain type or a Union of plain types (``bytes | None``) admits; () for
    anything else (generics, Any, IO, ...), which the original checks."""
    members = typing.get_args(typeinfo) if typing.get_origin(typeinfo) in (typing.Union, types.UnionType) \
        else (typeinfo,)
    if all(isinstance(t, type) and t is not typing.Any and typing.get_origin(t) is None
           and t.__module__ != "typing" for t in members):
        return tuple(members)
    return ()


def fast_message_typecheck() -> None:
    """Install :class:`_FieldTypecheck` for mitmproxy.http (idempotent)."""
    if not isinstance(http.typecheck, _FieldTypecheck):
        http.typecheck = _FieldTypecheck(typecheck.check_option_type)


# ------------------------------------------------- an answer before a streamed body


def _answer_before_body(original):
    """HttpStream.start_request_stream, able to send an answer an addon set at requestheaders.

    A body over stream_large_bodies (or a chunked one that grows past it) is streamed. When
    an addon had already answered the request (every refusal at the head: a host not
    allowed, a private address, a credential in the URL), mitmproxy raised "Can't set a
    response and enable streaming at the same time", crashed again on each chunk of the body
    that followed (211 times for an 11 MB upload), and never answered: the client hung to the
    idle timeout and got an empty reply, not EGRESS_BLOCKED. Here that answer is sent at
    once, as mitmproxy sends one set later (the responseheaders and response hooks), and the
    body still coming is read and dropped: nothing is dialled, nothing relayed or kept. An
    HTTP/1 answer says ``Connection: close``, so the connection ends with the body (clients
    such as curl stop sending on an error answer and close).
    """
    from mitmproxy.proxy.layers.http import HttpResponseHeadersHook, ResponseEndOfMessage, SendHttp

    def start_request_stream(self):
        if self.flow.response is None:
            return (yield from original(self))
        response = self.flow.response
        if not (self.flow.request.is_http2 or self.flow.request.is_http3):
            response.headers["connection"] = "close"
        response.timestamp_start = time.time()
        self.client_state = self.state_errored  # from now on: every event of the request dropped
        yield HttpResponseHeadersHook(self.flow)
        if (yield from self.check_killed(True)):
            return
        yield from self.send_response()  # the response hook, then the answer's head and body
        self.flow.live = False
        yield SendHttp(ResponseEndOfMessage(self.stream_id), self.context.client)

    start_request_stream.egress_original = original
    return start_request_stream


def answer_before_streamed_body() -> None:
    """Install :func:`_answer_before_body` (idempotent)."""
    from mitmproxy.proxy.layers.http import HttpStream

    if not hasattr(HttpStream.start_request_stream, "egress_original"):
        HttpStream.start_request_stream = _answer_before_body(HttpStream.start_request_stream)


# ------------------------------------------------ the refusal, not mitmproxy's page


def _answer_invalid_request(original):
    """HttpStream.check_invalid, sending the answer an addon gave a request mitmproxy refuses.

    mitmproxy refuses some requests itself after their head was read (a scheme other than
    http/https: ``GET ws://...``, ``GET HTTP://...``; Transfer-Encoding with Content-Length;
    a CONNECT inside a tunnel), runs the requestheaders and error hooks, then sends its own
    HTML 400. egress's guards refuse such a request in those hooks, so the client got
    mitmproxy's page (no X-Egress-Blocked, no EGRESS_BLOCKED line) for a refusal egress had
    recorded. Here, when a hook set the flow's response, that response is sent (its head and
    its body) before mitmproxy's error event, which then only closes the connection: an
    HTTP/1 server side writes its page only when no response is under way. Its status is
    mitmproxy's (400: a request it will not serve as HTTP, as egress answers a malformed head).
    A response failing the same checks (``request=False``) is the upstream's: left as it was.
    """
    from mitmproxy.net.http import status_codes
    from mitmproxy.proxy.layers.http import ResponseData, ResponseHeaders, ResponseProtocolError, SendHttp

    def check_invalid(self, request: bool):
        commands_ = original(self, request)
        reply = None
        while True:
            try:
                command = commands_.send(reply)
            except StopIteration as stop:
                return stop.value
            answer = self.flow.response if request else None
            if (answer is not None and isinstance(command, SendHttp)
                    and isinstance(command.event, ResponseProtocolError) and command.connection is self.context.client):
                if answer.status_code != command.event.code:
                    answer.status_code = command.event.code
                    answer.reason = status_codes.RESPONSES.get(command.event.code, "")
                yield SendHttp(ResponseHeaders(self.stream_id, answer, False), self.context.client)
                if answer.raw_content:
                    yield SendHttp(ResponseData(self.stream_id, answer.raw_content), self.context.client)
            reply = yield command

    check_invalid.egress_original = original
    return check_invalid


def answer_invalid_requests() -> None:
    """Install :func:`_answer_invalid_request` (idempotent)."""
    from mitmproxy.proxy.layers.http import HttpStream

    if not hasattr(HttpStream.check_invalid, "egress_original"):
        HttpStream.check_invalid = _answer_invalid_request(HttpStream.check_invalid)


# ------------------------------------------------------ egress's HTTP/1 sides


def read_upstreams_with(client_class: type) -> None:
    """Make mitmproxy read every upstream HTTP/1 response with ``client_class``, a subclass of
    its Http1Client (idempotent). HttpClient (a new server connection) and HttpLayer (a server
    that speaks first) make their Http1Client by its module-level name in
    mitmproxy.proxy.layers.http, so the subclass goes under that name."""
    from mitmproxy.proxy.layers import http as http_layers

    if http_layers.Http1Client is not client_class:
        http_layers.Http1Client = client_class


def serve_clients_with(chosen: layer.Layer | None, make: typing.Callable) -> bool:
    """Have the HttpLayer in ``chosen``'s stack (NextLayer's choice, or the layer it leads to
    through ``child_layer``: a TLS layer, a mode) serve its client with ``make(context,
    http_layer)``, a subclass of mitmproxy's Http1Server, in place of the one it would make:
    HttpLayer keeps an entry of its ``connections`` it finds there, as it does for client
    replay. False if the stack holds no HttpLayer, or its client is served already."""
    from mitmproxy.proxy.layers.http import HttpLayer

    found = chosen
    while found is not None and not isinstance(found, HttpLayer):
        found = getattr(found, "child_layer", None)
    if found is None:
        return False
    client = found.context.client
    if client in found.connections:
        return False
    found.connections[client] = make(found.context.fork(), found)
    return True


@dataclass(frozen=True)
class OwnAddons:
    """mitmproxy's own addons that egress embeds (mitmdump would load ~35)."""

    core: core.Core
    proxyserver: proxyserver.Proxyserver
    next_layer: next_layer.NextLayer
    tls_config: tlsconfig.TlsConfig


class _HookTable(_addonmanager.AddonManager):
    """mitmproxy's AddonManager, dispatching a hook only to the addons that implement it.

    mitmproxy's own trigger_event walks every addon (and its nested addons) for every hook,
    each inside a context manager and a coroutine of its own, and calls ``event.args()``
    per call; after every hook that carries a flow it does the same again for ``update``,
    which no egress addon implements. Measured with py-spy on new passthrough tunnels and
    on small requests, that dispatch was ~10-13% of egress's CPU. Here the functions
    implementing each hook are looked up once per hook name (again after any addon is
    added or removed), grouped by top-level addon as mitmproxy's walk groups them, and
    called in the same order with the same error handling: an exception is logged as
    mitmproxy logs it and skips the rest of that addon's group, AddonHalt ends the event,
    OptionsError propagates. A hook attribute that is neither callable nor a module goes
    to mitmproxy's own walk, which reports it.
    """

    _table: dict | None = None

    def _reset(self) -> None:
        self._table = None

    def register(self, addon):
        self._reset()
        return super().register(addon)

    def remove(self, addon):
        self._reset()
        return super().remove(addon)

    def clear(self):
        self._reset()
        return super().clear()

    def _groups(self, name: str):
        table = self._table
        if table is None:
            table = self._table = {}
        elif name in table:
            return table[name]
        groups = []
        for top in self.chain:
            funcs = []
            for addon in _addonmanager.traverse([top]):
                func = getattr(addon, name, None)
                if not func or isinstance(func, types.ModuleType):
                    continue
                if not callable(func):
                    table[name] = None  # mitmproxy's walk raises and logs it
                    return None
                funcs.append(func)
            if funcs:
                groups.append(tuple(funcs))
        table[name] = groups = tuple(groups)
        return groups

    async def trigger_event(self, event) -> None:
        groups = self._groups(event.name)
        if groups is None:
            return await super().trigger_event(event)
        if not groups:
            return
        args = event.args()
        for funcs in groups:
            try:
                for func in funcs:
                    result = func(*args)
                    if result is not None and inspect.isawaitable(result):
                        await result
            except _exceptions.AddonHalt:
                return
            except _exceptions.OptionsError:
                raise
            except Exception as e:
                _addonmanager.logger.error(f"Addon error: {e}", exc_info=(type(e), e, e.__traceback__))


def new_master(**option_values) -> tuple[_master.Master, OwnAddons]:
    """A master with no addons yet, and mitmproxy's own addons for the caller to place.

    Must run inside an event loop (the master binds to the running one).
    """
    _load_ca_once()
    fast_message_typecheck()
    answer_before_streamed_body()
    answer_invalid_requests()
    master = _master.Master(_options.Options(**option_values))
    master.addons.__class__ = _HookTable  # same state, faster dispatch
    return master, OwnAddons(core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(),
                             tlsconfig.TlsConfig())


# ------------------------------------------------------------------ the CA, once

# TlsConfig loads the CA (CertStore.from_store) on configure and again on running: each load
# parses the CA's RSA key, which cryptography checks at length (~50-110 ms a load here, two per
# proxy start). The store is the CA's key and certificate plus a cache of leaf certificates,
# the same for every proxy of one process, so it is loaded once per CA file version, and the
# warm server (egress.run.warm.server) loads it before it forks. Only the CA files' store is shared:
# egress never sets mitmproxy's `certs` option (which would add certificates to it).
_stores: dict[tuple, certs.CertStore] = {}


def _load_ca_once() -> None:
    current = certs.CertStore.__dict__["from_store"]
    if getattr(current, "egress_once", False):
        return
    load = current.__func__

    def from_store(cls, path, basename, key_size, passphrase=None):
        ca = Path(path) / f"{basename}-ca.pem"
        try:
            info = ca.stat()
        except OSError:  # not made yet: mitmproxy makes it
            return load(cls, path, basename, key_size, passphrase)
        key = (str(ca), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, key_size, passphrase)
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = load(cls, path, basename, key_size, passphrase)
        return store

    from_store.egress_once = True
    certs.CertStore.from_store = classmethod(from_store)


def preload_ca(confdir: Path) -> None:
    """Load the CA in ``confdir`` now (if it exists), as a proxy started later will ask for it."""
    _load_ca_once()
    if (confdir / "mitmproxy-ca.pem").exists():
        certs.CertStore.from_store(confdir, "mitmproxy", _options.KEY_SIZE)


async def start(master: _master.Master, server: proxyserver.Proxyserver) -> list[tuple[str, int]]:
    """Listen as the options say, then run the ``running`` hook; the bound addresses. Raises ListenError."""
    if not await server.setup_servers():
        errors = [str(s.last_exception) for s in server.servers if s.last_exception]
        raise ListenError("; ".join(errors) or "the proxy could not start listening")
    await master.running()
    return [addr[:2] for addr in server.listen_addrs()]


async def serve_socket(server: proxyserver.Proxyserver, sock: socket.socket, on_accept=None) -> asyncio.Server:
    """Serve connections from an already-listening socket (one made inside a sandbox) as a regular
    proxy; ``on_accept()`` is called as each connection is taken."""
    instance_handle = regular_handler(server)
    sock.setblocking(False)
    handle = instance_handle
    if on_accept is not None:
        async def handle(reader, writer):
            on_accept()
            await instance_handle(reader, writer)
    return await asyncio.start_server(handle, sock=sock)


def regular_handler(server: proxyserver.Proxyserver):
    """``handle_stream(reader, writer)`` of a regular-mode server instance: a client connection
    served as by an explicit proxy (egress.proxy.capture feeds it captured connections, each
    behind a CONNECT of its own)."""
    instance = next(iter(server.servers), None)
    if instance is None:  # not listening anywhere itself: a regular-mode instance of our own
        instance = ServerInstance.make(ProxyMode.parse("regular"), server)
    return instance.handle_stream


async def stop_serving(server: proxyserver.Proxyserver, timeout: float) -> int:
    """Stop listening, end every client connection, and wait until their handlers have finished
    (at most ``timeout`` seconds); the number still open then.

    mitmproxy itself leaves them to be cancelled when the loop ends, mid-hook: their last events
    were lost, and Python 3.11 reported each such cancelled task as an error (egress.proxy.master).
    """
    await server.servers.update([])  # mitmproxy's own listeners (egress serve); handed sockets are the caller's
    loop = asyncio.get_running_loop()
    for _ in range(3):  # a connection accepted just now: its handler registers on its first step
        await asyncio.sleep(0)
    for handler in list(server.connections.values()):
        io = handler.transports.get(handler.client)
        if io is not None and io.handler is not None:
            io.handler.cancel("egress is stopping")  # handle_client then closes its servers and returns
    deadline = loop.time() + timeout
    while server.connections and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return len(server.connections)


async def stopped(master: _master.Master) -> None:
    """Returns once :func:`stop` was called."""
    await master.should_exit.wait()


async def done(master: _master.Master) -> None:
    """The ``done`` hook: the addons let go of what they hold."""
    await master.done()


def stop(master: _master.Master) -> None:
    """Thread-safe."""
    master.shutdown()


def listen_addrs() -> list[tuple]:
    """The addresses the running proxy listens on (for addons: the proxy must never dial itself)."""
    return list(ctx.master.addons.get("proxyserver").listen_addrs())


# ------------------------------------------------------------ live connections


def connection_handler(flow: http.HTTPFlow):
    """The handler of the flow's client connection, or None once it is gone."""
    return ctx.master.addons.get("proxyserver").connections.get(flow.client_conn.id)


def event_lock(flow: http.HTTPFlow) -> asyncio.Lock | None:
    """The lock mitmproxy's connection handler takes to handle each event of the flow's
    client connection (a read, a hook's end, the server's bytes): while another task holds
    it, that connection is read no further. None when there is none to find."""
    try:
        handler = connection_handler(flow)
    except AttributeError:  # no mitmproxy master (a flow driven by hand)
        return None
    lock = getattr(handler, "_server_event_lock", None)
    return lock if isinstance(lock, asyncio.Lock) else None


def close_connections(flow: http.HTTPFlow, *conns: connection.Connection) -> bool:
    """Close these connections of a live flow at the socket (bytes already moving cannot be
    recalled by a hook). False if the flow's client connection is already gone."""
    handler = connection_handler(flow)
    if handler is None:
        return False
    for conn in conns:
        transport = handler.transports.get(conn)
        if transport is not None and transport.writer is not None:
            transport.writer.close()
    return True


def feed_server_response(flow: http.HTTPFlow, response: http.Response) -> bool:
    """Make ``response`` arrive as if the flow's (plain HTTP) server had sent it.

    Every later hook then sees an ordinary response. Not for TLS servers: the bytes
    would be read as ciphertext. False if the client connection is already gone.
    """
    handler = connection_handler(flow)
    if handler is None:
        return False
    raw = http1.assemble_response(response)
    asyncio.ensure_future(handler.server_event(events.DataReceived(flow.server_conn, raw)))
    return True


def relabel_server_address(server: connection.Server, address: tuple) -> None:
    """Name an open server connection by ``address`` without rerouting it.

    mitmproxy refuses to change the address of an open connection, because that
    would not reroute it; relabelling (the peername keeps the real address, so
    mitmproxy reuses the connection by name) is exactly what is wanted here.
    """
    object.__setattr__(server, "address", address)


# ------------------------------------------------------------------------ TLS


def verify_result(ssl_conn) -> int:
    """OpenSSL's certificate verification result (X509_V_OK = 0) of a pyOpenSSL connection, as
    mitmproxy's own TLS layer reads it to word "Certificate verify failed: ..." (pyOpenSSL has
    no public call for it). 0 when there is nothing to ask."""
    from OpenSSL import SSL

    if ssl_conn is None:
        return 0
    return int(SSL._lib.SSL_get_verify_result(ssl_conn._ssl))


# ------------------------------------------------------------- protocol layers


def opaque_relay(context, count=None) -> layer.Layer:
    """A layer that relays the tunnel's bytes untouched (no interception, no flow).

    ``count(from_client, n)`` is called for every chunk relayed. Once the server connection
    is open (through mitmproxy's server_connect hooks, so every guard there has run) and a
    first chunk has gone through mitmproxy's own path, the two sockets are spliced: their
    asyncio transports hand each chunk straight to the other (:class:`_Splice`), without
    mitmproxy's per-chunk event path through the layer stack; opening, half-closing and
    closing still go through mitmproxy as before.
    """
    return _SplicedRelay(context, count)


class _SplicedRelay(TCPLayer):
    """TCPLayer(ignore=True), spliced after its first chunk when it safely can be (see
    :func:`splice`); otherwise (a TLS transport, bytes still buffered) it relays chunk by
    chunk as TCPLayer does, and tries again at the next chunk."""

    def __init__(self, context, count=None):
        super().__init__(context, ignore=True)
        self._count = count
        self.spliced = False

    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self._count is not None and isinstance(event, events.DataReceived):
            self._count(event.connection is self.context.client, len(event.data))
        yield from super().relay_messages(event)
        if not self.spliced and isinstance(event, events.DataReceived):
            self.spliced = splice(self.context.client, self.context.server, self._count)


def splice(client: connection.Client, server: connection.Server, count=None) -> bool:
    """Relay between ``client`` and ``server`` transport to transport from now on; False
    (nothing changed) unless both are open plain asyncio socket transports with nothing
    buffered in their readers (bytes mitmproxy has yet to read would be overtaken)."""
    handler = client_handler(client)
    if handler is None or client.state is not connection.ConnectionState.OPEN \
            or server.state is not connection.ConnectionState.OPEN:
        return False
    ios = [handler.transports.get(client), handler.transports.get(server)]
    transports = []
    for io in ios:
        reader, writer = getattr(io, "reader", None), getattr(io, "writer", None)
        if not isinstance(reader, asyncio.StreamReader) or not isinstance(writer, asyncio.StreamWriter):
            return False
        if getattr(reader, "_buffer", b"x") or reader.at_eof():
            return False
        transport = writer.transport
        if (transport.is_closing() or transport.get_extra_info("sslcontext") is not None
                or not hasattr(transport, "set_protocol") or transport.get_protocol() is None):
            return False
        transports.append(transport)
    watchdog = handler.timeout_watchdog
    ends = [_Splice(t, t.get_protocol(), watchdog, count, from_client) for t, from_client in
            zip(transports, (True, False), strict=True)]
    ends[0].peer, ends[1].peer = transports[1], transports[0]
    for transport, end in zip(transports, ends, strict=True):
        transport.set_protocol(end)
    return True


class _Splice(asyncio.Protocol):
    """One end of a spliced tunnel: what its transport reads is written to the peer
    transport at once (reads are up to 256 KiB); when the peer cannot take more, reading
    pauses. Everything but data goes to the protocol it replaced (mitmproxy's stream), so
    EOF, half-close, errors and close reach mitmproxy as before. Counts as the layer did,
    and keeps mitmproxy's idle watchdog fed."""

    __slots__ = ("transport", "inner", "watchdog", "count", "from_client", "peer")

    def __init__(self, transport, inner, watchdog, count, from_client: bool):
        self.transport, self.inner, self.watchdog = transport, inner, watchdog
        self.count, self.from_client = count, from_client
        self.peer = None

    def data_received(self, data: bytes) -> None:
        self.peer.write(data)
        self.watchdog.register_activity()
        if self.count is not None:
            self.count(self.from_client, len(data))

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:  # our transport's write buffer is full: stop reading the peer
        self.peer.pause_reading()
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.peer.resume_reading()
        self.inner.resume_writing()


def is_opaque(chosen: layer.Layer | None) -> bool:
    """True if NextLayer chose to carry something other than HTTP (raw TCP with a flow, DNS, UDP)."""
    return (isinstance(chosen, TCPLayer) and chosen.flow is not None) or isinstance(chosen, (DNSLayer, UDPLayer))


class _Close(layer.Layer):
    """Closes the client connection and ignores everything else."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)


def closing_layer(context) -> layer.Layer:
    """A layer that closes the client connection as soon as it starts."""
    return _Close(context)


# ------------------------------------------------------------- WebSockets


def becomes_websocket(flow: http.HTTPFlow) -> bool:
    """Whether mitmproxy will relay what follows this 101 as WebSocket messages: the test
    of its HttpStream.send_response, which otherwise makes a raw TCP relay."""
    return (flow.response.headers.get("upgrade", "").lower() == "websocket"
            and flow.request.headers.get("Sec-WebSocket-Version", "").encode() == wsproto.handshake.WEBSOCKET_VERSION
            and ctx.options.websocket)


def websocket_layer(flow: http.HTTPFlow) -> WebsocketLayer | None:
    """The layer relaying ``flow``'s WebSocket, found from its client connection's layer
    stack (mitmproxy hands addons the flow, not the layer); None if it is not there."""
    proxyserver = ctx.master.addons.get("proxyserver")
    handler = proxyserver.connections.get(flow.client_conn.id) if proxyserver else None
    todo = [handler.layer] if handler is not None else []
    seen = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, WebsocketLayer) and node.flow is flow:
            return node
        # the ways mitmproxy's layers hold their children: NextLayer.layer, child_layer
        # (tunnels, HTTP streams), the HTTP layer's streams, and modes that hand their
        # events straight to a child (HttpProxy sets _handle_event to the child's)
        todo += [getattr(node, "layer", None), getattr(node, "child_layer", None)]
        todo += list(getattr(node, "streams", {}).values())
        delegate = getattr(getattr(node, "_handle_event", None), "__self__", None)
        if isinstance(delegate, layer.Layer):
            todo.append(delegate)
    return None


# ------------------------------------------------- connections by their client


def client_handler(client: connection.Client):
    """The proxy server's handler of ``client``'s connection; None once it is gone, or with no
    proxy server (an in-process test)."""
    try:
        return ctx.master.addons.get("proxyserver").connections.get(client.id)
    except AttributeError:
        return None


def is_open(client: connection.Client, conn: connection.Connection | None = None) -> bool:
    """Whether ``conn`` (default: the client's own) is still served by a running task."""
    handler = client_handler(client)
    io = handler.transports.get(conn or client) if handler is not None else None
    return io is not None and io.handler is not None


def unsent_bytes(client: connection.Client) -> int:
    """Bytes the proxy has queued for ``client`` and not yet written (0 if unknown)."""
    handler = client_handler(client)
    io = handler.transports.get(client) if handler is not None else None
    transport = getattr(getattr(io, "writer", None), "transport", None)
    return transport.get_write_buffer_size() if transport is not None else 0


def cancel(client: connection.Client, *conns: connection.Connection | None, reason: str) -> bool:
    """Stop serving these connections of ``client`` now, from anywhere in the loop (their tasks
    are cancelled; mitmproxy then closes them). False if the client's connection is gone."""
    handler = client_handler(client)
    if handler is None:
        return False
    for conn in conns:
        io = handler.transports.get(conn) if conn is not None else None
        if io is not None and io.handler is not None:
            io.handler.cancel(reason)
    return True


def set_idle_timeout(client: connection.Client, seconds: float) -> bool:
    """Close ``client``'s connection after ``seconds`` without traffic (mitmproxy's watchdog
    reads its timeout at each wake-up). False if the connection is gone."""
    handler = client_handler(client)
    if handler is None:
        return False
    handler.timeout_watchdog.timeout = seconds
    return True
