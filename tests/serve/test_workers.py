"""`egress serve --workers N`: one port, N real worker processes, one supervisor.

Every test runs a real serve with two workers (a real mitmproxy in each) and looks at what a
user sees: answers, the audit log (each line names its worker's pid), /metrics, stderr, the
control socket, the processes left behind. Connections are spread by the kernel by a hash
of their addresses, so each test makes enough new connections that both workers serve some
(40 give one worker all of them with odds of 2**-39).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import DEFAULT_POLICY, clean_env, egress_command, proxied_session, start_proxy, stop_proxy

pytestmark = pytest.mark.skipif(not os.sys.platform.startswith("linux"), reason="--workers needs Linux (SO_REUSEPORT)")

SPREAD = 40  # new connections that reach both workers (see above)


def wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def status(proxy, url: str) -> int:
    return proxied_session(proxy).get(url, timeout=30).status_code  # a new session: a new connection


def metric(proxy, line: str) -> float:
    match = re.search(rf"^{re.escape(line)} (\S+)$", proxy.metrics(), re.M)
    return float(match.group(1)) if match else 0.0


def audit_when(proxy, count: int, predicate=lambda e: True) -> list[dict]:
    """The audit log once ``count`` events match (events are written as flows finish)."""
    return wait_for(lambda: (lambda e: e if len(e) >= count else None)(
        [e for e in proxy.audit() if predicate(e)]), f"{count} audit lines")


def rules(proxy) -> int:
    from egress.policy.loader import load_policy

    return load_policy([str(proxy.audit_path.parent / "policy.toml")]).rule_count


def reloads(proxy) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in proxy.stderr_lines:
        if m := re.match(r"egress: worker (\d+): policy reloaded", line):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


@pytest.fixture
def two(proxy_factory):
    """A serve with two workers (and its worker pids)."""
    def start(policy: str = DEFAULT_POLICY, *extra: str, **kwargs):
        proxy = proxy_factory(policy, "--workers", "2", *extra, **kwargs)
        proxy.workers = wait_for(lambda: (lambda c: c if len(c) == 2 else None)(children(proxy.process.pid)),
                                 "two workers")
        return proxy
    return start


# ------------------------------------------------------------- one port, two workers


def test_requests_spread_over_both_workers_and_metrics_count_every_one(two, http_upstream):
    proxy = two()
    listening = [line for line in proxy.stderr_lines if "proxy listening on" in line]
    assert len(listening) == 1 and proxy.port > 0  # port 0 asked: one real port printed
    wait_for(lambda: any(f"2 workers, pids {proxy.workers[0]}, {proxy.workers[1]}" in line
                         for line in proxy.stderr_lines), "the workers' line")
    for _ in range(SPREAD):
        assert status(proxy, http_upstream.url("allowed.test")) == 200
    for _ in range(10):
        assert status(proxy, http_upstream.url("other.test")) == 403
    events = audit_when(proxy, SPREAD + 10)
    assert {e["worker"] for e in events} == set(proxy.workers)
    assert len(events) == SPREAD + 10 == len(http_upstream.requests) + 10
    assert metric(proxy, 'egress_requests_total{decision="allow",reason="allowed"}') == SPREAD
    assert metric(proxy, 'egress_requests_total{decision="block",reason="not-allowed"}') == 10
    assert metric(proxy, 'egress_blocked_total{domain="other.test",reason="not-allowed"}') == 10
    assert metric(proxy, 'egress_transferred_bytes_total{direction="download"}') == SPREAD * len(b"hello from upstream\n")
    assert metric(proxy, "egress_policy_rules") == rules(proxy)
    text = proxy.metrics()
    assert not re.search(r'pid="', text)  # summed, not one series per worker


def test_workers_1_is_one_process_as_before(proxy_factory, http_upstream):
    proxy = proxy_factory(DEFAULT_POLICY, "--workers", "1")
    assert status(proxy, http_upstream.url("allowed.test")) == 200
    [event] = audit_when(proxy, 1)
    assert "worker" not in event
    assert children(proxy.process.pid) == []
    assert not any("workers, pids" in line for line in proxy.stderr_lines)


def test_open_connections_sum_the_live_workers(two):
    proxy = two()
    clients = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(12)]
    try:
        wait_for(lambda: metric(proxy, "egress_open_connections") == 12, "12 open connections")
        os.kill(proxy.workers[0], signal.SIGKILL)
        wait_for(lambda: any("serving again" in line for line in proxy.stderr_lines), "the new worker")

        def still_open(sock: socket.socket) -> bool:
            try:
                return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b""
            except BlockingIOError:
                return True
            except OSError:
                return False

        left = wait_for(lambda: (lambda n: n if 0 < n < 12 else None)(sum(map(still_open, clients))),
                        "the killed worker's connections to close")
        # the killed worker's connections no longer count; the other worker's still do
        wait_for(lambda: metric(proxy, "egress_open_connections") == left, f"{left} open connections")
    finally:
        for sock in clients:
            sock.close()
    wait_for(lambda: metric(proxy, "egress_open_connections") == 0, "no open connection")


# ------------------------------------------------------------- policy and control


def test_a_policy_edit_sighup_and_policy_reload_reach_every_worker(two, http_upstream, tmp_path):
    proxy = two()
    policy = proxy.audit_path.parent / "policy.toml"
    url = http_upstream.url("other.test")
    assert status(proxy, url) == 403
    rules_before = rules(proxy)
    policy.write_text(DEFAULT_POLICY.replace('allow = ["allowed.test"', 'allow = ["allowed.test", "other.test"')
                      .replace('allow_private = ["allowed.test"', 'allow_private = ["allowed.test", "other.test"'))
    wait_for(lambda: reloads(proxy) == {"1": 1, "2": 1}, "both workers' reload")
    for _ in range(SPREAD):
        assert status(proxy, url) == 200
    allowed = audit_when(proxy, SPREAD, lambda e: e["host"] == "other.test" and e["decision"] == "allow")
    assert {e["worker"] for e in allowed} == set(proxy.workers)
    assert metric(proxy, "egress_policy_rules") == rules(proxy) > rules_before

    proxy.process.send_signal(signal.SIGHUP)
    wait_for(lambda: reloads(proxy) == {"1": 2, "2": 2}, "both workers' reload on SIGHUP")
    env = clean_env(tmp_path, EGRESS_STATE_DIR=str(proxy.state_dir))
    runs = subprocess.run([*egress_command(), "runs", "--json"], capture_output=True, text=True, env=env, timeout=30)
    [info] = [json.loads(line) for line in runs.stdout.splitlines()]
    assert info["run"] == f"serve-{proxy.process.pid}" and info["pid"] == proxy.process.pid
    assert sorted(info["workers"]) == proxy.workers
    result = subprocess.run([*egress_command(), "policy", "reload", "--run", info["run"]], capture_output=True,
                            text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: reloads(proxy) == {"1": 3, "2": 3}, "both workers' reload by `egress policy reload`")


def test_a_broken_edit_keeps_every_workers_last_good_policy(two, http_upstream):
    proxy = two()
    policy = proxy.audit_path.parent / "policy.toml"
    policy.write_text('allow = ["allowed.test", "com"]\n')  # a public suffix: refused
    wait_for(lambda: sum("policy not reloaded" in line for line in proxy.stderr_lines) >= 2, "both reports")
    for _ in range(SPREAD):
        assert status(proxy, http_upstream.url("allowed.test")) == 200
    assert {e["worker"] for e in audit_when(proxy, SPREAD)} == set(proxy.workers)
    assert metric(proxy, "egress_policy_load_errors_total") == 2  # one failed load per worker


def test_serve_with_workers_takes_no_grants(two, tmp_path):
    proxy = two()
    env = clean_env(tmp_path, EGRESS_STATE_DIR=str(proxy.state_dir))
    result = subprocess.run([*egress_command(), "allow", "other.test", "--run", f"serve-{proxy.process.pid}"],
                            capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 1
    assert "takes no grants" in result.stderr and "policy.toml" in result.stderr


def test_events_follow_sees_every_workers_events(two, http_upstream, tmp_path):
    proxy = two()
    env = clean_env(tmp_path, EGRESS_STATE_DIR=str(proxy.state_dir))
    follower = subprocess.Popen([*egress_command(), "events", "--follow", "--json", "--run",
                                 f"serve-{proxy.process.pid}"], stdout=subprocess.PIPE, text=True, env=env)
    seen: list[dict] = []
    reader = threading.Thread(target=lambda: seen.extend(json.loads(line) for line in follower.stdout), daemon=True)
    reader.start()
    try:
        # until the follower has subscribed (requests before that are not followed) and seen both workers
        for sent in range(1, 400):
            assert status(proxy, http_upstream.url("other.test", f"/{sent}")) == 403
            if len({e["worker"] for e in seen}) == 2:
                break
    finally:
        follower.terminate()
        follower.wait(10)
    assert {e["worker"] for e in seen} == set(proxy.workers)
    assert all(e["host"] == "other.test" and e["reason"] == "not-allowed" for e in seen)


def test_an_upstream_failure_is_said_once_across_workers(two, http_upstream):
    proxy = two("allow = [\"allowed.test\"]\nallow_private = [\"allowed.test\"]\n")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    port = closed.getsockname()[1]
    try:
        for _ in range(SPREAD):
            assert status(proxy, f"http://allowed.test:{port}/") == 502
        events = audit_when(proxy, SPREAD)
    finally:
        closed.close()
    assert {e["worker"] for e in events} == set(proxy.workers)
    said = wait_for(lambda: [line for line in proxy.stderr_lines if line.startswith("EGRESS_UPSTREAM_ERROR allowed.test")],
                    "the line")
    time.sleep(0.5)  # a second line would come within the observers' 0.1 s
    assert len([line for line in proxy.stderr_lines if line.startswith("EGRESS_UPSTREAM_ERROR")]) == len(said) == 1


def test_a_name_pointing_at_the_proxy_itself_is_refused_not_looped(two):
    proxy = two()
    response = proxied_session(proxy).get(f"http://allowed.test:{proxy.port}/", timeout=20)
    # with workers too, the proxy's own address is a refusal (issue 26 item 5), not a loop or a 502
    assert response.status_code == 403
    assert response.headers["X-Egress-Blocked"] == "allowed.test; reason=private-address"
    assert "this proxy's own listening address" in response.text.splitlines()[0]
    wait_for(lambda: metric(proxy, "egress_open_connections") <= 1, "the connection to end")


# ------------------------------------------------------------- the audit log


def _long_lines_under_load(proxy, url: str) -> int:
    """Requests from 8 threads at once, each refused for a stored secret in a header whose name is
    5000 characters long: the detail names the header, so each audit line is over 5 KB
    (PIPE_BUF is 4096). Returns how many were sent."""
    name = "X-" + "n" * 5000

    def client() -> None:
        for _ in range(25):
            response = proxied_session(proxy).get(url, headers={name: "token MY-STORED-SECRET-1234567"}, timeout=30)
            assert response.status_code == 403

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 8 * 25


def _whole_lines(text: str, count: int, workers: list[int]) -> None:
    lines = text.splitlines()
    assert len(lines) == count
    events = [json.loads(line) for line in lines]  # a line cut into by another would not parse
    assert all(len(line) > 5000 for line in lines)
    assert {e["worker"] for e in events} == set(workers)
    assert all(e["reason"] == "credential" for e in events)


def test_audit_lines_never_interleave_in_a_file(two, http_upstream):
    proxy = two(DEFAULT_POLICY, env={"MY_SERVICE_TOKEN": "MY-STORED-SECRET-1234567"})
    sent = _long_lines_under_load(proxy, http_upstream.url("allowed.test"))
    wait_for(lambda: len(proxy.audit_path.read_text().splitlines()) >= sent, "every line")
    _whole_lines(proxy.audit_path.read_text(), sent, proxy.workers)


def test_audit_lines_never_interleave_on_standard_output(tmp_path, test_ca_file, http_upstream):
    read, write = os.pipe()  # a pipe, as a log collector's: atomic only up to PIPE_BUF
    proxy = start_proxy(tmp_path, DEFAULT_POLICY, "--workers", "2", "--audit-log", "-",
                        upstream_ca=test_ca_file, env={"MY_SERVICE_TOKEN": "MY-STORED-SECRET-1234567"},
                        stdout=write)
    os.close(write)
    chunks: list[bytes] = []

    def slow_reader() -> None:  # a log collector that lags: the pipe fills, and writers wait on it
        while chunk := os.read(read, 4096):
            chunks.append(chunk)
            time.sleep(0.002)

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    try:
        workers = children(proxy.process.pid)
        sent = _long_lines_under_load(proxy, http_upstream.url("allowed.test"))
        wait_for(lambda: b"".join(chunks).count(b"\n") >= sent, "every line")
    finally:
        stop_proxy(proxy)
        reader.join(10)
        os.close(read)
    assert proxy.process.returncode == 0
    _whole_lines(b"".join(chunks).decode(), sent, workers)


# ------------------------------------------------------------- supervision


def test_a_killed_worker_is_restarted_and_no_connection_is_lost(two, http_upstream):
    proxy = two()
    for _ in range(10):
        assert status(proxy, http_upstream.url("allowed.test")) == 200
    audit_when(proxy, 10)  # written: a worker killed with SIGKILL loses the events it had not written yet
    killed, kept = proxy.workers
    os.kill(killed, signal.SIGKILL)
    # at once: connections hashed to the killed worker's socket wait in its queue for the new one
    for _ in range(SPREAD):
        assert status(proxy, http_upstream.url("allowed.test")) == 200
    assert any(f"worker 1 (pid {killed}) was killed by SIGKILL; starting another" in line
               for line in proxy.stderr_lines)
    new = [pid for pid in children(proxy.process.pid) if pid != kept]
    assert len(new) == 1 and new[0] != killed and not alive(killed)
    events = audit_when(proxy, 10 + SPREAD)
    assert {e["worker"] for e in events[10:]} == {kept, new[0]}
    assert metric(proxy, 'egress_requests_total{decision="allow",reason="allowed"}') == 10 + SPREAD  # kept


def test_sigterm_stops_every_worker_and_leaves_nothing_behind(tmp_path, test_ca_file, http_upstream):
    proxy = start_proxy(tmp_path, DEFAULT_POLICY, "--workers", "2", upstream_ca=test_ca_file)
    workers = wait_for(lambda: (lambda c: c if len(c) == 2 else None)(children(proxy.process.pid)), "two workers")
    shared = Path(Path(f"/proc/{workers[0]}/cmdline").read_bytes().split(b"\0")[4].decode())
    control = proxy.state_dir / "runs" / f"serve-{proxy.process.pid}.sock"
    assert shared.is_dir() and control.exists()
    assert status(proxy, http_upstream.url("allowed.test")) == 200
    proxy.process.send_signal(signal.SIGTERM)
    assert proxy.process.wait(30) == 0
    assert not any(alive(pid) for pid in workers)
    assert not shared.exists() and not control.exists()
    assert len(proxy.audit()) == 1


def test_a_killed_supervisor_takes_its_workers_with_it(tmp_path, test_ca_file, two):
    proxy = start_proxy(tmp_path, DEFAULT_POLICY, "--workers", "2", upstream_ca=test_ca_file)
    workers = wait_for(lambda: (lambda c: c if len(c) == 2 else None)(children(proxy.process.pid)), "two workers")
    shared = Path(Path(f"/proc/{workers[0]}/cmdline").read_bytes().split(b"\0")[4].decode())
    try:
        proxy.process.kill()
        proxy.process.wait()
        wait_for(lambda: not any(alive(pid) for pid in workers), "the workers to end")
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
        assert shared.is_dir()  # what a killed supervisor could not remove...
        two()
        assert not shared.exists()  # ...the next one does
    finally:
        import shutil

        shutil.rmtree(shared, ignore_errors=True)


def test_a_second_serve_on_the_same_port_is_refused(two, tmp_path):
    proxy = two()
    for workers in ("2", "1"):
        result = subprocess.run([*egress_command(), "serve", "--listen", f"127.0.0.1:{proxy.port}", "--metrics",
                                 "off", "--state-dir", str(proxy.state_dir), "--workers", workers],
                                capture_output=True, text=True, env=clean_env(tmp_path), timeout=60)
        assert result.returncode == 4, result.stderr
        assert f"cannot listen on 127.0.0.1:{proxy.port}" in result.stderr


def test_a_worker_that_cannot_start_stops_serve_with_its_status(tmp_path):
    # The supervisor checks the policy first (3); here a worker meets what only it does: an
    # unloadable module. Simulated with a PYTHONPATH whose egress.serve.workers fails to import.
    site = tmp_path / "site"
    repo = Path(__file__).resolve().parents[2]
    import shutil

    shutil.copytree(repo / "egress", site / "egress", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo / "policies", site / "egress" / "policies", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "egress" / "proxy" / "master.py").write_text("raise ImportError('this egress is broken')\n")
    result = subprocess.run([*egress_command(), "serve", "--listen", "127.0.0.1:0", "--metrics", "off",
                             "--state-dir", str(tmp_path / "state"), "--workers", "2"],
                            capture_output=True, text=True, timeout=120,
                            env=clean_env(tmp_path, PYTHONPATH=str(site), PYTHONSAFEPATH="1"))
    assert result.returncode == 6, result.stderr
    assert re.search(r"egress: worker \d \(pid \d+\) could not start \(exited with status 1\): stopping every worker",
                     result.stderr)
    assert "proxy listening" not in result.stderr


# ------------------------------------------------------------- the domain label's bound


@pytest.mark.parametrize("names, labels", [
    (["a.test", "b.test", "a.test", "c.test", "b.test"], ["a.test", "b.test", "a.test", "other", "b.test"]),
    ([None, "", "a.test"], ["other", "other", "a.test"]),
])
def test_the_first_names_keep_their_label_then_other(tmp_path, names, labels):
    from egress.observe.metrics import DomainLabels

    for path in (None, str(tmp_path / "domains")):  # one process, or a table shared by workers
        label = DomainLabels(path, limit=2).label
        assert [label(name) for name in names] == labels


LABELLER = """
import json, sys
from egress.observe.metrics import DomainLabels
label = DomainLabels(sys.argv[1], limit=50).label
names = [f"d{i}.test" for i in range(120)]
print(json.dumps({name: label(name) for name in (names if sys.argv[2] == "up" else names[::-1])}))
"""


def test_the_domain_bound_holds_across_worker_processes(tmp_path):
    # Three processes label 120 names at once, in different orders, against one table of 50.
    path = str(tmp_path / "domains")
    processes = [subprocess.Popen([os.sys.executable, "-c", LABELLER, path, order], stdout=subprocess.PIPE)
                 for order in ("up", "down", "up")]
    results = [json.loads(process.communicate(timeout=60)[0]) for process in processes]
    named = {name for result in results for name, label in result.items() if label != "other"}
    assert len(named) == 50
    for result in results:  # a name has the same label in every process
        assert result == {name: name if name in named else "other" for name in result}


def test_reloads_while_a_worker_restarts_do_not_end_it(two, http_upstream):
    proxy = two()
    os.kill(proxy.workers[0], signal.SIGKILL)
    wait_for(lambda: any("starting another" in line for line in proxy.stderr_lines), "the restart")
    for _ in range(40):  # SIGHUP's default action ends a process: the replacement must not get one early
        proxy.process.send_signal(signal.SIGHUP)
        time.sleep(0.02)
    wait_for(lambda: any("serving again" in line for line in proxy.stderr_lines), "the new worker")
    assert proxy.process.poll() is None, "".join(proxy.stderr_lines)
    for _ in range(SPREAD):
        assert status(proxy, http_upstream.url("allowed.test")) == 200
    assert len(set(e["worker"] for e in audit_when(proxy, SPREAD))) == 2


@pytest.mark.parametrize("broken", [False, True], ids=["policy-good", "policy-broken"])
def test_a_worker_that_keeps_dying_stops_serve_loudly(two, broken):
    # with the files broken, each replacement runs the last good policy: the rule is the same
    from egress.serve.workers import RESTARTS

    proxy = two()
    if broken:
        (proxy.audit_path.parent / "policy.toml").write_text("allow = [\n")
        wait_for(lambda: sum("policy not reloaded" in line for line in proxy.stderr_lines) >= 2, "both reports")
    for death in range(RESTARTS + 1):
        [pid] = [p for p in children(proxy.process.pid) if p not in proxy.workers[1:]]
        os.kill(pid, signal.SIGKILL)
        if death < RESTARTS:
            wait_for(lambda death=death: sum("serving again" in line for line in proxy.stderr_lines) == death + 1,
                     f"restart {death + 1}")
    assert proxy.process.wait(30) == 6
    last = [line for line in proxy.stderr_lines if "stopping every worker" in line]
    assert last == [f"egress: worker 1 (pid {pid}) was killed by SIGKILL, its {RESTARTS + 1}th end within 60 s: "
                    "stopping every worker\n"]
    assert not any(alive(p) for p in proxy.workers)
    assert sum("running the last good policy" in line for line in proxy.stderr_lines) == (RESTARTS if broken else 0)


def test_sigterm_while_serve_starts_stops_it_and_leaves_nothing(tmp_path):
    import glob

    policy = tmp_path / "policy.toml"
    policy.write_text(DEFAULT_POLICY)
    process = subprocess.Popen([*egress_command(), "serve", "--policy", str(policy), "--listen", "127.0.0.1:0",
                                "--metrics", "off", "--state-dir", str(tmp_path / "state"), "--workers", "2"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=clean_env(tmp_path))
    try:
        def catches_sigterm() -> bool:  # the supervisor's handler is in place (SigCgt), its folder made
            status = Path(f"/proc/{process.pid}/status").read_text()
            caught = int(re.search(r"^SigCgt:\s*(\S+)", status, re.M).group(1), 16)
            return bool(caught & (1 << (signal.SIGTERM - 1))) and bool(glob.glob(f"/tmp/egress-serve-{process.pid}-*"))
        wait_for(catches_sigterm, "the supervisor to catch SIGTERM")
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    def cmdline(pid: str) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            return b""

    workers = [pid for pid in filter(str.isdigit, os.listdir("/proc"))
               if f"egress-serve-{process.pid}-".encode() in cmdline(pid)]
    assert workers == [] and glob.glob(f"/tmp/egress-serve-{process.pid}-*") == []  # clean_env: no TMPDIR
    assert "proxy listening" not in process.stderr.read()


# ------------------------------------------------------------- the last good policy


def _workers_serving(proxy, url: str, expect: int, reason: str) -> set[int]:
    """``SPREAD`` requests answered ``expect``; the pids of the workers that decided them."""
    for _ in range(SPREAD):
        assert status(proxy, url) == expect
    events = audit_when(proxy, SPREAD, lambda e: e["reason"] == reason and e["host"] in url)
    return {e["worker"] for e in events[-SPREAD:]}


def test_a_worker_restarted_while_the_policy_is_broken_runs_the_last_good_policy(two, http_upstream):
    # P14: a broken edit, then one worker's death (kill -9: an OOM kill) used to stop every worker
    proxy = two()
    policy = proxy.audit_path.parent / "policy.toml"
    policy.write_text(DEFAULT_POLICY + "allow = [\n")  # a syntax error
    wait_for(lambda: sum("policy not reloaded" in line for line in proxy.stderr_lines) >= 2, "both reports")
    killed, kept = proxy.workers
    os.kill(killed, signal.SIGKILL)
    said = wait_for(lambda: [line for line in proxy.stderr_lines if "running the last good policy" in line]
                    or proxy.process.poll() is not None, "the replacement's line")
    assert proxy.process.poll() is None, "".join(proxy.stderr_lines)  # it stopped with 3 before
    assert re.fullmatch(rf"egress: worker 1: policy files do not load \({re.escape(str(policy))}:\d+: not valid "
                        r"TOML: .*\): running the last good policy from \d\d:\d\d:\d\d\n", said[0]), said
    wait_for(lambda: any("serving again" in line for line in proxy.stderr_lines), "the new worker")
    assert proxy.process.poll() is None, "".join(proxy.stderr_lines)
    [new] = [pid for pid in children(proxy.process.pid) if pid != kept]
    # both workers serve the last good policy: allowed 200, refused 403
    assert _workers_serving(proxy, http_upstream.url("allowed.test"), 200, "allowed") == {kept, new}
    assert _workers_serving(proxy, http_upstream.url("other.test"), 403, "not-allowed") == {kept, new}
    assert metric(proxy, "egress_policy_load_errors_total") >= 2  # the survivor's failed reload, the replacement's load

    # the next good edit reaches every worker, the replacement too
    before = reloads(proxy)
    policy.write_text(DEFAULT_POLICY.replace('allow = ["allowed.test"', 'allow = ["allowed.test", "other.test"')
                      .replace('allow_private = ["allowed.test"', 'allow_private = ["allowed.test", "other.test"'))
    wait_for(lambda: all(reloads(proxy).get(n, 0) > before.get(n, 0) for n in "12"), "both workers' reload")
    assert _workers_serving(proxy, http_upstream.url("other.test"), 200, "allowed") == {kept, new}
    assert proxy.process.poll() is None


def test_the_last_good_policy_is_its_files_as_read_then_and_nothing_before_the_first(tmp_path):
    # A worker's own load (egress.serve.workers.load_for_worker), in this process, on real files: the
    # texts of the newest policy that loaded, includes too, each led where it led then.
    from egress.policy.source import PolicySource
    from egress.proxy.build import BuildError
    from egress.serve.workers import LastGood, load_for_worker

    shared, said = tmp_path / "shared", []
    shared.mkdir()
    main, more = tmp_path / "main.toml", tmp_path / "more.toml"
    main.write_text('include = ["more.toml"]\nallow = ["a.test"]\n')
    more.write_text('allow = ["b.test" \n')  # broken before any policy loaded: serve's start fails, 3
    source = PolicySource([str(main)])
    with pytest.raises(BuildError) as failed:
        load_for_worker(source, str(shared), said.append)
    assert failed.value.status == 3 and LastGood.read(str(shared)) is None
    assert said == [f"policy not loaded: {more}:1: not valid TOML: Unclosed array (at end of document)"]

    more.write_text('allow = ["b.test"]\n')
    policy, _, fell_back = load_for_worker(source, str(shared), said.append)
    assert not fell_back and policy.decide("b.test").allowed
    more.write_text('allow = ["b.test", "c.test"]\n')  # a newer load, then a broken edit
    load_for_worker(source, str(shared), said.append)
    more.write_text('allow = ["b.test", "c.test"\n')
    said.clear()
    policy, _, fell_back = load_for_worker(source, str(shared), said.append)
    assert fell_back and [policy.decide(h).allowed for h in ("a.test", "b.test", "c.test", "d.test")] == [
        True, True, True, False]
    assert policy.files == [str(main), str(more)]
    [line] = said
    assert line.startswith(f"policy files do not load ({more}:1: not valid TOML") and "last good policy from" in line
    assert sorted(p.name for p in shared.iterdir()) == ["last-good-policy", "last-good-policy.lock"]  # no leftovers


def test_a_load_that_began_earlier_never_replaces_a_later_ones_texts(tmp_path):
    # Two workers reloading two quick edits: the one that read the older text may finish last.
    from egress.serve.workers import LastGood, TextRecorder

    policy = tmp_path / "policy.toml"
    policy.write_text('allow = ["old.test"]\n')
    older = TextRecorder(str(tmp_path))
    older(policy)
    policy.write_text('allow = ["new.test"]\n')
    newer = TextRecorder(str(tmp_path))
    newer(policy)
    assert newer.keep() is None and older.keep() is None
    assert LastGood.read(str(tmp_path))(policy) == 'allow = ["new.test"]\n'


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_reload_frees_the_policy_each_worker_started_with(two):
    # The worker's start-up kept a name for its first policy: a reload then freed nothing, and each
    # worker held two policies for its life where `--workers 1` holds one.
    entries = 150_000  # ~18 MB of policy in each worker
    big = "allow = [\n" + "".join(f'  "host-{i}.example{i % 50}.com",\n' for i in range(entries)) + "]\n"
    proxy = two(big)
    policy = proxy.audit_path.parent / "policy.toml"
    before = {pid: _rss_mib(pid) for pid in proxy.workers}
    policy.write_text('allow = ["allowed.test"]\n')
    wait_for(lambda: reloads(proxy) == {"1": 1, "2": 1}, "both workers' reload")
    # freed a piece at a time after the reload is said (egress.host.live._let_go), then trimmed
    wait_for(lambda: all(_rss_mib(pid) < before[pid] - 8 for pid in proxy.workers),
             f"both workers to give back their first policy (RSS before: {before})")
