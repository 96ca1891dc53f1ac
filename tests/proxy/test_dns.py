"""Resolution through a real DNS server the test runs on 127.0.0.1 (`serve --dns-server`).

Proves the dnspython path: answers are classified (a name resolving to loopback is
refused), each client connection resolves once and dials what it checked (a DNS
rebinding answer cannot redirect it), and failures answer 502/504 with the reason.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from conftest import proxied_session


class DnsServer:
    """Answers A queries from ``answers[name]`` (a list consumed in turn; the last repeats)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answers: dict[str, list[str]] = {}
        self.silent: set[str] = set()
        self.queries: list[tuple[str, str]] = []
        self.ttl = 0  # of every answer (and, for a name with no AAAA, of the SOA saying so)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            query = dns.message.from_wire(data)
            question = query.question[0]
            name = question.name.to_text().rstrip(".")
            self.queries.append((name, dns.rdatatype.to_text(question.rdtype)))
            if name in self.silent:
                continue
            response = dns.message.make_response(query)
            if name not in self.answers:
                response.set_rcode(dns.rcode.NXDOMAIN)
            elif question.rdtype == dns.rdatatype.A:
                queue = self.answers[name]
                address = queue.pop(0) if len(queue) > 1 else queue[0]
                response.answer.append(dns.rrset.from_text(question.name, self.ttl, "IN", "A", address))
            elif self.ttl:  # no data of this type, for that long (RFC 2308: the SOA's TTL and minimum)
                response.authority.append(dns.rrset.from_text(
                    question.name, self.ttl, "IN", "SOA", f"ns.test. admin.test. 1 60 60 60 {self.ttl}"))
            self.sock.sendto(response.to_wire(), peer)

    def a_queries(self, name: str) -> int:
        return sum(1 for n, kind in self.queries if n == name and kind == "A")

    def close(self):
        self.sock.close()


@pytest.fixture
def dns_server():
    server = DnsServer()
    yield server
    server.close()


def _server_on(address: str, port: int = 0, label: bytes = b""):
    seen = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(self.path)
            body = label
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((address, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def start(proxy_factory, dns_server, policy: str, *extra: str):
    return proxy_factory(policy, "--dns-server", f"127.0.0.1:{dns_server.port}", *extra, names=[])


def test_a_name_that_resolves_to_loopback_is_refused(proxy_factory, dns_server, http_upstream):
    dns_server.answers["sneaky.test"] = ["127.0.0.1"]
    proxy = start(proxy_factory, dns_server, 'allow = ["sneaky.test"]\n')
    response = proxied_session(proxy).get(f"http://sneaky.test:{http_upstream.port}/small", timeout=20)
    assert response.status_code == 403
    assert response.headers["X-Egress-Blocked"] == "sneaky.test; reason=private-address"
    assert dns_server.a_queries("sneaky.test") >= 1
    assert http_upstream.connections == 0


def test_a_denied_name_is_never_even_looked_up(proxy_factory, dns_server):
    dns_server.answers["nope.test"] = ["127.0.0.1"]
    proxy = start(proxy_factory, dns_server, 'allow = ["other.test"]\n')
    response = proxied_session(proxy).get("http://nope.test/", timeout=20)
    assert response.status_code == 403
    assert dns_server.queries == []


def test_rebinding_cannot_redirect_a_checked_connection(proxy_factory, dns_server):
    good, good_seen = _server_on("127.0.0.2", 0, b"good")
    port = good.server_address[1]
    victim, victim_seen = _server_on("127.0.0.3", port, b"victim")
    try:
        # First answer: an address the policy lets this name use; every later one: another.
        dns_server.answers["rebind.test"] = ["127.0.0.2", "127.0.0.3"]
        proxy = start(proxy_factory, dns_server,
                      'allow = ["rebind.test"]\nallow_private = ["127.0.0.2/32"]\n')
        session = proxied_session(proxy)
        bodies = [session.get(f"http://rebind.test:{port}/{i}", timeout=20).content for i in range(3)]
        assert bodies == [b"good"] * 3
        assert dns_server.a_queries("rebind.test") == 1  # resolved once for the connection
        # A new connection resolves again, gets 127.0.0.3, and that answer is checked too.
        fresh = proxied_session(proxy).get(f"http://rebind.test:{port}/again", timeout=20)
        assert fresh.status_code == 403
        assert "resolves to 127.0.0.3, loopback" in fresh.text
        assert victim_seen == [] and len(good_seen) == 3
    finally:
        for server in (good, victim):
            server.shutdown()
            server.server_close()


def test_localhost_names_are_loopback_and_never_asked_of_dns(proxy_factory, dns_server, http_upstream):
    # RFC 6761: localhost is loopback whatever a DNS server says (this one would say 10.0.0.9).
    for name in ("localhost", "app.localhost"):
        dns_server.answers[name] = ["10.0.0.9"]
    proxy = start(proxy_factory, dns_server, 'allow = ["localhost"]\n')
    session = proxied_session(proxy)
    for name in ("localhost", "app.localhost"):
        response = session.get(f"http://{name}:{http_upstream.port}/small", timeout=20)
        assert response.status_code == 403
        assert response.headers["X-Egress-Blocked"] == f"{name}; reason=private-address"
        assert response.text.splitlines()[0] == (
            f'EGRESS_BLOCKED {name}: resolves to 127.0.0.1 and ::1, loopback; to allow it, add "127.0.0.1" to '
            f'the policy\'s allow_private list: allow_private = ["127.0.0.1"]')
    assert http_upstream.connections == 0
    # allowed to be loopback: dialled at 127.0.0.1, still without a lookup
    proxy = start(proxy_factory, dns_server, 'allow = ["localhost"]\nallow_private = ["127.0.0.1"]\n')
    response = proxied_session(proxy).get(f"http://app.localhost:{http_upstream.port}/small", timeout=20)
    assert response.status_code == 200 and response.text == "hello from upstream\n"
    assert dns_server.queries == []


def test_unknown_name_answers_502_dns_failed(proxy_factory, dns_server):
    proxy = start(proxy_factory, dns_server, 'allow = ["missing.test"]\n')
    response = proxied_session(proxy).get("http://missing.test/", timeout=20)
    assert response.status_code == 502
    assert response.headers["X-Egress-Error"] == "missing.test; reason=dns-failed"
    assert response.text.startswith("EGRESS_UPSTREAM_ERROR missing.test: the name does not resolve")


def test_silent_dns_answers_504_dns_timeout(proxy_factory, dns_server):
    dns_server.silent.add("slow.test")
    proxy = start(proxy_factory, dns_server, 'allow = ["slow.test"]\n', "--dns-timeout", "1")
    response = proxied_session(proxy).get("http://slow.test/", timeout=30)
    assert response.status_code == 504
    assert response.headers["X-Egress-Error"] == "slow.test; reason=dns-timeout"


def test_the_resolvers_cached_answer_is_what_resolve_returned(dns_server):
    # egress.proxy.fastpath decides only on Resolver.cached: it must give what resolve() would, or None.
    import asyncio

    from egress.core.hosts import parse_host
    from egress.proxy.resolver import ResolveError, Resolver

    dns_server.ttl = 60
    dns_server.answers["kept.test"] = ["127.0.0.7"]
    resolver = Resolver(timeout=5, nameserver=("127.0.0.1", dns_server.port))
    kept, missing = parse_host("kept.test"), parse_host("missing.test")
    assert resolver.cached(kept) is None  # nothing asked yet

    async def main():
        first = await resolver.resolve(kept)
        with pytest.raises(ResolveError):
            await resolver.resolve(missing)
        return first

    first = asyncio.run(main())
    assert resolver.cached(kept) == first == [ipaddress.ip_address("127.0.0.7")]
    assert resolver.cached(missing) is None  # resolve() fails for it: that is the guard's to say
    assert resolver.cached(parse_host("127.0.0.9")) == [ipaddress.ip_address("127.0.0.9")]
    assert resolver.cached(parse_host("localhost")) is not None

    dns_server.ttl = 0  # answers that may not be kept are not
    dns_server.answers["brief.test"] = ["127.0.0.8"]
    asyncio.run(resolver.resolve(parse_host("brief.test")))
    assert resolver.cached(parse_host("brief.test")) is None
