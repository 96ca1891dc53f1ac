"""Escapes a hostile command tried from inside the sandbox, each one closed, as root and as nobody.

Every attempt below succeeded before the sandbox gained its mount view, seccomp filter and
dropped capabilities (issue 8): typing into the caller's terminal with TIOCSTI, chmod/chown/
utime/xattr on host files, connecting to a host Unix socket (a relay to TCP, docker's socket,
an ssh-agent), reading egress's hidden state or a secret file bound to hosts, and leaving
files in a shared /dev/shm. The command here is a probe that tries them all and reports
errno values; the test checks both what the probe saw and what the host kept.

The same probe runs as the caller (root in CI) and as `nobody` (Debian's python3.11, which
every user can run), with host files owned by the runner so that ordinary permissions would
allow each change: only the sandbox says no.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import make_host_dir

if not sys.platform.startswith("linux"):
    pytest.skip("Linux sandbox tests need Linux", allow_module_level=True)

from sandbox import landlock  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WAIT = 30
SYSTEM_PYTHON = "/usr/bin/python3.11"

if landlock.abi_version() == 0:
    pytest.skip(f"Landlock is unavailable: {landlock.unavailable_reason()}", allow_module_level=True)

PROBE = r"""
import errno, fcntl, json, os, pty, socket, sys, termios
args = json.loads(sys.argv[1])

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return e.errno

def inject(request):
    # A terminal that is our controlling one, as the caller's terminal is the command's.
    master, slave = pty.openpty()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        code = attempt(lambda: fcntl.ioctl(slave, request, b"x"))
        os._exit(0 if code == "ok" else code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) or "ok"

def connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    return attempt(lambda: s.connect(path))

def own_server():
    path = os.path.join(args["project"], "own.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    server.accept()[0].close()

victim = args["victim"]
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
results = {
    "tiocsti": inject(termios.TIOCSTI),
    "tiocsti with high bits": inject(termios.TIOCSTI | (1 << 32)),
    "tioclinux": inject(0x541C),
    "chmod": attempt(lambda: os.chmod(victim, 0o777)),
    "chown": attempt(lambda: os.chown(victim, os.getuid(), os.getgid())),
    "utime": attempt(lambda: os.utime(victim, (0, 0))),
    "setxattr": attempt(lambda: os.setxattr(victim, "user.egress", b"1")),
    "write": attempt(lambda: open(victim, "a").write("x")),
    "host socket": connect(args["host_socket"]),
    "renamed socket": connect(args["renamed_socket"]),
    "relative socket": connect(args["relative_socket"]),
    "socket in /tmp": connect(args["tmp_socket"]),
    "hidden listing": sorted(os.listdir(args["hidden"])),
    "replaced reads": open(args["replaced"]).read(),
    "host shm visible": os.path.exists("/dev/shm/" + args["shm_marker"]),
    "shm write": attempt(lambda: open("/dev/shm/" + args["shm_marker"] + "-inside", "w").write("x")),
    "own unix server": attempt(own_server),
    "setuid by chmod": attempt(lambda: (open(os.path.join(args["project"], "su"), "w").close(),
                                        os.chmod(os.path.join(args["project"], "su"), 0o4755))),
    "setuid by open": attempt(lambda: os.close(os.open(os.path.join(args["project"], "su2"),
                                                       os.O_CREAT | os.O_WRONLY, 0o4755))),
    "pty": attempt(lambda: pty.openpty()),
    "capabilities": {k: status[k].strip() for k in ("CapPrm", "CapEff", "CapBnd", "CapAmb")},
}
print(json.dumps(results))
"""

DRIVER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from sandbox.linux import SandboxSpec, start
cfg = json.loads(sys.argv[2])
r, w = os.pipe()
box = start(SandboxSpec([sys.executable, "-I", "-S", "-c", cfg["probe"], json.dumps(cfg["args"])],
                        {"PATH": "/usr/bin:/bin"}, cfg["args"]["project"], writable=[cfg["args"]["project"]],
                        hidden=[cfg["args"]["hidden"]], replaced={cfg["args"]["replaced"]: b"placeholder\n"},
                        # granted read-only (as --read does): what lies there is seen, and must stay unchanged
                        readable=[os.path.dirname(cfg["args"]["victim"])], stdout=w))
os.close(w)
status = box.wait(30)
box.close()
print(json.dumps({"status": status, "inside": json.loads(os.fdopen(r).read() or "null")}))
"""


def _sandbox_works() -> str | None:
    from sandbox.linux import SandboxError, SandboxSpec, start

    try:
        start(SandboxSpec(["true"], {"PATH": "/usr/bin:/bin"}, "/")).close()
    except SandboxError as e:
        return str(e)
    return None


if _lacking := _sandbox_works():
    pytest.skip(_lacking, allow_module_level=True)


@pytest.fixture(params=["caller", "nobody"])
def runner(request):
    """(python, package dir, uid, gid) to run the driver with: this user, or nobody."""
    if request.param == "caller":
        yield sys.executable, REPO, os.getuid(), os.getgid()
        return
    if os.geteuid() != 0:
        pytest.skip("switching to the 'nobody' user needs root (the suite runs unprivileged: 'caller' covers it)")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"no interpreter other users can run: {SYSTEM_PYTHON} is missing")
    nobody = pwd.getpwnam("nobody")
    lib = Path(tempfile.mkdtemp(prefix="egress-escapes-lib-"))
    try:
        lib.chmod(0o755)
        for package in ("sandbox", "egress"):  # sandbox reads egress.core.contract
            shutil.copytree(REPO / package, lib / package, ignore=shutil.ignore_patterns("__pycache__"))
            for folder in (lib / package, *[p for p in (lib / package).rglob("*") if p.is_dir()]):
                folder.chmod(0o755)
        yield SYSTEM_PYTHON, lib, nobody.pw_uid, nobody.pw_gid
    finally:
        shutil.rmtree(lib, ignore_errors=True)


@pytest.fixture
def scene(runner):
    """Host files, a host socket in a visible folder and one in /tmp, egress-like state, a /dev/shm marker."""
    python, lib, uid, gid = runner
    base = make_host_dir(for_everyone=True)
    tmp_socket = f"/tmp/egress-escapes-{uuid.uuid4().hex[:8]}.sock"
    shm_marker = f"egress-escapes-{uuid.uuid4().hex[:8]}"
    servers = []
    try:
        project, hidden = base / "project", base / "state"
        for folder in (project, hidden, hidden / "ca"):
            folder.mkdir()
        (hidden / "ca" / "key.pem").write_text("PRIVATE KEY")
        victim, replaced = base / "victim.txt", base / "token"
        victim.write_text("keep")
        victim.chmod(0o644)
        replaced.write_text("the real secret\n")
        for path in (base, project, hidden, victim, replaced):
            os.chown(path, uid, gid)  # ordinary permissions allow every change: only the sandbox refuses
        # A socket inside the hidden state folder (the warm proxy's): hidden with it, and the
        # view must still be made (covering it as a host socket failed once it was gone).
        for path in (str(base / "relay.sock"), tmp_socket, str(hidden / "warm.sock")):
            server = socket.socket(socket.AF_UNIX)
            server.bind(path)
            os.chmod(path, 0o777)
            server.listen()
            server.setblocking(False)
            servers.append(server)
        # OpenSSH's ControlMaster: bind a temporary name, link it to the ControlPath, unlink the
        # first. /proc/net/unix keeps the name as bound, which no longer exists.
        (base / "ssh").mkdir()
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(base / "ssh" / "cm.tmp"))
        os.link(base / "ssh" / "cm.tmp", base / "ssh" / "cm")
        os.unlink(base / "ssh" / "cm.tmp")
        os.chmod(base / "ssh" / "cm", 0o777)
        server.listen()
        server.setblocking(False)
        servers.append(server)
        # A name bound relative to the binder's working folder is listed relative.
        (base / "rel").mkdir()
        os.chown(base / "rel", uid, gid)
        # Bound by the runner's own process (an unprivileged caller cannot look into others').
        binder = subprocess.Popen([python, "-I", "-S", "-c", textwrap.dedent("""
            import os, socket, sys, time
            os.chdir(sys.argv[1])
            s = socket.socket(socket.AF_UNIX)
            s.bind("rel.sock")
            os.chmod("rel.sock", 0o777)
            s.listen()
            print("ready", flush=True)
            s.settimeout(60)
            try:
                s.accept()
                print("REACHED", flush=True)
            except OSError:
                pass
        """), str(base / "rel")], stdout=subprocess.PIPE, text=True, user=uid, group=gid,
                                  extra_groups=[] if os.geteuid() == 0 else None)
        assert binder.stdout.readline().strip() == "ready"
        Path("/dev/shm", shm_marker).write_text("host")
        yield {"python": python, "lib": str(lib), "uid": uid, "gid": gid, "servers": servers, "victim": victim,
               "binder": binder,
               "args": {"project": str(project), "victim": str(victim), "host_socket": str(base / "relay.sock"),
                        "renamed_socket": str(base / "ssh" / "cm"), "relative_socket": str(base / "rel" / "rel.sock"),
                        "tmp_socket": tmp_socket, "hidden": str(hidden), "replaced": str(replaced),
                        "shm_marker": shm_marker}}
    finally:
        if "binder" in locals():
            binder.kill()
            binder.wait()
        for server in servers:
            server.close()
        for path in (tmp_socket, f"/dev/shm/{shm_marker}", f"/dev/shm/{shm_marker}-inside"):
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


def test_every_known_escape_is_closed(scene):
    before = os.stat(scene["victim"])
    done = subprocess.run([scene["python"], "-I", "-S", "-B", "-c", textwrap.dedent(DRIVER), scene["lib"],
                           json.dumps({"probe": PROBE, "args": scene["args"]})],
                          user=scene["uid"], group=scene["gid"], extra_groups=[] if os.geteuid() == 0 else None,
                          env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["status"] == 0, outcome
    seen = outcome["inside"]

    # 1. No keystrokes pushed into a terminal, whatever the high bits of the request say.
    for request in ("tiocsti", "tiocsti with high bits", "tioclinux"):
        assert seen[request] == errno.EPERM, (request, seen[request])
    # 5. No metadata change (or write) on a host file the runner owns.
    for change in ("chmod", "chown", "utime", "setxattr", "write"):
        assert seen[change] == errno.EROFS, (change, seen[change])
    after = os.stat(scene["victim"])
    assert (after.st_mode, after.st_uid, after.st_mtime_ns) == (before.st_mode, before.st_uid, before.st_mtime_ns)
    assert stat.S_IMODE(after.st_mode) == 0o644 and scene["victim"].read_text() == "keep"
    # 4. Host sockets: covered where visible, absent under /tmp; nothing reached either listener.
    assert seen["host socket"] == errno.EACCES  # a read-only empty file lies over it
    assert seen["renamed socket"] == errno.EACCES  # found beside the name it was bound with
    assert seen["relative socket"] == errno.EACCES  # found through its owner's working folder
    assert seen["socket in /tmp"] == errno.ENOENT
    for server in scene["servers"]:
        with pytest.raises(BlockingIOError):
            server.accept()
    # ...while the command's own Unix server in its project still works.
    assert seen["own unix server"] == "ok"
    # 6. egress's state shows empty; a bound secret's file shows its placeholder.
    assert seen["hidden listing"] == []
    assert seen["replaced reads"] == "placeholder\n"
    # 7. A private /dev/shm: the host's files are not there, the command's stay inside.
    assert seen["host shm visible"] is False and seen["shm write"] == "ok"
    assert not Path("/dev/shm", scene["args"]["shm_marker"] + "-inside").exists()
    # Root's powers do not follow a root caller in: no capability at all, in any set.
    assert set(seen["capabilities"].values()) == {"0000000000000000"}, seen["capabilities"]
    # A root caller's command cannot leave a setuid-root program in the project for after the
    # run, nor anyone else's: a set-id file of the project's owner gives every local user that uid (N9).
    assert (seen["setuid by chmod"], seen["setuid by open"]) == (errno.EPERM, errno.EPERM)
    for name in ("su", "su2"):
        path = Path(scene["args"]["project"], name)
        assert not (path.exists() and path.stat().st_mode & 0o6000)
    # What a normal program needs still works.
    assert seen["pty"] == "ok"
