"""Issue 9, end to end: a strict request head, mitmproxy's own refusals reported, and the limits
that keep one client from taking the proxy down (egress/proxy/addons/limits.py).

A real `egress serve`, raw sockets on 127.0.0.1, the test upstreams of conftest.
"""

from __future__ import annotations

import asyncio
import re
import resource
import socket
import threading
import time
from pathlib import Path

import conftest
import pytest
from conftest import DEFAULT_POLICY, proxied_session


def send_raw(proxy, data: bytes, timeout: float = 20) -> bytes:
    """Send ``data`` on a new connection; return everything the proxy answers until it closes."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)
    try:
        sock.sendall(data)
        return read_until_closed(sock)
    finally:
        sock.close()


def read_until_closed(sock) -> bytes:
    answer = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        answer += chunk
    return answer


def blocks(proxy, reason: str) -> list[dict]:
    return [e for e in proxy.wait_for_audit(lambda e: e["reason"] == reason)
            if e["decision"] == "block" and e["reason"] == reason]


def metric(proxy, name: str, labels: str) -> float:
    match = re.search(rf"^{name}\{{{labels}\}} (\S+)$", proxy.metrics(), re.M)
    return float(match.group(1)) if match else 0.0


# ----------------------------------------------------------- the request head

# (id, header line) in a request to an allowed host: each was forwarded verbatim before.
BAD_HEADERS = [
    ("obs-fold", b"X-A: a\r\n b"),
    ("obs-fold-tab", b"X-A: a\r\n\tTransfer-Encoding: chunked"),
    ("bare-cr", b"X-A: a\rTransfer-Encoding: chunked"),
    ("nul", b"X-A: a\x00b"),
    ("vertical-tab", b"X-A: a\x0bb"),
    ("escape", b"X-A: \x1b[2Jb"),
    ("del", b"X-A: a\x7fb"),
]


@pytest.mark.parametrize("line", [c[1] for c in BAD_HEADERS], ids=[c[0] for c in BAD_HEADERS])
def test_header_oddities_a_lenient_upstream_could_misread_are_refused(proxy, http_upstream, line):
    port = http_upstream.port
    answer = send_raw(proxy, f"GET http://allowed.test:{port}/small HTTP/1.1\r\nHost: allowed.test:{port}\r\n"
                             .encode() + line + b"\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400")
    assert b"X-Egress-Blocked: allowed.test; reason=protocol" in answer
    assert http_upstream.connections == 0
    assert len(blocks(proxy, "protocol")) == 1


def test_a_control_character_in_the_request_target_is_refused(proxy, http_upstream):
    answer = send_raw(proxy, f"GET http://allowed.test:{http_upstream.port}/a\x00b HTTP/1.1\r\n"
                             f"Host: allowed.test\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 400") and b"reason=protocol" in answer
    assert http_upstream.connections == 0


def test_bare_lf_line_ends_reach_upstream_as_crlf(proxy, http_upstream):
    # mitmproxy splits the head on LF and writes it anew: upstream cannot read it another way.
    port = http_upstream.port
    answer = send_raw(proxy, f"GET http://allowed.test:{port}/small HTTP/1.1\nHost: allowed.test:{port}\n"
                             f"X-A: a\nConnection: close\n\n".encode())
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert http_upstream.requests[-1]["headers"]["X-A"] == "a"


def test_an_oversized_head_gets_431_before_it_is_buffered(proxy, http_upstream):
    # Before: buffered to the end (200 MiB of header took the proxy to 884 MiB).
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=20)
    sock.sendall(f"GET http://allowed.test:{http_upstream.port}/small HTTP/1.1\r\n".encode())
    answer = b""
    try:
        for _ in range(4096):  # up to 32 MiB, stopped by the proxy after 64 KiB
            sock.sendall(b"X-Pad: " + b"a" * 8184 + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        answer = read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 431") and b"reason=protocol" in answer
    assert http_upstream.connections == 0
    assert metric(proxy, "egress_connections_limited_total", 'limit="head-size"') == 1
    assert proxy.rss_peak_kib() < 200 * 1024


def test_a_head_just_under_the_limit_passes(proxy, http_upstream):
    port = http_upstream.port
    head = f"GET http://allowed.test:{port}/small HTTP/1.1\r\nHost: allowed.test:{port}\r\nConnection: close\r\n"
    pad = 64 * 1024 - len(head) - len("X-Pad: \r\n\r\n") - 2
    answer = send_raw(proxy, head.encode() + b"X-Pad: " + b"a" * pad + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


# ------------------------------------------- mitmproxy's own refusals, reported


def test_a_smuggling_attempt_mitmproxy_refuses_is_reported(proxy, http_upstream):
    port = http_upstream.port
    answer = send_raw(proxy, f"POST http://allowed.test:{port}/echo HTTP/1.1\r\nHost: allowed.test:{port}\r\n"
                             f"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 400")
    assert http_upstream.connections == 0
    [event] = blocks(proxy, "protocol")
    assert event["host"] == "allowed.test" and "transfer-encoding and content-length" in event["detail"]


@pytest.mark.parametrize(("request_line", "host"), [
    ("GET http://exa!mple.test/ HTTP/1.1", "exa!mple.test"),
    ("CONNECT exa!mple.test:443 HTTP/1.1", "exa!mple.test:443"),
], ids=["absolute-form", "connect"])
def test_a_malformed_host_in_the_request_line_is_reported(proxy, request_line, host):
    answer = send_raw(proxy, f"{request_line}\r\nHost: x\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 400")
    assert f"X-Egress-Blocked: {host}; reason=invalid-host".encode() in answer
    [event] = blocks(proxy, "invalid-host")
    assert event["host"] == host


def test_an_origin_form_request_with_a_bad_host_header_is_reported(proxy):
    answer = send_raw(proxy, b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400") and b"reason=invalid-host" in answer
    assert len(blocks(proxy, "invalid-host")) == 1


def test_a_request_with_trailers_is_refused_and_reported(proxy, http_upstream):
    # Before: NotImplementedError inside mitmproxy, the connection dropped, nothing reported.
    port = http_upstream.port
    answer = send_raw(proxy, f"POST http://allowed.test:{port}/echo HTTP/1.1\r\nHost: allowed.test:{port}\r\n"
                             f"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 400")
    assert b"X-Egress-Blocked: allowed.test; reason=protocol" in answer
    assert http_upstream.connections == 0
    [event] = blocks(proxy, "protocol")
    assert event["detail"] == "trailers in a chunked request body" and event["method"] == "POST"
    assert not any("crashed" in line for line in proxy.stderr_lines)


# ------------------------------------------------------------------- limits


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(proxy_factory, monkeypatch):
    # As systemd starts a service: 1024 soft, more hard. ~1000 idle connections then refused everyone.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard descriptor limit here is {hard}: nothing to raise")
    command = conftest.egress_command()
    monkeypatch.setattr(conftest, "egress_command",
                        lambda: ["sh", "-c", 'ulimit -Sn 1024 && exec "$@"', "sh", *command])
    proxy = proxy_factory()
    limits = Path(f"/proc/{proxy.process.pid}/limits").read_text()
    soft, hard_seen = re.search(r"^Max open files\s+(\S+)\s+(\S+)", limits, re.M).groups()
    assert soft == hard_seen != "1024"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _hold_tunnels(proxy, count: int, while_held) -> None:
    """Open ``count`` passthrough tunnels to an echo server, check a round trip in each, call
    ``while_held()`` with all of them open, then close them all."""
    ends = []

    async def echo(reader, writer):
        ends.append(writer)
        while data := await reader.read(65536):
            writer.write(data)

    server = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=1024)
    target = f"passthrough.test:{server.sockets[0].getsockname()[1]}"
    gate = asyncio.Semaphore(50)

    async def tunnel(i):
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            writer.write(b"%d;" % i)
            assert await reader.readexactly(len(b"%d;" % i)) == b"%d;" % i
            return writer

    writers = await asyncio.gather(*(tunnel(i) for i in range(count)))
    try:
        await asyncio.to_thread(while_held)
    finally:
        for writer in writers + ends:
            writer.close()
        server.close()
        await asyncio.gather(*(w.wait_closed() for w in writers + ends), return_exceptions=True)


def test_the_memory_of_closed_tunnels_is_given_back(proxy_factory):
    # Each connection leaves objects in reference cycles; held long enough they reach the oldest
    # generation, which CPython then collected only after a quarter as many new long-lived
    # objects: after 10,000 tunnels closed, each worker kept its RSS of 10,000 held (bench/soak.py).
    # mitmproxy's tunnels: serve's front (egress.proxy.fastpath) holds ~4 KiB a passthrough tunnel, not ~25.
    proxy = proxy_factory(DEFAULT_POLICY, "--max-client-connections", "0", "--workers", "1",
                          env={"EGRESS_PASSTHROUGH_FRONT": "off"})
    pid = proxy.process.pid
    asyncio.run(_hold_tunnels(proxy, 50, lambda: None))  # every code path imported once
    _wait_for_no_connection(proxy)
    rest = _rss_mib(pid)
    held: list[float] = []
    asyncio.run(_hold_tunnels(proxy, 2000, lambda: held.append(_rss_mib(pid))))
    _wait_for_no_connection(proxy)
    grown = held[0] - rest
    assert grown > 20, (rest, held)  # ~25 KiB a tunnel
    # Not all of it: what still lives pins some of the allocator's arenas (a third to a half
    # stayed, here and in the soak); before, none of it came back.
    deadline = time.monotonic() + 60
    while held[0] - _rss_mib(pid) < grown / 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held[0] - _rss_mib(pid) >= grown / 3, (rest, held[0], _rss_mib(pid))


def _wait_for_no_connection(proxy) -> None:
    def open_now() -> float:
        return float(re.search(r"^egress_open_connections (\S+)$", proxy.metrics(), re.M).group(1))

    deadline = time.monotonic() + 60
    while open_now() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_now() == 0


def test_connections_per_client_address_are_capped(proxy_factory, http_upstream):
    proxy = proxy_factory(DEFAULT_POLICY, "--max-client-connections", "2")
    held = [socket.create_connection(("127.0.0.1", proxy.port), timeout=20) for _ in range(2)]
    for sock in held:  # both are served
        sock.sendall(f"GET http://allowed.test:{http_upstream.port}/small HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
                     .encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    third = socket.create_connection(("127.0.0.1", proxy.port), timeout=20)
    assert read_until_closed(third) == b""  # closed at once, nothing read from it
    third.close()
    assert metric(proxy, "egress_connections_limited_total", 'limit="client-connections"') == 1
    held.pop().close()
    session = proxied_session(proxy)
    for _ in range(50):  # the freed place is given back once the proxy has seen the close
        try:
            if session.get(http_upstream.url("allowed.test"), timeout=20).status_code == 200:
                break
        except OSError:
            time.sleep(0.1)
    else:
        pytest.fail("no connection was accepted after one of two closed")
    for sock in held:
        sock.close()


def test_a_head_sent_a_byte_at_a_time_is_cut_off(proxy_factory, http_upstream):
    # Every byte was activity for mitmproxy's watchdog: such a head never ended.
    proxy = proxy_factory(DEFAULT_POLICY, "--head-timeout", "1")
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    head = f"GET http://allowed.test:{http_upstream.port}/small HTTP/1.1\r\nX-Slow: ".encode() + b"a" * 10000
    closed = False
    for byte in head:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        time.sleep(0.05)
    if not closed:
        assert read_until_closed(sock) == b""
    sock.close()
    assert http_upstream.connections == 0
    assert metric(proxy, "egress_connections_limited_total", 'limit="head-timeout"') == 1


def test_an_idle_kept_alive_connection_is_closed_after_the_head_timeout(proxy_factory, http_upstream):
    proxy = proxy_factory(DEFAULT_POLICY, "--head-timeout", "1")
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    sock.sendall(f"GET http://allowed.test:{http_upstream.port}/small HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
                 .encode())
    answer = read_until_closed(sock)  # the answer, then the close once the connection idled
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello from upstream\n")


def test_an_idle_passthrough_tunnel_is_closed_after_the_idle_timeout(proxy_factory, https_upstream):
    proxy = proxy_factory(DEFAULT_POLICY, "--idle-timeout", "1")
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=60)
    target = f"passthrough.test:{https_upstream.port}"
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    answer = read_until_closed(sock)  # 200, then nothing more: closed once idle
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200")


# ------------------------------------------- what a client or an upstream holds (issue 26)


class HostileUpstream(conftest.RawServer):
    """An upstream that reads a request (head, and a body of a Content-Length) and then does
    ``behave(upstream, conn)`` (``ssl_context``: TLS first)."""

    def __init__(self, behave, ssl_context=None):
        self.behave = behave
        self.release = threading.Event()
        self.sent = 0
        super().__init__(ssl_context=ssl_context)

    def handle(self, conn):
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return
            data += more
        head, body = data.split(b"\r\n\r\n", 1)
        length = re.search(rb"\r\ncontent-length: *(\d+)", head, re.I)
        while length is not None and len(body) < int(length.group(1)):
            more = conn.recv(1 << 20)
            if not more:
                return
            body += more
        self.behave(self, conn)

    def close(self):
        self.release.set()
        super().close()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _reset_peak(pid: int) -> int:
    """Reset the process's peak RSS (VmHWM) to its RSS now (clear_refs 5); return that RSS in KiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _rss_kib(pid)


def _head_bomb(upstream, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Big: ")
    chunk = b"a" * 65536
    for _ in range(32 * 16):  # 32 MiB, until the proxy stops reading
        conn.sendall(chunk)
        upstream.sent += len(chunk)


@pytest.fixture(params=["http", "https"])
def head_bomb(request, test_ca):
    """(scheme, upstream): an allowed upstream answering ``HTTP/1.1 200 OK`` and a 32 MiB header."""
    context = None
    if request.param == "https":
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        test_ca.issue_cert("allowed.test").configure_cert(context)
    upstream = HostileUpstream(_head_bomb, context)
    yield request.param, upstream
    upstream.close()


def test_an_upstreams_endless_response_head_is_cut_at_the_head_limit(proxy, head_bomb):
    # Before: buffered whole (+100 MiB for 32 MiB), sent back whole as the 502's body (a repr of
    # it), and whole in serve's EGRESS_UPSTREAM_ERROR line.
    scheme, upstream = head_bomb
    session = proxied_session(proxy)
    url = f"{scheme}://allowed.test:{upstream.port}/"
    assert session.get(url, timeout=60).status_code == 502  # every code path imported once
    before = _reset_peak(proxy.process.pid)
    response = session.get(url, timeout=60)
    grown = proxy.rss_peak_kib() - before
    assert response.status_code == 502
    assert response.headers["X-Egress-Error"] == "allowed.test; reason=connect-failed"
    assert response.text == ("EGRESS_UPSTREAM_ERROR allowed.test: the upstream server could not be reached "
                             "(response head over 64 KiB)\n")
    assert upstream.sent < 32 << 20  # the proxy stopped reading
    assert grown < 8 * 1024, grown
    proxy.wait_for_audit(lambda e: len([x for x in proxy.audit() if x["decision"] == "error"]) == 2)
    errors = [(e["reason"], e["detail"]) for e in proxy.audit() if e["decision"] == "error"]
    assert errors == [("connect-failed", "response head over 64 KiB")] * 2
    line = "EGRESS_UPSTREAM_ERROR allowed.test (the upstream server could not be reached: response head over 64 KiB)\n"
    deadline = time.monotonic() + 10  # serve's stderr is read by a thread
    while line not in proxy.stderr_lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [x for x in proxy.stderr_lines if x.startswith("EGRESS_")] == [line]


def _head_then_close(upstream, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 32768)


def test_an_upstreams_unfinished_head_is_named_by_its_start_only(proxy):
    # Before: mitmproxy's "unexpected server response: b'...'" with all of it, as the 502's body.
    upstream = HostileUpstream(_head_then_close)
    try:
        response = proxied_session(proxy).get(f"http://allowed.test:{upstream.port}/", timeout=60)
    finally:
        upstream.close()
    assert response.status_code == 502
    assert response.text.startswith("EGRESS_UPSTREAM_ERROR allowed.test: the upstream server could not be reached "
                                    "(unexpected server response: b'HTTP/1.1 200 OK\\r\\nX-Big: aaaa")
    assert len(response.text) < 400, len(response.text)


def _chunk_line_bomb(upstream, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;x=")
    chunk = b"a" * 65536
    for _ in range(32 * 16):  # 32 MiB, until the proxy stops reading
        conn.sendall(chunk)
        upstream.sent += len(chunk)


def test_an_upstreams_chunk_size_line_without_end_is_cut_at_the_head_limit(proxy):
    upstream = HostileUpstream(_chunk_line_bomb)
    try:
        answer = send_raw(proxy, f"GET http://allowed.test:{upstream.port}/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
                                 .encode())
    finally:
        upstream.close()
    assert answer.startswith(b"HTTP/1.1 200")  # the head had gone to the client: the connection is cut
    assert upstream.sent < 32 << 20
    [event] = [e for e in proxy.wait_for_audit(lambda e: e["decision"] == "error") if e["decision"] == "error"]
    assert (event["reason"], event["detail"]) == (
        "connect-failed", "a chunk size line or trailer of the response body over 64 KiB")


def _client_hello(server_name: str) -> bytes:
    """The first flight of a real TLS client (Python's ssl) for ``server_name``."""
    import ssl

    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=server_name)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def _trickle_until_closed(sock, data: bytes, interval: float, deadline: float) -> bool:
    """Send ``data`` a byte every ``interval`` s; True once the proxy has closed the connection
    (before the last byte, and before the monotonic ``deadline``), False otherwise."""
    import select

    for byte in data:
        if time.monotonic() > deadline:
            return False
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return True
        readable, _, _ = select.select([sock], [], [], interval)
        if readable:
            try:
                if sock.recv(65536) == b"":
                    return True
            except ConnectionResetError:
                return True
    return False


def test_a_tls_handshake_trickled_inside_a_tunnel_is_cut_by_the_head_timeout(proxy_factory, https_upstream):
    # Before: when NextLayer chose the TLS layer the head timer was switched off, as for a relay: a
    # ClientHello sent a byte at a time (each byte within the idle timeout) held the connection for hours.
    proxy = proxy_factory(DEFAULT_POLICY, "--head-timeout", "1")
    hello = _client_hello("allowed.test")
    target = f"allowed.test:{https_upstream.port}"
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    try:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(hello[:5])  # a TLS record header: NextLayer picks the TLS layer
        closed = _trickle_until_closed(sock, hello[5:], 0.3, time.monotonic() + 60)
    finally:
        sock.close()
    assert closed
    assert metric(proxy, "egress_connections_limited_total", 'limit="head-timeout"') == 1
    assert https_upstream.connections == 0


def test_bytes_pipelined_behind_a_waiting_request_are_bounded(proxy, http_upstream):
    # Before: while a request waited for its upstream, everything the client sent behind it was
    # buffered, without limit (160 MiB in 2.3 s); --max-head-size was never consulted.
    pid = proxy.process.pid
    port = http_upstream.port
    for warm in (f"GET http://allowed.test:{port}/small HTTP/1.1\r\nHost: allowed.test\r\nConnection: close",
                 f"GET http://allowed.test:{port}/small HTTP/1.1\r\nHost: allowed.test\r\nX-A: \x00"):
        send_raw(proxy, f"{warm}\r\n\r\n".encode())  # every code path imported once: an answer, a refusal
    before = _reset_peak(pid)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=60)
    try:
        sock.sendall(f"GET http://allowed.test:{port}/hang HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode())
        deadline = time.monotonic() + 30
        while not any(r["path"] == "/hang" for r in http_upstream.requests) and time.monotonic() < deadline:
            time.sleep(0.02)  # the first request is with its upstream: the proxy waits for its answer
        one = f"GET http://allowed.test:{port}/small HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode()
        flood = one * (8 * 1024 * 1024 // len(one))
        refused = False
        try:
            sock.sendall(flood)
        except (BrokenPipeError, ConnectionResetError):
            refused = True
        answer = b""
        if not refused:  # all of it went into the proxy's buffers (or the kernel's): ask for the answer
            http_upstream.release.set()
        answer = read_until_closed(sock)
    finally:
        sock.close()
        http_upstream.release.set()
    grown = proxy.rss_peak_kib() - before
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"X-Egress-Blocked: allowed.test; reason=protocol" in answer
    assert grown < 2 * 1024, grown  # 8 MiB buffered before: +5.9 MiB (the rest waited in the kernel)
    assert [e["detail"] for e in blocks(proxy, "protocol")] == [
        "a NUL byte in the request head", "more than 64 KiB sent behind a request still waiting for its answer"]
    assert [r["path"] for r in http_upstream.requests] == ["/small", "/hang"]  # none of the flood


class EarlyAnswer(conftest.RawServer):
    """A keep-alive upstream that answers each request as soon as its head is in, before reading
    its body (as nginx's ``return 200`` does), then reads the body."""

    def handle(self, conn):
        data = b""
        while True:
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            head, data = data.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"\r\ncontent-length: *(\d+)", head, re.I).group(1))
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            while len(data) < length:
                more = conn.recv(1 << 20)
                if not more:
                    return
                data += more
            data = data[length:]


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_keep_alive_client_uploading_right_after_its_answer_is_not_refused(proxy, test_ca, scheme):
    # An upstream that answers before it reads the body: the client has its whole answer while
    # it still uploads, and sends its next request as soon as its body is out, before mitmproxy
    # has ended the exchange. Before: refused as "sent behind a request still waiting" (curl's
    # repeated uploads to nginx: 24 of 36 over HTTPS).
    context = None
    if scheme == "https":
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        test_ca.issue_cert("allowed.test").configure_cert(context)
    upstream = EarlyAnswer(ssl_context=context)
    session = proxied_session(proxy)
    body = b"u" * (2 * 1024 * 1024)
    try:
        statuses = [session.post(f"{scheme}://allowed.test:{upstream.port}/upload", data=body,
                                 timeout=30).status_code for _ in range(12)]
    finally:
        session.close()
        upstream.close()
    assert statuses == [200] * 12
    assert not [e for e in proxy.audit() if e["decision"] == "block"]


def _part_then_wait(upstream, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4000000\r\n\r\n" + b"b" * 100000)
    upstream.release.wait(60)


def test_bytes_pipelined_while_a_response_streams_are_bounded(proxy):
    # The answer has begun (a large body is streamed): the connection is cut, and the refusal is an event.
    upstream = HostileUpstream(_part_then_wait)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=60)
    try:
        one = f"GET http://allowed.test:{upstream.port}/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode()
        sock.sendall(one)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        try:
            sock.sendall(one * (8 * 1024 * 1024 // len(one)))
        except (BrokenPipeError, ConnectionResetError):
            pass
        read_until_closed(sock)
    finally:
        sock.close()
        upstream.close()
    [event] = blocks(proxy, "protocol")
    assert event["detail"] == "more than 64 KiB sent behind a request still waiting for its answer"


def test_a_chunk_size_line_without_end_is_refused_at_the_head_limit(proxy, http_upstream):
    # Before: h11's chunked reader buffers a chunk size line (its extension) until its line end,
    # whatever its size, and no head timeout runs while a body is read.
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=60)
    try:
        sock.sendall(f"POST http://allowed.test:{http_upstream.port}/echo HTTP/1.1\r\nHost: allowed.test\r\n"
                     f"Transfer-Encoding: chunked\r\n\r\n1;x=".encode())
        try:
            for _ in range(128):  # 8 MiB, stopped by the proxy after 64 KiB
                sock.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"X-Egress-Blocked: allowed.test; reason=protocol" in answer
    [event] = blocks(proxy, "protocol")
    assert event["detail"] == "a chunk size line or trailer of the request body over 64 KiB"
    assert metric(proxy, "egress_connections_limited_total", 'limit="head-size"') == 1


def _ok_when_released(upstream, conn):
    upstream.release.wait(60)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")


def test_memory_that_closed_connections_left_in_reference_cycles_is_given_back(proxy):
    # Flows live in reference cycles; held a while (here: waiting for a slow upstream) they reach
    # the collector's oldest generation. Before: collected only after 1000 closed connections
    # (egress.proxy.reclaim) or CPython's own rule for objects, not bytes: 100 buffered uploads of
    # 900 KiB kept +150 MiB after they had all closed, as long as the proxy ran (P9: 6 zstd
    # uploads, 360 MiB).
    upstream = HostileUpstream(_ok_when_released)
    pid = proxy.process.pid
    rest = _rss_kib(pid)
    body = b"z" * (900 * 1024)
    clients = []
    try:
        for _ in range(100):
            sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=60)
            sock.sendall(f"POST http://allowed.test:{upstream.port}/ HTTP/1.1\r\nHost: allowed.test\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            clients.append(sock)
        deadline = time.monotonic() + 60
        while _rss_kib(pid) - rest < 64 * 1024 and time.monotonic() < deadline:
            time.sleep(0.1)
        held = _rss_kib(pid)
        upstream.release.set()
        for sock in clients:
            assert read_until_closed(sock).startswith(b"HTTP/1.1 200")
    finally:
        for sock in clients:
            sock.close()
        upstream.close()
    _wait_for_no_connection(proxy)
    grown = held - rest
    assert grown > 64 * 1024, (rest, held)
    deadline = time.monotonic() + 60  # the sweep looks every few seconds
    while held - _rss_kib(pid) < grown / 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held - _rss_kib(pid) >= grown / 2, (rest, held, _rss_kib(pid))
