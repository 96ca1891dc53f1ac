"""Shared fixtures: real upstream servers on 127.0.0.1, a real `egress serve` process.

Every name a test uses ends in `.test` and resolves to 127.0.0.1 through the
proxy's own `--resolve`, never through the machine's DNS; every address is
loopback. The machine's own CA and proxy variables are never passed on: clients
get an explicit, minimal environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

TEST_NAMES = ["allowed.test", "api.allowed.test", "denied.allowed.test", "other.test",
              "blocked.test", "private.test", "passthrough.test"]


# A warm proxy server (egress.run.warm.server) a test started and did not stop exits on its own after this.
WARM_IDLE_FOR_TESTS = "30"


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """A minimal environment: no inherited proxy, CA or pip/npm settings."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "EGRESS_WARM_IDLE": WARM_IDLE_FOR_TESTS}
    env.update(extra)
    return env


# ------------------------------------------------------- warm proxy servers


def warm_server_pids(root: Path) -> list[int]:
    """The warm proxy servers (egress.run.warm.server) running for a state folder under ``root``, by
    their command line: a server a run just started is found even before it has written its
    record."""
    found = []
    prefix = str(root).rstrip("/") + "/"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"egress.run.warm.server" not in args or b"--state-dir" not in args:
            continue
        state = args[args.index(b"--state-dir") + 1].decode(errors="replace") + "/"
        if state.startswith(prefix):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""  # a zombie's is empty
    except OSError:
        return False


def stop_warm_servers(root: Path) -> list[int]:
    """Stop (by pid: SIGTERM, then SIGKILL) every warm server whose state folder is under ``root``."""
    pids = warm_server_pids(root)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return pids


@pytest.fixture(autouse=True)
def _no_warm_server_outlives_its_test(tmp_path):
    yield
    stop_warm_servers(tmp_path)


# ------------------------------------------------ built once per test run, shared by the workers

SHARED_ENV = "EGRESS_TEST_SHARED"  # a folder for the whole run (every xdist worker inherits it)


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: starts real processes (tests/conftest.py E2E); -m 'not e2e' leaves them out")
    if not hasattr(config, "workerinput"):  # the controller, or a serial run: before any worker starts
        import tempfile

        shared = tempfile.mkdtemp(prefix="egress-tests-")
        os.chmod(shared, 0o755)  # user_venv: other users run egress from inside it
        os.environ[SHARED_ENV] = shared


# Test files that start real processes (egress serve or run, servers, clients, sandboxes, containers):
# their tests carry the `e2e` marker. `./scripts/test -m "not e2e"` runs the rest, in process.
E2E = {
    "test_brokered_secrets", "test_cli", "test_conformance", "test_control_auth", "test_credentials",
    "test_default_deny", "test_deny_by_address", "test_deploy", "test_dns", "test_doctor", "test_escapes",
    "test_front", "test_grants", "test_guardrails", "test_linux", "test_live_policy", "test_proxy",
    "test_run_capture", "test_body_forms", "test_decode_forms", "test_host_secrets",
    "test_providers", "test_run", "test_run_clients", "test_run_confinement", "test_run_escapes",
    "test_run_toolchains", "test_scan_budget", "test_seccomp_escapes", "test_upstream", "test_warm",
    "test_workers",
}
E2E_PATHS = {"tests/proxy/test_limits.py"}  # (tests/proxy/addons/test_limits.py runs in process)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    for item in items:
        path = Path(item.path)
        if path.stem in E2E or str(path.relative_to(root)) in E2E_PATHS:
            item.add_marker(pytest.mark.e2e)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the workers are gone
        shutil.rmtree(os.environ.pop(SHARED_ENV, ""), ignore_errors=True)


@contextlib.contextmanager
def one_worker_at_a_time(name: str):
    """Held by one xdist worker at a time (a lock in the run's shared folder): for what the machine
    has once, such as the test host's fixed addresses (test_run.test_host)."""
    import fcntl

    with open(Path(os.environ[SHARED_ENV]) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def built_once(name: str, build) -> Path:
    """``<the run's shared folder>/<name>``, made by ``build(path)`` in the first worker to ask while
    the others wait (a lock); pytest.skip with the first build's reason in every worker if it failed."""
    root = Path(os.environ[SHARED_ENV])
    path, failed = root / name, root / f"{name}.failed"
    with one_worker_at_a_time(name):
        if not path.exists() and not failed.exists():
            try:
                build(path)
            except pytest.skip.Exception as e:
                failed.write_text(str(e.msg))
            except Exception as e:
                failed.write_text(f"building {name} failed: {e}")
    if failed.exists():
        pytest.skip(failed.read_text())
    return path


@pytest.fixture(scope="session")
def user_venv():
    """egress installed for a user who cannot read /root (where this machine's default Python lives):
    (venv, nobody's passwd entry). Built once a run (~30 s; it was built once per file using it)."""
    import pwd

    if os.geteuid() != 0:
        pytest.skip("switching to the 'nobody' user needs root")
    system_python = "/usr/bin/python3.11"
    if not os.access(system_python, os.X_OK):
        pytest.skip(f"{system_python} (Debian's python3.11, readable by every user) is not installed")

    def build(venv: Path) -> None:
        subprocess.run([system_python, "-m", "venv", str(venv)], check=True, capture_output=True)
        install = subprocess.run([f"{venv}/bin/pip", "install", "-q", str(Path(__file__).resolve().parents[1])],
                                 capture_output=True, text=True)
        if install.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.skip(f"cannot install egress for another user: {install.stderr[-500:]}")

    return str(built_once("user-venv", build)), pwd.getpwnam("nobody")


# Folders egress run shows empty inside its sandbox (sandbox/mounts.py MASKED).
MASKED_BY_THE_SANDBOX = ("/tmp", "/var/tmp", "/run", "/var/run")


def _unmasked_base(for_everyone: bool) -> Path:
    """A folder outside what the sandbox masks, writable here (and with `for_everyone`, every
    ancestor searchable by other users): where 'elsewhere on the host' lives in tests."""
    # The checkout, home, the current folder; as root, /var/lib (a clone under /tmp, home 0700).
    candidates = [Path(__file__).resolve().parents[1], Path.home(), Path.cwd(), Path("/var/lib")]
    for base in candidates:
        real = os.path.realpath(base)
        masked = any(real == m or real.startswith(m + "/") for m in MASKED_BY_THE_SANDBOX)
        searchable = all(os.stat(p).st_mode & 0o001 for p in [real, *map(str, Path(real).parents)])
        if not masked and os.access(real, os.W_OK) and (searchable or not for_everyone):
            return Path(real)
    pytest.skip(f"no writable folder{' that every user can reach' if for_everyone else ''} outside "
                f"{', '.join(MASKED_BY_THE_SANDBOX)} among {', '.join(map(str, candidates))}")


def make_host_dir(for_everyone: bool = False) -> Path:
    """A fresh folder the sandbox shows read-only: a stand-in for the user's files outside the project.
    The caller removes it."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=".egress-test-host-", dir=_unmasked_base(for_everyone)))
    path.chmod(0o755)
    return path


@pytest.fixture
def host_dir():
    path = make_host_dir()
    try:
        yield path
    finally:
        stop_warm_servers(path)  # a state folder in it has one; starting, it would make the folder again
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ raw echo upstream


class RawServer:
    """A raw TCP server on 127.0.0.1:0 (or ``host``): each connection (TLS first with
    ``ssl_context``) given to ``handle(conn)`` in a thread of its own; an OSError there ends it."""

    def __init__(self, host: str = "127.0.0.1", ssl_context=None):
        self.ssl_context = ssl_context
        self.sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
            self.handle(conn)
        except OSError:
            pass
        finally:
            conn.close()  # the TLS socket when there is one: the plain one was handed to it

    def handle(self, conn) -> None:
        raise NotImplementedError

    def close(self):
        self.stopped.set()
        self.sock.close()


class EchoServer(RawServer):
    """A raw TCP server that echoes what it reads."""

    def handle(self, conn):
        while data := conn.recv(65536):
            conn.sendall(data)


# ------------------------------------------------------------------ upstreams


@dataclass
class Upstream:
    """A local HTTP or HTTPS server that records what reached it."""

    server: ThreadingHTTPServer
    scheme: str
    connections: int = 0
    requests: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    release: threading.Event = field(default_factory=threading.Event)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def url(self, host: str, path: str = "/small") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: Upstream

    def log_message(self, *args):  # keep test output clean
        pass

    def _record(self, body: bytes = b"") -> None:
        with self.upstream.lock:
            self.upstream.requests.append(
                {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body})

    def _send(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._record()
        path = self.path.split("?")[0]
        if path == "/small":
            self._send(200, b"hello from upstream\n")
        elif path == "/headers":
            self._send(200, json.dumps(dict(self.headers)).encode(), "application/json")
        elif path.startswith("/bytes/"):
            size = int(path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            chunk = b"x" * 65536
            while size > 0:
                self.wfile.write(chunk[: min(size, len(chunk))])
                size -= len(chunk)
        elif path == "/hang":
            self.upstream.release.wait(60)
            self.close_connection = True
        elif path == "/reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.connection.close()
            self.close_connection = True
        else:
            self._send(404, b"not found\n")

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        self._record(body)
        self._send(200, body, self.headers.get("Content-Type") or "application/octet-stream")


def _start_upstream(ssl_context: ssl.SSLContext | None) -> Upstream:
    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def verify_request(self, request, client_address):
            with upstream.lock:
                upstream.connections += 1
            return True

    handler = type("Handler", (_Handler,), {})
    server = Server(("127.0.0.1", 0), handler)
    if ssl_context is not None:
        server.socket = ssl_context.wrap_socket(server.socket, server_side=True)
    upstream = Upstream(server, "https" if ssl_context else "http")
    handler.upstream = upstream
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return upstream


@pytest.fixture(scope="session")
def test_ca():
    trustme = pytest.importorskip("trustme", reason="trustme is needed to make test certificates")
    return trustme.CA()


@pytest.fixture(scope="session")
def test_ca_file(test_ca, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ca") / "upstream-ca.pem"
    test_ca.cert_pem.write_to_path(str(path))
    return path


def start_upstream(test_ca=None) -> Upstream:
    """An upstream on 127.0.0.1:0: HTTPS for TEST_NAMES with a certificate from ``test_ca``, else plain HTTP."""
    context = None
    if test_ca is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        test_ca.issue_cert(*TEST_NAMES, "127.0.0.1").configure_cert(context)
    return _start_upstream(context)


def stop_upstream(upstream: Upstream) -> None:
    upstream.release.set()
    upstream.server.shutdown()
    upstream.server.server_close()


@pytest.fixture
def http_upstream():
    upstream = start_upstream()
    yield upstream
    stop_upstream(upstream)


@pytest.fixture
def https_upstream(test_ca):
    upstream = start_upstream(test_ca)
    yield upstream
    stop_upstream(upstream)


# ---------------------------------------------------------------------- proxy


DEFAULT_POLICY = """
allow = ["allowed.test", "passthrough.test", "private.test"]
deny = ["denied.allowed.test"]
passthrough = ["passthrough.test"]
allow_private = ["allowed.test", "passthrough.test"]
"""


@dataclass
class ProxyProcess:
    process: subprocess.Popen
    port: int
    metrics_url: str | None
    state_dir: Path
    audit_path: Path
    stderr_lines: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ca_path(self) -> Path:
        return self.state_dir / "ca" / "mitmproxy-ca-cert.pem"

    def audit(self) -> list[dict]:
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line.strip()]

    def wait_for_audit(self, predicate, timeout: float = 10.0) -> list[dict]:
        """Events are written as flows finish, which may be just after the client returns."""
        deadline = time.monotonic() + timeout
        while True:
            events = self.audit()
            if any(predicate(e) for e in events) or time.monotonic() > deadline:
                return events
            time.sleep(0.05)

    def metrics(self) -> str:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def rss_peak_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")


def egress_command() -> list[str]:
    return [sys.executable, "-m", "egress.cli"]


# `egress serve` runs as many workers as CPUs unless told; the tests that are not about workers
# run one process, as they were written for (tests/serve/test_workers.py is about them).
# EGRESS_TEST_WORKERS=N runs every serve of the suite with N workers instead.
TEST_WORKERS = os.environ.get("EGRESS_TEST_WORKERS", "1")


def start_proxy(tmp_path: Path, policy: str = DEFAULT_POLICY, *extra: str,
                upstream_ca: Path | None = None, names=TEST_NAMES, env: dict | None = None,
                stdout=subprocess.DEVNULL) -> ProxyProcess:
    policy_path = tmp_path / "policy.toml"
    policy_path.write_text(policy)
    state_dir = tmp_path / "state"
    audit_path = tmp_path / "audit.jsonl"
    args = [*egress_command(), "serve", "--policy", str(policy_path), "--listen", "127.0.0.1:0",
            "--metrics", "127.0.0.1:0", "--state-dir", str(state_dir), "--audit-log", str(audit_path)]
    for name in names:
        args += ["--resolve", f"{name}:127.0.0.1"]
    if upstream_ca:
        args += ["--upstream-ca", str(upstream_ca)]
    args += list(extra)
    if "--workers" not in extra:
        args += ["--workers", TEST_WORKERS]
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=stdout,
                               stderr=subprocess.PIPE, text=True, env=clean_env(tmp_path, **(env or {})))
    lines: list[str] = []
    port = metrics_url = None
    deadline = time.monotonic() + 60
    while port is None or metrics_url is None:
        line = process.stderr.readline()
        if not line:
            process.wait(5)
            raise AssertionError(f"egress serve exited ({process.returncode}):\n{''.join(lines)}")
        lines.append(line)
        if "proxy listening on" in line:
            port = int(line.rsplit(":", 1)[1])
        elif "metrics on" in line:
            metrics_url = line.split("metrics on ", 1)[1].strip()
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("egress serve did not start:\n" + "".join(lines))

    def drain():
        for line in process.stderr:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return ProxyProcess(process, port, metrics_url, state_dir, audit_path, lines)


def stop_proxy(proxy: ProxyProcess) -> None:
    if proxy.process.poll() is None:
        proxy.process.send_signal(signal.SIGTERM)
        try:
            proxy.process.wait(10)
        except subprocess.TimeoutExpired:
            proxy.process.kill()
            proxy.process.wait()


@pytest.fixture
def proxy_factory(tmp_path, test_ca_file):
    started: list[ProxyProcess] = []

    def factory(policy: str = DEFAULT_POLICY, *extra: str, **kwargs) -> ProxyProcess:
        kwargs.setdefault("upstream_ca", test_ca_file)
        directory = tmp_path / f"proxy{len(started)}"
        directory.mkdir()
        proxy = start_proxy(directory, policy, *extra, **kwargs)
        started.append(proxy)
        return proxy

    yield factory
    for proxy in started:
        stop_proxy(proxy)
    for proxy in started:
        assert_no_crash(proxy)


def assert_no_crash(proxy: ProxyProcess) -> None:
    """An exception inside an addon, or in mitmproxy's own layers ("mitmproxy has crashed!",
    "connection handler has crashed"), is logged, not raised: make it fail the test."""
    errors = [line for line in proxy.stderr_lines
              if "Addon error" in line or "Traceback" in line or "has crashed" in line]
    assert not errors, "".join(proxy.stderr_lines)


@pytest.fixture
def proxy(proxy_factory) -> ProxyProcess:
    return proxy_factory()


def proxied_session(proxy: ProxyProcess):
    """A requests session through ``proxy`` that trusts only egress's CA and ignores the machine's settings."""
    import requests

    session = requests.Session()
    session.trust_env = False
    session.proxies = {"http": proxy.url, "https": proxy.url}
    session.verify = str(proxy.ca_path)
    return session


# ---------------------------------------------------------------------- curl


@pytest.fixture(scope="session")
def curl_path() -> str:
    path = shutil.which("curl")
    if path is None:
        pytest.skip("curl is not installed (.ci/run installs it)")
    return path


def run_curl(curl: str, proxy: ProxyProcess, url: str, *args: str, home: Path) -> subprocess.CompletedProcess:
    """curl through the proxy, trusting only egress's CA, with a clean environment."""
    command = [curl, "-sS", "--max-time", "30", "--proxy", proxy.url, "--cacert", str(proxy.ca_path),
               *args, url]
    return subprocess.run(command, capture_output=True, env=clean_env(home), timeout=60)
