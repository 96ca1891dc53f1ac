"""End to end: a real `egress serve`, real upstreams on 127.0.0.1, real clients."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import ssl
import threading

import pytest
from conftest import proxied_session, run_curl


def connect_raw(proxy, target: str, extra: bytes = b"") -> tuple[socket.socket, bytes]:
    """Send CONNECT target; return the socket and the proxy's complete answer head (+ body if any)."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode() + extra)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    match = re.search(rb"content-length: *(\d+)", head, re.I)
    if match:
        while len(rest) < int(match.group(1)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    return sock, head + b"\r\n\r\n" + rest


def tls_through_tunnel(proxy, target: str, server_hostname: str, cafile) -> ssl.SSLSocket:
    sock, answer = connect_raw(proxy, target)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    context = ssl.create_default_context(cafile=str(cafile))
    return context.wrap_socket(sock, server_hostname=server_hostname)


def http_over(sock, host_header: str, path: str = "/small") -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, ssl.SSLError):
            break
        if not chunk:
            break
        data += chunk
    return data


# ------------------------------------------------------------------ allowed


def test_allowed_https_passes_intercepted_with_body_intact(proxy, https_upstream, curl_path, tmp_path):
    result = run_curl(curl_path, proxy, https_upstream.url("allowed.test"), "-i", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert b"hello from upstream" in result.stdout
    assert https_upstream.requests[-1]["headers"]["Host"] == f"allowed.test:{https_upstream.port}"
    events = proxy.wait_for_audit(lambda e: e["method"] == "GET")
    get = [e for e in events if e["method"] == "GET"][-1]
    assert get["decision"] == "allow" and get["host"] == "allowed.test"
    assert get["rule"].startswith("allowed.test (") and get["bytes_received"] == len(b"hello from upstream\n")


def test_allowed_plain_http_passes_with_python_requests(proxy, http_upstream):
    body = b'{"x": "' + b"y" * 5000 + b'"}'
    response = proxied_session(proxy).post(http_upstream.url("api.allowed.test", "/echo"), data=body,
                                            headers={"Content-Type": "application/json"}, timeout=20)
    assert response.status_code == 200
    assert response.content == body
    assert http_upstream.requests[-1]["body"] == body


def test_subdomain_of_allowed_entry_is_allowed_over_https(proxy, https_upstream):
    response = proxied_session(proxy).get(https_upstream.url("api.allowed.test", "/small"), timeout=20)
    assert response.status_code == 200 and response.text == "hello from upstream\n"


# ------------------------------------------------------------------ refused


def test_refused_connect_names_the_host_and_reaches_nothing(proxy, https_upstream):
    sock, answer = connect_raw(proxy, f"blocked.test:{https_upstream.port}")
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403")
    assert b"X-Egress-Blocked: blocked.test; reason=not-allowed" in head
    assert body.decode().splitlines()[0] == "EGRESS_BLOCKED blocked.test: not on the allow list"
    assert https_upstream.connections == 0


def test_refused_https_with_curl_reports_403(proxy, https_upstream, curl_path, tmp_path):
    result = run_curl(curl_path, proxy, https_upstream.url("blocked.test"), home=tmp_path)
    assert result.returncode == 56
    assert b"CONNECT tunnel failed, response 403" in result.stderr
    assert https_upstream.connections == 0


def test_refused_plain_http_has_header_and_body(proxy, http_upstream, curl_path, tmp_path):
    result = run_curl(curl_path, proxy, http_upstream.url("other.test"), "-i", home=tmp_path)
    head, _, body = result.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403")
    assert b"X-Egress-Blocked: other.test; reason=not-allowed" in head
    assert body.splitlines()[0] == b"EGRESS_BLOCKED other.test: not on the allow list"
    assert http_upstream.connections == 0


def test_deny_wins_over_allow_of_parent(proxy, http_upstream):
    response = proxied_session(proxy).get(http_upstream.url("denied.allowed.test"), timeout=20)
    assert response.status_code == 403
    assert response.headers["X-Egress-Blocked"] == "denied.allowed.test; reason=denied"
    assert http_upstream.connections == 0


def test_name_resolving_to_private_address_is_refused(proxy, https_upstream):
    # private.test is allowed by name but resolves to 127.0.0.1 and is not in allow_private.
    sock, answer = connect_raw(proxy, f"private.test:{https_upstream.port}")
    sock.close()
    assert answer.startswith(b"HTTP/1.1 403")
    assert b"X-Egress-Blocked: private.test; reason=private-address" in answer
    assert (b'EGRESS_BLOCKED private.test: resolves to 127.0.0.1, loopback; to allow it, add "127.0.0.1" to '
            b'the policy\'s allow_private list: allow_private = ["127.0.0.1"]\n') in answer
    assert https_upstream.connections == 0


@pytest.mark.parametrize("spelling", ["2130706433", "0x7f.1", "0177.0.0.1", "127.1", "[::ffff:127.0.0.1]"])
def test_ip_literal_spellings_are_normalised_and_never_match_names(proxy_factory, http_upstream, spelling):
    proxy = proxy_factory('allow = ["allowed.test"]\ndeny = ["127.0.0.0/8"]\n')
    response = proxied_session(proxy).get(f"http://{spelling}:{http_upstream.port}/small", timeout=20)
    assert response.status_code == 403
    assert response.headers["X-Egress-Blocked"] == "127.0.0.1; reason=denied"
    assert http_upstream.connections == 0


def test_ip_allowed_by_policy_still_needs_allow_private(proxy_factory, http_upstream):
    proxy = proxy_factory('allow = ["127.0.0.1"]\n')
    response = proxied_session(proxy).get(f"http://127.0.0.1:{http_upstream.port}/small", timeout=20)
    assert response.status_code == 403
    assert "reason=private-address" in response.headers["X-Egress-Blocked"]
    proxy = proxy_factory('allow = ["127.0.0.1"]\nallow_private = ["127.0.0.0/8"]\n')
    response = proxied_session(proxy).get(f"http://127.0.0.1:{http_upstream.port}/small", timeout=20)
    assert response.status_code == 200


# A company resolver that answers package hosts with addresses in a reserved range (seen:
# 203.0.113.x for pypi.org): the refusal names the address, its class and the line that allows it.
RESERVED_LINE = ('EGRESS_BLOCKED pypi.test: resolves to 203.0.113.80, reserved for documentation; to allow it, '
                 'add "203.0.113.80" to the policy\'s allow_private list: allow_private = ["203.0.113.80"]')


def test_a_reserved_address_refusal_names_the_address_class_and_fix(proxy_factory, tmp_path):
    import select
    import subprocess

    from conftest import clean_env, egress_command

    proxy = proxy_factory('allow = ["pypi.test"]\n', "--resolve", "pypi.test:203.0.113.80")
    env = clean_env(tmp_path, EGRESS_STATE_DIR=str(proxy.state_dir))
    follower = subprocess.Popen([*egress_command(), "events", "--follow", "--run", f"serve-{proxy.process.pid}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        followed = ""
        for _ in range(100):  # until the follower has subscribed and seen one (a refusal is cheap)
            sock, answer = connect_raw(proxy, "pypi.test:443")
            sock.close()
            if select.select([follower.stdout], [], [], 0.2)[0]:
                followed = follower.stdout.readline()
                break
    finally:
        follower.kill()
        follower.wait()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403")
    assert b"\r\nX-Egress-Blocked: pypi.test; reason=private-address\r\n" in head  # the header stays terse
    assert body.decode().splitlines()[0] == RESERVED_LINE
    detail = RESERVED_LINE.split(": ", 1)[1]
    assert followed.rstrip("\n") == f"block CONNECT pypi.test:443  private-address ({detail})"
    response = proxied_session(proxy).get("http://pypi.test/simple/", timeout=20)  # plain HTTP: the same
    assert response.status_code == 403 and response.text.splitlines()[0] == RESERVED_LINE
    events = proxy.wait_for_audit(lambda e: e["method"] == "GET")
    assert {(e["reason"], e["detail"]) for e in events} == {("private-address", detail)}


def test_the_suggested_allow_private_line_opens_it(proxy_factory, http_upstream):
    # private.test resolves to 127.0.0.1 (--resolve): paste the line the refusal gives into the policy.
    policy = 'allow = ["private.test"]\n'
    refused = proxied_session(proxy_factory(policy)).get(http_upstream.url("private.test"), timeout=20)
    assert refused.status_code == 403
    line = refused.text.splitlines()[0].rpartition(": ")[2]
    assert line == 'allow_private = ["127.0.0.1"]'
    response = proxied_session(proxy_factory(policy + line + "\n")).get(http_upstream.url("private.test"), timeout=20)
    assert response.status_code == 200 and response.text == "hello from upstream\n"


def test_an_exact_entry_allows_that_host_only(proxy_factory, http_upstream):
    proxy = proxy_factory('allow = ["=allowed.test"]\nallow_private = ["=allowed.test"]\n')
    session = proxied_session(proxy)
    assert session.get(http_upstream.url("allowed.test"), timeout=20).status_code == 200
    refused = session.get(http_upstream.url("api.allowed.test"), timeout=20)
    assert refused.status_code == 403
    assert refused.headers["X-Egress-Blocked"] == "api.allowed.test; reason=not-allowed"
    assert len(http_upstream.requests) == 1


# ---------------------------------------------------------- inside a tunnel


def test_sni_naming_another_host_is_misdirected(proxy, https_upstream):
    tls = tls_through_tunnel(proxy, f"allowed.test:{https_upstream.port}", "other.test", proxy.ca_path)
    answer = http_over(tls, "other.test")
    assert answer.startswith(b"HTTP/1.1 403")
    assert b"X-Egress-Blocked: allowed.test; reason=misdirected" in answer
    assert https_upstream.connections == 0


def test_host_header_naming_another_host_is_misdirected(proxy, https_upstream):
    tls = tls_through_tunnel(proxy, f"allowed.test:{https_upstream.port}", "allowed.test", proxy.ca_path)
    answer = http_over(tls, "other.test")
    assert answer.startswith(b"HTTP/1.1 403")
    assert b"reason=misdirected" in answer
    assert https_upstream.connections == 0


def test_plain_http_host_header_must_match_the_url(proxy, http_upstream):
    response = proxied_session(proxy).get(http_upstream.url("allowed.test"), headers={"Host": "other.test"},
                                           timeout=20)
    assert response.status_code == 403
    assert response.headers["X-Egress-Blocked"] == "allowed.test; reason=misdirected"
    assert http_upstream.connections == 0


def test_non_http_in_an_intercepted_tunnel_is_refused(proxy, http_upstream):
    sock, answer = connect_raw(proxy, f"allowed.test:{http_upstream.port}")
    assert answer.startswith(b"HTTP/1.1 200")
    sock.sendall(b"SSH-2.0-OpenSSH_9.0\r\n")
    sock.settimeout(10)
    assert sock.recv(100) == b""  # closed, nothing relayed
    sock.close()
    events = proxy.wait_for_audit(lambda e: e["reason"] == "protocol")
    assert any(e["reason"] == "protocol" and e["decision"] == "block" for e in events)
    assert http_upstream.connections == 0


def test_passthrough_host_is_tunnelled_untouched(proxy, https_upstream, test_ca_file):
    # The client sees the upstream's own certificate (from the test CA), not one from egress's CA.
    tls = tls_through_tunnel(proxy, f"passthrough.test:{https_upstream.port}", "passthrough.test", test_ca_file)
    issuer = dict(item[0] for item in tls.getpeercert()["issuer"])
    answer = http_over(tls, "passthrough.test")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello from upstream\n")
    assert "mitmproxy" not in json.dumps(issuer)
    assert https_upstream.connections == 1


class _RawServer:
    """A raw TCP server on 127.0.0.1:0 (not HTTP): reads ``expect`` bytes, then answers the
    sha256 of what it read and ``reply`` bytes, and closes."""

    def __init__(self, expect: int, reply: bytes):
        self.expect, self.reply = expect, reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            digest, left = hashlib.sha256(), self.expect
            while left and (chunk := conn.recv(min(left, 1 << 20))):
                digest.update(chunk)
                left -= len(chunk)
            conn.sendall(digest.digest() + self.reply)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


def test_passthrough_relays_bulk_both_ways_and_counts_the_bytes(proxy):
    # A passthrough tunnel is relayed socket to socket once it runs (egress.proxy.mitm.splice):
    # every byte still arrives, in order, the server's close still reaches the client, and
    # the bytes are counted both ways.
    sent, reply = os.urandom(6 * 2**20), os.urandom(3 * 2**20 + 17)
    server = _RawServer(len(sent), reply)
    try:
        sock, answer = connect_raw(proxy, f"passthrough.test:{server.port}")
        assert answer.startswith(b"HTTP/1.1 200"), answer
        sock.settimeout(20)
        sock.sendall(sent)
        received = _read_all(sock)
        sock.close()
    finally:
        server.close()
    assert received == hashlib.sha256(sent).digest() + reply
    counted = dict(re.findall(r'^egress_passthrough_bytes_total\{direction="(\w+)"\} (\S+)$', proxy.metrics(), re.M))
    assert {k: float(v) for k, v in counted.items()} == {"upload": len(sent), "download": len(received)}


# ------------------------------------------------------ upstream failures


def test_upstream_reset_gives_502_and_the_proxy_keeps_serving(proxy, http_upstream):
    session = proxied_session(proxy)
    response = session.get(http_upstream.url("allowed.test", "/reset"), timeout=20)
    assert response.status_code == 502
    assert session.get(http_upstream.url("allowed.test"), timeout=20).status_code == 200


def test_garbage_from_a_client_gets_400_and_others_are_served(proxy, http_upstream):
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sock.sendall(b"\x16\x00GARBAGE NOT HTTP\r\n\r\n")
    answer = sock.recv(4096)
    sock.close()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400")
    assert proxied_session(proxy).get(http_upstream.url("allowed.test"), timeout=20).status_code == 200


# ------------------------------------------------------- events & metrics


def test_audit_log_is_json_lines_with_the_documented_fields(proxy, http_upstream):
    session = proxied_session(proxy)
    session.get(http_upstream.url("allowed.test"), timeout=20)
    session.get(http_upstream.url("blocked.test"), timeout=20)
    events = proxy.wait_for_audit(lambda e: e["host"] == "allowed.test")
    assert {"time", "client", "session", "method", "host", "port", "decision", "reason", "rule",
            "bytes_sent", "bytes_received"} <= set(events[0])
    decisions = {(e["host"], e["decision"], e["reason"]) for e in events}
    assert ("blocked.test", "block", "not-allowed") in decisions
    assert ("allowed.test", "allow", "allowed") in decisions


def test_metrics_count_decisions_and_blocks(proxy, http_upstream):
    session = proxied_session(proxy)
    for _ in range(3):
        session.get(http_upstream.url("blocked.test"), timeout=20)
    session.get(http_upstream.url("allowed.test"), timeout=20)
    proxy.wait_for_audit(lambda e: e["host"] == "allowed.test")
    text = proxy.metrics()
    assert 'egress_requests_total{decision="block",reason="not-allowed"} 3.0' in text
    assert 'egress_blocked_total{domain="blocked.test",reason="not-allowed"} 3.0' in text
    assert 'egress_requests_total{decision="allow",reason="allowed"} 1.0' in text
    assert re.search(r"^egress_policy_rules \d+\.0$", text, re.M)
    assert re.search(r'^egress_transferred_bytes_total\{direction="download"\} 20\.0$', text, re.M)
    assert "egress_upstream_connect_seconds_count 1.0" in text


def test_large_download_is_streamed_not_buffered(proxy, https_upstream, curl_path, tmp_path):
    size = 256 * 1024 * 1024
    result = run_curl(curl_path, proxy, https_upstream.url("allowed.test", f"/bytes/{size}"),
                      "-o", "/dev/null", "-w", "%{size_download}", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == size
    # Buffered, mitmproxy peaks at 1.5-1.8 GB for this body; streamed it stays near idle.
    assert proxy.rss_peak_kib() < 250 * 1024


def test_upstream_that_hangs_gets_504_naming_the_reason(proxy_factory, http_upstream):
    from conftest import DEFAULT_POLICY

    proxy = proxy_factory(DEFAULT_POLICY, "--upstream-timeout", "1")
    session = proxied_session(proxy)
    response = session.get(http_upstream.url("allowed.test", "/hang"), timeout=30)
    assert response.status_code == 504
    assert response.headers["X-Egress-Error"] == "allowed.test; reason=upstream-timeout"
    assert response.text.startswith("EGRESS_UPSTREAM_ERROR allowed.test:")
    events = proxy.wait_for_audit(lambda e: e["reason"] == "upstream-timeout")
    assert any(e["decision"] == "error" and e["reason"] == "upstream-timeout" for e in events)
    assert session.get(http_upstream.url("allowed.test"), timeout=20).status_code == 200


def test_upstream_that_hangs_inside_tls_is_dropped_with_504(proxy_factory, https_upstream):
    from conftest import DEFAULT_POLICY

    proxy = proxy_factory(DEFAULT_POLICY, "--upstream-timeout", "1")
    response = proxied_session(proxy).get(https_upstream.url("allowed.test", "/hang"), timeout=30)
    # the hung TLS connection is closed; egress answers as for plain HTTP (before: mitmproxy's 502 page)
    assert response.status_code == 504
    assert response.headers["X-Egress-Error"] == "allowed.test; reason=upstream-timeout"
    assert response.text == ("EGRESS_UPSTREAM_ERROR allowed.test: the upstream server did not answer in time "
                             "(no response within 1 s)\n")
    events = proxy.wait_for_audit(lambda e: e["reason"] == "upstream-timeout")
    assert any(e["decision"] == "error" and e["host"] == "allowed.test" for e in events
               if e["reason"] == "upstream-timeout")


def test_a_name_pointing_at_the_proxy_itself_is_refused_not_looped(proxy_factory, curl_path, tmp_path):
    # allowed.test is allowed and may reach 127.0.0.1 (allow_private), but 127.0.0.1:<its port> is
    # the proxy itself. Before: a 502 "upstream could not be reached" (connect-failed), and a 200 to
    # the CONNECT. Now a refusal, like any other, before anything is dialled.
    from conftest import DEFAULT_POLICY

    proxy = proxy_factory(DEFAULT_POLICY)
    words = f"EGRESS_BLOCKED allowed.test: resolves to 127.0.0.1:{proxy.port}, this proxy's own listening address"
    response = proxied_session(proxy).get(f"http://allowed.test:{proxy.port}/", timeout=20)
    assert response.status_code == 403
    assert response.headers["X-Egress-Blocked"] == "allowed.test; reason=private-address"
    assert response.text.splitlines()[0] == words
    assert "X-Egress-Error" not in response.headers
    result = run_curl(curl_path, proxy, f"https://allowed.test:{proxy.port}/", "-v", home=tmp_path)
    assert result.returncode == 56, result.stderr  # the CONNECT itself is refused
    assert b"CONNECT tunnel failed, response 403" in result.stderr
    _, answer = connect_raw(proxy, f"passthrough.test:{proxy.port}")  # the passthrough front hands it over
    assert answer.startswith(b"HTTP/1.1 403")
    assert b"X-Egress-Blocked: passthrough.test; reason=private-address" in answer
    events = proxy.wait_for_audit(lambda e: e["host"] == "passthrough.test")
    mine = [e for e in events if e["port"] == proxy.port]
    assert [(e["method"], e["host"], e["decision"], e["reason"]) for e in mine] == [
        ("GET", "allowed.test", "block", "private-address"), ("CONNECT", "allowed.test", "block", "private-address"),
        ("CONNECT", "passthrough.test", "block", "private-address")]
    assert re.search(r"^egress_open_connections [01]\.0$", proxy.metrics(), re.M)


# ------------------------------------------- refusals mitmproxy answered itself (P12)

# mitmproxy refuses some requests itself once their head is read (HttpStream.check_invalid: a scheme
# other than http/https, Transfer-Encoding with Content-Length, a CONNECT inside a tunnel). egress's
# guards record those as refusals, but the client got mitmproxy's HTML 400: no X-Egress-Blocked, no
# EGRESS_BLOCKED line.


def _assert_egress_refusal(answer: bytes, host: str, reason: str) -> None:
    """egress's refusal of a malformed request: 400, X-Egress-Blocked, the EGRESS_BLOCKED line; no HTML."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer  # a request egress will not serve as HTTP
    assert f"\r\nX-Egress-Blocked: {host}; reason={reason}".encode() in head, answer
    assert body.startswith(f"EGRESS_BLOCKED {host}: ".encode()), answer
    assert b"<html" not in answer.lower()


def _plain(proxy, request: bytes) -> bytes:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    with sock:
        sock.sendall(request)
        return _read_all(sock)


REFUSED_BY_MITMPROXY = {  # target -> (request head after the request line, host named)
    "ws-scheme": ("GET ws://other.test:{port}/ HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n", "other.test"),
    "upper-case-scheme": ("GET HTTP://other.test:{port}/small HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n",
                          "other.test"),
    "ftp-scheme": ("GET ftp://allowed.test:{port}/ HTTP/1.1\r\nHost: allowed.test:{port}\r\n\r\n", "allowed.test"),
    "cl-and-te": ("POST http://allowed.test:{port}/ HTTP/1.1\r\nHost: allowed.test:{port}\r\nContent-Length: 5\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "allowed.test"),
}


@pytest.mark.parametrize("case", list(REFUSED_BY_MITMPROXY))
def test_a_request_mitmproxy_refuses_gets_egress_refusal(proxy, http_upstream, case):
    template, host = REFUSED_BY_MITMPROXY[case]
    answer = _plain(proxy, template.format(port=http_upstream.port).encode())
    _assert_egress_refusal(answer, host, "protocol")
    assert http_upstream.connections == 0
    events = proxy.wait_for_audit(lambda e: e["decision"] == "block")
    assert [(e["host"], e["reason"]) for e in events if e["decision"] == "block"] == [(host, "protocol")]


@pytest.mark.parametrize("request_line", ["GET ws://other.test:{port}/ HTTP/1.1", "GET HTTP://other.test:{port}/ HTTP/1.1",
                                          "CONNECT other.test:{port} HTTP/1.1"],
                         ids=["ws-scheme", "upper-case-scheme", "nested-connect"])
def test_a_request_mitmproxy_refuses_inside_a_tls_tunnel_gets_egress_refusal(proxy, https_upstream, request_line):
    port = https_upstream.port
    tls = tls_through_tunnel(proxy, f"allowed.test:{port}", "allowed.test", proxy.ca_path)
    with tls:
        tls.sendall(request_line.format(port=port).encode() + f"\r\nHost: allowed.test:{port}\r\n\r\n".encode())
        answer = _read_all(tls)
    _assert_egress_refusal(answer, "other.test", "protocol")
    assert https_upstream.requests == []


def test_a_malformed_chunked_body_is_answered_with_egress_refusal(proxy, http_upstream):
    # mitmproxy closes the connection before it reports the broken chunk: the client used to get
    # no answer at all; now egress's refusal goes out first.
    answer = _plain(proxy, (f"POST http://allowed.test:{http_upstream.port}/ HTTP/1.1\r\n"
                            f"Host: allowed.test:{http_upstream.port}\r\nTransfer-Encoding: chunked\r\n\r\n"
                            "zz\r\nhello\r\n0\r\n\r\n").encode())
    _assert_egress_refusal(answer, "allowed.test", "protocol")
    assert http_upstream.requests == []


def test_smuggling_framing_inside_a_tls_tunnel_is_refused_naming_the_tunnels_host(proxy, https_upstream):
    # Inside a tunnel the request names no host of its own: the refusal names the tunnel's, and
    # leaves out mitmproxy's advice to turn its check off (no option of egress's).
    port = https_upstream.port
    tls = tls_through_tunnel(proxy, f"allowed.test:{port}", "allowed.test", proxy.ca_path)
    with tls:
        tls.sendall(f"POST /small HTTP/1.1\r\nHost: allowed.test:{port}\r\nContent-Length: 5\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode())
        answer = _read_all(tls)
    _assert_egress_refusal(answer, "allowed.test", "protocol")
    assert b"validate_inbound_headers" not in answer
    assert https_upstream.requests == []


def test_a_scheme_mitmproxy_refuses_inside_a_plain_tunnel_gets_egress_refusal(proxy, http_upstream):
    port = http_upstream.port
    sock, answer = connect_raw(proxy, f"allowed.test:{port}")
    with sock:
        assert answer.startswith(b"HTTP/1.1 200")
        sock.sendall(f"GET ws://other.test:{port}/ HTTP/1.1\r\nHost: allowed.test:{port}\r\n\r\n".encode())
        answer = _read_all(sock)
    _assert_egress_refusal(answer, "other.test", "protocol")
    assert http_upstream.requests == []


def test_curl_sending_a_ws_target_gets_egress_refusal(proxy, http_upstream, curl_path, tmp_path):
    # A real client's request line: curl's --request-target puts the target on the line verbatim.
    port = http_upstream.port
    result = run_curl(curl_path, proxy, f"http://allowed.test:{port}/small", "-i", "--request-target",
                      f"ws://other.test:{port}/", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(b"HTTP/1.1 400 "), result.stdout
    assert b"X-Egress-Blocked: other.test; reason=protocol" in result.stdout
    assert b"\r\n\r\nEGRESS_BLOCKED other.test: " in result.stdout
    assert http_upstream.requests == []


# ------------------------------------------------- issue 9: guard holes


def test_absolute_form_target_inside_a_tunnel_must_name_the_tunnel_host(proxy, https_upstream):
    # RFC 9112 3.2.2: a server serves the absolute-form target's virtual host, whatever the
    # Host header says. Before: forwarded as it came, i.e. to other.test's site.
    tls = tls_through_tunnel(proxy, f"allowed.test:{https_upstream.port}", "allowed.test", proxy.ca_path)
    tls.sendall(f"GET https://other.test:{https_upstream.port}/small HTTP/1.1\r\n"
                f"Host: allowed.test:{https_upstream.port}\r\nConnection: close\r\n\r\n".encode())
    answer = _read_all(tls)
    assert answer.startswith(b"HTTP/1.1 403")
    assert b"X-Egress-Blocked: allowed.test; reason=misdirected" in answer
    assert b"request target names 'other.test:" in answer
    assert https_upstream.connections == 0


def test_absolute_form_target_naming_the_tunnel_host_passes(proxy, https_upstream):
    tls = tls_through_tunnel(proxy, f"allowed.test:{https_upstream.port}", "allowed.test", proxy.ca_path)
    tls.sendall(f"GET https://allowed.test:{https_upstream.port}/small HTTP/1.1\r\n"
                f"Host: allowed.test:{https_upstream.port}\r\nConnection: close\r\n\r\n".encode())
    answer = _read_all(tls)
    assert b"X-Egress-Blocked" not in answer  # the test upstream 404s absolute-form paths: it was reached
    assert https_upstream.requests[-1]["path"] == f"https://allowed.test:{https_upstream.port}/small"


def test_a_host_port_of_5000_digits_is_refused_not_forwarded(proxy, http_upstream):
    # int() of 5000 digits raised ValueError inside the policy guard: mitmproxy logged an
    # addon error and forwarded the request (proxy_factory fails on "Addon error" too).
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sock.sendall(f"GET http://allowed.test:{http_upstream.port}/small HTTP/1.1\r\n"
                 f"Host: allowed.test:{'1' * 5000}\r\nConnection: close\r\n\r\n".encode())
    answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 403")
    assert b"X-Egress-Blocked: allowed.test; reason=misdirected" in answer
    assert http_upstream.connections == 0
    events = proxy.wait_for_audit(lambda e: e["reason"] == "misdirected")
    assert [e["reason"] for e in events] == ["misdirected"]


def _read_all(sock) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError, ssl.SSLError):
            break
        if not chunk:
            break
        data += chunk
    return data


# ------------------------------------------------------------ large bodies refused

# A body over mitmproxy's stream_large_bodies (1 MiB) is marked for streaming before any
# guard decides. A guard refusing it at its head then set the answer too, and mitmproxy
# raised ("Can't set a response and enable streaming at the same time"), crashed again on
# every chunk of the body (211 times for 11 MB) and never answered: the client hung until
# the idle timeout and got an empty reply instead of EGRESS_BLOCKED.
BIG_BODY = b"0123456789abcdef" * (2 * 2**20 // 16)  # 2 MiB, clean text


@pytest.mark.parametrize("framing", ["content-length", "chunked", "expect-100-continue"])
@pytest.mark.parametrize("host, path, reason", [
    ("other.test", "/upload", "not-allowed"),
    ("denied.allowed.test", "/upload", "denied"),
    ("private.test", "/upload", "private-address"),
    ("allowed.test", "/upload?key=sk_live_4eC39HqLyjWDarjtT1zdp7dc", "credential"),  # made up, Stripe's shape
])
def test_a_large_upload_refused_at_its_head_gets_the_refusal(proxy, http_upstream, curl_path, tmp_path,
                                                               host, path, reason, framing):
    body = tmp_path / "body.txt"
    body.write_bytes(BIG_BODY)
    extra = {"content-length": ["-H", "Expect:"], "chunked": ["-H", "Expect:", "-H", "Transfer-Encoding: chunked"],
             "expect-100-continue": []}[framing]  # curl asks for 100-continue itself over 1 MiB
    result = run_curl(curl_path, proxy, http_upstream.url(host, path), "-i",
                      "--data-binary", f"@{body}", *extra, home=tmp_path)
    head, _, answer = result.stdout.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), (result.returncode, result.stderr, head)
    assert f"X-Egress-Blocked: {host}; reason={reason}".encode() in head
    assert answer.startswith(f"EGRESS_BLOCKED {host}".encode())
    assert http_upstream.connections == 0
    events = proxy.wait_for_audit(lambda e: e["decision"] == "block")
    assert [e["reason"] for e in events] == [reason]


def test_a_large_upload_refused_inside_a_tunnel_gets_the_refusal(proxy, https_upstream, test_ca_file):
    # intercepted: the Host header names another host than the tunnel (misdirected)
    tls = tls_through_tunnel(proxy, f"allowed.test:{https_upstream.port}", "allowed.test", proxy.ca_path)
    tls.sendall(f"POST /upload HTTP/1.1\r\nHost: other.test:{https_upstream.port}\r\n"
                f"Content-Length: {len(BIG_BODY)}\r\nConnection: close\r\n\r\n".encode())
    sender = threading.Thread(target=_send_quietly, args=(tls, BIG_BODY), daemon=True)
    sender.start()
    answer = _read_all(tls)
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert b"reason=misdirected" in answer
    assert https_upstream.connections == 0


def _send_quietly(sock, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the proxy answered and closed before the body was all sent
        pass
