"""One conformance suite for every sandbox `egress run` can hold a command in (sandbox/api.py), run
against each one this machine can run: the Linux namespace sandbox, podman and docker (a rootful
podman and a dockerd of the test's own, started as tests/sandbox/test_providers.py starts them),
--provider local, and macOS Seatbelt through the stand-in sandbox-exec of tests/sandbox/test_macos.py.
As httpjail's platform_tests! runs one suite against each jail, each promise here is one test,
parametrized over the providers.

Kept honest: what a provider does not promise is skipped with the reason (local is no sandbox),
and where this machine cannot see a promise kept (the stand-in sandbox-exec applies no profile,
it records it and runs the command), the test reads what a Mac would enforce instead: the
Seatbelt profile the launcher wrote, decided with tests/sbpl.py.

The promises:
  - the objects are what sandbox/api.py names (Platform, Listener, Box); closing a box while its
    command runs ends the command and lets go of the box's socket, and closing it before the
    command could start leaves nothing either;
  - the command runs in the project and its exit status comes back (its own, 126, 127);
  - the proxy is its only road out: through it an allowed host answers and a refused one is named;
    around it a direct connection to a host the test made arrives nowhere;
  - writes outside the project are refused (the project is writable);
  - signals reach it: SIGTERM to egress run runs the command's trap, and its status comes back;
  - the end cleans up: what the command left running, a --timeout's whole tree, the engine's
    containers, the run's port and folder are gone when egress run returns.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the providers are run on Linux (macOS's through a stand-in sandbox-exec)", allow_module_level=True)

from conftest import TEST_NAMES, clean_env, egress_command, make_host_dir  # noqa: E402
from sbpl import decide, read_sbpl, rules  # noqa: E402
from test_macos import DRIVER, STAND_IN  # noqa: E402
from test_providers import docker, image_tarball, make_project, podman  # noqa: E402, F401 (fixtures)
from test_run import test_host  # noqa: E402, F401 (fixture)

from egress.core.contract import EXIT_TIMEOUT  # noqa: E402
from sandbox import api, landlock  # noqa: E402
from sandbox.container import Container, ContainerSpec  # noqa: E402
from sandbox.platforms import Linux, MacOS  # noqa: E402
from sandbox.providers import Local  # noqa: E402
from sandbox.spec import SandboxError, SandboxSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
POLICY = 'allow = ["allowed.test"]\nallow_private = ["allowed.test"]\n'
WAIT = 60  # seconds; a safety net against hanging the suite, never an assertion about speed
PROVIDERS = ["namespace", "podman", "docker", "local", "seatbelt"]


@dataclass
class Subject:
    """One provider as this machine runs it."""

    name: str
    project: Path
    flags: list[str] = field(default_factory=list)  # egress run's --provider (and --image)
    env: dict[str, str] = field(default_factory=dict)  # the engine's own variables
    engine: object = None  # test_providers.Engine for podman and docker
    stand_in: Path | None = None  # the stand-in sandbox-exec (seatbelt)
    record: Path | None = None  # what it was given, a JSON line a start

    @property
    def sandbox(self) -> bool:
        return self.name != "local"

    @property
    def enforced(self) -> bool:
        """False where the sandbox's rules are written here but applied only on a Mac."""
        return self.stand_in is None

    def platform(self) -> api.Platform:
        if self.name == "namespace":
            return Linux()
        if self.name == "local":
            return Local()
        if self.name == "seatbelt":
            return MacOS(sandbox_exec=str(self.stand_in))
        return Container(self.name, ContainerSpec(self.engine.image))

    def profile(self) -> str:
        """The Seatbelt profile of the stand-in's last start (seatbelt only)."""
        import json

        last = json.loads(self.record.read_text().splitlines()[-1])
        assert last["argv"][1] == "-p"
        return last["argv"][2]


def _namespaces_missing() -> str | None:
    if landlock.abi_version() == 0:
        return f"Landlock is unavailable: {landlock.unavailable_reason()}"
    from sandbox.linux import start

    try:
        start(SandboxSpec(["true"], {"PATH": "/usr/bin:/bin"}, "/", network=False)).close()
    except SandboxError as e:
        return str(e)
    return None


@pytest.fixture(params=PROVIDERS)
def subject(request, tmp_path) -> Subject:
    name = request.param
    if name in ("podman", "docker"):
        engine = request.getfixturevalue(name)  # skips, naming what is missing here
        return Subject(name, make_project(tmp_path), ["--provider", name, "--image", engine.image],
                       engine.env, engine)
    project = tmp_path / "project"
    project.mkdir()
    if name == "namespace":
        if missing := _namespaces_missing():
            pytest.skip(f"the namespace sandbox cannot run here: {missing}")
        return Subject(name, project, ["--provider", "namespace"])
    if name == "local":
        return Subject(name, project, ["--provider", "local"])
    stand_in = tmp_path / "bin" / "sandbox-exec"
    stand_in.parent.mkdir()
    record = tmp_path / "sandbox-exec.jsonl"
    stand_in.write_text(STAND_IN.format(python=sys.executable, record=str(record)))
    stand_in.chmod(0o755)
    return Subject(name, project, stand_in=stand_in, record=record)


def egress_run(subject: Subject, tmp_path: Path, *command: str, extra=(), start=False):
    """``egress run`` with ``subject``'s provider from a clean environment, the test names resolved
    to 127.0.0.1; the macOS launcher through test_macos's driver. Its result, or (start) its process."""
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    if subject.stand_in is not None:
        args = [sys.executable, "-c", DRIVER, str(subject.stand_in)]
    else:
        args = [*egress_command(), "run"]
    args += ["--policy", str(policy), "--state-dir", str(tmp_path / "state")]
    for name in TEST_NAMES:
        args += ["--resolve", f"{name}:127.0.0.1"]
    args += [*subject.flags, *extra, "--", *command]
    launcher_tmp = tmp_path / "launcher-tmp"  # where egress run makes its per-run folder
    launcher_tmp.mkdir(exist_ok=True)
    env = clean_env(tmp_path, PYTHONPATH=str(REPO), TMPDIR=str(launcher_tmp), **subject.env)
    kwargs = dict(cwd=subject.project, env=env, text=True, stdin=subprocess.DEVNULL,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if start:
        return subprocess.Popen(args, **kwargs)
    return subprocess.run(args, timeout=300, **kwargs)


def processes_with(marker: str, program: str | None = None) -> list[int]:
    """Pids (this machine's view: containers' too) whose command line holds ``marker``; with
    ``program``, only those running it (not the engine's client, whose arguments hold it too)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()  # a zombie's reads empty
            except OSError:
                continue
            runs = program is None or os.path.basename(cmdline.split(b"\0")[0]) == program.encode()
            if marker.encode() in cmdline and runs:
                found.append(int(entry))
    return found


def gone(marker: str) -> bool:
    """True once no process holds ``marker``: a SIGKILL is sent before the run returns, and its
    target may take a moment to die."""
    deadline = time.monotonic() + WAIT
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not processes_with(marker)


def a_marker() -> str:
    """A sleep argument no other process has (an integer: busybox's sleep takes no fraction)."""
    return str(random.SystemRandom().randrange(10**8, 10**9))


# ------------------------------------------------------------------ the objects


def _start(subject: Subject, monkeypatch, marker: str):
    """``sleep MARKER`` started through the platform object itself: (platform, listener, box)."""
    for key, value in subject.env.items():  # the engine's client reads them from egress's environment
        monkeypatch.setenv(key, value)
    platform = subject.platform()
    listener = platform.listener(True)
    spec = SandboxSpec(["sleep", marker], {"PATH": "/usr/bin:/bin"}, str(subject.project),
                       writable=[str(subject.project)], proxy_port=listener.port, capture=platform.capture)
    return platform, listener, platform.start(spec, listener)


def test_the_objects_are_sandbox_apis_and_closing_a_box_ends_its_command(subject, monkeypatch):
    marker = a_marker()
    platform, listener, box = _start(subject, monkeypatch, marker)
    with box:
        assert isinstance(platform, api.Platform) and isinstance(listener, api.Listener)
        assert isinstance(box, api.Box)
        assert platform.refusal() is None
        assert isinstance(platform.holds_until_ready, bool) and isinstance(platform.writable_elsewhere(), list)
        assert (platform.warning is None) == subject.sandbox  # only what is no sandbox says so first
        url = urlsplit(listener.url)
        assert (url.hostname, url.port) == ("127.0.0.1", listener.port)
        box.ready()
        deadline = time.monotonic() + WAIT
        while not processes_with(marker, "sleep") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert processes_with(marker, "sleep"), "the command never started"
        assert box.returncode is None
        held = box.listen_socket
        assert held is not None  # where the run's proxy is served: made here, or inside the sandbox
    assert box.returncode is not None  # closed: the command ended with the box
    assert gone(marker)
    assert held.fileno() == -1  # and the box let go of the socket
    box.close()  # again: nothing happens
    box.signal(signal.SIGTERM)  # to a command that has ended: nothing happens
    if listener.socket is not None:  # a port on this machine's loopback: nobody listens there now
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", listener.port), timeout=WAIT).close()
    if subject.engine is not None:
        assert subject.engine.containers() == []


def test_a_box_closed_at_once_leaves_nothing(subject, monkeypatch):
    """Closed before its command could start (a launcher failing, a --timeout shorter than the
    engine's making of the container): nothing runs on, nothing is made later."""
    marker = a_marker()
    _, _, box = _start(subject, monkeypatch, marker)
    box.close()
    assert box.returncode is not None
    assert gone(marker)
    if subject.engine is not None:
        assert subject.engine.containers() == []


# ------------------------------------------------------------------ the command and its status


@pytest.mark.parametrize("command, status", [
    (["sh", "-c", "echo made > made; exit 7"], 7),
    (["sh", "-c", "exit 0"], 0),
    (["no-such-program-here"], 127),
    (["/etc/passwd"], 126),
], ids=["its-own", "zero", "not-found", "not-executable"])
def test_the_command_runs_in_the_project_and_its_status_comes_back(subject, tmp_path, command, status):
    result = egress_run(subject, tmp_path, *command)
    assert result.returncode == status, result.stderr
    if status == 7:
        assert (subject.project / "made").read_text() == "made\n"


# ------------------------------------------------------------------ the only road out


def test_the_proxy_is_the_road_out_an_allowed_host_answers_and_a_refused_one_is_named(subject, tmp_path,
                                                                                       http_upstream):
    script = ("curl -sS --max-time 60 " + http_upstream.url("allowed.test") +
              "; curl -sS --max-time 60 -o /dev/null -w '%{http_code}\\n' http://blocked.invalid/")
    result = egress_run(subject, tmp_path, "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from upstream\n403\n"
    assert "EGRESS_BLOCKED blocked.invalid (not on the allow list)" in result.stderr
    assert len(http_upstream.requests) == 1


def test_a_connection_around_the_proxy_arrives_nowhere(subject, tmp_path, test_host):  # noqa: F811 (a fixture)
    if not subject.sandbox:
        pytest.skip("--provider local is no sandbox: a client that ignores the proxy variables goes around it")
    has_ping = shutil.which("ping") or subject.engine  # (the test image's busybox has one)
    ping = "ping -c 1 -W 2 198.51.100.2 >/dev/null 2>&1; echo ping=$?; " if has_ping else ""
    script = f"curl -fsS --noproxy '*' --max-time 20 -o /dev/null http://198.51.100.2:8080/; echo tcp=$?; {ping}"
    result = egress_run(subject, tmp_path, "sh", "-c", script)
    if not subject.enforced:
        # The stand-in ran it unconfined; on a Mac the profile refuses every outbound road but one:
        # the run's proxy port on localhost (and Unix sockets in the run's own folder).
        outbound = [(action, filters) for action, operations, filters in rules(read_sbpl(subject.profile()))
                    if any(op.startswith("network") for op in operations)]
        assert decide(subject.profile(), "default") == "deny"
        ips = [f[2] for action, filters in outbound if action == "allow" for f in filters if f[:2] == ["remote", "ip"]]
        assert len(ips) == 1 and ips[0].startswith("localhost:")
        assert all(f[:2] in (["remote", "ip"], ["remote", "unix-socket"], ["local", "unix-socket"])
                   for action, filters in outbound if action == "allow" for f in filters)
        return
    lines = result.stdout.splitlines()
    assert "tcp=0" not in lines and "ping=0" not in lines, result.stdout
    # captured by the namespace's redirect, refused by egress and named
    assert "EGRESS_BLOCKED 198.51.100.2" in result.stderr, result.stderr
    assert not os.path.exists(test_host), open(test_host).read()


# ------------------------------------------------------------------ writes


def test_writes_outside_the_project_are_refused(subject, tmp_path):
    if not subject.sandbox:
        pytest.skip("--provider local is no sandbox: the command writes wherever its user can")
    outside = make_host_dir(for_everyone=True)  # the user's files elsewhere: writable for anyone here
    try:
        outside.chmod(0o777)
        script = f"echo x > {outside}/made; echo outside=$?; echo y > inside && echo inside=0"
        result = egress_run(subject, tmp_path, "sh", "-c", script)
        assert (subject.project / "inside").read_text() == "y\n", result.stderr
        if not subject.enforced:  # the stand-in wrote it; a Mac would refuse it
            profile = subject.profile()
            assert decide(profile, "file-write-create", f"{outside}/made") == "deny"
            assert decide(profile, "file-write-create", f"{os.path.realpath(subject.project)}/inside") == "allow"
            return
        assert "outside=0" not in result.stdout.splitlines(), result.stdout
        assert not (outside / "made").exists()
    finally:
        shutil.rmtree(outside, ignore_errors=True)


# ------------------------------------------------------------------ signals


def _catches(pid: int, sig: int) -> bool:
    """True once process ``pid`` has a handler for ``sig`` (egress run forwards from then on)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught & (1 << (sig - 1)))


def test_a_signal_to_egress_run_reaches_the_command(subject, tmp_path):
    script = "trap 'echo got TERM; exit 9' TERM; echo ready; while :; do sleep 1 & wait $!; done"
    run = egress_run(subject, tmp_path, "sh", "-c", script, start=True)
    try:
        assert run.stdout.readline() == "ready\n", run.stderr.read() if run.poll() is not None else ""
        deadline = time.monotonic() + WAIT
        while not _catches(run.pid, signal.SIGTERM) and time.monotonic() < deadline:
            time.sleep(0.02)
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 9, err
    assert out == "got TERM\n"


# ------------------------------------------------------------------ the end


def test_the_end_takes_what_the_command_left_its_port_and_its_folder(subject, tmp_path):
    marker = a_marker()
    result = egress_run(subject, tmp_path, "sh", "-c", f"sleep {marker} >/dev/null 2>&1 & echo $HTTPS_PROXY")
    assert result.returncode == 0, result.stderr
    assert gone(marker), "a process the command left outlived its run"
    assert os.listdir(tmp_path / "launcher-tmp") == []  # the run's own folder
    if subject.engine is not None:
        assert subject.engine.containers() == []  # nor a holder
    port = urlsplit(result.stdout.strip()).port
    if subject.name in ("local", "seatbelt"):  # the port was this machine's: nobody listens there now
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=WAIT).close()


def test_a_timeout_ends_everything_the_command_started(subject, tmp_path):
    marker = a_marker()
    result = egress_run(subject, tmp_path, "sh", "-c", f"sleep {marker} & sleep {marker}", extra=["--timeout", "2"])
    assert result.returncode == EXIT_TIMEOUT and "timed out after 2 s" in result.stderr, result.stderr
    assert gone(marker)
    if subject.engine is not None:
        assert subject.engine.containers() == []
