"""The sandbox refuses what it does not grant (issue 25): signals, host sockets, terminals, /dev.

Each test is an attack of the second red-team review (N3, N4, N7) that broke the sandbox at
540349a: the command signalled its caller's process group, reached host Unix sockets bound in
another network or mount namespace or renamed after bind (and another run's), and wrote to
another terminal of the user. They run as the caller (root in CI) and as `nobody` (Debian's
python3.11), the pattern of tests/sandbox/test_escapes.py.
"""

from __future__ import annotations

import errno
import json
import os
import pty
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import make_host_dir

if not sys.platform.startswith("linux"):
    pytest.skip("Linux sandbox tests need Linux", allow_module_level=True)

# The escape tests' own users (caller and nobody), and their skips: no Landlock, no working sandbox.
from test_escapes import runner  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]
WAIT = 30

# Runs the probe in a sandbox (as the runner's uid); prints {"status", "inside", "signalled"}.
DRIVER = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
from sandbox.linux import SandboxSpec, start
cfg = json.loads(sys.argv[2])
signalled = []
signal.signal(signal.SIGUSR1, lambda *_: signalled.append("SIGUSR1"))
r, w = os.pipe()
box = start(SandboxSpec([sys.executable, "-I", "-S", "-c", cfg["probe"], json.dumps(cfg["args"])],
                        {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}, cfg["project"],
                        writable=[cfg["project"]], stdout=w, stdin=cfg.get("stdin")))
os.close(w)
status = box.wait(30)
box.close()
print(json.dumps({"status": status, "inside": json.loads(os.fdopen(r).read() or "null"), "signalled": signalled,
                  "pgid": os.getpgrp()}))
"""


@pytest.fixture
def base(runner):
    """A host folder every user can reach, owned by the runner: 'elsewhere on the host'."""
    path = make_host_dir(for_everyone=True)
    os.chown(path, runner[2], runner[3])
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sandboxed(runner, project: Path, probe: str, args: dict, stdin: int | None = None) -> dict:
    python, lib, uid, gid = runner
    os.chown(project, uid, gid)
    cfg = {"probe": textwrap.dedent(probe), "args": args, "project": str(project), "stdin": stdin}
    done = subprocess.run([python, "-I", "-S", "-B", "-c", DRIVER, str(lib), json.dumps(cfg)],
                          user=uid, group=gid, extra_groups=[] if os.geteuid() == 0 else None,
                          env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True, timeout=WAIT,
                          pass_fds=() if stdin is None else (stdin,))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_command_signals_nothing_outside_its_run(runner, base):
    # N3: kill(0, ...) reached the launcher, the harness that started it and its siblings (the
    # command was in their process group); SIGSTOP of the launcher defeated --timeout.
    project = base / "project"
    project.mkdir()
    probe = r"""
        import json, os, signal, sys
        args = json.loads(sys.argv[1])
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # what it sends its own group, it takes itself
        def attempt(fn):
            try:
                fn()
                return "sent"
            except OSError as e:
                return e.errno
        print(json.dumps({
            "group": attempt(lambda: os.kill(0, signal.SIGUSR1)),
            "every process": attempt(lambda: os.kill(-1, signal.SIGUSR1)),
            "caller's group": attempt(lambda: os.killpg(args["pgid"], signal.SIGUSR1)),
            "sid": os.getsid(0), "pgid": os.getpgrp(),
        }))
    """
    outcome = sandboxed(runner, project, probe, {"pgid": os.getpgrp()})
    assert outcome["status"] == 0, outcome
    seen = outcome["inside"]
    assert outcome["signalled"] == [], outcome  # the driver (in the launcher's place) heard nothing
    # A session and process group of its own (init's, PID 1 inside): not the caller's, which
    # would read as 0 here (its leader is outside the PID namespace).
    assert (seen["sid"], seen["pgid"]) == (1, 1), seen
    assert seen["caller's group"] in (errno.ESRCH, errno.EPERM), seen


SOCKET_PROBE = r"""
    import json, os, socket, sys
    args = json.loads(sys.argv[1])
    found = {}
    for name, path in args["sockets"].items():
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        try:
            s.connect(path)
            found[name] = "connected"
        except OSError as e:
            found[name] = e.errno
    print(json.dumps(found))
"""


def _listen(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen()
    server.setblocking(False)
    return server


def _in_namespace(flags: list[str], script: str, *args: str) -> subprocess.Popen:
    """A listener started in namespaces of its own (unshare); it prints 'ready' once bound."""
    process = subprocess.Popen(["unshare", *flags, sys.executable, "-c", textwrap.dedent(script), *args],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


NAMESPACED_LISTENER = """
    import os, socket, subprocess, sys, time
    if len(sys.argv) > 2:  # another mount namespace: the folder is bound at another name first
        subprocess.run(["mount", "--bind", sys.argv[2], sys.argv[3]], check=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(sys.argv[1])
    os.chmod(sys.argv[1], 0o777)
    s.listen()
    print("ready", flush=True)
    time.sleep(60)
"""


def test_no_host_socket_is_reachable_whatever_bound_it(runner, base):
    # N4's four cases: bound in another network namespace, in another mount namespace under
    # another name, renamed into another folder after bind, and another run's own socket.
    if os.geteuid() != 0:
        pytest.skip("binding sockets in namespaces of the test's own needs root")
    for folder in ("netns", "mountns", "named", "renamed/a", "renamed/b", "other-run"):
        (base / folder).mkdir(parents=True)
    for path in base.rglob("*"):
        path.chmod(0o777)
    project = base / "project"
    project.mkdir()
    listeners, processes = [], []
    try:
        processes.append(_in_namespace(["-n"], NAMESPACED_LISTENER, str(base / "netns" / "relay.sock")))
        # bound as <base>/named/app.sock in a mount namespace where that folder is <base>/mountns
        processes.append(_in_namespace(["-m", "--propagation", "private"], NAMESPACED_LISTENER,
                                       str(base / "named" / "app.sock"), str(base / "mountns"), str(base / "named")))
        listeners.append(_listen(str(base / "renamed" / "a" / "x.sock")))
        os.rename(base / "renamed" / "a" / "x.sock", base / "renamed" / "b" / "x.sock")
        sockets = {"other network namespace": str(base / "netns" / "relay.sock"),
                   "other mount namespace": str(base / "mountns" / "app.sock"),
                   "renamed into another folder": str(base / "renamed" / "b" / "x.sock")}
        for path in sockets.values():  # each is there on the host, and reachable from outside the sandbox
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(path)
            probe.close()
        seen = sandboxed(runner, project, SOCKET_PROBE, {"sockets": sockets})
        assert seen["status"] == 0, seen
        # Not there at all: the folder was never granted to the command.
        assert seen["inside"] == dict.fromkeys(sockets, errno.ENOENT), seen
    finally:
        for process in processes:
            process.kill()
            process.wait()
        for server in listeners:
            server.close()


def test_two_runs_cannot_reach_each_other(runner, base):
    # N4, case 4: run A's command listens in its project; run B's command, in another project,
    # connected and read what A sent (a narrow run borrowing a wider one's network).
    first, second = base / "a", base / "b"
    for project in (first, second):
        project.mkdir()
    listener = r"""
        import json, os, socket, sys, time
        args = json.loads(sys.argv[1])
        s = socket.socket(socket.AF_UNIX)
        s.bind(args["path"])
        os.chmod(args["path"], 0o777)
        s.listen()
        open(args["ready"], "w").close()
        s.settimeout(20)
        try:
            s.accept()
            print(json.dumps("reached"))
        except OSError:
            print(json.dumps("alone"))
    """
    path, ready = first / "run-a.sock", first / "ready"
    python, lib, uid, gid = runner
    os.chown(first, uid, gid)
    cfg = {"probe": textwrap.dedent(listener), "args": {"path": str(path), "ready": str(ready)}, "project": str(first)}
    run_a = subprocess.Popen([python, "-I", "-S", "-B", "-c", DRIVER, str(lib), json.dumps(cfg)], user=uid, group=gid,
                             extra_groups=[] if os.geteuid() == 0 else None, env={"PATH": "/usr/bin:/bin"}, cwd="/",
                             stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(300):  # a bound on the wait, not on how fast it is
            if ready.exists() or run_a.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), "run A never listened"
        seen = sandboxed(runner, second, SOCKET_PROBE, {"sockets": {"run A": str(path)}})
        assert seen["inside"] == {"run A": errno.ENOENT}, seen
    finally:
        run_a.kill()
        run_a.wait()


def test_other_terminals_and_devices_are_not_there(runner, base):
    # N7: another terminal of the user (/dev/pts/N, not the run's) was written to (OSC 52
    # clipboard writes) and reconfigured (echo off, Ctrl-C cleared) from the sandbox. N10's
    # /dev/vsock and the rest of the host's /dev are not the command's either.
    master, slave = pty.openpty()  # "another session" of the user
    os.chmod(os.ttyname(slave), 0o666)  # ordinary permissions would let anyone write it
    own_master, own_slave = pty.openpty()  # the run's own terminal, its user's as a login's is
    os.chown(os.ttyname(own_slave), runner[2], runner[3])
    project = base / "project"
    project.mkdir()
    probe = r"""
        import json, os, pty, sys
        args = json.loads(sys.argv[1])
        def attempt(fn):
            try:
                fn()
                return "ok"
            except OSError as e:
                return e.errno
        print(json.dumps({
            "other terminal": attempt(lambda: os.close(os.open(args["other"], os.O_RDWR | os.O_NOCTTY))),
            "own terminal": attempt(lambda: os.write(os.open("/proc/self/fd/0", os.O_WRONLY), b"mine\r\n")),
            "own ptys": attempt(pty.openpty),
            "dev": sorted(os.listdir("/dev")),
            "pts": sorted(os.listdir("/dev/pts")),
        }))
    """
    try:
        outcome = sandboxed(runner, project, probe, {"other": os.ttyname(slave)}, stdin=own_slave)
        seen = outcome["inside"]
        assert seen["other terminal"] == errno.ENOENT, seen
        assert seen["own terminal"] == "ok" and seen["own ptys"] == "ok", seen
        assert b"mine" in os.read(own_master, 100)
        # Only the ordinary devices, the command's own devpts and shm, and its terminal as /dev/console.
        assert set(seen["dev"]) <= {"null", "zero", "full", "random", "urandom", "tty", "console", "fd", "stdin",
                                    "stdout", "stderr", "ptmx", "pts", "shm"}, seen["dev"]
        assert set(seen["pts"]) <= {"ptmx", "0"}, seen["pts"]  # a devpts of its own: the pty it opened
    finally:
        for fd in (master, slave, own_master, own_slave):
            os.close(fd)
