"""The Linux sandbox, tested for real: namespaces, Landlock and supervision, no mocks.

Traffic goes only to loopback (the host's or the sandbox's own). Programs run inside are
/bin/sh, coreutils and this interpreter's Python (readable inside: the sandbox keeps our uid).
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("Linux sandbox tests need Linux", allow_module_level=True)

from conftest import make_host_dir  # noqa: E402

from sandbox import landlock  # noqa: E402
from sandbox.linux import (  # noqa: E402
    EXIT_CANNOT_EXECUTE,
    EXIT_NOT_FOUND,
    EXIT_SANDBOX,
    EXIT_TIMEOUT,
    SandboxError,
    SandboxSpec,
    begin,
    start,
)

REPO = Path(__file__).resolve().parents[2]
PY = [sys.executable, "-I", "-S", "-c"]
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C"}
WAIT = 30  # seconds; a safety net against hanging the suite, never an assertion about speed


def _missing() -> str | None:
    """What this machine lacks for the sandbox, or None."""
    if landlock.abi_version() == 0:
        return f"Landlock is unavailable: {landlock.unavailable_reason()}"
    try:
        start(SandboxSpec(["true"], ENV, "/")).close()
    except SandboxError as e:
        if e.kind != "namespaces":
            raise
        return str(e)
    return None


if _lacking := _missing():
    pytest.skip(_lacking, allow_module_level=True)


def run(argv, cwd, writable=(), **kw) -> tuple[int, str]:
    """Run argv in a sandbox; return (status, stdout)."""
    r, w = os.pipe()
    try:
        box = start(SandboxSpec(argv, ENV, str(cwd), writable=[str(p) for p in writable], stdout=w, **kw))
    finally:
        os.close(w)
    with box, os.fdopen(r) as out:
        status = box.wait(timeout=WAIT)
        return status, out.read()


def py(code: str) -> list[str]:
    return [*PY, textwrap.dedent(code)]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def processes_with(marker: str, program: str | None = None) -> list[int]:
    """Pids (host view) whose command line holds `marker`, optionally only those running `program`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and (program is None or cmdline.startswith(program.encode() + b"\0")):
                found.append(int(entry))
    return found


# --- network ---------------------------------------------------------------------------------


def test_only_loopback_exists_inside_and_it_is_up(tmp_path):
    status, out = run(py("""
        import fcntl, json, socket, struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
        print(json.dumps({"names": [n for _, n in socket.if_nameindex()], "lo_up": bool(flags & 1)}))
    """), tmp_path)
    assert status == 0
    assert json.loads(out) == {"names": ["lo"], "lo_up": True}


@pytest.mark.skipif(not shutil.which("ip"), reason="iproute2's `ip` is not installed")
def test_ip_link_lists_only_lo(tmp_path):
    status, out = run(["ip", "-o", "link"], tmp_path)
    assert status == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].split(":")[1].strip() == "lo" and "UP" in lines[0]


def test_no_route_leaves_the_namespace(tmp_path):
    # 192.0.2.1 is TEST-NET-1; with no interface but lo the kernel refuses before sending anything.
    status, out = run(py("""
        import socket
        try:
            socket.create_connection(("192.0.2.1", 80), timeout=5)
            print("connected")
        except OSError as e:
            print(e.errno)
    """), tmp_path)
    assert status == 0
    assert int(out) == errno.ENETUNREACH


def test_attempts_to_go_around_the_handed_over_socket_are_counted(tmp_path):
    # What egress run's hint rests on (sandbox/netcount.py): each send with no route out (IPv4,
    # IPv6) and each datagram to a loopback port where nothing listens (a stub resolver's
    # 127.0.0.53); a connection to the handed-over socket is not one. Nothing leaves either way.
    code = py("""
        import socket
        for family, address in ((socket.AF_INET, ("192.0.2.1", 80)), (socket.AF_INET6, ("2001:db8::1", 80))):
            try:
                socket.socket(family).connect(address)
            except OSError:
                pass
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"?", ("127.0.0.53", 53))
        socket.create_connection(("127.0.0.1", 3128)).close()
    """)
    with start(SandboxSpec(code, ENV, str(tmp_path), network=True)) as box:
        assert box.wait(timeout=WAIT) == 0
        assert box.direct_attempts() == (3 if os.path.exists("/proc/net/snmp6") else 2)
    with start(SandboxSpec(py("import socket; socket.create_connection(('127.0.0.1', 3128)).close()"), ENV,
                           str(tmp_path), network=True)) as box:
        assert box.wait(timeout=WAIT) == 0
        assert box.direct_attempts() == 0
    with start(SandboxSpec(["true"], ENV, str(tmp_path), network=False)) as box:
        box.wait(timeout=WAIT)
        assert box.direct_attempts() is None  # no handed-over socket: nothing to go around


def test_host_loopback_server_is_not_reachable_from_inside(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        status, out = run(py(f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=5)
                print("connected")
            except ConnectionRefusedError:
                print("refused")
        """), tmp_path)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing arrived at the host's loopback either
    assert (status, out.strip()) == (0, "refused")


def test_handed_over_socket_carries_bytes_both_ways(tmp_path):
    code = py("""
        import socket, sys
        c = socket.create_connection(("127.0.0.1", 3128), timeout=20)
        c.sendall(b"ping from inside")
        sys.exit(0 if c.recv(100) == b"pong from outside" else 1)
    """)
    with start(SandboxSpec(code, ENV, str(tmp_path), network=True, proxy_port=3128)) as box:
        lsock = box.listen_socket
        assert lsock.getsockname() == ("127.0.0.1", 3128)
        assert lsock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        lsock.settimeout(WAIT)
        conn, peer = lsock.accept()
        with conn:
            assert peer[0] == "127.0.0.1"
            assert conn.recv(100) == b"ping from inside"
            conn.sendall(b"pong from outside")
        assert box.wait(timeout=WAIT) == 0


def test_connection_waits_in_backlog_until_the_parent_accepts(tmp_path):
    code = py("""
        import socket
        with socket.create_connection(("127.0.0.1", 3128), timeout=20) as c:
            c.sendall(b"early")
    """)
    with start(SandboxSpec(code, ENV, str(tmp_path), network=True)) as box:
        assert box.wait(timeout=WAIT) == 0  # the command is gone; its connection is not
        box.listen_socket.settimeout(WAIT)
        conn, _ = box.listen_socket.accept()
        with conn:
            assert conn.recv(100) == b"early"


def test_server_started_inside_is_reachable_from_inside(tmp_path):
    status, out = run(py("""
        import socket
        srv = socket.create_server(("127.0.0.1", 8080))
        cli = socket.create_connection(("127.0.0.1", 8080), timeout=5)
        conn, _ = srv.accept()
        cli.sendall(b"hello")
        print(conn.recv(5).decode())
    """), tmp_path)
    assert (status, out.strip()) == (0, "hello")


KEYRING_INSIDE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
keyctl, add_key, mine = map(int, sys.argv[1:4])
def call(nr, *args):
    return libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
buf = ctypes.create_string_buffer(256)
print(call(keyctl, 6, -3, buf, 256), ctypes.get_errno())  # KEYCTL_DESCRIBE the session keyring
print(call(keyctl, 3, mine), ctypes.get_errno())  # KEYCTL_REVOKE the caller's key
print(call(add_key, b"user", b"planted", b"x", 1, -3), ctypes.get_errno())  # into the session keyring
print(call(add_key, b"user", b"planted", b"x", 1, -4), ctypes.get_errno())  # into the user keyring
"""

KEYRING = """
    # The caller has a session keyring holding a key (pam_keyinit and `keyctl session` make one).
    import ctypes, json, os, platform, struct, sys
    sys.path.insert(0, sys.argv[1])
    from sandbox.linux import SandboxSpec, start
    libc = ctypes.CDLL(None, use_errno=True)
    KEYCTL, ADD_KEY = {"x86_64": (250, 248), "aarch64": (219, 217), "riscv64": (219, 217)}[platform.machine()]
    def call(nr, *args):
        return libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    call(KEYCTL, 1, b"egress-test-session")  # KEYCTL_JOIN_SESSION_KEYRING
    mine = call(ADD_KEY, b"user", b"caller-secret", b"s3cret", 6, -3)  # into @s
    r, w = os.pipe()
    box = start(SandboxSpec([sys.executable, "-I", "-S", "-c", sys.argv[2], str(KEYCTL), str(ADD_KEY), str(mine)],
                            {"PATH": "/usr/bin:/bin"}, "/", stdout=w))
    os.close(w)
    status = box.wait(30)
    box.close()
    buf = ctypes.create_string_buffer(4096)
    n = call(KEYCTL, 11, -3, buf, 4096)  # KEYCTL_READ: the keys in our session keyring now
    print(json.dumps({"status": status, "inside": os.fdopen(r).read().split(),
                      "keys_after": list(struct.unpack(f"{n // 4}i", buf.raw[:n])), "mine": mine}))
"""


def test_the_callers_session_keyring_is_out_of_reach():
    # Keyrings are in no namespace: an inherited session keyring would let the command read,
    # plant or revoke the caller's keys (Kerberos caches, cached passwords), for after the run.
    done = subprocess.run([*PY, textwrap.dedent(KEYRING), str(REPO), KEYRING_INSIDE],
                          capture_output=True, text=True, timeout=WAIT)
    if done.returncode != 0 and "KeyError" in done.stderr:
        pytest.skip(f"no keyctl numbers for this architecture: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == 0
    # Every keyring call is refused to the command (seccomp, EPERM): no keyring is read, planted
    # into or revoked, the caller's session and user keyrings included (red team N2).
    calls = [tuple(map(int, result["inside"][i:i + 2])) for i in range(0, 8, 2)]
    assert calls == [(-1, errno.EPERM)] * 4, calls
    assert result["keys_after"] == [result["mine"]]  # nothing planted, nothing revoked


def test_low_ports_of_its_own_loopback_need_no_capability(tmp_path):
    # The command holds no capability (even a root caller's): port 80 of its private loopback
    # is still its own to use, while the machine's setting stays as it was.
    host_setting = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text()
    status, out = run(py("""
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 80))
        print(s.getsockname()[1])
    """), tmp_path)
    assert (status, out.strip()) == (0, "80")
    assert Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text() == host_setting


def test_without_network_there_is_no_socket_and_the_proxy_port_refuses(tmp_path):
    code = py("""
        import socket
        try:
            socket.create_connection(("127.0.0.1", 3128), timeout=5)
            print("connected")
        except ConnectionRefusedError:
            print("refused")
    """)
    r, w = os.pipe()
    with start(SandboxSpec(code, ENV, str(tmp_path), network=False, stdout=w)) as box:
        os.close(w)
        assert box.listen_socket is None
        assert box.wait(timeout=WAIT) == 0
        with os.fdopen(r) as out:
            assert out.read().strip() == "refused"


# --- namespaces ------------------------------------------------------------------------------


def test_command_runs_in_its_own_user_net_and_pid_namespaces(tmp_path):
    status, out = run(py("""
        import json, os
        print(json.dumps({
            "ns": {n: os.readlink(f"/proc/self/ns/{n}") for n in ("user", "net", "pid", "mnt")},
            "pid": os.getpid(),
            "visible": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
            "uid": os.getuid(),
        }))
    """), tmp_path)
    assert status == 0
    inside = json.loads(out)
    for name, link in inside["ns"].items():
        assert link != os.readlink(f"/proc/self/ns/{name}"), name
    assert inside["pid"] == 2  # PID 1 is the sandbox's init
    assert inside["visible"] == [1, 2]  # a private /proc: no host process is visible
    assert inside["uid"] == os.getuid()  # the caller's own id, mapped


# --- filesystem ------------------------------------------------------------------------------

WRITE_PROBE = """
    import json, os, sys
    def attempt(fn):
        try:
            fn()
            return "ok"
        except OSError as e:
            return e.errno
    w, other, etc_name = sys.argv[1:4]
    results = {
        "create in writable": attempt(lambda: open(os.path.join(w, "f"), "w").write("x")),
        "mkdir in writable": attempt(lambda: os.mkdir(os.path.join(w, "d"))),
        "rename in writable": attempt(lambda: os.rename(os.path.join(w, "f"), os.path.join(w, "d", "g"))),
        "create elsewhere": attempt(lambda: open(os.path.join(other, "f"), "w")),
        "overwrite elsewhere": attempt(lambda: open(os.path.join(other, "existing"), "w")),
        "append elsewhere": attempt(lambda: open(os.path.join(other, "existing"), "a")),
        "mkdir elsewhere": attempt(lambda: os.mkdir(os.path.join(other, "d"))),
        "unlink elsewhere": attempt(lambda: os.unlink(os.path.join(other, "existing"))),
        "move out of writable": attempt(lambda: os.rename(os.path.join(w, "d", "g"), os.path.join(other, "g"))),
        "symlink elsewhere": attempt(lambda: os.symlink("/etc/passwd", os.path.join(other, "l"))),
        "create in /etc": attempt(lambda: open(os.path.join("/etc", etc_name), "x")),
        "truncate /dev/null": attempt(lambda: open("/dev/null", "w").write("x")),
        "read /etc/passwd": attempt(lambda: open("/etc/passwd").read()),
    }
    print(json.dumps(results))
"""


@pytest.fixture
def areas(tmp_path, host_dir):
    w, other = tmp_path / "project", host_dir / "elsewhere"
    w.mkdir()
    other.mkdir()
    (other / "existing").write_text("keep")
    etc_name = f"egress-sandbox-test-{uuid.uuid4().hex}"
    yield w, other, etc_name
    Path("/etc", etc_name).unlink(missing_ok=True)  # only there if confinement failed


@pytest.mark.parametrize("shown", [True, False], ids=["granted read-only", "not granted"])
def test_writes_succeed_only_beneath_writable_paths(areas, shown):
    # A host folder the command was granted (--read) is read-only; one it was not is not there at all.
    w, other, etc_name = areas
    status, out = run([*py(WRITE_PROBE), str(w), str(other), etc_name], w, writable=[w],
                      readable=[str(other)] if shown else [])
    assert status == 0
    results = json.loads(out)
    allowed = {"create in writable", "mkdir in writable", "rename in writable", "truncate /dev/null", "read /etc/passwd"}
    assert {k: v for k, v in results.items() if k in allowed} == dict.fromkeys(allowed, "ok")
    for name, outcome in results.items():
        if name not in allowed:
            refusals = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EXDEV) if shown or "/etc" in name else (
                errno.ENOENT,)
            assert outcome in refusals, (name, outcome)
    assert (other / "existing").read_text() == "keep"
    assert sorted(p.name for p in other.iterdir()) == ["existing"]
    assert not Path("/etc", etc_name).exists()


def test_read_only_folders_inside_the_project_can_be_neither_changed_nor_moved_away(tmp_path):
    # egress's own code in a venv inside the project: moving an ancestor away and putting a
    # folder of the command's at the same path would be as good as writing the code.
    site = tmp_path / ".venv" / "lib" / "site-packages"
    (site / "egress").mkdir(parents=True)
    script = ("mv .venv elsewhere || echo pinned; mv .venv/lib .venv/lib2 || echo pinned; "
              "touch .venv/lib/site-packages/egress/x || echo read-only; touch .venv/other && echo writable")
    status, out = run(["sh", "-c", script + " 2>/dev/null"], tmp_path, writable=[tmp_path], read_only=[str(site)])
    assert (status, out.split()) == (0, ["pinned", "pinned", "read-only", "writable"])
    assert sorted(os.listdir(tmp_path / ".venv")) == ["lib", "other"] and os.listdir(site) == ["egress"]


# What lies inside the project and is covered by a mount (hidden: egress's state; a host
# socket: an empty file over it). Moving a folder on the way took the cover along, and the
# command could then put its own folder or socket at the path (red team, state in $HOME).
COVERED_IN_PROJECT = [
    # (case, path inside the project, a socket (else a hidden folder))
    ("hidden folder two deep", ".local/state/egress", False),
    ("hidden folder at the top", "state", False),
    ("host socket", "run/agent/agent.sock", True),
]


@pytest.mark.parametrize("case,inside,is_socket", COVERED_IN_PROJECT, ids=[c[0] for c in COVERED_IN_PROJECT])
@pytest.mark.parametrize("fs_confinement", [True, False], ids=["confined", "no-fs-confinement"])
def test_covered_paths_inside_the_project_cannot_be_moved_away(tmp_path, case, inside, is_socket, fs_confinement):
    project = tmp_path / "project"
    target = project / inside
    target.parent.mkdir(parents=True)
    listener = None
    if is_socket:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(target))  # listed in /proc/net/unix: covered
    else:
        target.mkdir()
        (target / "key").write_text("secret")
    chain = [target, *[p for p in target.parents if project in p.parents]]  # the path and each folder up to the project
    before = {p: os.lstat(p).st_ino for p in chain}
    script = """
        import json, os, sys
        seen = {}
        for path in sys.argv[1:]:
            for name, call in (("mv", lambda: os.rename(path, path + "2")), ("rm", lambda: (os.rmdir if os.path.isdir(path) else os.unlink)(path))):
                try:
                    call()
                    seen[name + " " + path] = 0
                except OSError as e:
                    seen[name + " " + path] = e.errno
        print(json.dumps(seen))
    """
    try:
        status, out = run([*py(script), *map(str, chain)], project, writable=[project], fs_confinement=fs_confinement,
                          hidden=[] if is_socket else [str(target)])
    finally:
        if listener is not None:
            listener.close()
    assert status == 0
    assert json.loads(out) == {f"{verb} {p}": errno.EBUSY for p in chain for verb in ("mv", "rm")}
    assert {p: os.lstat(p).st_ino for p in chain} == before
    assert sorted(os.listdir(project)) == [inside.split("/")[0]]


def test_without_fs_confinement_writes_go_wherever_the_uid_may(areas):
    w, other, etc_name = areas
    status, _ = run(["sh", "-c", f"echo x > {other}/free"], w, writable=[w], fs_confinement=False)
    assert status == 0 and (other / "free").read_text() == "x\n"


def test_an_ordinary_shell_pipeline_works_confined(tmp_path):
    script = "echo hi > out.txt && cat out.txt | tr a-z A-Z > /dev/null && ls > /dev/null 2>&1 && echo done"
    status, out = run(["sh", "-c", script], tmp_path, writable=[tmp_path])
    assert (status, out.strip()) == (0, "done")


def test_landlock_abi_is_reported_and_rights_are_masked_by_version():
    assert landlock.abi_version() >= 1, "this kernel has Landlock (the suite would skip otherwise)"
    assert landlock.unavailable_reason() is None
    assert not landlock.handled_rights(1) & (landlock.REFER | landlock.TRUNCATE | landlock.IOCTL_DEV)
    assert landlock.handled_rights(2) & landlock.REFER and not landlock.handled_rights(2) & landlock.TRUNCATE
    assert landlock.handled_rights(3) & landlock.TRUNCATE and not landlock.handled_rights(4) & landlock.IOCTL_DEV
    assert landlock.handled_rights(5) & landlock.IOCTL_DEV


NO_LANDLOCK = """
    # Make landlock_create_ruleset fail with ENOSYS, as on a kernel without Landlock.
    import ctypes, struct, sys
    sys.path.insert(0, sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    prog = b"".join(struct.pack("HBBI", *ins) for ins in [
        (0x20, 0, 0, 0),                 # A = seccomp_data.nr
        (0x15, 0, 1, 444),               # if A == landlock_create_ruleset
        (0x06, 0, 0, 0x00050000 | 38),   #   return ERRNO(ENOSYS)
        (0x06, 0, 0, 0x7FFF0000),        # return ALLOW
    ])
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HxxxxxxQ", 4, ctypes.addressof(buf))
    assert libc.prctl(38, 1, 0, 0, 0) == 0                      # no_new_privs
    assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # seccomp filter
    from sandbox import landlock
    from sandbox.linux import SandboxError, SandboxSpec, start
    print(landlock.abi_version())
    try:
        start(SandboxSpec(["true"], {"PATH": "/usr/bin:/bin"}, "/"))
    except SandboxError as e:
        print(e.code, e.kind, e, sep="|")
    print(start(SandboxSpec(["true"], {"PATH": "/usr/bin:/bin"}, "/", fs_confinement=False)).wait())
"""


def test_missing_landlock_fails_closed_and_names_the_flag():
    done = subprocess.run([*PY, textwrap.dedent(NO_LANDLOCK), str(REPO)], capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    abi, error, unconfined = done.stdout.strip().splitlines()
    assert abi == "0"
    code, kind, message = error.split("|")
    assert (int(code), kind) == (EXIT_SANDBOX, "landlock")
    assert "Landlock" in message and "--no-fs-confinement" in message
    assert unconfined == "0"  # and with the flag, the command runs


# --- supervision -----------------------------------------------------------------------------


@pytest.mark.parametrize(("script", "expected"), [
    ("exit 0", 0),
    ("exit 3", 3),
    ("kill -TERM $$", 128 + signal.SIGTERM),
    ("kill -KILL $$", 128 + signal.SIGKILL),
])
def test_exit_status_follows_shell_convention(tmp_path, script, expected):
    assert run(["sh", "-c", script], tmp_path)[0] == expected


def test_signal_is_forwarded_to_the_command(tmp_path):
    with start(SandboxSpec(["sleep", "1000"], ENV, str(tmp_path))) as box:
        # start() returns once exec is past its point of no return: posix_spawn's vfork parent
        # wakes when the old memory is dropped, before the kernel lays out the new argv, so for
        # a moment /proc/PID/cmdline reads empty (seen once in CI). Wait for sleep's own.
        cmdline = Path(f"/proc/{box.pid}/cmdline")
        deadline = time.monotonic() + WAIT
        while not cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert cmdline.read_bytes().startswith(b"sleep\0")
        box.signal(signal.SIGTERM)
        assert box.wait(timeout=WAIT) == 128 + signal.SIGTERM


def test_timeout_kills_the_whole_tree(tmp_path):
    marker = f"1000.{uuid.uuid4().int % 10**9}"  # a sleep argument no other process has
    fds_before = open_fds()
    box = start(SandboxSpec(["sh", "-c", f"sleep {marker} & sleep {marker}"], ENV, str(tmp_path)))
    deadline = time.monotonic() + WAIT
    while len(processes_with(marker, "sleep")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(processes_with(marker, "sleep")) == 2  # both sleeps run, seen from the host
    # Waited for in a thread, so that a wait() that fails to kill fails this test instead of hanging it.
    statuses = []
    waiter = threading.Thread(target=lambda: statuses.append(box.wait(timeout=0.2)), daemon=True)
    waiter.start()
    waiter.join(WAIT)
    if waiter.is_alive():
        for pid in processes_with(marker, "sleep"):
            os.kill(pid, signal.SIGKILL)
        waiter.join(WAIT)
        pytest.fail("wait(timeout) did not end the command")
    assert statuses == [EXIT_TIMEOUT]
    assert processes_with(marker) == []  # the background one is gone too
    box.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # no child of ours is left, not even a zombie
    assert open_fds() == fds_before


def test_everything_the_command_started_ends_with_it(tmp_path):
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    assert run(["sh", "-c", f"sleep {marker} & exit 0"], tmp_path)[0] == 0
    assert processes_with(marker) == []


def test_close_is_idempotent_and_releases_every_descriptor(tmp_path):
    fds_before = open_fds()
    box = start(SandboxSpec(["sleep", "1000"], ENV, str(tmp_path), network=True))
    box.close()
    box.close()
    assert box.returncode == 128 + signal.SIGKILL
    assert box.listen_socket.fileno() == -1
    assert open_fds() == fds_before
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_begin_holds_the_command_until_ready_and_what_is_written_meanwhile_is_there(tmp_path):
    # The launcher writes the files the command's environment names (its CA bundle, wgetrc)
    # between begin() and ready(): the command must find them, whenever init got to its go.
    r, w = os.pipe()
    try:
        box = begin(SandboxSpec(["cat", "written-meanwhile"], ENV, str(tmp_path), writable=[str(tmp_path)],
                                stdout=w))
    finally:
        os.close(w)
    with box, os.fdopen(r) as out:
        time.sleep(0.2)  # init confined and waiting, most likely; the order must not matter
        (tmp_path / "written-meanwhile").write_text("there\n")
        box.ready()
        assert box.wait(timeout=WAIT) == 0
        assert out.read() == "there\n"


@pytest.mark.parametrize("pause", [0.0, 0.2])  # closed while the sandbox is made, or once init waits
def test_a_box_closed_before_ready_never_runs_its_command(tmp_path, pause):
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    fds_before = open_fds()
    box = begin(SandboxSpec(["sh", "-c", f"touch ran; sleep {marker}"], ENV, str(tmp_path),
                            writable=[str(tmp_path)], network=True))
    time.sleep(pause)
    box.close()
    box.close()
    assert not (tmp_path / "ran").exists()
    assert processes_with(marker) == []
    assert open_fds() == fds_before
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_stdio_can_be_given_and_nothing_else_leaks_in(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as unrelated:  # an fd the command must not get
        status, out = run(["sh", "-c", "ls /proc/self/fd"], tmp_path, network=True)
        assert unrelated.fileno() > 2
    assert status == 0
    assert sorted(int(fd) for fd in out.split()) == [0, 1, 2, 3]  # 3: the directory ls reads


# --- failures before exec --------------------------------------------------------------------


def test_command_not_found(tmp_path):
    fds_before = open_fds()
    with pytest.raises(SandboxError) as caught:
        start(SandboxSpec(["no-such-command-egress"], ENV, str(tmp_path)))
    assert (caught.value.code, caught.value.kind) == (EXIT_NOT_FOUND, "exec")
    assert "no-such-command-egress" in str(caught.value) and "\n" not in str(caught.value)
    assert open_fds() == fds_before
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_not_executable(tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    with pytest.raises(SandboxError) as caught:
        start(SandboxSpec([str(script)], ENV, str(tmp_path)))
    assert caught.value.code == EXIT_CANNOT_EXECUTE


def test_missing_cwd_runs_nothing(tmp_path):
    witness = tmp_path / "ran"
    with pytest.raises(SandboxError) as caught:
        start(SandboxSpec(["sh", "-c", f"touch {witness}"], ENV, str(tmp_path / "missing")))
    assert (caught.value.code, caught.value.kind) == (EXIT_SANDBOX, "cwd")
    assert "missing" in str(caught.value)
    assert not witness.exists()


def test_missing_writable_path_fails_closed(tmp_path):
    with pytest.raises(SandboxError) as caught:
        start(SandboxSpec(["true"], ENV, str(tmp_path), writable=[str(tmp_path / "nope")]))
    assert (caught.value.code, caught.value.kind) == (EXIT_SANDBOX, "mounts")
    assert "writable path" in str(caught.value) and "nope" in str(caught.value)


FORBIDDEN_USERNS = """
    # In a user namespace of our own, forbid further user namespaces, then ask for a sandbox.
    import sys
    sys.path.insert(0, sys.argv[1])
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    from sandbox.linux import SandboxError, SandboxSpec, start
    try:
        start(SandboxSpec(["true"], {"PATH": "/usr/bin:/bin"}, "/"))
        print("ran")
    except SandboxError as e:
        print(e.code, e.kind, e, sep="|")
"""


@pytest.mark.skipif(not shutil.which("unshare"), reason="util-linux `unshare` is not installed")
def test_refused_user_namespaces_fail_closed_with_the_fix(tmp_path):
    done = subprocess.run(["unshare", "--user", "--map-root-user", *PY, textwrap.dedent(FORBIDDEN_USERNS), str(REPO)],
                          capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    code, kind, message = done.stdout.strip().split("|")
    assert (int(code), kind) == (EXIT_SANDBOX, "namespaces")
    assert "sysctl -w user.max_user_namespaces=" in message


# --- as an unprivileged user -----------------------------------------------------------------

AS_NOBODY = """
    # Runs as nobody: start a sandbox, accept its connection, report what the inside saw.
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from sandbox.linux import SandboxSpec, start
    w, other, inside = sys.argv[2:5]
    r, wfd = os.pipe()
    box = start(SandboxSpec([sys.executable, "-I", "-S", "-c", inside, w, other], {"PATH": "/usr/bin:/bin"},
                            w, writable=[w], network=True, stdout=wfd))
    os.close(wfd)
    box.listen_socket.settimeout(20)
    conn, _ = box.listen_socket.accept()
    assert conn.recv(2) == b"hi"
    conn.sendall(b"welcome")
    status = box.wait(timeout=30)
    box.close()
    result = json.loads(os.fdopen(r).read())
    result.update(status=status, outer_uid=os.getuid())
    print(json.dumps(result))
"""

INSIDE_AS_NOBODY = """
    import json, os, socket, sys
    c = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    c.sendall(b"hi")
    got = c.recv(10).decode()
    def attempt(fn, *args):
        try:
            fn(*args)
            return "ok"
        except OSError as e:
            return e.errno
    write = lambda path: open(path, "w").write("x")
    print(json.dumps({"uid": os.getuid(), "links": [n for _, n in socket.if_nameindex()], "got": got,
                      "write_w": attempt(write, sys.argv[1] + "/f"), "write_other": attempt(write, sys.argv[2] + "/f"),
                      "init_fds": attempt(os.listdir, "/proc/1/fd")}))
"""


def test_works_for_an_unprivileged_user(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the suite already runs unprivileged: every other test covers this")
    system_python = "/usr/bin/python3.11"
    if not os.access(system_python, os.X_OK):
        pytest.skip(f"no interpreter other users can run: {system_python} is missing")
    nobody = pwd.getpwnam("nobody")
    # A world-readable copy of the package (the checkout may sit under /root) and areas nobody owns.
    base = Path(tempfile.mkdtemp(prefix="egress-sandbox-", dir="/tmp"))
    try:
        base.chmod(0o755)
        for package in ("sandbox", "egress"):  # sandbox reads egress.core.contract
            shutil.copytree(REPO / package, base / "lib" / package, ignore=shutil.ignore_patterns("__pycache__"))
        for d in (base / "lib", *[p for p in (base / "lib").rglob("*") if p.is_dir()]):
            d.chmod(0o755)
        w, other = base / "w", make_host_dir(for_everyone=True) / "other"
        for d in (w, other):
            d.mkdir()
            os.chown(d, nobody.pw_uid, nobody.pw_gid)
        done = subprocess.run(
            [system_python, "-I", "-S", "-B", "-c", textwrap.dedent(AS_NOBODY), str(base / "lib"), str(w), str(other),
             textwrap.dedent(INSIDE_AS_NOBODY)],
            user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], env={"PATH": "/usr/bin:/bin"},
            cwd="/", capture_output=True, text=True, timeout=WAIT,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["outer_uid"] == nobody.pw_uid
        assert result["uid"] == nobody.pw_uid
        assert result["links"] == ["lo"]
        assert result["got"] == "welcome"
        assert result["write_w"] == "ok"
        assert result["write_other"] == errno.ENOENT  # nobody owns it, and it was not granted: not there
        assert result["init_fds"] == errno.EACCES  # init keeps capabilities; the command cannot reach into it
        assert result["status"] == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(other.parent, ignore_errors=True)
