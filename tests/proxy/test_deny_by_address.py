"""Deny wins, also by address: an IP or CIDR on the deny list refuses every name resolving into it.

Red-team finding P17: with ``deny = ["127.0.0.2"]`` the literal was refused, but
``any.name.test`` (resolved to 127.0.0.2) was served by the denied address. Here every name
resolves to 127.0.0.1 (--resolve), the address the deny list names, and each road is tried
with real clients against real upstreams: plain HTTP (curl), an intercepted TLS tunnel (curl),
and a passthrough tunnel with serve's front on and off (a raw CONNECT). Each must be
egress's refusal (403, X-Egress-Blocked, ``EGRESS_BLOCKED <host>: ...`` naming the entry and
the address) with nothing dialled.
"""

from __future__ import annotations

import socket

import pytest
from conftest import EchoServer as Echo, run_curl, start_upstream, stop_upstream

NAMES = ["allowed.test", "other.test", "passthrough.test"]
OFF = {"EGRESS_PASSTHROUGH_FRONT": "off"}

POLICIES = {
    # network "all": the deny list is the only restriction; allow_private only makes loopback
    # reachable at all (a public denied range would not need it)
    "all, an address": ('network = "all"\ndeny = ["127.0.0.1"]\nallow_private = ["127.0.0.0/8"]\n'
                        'passthrough = ["passthrough.test"]\n', "127.0.0.1"),
    "all, a range": ('network = "all"\ndeny = ["127.0.0.0/24"]\nallow_private = ["127.0.0.0/8"]\n'
                     'passthrough = ["passthrough.test"]\n', "127.0.0.0/24"),
    # allow-list mode: the name is allowed (and may reach loopback), its address is denied
    "allow list": ('allow = ["allowed.test", "other.test", "passthrough.test"]\ndeny = ["127.0.0.1"]\n'
                   'passthrough = ["passthrough.test"]\n'
                   'allow_private = ["allowed.test", "other.test", "passthrough.test"]\n', "127.0.0.1"),
}


@pytest.fixture(params=list(POLICIES))
def denied(request, proxy_factory):
    text, entry = POLICIES[request.param]
    proxy = proxy_factory(text, names=NAMES)
    return proxy, entry


@pytest.fixture
def upstreams(test_ca):
    plain, tls = start_upstream(), start_upstream(test_ca)
    yield plain, tls
    stop_upstream(plain)
    stop_upstream(tls)


def refusal_line(host: str, entry: str, address: str = "127.0.0.1") -> str:
    """The first line of the refusal: the address the name resolved to, and the deny entry."""
    return f"EGRESS_BLOCKED {host}: on the deny list (resolves to {address}, covered by the deny entry {entry})"


def test_a_name_resolving_to_a_denied_address_is_refused_over_plain_http(denied, upstreams, curl_path, tmp_path):
    proxy, entry = denied
    plain, _ = upstreams
    result = run_curl(curl_path, proxy, plain.url("other.test"), "-i", home=tmp_path)
    head, _, body = result.stdout.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 403"), result.stdout
    assert "X-Egress-Blocked: other.test; reason=denied" in head.splitlines()
    line = body.splitlines()[0]
    assert line == refusal_line("other.test", entry)
    assert plain.connections == 0 and plain.requests == []
    [event] = proxy.wait_for_audit(lambda e: e["reason"] == "denied")
    assert (event["decision"], event["host"]) == ("block", "other.test")
    assert event["detail"] == f"resolves to 127.0.0.1, covered by the deny entry {entry}"
    assert event["rule"].startswith(f"{entry} (") and "policy.toml:" in event["rule"]  # the file and line


def test_a_name_resolving_to_a_denied_address_is_refused_in_an_intercepted_tunnel(
        denied, upstreams, curl_path, tmp_path):
    proxy, entry = denied
    _, tls = upstreams
    result = run_curl(curl_path, proxy, tls.url("allowed.test"), "-v", home=tmp_path)
    assert result.returncode != 0
    assert "< HTTP/1.1 403" in result.stderr.decode() and "< X-Egress-Blocked: allowed.test; reason=denied" in \
        result.stderr.decode(), result.stderr
    assert tls.connections == 0 and tls.requests == []


def connect(proxy, target: str, then: bytes = b"") -> bytes:
    """A CONNECT head (and ``then`` right behind it); the proxy's whole answer, until it closes
    or its body (Content-Length) is complete."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=20) as sock:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode() + then)
        answer = b""
        while True:
            head, sep, body = answer.partition(b"\r\n\r\n")
            if sep and (length := next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                                        if line.lower().startswith(b"content-length:")), None)) is not None:
                if len(body) >= length:
                    return answer
            elif sep and then and body:  # a tunnel: what came back through it
                return answer
            chunk = sock.recv(65536)
            if not chunk:
                return answer
            answer += chunk


@pytest.mark.parametrize("front", ["front", "front off"])
def test_a_name_resolving_to_a_denied_address_is_refused_on_the_passthrough_road(
        proxy_factory, front, request):
    text, entry = POLICIES["all, an address"]
    echo = Echo()
    request.addfinalizer(echo.close)
    proxy = proxy_factory(text, names=NAMES, env=None if front == "front" else OFF)
    answer = connect(proxy, f"passthrough.test:{echo.port}", b"ping")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), answer
    assert b"X-Egress-Blocked: passthrough.test; reason=denied" in head.split(b"\r\n")
    assert body.decode().splitlines()[0] == refusal_line("passthrough.test", entry)
    assert echo.accepted == 0


def test_the_literal_and_another_address_are_unchanged(proxy_factory, upstreams, curl_path, tmp_path):
    # The literal was refused before (decide); a name whose address no deny entry covers still passes.
    text = 'network = "all"\ndeny = ["127.0.0.2"]\nallow_private = ["127.0.0.0/8"]\n'
    proxy = proxy_factory(text, names=NAMES)
    plain, _ = upstreams
    ok = run_curl(curl_path, proxy, plain.url("other.test"), "-o", "/dev/null", "-w", "%{http_code}", home=tmp_path)
    assert ok.stdout == b"200"
    literal = run_curl(curl_path, proxy, f"http://127.0.0.2:{plain.port}/small", "-i", home=tmp_path)
    assert literal.stdout.startswith(b"HTTP/1.1 403") and b"reason=denied" in literal.stdout
    assert len(plain.requests) == 1
