"""Credentials never leave: end to end through a real `egress serve` / `egress run`.

Every token here is made up to match its provider's format; none is real.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import string
import subprocess
import sys

import pytest

from conftest import DEFAULT_POLICY, TEST_NAMES, clean_env, egress_command, proxied_session

_RANDOM = random.Random(20261202)


def fake(prefix: str, length: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return prefix + "".join(_RANDOM.choice(alphabet) for _ in range(length))


GITHUB = fake("ghp_", 36)
STRIPE = fake("sk_live_", 24)
ANTHROPIC = fake("sk-ant-api03-", 93, string.ascii_letters + string.digits + "_-") + "AA"
STORED = fake("", 32)  # an install's own secret with no well-known shape


def assert_refused(response, upstream, kind: str):
    assert response.status_code == 403, response.text
    assert "reason=credential" in response.headers["X-Egress-Blocked"]
    assert kind in response.text
    for value in (GITHUB, STRIPE, ANTHROPIC, STORED):
        assert value not in response.text and value not in str(response.headers)
    assert upstream.requests == []


# --------------------------------------------------------------- block (default)


@pytest.fixture
def guarded(proxy_factory):
    return proxy_factory(DEFAULT_POLICY, env={"MY_SERVICE_TOKEN": STORED})


@pytest.mark.parametrize("placement", ["query", "header", "bearer", "json", "form", "multipart", "basic"])
def test_token_anywhere_in_a_request_is_refused(guarded, https_upstream, placement):
    session = proxied_session(guarded)
    url = https_upstream.url("allowed.test", "/echo")
    if placement == "query":
        response = session.get(https_upstream.url("allowed.test", f"/small?token={GITHUB}"), timeout=20)
    elif placement == "header":
        response = session.get(url, headers={"X-Api-Key": ANTHROPIC}, timeout=20)
    elif placement == "bearer":
        response = session.get(url, headers={"Authorization": f"Bearer {STRIPE}"}, timeout=20)
    elif placement == "json":
        response = session.post(url, data=json.dumps({"config": {"token": GITHUB}}), timeout=20,
                                headers={"Content-Type": "application/json"})
    elif placement == "form":
        response = session.post(url, data={"key": STRIPE, "x": "y"}, timeout=20)
    elif placement == "multipart":
        response = session.post(url, files={"upload": ("env.txt", f"TOKEN={GITHUB}\n".encode())}, timeout=20)
    else:
        response = session.get(url, auth=("x-access-token", GITHUB), timeout=20)
    kind = {"header": "anthropic", "bearer": "stripe", "form": "stripe"}.get(placement, "github")
    assert_refused(response, https_upstream, kind)


def test_stored_secret_from_the_environment_is_refused(guarded, http_upstream):
    response = proxied_session(guarded).post(http_upstream.url("allowed.test", "/echo"),
                                         data=f"debug dump: {STORED}", timeout=20)
    assert_refused(response, http_upstream, "MY_SERVICE_TOKEN")


def test_token_inside_gzip_body_is_refused(guarded, https_upstream):
    body = gzip.compress(json.dumps({"t": GITHUB}).encode())
    response = proxied_session(guarded).post(https_upstream.url("allowed.test", "/echo"), data=body, timeout=20,
                                         headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert_refused(response, https_upstream, "github")


def test_unreadable_content_encoding_fails_closed(guarded, https_upstream):
    response = proxied_session(guarded).post(https_upstream.url("allowed.test", "/echo"), data=b"\x00\x01opaque",
                                         headers={"Content-Encoding": "x-mystery"}, timeout=20)
    assert response.status_code == 403
    assert "reason=credential" in response.headers["X-Egress-Blocked"]
    assert https_upstream.requests == []


def test_ordinary_requests_pass_untouched(guarded, https_upstream):
    body = json.dumps({"sha": "9fceb02d0ae598e95dc970b74767f19372d61af8",
                       "id": "123e4567-e89b-12d3-a456-426614174000", "note": "use a ghp_ token"})
    response = proxied_session(guarded).post(https_upstream.url("allowed.test", "/echo"), data=body, timeout=20)
    assert response.status_code == 200
    assert response.text == body


# ----------------------------------------------------------------------- mask


def test_mask_mode_forwards_the_redacted_request(proxy_factory, https_upstream):
    policy = DEFAULT_POLICY + '\n[credentials]\naction = "mask"\n'
    proxy = proxy_factory(policy)
    response = proxied_session(proxy).post(https_upstream.url("allowed.test", f"/echo?t={STRIPE}"),
                                       data=json.dumps({"token": GITHUB}),
                                       headers={"X-Api-Key": ANTHROPIC}, timeout=20)
    assert response.status_code == 200
    seen = https_upstream.requests[-1]
    assert seen["body"] == json.dumps({"token": "[redacted:github-token]"}).encode()
    assert GITHUB.encode() not in seen["body"] and STRIPE not in seen["path"]
    assert "[redacted:" in seen["path"] and seen["headers"]["X-Api-Key"].startswith("[redacted:")


# ------------------------------------------------------------------ bound secrets


BOUND_POLICY = DEFAULT_POLICY.replace('allow = ["allowed.test"', 'allow = ["allowed.test", "other.test"') \
    .replace('allow_private = ["allowed.test"', 'allow_private = ["allowed.test", "other.test"') + """
[[credentials.secret]]
env = "GITHUB_TOKEN"
hosts = ["allowed.test"]
"""


def test_bound_secret_reaches_its_host_only(proxy_factory, https_upstream):
    proxy = proxy_factory(BOUND_POLICY, env={"GITHUB_TOKEN": GITHUB})
    session = proxied_session(proxy)
    ok = session.get(https_upstream.url("allowed.test", "/small"), headers={"Authorization": f"token {GITHUB}"},
                     timeout=20)
    assert ok.status_code == 200
    assert https_upstream.requests[-1]["headers"]["Authorization"] == f"token {GITHUB}"
    before = len(https_upstream.requests)
    refused = session.get(https_upstream.url("other.test", "/small"), headers={"Authorization": f"token {GITHUB}"},
                          timeout=20)
    assert refused.status_code == 403 and "reason=credential" in refused.headers["X-Egress-Blocked"]
    assert len(https_upstream.requests) == before


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("table, env, message", [
    ('[credentials]\naction = "warn"\n', {}, "'warn' is not an action"),
    ('[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["nowhere.test"]\n', {"GITHUB_TOKEN": GITHUB},
     "bound to 'nowhere.test', which the policy does not allow"),
    ('[[credentials.secret]]\nfile = "/nonexistent/egress-secret"\n', {}, "cannot read /nonexistent/egress-secret"),
    ('[[credentials.secret]]\nenv = "SHORT"\n', {"SHORT": "abc"}, "needs at least"),
    ('[[credentials.secret]]\nenv = "UNSET_SECRET_X"\n', {}, "$UNSET_SECRET_X is not set"),
])
def test_bad_credential_settings_stop_serve_with_a_clear_error(tmp_path, table, env, message):
    policy = tmp_path / "p.toml"
    policy.write_text(DEFAULT_POLICY + "\n" + table)
    result = subprocess.run([*egress_command(), "serve", "--policy", str(policy), "--listen", "127.0.0.1:0",
                             "--metrics", "off", "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=60, env=clean_env(tmp_path, **env))
    assert result.returncode == 3
    assert message in result.stderr


# -------------------------------------------------------------------- redaction


def test_egress_redact_filters_a_stream(tmp_path):
    text = f"token {GITHUB}\nstored {STORED}\nexport API_PASSWORD=hunter2hunter2\nplain line\n"
    result = subprocess.run([*egress_command(), "redact"], input=text, capture_output=True, text=True,
                            timeout=60, env=clean_env(tmp_path, MY_SERVICE_TOKEN=STORED))
    assert result.returncode == 0, result.stderr
    assert GITHUB not in result.stdout and STORED not in result.stdout and "hunter2" not in result.stdout
    assert "[redacted:github-token]" in result.stdout
    assert "export API_PASSWORD=[redacted:env-secret]" in result.stdout
    assert result.stdout.endswith("plain line\n")


# ------------------------------------------------------------- brokered (egress run)


def egress_run(tmp_path, policy: str, env: dict, *command: str, upstream_ca=None):
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(policy)
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    args = [*egress_command(), "run", "--policy", str(policy_file), "--state-dir", str(tmp_path / "state")]
    for name in TEST_NAMES:
        args += ["--resolve", f"{name}:127.0.0.1"]
    if upstream_ca:
        args += ["--upstream-ca", str(upstream_ca)]
    return subprocess.run([*args, "--", *command], capture_output=True, text=True, timeout=120, cwd=project,
                          env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), **env))


@pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")
def test_brokered_secret_command_sees_only_a_placeholder(tmp_path, https_upstream, test_ca_file, curl_path):
    policy = 'allow = ["allowed.test", "other.test"]\nallow_private = ["allowed.test", "other.test"]\n' \
             '[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["allowed.test"]\n'
    script = (f'echo "$GITHUB_TOKEN"; '
              f'curl -sS -H "Authorization: token $GITHUB_TOKEN" {https_upstream.url("allowed.test", "/small")}; '
              f'curl -sS -H "Authorization: token $GITHUB_TOKEN" {https_upstream.url("other.test", "/small")}')
    result = egress_run(tmp_path, policy, {"GITHUB_TOKEN": GITHUB}, "sh", "-c", script, upstream_ca=test_ca_file)
    placeholder = result.stdout.splitlines()[0]
    assert placeholder != GITHUB and placeholder.startswith("ghp_") and len(placeholder) == len(GITHUB)
    assert GITHUB not in result.stdout and GITHUB not in result.stderr
    assert "hello from upstream" in result.stdout
    # The bound host received the real value; the other host received nothing.
    assert [r["headers"].get("Authorization") for r in https_upstream.requests] == [f"token {GITHUB}"]
    assert "EGRESS_BLOCKED other.test (the request carries a credential)" in result.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")
def test_trace_with_a_brokered_secret_is_refused(tmp_path, https_upstream, test_ca_file, curl_path):
    policy = 'allow = ["allowed.test"]\nallow_private = ["allowed.test"]\n' \
             '[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["allowed.test"]\n'
    script = f'curl -sS -X TRACE -H "Authorization: token $GITHUB_TOKEN" {https_upstream.url("allowed.test", "/small")}'
    result = egress_run(tmp_path, policy, {"GITHUB_TOKEN": GITHUB}, "sh", "-c", script, upstream_ca=test_ca_file)
    assert "EGRESS_BLOCKED allowed.test" in result.stdout
    assert https_upstream.requests == []


@pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")
def test_run_redact_filters_the_commands_output(tmp_path):
    result = subprocess.run(
        [*egress_command(), "run", "--redact", "--network", "off", "--", "sh", "-c",
         f'echo "leak: $MY_SERVICE_TOKEN"; echo "{GITHUB}" >&2'],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), MY_SERVICE_TOKEN=STORED))
    assert result.stdout == "leak: [redacted:MY_SERVICE_TOKEN]\n"
    assert "[redacted:github-token]" in result.stderr and GITHUB not in result.stderr


def test_basic_auth_decoding_is_real(guarded, https_upstream):
    # A Basic credential whose user part is innocent and whose password is a token.
    header = "Basic " + base64.b64encode(f"__token__:{GITHUB}".encode()).decode()
    response = proxied_session(guarded).get(https_upstream.url("allowed.test"), headers={"Authorization": header},
                                        timeout=20)
    assert_refused(response, https_upstream, "github")


# ------------------------------------- holes an adversarial review found (kept closed)


import socket
import ssl
import threading


class RawUpstream:
    """A TLS server on 127.0.0.1 that records every byte it receives and answers as told."""

    def __init__(self, test_ca, answer: bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"):
        cert = test_ca.issue_cert("allowed.test", "other.test")
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(self.context)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        self.received = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn):
        try:
            with self.context.wrap_socket(conn, server_side=True) as tls:
                answered = False
                while True:
                    data = tls.recv(65536)
                    if not data:
                        return
                    self.received += data
                    if not answered and b"\r\n\r\n" in self.received:
                        tls.sendall(self.answer)
                        answered = True
        except OSError:
            return

    def close(self):
        self.sock.close()


def tunnel(proxy, port: int, host: str = "allowed.test"):
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=15)
    sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    context = ssl.create_default_context(cafile=str(proxy.ca_path))
    return context.wrap_socket(sock, server_hostname=host)


def read_all(sock) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (OSError, ssl.SSLError):
        pass
    return data


def test_a_large_chunked_upload_is_scanned_too(guarded, test_ca):
    upstream = RawUpstream(test_ca)
    try:
        tls = tunnel(guarded, upstream.port)
        tls.sendall(f"POST /up HTTP/1.1\r\nHost: allowed.test:{upstream.port}\r\n"
                    f"Transfer-Encoding: chunked\r\n\r\n".encode())
        for piece in (f"x={GITHUB} ".encode(), b"A" * (1100 * 1024)):
            try:
                tls.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:
                break
        read_all(tls)
        assert GITHUB.encode() not in upstream.received
        events = guarded.wait_for_audit(lambda e: e["reason"] == "credential")
        assert any(e["reason"] == "credential" for e in events)
    finally:
        upstream.close()


def test_a_token_split_across_stream_chunks_never_leaves(guarded, test_ca):
    upstream = RawUpstream(test_ca)
    try:
        tls = tunnel(guarded, upstream.port)
        body = b"A" * (2 * 1024 * 1024) + b"\n" + GITHUB.encode() + b"\n" + b"B" * 1000
        tls.sendall(f"POST /up HTTP/1.1\r\nHost: allowed.test:{upstream.port}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode())
        try:
            tls.sendall(body)
        except OSError:
            pass
        read_all(tls)
        assert GITHUB[:20].encode() not in upstream.received
    finally:
        upstream.close()


def test_websocket_messages_are_scanned(guarded, test_ca):
    upstream = RawUpstream(test_ca, answer=b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                          b"Connection: Upgrade\r\nSec-WebSocket-Accept: "
                                          b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n")
    try:
        tls = tunnel(guarded, upstream.port)
        tls.sendall(f"GET /ws HTTP/1.1\r\nHost: allowed.test:{upstream.port}\r\nUpgrade: websocket\r\n"
                    f"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    f"Sec-WebSocket-Version: 13\r\n\r\n".encode())
        assert tls.recv(4096).startswith(b"HTTP/1.1 101")
        payload = f"token={GITHUB}".encode()
        mask = b"\x01\x02\x03\x04"
        frame = bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        tls.sendall(frame)
        read_all(tls)
        assert GITHUB.encode() not in upstream.received
    finally:
        upstream.close()


def test_other_upgrades_are_refused_not_relayed(guarded, test_ca):
    upstream = RawUpstream(test_ca, answer=b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: foo\r\n"
                                          b"Connection: Upgrade\r\n\r\n")
    try:
        tls = tunnel(guarded, upstream.port)
        tls.sendall(f"GET / HTTP/1.1\r\nHost: allowed.test:{upstream.port}\r\nUpgrade: foo\r\n"
                    f"Connection: Upgrade\r\n\r\n".encode())
        try:
            tls.sendall(f"raw bytes {GITHUB}".encode())
        except OSError:
            pass
        read_all(tls)
        assert GITHUB.encode() not in upstream.received
        events = guarded.wait_for_audit(lambda e: e["reason"] == "protocol")
        assert any(e["reason"] == "protocol" for e in events)
    finally:
        upstream.close()


def test_transfer_codings_other_than_chunked_are_refused(guarded, test_ca):
    upstream = RawUpstream(test_ca)
    try:
        tls = tunnel(guarded, upstream.port)
        body = gzip.compress(f"t={GITHUB}".encode())
        tls.sendall(f"POST /up HTTP/1.1\r\nHost: allowed.test:{upstream.port}\r\n"
                    f"Transfer-Encoding: gzip, chunked\r\n\r\n".encode() +
                    b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        answer = read_all(tls)
        assert answer.startswith(b"HTTP/1.1 403") and b"reason=credential" in answer
        assert b"gzip" not in upstream.received
    finally:
        upstream.close()


def test_an_upper_cased_secret_in_a_host_name_is_refused_before_dns(proxy_factory):
    hexsecret = "9f2c4e7a1b3d5f60718293a4b5c6d7e8f9012345"
    proxy = proxy_factory(DEFAULT_POLICY, env={"MY_HEX_TOKEN": hexsecret})
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=15)
    target = f"{hexsecret.upper()}.allowed.test:443"
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 403") and b"reason=credential" in answer
    assert hexsecret.encode() not in answer.lower()
    for event in proxy.audit():
        assert hexsecret not in json.dumps(event).lower()
    assert hexsecret not in proxy.metrics().lower()


def test_refusals_and_logs_never_repeat_a_token(guarded, https_upstream):
    session = proxied_session(guarded)
    session.get(https_upstream.url("allowed.test"), headers={"Host": f"{GITHUB}.allowed.test"}, timeout=20)
    sock = socket.create_connection(("127.0.0.1", guarded.port), timeout=15)
    sock.sendall(f"CONNECT {GITHUB}.blocked.test:443 HTTP/1.1\r\n\r\n".encode())
    answer = read_all(sock)
    assert GITHUB.lower().encode() not in answer.lower()
    guarded.wait_for_audit(lambda e: "blocked.test" in e["host"])
    log = guarded.audit_path.read_text().lower()
    assert GITHUB.lower() not in log
    assert GITHUB.lower()[:12] not in guarded.metrics().lower()


@pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")
def test_a_bound_host_echoing_the_secret_gives_back_the_placeholder(tmp_path, https_upstream, test_ca_file,
                                                                    curl_path):
    policy = 'allow = ["allowed.test"]\nallow_private = ["allowed.test"]\n' \
             '[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["allowed.test"]\n'
    script = f'curl -sS -H "Authorization: token $GITHUB_TOKEN" {https_upstream.url("allowed.test", "/headers")}'
    result = egress_run(tmp_path, policy, {"GITHUB_TOKEN": GITHUB}, "sh", "-c", script, upstream_ca=test_ca_file)
    assert https_upstream.requests[-1]["headers"]["Authorization"] == f"token {GITHUB}"
    echoed = json.loads(result.stdout)
    assert echoed["Authorization"] != f"token {GITHUB}" and echoed["Authorization"].startswith("token ghp_")
    assert GITHUB not in result.stdout


JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9." \
      "eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkphbmUiLCJpYXQiOjE3MDAwMDAwMDB9." \
      "Kx7v1pQm3Rz9WcT0yHbN4aLsD8eF2gJuV6oI5kYtXqE"


def test_ignore_kinds_lets_a_format_through_but_not_stored_secrets(proxy_factory, https_upstream):
    strict = proxy_factory(DEFAULT_POLICY)
    refused = proxied_session(strict).get(https_upstream.url("allowed.test"), headers={"Cookie": f"session={JWT}"},
                                      timeout=20)
    assert refused.status_code == 403 and "jwt" in refused.text
    relaxed = proxy_factory(DEFAULT_POLICY + '\n[credentials]\nignore_kinds = ["jwt"]\n',
                            env={"MY_SERVICE_TOKEN": STORED})
    session = proxied_session(relaxed)
    ok = session.get(https_upstream.url("allowed.test"), headers={"Cookie": f"session={JWT}"}, timeout=20)
    assert ok.status_code == 200
    assert https_upstream.requests[-1]["headers"]["Cookie"] == f"session={JWT}"
    still = session.get(https_upstream.url("allowed.test", f"/small?k={STORED}"), timeout=20)
    assert still.status_code == 403


def test_an_unknown_kind_is_a_load_error(tmp_path):
    policy = tmp_path / "p.toml"
    policy.write_text('allow = ["example.org"]\n[credentials]\nignore_kinds = ["jwtt"]\n')
    result = subprocess.run([*egress_command(), "policy", "validate", str(policy)], capture_output=True,
                            text=True, timeout=60, env=clean_env(tmp_path))
    assert result.returncode == 1
    assert "'jwtt' is not a kind; did you mean 'jwt'?" in result.stderr
