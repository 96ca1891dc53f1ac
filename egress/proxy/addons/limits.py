"""Limits that keep one client from taking the proxy down for everyone, and a strict HTTP/1 head.

Measured before these limits (mitmproxy 11.0.2 as egress embeds it):

* a request head is buffered until its blank line, whatever its size (mitmproxy's own
  ``FIXME: protect against header size DoS``): one connection sending 200 MiB of header
  took the proxy to 884 MiB;
* a connection stays open while any byte arrives, and ten minutes without one: a head
  sent a byte at a time never ends, and ~1000 idle connections used up systemd's default
  1024 descriptors, so everyone else was refused;
* obs-fold (a header line starting with a space) and a bare CR in a header value were
  forwarded verbatim: an upstream that reads them another way than mitmproxy does
  (RFC 9112 §5.2, §2.2) can be desynchronised (request smuggling);
* a chunked request with trailers raised NotImplementedError inside mitmproxy, which
  dropped the connection with nothing reported; a request line mitmproxy could not parse
  (a malformed host) got mitmproxy's 400, with no hook and no event.

What this module does:

* :func:`raise_fd_limit`: the soft descriptor limit is raised to the hard one at start;
* ``egress_max_client_connections`` (default 256) open connections per client address; a
  connection past it is closed at once. Under ``egress run`` every connection comes from
  the sandbox's 127.0.0.1, so it is the run's limit;
* ``egress_idle_timeout`` (default 300 s, mitmproxy's is 600 s): a connection with no
  traffic at all is closed (long-lived tunnels and WebSockets that exchange nothing);
* ``egress_head_timeout`` (default 60 s): a connection waiting for a request head (the
  first, the next one on a kept-alive connection, the first inside a new tunnel including
  its TLS handshake) must complete it within that time, however the bytes trickle in, or
  it is closed (idle kept-alive connections are closed by it too, as nginx's keepalive
  timeout does). A timer per connection would cost per request; one sweep a few times a
  second looks at every waiting connection instead;
* ``egress_max_head_bytes`` (default 64 KiB; nginx's largest default header buffers are
  4 x 8 KiB, Node's 16 KiB): a bigger request head is answered ``431`` and the connection
  closed before more is buffered;
* the same bound for what a connection holds unread while mitmproxy is not reading a head: the
  bytes a client sends behind a request still waiting for its answer (pipelined requests:
  mitmproxy reads one at a time, and buffered all the rest, 160 MiB in 2.3 s), and a chunk
  size line or trailer of a chunked body. Past it the request is refused (``400``,
  ``protocol``) and the connection closed. Once the client has its answer whole (every byte of
  a response of known length relayed), what it sends is its next request, in the gap before
  mitmproxy's response hook ends the exchange: ANSWERED_SLACK (1 MiB) is allowed there. Refusing rather than pausing the socket: a client
  that sends 64 KiB ahead is no HTTP client (browsers and curl do not pipeline), and pausing
  would need the transport that mitmproxy's layers never see;
* and for the upstream's response head (:class:`StrictHttp1Client`): mitmproxy buffered it
  whole too (+390 MiB for a 96 MiB head), and put a repr of all of it in the error that
  became the 502's body. A head past the bound fails the request as egress's upstream error
  (``502``, ``connect-failed``, "response head over 64 KiB"), the server connection is
  closed and its buffer dropped. An upstream's own error text reaches the answer cut to a few
  hundred characters (upstream_errors.py);
* a request head with obs-fold, a bare CR, NUL or another control character (HTAB aside)
  is answered ``400`` (``protocol``). Bare LF line ends are left to mitmproxy: it splits
  lines on LF and writes the head anew with CRLF, so upstream never sees them;
* connections that closed are given back to the system (:mod:`egress.proxy.reclaim`: a full collection
  once as many have closed as are open, then ``malloc_trim``), and so is memory that grew and
  stays grown, whatever closed (the sweep below asks it each time);
* a request line mitmproxy cannot parse is answered ``400`` by egress (``invalid-host`` when
  it names a host that is not one, else ``protocol``), with an event; trailers and a
  malformed chunked body are reported as ``protocol`` refusals (and trailers answered 400).

The HTTP/1 part is a subclass of mitmproxy's ``Http1Server``, put in place of the one an
``HttpLayer`` would make for the client (egress.proxy.mitm.serve_clients_with). egress runs
with ``http2=False``, so a client connection is always HTTP/1. The server side is a subclass
of ``Http1Client``, which mitmproxy makes by its module-level name at each new server
connection (egress.proxy.mitm.read_upstreams_with puts the subclass under that name).
Upstream HTTP/2 is never negotiated (``http2=False`` offers no ALPN h2), so every upstream is
read by it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import time

from h11._receivebuffer import ReceiveBuffer
from mitmproxy import connection, ctx
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http import http1, status_codes, url
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import TCPLayer
from mitmproxy.proxy.layers.http import HttpLayer, HTTPMode
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import (
    RequestHeaders,
    RequestProtocolError,
    ResponseData,
    ResponseHeaders,
    ResponseProtocolError,
)
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Server, make_body_reader

from egress.core.hosts import InvalidHost, parse_authority
from egress.policy.matcher import Decision
from egress.proxy import auth as proxyauth, mitm
from egress.proxy.engine import Engine
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import KEY, ConnState, flow_state
from egress.proxy.reclaim import Reclaimer
from egress.proxy.refusal import Stage, refuse, upstream_error

logger = logging.getLogger("egress")

MAX_CLIENT_CONNECTIONS = 256
IDLE_TIMEOUT = 300.0
HEAD_TIMEOUT = 60.0
MAX_HEAD_BYTES = 64 * 1024
# What a client may send behind a request whose answer it already has whole: mitmproxy relays a
# streamed response's last byte (egress streams every response it does not rewrite), then runs
# the response hook before it reads the next request; a keep-alive client that starts its next
# upload at once (curl with several URLs, a requests session) sends into that gap.
ANSWERED_SLACK = 1024 * 1024

# In a request head (its lines joined by LF): a control character other than HTAB (a bare CR
# included: line-ending CRs are gone), or a line that starts with a space or HTAB (obs-fold).
_BAD_HEAD = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\n[ \t]")
_WHAT = {b"\r": "a bare CR", b"\x00": "a NUL byte"}


def bad_head(lines) -> str | None:
    """What makes a request head's lines (line ends removed) unacceptable, in words: obs-fold,
    a bare CR, NUL or another control character; None if nothing does."""
    bad = _BAD_HEAD.search(b"\n".join(lines))
    if bad is None:
        return None
    found = bad.group()
    return "obs-fold (a header line starting with whitespace)" if found[:1] == b"\n" else \
        _WHAT.get(found, f"the control character {found!r}")


def size_words(limit: int) -> str:
    """A byte limit as a person reads it: ``64 KiB``, or ``1000 bytes``."""
    return f"{limit >> 10} KiB" if limit and limit % 1024 == 0 else f"{limit} bytes"


def excerpt(data: bytes, most: int = 200) -> str:
    """A repr of the first ``most`` bytes of ``data``, and ``...`` if there was more."""
    return repr(data[:most]) + ("..." if len(data) > most else "")


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return (soft before, soft now).

    systemd starts services with 1024 soft (and 524288 hard): 1024 descriptors are ~500
    proxied connections. A hard limit of "unlimited" is capped at 2**20 (Linux's default
    fs.nr_open, beyond which the kernel refuses the soft limit anyway).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


class Limits:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.metrics = engine.recorder.metrics
        self.per_client: dict[str, int] = {}  # client address -> open connections
        self.max_client_connections = MAX_CLIENT_CONNECTIONS
        self.idle_timeout = IDLE_TIMEOUT
        self.head_timeout = HEAD_TIMEOUT
        self.max_head_bytes = MAX_HEAD_BYTES
        self._sweeper: asyncio.Task | None = None
        self.reclaimer = Reclaimer()
        mitm.read_upstreams_with(StrictHttp1Client)
        # (peername, sockname) -> (counted address, waiting since): connections egress.proxy.fastpath
        # counted and handed over, until mitmproxy's client_connected takes them
        self.carried: dict[tuple, tuple[str | None, float]] = {}

    def load(self, loader) -> None:
        loader.add_option("egress_max_client_connections", int, MAX_CLIENT_CONNECTIONS,
                          "Open connections allowed per client address (0: no limit).")
        loader.add_option("egress_idle_timeout", float, IDLE_TIMEOUT,
                          "Seconds a connection may exchange nothing before it is closed.")
        loader.add_option("egress_head_timeout", float, HEAD_TIMEOUT,
                          "Seconds a connection may take to send a complete request head (0: no limit).")
        loader.add_option("egress_max_head_bytes", int, MAX_HEAD_BYTES,
                          "Largest request head (request line and headers) in bytes; larger ones get 431.")

    def configure(self, updated) -> None:
        options = ctx.options
        self.max_client_connections = options.egress_max_client_connections
        self.idle_timeout = options.egress_idle_timeout
        self.head_timeout = options.egress_head_timeout
        self.max_head_bytes = options.egress_max_head_bytes

    def running(self) -> None:
        self.reclaimer.check()  # the resident size at start: the first floor
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_forever())

    def done(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.reclaimer.cancel()

    # ------------------------------------------------------------- connections

    @guard
    def client_connected(self, client: connection.Client) -> None:
        self.reclaimer.opened()
        state = self.engine.conn(client)
        carried = self.carried.pop((client.peername, client.sockname), None) if self.carried else None
        if carried is not None:  # egress.proxy.fastpath counted it when it took it, and handed it over
            state.counted, state.waiting_since = carried
            mitm.set_idle_timeout(client, self.idle_timeout)
            return
        state.waiting_since = time.monotonic()
        address = client.peername[0] if client.peername else None
        if address is not None and self.max_client_connections > 0:
            if not self.admit(address):
                client.error = f"more than {self.max_client_connections} connections from {address}"
                self.metrics.connections_limited.labels("client-connections").inc()
                return
            state.counted = address
        mitm.set_idle_timeout(client, self.idle_timeout)

    def admit(self, address: str) -> bool:
        """Count one more open connection from ``address``; False (nothing counted) past the limit."""
        count = self.per_client.get(address, 0)
        if count >= self.max_client_connections:
            return False
        self.per_client[address] = count + 1
        return True

    def release(self, address: str) -> None:
        """One connection counted by :meth:`admit` has closed."""
        left = self.per_client.get(address, 1) - 1
        if left > 0:
            self.per_client[address] = left
        else:
            self.per_client.pop(address, None)

    def carry(self, peername, sockname, counted: str | None, since: float) -> None:
        """A connection egress.proxy.fastpath took (counted against ``counted``, waiting for its head since
        ``since``) goes to mitmproxy: its client_connected takes both over instead of counting
        it again, so the limit and the head timeout run from when it was accepted."""
        self.carried[(peername, sockname)] = (counted, since)

    @guard
    def client_disconnected(self, client: connection.Client) -> None:
        state = self.engine.connections.get(client)
        if state is not None and state.counted is not None:
            self.release(state.counted)
            state.counted = None
        self.engine.forget(client)
        self.reclaimer.closed_one()

    @guard
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        chosen = nextlayer.layer
        if isinstance(chosen, TCPLayer):  # a relay (passthrough): no request head to wait for
            state = self.engine.connections.get(nextlayer.context.client)
            if state is not None:
                state.waiting_since = None
            return
        mitm.serve_clients_with(chosen, self._http1_server)
        # Anything else still leads to a head: a TLS handshake inside a tunnel (its HttpLayer
        # comes after it, from another NextLayer) keeps the clock that started at the CONNECT's
        # 200, so a ClientHello trickled a byte at a time is cut like a trickled head. A closing
        # layer closes the connection as it starts: its clock never fires.

    def _http1_server(self, context, http_layer: HttpLayer) -> StrictHttp1Server:
        return StrictHttp1Server(context, self, http_layer)

    @guard
    def websocket_start(self, flow) -> None:
        self.engine.conn(flow.client_conn).waiting_since = None

    # ----------------------------------------------------------- head timeout

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(5.0, (self.head_timeout or 20.0) / 4)))
            try:
                self.sweep(time.monotonic())
                self.reclaimer.check()  # memory that grew and stays grown: see egress.proxy.reclaim
            except Exception:  # the sweep must go on; mitmproxy would not see this task fail
                logger.exception("egress: the head-timeout sweep failed")

    def sweep(self, now: float) -> int:
        """Close every connection that has waited longer than the head timeout; return how many."""
        if self.head_timeout <= 0:
            return 0
        deadline = now - self.head_timeout
        closed = 0
        for client, state in list(self.engine.connections.items()):
            since = state.waiting_since
            if since is None or since > deadline:
                continue
            if not mitm.is_open(client):
                continue
            if mitm.unsent_bytes(client):
                continue  # still sending it our last answer: the client is reading
            state.waiting_since = None
            mitm.cancel(client, client, reason="egress: no complete request head in time")
            self.metrics.connections_limited.labels("head-timeout").inc()
            closed += 1
        return closed


class StrictHttp1Server(Http1Server):
    """mitmproxy's HTTP/1 server side, with a bounded and strictly checked request head, and
    egress's answers in place of mitmproxy's error pages.

    ``read_headers`` follows mitmproxy 11.0.2's own, with the checks added before the
    head is parsed and egress's refusal instead of mitmproxy's bare 400. ``send`` answers
    an upstream failure that egress named (upstream_errors.py) with egress's 502/504
    instead of mitmproxy's HTML page.
    """

    def __init__(self, context, limits: Limits, http_layer: HttpLayer):
        super().__init__(context)
        self.limits = limits
        self.http_layer = http_layer
        self.conn_state: ConnState = limits.engine.conn(context.client)
        self._unsent_body: int | None = None  # bytes of the response body the client lacks

    def read_headers(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        if not isinstance(event, events.DataReceived):
            yield from super().read_headers(event)
            return
        state = self.conn_state
        if state.waiting_since is None:
            state.waiting_since = time.monotonic()
        lines = self.buf.maybe_extract_lines()
        while lines == []:  # blank lines before a request line are ignored (RFC 9112 §2.2)
            lines = self.buf.maybe_extract_lines()
        limit = self.limits.max_head_bytes
        if lines is None:
            if len(self.buf) > limit:
                yield from self._refuse_head(431, "protocol", f"a request head larger than {limit} bytes",
                                             bytes(self.buf)[:1024].split(b"\n", 1)[0])
            return
        if sum(map(len, lines)) + 2 * len(lines) > limit:
            yield from self._refuse_head(431, "protocol", f"a request head larger than {limit} bytes", lines[0])
            return
        what = bad_head(lines)
        if what is not None:
            yield from self._refuse_head(400, "protocol", f"{what} in the request head", lines[0])
            return
        try:
            self.request = http1.read_request_head([bytes(x) for x in lines])
            expected_body_size = http1.expected_http_body_size(self.request)
        except ValueError as e:
            self.request = None
            yield from self._refuse_head(400, "protocol", str(e)[:200], lines[0])
            return
        request = self.request
        wanted = self.limits.engine.proxy_auth
        if wanted is not None and not state.authenticated:
            # A proxy others on the host can reach (egress run on macOS, serve --auth): a client
            # without the secret gets 407 before any hook, decision or event (egress.proxy.auth).
            if not proxyauth.accepts(request.headers.get("Proxy-Authorization"), wanted):
                state.waiting_since = None
                yield commands.SendData(self.conn, http1.assemble_response(proxyauth.challenge()))
                yield commands.CloseConnection(self.conn)
                self.state = self.done
                self.buf = ReceiveBuffer()
                return
            state.authenticated = True
        if wanted is not None:
            request.headers.pop("Proxy-Authorization", None)  # the secret goes no further
        if (self.http_layer.mode is HTTPMode.regular and not request.authority and request.method != "CONNECT"):
            # mitmproxy then takes the destination from the Host header, and answers a bad one
            # with a 400 of its own and no hook: refuse it here, reported.
            try:
                url.parse_authority(request.host_header or "", check=True)
            except ValueError:
                yield from self._refuse_head(400, "invalid-host", "no valid Host header",
                                             host=request.host_header or "")
                return
        state.waiting_since = None
        self._unsent_body = None  # this request's answer has not begun
        yield ReceiveHttp(RequestHeaders(self.stream_id, request, expected_body_size == 0))
        self.body_reader = make_body_reader(expected_body_size)
        self.state = self.read_body
        yield from self.state(event)

    def send(self, event) -> layer.CommandGenerator[None]:
        # How much of the response body the client still lacks (None: until its end is sent).
        if isinstance(event, ResponseHeaders):
            try:
                size = http1.expected_http_body_size(self.request, event.response)
            except ValueError:
                size = None
            self._unsent_body = size if size is not None and size >= 0 else None
        elif isinstance(event, ResponseData) and self._unsent_body:
            self._unsent_body = max(0, self._unsent_body - len(event.data))
        # Http1Server.send would write make_error_response's HTML page, then close.
        if (isinstance(event, ResponseProtocolError) and self.response is None
                and event.code != status_codes.NO_RESPONSE
                and self.conn.state & connection.ConnectionState.CAN_WRITE):
            answer = self._upstream_answer(event.stream_id)
            if answer is not None:
                yield commands.SendData(self.conn, http1.assemble_response(answer))
                yield commands.CloseConnection(self.conn)
                return
        yield from super().send(event)

    def _upstream_answer(self, stream_id: int):
        """egress's answer for the flow of ``stream_id`` when its upstream failure has a code, or
        when its dial was refused (the refusal, egress.proxy.refusal.take_dial_refusal)."""
        flow = getattr(self.http_layer.streams.get(stream_id), "flow", None)
        state = flow.metadata.get(KEY) if flow is not None else None
        if state is not None and state.refused_dial:
            return flow.response
        if state is None or state.upstream_error is None or state.refused:
            return None
        clean = self.limits.engine.recorder.clean
        return upstream_error(clean(state.host_name or flow.request.host or "unknown"), state.upstream_error,
                              clean(state.upstream_detail))

    def read_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        try:
            # mitmproxy closes the connection first, then reports the malformed body: the close is
            # held back until egress's refusal has been sent, so the client is answered (400, the
            # line), as for every other refusal, rather than cut off without a word.
            held = failed = None
            for command in super().read_body(event):
                if (held is None and isinstance(event, events.DataReceived)
                        and isinstance(command, commands.CloseConnection) and command.connection is self.conn):
                    held = command
                    continue
                if (isinstance(command, ReceiveHttp) and isinstance(command.event, RequestProtocolError)
                        and isinstance(event, events.DataReceived)):  # not a client that went away
                    failed = True
                    response = self._refuse_flow(command.event.message)
                    if held is not None and response is not None and self.response is None:
                        yield commands.SendData(self.conn, http1.assemble_response(response))
                if held is not None:
                    yield held
                    held = None
                yield command
            if held is not None:
                yield held
        except NotImplementedError:  # mitmproxy 11: "HTTP trailers are not implemented yet."
            response = self._refuse_flow("trailers in a chunked request body")
            if response is not None and self.response is None:
                yield commands.SendData(self.conn, http1.assemble_response(response))
            yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(RequestProtocolError(self.stream_id, "HTTP trailers are not supported", 400))
            self.state = self.done
            return
        if len(self.buf) > self.limits.max_head_bytes > 0 and not failed:
            yield from self._refuse_unread(event)

    def wait(self, event: events.Event) -> layer.CommandGenerator[None]:
        # mitmproxy reads the next request only once this one is answered, and buffers what comes
        # meanwhile (Http1Connection._handle_event appends every DataReceived): bounded here.
        limit = self.limits.max_head_bytes
        if limit > 0 and self._unsent_body == 0:
            limit = max(limit, ANSWERED_SLACK)  # the client has its answer whole: its next request
        if len(self.buf) > limit > 0:
            yield from self._refuse_unread(event)
        if self.state == self.wait:
            yield from super().wait(event)

    def _refuse_unread(self, event: events.Event) -> layer.CommandGenerator[None]:
        """Refuse the request and close: more than the head limit waits unread in the buffer
        while a body is read (a chunk size line or trailer without end) or while the request
        waits for its answer (what the client sent behind it)."""
        limit = self.limits.max_head_bytes
        if not isinstance(event, events.DataReceived):
            return
        if self.state == self.read_body:
            message = f"a chunk size line or trailer of the request body over {size_words(limit)}"
        elif self.state == self.wait:
            message = f"more than {size_words(limit)} sent behind a request still waiting for its answer"
        else:
            return
        self.limits.metrics.connections_limited.labels("head-size").inc()
        answering = self.response is None and bool(self.conn.state & ConnectionState.CAN_WRITE)
        response = self._refuse_flow(message, answer=answering)
        if answering and response is not None:
            yield commands.SendData(self.conn, http1.assemble_response(response))
        yield commands.CloseConnection(self.conn)
        yield ReceiveHttp(RequestProtocolError(self.stream_id, message, 400))
        self.state = self.done
        self.buf = ReceiveBuffer()

    def mark_done(self, *, request: bool = False, response: bool = False) -> layer.CommandGenerator[None]:
        yield from super().mark_done(request=request, response=response)
        state = self.conn_state
        if state.waiting_since is None and (
                self.state == self.read_headers
                or (self.state == self.passthrough and self.request is not None and self.request.method == "CONNECT")):
            state.waiting_since = time.monotonic()  # the next head, or the tunnel's first one

    def done(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        self.buf = ReceiveBuffer()  # what still arrives is dropped, not kept
        yield from ()

    # -------------------------------------------------------------- refusing

    def _refuse_head(self, status: int, reason: str, detail: str, request_line: bytes = b"",
                     host: str | None = None) -> layer.CommandGenerator[None]:
        method, named = _request_line(bytes(request_line))
        if host is None:
            host = named
        tunnel = self.conn_state.tunnel
        port = tunnel[1] if tunnel is not None else None
        if host:
            try:
                parsed, port = parse_authority(host)
                host = parsed.name
            except InvalidHost as e:
                reason, detail, host = "invalid-host", str(e), host[:100]
        else:
            host = tunnel[0].name if tunnel is not None else "unknown"
        if status == 431:
            self.limits.metrics.connections_limited.labels("head-size").inc()
        response = refuse(self.limits.engine, self.context.client, Decision(host, port, False, reason, detail=detail),
                          Stage.LAYER, status=status, method=method)
        self.conn_state.waiting_since = None
        yield commands.SendData(self.conn, http1.assemble_response(response))
        yield commands.CloseConnection(self.conn)
        self.state = self.done
        self.buf = ReceiveBuffer()

    def _refuse_flow(self, message: str, answer: bool = True):
        """A refusal (one event) for the flow of this request; its response, if one was made
        (``answer=False``: the event only, the response to the client has begun)."""
        stream = self.http_layer.streams.get(self.stream_id)
        flow = getattr(stream, "flow", None)
        if flow is None:
            return None
        state = flow_state(flow)
        host = state.host_name or flow.request.host or "unknown"
        response = refuse(self.limits.engine, flow, Decision(host, flow.request.port, False, "protocol",
                                                             detail=message[:200]), Stage.LAYER, status=400)
        return response if answer else None


class StrictHttp1Client(Http1Client):
    """mitmproxy's HTTP/1 client side (what reads an upstream's response), with the response
    head bounded as the request head is (``egress_max_head_bytes``), and so what waits unread
    in a response body (a chunk size line without end).

    ``read_headers`` follows mitmproxy 11.0.2's own, with the bound checked before the head is
    parsed. Past it, the request fails as an upstream error whose message is the detail
    (upstream_errors.py names it ``connect-failed``; egress's HTTP/1 server side answers the
    502), the server connection is closed and the buffer dropped. An upstream that closes in
    the middle of a head: mitmproxy's message carried a repr of the whole buffer, here 200
    bytes of it.
    """

    def __init__(self, context):
        super().__init__(context)
        # read once a server connection (an option read costs 2.5 us); MAX_HEAD_BYTES where Limits is not loaded
        self.max_head_bytes = getattr(context.options, "egress_max_head_bytes", MAX_HEAD_BYTES)

    def read_headers(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        if not self.request or not isinstance(event, (events.DataReceived, events.ConnectionClosed)):
            yield from super().read_headers(event)  # data for no request: mitmproxy closes
            return
        if isinstance(event, events.ConnectionClosed):
            if self.stream_id and self.buf:
                if self.conn.state & ConnectionState.CAN_WRITE:
                    yield commands.CloseConnection(self.conn)
                message = f"unexpected server response: {excerpt(bytes(self.buf))}"
                self.buf = ReceiveBuffer()
                yield ReceiveHttp(ResponseProtocolError(self.stream_id, message))
                return
            yield from super().read_headers(event)
            return
        lines = self.buf.maybe_extract_lines()
        limit = self.max_head_bytes
        if not lines:
            if len(self.buf) > limit > 0:
                yield from self._fail(f"response head over {size_words(limit)}")
            return
        if sum(map(len, lines)) + 2 * len(lines) > limit > 0:
            yield from self._fail(f"response head over {size_words(limit)}")
            return
        try:
            self.response = http1.read_response_head([bytes(x) for x in lines])
            expected_size = http1.expected_http_body_size(self.request, self.response)
        except ValueError as e:
            yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(ResponseProtocolError(self.stream_id, f"Cannot parse HTTP response: {str(e)[:200]}"))
            return
        yield ReceiveHttp(ResponseHeaders(self.stream_id, self.response, expected_size == 0))
        self.body_reader = make_body_reader(expected_size)
        self.state = self.read_body
        yield from self.state(event)

    def read_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super().read_body(event)
        if self.buf and self.state == self.read_body and isinstance(event, events.DataReceived):
            limit = self.max_head_bytes
            if len(self.buf) > limit > 0:
                yield from self._fail(f"a chunk size line or trailer of the response body over {size_words(limit)}")

    def _fail(self, message: str) -> layer.CommandGenerator[None]:
        yield commands.CloseConnection(self.conn)
        yield ReceiveHttp(ResponseProtocolError(self.stream_id, message))
        self.state = self.done
        self.buf = ReceiveBuffer()

    def done(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        self.buf = ReceiveBuffer()  # what still arrives is dropped, not kept
        yield from ()


def _request_line(line: bytes) -> tuple[str, str | None]:
    """(method, host the target names or None) from a request line, without trusting it."""
    parts = line.split(b" ")
    method = parts[0].decode("ascii", "replace")[:20] if parts and parts[0].isalpha() else "-"
    if len(parts) < 2:
        return method, None
    target = parts[1][:1024].decode("ascii", "replace")
    if method == "CONNECT":
        return method, target
    if "://" in target:
        return method, target.split("://", 1)[1].split("/", 1)[0].rpartition("@")[2]
    return method, None
