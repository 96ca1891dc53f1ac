"""`egress run -- CMD` end to end: real namespaces, the real proxy, real clients.

Upstreams run on the host's 127.0.0.1; the command can reach them only through the
proxy (which resolves the test names to 127.0.0.1 with --resolve). Escape attempts
aim at a test host in a network namespace this test makes itself (veth, TEST-NET-2
addresses), so a leak would really arrive there and be seen.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from conftest import TEST_NAMES, clean_env, egress_command, make_host_dir, one_worker_at_a_time, stop_warm_servers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")

POLICY = 'allow = ["allowed.test"]\nallow_private = ["allowed.test"]\n'


def egress_run(tmp_path, *command: str, policy: str = POLICY, extra=(), upstream_ca=None, timeout=120,
               project=None, env=None) -> subprocess.CompletedProcess:
    """``egress run`` from a clean environment (plus ``env``: egress's own variables), the test names
    resolved to 127.0.0.1."""
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(policy)
    args = [*egress_command(), "run", "--policy", str(policy_file), "--state-dir", str(tmp_path / "state")]
    for name in TEST_NAMES:
        args += ["--resolve", f"{name}:127.0.0.1"]
    if upstream_ca:
        args += ["--upstream-ca", str(upstream_ca)]
    args += [*extra, "--", *command]
    project = project or tmp_path / "project"
    project.mkdir(exist_ok=True)
    launcher_tmp = tmp_path / "launcher-tmp"  # where egress run makes its per-run folder
    launcher_tmp.mkdir(exist_ok=True)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=project,
                          env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), TMPDIR=str(launcher_tmp), **(env or {})))


@pytest.fixture(scope="module", autouse=True)
def namespaces_available():
    probe = subprocess.run(["unshare", "-Urn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user+network namespaces are not available here: {probe.stderr.decode().strip()}")


# ------------------------------------------------------------------ the road


def test_allowed_https_request_works_inside(tmp_path, https_upstream, test_ca_file, curl_path):
    result = egress_run(tmp_path, "curl", "-sS", https_upstream.url("allowed.test"), upstream_ca=test_ca_file)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from upstream\n"
    assert https_upstream.requests[-1]["headers"]["Host"] == f"allowed.test:{https_upstream.port}"


def test_python_and_git_clients_use_the_proxy(tmp_path, http_upstream):
    script = f"import urllib.request; print(urllib.request.urlopen('{http_upstream.url('allowed.test')}').read().decode())"
    result = egress_run(tmp_path, sys.executable, "-c", script)
    assert result.returncode == 0, result.stderr
    assert "hello from upstream" in result.stdout
    if shutil.which("git"):
        # git over http to a server that is not a git server: the request must still arrive via the proxy.
        before = len(http_upstream.requests)
        egress_run(tmp_path, "git", "ls-remote", http_upstream.url("allowed.test", "/repo.git"))
        assert len(http_upstream.requests) > before
        assert http_upstream.requests[-1]["path"].startswith("/repo.git/info/refs")


def test_refusal_is_printed_by_egress_even_when_the_command_hides_it(tmp_path, https_upstream, curl_path):
    url = https_upstream.url("blocked.test")
    result = egress_run(tmp_path, "sh", "-c", f"curl -s {url} >/dev/null 2>&1; echo hidden")
    assert result.returncode == 0
    assert result.stdout == "hidden\n"
    assert "EGRESS_BLOCKED blocked.test (not on the allow list)" in result.stderr
    assert https_upstream.connections == 0


def test_refused_request_shows_the_403_and_is_reported_once(tmp_path, https_upstream, curl_path):
    url = https_upstream.url("blocked.test")
    result = egress_run(tmp_path, "sh", "-c", f"curl -sS {url}; curl -sS {url}")
    assert "CONNECT tunnel failed, response 403" in result.stderr
    assert result.stderr.count("EGRESS_BLOCKED blocked.test") == 1


@pytest.mark.parametrize("mode", ["warm", "lazy"])
def test_each_refusal_line_comes_whole_and_before_the_commands_own_error(tmp_path, https_upstream, curl_path, mode):
    # Measured before: the 403 went to curl at once while egress's line was written on a thread
    # of its own (lazy) or by the launcher (warm). In the lazy mode curl's error came first in
    # every run; under load curl, which writes its error one byte per write(2), ran into the
    # line: "cEGRESS_BLOCKED blocked.test (...)" then "url: (56) CONNECT tunnel failed, ...".
    hosts = [f"h{i}.blocked.test" for i in range(12)]  # one line each: a host is named once per run
    script = "; ".join(f"curl -sS https://{host}:{https_upstream.port}/" for host in hosts)
    script += "; curl -sSf http://allowed.test:1/"  # an upstream failure: nothing listens on loopback's port 1
    result = egress_run(tmp_path, "sh", "-c", script, extra=["--proxy", mode])
    curl_error = "curl: (56) CONNECT tunnel failed, response 403"
    expected = [line for host in hosts for line in (f"EGRESS_BLOCKED {host} (not on the allow list)", curl_error)]
    expected += ["EGRESS_UPSTREAM_ERROR allowed.test", "curl: (22) The requested URL returned error: 502"]
    lines = [line for line in result.stderr.splitlines() if not line.startswith("egress: ")]
    assert [line.split(" (the upstream")[0] for line in lines] == expected
    assert https_upstream.connections == 0


@pytest.mark.parametrize("mode", ["warm", "lazy"])
def test_a_captured_connection_is_named_before_it_is_closed(tmp_path, mode):
    # Transparent capture (egress.proxy.capture): a raw TCP connection that is not HTTP is named,
    # then closed; the command that sees the close and says so writes after egress's line.
    script = textwrap.dedent("""
        import socket, sys
        for port in (7001, 7002, 7003):
            s = socket.create_connection(("198.51.100.2", port), timeout=10)
            s.sendall(b"SSH-2.0-OpenSSH_9.6\\r\\n")
            print(f"closed {port}: {s.recv(1)!r}", file=sys.stderr, flush=True)
    """)
    result = egress_run(tmp_path, sys.executable, "-c", script, extra=["--proxy", mode])
    lines = [line for line in result.stderr.splitlines() if not line.startswith("egress: ")]
    assert [line.split(" (")[0] for line in lines] == [
        line for port in (7001, 7002, 7003) for line in (f"EGRESS_BLOCKED 198.51.100.2:{port}", f"closed {port}: b''")
    ], result.stderr


def test_a_private_address_refusal_names_the_address_and_the_line_that_allows_it(tmp_path, curl_path):
    # A company resolver answering pypi.org with a documentation-range address: the run's line says
    # which address, what kind, and the exact policy line (nothing is dialled: refused before).
    result = egress_run(tmp_path, "curl", "-sS", "https://pypi.test/simple/",
                        extra=["--allow", "pypi.test", "--resolve", "pypi.test:203.0.113.80", "--headless"])
    assert result.returncode == 56  # curl: CONNECT tunnel failed
    assert ('EGRESS_BLOCKED pypi.test (resolves to 203.0.113.80, reserved for documentation; to allow it, add '
            '"203.0.113.80" to the policy\'s allow_private list: allow_private = ["203.0.113.80"])\n') in result.stderr


def test_deny_flag_wins_over_allow(tmp_path, http_upstream):
    result = egress_run(tmp_path, "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                        http_upstream.url("allowed.test"), extra=["--deny", "allowed.test"])
    assert result.stdout == "403"
    assert "EGRESS_BLOCKED allowed.test (on the deny list)" in result.stderr
    assert http_upstream.connections == 0


def test_exit_status_is_the_commands(tmp_path):
    assert egress_run(tmp_path, "sh", "-c", "exit 7").returncode == 7
    assert egress_run(tmp_path, "sh", "-c", "kill -TERM $$").returncode == 128 + 15


def test_missing_command_and_missing_project_fail_before_anything_runs(tmp_path):
    missing = egress_run(tmp_path, "definitely-not-a-command-egress")
    assert missing.returncode == 127 and "not found" in missing.stderr
    node = egress_run(tmp_path, "node", "-e", "1", extra=[]) if not shutil.which("node") else None
    if node is not None:
        assert "install it with" in node.stderr
    result = subprocess.run([*egress_command(), "run", "--project", str(tmp_path / "nope"), "--", "true"],
                            capture_output=True, text=True, env=clean_env(tmp_path, PYTHONPATH=os.getcwd()))
    assert result.returncode == 125 and "does not exist" in result.stderr


def test_bad_policy_is_a_launcher_failure(tmp_path):
    result = egress_run(tmp_path, "true", policy='allow = ["co.uk"]\n')
    assert result.returncode == 125
    assert "public suffix" in result.stderr


# ------------------------------------------------- the proxy options, as for serve


def test_the_proxy_options_of_serve_shape_the_runs_proxy(tmp_path, http_upstream, curl_path):
    from test_dns import DnsServer

    dns = DnsServer()
    try:
        dns.answers["named.test"] = ["127.0.0.1"]  # known to this DNS server only, not to --resolve
        dns.silent.add("silent.test")
        audit = tmp_path / "audit.jsonl"
        status = 'curl -s -o /dev/null -w "%{http_code} "'
        port = http_upstream.port
        result = egress_run(
            tmp_path, "sh", "-c", f"{status} http://named.test:{port}/small; {status} http://silent.test:{port}/; "
                                  f"{status} http://named.test:{port}/hang",
            policy='allow = ["named.test", "silent.test"]\nallow_private = ["127.0.0.1/32"]\n',
            extra=["--dns-server", f"127.0.0.1:{dns.port}", "--dns-timeout", "1", "--upstream-timeout", "1",
                   "--audit-log", str(audit), "--metrics", "127.0.0.1:0"])
    finally:
        dns.close()
    assert result.stdout.split() == ["200", "504", "504"], result.stderr
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(e["host"], e["reason"]) for e in events] == [
        ("named.test", "allowed"), ("silent.test", "dns-timeout"), ("named.test", "upstream-timeout")]
    assert len({e["session"] for e in events}) == 1 and events[0]["session"]
    assert re.search(r"^egress: metrics on http://127\.0\.0\.1:\d+/metrics$", result.stderr, re.M), result.stderr


@pytest.mark.parametrize("option", ["--metrics", "--audit-log"])
def test_an_unusable_metrics_port_or_audit_log_stops_the_run_before_the_command(tmp_path, option):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        value = f"127.0.0.1:{taken.getsockname()[1]}" if option == "--metrics" else str(tmp_path / "no" / "a.log")
        result = egress_run(tmp_path, "touch", "ran", extra=[option, value])
    assert result.returncode == 125
    assert ("cannot serve metrics on" if option == "--metrics" else "cannot open the audit log") in result.stderr
    assert not (tmp_path / "project" / "ran").exists()


# -------------------------------------------------------------- the walls


def test_command_sees_only_loopback(tmp_path):
    # /proc/net/dev lists the interfaces of the reader's own network namespace.
    result = egress_run(tmp_path, "cat", "/proc/net/dev")
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:]]
    assert interfaces == ["lo"], result.stdout


def test_direct_connections_to_host_loopback_fail_and_noproxy_by_name_goes_through_egress(tmp_path, http_upstream,
                                                                                          curl_path):
    direct = egress_run(tmp_path, "curl", "-sS", "--max-time", "5", "--noproxy", "*",
                        f"http://127.0.0.1:{http_upstream.port}/small")
    assert direct.returncode != 0  # the sandbox's own loopback: nothing listens there
    assert http_upstream.connections == 0
    # A client that ignores the proxy is captured (tests/run/test_run_capture.py): held to the policy.
    by_name = egress_run(tmp_path, "curl", "-sS", "--max-time", "5", "--noproxy", "*",
                         http_upstream.url("allowed.test"))
    assert by_name.stdout == "hello from upstream\n", by_name.stderr


def test_server_started_inside_is_reachable_inside_only(tmp_path):
    port_file = tmp_path / "project" / "port"
    script = textwrap.dedent(f"""
        import socket, urllib.request, http.server, threading
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        open({str(port_file)!r}, "w").write(str(srv.server_address[1]))
        body = urllib.request.urlopen(f"http://127.0.0.1:{{srv.server_address[1]}}/").read()
        print("inside ok" if body else "empty")
        import time; time.sleep(2)
    """)
    (tmp_path / "project").mkdir()
    process = subprocess.Popen([*egress_command(), "run", "--", sys.executable, "-c", script],
                               cwd=tmp_path / "project",
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=clean_env(tmp_path, PYTHONPATH=os.getcwd(),
                                             EGRESS_STATE_DIR=str(tmp_path / "state")))
    try:
        for _ in range(200):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        port = int(port_file.read_text())
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
    finally:
        out, err = process.communicate(timeout=60)
    assert "inside ok" in out, err


def test_writes_are_confined_to_the_project_and_added_dirs(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    extra = tmp_path / "extra"
    extra.mkdir()
    result = egress_run(
        tmp_path, "sh", "-c",
        f"touch inside && touch {extra}/added && touch $TMPDIR/tmp && (touch {outside}/x 2>/dev/null || echo refused)",
        extra=["--add-dir", str(extra)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused"
    assert (tmp_path / "project" / "inside").exists() and (extra / "added").exists()
    assert not (outside / "x").exists()
    etc = egress_run(tmp_path, "touch", "/etc/egress-test-file")
    assert etc.returncode != 0 and not os.path.exists("/etc/egress-test-file")


def test_timeout_kills_the_tree_and_cleans_up(tmp_path):
    seconds = 100000 + uuid.uuid4().int % 800000  # a sleep no other process on the machine runs
    marker = f"sleep {seconds}"
    result = egress_run(tmp_path, "sh", "-c", f"{marker} & {marker}",
                        extra=["--timeout", "1"])
    assert result.returncode == 124
    assert "timed out after 1 s" in result.stderr
    leftover = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert leftover.stdout == ""
    assert list((tmp_path / "launcher-tmp").iterdir()) == []


def test_network_off_has_no_proxy_and_fails_fast(tmp_path):
    result = egress_run(tmp_path, sys.executable, "-c",
                        "import os, socket; print(os.environ.get('HTTPS_PROXY'));"
                        "s = socket.socket(); s.settimeout(5); s.connect(('127.0.0.1', 3128))",
                        extra=["--network", "off"])
    assert result.stdout.startswith("None")
    assert "ConnectionRefusedError" in result.stderr


def test_network_off_pip_download_fails(tmp_path):
    result = egress_run(tmp_path, sys.executable, "-m", "pip", "download", "--no-deps", "-d", ".", "six",
                        extra=["--network", "off"], timeout=120)
    assert result.returncode != 0
    assert not list((tmp_path / "project").glob("six*"))


# --------------------------------------------- escapes toward a real test host


@pytest.fixture
def test_host():
    """A network namespace with a veth link to the machine and a TCP/UDP listener at 198.51.100.2:
    one at a time across test workers (its addresses are fixed). The path of the listener's log."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("making a test host needs root and iproute2 (ip)")
    with one_worker_at_a_time("test-host"):
        yield from _test_host()


def _test_host():
    name = f"egress-th-{uuid.uuid4().hex[:6]}"
    host_if, ns_if = f"eh{uuid.uuid4().hex[:6]}", f"en{uuid.uuid4().hex[:6]}"
    log = f"/tmp/{name}.log"

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", name)
    listener = None
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", name)
        ip("addr", "add", "198.51.100.1/24", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", name, "addr", "add", "198.51.100.2/24", "dev", ns_if)
        ip("-n", name, "link", "set", ns_if, "up")
        ip("-n", name, "link", "set", "lo", "up")
        server = textwrap.dedent(f"""
            import socket, select, sys
            t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(("0.0.0.0", 8080)); t.listen()
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", 53))
            print("ready", flush=True)
            while True:
                r, _, _ = select.select([t, u], [], [])
                with open({log!r}, "a") as f:
                    if t in r:
                        c, a = t.accept(); f.write(f"tcp {{a}}\\n"); c.close()
                    if u in r:
                        d, a = u.recvfrom(2048); f.write(f"udp {{a}}\\n")
        """)
        listener = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", server],
                                    stdout=subprocess.PIPE, text=True)
        assert listener.stdout.readline().strip() == "ready"
        # Only ever aim at the test host: the route must be our veth, not the machine's uplink.
        route = subprocess.run(["ip", "route", "get", "198.51.100.2"], capture_output=True, text=True).stdout
        assert f"dev {host_if}" in route, route
        # Sanity: from the machine the test host is reachable, so a leak would arrive and be logged.
        socket.create_connection(("198.51.100.2", 8080), timeout=5).close()
        for _ in range(100):  # the listener writes its line just after accepting
            if os.path.exists(log) and open(log).read():
                break
            time.sleep(0.05)
        assert open(log).read().startswith("tcp")
        os.unlink(log)
        yield log
    finally:
        if listener is not None:
            listener.kill()
            listener.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        if os.path.exists(log):
            os.unlink(log)


def test_raw_tcp_udp_and_dns_escapes_never_arrive(tmp_path, test_host):
    script = textwrap.dedent("""
        import socket
        results = []
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for target in [("198.51.100.2", 53), ("198.51.100.2", 9)]:
            try:
                u.sendto(b"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x07example\\x03com\\x00\\x00\\x01\\x00\\x01", target)
                results.append("udp-sent")
            except OSError as e:
                results.append(f"udp-failed:{e.errno}")
        try:
            s = socket.create_connection(("198.51.100.2", 8080), timeout=10); results.append("tcp-connected")
            s.recv(1)  # until egress, having named it, closes it (a command gone at once may not be named)
        except OSError as e:
            results.append(f"tcp-failed:{e.errno}")
        print(" ".join(results))
    """)
    result = egress_run(tmp_path, sys.executable, "-c", script)
    # Captured (tests/run/test_run_capture.py): the TCP connect reaches egress, which names and closes
    # it; the DNS query reaches egress's stub; the other datagram is refused in the namespace.
    assert result.stdout.split() == ["udp-sent", "udp-failed:1", "tcp-connected"], result.stdout
    assert "EGRESS_BLOCKED 198.51.100.2:8080 (only HTTP(S) passes:" in result.stderr
    assert "EGRESS_BLOCKED 198.51.100.2:9 (only HTTP(S) passes: UDP)" in result.stderr
    time.sleep(0.5)  # let any datagram that did leak be logged before we look
    assert not os.path.exists(test_host), open(test_host).read()


def test_policy_file_sets_the_mode_and_the_flag_overrides_it(tmp_path):
    probe = "import os; print(os.environ.get('HTTPS_PROXY'))"
    off = egress_run(tmp_path, sys.executable, "-c", probe, policy='network = "off"\n')
    assert off.stdout.strip() == "None"
    flag = egress_run(tmp_path, sys.executable, "-c", probe, policy='network = "off"\n',
                      extra=["--network", "allowlist"])
    assert flag.stdout.strip() == "http://127.0.0.1:3128"


def test_network_all_allows_unlisted_names_but_not_the_deny_list(tmp_path, http_upstream):
    policy = 'allow_private = ["other.test"]\ndeny = ["blocked.test"]\n'
    ok = egress_run(tmp_path, "curl", "-sS", http_upstream.url("other.test"), policy=policy,
                    extra=["--network", "all"])
    assert ok.stdout == "hello from upstream\n", ok.stderr
    refused = egress_run(tmp_path, "curl", "-sS", http_upstream.url("blocked.test"), policy=policy,
                         extra=["--network", "all"])
    assert "EGRESS_BLOCKED blocked.test (on the deny list)" in refused.stderr


# ------------------------------------------- a policy file the command can write


PROJECT_POLICY = 'allow_private = ["other.test"]\n'  # other.test may be private (127.0.0.1), not allowed
OPENED = 'allow = ["other.test"]\nallow_private = ["other.test"]\n'
STATUS = 'curl -s -o /dev/null -w "%{http_code}\\n"'


def test_the_command_rewriting_the_project_policy_does_not_reload_it(tmp_path, http_upstream, curl_path):
    from egress.host.live import POLL_SECONDS

    project = tmp_path / "project"
    project.mkdir()
    (project / "egress.toml").write_text(PROJECT_POLICY)
    script = (f"{STATUS} {http_upstream.url('blocked.test')}; "  # the first connection: the proxy and its watcher start
              f"printf '{OPENED}' > egress.toml; sleep {2 * POLL_SECONDS + 0.5}; "  # past the watcher's next look
              f"{STATUS} {http_upstream.url('other.test')}")
    result = egress_run(tmp_path, "sh", "-c", script, extra=["--policy", "./egress.toml"])
    assert result.stdout.split() == ["403", "403"], result.stderr
    assert "EGRESS_BLOCKED other.test (not on the allow list)" in result.stderr
    assert http_upstream.connections == 0
    assert (project / "egress.toml").read_text() == OPENED  # the command could write it
    assert result.stderr.count(f"egress: {project / 'egress.toml'} changed, but the command can write it: "
                               f"this run keeps the policy it started with (the edit applies to the next "
                               f"run)") == 1, result.stderr


def test_the_command_rewriting_the_project_policy_before_it_connects_changes_nothing(tmp_path, http_upstream,
                                                                                     curl_path):
    # The proxy's policy is built at the first connection: it must not read the rewritten file.
    project = tmp_path / "project"
    project.mkdir()
    (project / "egress.toml").write_text(PROJECT_POLICY)
    script = f"printf '{OPENED}' > egress.toml; {STATUS} {http_upstream.url('other.test')}"
    result = egress_run(tmp_path, "sh", "-c", script, extra=["--policy", "./egress.toml"])
    assert result.stdout.split() == ["403"], result.stderr
    assert "EGRESS_BLOCKED other.test (not on the allow list)" in result.stderr
    assert http_upstream.connections == 0
    assert (project / "egress.toml").read_text() == OPENED


# ----------------------------------------------------------- as an ordinary user


@contextlib.contextmanager
def nobody_home(nobody):
    """(home, project): a home of nobody's own with a project in it, made for a run and removed
    after it, with the warm proxy the run started as nobody."""
    home = tempfile.mkdtemp(prefix="egress-user-home-")
    try:
        os.chmod(home, 0o755)
        project = os.path.join(home, "project")
        os.mkdir(project)
        for path in (home, project):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        yield home, project
    finally:
        stop_warm_servers(Path(home))
        shutil.rmtree(home, ignore_errors=True)


def run_as_nobody(venv: str, nobody, policy_text: str, resolve: tuple[str, ...], script: str):
    """`egress run --policy P --resolve H:127.0.0.1... -- sh -c SCRIPT` as nobody, from a project in
    a home of its own (nobody_home)."""
    with nobody_home(nobody) as (home, project):
        policy = os.path.join(home, "policy.toml")
        with open(policy, "w") as f:
            f.write(policy_text)
        command = [f"{venv}/bin/egress", "run", "--policy", policy]
        for host in resolve:
            command += ["--resolve", f"{host}:127.0.0.1"]
        return subprocess.run([*command, "--", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                              cwd=project, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                              env={"PATH": "/usr/bin:/bin", "HOME": home})


def test_works_as_an_unprivileged_user(user_venv, http_upstream, curl_path):
    venv, nobody = user_venv
    result = run_as_nobody(venv, nobody, POLICY, ("allowed.test", "blocked.test"),
                           f"id -u; curl -sS {http_upstream.url('allowed.test')}; "
                           f"curl -s {http_upstream.url('blocked.test')} >/dev/null; "
                           f"touch /etc/egress-nobody 2>/dev/null || echo cannot-write-etc")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [str(nobody.pw_uid), "hello from upstream", "cannot-write-etc"]
    assert "EGRESS_BLOCKED blocked.test (not on the allow list)" in result.stderr


def test_npm_uses_the_proxy_and_its_trust(tmp_path, https_upstream, test_ca_file):
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    registry = https_upstream.url("allowed.test", "/")
    result = egress_run(tmp_path, npm, "view", "left-pad", "--registry", registry, "--userconfig", "/dev/null",
                        upstream_ca=test_ca_file, timeout=180)
    # The local upstream is no registry (404), but the request must have arrived through egress,
    # over TLS intercepted with egress's CA, which npm had to trust.
    assert any(r["path"].startswith("/left-pad") for r in https_upstream.requests), result.stderr


def test_escapes_fail_as_an_unprivileged_user(user_venv, http_upstream, curl_path):
    # Issue 8's attacks through the real launcher, as nobody: the run's own control socket and
    # CA key, its own policy file, host file metadata. (Terminal injection, sockets and shared
    # memory as nobody: tests/sandbox/test_escapes.py.)
    venv, nobody = user_venv
    home = str(make_host_dir(for_everyone=True))  # outside /tmp: hidden by egress, not just masked
    try:
        project, state = os.path.join(home, "project"), os.path.join(home, "state")
        os.mkdir(project)
        victim = os.path.join(home, "victim.txt")
        with open(victim, "w") as f:
            f.write("keep")
        os.chmod(victim, 0o644)
        policy = os.path.join(project, "egress.toml")
        with open(policy, "w") as f:
            f.write('allow_private = ["other.test"]\n')
        for path in (home, project, victim, policy):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        url = http_upstream.url("other.test")
        curl = f"curl -s -o /dev/null -w '%{{http_code}}\\n' {url}"
        script = (f"ls {state}/runs {state}/ca 2>/dev/null || echo state-hidden; {curl}; "
                  f"printf 'allow = [\"other.test\"]\\nallow_private = [\"other.test\"]\\n' > egress.toml; sleep 2; "
                  f"{curl}; "
                  f"chmod 4777 ../victim.txt 2>/dev/null || echo chmod-refused")
        command = [f"{venv}/bin/egress", "run", "--policy", "egress.toml", "--state-dir", state,
                   "--resolve", "other.test:127.0.0.1", "--", "sh", "-c", script]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=project,
                                user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                                env={"PATH": "/usr/bin:/bin", "HOME": home})
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["state-hidden", "403", "403", "chmod-refused"], result.stderr
        assert "EGRESS_BLOCKED other.test (not on the allow list)" in result.stderr
        assert "changed, but the command can write it" in result.stderr
        assert http_upstream.connections == 0
        assert os.stat(victim).st_mode & 0o7777 == 0o644
    finally:
        stop_warm_servers(Path(home))  # the run's warm proxy, started as nobody
        shutil.rmtree(home, ignore_errors=True)
