"""egress serve's front: passthrough CONNECTs answered and relayed before mitmproxy.

Measured before (bench/proxy_bench.py, tunnels): a new passthrough tunnel cost egress
1.4-1.9 ms of CPU against squid's 0.3 ms. py-spy put nearly all of it in mitmproxy's
per-connection machinery: a connection handler and its layer stack (HttpProxy, HttpLayer,
HttpStream, NextLayer twice, TCPLayer), nine hooks of which four run as tasks, a flow,
Request and Response objects for the CONNECT. Cutting inside that (options read without
deep copies, tasks named without an environment look-up) measured 1.00x.

So `egress serve` accepts connections here first and reads their first bytes. Only a
connection whose first bytes are one complete ``CONNECT host:port HTTP/1.1`` head that the
mitmproxy path would answer with 200 and relay untouched is served here:

* the head: CRLF line ends only, within ``egress_max_head_bytes``, nothing
  ``limits.bad_head`` refuses, parsed by mitmproxy's own ``http1.read_request_head`` (as
  StrictHttp1Server parses it) and passed by its ``validate_request`` (as HttpStream checks it),
  HTTP/1.1, no body headers, no proxy authentication configured;
* the host: ``Policy.passthrough`` names it (the front can only relay);
* the CONNECT decision, mitmproxy's path's own (egress.proxy.connect.decide_connect: every
  check of CONNECT_CHECKS, the policy, a credential in the name, the address), allows it
  without waiting: its address known without a query (``Resolver.cached``);
* the client is within ``egress_max_client_connections`` (``Limits.admit``).

Everything else -- plain HTTP, intercepted CONNECTs, anything malformed, split over more
than a few reads, refused, or needing a DNS query -- goes to mitmproxy's own connection
handler with every byte read so far, as if mitmproxy had accepted it (its StreamReader is
fed those bytes, then the socket's): its guards decide, refuse and report as before. A
connection that sends nothing is handed over after ``HAND_OVER_AFTER`` seconds; its
per-client count and its head-timeout clock are carried over (``Limits.carry``), so both run
from the accept, as they did.

A tunnel served here does what the mitmproxy path does, in its order: the same ``allow``
event (egress.observe.events.allow_connect, as the Reporter's), 200 with mitmproxy's bytes,
the head timeout until the client's first bytes, the policy looked at again if a reload
replaced it meanwhile (egress.proxy.connect.recheck, as mitmproxy's Passthrough looks again at
that point: denied, off passthrough or its address no longer accepted, the connection is
closed with one block event, nothing dialled), then
the upstream dialled at the pinned address (no event if that fails: the
client's connection is closed, as mitmproxy closes it; no dial timeout, as mitmproxy has none:
the kernel's SYN retries or the idle timeout end a dial nobody answers, and a client's reset
cancels it, but not its FIN, which TCP cannot tell from a half-close), the connect latency observed, both
directions relayed transport to transport and counted into the passthrough byte metrics,
half-closes passed on, the idle timeout, the open-connections gauge, and the per-client
count released at the end.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from mitmproxy.net.http import http1
from mitmproxy.proxy.layers.http import HTTPMode, validate_request

from egress.core.hosts import InvalidHost, parse_host
from egress.observe.events import allow_connect
from egress.proxy.addons.limits import bad_head
from egress.proxy.connect import Allowed, ConnectContext, decide_connect, recheck
from egress.proxy.engine import client_label
from egress.proxy.refusal import refuse_connection

logger = logging.getLogger("egress")

CONNECT = b"CONNECT "
HEAD_END = b"\r\n\r\n"
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"  # mitmproxy's answer, byte for byte
HAND_OVER_AFTER = 1.0  # seconds a new connection may wait here for its first request head
PARTIAL_HEAD = 4096  # a CONNECT head still incomplete past this many bytes goes to mitmproxy
STREAM_LIMIT = 2 ** 16  # asyncio.start_server's StreamReader limit, as mitmproxy's listener has
PAUSE_BUFFER = 256 * 1024  # client bytes held while the upstream connects: reading pauses past it

# connection states
WAIT, HANDED, OPEN, CONNECTING, RELAY, DONE = range(6)


class Front:
    """The listener in front of mitmproxy's handler (``handle_stream(reader, writer)``)."""

    def __init__(self, engine, handle_stream, limits):
        self.engine = engine
        self.handle_stream = handle_stream
        self.limits = limits
        metrics = engine.recorder.metrics
        self.upload, self.download = metrics.passthrough_upload, metrics.passthrough_download
        self.open: set[_Conn] = set()  # connections held here: waiting for a head, or relayed
        self.servers: list[asyncio.Server] = []
        self.served = metrics.front_tunnels
        engine.policy_watchers.append(self.policy_changed)

    # ----------------------------------------------------------------- listening

    async def listen(self, host: str, port: int) -> list[tuple[str, int]]:
        """Listen as mitmproxy's regular-mode listener does (asyncio's own binding of ``host``;
        for port 0, one free port for every address); the bound addresses."""
        loop = asyncio.get_running_loop()
        if port == 0:
            try:  # mitmproxy's way to one port for IPv4 and IPv6 (its mode_servers.listen)
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("", 0))
                    chosen = s.getsockname()[1]
                server = await loop.create_server(self._protocol, host, chosen)
            except OSError:
                server = await loop.create_server(self._protocol, host, 0)
        else:
            server = await loop.create_server(self._protocol, host, port)
        self.servers.append(server)
        return [sock.getsockname()[:2] for sock in server.sockets]

    async def serve_socket(self, sock: socket.socket) -> asyncio.Server:
        sock.setblocking(False)
        server = await asyncio.get_running_loop().create_server(self._protocol, sock=sock)
        self.servers.append(server)
        return server

    def close(self) -> None:
        """Stop listening and end every connection held here (handed-over ones are mitmproxy's)."""
        for server in self.servers:
            server.close()
        for conn in list(self.open):
            conn.close()

    def _protocol(self) -> _Conn:
        return _Conn(self)

    # ----------------------------------------------------------------- deciding

    def check(self, head: bytes):
        """(host, port, rule, address) if the mitmproxy path would answer this head with 200 and
        relay the tunnel untouched to that address; None for anything else."""
        engine, limits = self.engine, self.limits
        if engine.proxy_auth is not None or len(head) > limits.max_head_bytes:
            return None
        lines = head[:-4].split(b"\r\n")
        for line in lines:
            if b"\r" in line or b"\n" in line:  # a bare CR or LF: mitmproxy's reading of it decides
                return None
        if bad_head(lines) is not None:
            return None
        try:
            request = http1.read_request_head(lines)
        except ValueError:
            return None
        if (request.method != "CONNECT" or request.http_version != "HTTP/1.1"
                or "content-length" in request.headers or "transfer-encoding" in request.headers):
            return None
        # mitmproxy's HttpStream refuses a head whose header names are not tokens ("Host : x",
        # "X Y: z") after read_request_head took them: measured, a 200 here, mitmproxy's 400 there.
        # Its own check, validate_inbound_headers on as mitmproxy's default is (were it turned
        # off, such a head is only handed over: mitmproxy then serves it).
        if validate_request(HTTPMode.regular, request, True) is not None:
            return None
        written, port = request.host, request.port
        try:
            host = parse_host(written)
        except InvalidHost:
            return None
        if engine.policy.passthrough(host, port) is None:  # mitmproxy's path intercepts it
            return None
        allowed = decide_connect(engine, ConnectContext(host, port, written))
        if not isinstance(allowed, Allowed):  # refused, or decided only with a wait: mitmproxy's path
            return None
        if allowed.lookup is not None:  # served here: mitmproxy's path will not observe it
            engine.recorder.metrics.dns_lookup.observe(allowed.lookup)
        return host, port, allowed.rule, allowed.address

    def recheck(self, host, port: int, ip):
        """None if the policy in force still lets this tunnel's first bytes go to ``ip`` untouched;
        else the refusal. The decision was made at the CONNECT, the dial waits for the client's
        first bytes (up to the head timeout): a reload in between must apply to it. A host taken
        off passthrough is refused: mitmproxy's path would intercept it now, this one cannot."""
        return recheck(self.engine, host, port, ip, relay_only=True)

    def policy_changed(self) -> None:
        """Close every tunnel held here whose host or address the policy now in force refuses,
        one block event each, as egress.proxy.addons.tunnels closes mitmproxy's: a relay has no next
        request to decide again at (red-team P8). One only taken off passthrough is left to _dial."""
        for conn in list(self.open):
            if conn.state is not OPEN and conn.state is not CONNECTING and conn.state is not RELAY:
                continue
            refusal = recheck(self.engine, conn.host, conn.port, conn.ip)
            if refusal is not None:
                refuse_connection(self.engine.recorder.record, client_label(conn.peername), refusal)
                conn.close()

    def record(self, peername, host, port: int, rule) -> None:
        """The event Reporter.http_connect records for an allowed CONNECT."""
        allow_connect(self.engine.recorder, client_label(peername), host.name, port, rule)


class _Conn(asyncio.Protocol):
    """One client connection: its first head awaited here, then handed over or relayed."""

    def __init__(self, front: Front):
        self.front = front
        self.state = WAIT
        self.transport = None
        self.up = None  # the upstream transport
        self.dial = None  # the task opening it
        self.buf = b""
        self.timer = None
        self.counted = None  # the client address counted against the per-client limit
        self.client_eof = self.up_eof = False
        self.paused = False  # the client's reading paused while the upstream connects
        self.up_full = False  # the upstream's write buffer past its high-water mark

    # ---------------------------------------------------------------- accepted

    def connection_made(self, transport) -> None:
        front, limits = self.front, self.front.limits
        self.transport = transport
        self.accepted = time.monotonic()
        self.peername = transport.get_extra_info("peername")
        self.sockname = transport.get_extra_info("sockname")
        if self.peername and limits.max_client_connections > 0:
            if not limits.admit(self.peername[0]):
                self.hand_over(carry=False)  # mitmproxy refuses it, as any connection past the limit
                return
            self.counted = self.peername[0]
        front.open.add(self)
        # at most a quarter of the head timeout, the granularity of the sweep that enforces it
        wait = min(HAND_OVER_AFTER, limits.head_timeout / 4) if limits.head_timeout > 0 else HAND_OVER_AFTER
        self.timer = asyncio.get_running_loop().call_later(wait, self.hand_over)

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state is RELAY:
            up = self.up
            if not up.is_closing():  # as mitmproxy writes only to a connection not closing
                up.write(data)
            self.last = time.monotonic()
            self.front.upload.inc(len(data))
        elif state is WAIT:
            self.buf += data
            self._decide()
        elif state is OPEN or state is CONNECTING:
            self.buf += data
            if state is OPEN:
                self._dial()
            elif len(self.buf) > PAUSE_BUFFER and not self.paused:
                self.paused = True
                self.transport.pause_reading()

    def eof_received(self):
        state = self.state
        if state is WAIT:
            return self.hand_over(eof=True)
        self.client_eof = True
        if state is RELAY:
            if self.up_eof:
                self.close()
            else:
                self.up.write_eof()
            return True
        if state is CONNECTING:
            return True  # passed on once the upstream is there
        self.close()  # no tunnel byte yet: nothing to relay
        return False

    def connection_lost(self, exc) -> None:
        state = self.state
        if state is WAIT:
            self.hand_over(lost=exc or True)
        elif state is not DONE and state is not HANDED:
            # Lost (a reset, a failed write: a half-close is eof_received), nothing reaches the
            # client any more: both ends closed, what is queued upstream still written. Measured
            # before, when the upstream was only half-closed here: an upstream that streams and
            # ignores EOF kept each such tunnel (its slot, its socket) past the idle timeout, for
            # ever, the bytes it sent dropped; mitmproxy's path closed them.
            self.close()

    def pause_writing(self) -> None:  # the client's buffer is full: stop reading the upstream
        if self.up is not None:
            self.up.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None:
            self.up.resume_reading()

    # ------------------------------------------------------------ the decision

    def _decide(self) -> None:
        buf = self.buf
        end = buf.find(HEAD_END)
        if end < 0:
            if len(buf) < PARTIAL_HEAD and (CONNECT.startswith(buf) if len(buf) < len(CONNECT)
                                            else buf.startswith(CONNECT)):
                return  # the rest of a CONNECT head may follow (until HAND_OVER_AFTER)
            self.hand_over()
            return
        try:
            go = self.front.check(buf[:end + 4])
        except Exception as e:  # mitmproxy's guards decide (and refuse, fail-closed, if they break too)
            logger.error(f"the passthrough front failed ({type(e).__name__}); handed to mitmproxy")
            go = None
        if go is None:
            self.hand_over()
            return
        self._open(end + 4, *go)

    def hand_over(self, eof: bool = False, lost=None, carry: bool = True):
        """Give the connection to mitmproxy's handler with every byte read so far."""
        if self.state is not WAIT:
            return None
        front = self._leave(HANDED)
        if carry:
            front.limits.carry(self.peername, self.sockname, self.counted, self.accepted)
        transport = self.transport
        protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=STREAM_LIMIT), front.handle_stream)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)  # the writer and mitmproxy's handler task, as start_server makes them
        if self.buf:
            protocol.data_received(self.buf)
            self.buf = b""
        keep_open = None
        if eof:
            keep_open = protocol.eof_received()
        if lost is not None:
            protocol.connection_lost(lost if isinstance(lost, BaseException) else None)
        return keep_open

    # -------------------------------------------------------------- the tunnel

    def _open(self, head_length: int, host, port: int, rule, ip) -> None:
        front = self.front
        if self.timer is not None:
            self.timer.cancel()
        self.state = OPEN
        # CR and LF bytes that came with the head are dropped, as mitmproxy's HTTP/1 reader drops
        # them when it makes the tunnel (Http1Connection.make_pipe): some clients send a blank
        # line more after a CONNECT. Measured before: relayed here, so the two paths sent an
        # upstream different first bytes for the same input. What arrives after the 200 is relayed.
        self.buf = self.buf[head_length:].lstrip(b"\r\n")
        self.host, self.port, self.ip = host, port, ip
        self.generation = front.engine.policy_generation  # _dial looks again if the policy changed
        front.record(self.peername, host, port, rule)
        front.engine.recorder.metrics.open_connections.inc()
        front.limits.reclaimer.opened()
        front.served.inc()
        self.transport.write(ESTABLISHED)
        self.last = self.waiting = time.monotonic()
        self._arm()
        if self.buf:  # bytes sent right behind the head: the tunnel's first
            self._dial()

    def _dial(self) -> None:
        front = self.front
        if front.engine.policy_generation != self.generation:
            refusal = front.recheck(self.host, self.port, self.ip)
            if refusal is not None:  # one block event, the connection closed, nothing dialled
                refuse_connection(front.engine.recorder.record, client_label(self.peername), refusal)
                self.close()
                return
        self.state = CONNECTING
        self.waiting = None  # the head timeout ends where mitmproxy's relay would be chosen
        self.started = time.time()
        if len(self.buf) > PAUSE_BUFFER:
            self.paused = True
            self.transport.pause_reading()
        loop = asyncio.get_running_loop()
        self.dial = loop.create_task(loop.create_connection(lambda: _Upstream(self), str(self.ip), self.port))
        self.dial.add_done_callback(self._dialled)

    def _dialled(self, task: asyncio.Task) -> None:
        self.dial = None
        if task.cancelled():
            self.close()
            return
        error = task.exception()
        if self.state is not CONNECTING:  # the client went away meanwhile
            if error is None:
                task.result()[0].close()
            return
        if error is not None:  # as mitmproxy: the client's connection closed, no event
            self.close()
            return
        metrics = self.front.engine.recorder.metrics
        metrics.upstream_connect.observe(time.time() - self.started)
        self.state = RELAY
        up = self.up
        if self.buf:
            self.front.upload.inc(len(self.buf))
            up.write(self.buf)
            self.buf = b""
        if self.client_eof:
            up.write_eof()
        if self.paused:
            self.paused = False
            # Not if the write above filled the upstream's buffer: its pause_writing paused the
            # client, and its resume_writing resumes it. Resumed here regardless, the client's
            # bytes were buffered without end (pause_writing comes once): measured with an
            # upstream whose MSS is 536 and which does not read, 1.5 GB in the front's buffer.
            if not self.up_full:
                self.transport.resume_reading()

    def _arm(self) -> None:
        limits = self.front.limits
        delays = [t for t in (limits.idle_timeout, limits.head_timeout if self.waiting is not None else 0) if t > 0]
        if delays:
            self.timer = asyncio.get_running_loop().call_later(min(delays), self._tick)

    def _tick(self) -> None:
        self.timer = None
        if self.state is DONE:
            return
        limits, now = self.front.limits, time.monotonic()
        if self.waiting is not None and 0 < limits.head_timeout <= now - self.waiting:
            self.front.engine.recorder.metrics.connections_limited.labels("head-timeout").inc()
            self.close()
            return
        if 0 < limits.idle_timeout <= now - self.last:
            self.close()
            return
        delays = [limits.idle_timeout - (now - self.last)] if limits.idle_timeout > 0 else []
        if self.waiting is not None and limits.head_timeout > 0:
            delays.append(limits.head_timeout - (now - self.waiting))
        if delays:
            self.timer = asyncio.get_running_loop().call_later(max(0.01, min(delays)), self._tick)

    def _leave(self, state: int) -> Front:
        """This connection is no longer the front's to time or to close at its close()."""
        self.state = state
        self.front.open.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return self.front

    def close(self) -> None:
        """End both connections (what is queued is still written) and give back what was counted."""
        state = self.state
        if state is DONE or state is HANDED:
            return
        front = self._leave(DONE)
        self.transport.close()
        if self.up is not None:
            self.up.close()
        if self.dial is not None:  # still connecting: stop (a blackholed SYN would take minutes)
            self.dial.cancel()
        if self.counted is not None:
            front.limits.release(self.counted)
            self.counted = None
        if state is not WAIT:
            front.engine.recorder.metrics.open_connections.dec()
            front.limits.reclaimer.closed_one()


class _Upstream(asyncio.Protocol):
    """The upstream side of a tunnel served by the front."""

    __slots__ = ("conn",)

    def __init__(self, conn: _Conn):
        self.conn = conn

    def connection_made(self, transport) -> None:
        self.conn.up = transport

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        client = conn.transport
        if not client.is_closing():
            client.write(data)
        conn.last = time.monotonic()
        conn.front.download.inc(len(data))

    def eof_received(self):
        conn = self.conn
        conn.up_eof = True
        if conn.client_eof:
            conn.close()
        elif not conn.transport.is_closing():
            conn.transport.write_eof()
        return True

    def connection_lost(self, exc) -> None:
        conn = self.conn
        if conn.state is not RELAY:
            return
        if not conn.client_eof and not conn.transport.is_closing():
            conn.up_eof = True
            conn.transport.write_eof()  # the client may still send; it ends when it closes
        else:
            conn.close()

    def pause_writing(self) -> None:  # the upstream's buffer is full: stop reading the client
        self.conn.up_full = True
        self.conn.transport.pause_reading()

    def resume_writing(self) -> None:
        self.conn.up_full = False
        self.conn.transport.resume_reading()
