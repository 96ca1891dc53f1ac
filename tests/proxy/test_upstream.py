"""Upstream trust and upstream failures, end to end: a real `egress serve` and `egress run`, real
upstreams on 127.0.0.1 with trustme certificates, a real DNS server on 127.0.0.1, curl.

The "system" trust store here is a bundle holding only the test network's CA (the CA that
signs ``https_upstream``: a network that re-signs outbound TLS with a CA of its own, installed
in the system store), handed to egress as its own ``SSL_CERT_FILE``. An upstream signed by
``stranger_ca`` stands for one signed by a CA nobody installed. The machine's own store and
variables never decide an outcome: egress gets a clean environment.
"""

from __future__ import annotations

import re
import socket
import ssl
import subprocess
import sys

import pytest
from conftest import (
    DEFAULT_POLICY,
    TEST_NAMES,
    RawServer,
    _start_upstream,
    clean_env,
    egress_command,
    proxied_session,
    run_curl,
)
from test_dns import DnsServer
from test_run import egress_run

from egress.core.contract import EXIT_LAUNCHER, EXIT_STATE

UNKNOWN_CA_LINE = ("EGRESS_UPSTREAM_ERROR other.test (the upstream server's certificate did not verify: unable to get "
                   "local issuer certificate; if a proxy on your network re-signs TLS, pass its CA with "
                   "--upstream-ca FILE)")
POLICY = 'allow = ["allowed.test", "other.test"]\nallow_private = ["127.0.0.1/32"]\n'

namespaces = pytest.mark.skipif(
    sys.platform != "linux" or subprocess.run(["unshare", "-Urn", "true"], capture_output=True).returncode != 0,
    reason="egress run needs Linux user and network namespaces (unshare -Urn failed)")


@pytest.fixture
def system_bundle(tmp_path, test_ca):
    """A stand-in for the system's CA bundle: the test network's CA only."""
    path = tmp_path / "system-ca-bundle.pem"
    test_ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture(scope="session")
def stranger_ca():
    trustme = pytest.importorskip("trustme", reason="trustme is needed to make test certificates")
    return trustme.CA()


@pytest.fixture
def stranger_ca_file(tmp_path, stranger_ca):
    path = tmp_path / "stranger-ca.pem"
    stranger_ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture
def stranger_upstream(stranger_ca):
    """An HTTPS upstream whose certificate a CA in no trust store signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    stranger_ca.issue_cert(*TEST_NAMES, "127.0.0.1").configure_cert(context)
    upstream = _start_upstream(context)
    yield upstream
    upstream.server.shutdown()
    upstream.server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (connecting is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_line(proxy, line: str) -> list[str]:
    """serve's stderr lines once ``line`` is among them (events reach observers within ~0.1 s)."""
    import time

    deadline = time.monotonic() + 10
    while line not in [seen.rstrip("\n") for seen in proxy.stderr_lines] and time.monotonic() < deadline:
        time.sleep(0.05)
    return [seen.rstrip("\n") for seen in proxy.stderr_lines]


# ------------------------------------------------------------ trust: serve


def test_serve_trusts_the_system_store_with_no_flag(proxy_factory, https_upstream, system_bundle, curl_path,
                                                    tmp_path):
    proxy = proxy_factory(POLICY, upstream_ca=None, env={"SSL_CERT_FILE": str(system_bundle)})
    result = run_curl(curl_path, proxy, https_upstream.url("allowed.test"), home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"hello from upstream\n"
    assert f"egress: upstream certificates verified against SSL_CERT_FILE {system_bundle}\n" in proxy.stderr_lines


def test_an_upstream_signed_by_an_unknown_ca_is_refused_naming_the_host_and_the_fix(
        proxy_factory, https_upstream, stranger_upstream, system_bundle, curl_path, tmp_path):
    proxy = proxy_factory(POLICY, upstream_ca=None, env={"SSL_CERT_FILE": str(system_bundle)})
    url = stranger_upstream.url("other.test")

    # Before: the tunnel's 200, then mitmproxy's HTML 502 page, and curl exited 0 having printed it.
    response = proxied_session(proxy).get(url, timeout=30)
    assert response.status_code == 502
    assert response.headers["X-Egress-Error"] == "other.test; reason=upstream-certificate"
    assert response.text == ("EGRESS_UPSTREAM_ERROR other.test: the upstream server's certificate did not verify "
                             "(unable to get local issuer certificate; if a proxy on your network re-signs TLS, "
                             "pass its CA with --upstream-ca FILE)\n")
    failing = run_curl(curl_path, proxy, url, "-f", home=tmp_path)
    assert failing.returncode == 22  # an HTTP error for curl -f, as for any 502
    assert stranger_upstream.requests == []  # nothing was sent to the server that could not be verified

    lines = wait_for_line(proxy, UNKNOWN_CA_LINE)
    assert lines.count(UNKNOWN_CA_LINE) == 1  # once per host and reason, though asked twice
    events = proxy.wait_for_audit(lambda e: e["host"] == "other.test")
    assert [(e["decision"], e["reason"]) for e in events if e["host"] == "other.test"] == [
        ("allow", "allowed"), ("error", "upstream-certificate"), ("allow", "allowed"), ("error", "upstream-certificate")]
    assert 'egress_upstream_errors_total{domain="other.test",reason="upstream-certificate"} 2.0' in proxy.metrics()

    # the system store still decides the rest: the network's own upstream is trusted
    assert run_curl(curl_path, proxy, https_upstream.url("allowed.test"), home=tmp_path).stdout == b"hello from upstream\n"


def test_upstream_ca_is_trusted_on_top_of_the_system_store(proxy_factory, https_upstream, stranger_upstream,
                                                          system_bundle, stranger_ca_file, curl_path, tmp_path):
    proxy = proxy_factory(POLICY, upstream_ca=stranger_ca_file, env={"SSL_CERT_FILE": str(system_bundle)})
    for upstream, name in ((stranger_upstream, "other.test"), (https_upstream, "allowed.test")):
        result = run_curl(curl_path, proxy, upstream.url(name), "-f", home=tmp_path)
        assert (result.returncode, result.stdout) == (0, b"hello from upstream\n"), result.stderr
    assert (f"egress: upstream certificates verified against SSL_CERT_FILE {system_bundle} and --upstream-ca "
            f"{stranger_ca_file}\n") in proxy.stderr_lines


# -------------------------------------------------------------- trust: run


@namespaces
def test_run_trusts_the_system_store_and_names_an_untrusted_upstream(
        tmp_path, https_upstream, stranger_upstream, system_bundle, stranger_ca_file, curl_path):
    status = "curl -sS -o /dev/null -w '%{http_code}\\n'"
    script = f"curl -sS {https_upstream.url('allowed.test')}; {status} {stranger_upstream.url('other.test')}"
    result = egress_run(tmp_path, "sh", "-c", script, policy=POLICY,
                        env={"SSL_CERT_FILE": str(system_bundle)})
    assert result.stdout == "hello from upstream\n502\n", result.stderr
    assert result.stderr.splitlines() == [UNKNOWN_CA_LINE]

    result = egress_run(tmp_path, "sh", "-c", script, policy=POLICY, upstream_ca=stranger_ca_file,
                        env={"SSL_CERT_FILE": str(system_bundle)})
    assert result.stdout == "hello from upstream\n200\n", result.stderr
    assert result.stderr == ""


# ------------------------------------------------- trust: bad files, at start


BAD_CA_FILES = {
    # kind: (how to make it, the problem egress names)
    "missing": (lambda path: None, "no such file"),
    "folder": (lambda path: path.mkdir(), "is a folder; expected a PEM file of CA certificates"),
    "empty": (lambda path: path.write_text(""), "is empty; expected a PEM file of CA certificates"),
    "not PEM": (lambda path: path.write_bytes(b"\x30\x82\x01\x0a DER, not PEM"),
                "holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
    "broken PEM": (lambda path: path.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n"
                                                "-----END CERTIFICATE-----\n"),
                   "OpenSSL cannot read its certificates"),
}


@pytest.mark.parametrize("kind", BAD_CA_FILES)
def test_a_bad_upstream_ca_stops_serve_at_start(tmp_path, kind):
    make, problem = BAD_CA_FILES[kind]
    path = tmp_path / "ca.pem"
    make(path)
    result = subprocess.run([*egress_command(), "serve", "--listen", "127.0.0.1:0", "--metrics", "off",
                             "--state-dir", str(tmp_path / "state"), "--upstream-ca", str(path)],
                            capture_output=True, text=True, timeout=60, env=clean_env(tmp_path))
    assert result.returncode == EXIT_STATE
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"egress: --upstream-ca {path}: {problem}"), result.stderr


@namespaces
@pytest.mark.parametrize("kind", BAD_CA_FILES)
def test_a_bad_upstream_ca_stops_run_before_the_command(tmp_path, kind):
    make, problem = BAD_CA_FILES[kind]
    path = tmp_path / "ca.pem"
    make(path)
    result = egress_run(tmp_path, "touch", "ran", upstream_ca=path)
    assert result.returncode == EXIT_LAUNCHER
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"egress: --upstream-ca {path}: {problem}"), result.stderr
    assert not (tmp_path / "project" / "ran").exists()


def test_a_bad_ssl_cert_file_in_egress_environment_stops_serve_at_start(tmp_path):
    missing = tmp_path / "no-such-bundle.pem"
    result = subprocess.run([*egress_command(), "serve", "--listen", "127.0.0.1:0", "--metrics", "off",
                             "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60,
                            env=clean_env(tmp_path, SSL_CERT_FILE=str(missing)))
    assert result.returncode == EXIT_STATE
    assert result.stderr == f"egress: SSL_CERT_FILE={missing} (egress's environment): no such file\n"


# --------------------------------------------------- upstream failures named


@pytest.fixture
def failures(tmp_path, http_upstream):
    """The policy, options and URLs of four failures: a name that does not resolve (the DNS
    server answers NXDOMAIN), a closed port (plain and in a tunnel), an upstream that never
    answers, and an HTTPS request to a server that does not speak TLS."""
    dns = DnsServer()
    closed = closed_port()
    yield {
        "policy": 'allow = ["nothing.invalid", "closed.test", "allowed.test"]\nallow_private = ["127.0.0.1/32"]\n',
        "options": ["--dns-server", f"127.0.0.1:{dns.port}", "--dns-timeout", "2", "--upstream-timeout", "1",
                    "--resolve", "closed.test:127.0.0.1"],
        "urls": ["http://nothing.invalid/", f"http://closed.test:{closed}/", f"https://closed.test:{closed}/",
                 http_upstream.url("allowed.test", "/hang"), f"https://allowed.test:{http_upstream.port}/small"],
        "statuses": ["502", "502", "502", "504", "502"],
        "lines": [
            "EGRESS_UPSTREAM_ERROR nothing.invalid (the name does not resolve)",
            re.compile(r"EGRESS_UPSTREAM_ERROR closed\.test \(the upstream server could not be reached: "
                       r".*Connect call failed.*\)"),
            "EGRESS_UPSTREAM_ERROR allowed.test (the upstream server did not answer in time)",
            "EGRESS_UPSTREAM_ERROR allowed.test (the TLS handshake with the upstream server failed: The remote "
            "server does not speak TLS.)",
        ],
    }
    dns.close()


def matches(expected, line: str) -> bool:
    return expected.fullmatch(line) is not None if isinstance(expected, re.Pattern) else expected == line


@namespaces
def test_run_prints_one_line_per_host_and_cause_of_upstream_failure(tmp_path, failures, curl_path):
    status = "curl -s -o /dev/null -w '%{http_code} '"
    script = "; ".join(f"{status} {url}" for url in failures["urls"] * 2)  # each twice: one line each still
    result = egress_run(tmp_path, "sh", "-c", script, policy=failures["policy"], extra=failures["options"])
    assert result.stdout.split() == failures["statuses"] * 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == len(failures["lines"]), result.stderr
    for expected in failures["lines"]:
        assert sum(matches(expected, line) for line in lines) == 1, (expected, result.stderr)


def test_serve_logs_and_counts_upstream_failures(proxy_factory, failures, http_upstream):
    proxy = proxy_factory(failures["policy"], *failures["options"], upstream_ca=None)
    session = proxied_session(proxy)
    for _ in range(2):
        for url, status in zip(failures["urls"], failures["statuses"]):
            response = session.get(url, timeout=30)
            assert response.status_code == int(status), (url, response.text)
            assert response.text.startswith("EGRESS_UPSTREAM_ERROR "), (url, response.text)
            assert re.fullmatch(r"[a-z.]+; reason=[a-z-]+", response.headers["X-Egress-Error"])
    wait_for_line(proxy, failures["lines"][-1])
    lines = [line.rstrip("\n") for line in proxy.stderr_lines if line.startswith("EGRESS_")]
    assert len(lines) == len(failures["lines"]), lines
    for expected in failures["lines"]:
        assert sum(matches(expected, line) for line in lines) == 1, (expected, lines)
    metrics = proxy.metrics()
    for domain, reason, count in (("nothing.invalid", "dns-failed", 2), ("closed.test", "connect-failed", 4),
                                  ("allowed.test", "upstream-timeout", 2), ("allowed.test", "tls-failed", 2)):
        assert f'egress_upstream_errors_total{{domain="{domain}",reason="{reason}"}} {count}.0' in metrics


class TricklingTlsServer(RawServer):
    """A server that reads a ClientHello, then answers a byte every 0.3 s (a handshake record
    header, then zeros) until the connection closes: a ServerHello that never ends."""

    def handle(self, conn):
        conn.recv(65536)
        for byte in b"\x16\x03\x03\x40\x00\x02" + bytes(16000):
            if self.stopped.wait(0.3):
                return
            conn.sendall(bytes([byte]))


def test_an_upstream_trickling_its_tls_handshake_is_cut_by_the_upstream_timeout(proxy_factory):
    # Before: the timeout closed flow.server_conn, which is not yet the connection being handshaken:
    # nothing was closed, and the request hung past --upstream-timeout (plain HTTP got its 504).
    proxy = proxy_factory(DEFAULT_POLICY, "--upstream-timeout", "1")
    upstream = TricklingTlsServer()
    try:
        response = proxied_session(proxy).get(f"https://allowed.test:{upstream.port}/", timeout=20)
    finally:
        upstream.close()
    assert response.status_code == 504
    assert response.headers["X-Egress-Error"] == "allowed.test; reason=upstream-timeout"


def test_a_client_that_gives_up_is_not_an_upstream_failure(proxy_factory, http_upstream, curl_path, tmp_path):
    proxy = proxy_factory(DEFAULT_POLICY, "--upstream-timeout", "30")
    result = run_curl(curl_path, proxy, http_upstream.url("allowed.test", "/hang"), "--max-time", "1", home=tmp_path)
    assert result.returncode == 28  # curl's own timeout
    events = proxy.wait_for_audit(lambda e: e["host"] == "allowed.test")
    assert [(e["decision"], e["reason"]) for e in events] == [("allow", "allowed")]
    assert events[0]["detail"].startswith("not completed: ")
    assert not any(line.startswith("EGRESS_UPSTREAM_ERROR") for line in proxy.stderr_lines)
    assert "egress_upstream_errors_total{" not in proxy.metrics()


def test_the_proxys_own_address_is_a_refusal_not_an_upstream_failure(proxy_factory, curl_path, tmp_path):
    # allowed.test resolves to 127.0.0.1, where the proxy listens: dialled, the request would come back
    # to the proxy. Before: counted and logged as an upstream that could not be reached (connect-failed,
    # 502, EGRESS_UPSTREAM_ERROR); it is a destination egress refuses.
    proxy = proxy_factory(DEFAULT_POLICY)
    for url in (f"http://allowed.test:{proxy.port}/", f"https://allowed.test:{proxy.port}/"):
        result = run_curl(curl_path, proxy, url, "-o", "/dev/null", "-w", "%{http_code} %{http_connect}",
                          home=tmp_path)
        assert "403" in result.stdout.decode().split(), (url, result.stdout, result.stderr)  # the GET's or the CONNECT's
    events = proxy.wait_for_audit(lambda e: e["method"] == "CONNECT")
    assert [(e["method"], e["decision"], e["reason"]) for e in events] == [("GET", "block", "private-address"),
                                                                         ("CONNECT", "block", "private-address")]
    metrics = proxy.metrics()
    assert 'egress_blocked_total{domain="allowed.test",reason="private-address"} 2.0' in metrics
    assert "egress_upstream_errors_total{" not in metrics
    assert not any(line.startswith("EGRESS_UPSTREAM_ERROR") for line in proxy.stderr_lines)


# ------------------------------------------ nothing but egress's lines on stderr


@namespaces
def test_many_short_runs_leave_only_egress_lines_and_the_commands_own_on_stderr(tmp_path, http_upstream, curl_path):
    # Measured before: a mitmproxy CancelledError traceback in ~2 of 80 runs of curl, and in every
    # run whose command connected and exited at once (its connection was still being served when
    # the proxy stopped: Python 3.11 reports such a cancelled task as an error).
    project = tmp_path / "project"
    project.mkdir()
    (project / "connect_and_go.py").write_text(
        "import os, socket, sys\n"
        "s = socket.create_connection(('127.0.0.1', 3128))\n"
        f"s.sendall(b'GET {http_upstream.url('allowed.test')} HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n')\n"
        "print('bye', file=sys.stderr, flush=True)\n"
        "os._exit(0)\n")
    commands = [
        (["python3", "connect_and_go.py"], {"bye"}),
        (["curl", "-sS", "-o", "/dev/null", http_upstream.url("allowed.test")], set()),
        (["curl", "-sS", http_upstream.url("blocked.test", "/").replace("http:", "https:")],
         {"curl: (56) CONNECT tunnel failed, response 403"}),
    ]
    strays = []
    for attempt in range(24):  # the first kind alone failed 10 of 10 before
        argv, own = commands[attempt % len(commands)]
        result = egress_run(tmp_path, *argv, project=project)
        strays += [line for line in result.stderr.splitlines()
                   if line not in own and not line.startswith(("egress: ", "EGRESS_BLOCKED ", "EGRESS_UPSTREAM_ERROR "))
                   or re.search(r"Traceback|Exception|Error\b|Task", line)]  # nor egress passing one on
    assert strays == []


def test_serve_stopped_with_connections_open_writes_only_its_own_lines(proxy_factory, http_upstream, https_upstream):
    from conftest import stop_proxy

    proxy = proxy_factory()
    clients = []
    for _ in range(5):  # tunnels open, and requests waiting on an upstream that never answers
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        sock.sendall(f"GET {http_upstream.url('allowed.test', '/hang')} HTTP/1.1\r\n"
                     f"Host: allowed.test:{http_upstream.port}\r\n\r\n".encode())
        clients.append(sock)
        tunnel = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        tunnel.sendall(f"CONNECT allowed.test:{https_upstream.port} HTTP/1.1\r\n\r\n".encode())
        tunnel.recv(1024)
        clients.append(tunnel)
    proxy.wait_for_audit(lambda e: e["method"] == "CONNECT")
    stop_proxy(proxy)
    for sock in clients:
        sock.close()
    assert proxy.process.returncode == 0
    assert [line for line in proxy.stderr_lines if not line.startswith(("egress: ", "EGRESS_"))] == []
    assert not any("Exception" in line or "Traceback" in line for line in proxy.stderr_lines)
