"""Proxy authentication (egress.proxy.auth): `egress serve --auth`, and egress run's per-run secret
on macOS, on a real proxy with real clients. Without the secret a client gets 407 and nothing
else: no policy answer, no event, no upstream connection."""

from __future__ import annotations

import base64
import socket

import pytest
from conftest import DEFAULT_POLICY, run_curl

from egress.proxy.auth import accepts, parse

SECRET = "s3cret-Only_the-run-knows"


def _basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("header,ok", [
    (_basic(f"egress:{SECRET}"), True),
    ("basic " + base64.b64encode(f"egress:{SECRET}".encode()).decode(), True),  # the scheme in any case
    (_basic(f"egress:{SECRET}x"), False),
    (_basic(f"other:{SECRET}"), False),
    (_basic("egress:"), False),
    ("Bearer " + SECRET, False),
    ("Basic !!!notbase64", False),
    ("Basic", False),
    ("", False),
    (None, False),
    ("Basic " + base64.b64encode(f"egress:{SECRET}".encode()).decode() + "é", False),
])
def test_accepts_exactly_the_credentials(header, ok):
    assert accepts(header, f"egress:{SECRET}".encode()) is ok


@pytest.mark.parametrize("text", ["nouser", ":pass", "user:", "a b:c", "user:pa\nss"])
def test_parse_refuses_what_is_not_user_and_password(text):
    with pytest.raises(ValueError):
        parse(text)


@pytest.fixture
def auth_proxy(proxy_factory):
    return proxy_factory(DEFAULT_POLICY, "--auth", f"egress:{SECRET}")


def _with_secret(proxy, secret=SECRET) -> object:
    class WithSecret:
        url = f"http://egress:{secret}@127.0.0.1:{proxy.port}"
        ca_path = proxy.ca_path
    return WithSecret


def test_serve_says_it_asks_for_credentials(auth_proxy):
    assert any("clients must authenticate as egress" in line for line in auth_proxy.stderr_lines)
    assert not any(SECRET in line for line in auth_proxy.stderr_lines)


def test_without_the_secret_a_client_gets_407_and_nothing_else(auth_proxy, http_upstream, https_upstream,
                                                                  curl_path, tmp_path):
    plain = run_curl(curl_path, auth_proxy, http_upstream.url("allowed.test"), "-i", home=tmp_path)
    assert plain.stdout.startswith(b"HTTP/1.1 407")
    assert b'Proxy-Authenticate: Basic realm="egress"' in plain.stdout
    refused = run_curl(curl_path, auth_proxy, http_upstream.url("other.test"), "-i", home=tmp_path)
    assert refused.stdout.startswith(b"HTTP/1.1 407") and b"EGRESS_BLOCKED" not in refused.stdout
    tunnel = run_curl(curl_path, auth_proxy, https_upstream.url("allowed.test"), home=tmp_path)
    assert tunnel.returncode != 0 and b"407" in tunnel.stderr
    wrong = run_curl(curl_path, _with_secret(auth_proxy, "guess"), http_upstream.url("allowed.test"), "-i",
                     home=tmp_path)
    assert wrong.stdout.startswith(b"HTTP/1.1 407")
    assert http_upstream.requests == [] and https_upstream.requests == []
    # Nothing was decided, so nothing was recorded: a stranger cannot fill the audit log or ask for grants.
    authorised = run_curl(curl_path, _with_secret(auth_proxy), http_upstream.url("allowed.test"), home=tmp_path)
    assert authorised.stdout == b"hello from upstream\n"
    events = auth_proxy.wait_for_audit(lambda e: e.get("decision") == "allow")
    assert [e["host"] for e in events] == ["allowed.test"]


def test_with_the_secret_the_proxy_works_as_ever_and_the_secret_goes_no_further(
        auth_proxy, http_upstream, https_upstream, curl_path, tmp_path):
    proxy = _with_secret(auth_proxy)
    plain = run_curl(curl_path, proxy, http_upstream.url("allowed.test", "/headers"), home=tmp_path)
    assert plain.returncode == 0
    assert "Proxy-Authorization" not in plain.stdout.decode()
    tls = run_curl(curl_path, proxy, https_upstream.url("allowed.test", "/headers"), home=tmp_path)
    assert tls.returncode == 0, tls.stderr
    assert "Proxy-Authorization" not in tls.stdout.decode()
    assert all("Proxy-Authorization" not in r["headers"] for r in http_upstream.requests + https_upstream.requests)
    blocked = run_curl(curl_path, proxy, http_upstream.url("other.test"), "-i", home=tmp_path)
    assert blocked.stdout.startswith(b"HTTP/1.1 403") and b"EGRESS_BLOCKED other.test" in blocked.stdout


def test_a_raw_connection_without_the_secret_is_closed_after_the_407(auth_proxy):
    with socket.create_connection(("127.0.0.1", auth_proxy.port), timeout=30) as conn:
        conn.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n"
                     b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 407") and answer.count(b"HTTP/1.1") == 1


def test_every_worker_asks_for_the_credentials(proxy_factory, http_upstream, curl_path, tmp_path):
    """serve --workers 2 --auth: whichever worker the kernel hands a connection to answers 407."""
    proxy = proxy_factory(DEFAULT_POLICY, "--auth", f"egress:{SECRET}", "--workers", "2")
    assert any("clients must authenticate as egress" in line for line in proxy.stderr_lines)
    for _ in range(8):  # SO_REUSEPORT spreads new connections by their source port
        refused = run_curl(curl_path, proxy, http_upstream.url("allowed.test"), "-i", home=tmp_path)
        assert refused.stdout.startswith(b"HTTP/1.1 407")
        allowed = run_curl(curl_path, _with_secret(proxy), http_upstream.url("allowed.test"), home=tmp_path)
        assert allowed.stdout == b"hello from upstream\n"
    assert len(http_upstream.requests) == 8
