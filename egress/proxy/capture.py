"""`egress run`'s transparent capture, on the proxy's side: what sandbox/capture.py redirects.

Three kinds of handed-over socket, all made inside the command's network namespace:

* the DNS stub (UDP, port 53 of loopback; every query to port 53 anywhere is redirected to
  it). Nothing is ever forwarded: an A or AAAA question for a name is answered with a
  *synthetic* address from :class:`AddressBook` (198.18.0.0/15, fd65:6772:6573::/64), which
  maps back to the name when the command connects to it. So the next step of a command that
  looked up a refused or unlisted name is a connection egress sees and refuses *by name*
  (a 403 with EGRESS_BLOCKED for plain HTTP, a closed connection for TLS, and the line on
  egress run's stderr either way). A name whose labels look like data leaving (egress.core.exfil)
  is answered NXDOMAIN and reported at once (reason ``exfiltration``); other question types
  (TXT, MX, HTTPS...) get an empty answer.
* the capture listener (TCP, any port): the original destination (SO_ORIGINAL_DST) maps
  back to the name; the first bytes say TLS (the SNI is read) or HTTP (the Host header);
  either is handed to the regular proxy exactly as if the client had sent
  ``CONNECT <name>:<port>``, so every guard (policy, Host/SNI must name the tunnel's host,
  credentials, grants and the held prompt, address checks, events, metrics) applies
  unchanged. Anything else is refused: ``EGRESS_BLOCKED github.com:22 (only HTTP(S) passes: ssh)``.
* the NFLOG socket: each packet that is neither TCP nor DNS (UDP, ICMP, ...) is refused in
  the namespace (ICMP port unreachable) and a copy of its headers arrives here to be named.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import struct
from collections.abc import Callable

from egress.core.hosts import InvalidHost, parse_host
from egress.policy.matcher import Decision
from egress.proxy.refusal import refuse_connection

FIRST_BYTES_WAIT = 2.0  # seconds a captured connection may stay silent before it is named and refused
FIRST_BYTES_MAX = 16384  # bytes read to find the TLS SNI or the HTTP Host header
SYNTHETIC_V4 = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking: never a real host
SYNTHETIC_V6 = ipaddress.ip_network("fd65:6772:6573::/64")  # a ULA of our own ("egres")
DNS_TTL = 60

_SO_ORIGINAL_DST = 80
_SOL_IPV6 = 41


class AddressBook:
    """Names the command looked up, each with a synthetic IPv4 and IPv6 address of its own."""

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[str, str]] = {}
        self._by_address: dict[str, str] = {}

    def addresses(self, name: str) -> tuple[str, str]:
        known = self._by_name.get(name)
        if known is None:
            n = len(self._by_name) + 1
            if n >= SYNTHETIC_V4.num_addresses - 1:
                raise OverflowError("the run looked up more names than there are synthetic addresses")
            known = (str(SYNTHETIC_V4[n]), str(SYNTHETIC_V6[n]))
            self._by_name[name] = known
            for address in known:
                self._by_address[address] = name
        return known

    def name(self, address: str) -> str | None:
        """The name behind a synthetic address; None for any other address."""
        if address.startswith("::ffff:"):
            address = address[7:]
        return self._by_address.get(address)


# ----------------------------------------------------------------- what the first bytes say

_METHOD = re.compile(rb"^[A-Z]{3,10} \S+ HTTP/1\.[01]\r?\n")
_HOST = re.compile(rb"\r?\nhost:[ \t]*([^\r\n]*)", re.IGNORECASE)
_PORT_PROTOCOLS = {
    21: "ftp", 22: "ssh", 23: "telnet", 25: "smtp", 53: "dns over TCP", 110: "pop3", 143: "imap",
    389: "ldap", 445: "smb", 465: "smtp", 587: "smtp", 873: "rsync", 993: "imap", 995: "pop3",
    1433: "mssql", 1521: "oracle", 1883: "mqtt", 2049: "nfs", 3306: "mysql", 3389: "rdp",
    5432: "postgresql", 5672: "amqp", 5900: "vnc", 6379: "redis", 6667: "irc", 9092: "kafka",
    9418: "git protocol", 11211: "memcached", 27017: "mongodb",
}
_UDP_PROTOCOLS = {443: "QUIC (HTTP/3)", 80: "QUIC", 123: "ntp", 500: "ipsec", 4500: "ipsec", 1194: "openvpn",
                  51820: "wireguard", 3478: "stun", 19302: "stun", 5353: "mdns", 69: "tftp", 161: "snmp",
                  514: "syslog"}
_IP_PROTOCOLS = {1: "ICMP (ping)", 58: "ICMPv6 (ping)", 132: "SCTP", 47: "GRE", 50: "ESP"}


def is_tls(first: bytes) -> bool:
    return len(first) >= 3 and first[0] == 0x16 and first[1] == 0x03


def is_http(first: bytes) -> bool:
    return bool(_METHOD.match(first)) or first.startswith(b"PRI * HTTP/2.0")


def tls_sni(first: bytes) -> str | None:
    """The server name of a TLS ClientHello (first record only); None if absent or unreadable."""
    try:
        if not is_tls(first) or first[5] != 0x01:
            return None
        p = 5 + 4 + 2 + 32  # record header, handshake header, version, random
        p += 1 + first[p]  # session id
        p += 2 + struct.unpack_from("!H", first, p)[0]  # cipher suites
        p += 1 + first[p]  # compression methods
        end = p + 2 + struct.unpack_from("!H", first, p)[0]
        p += 2
        while p + 4 <= end:
            kind, length = struct.unpack_from("!HH", first, p)
            p += 4
            if kind == 0:  # server_name: list length, type 0 (host_name), name length, name
                name_length = struct.unpack_from("!H", first, p + 3)[0]
                return first[p + 5:p + 5 + name_length].decode("ascii")
            p += length
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def http_host(first: bytes) -> str | None:
    """The Host header's host (no port) of an HTTP/1 request head; None without one."""
    found = _HOST.search(first.split(b"\r\n\r\n", 1)[0])
    if not found:
        return None
    value = found.group(1).strip().decode("latin-1")
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else None
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def claimed_name(first: bytes) -> str | None:
    """The host a captured connection's first bytes name (TLS SNI or HTTP Host), canonical, or None.

    It becomes the target of the CONNECT made up for the connection, so it must be a host name
    or address and nothing else: an SNI may hold any byte (CR, LF, spaces), and a Host header
    anything but CR and LF; either could otherwise write a second line into that CONNECT.
    """
    said = tls_sni(first) if is_tls(first) else http_host(first) if is_http(first) else None
    return _canonical(said) if said else None


def guess_protocol(first: bytes, port: int) -> str:
    """A person's name for a TCP protocol that is not HTTP or TLS, from its first bytes and port."""
    if first.startswith(b"SSH-"):
        return "ssh"
    if first.startswith(b"AMQP"):
        return "amqp"
    if first[:8] == b"\x00\x00\x00\x08\x04\xd2\x16\x2f":
        return "postgresql"
    if re.match(rb"^[0-9a-f]{4}git-(upload|receive)-pack", first):
        return "git protocol"
    if port in _PORT_PROTOCOLS:
        return _PORT_PROTOCOLS[port]
    return "unknown protocol" if first else "nothing sent (a server-first protocol)"


def guess_datagram(protocol: int, port: int | None) -> str:
    if protocol == socket.IPPROTO_UDP:
        return _UDP_PROTOCOLS.get(port, "UDP")
    return _IP_PROTOCOLS.get(protocol, f"IP protocol {protocol}")


def packet_destination(packet: bytes) -> tuple[str, int, int | None] | None:
    """(address, IP protocol, destination port or None) of an IPv4 or IPv6 packet's headers."""
    if not packet:
        return None
    version = packet[0] >> 4
    if version == 4 and len(packet) >= 20:
        header, protocol = (packet[0] & 0xF) * 4, packet[9]
        address = socket.inet_ntop(socket.AF_INET, packet[16:20])
    elif version == 6 and len(packet) >= 40:
        header, protocol = 40, packet[6]
        address = socket.inet_ntop(socket.AF_INET6, packet[24:40])
    else:
        return None
    port = None
    if protocol in (socket.IPPROTO_UDP, socket.IPPROTO_TCP, 132) and len(packet) >= header + 4:
        port = struct.unpack_from("!H", packet, header + 2)[0]
    return address, protocol, port


def nflog_packets(data: bytes) -> list[bytes]:
    """The packets (NFULA_PAYLOAD) in a datagram read from an NFLOG netlink socket."""
    packets = []
    offset = 0
    while offset + 20 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 20:
            break
        if kind == (4 << 8):  # NFNL_SUBSYS_ULOG, NFULNL_MSG_PACKET
            p = offset + 20  # nlmsghdr (16) + nfgenmsg (4)
            end = offset + length
            while p + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, p)
                if alen < 4:
                    break
                if atype & 0x7FFF == 9:  # NFULA_PAYLOAD
                    packets.append(data[p + 4:p + alen])
                p += (alen + 3) & ~3
        offset += (length + 3) & ~3
    return packets


def original_destination(sock: socket.socket) -> tuple[str, int]:
    if sock.family == socket.AF_INET:
        port, raw = struct.unpack_from("!2xH4s", sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16))
        return socket.inet_ntop(socket.AF_INET, raw), port
    port, raw = struct.unpack_from("!2xH4x16s", sock.getsockopt(_SOL_IPV6, _SO_ORIGINAL_DST, 28))
    return socket.inet_ntop(socket.AF_INET6, raw), port


def _canonical(name: str) -> str | None:
    try:
        return parse_host(name).name
    except InvalidHost:
        return None


# ----------------------------------------------------------------------------- the serving


class _ConnectResponseFilter:
    """The regular proxy's answer to the CONNECT we made up for a captured connection: a 200 is
    swallowed (the client never sent a CONNECT); a refusal reaches a plain-HTTP client (it is a
    fine answer to its request) and is dropped for a TLS client, whose connection then closes."""

    def __init__(self, plain_http: bool):
        self.plain_http = plain_http
        self.head = b""
        self.done = False
        self.refused = False

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return b"" if self.refused and not self.plain_http else data
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            return b""
        self.done = True
        head, rest = self.head[:end + 4], self.head[end + 4:]
        self.head = b""
        if head.split(b" ", 2)[1:2] == [b"200"]:
            return rest
        self.refused = True
        return head + rest if self.plain_http else b""


def _writer_class():
    class CaptureWriter(asyncio.StreamWriter):
        filter: _ConnectResponseFilter

        def write(self, data) -> None:
            data = self.filter.feed(bytes(data))
            if data:
                super().write(data)

    return CaptureWriter


class Capture:
    """Serves the capture sockets of one run, beside the regular proxy's handed-over socket.

    ``handle_stream(reader, writer)``: the regular proxy's (egress.proxy.mitm.regular_handler);
    ``decide(host)``: the policy's decision (egress.policy.Decision) for a DNS question;
    ``record(event)``: the run's recorder (its Telling, if any, is awaited before a refused client
    is closed); ``on_activity()``: a connection or query came.
    """

    def __init__(self, handle_stream, decide: Callable, record: Callable,
                 on_activity: Callable[[], None] = lambda: None):
        self.handle_stream = handle_stream
        self.decide = decide
        self.record = record
        self.on_activity = on_activity
        self.book = AddressBook()
        self._tasks: set[asyncio.Task] = set()
        self._closers: list[Callable[[], None]] = []
        self._unnamed: dict[int, tuple[str, str, int]] = {}  # connections still waiting for first bytes

    async def serve(self, sockets: list[tuple[str, socket.socket]]) -> None:
        loop = asyncio.get_running_loop()
        for tag, sock in sockets:
            sock.setblocking(False)
            if tag in ("T", "t"):
                self._spawn(self._accept_loop(sock))
            elif tag in ("D", "d"):
                transport, _ = await loop.create_datagram_endpoint(lambda: _DnsStub(self), sock=sock)
                self._closers.append(transport.close)
            elif tag == "N":
                loop.add_reader(sock.fileno(), self._nflog_readable, sock)
                self._closers.append(lambda s=sock: (loop.remove_reader(s.fileno()), s.close()))

    def close(self) -> None:
        # The run ended while these had sent nothing yet (a client that connected and gave up):
        # still named, from what is known.
        for client, name, port in list(self._unnamed.values()):
            self._block(client, "TCP", name, port, "not-http", guess_protocol(b"", port))
        self._unnamed.clear()
        for close in self._closers:
            close()
        self._closers = []
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _block(self, client: str, method: str, host: str, port: int | None, reason: str, detail: str):
        """Record the refusal; the egress.observe.events.Telling to await before the client learns of it, if any."""
        return refuse_connection(self.record, client, Decision(host, port, False, reason, detail=detail), method=method)

    # -- TCP

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                conn, _ = await loop.sock_accept(listener)
                self.on_activity()
                self._spawn(self._connection(conn))
        finally:
            listener.close()

    async def _connection(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            address, port = original_destination(conn)
        except OSError:
            conn.close()
            return
        name = self.book.name(address) or address
        peer = conn.getpeername()
        client = f"{peer[0]}:{peer[1]}"
        first = b""
        self._unnamed[id(conn)] = (client, name, port)
        try:
            first = await asyncio.wait_for(self._first_bytes(loop, conn), FIRST_BYTES_WAIT)
        except (TimeoutError, OSError):
            pass
        except BaseException:  # cancelled: by close(), which named it, this ends here
            if self._unnamed.pop(id(conn), None) is None:
                conn.close()
                return
            raise
        if self._unnamed.pop(id(conn), None) is None:  # named by close() meanwhile
            conn.close()
            return
        if not (is_tls(first) or is_http(first)):
            telling = self._block(client, "TCP", name, port, "not-http", guess_protocol(first, port))
            if telling is not None:  # the run's line first, then the reset (egress.proxy.addons.line_first)
                await telling.wait()
            conn.close()
            return
        said = claimed_name(first)
        target = name
        if self.book.name(address) is None and said:
            target = said  # a literal address (no lookup through us): the name the client says
        host = f"[{target}]" if ":" in target else target
        reader = asyncio.StreamReader(limit=2 ** 16)
        reader.feed_data(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode() + first)
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock=conn)
        except OSError:
            conn.close()
            return
        writer = _writer_class()(transport, protocol, reader, loop)
        writer.filter = _ConnectResponseFilter(plain_http=not is_tls(first))
        await self.handle_stream(reader, writer)

    @staticmethod
    async def _first_bytes(loop, conn: socket.socket) -> bytes:
        data = await loop.sock_recv(conn, FIRST_BYTES_MAX)
        while data:
            if is_tls(data):
                if len(data) >= 5 and len(data) >= 5 + struct.unpack_from("!H", data, 3)[0]:
                    return data
            elif is_http(data):
                if b"\r\n\r\n" in data:
                    return data
            elif len(data) >= 16 or not re.match(rb"^[A-Z]{0,10}$", data.split(b" ", 1)[0]):
                return data  # neither, whatever comes next
            if len(data) >= FIRST_BYTES_MAX:
                return data
            more = await loop.sock_recv(conn, FIRST_BYTES_MAX - len(data))
            if not more:
                return data
            data += more
        return data

    # -- DNS

    def dns_answer(self, wire: bytes, client: str) -> bytes | None:
        """The stub's answer to one query (None: not a query; dropped)."""
        import dns.exception
        import dns.flags
        import dns.message
        import dns.rcode
        import dns.rdataclass
        import dns.rdatatype
        import dns.rrset

        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        if query.flags & dns.flags.QR or len(query.question) != 1:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        question = query.question[0]
        qname = question.name.to_text(omit_final_dot=True)
        name = _canonical(qname)
        if name is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        decision = self.decide(name)
        if decision.reason == "exfiltration":
            self._block(client, "DNS", name, 53, "exfiltration", decision.detail)
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        if question.rdclass == dns.rdataclass.IN and question.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            v4, v6 = self.book.addresses(name)
            address = v4 if question.rdtype == dns.rdatatype.A else v6
            response.answer.append(dns.rrset.from_text(question.name, DNS_TTL, "IN",
                                                       dns.rdatatype.to_text(question.rdtype), address))
        return response.to_wire()

    # -- UDP and the rest, named from NFLOG

    def _nflog_readable(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return  # ENOBUFS: the kernel dropped copies; the packets themselves were refused anyway
        for packet in nflog_packets(data):
            found = packet_destination(packet)
            if found is None:
                continue
            address, protocol, port = found
            self.on_activity()
            name = self.book.name(address) or address
            method = "UDP" if protocol == socket.IPPROTO_UDP else "IP"
            self._block("", method, name, port, "not-http", guess_datagram(protocol, port))


class _DnsStub(asyncio.DatagramProtocol):
    def __init__(self, capture: Capture):
        self.capture = capture
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.capture.on_activity()
        answer = self.capture.dns_answer(data, f"{addr[0]}:{addr[1]}")
        if answer is not None:
            self.transport.sendto(answer, addr)
