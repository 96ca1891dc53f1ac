"""Kernel interfaces the seccomp filter refuses, tried from inside a real sandbox, as root and as nobody.

Each attempt succeeded in the red-team review of 2026-12-07 (issue 25): reading and planting
into the caller's user keyring (N2), a vsock socket that shares the host's port space (N10),
clone3 whose CLONE_INTO_CGROUP moves a process into any host cgroup (N6), and a setuid file
left in the project by an unprivileged caller (N9). The probe tries each and reports errno
values; the driver, running as the runner outside the sandbox, checks what the host kept (a key
it put in its own user keyring before the run). What programs need keeps working: the granted
socket families, threads and subprocesses (glibc falls back from clone3 to clone).

A small i386 program (built here with gcc -m32, no libc) makes the same calls through the
32-bit table, where socketcall would hide a socket's family.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import make_host_dir

if not sys.platform.startswith("linux"):
    pytest.skip("Linux sandbox tests need Linux", allow_module_level=True)

# The escape tests' own users (caller and nobody), and their skips: no Landlock, no working sandbox.
from test_escapes import WAIT, runner  # noqa: E402,F401

PROBE = r"""
import ctypes, errno, json, os, socket, subprocess, sys, threading
args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
nr = args["numbers"]

def call(number, *a):
    ret = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(x) if isinstance(x, int) else x for x in a])
    return "ok" if ret >= 0 else ctypes.get_errno()

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return e.errno

def family(*a):
    return attempt(lambda: socket.socket(*a).close())

def threads():
    seen = []
    workers = [threading.Thread(target=seen.append, args=(i,)) for i in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sorted(seen)

def posix_spawn():
    pid = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 7"], {})
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(9)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def in_project(name):
    return os.path.join(args["project"], name)

buf = ctypes.create_string_buffer(256)
results = {
    # keyrings (N2): the caller's user keyring by its well-known id, by serial, its key by serial
    "keyctl get @u": call(nr["keyctl"], 0, -4, 0),  # KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING
    "keyctl link @u": call(nr["keyctl"], 8, args["user_ring"], -3),  # KEYCTL_LINK into our session ring
    "keyctl read key": call(nr["keyctl"], 11, args["key"], buf, 256),  # KEYCTL_READ
    "keyctl search @u": call(nr["keyctl"], 10, args["user_ring"], b"user", args["key_name"].encode(), 0),
    "add_key @u": call(nr["add_key"], b"user", b"egress-planted", b"x", 1, -4),
    "add_key by serial": call(nr["add_key"], b"user", b"egress-planted", b"x", 1, args["user_ring"]),
    "request_key": call(nr["request_key"], b"user", args["key_name"].encode(), None, 0),
    # socket families (N10): refused as a kernel without them would; never connected or bound
    "vsock": family(socket.AF_VSOCK, socket.SOCK_STREAM),
    "vsock with high bits": call(nr["socket"], socket.AF_VSOCK | 1 << 32, socket.SOCK_STREAM, 0),
    "packet": family(socket.AF_PACKET, socket.SOCK_RAW, 0x0300),
    "inet packet": family(socket.AF_INET, 10, 0x0300),  # SOCK_PACKET: the kernel makes it AF_PACKET
    "netlink sock_diag": family(socket.AF_NETLINK, socket.SOCK_RAW, 4),
    "netlink audit": family(socket.AF_NETLINK, socket.SOCK_RAW, 9),
    "netlink netfilter": family(socket.AF_NETLINK, socket.SOCK_RAW, 12),
    "socketpair inet": call(nr["socketpair"], socket.AF_INET, socket.SOCK_STREAM, 0, ctypes.create_string_buffer(8)),
    "unix": family(socket.AF_UNIX, socket.SOCK_STREAM),
    "inet": family(socket.AF_INET, socket.SOCK_STREAM),
    "inet6": family(socket.AF_INET6, socket.SOCK_DGRAM),
    "netlink route": family(socket.AF_NETLINK, socket.SOCK_RAW, 0),
    "interfaces": [name for _, name in socket.if_nameindex()],  # glibc reads them over NETLINK_ROUTE
    "socketpair unix": attempt(lambda: [s.close() for s in socket.socketpair(socket.AF_UNIX)]),
    # clone3 (N6): a size no kernel takes, so nothing is made if the filter lets it through (EINVAL)
    "clone3": call(nr["clone3"], None, 0),
    "threads": threads(),
    "subprocess": subprocess.run(["/bin/sh", "-c", "echo $((6 * 7))"], capture_output=True, text=True).stdout.strip(),
    "posix_spawn": posix_spawn(),
    "fork": fork(),
    # set-id files (N9), for every caller
    "setuid by chmod": attempt(lambda: (open(in_project("su"), "w").close(), os.chmod(in_project("su"), 0o4755))),
    "setgid by chmod": attempt(lambda: os.chmod(in_project("su"), 0o2755)),
    "setuid by open": attempt(lambda: os.close(os.open(in_project("su2"), os.O_CREAT | os.O_WRONLY, 0o4755))),
    "setgid folder": attempt(lambda: (os.mkdir(in_project("d")), os.chmod(in_project("d"), 0o2775))),
    "setuid by mknod": attempt(lambda: os.mknod(in_project("su3"), 0o104755)),
    "plain chmod": attempt(lambda: os.chmod(in_project("su"), 0o755)),
}
print(json.dumps(results))
"""

# As the runner, outside the sandbox: a key of its own in its user keyring before the run; after
# it, what the keyring holds; the key invalidated in any case.
DRIVER = r"""
import ctypes, json, os, struct, sys
sys.path.insert(0, sys.argv[1])
from sandbox.linux import SandboxSpec, start
cfg = json.loads(sys.argv[2])
args = cfg["args"]
libc = ctypes.CDLL(None, use_errno=True)
nr = args["numbers"]

def call(number, *a):
    ret = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(x) if isinstance(x, int) else x for x in a])
    if ret < 0:
        raise OSError(ctypes.get_errno(), f"syscall {number}")
    return ret

def ring(serial):
    buf = ctypes.create_string_buffer(4096)
    n = call(nr["keyctl"], 11, serial, buf, 4096)  # KEYCTL_READ of a keyring: its keys' serials
    return list(struct.unpack(f"{n // 4}i", buf.raw[:n]))

def describe(serial):
    buf = ctypes.create_string_buffer(512)
    n = call(nr["keyctl"], 6, serial, buf, 512)  # KEYCTL_DESCRIBE: type;uid;gid;perm;name
    return buf.raw[:n].rstrip(b"\0").decode()

secret = b"CALLER-USER-KEYRING-SECRET"
args["user_ring"] = call(nr["keyctl"], 0, -4, 1)  # KEYCTL_GET_KEYRING_ID of @u, made if need be
args["key"] = call(nr["add_key"], b"user", args["key_name"].encode(), secret, len(secret), -4)
try:
    before = ring(args["user_ring"])
    r, w = os.pipe()
    box = start(SandboxSpec([sys.executable, "-I", "-S", "-c", cfg["probe"], json.dumps(args)],
                            {"PATH": "/usr/bin:/bin"}, args["project"], writable=[args["project"]], stdout=w))
    os.close(w)
    status = box.wait(30)
    box.close()
    after = ring(args["user_ring"])
    buf = ctypes.create_string_buffer(256)
    n = call(nr["keyctl"], 11, args["key"], buf, 256)
    print(json.dumps({"status": status, "inside": json.loads(os.fdopen(r).read() or "null"),
                      "key": args["key"], "before": before, "after": after,
                      "planted": [describe(k) for k in after if k not in before], "payload": buf.raw[:n].decode()}))
finally:
    for key in ring(args["user_ring"]):  # ours, and anything planted
        if key == args["key"] or describe(key).endswith(";egress-planted"):
            call(nr["keyctl"], 21, key)  # KEYCTL_INVALIDATE
"""

NUMBERS = {  # the native table's numbers, for the probe's raw calls
    "x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250, "socket": 41, "socketpair": 53, "clone3": 435},
    "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219, "socket": 198, "socketpair": 199, "clone3": 435},
    "riscv64": {"add_key": 217, "request_key": 218, "keyctl": 219, "socket": 198, "socketpair": 199, "clone3": 435},
}

if platform.machine() not in NUMBERS:
    pytest.skip(f"no system call numbers for {platform.machine()} in this test", allow_module_level=True)


@pytest.fixture
def project(runner):
    """A project folder the runner owns (ordinary permissions allow every change: only the sandbox refuses)."""
    _, _, uid, gid = runner
    base = make_host_dir(for_everyone=True)
    try:
        (base / "project").mkdir()
        for path in (base, base / "project"):
            os.chown(path, uid, gid)
        yield base / "project"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _drive(runner, driver: str, probe: str, args: dict) -> dict:
    python, lib, uid, gid = runner
    done = subprocess.run([python, "-I", "-S", "-B", "-c", textwrap.dedent(driver), str(lib),
                           json.dumps({"probe": probe, "args": args})],
                          user=uid, group=gid, extra_groups=[] if os.geteuid() == 0 else None,
                          env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["status"] == 0, outcome
    return outcome


def test_the_doctors_numbers_are_this_machines():
    from sandbox import seccomp

    assert seccomp.native_numbers() == NUMBERS[platform.machine()]


def _setid_files(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID)]


def _host_has_ipv6() -> bool:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()
        return True
    except OSError:
        return False


def test_refused_kernel_interfaces(runner, project):
    args = {"project": str(project), "numbers": NUMBERS[platform.machine()],
            "key_name": f"egress-test-{uuid.uuid4().hex[:8]}"}
    outcome = _drive(runner, DRIVER, PROBE, args)
    seen = outcome["inside"]

    # Keyrings: every call refused, whichever key or ring it names...
    for name in ("keyctl get @u", "keyctl link @u", "keyctl read key", "keyctl search @u", "add_key @u",
                 "add_key by serial", "request_key"):
        assert seen[name] == errno.EPERM, (name, seen[name])
    # ... and the runner's user keyring is as it was: its key, unread, unchanged; nothing planted.
    assert outcome["after"] == outcome["before"] and outcome["key"] in outcome["after"], outcome
    assert outcome["planted"] == [] and outcome["payload"] == "CALLER-USER-KEYRING-SECRET"

    # Socket families: an allow list; the rest answer as a kernel without them would.
    for name in ("vsock", "vsock with high bits", "packet", "inet packet", "netlink sock_diag", "netlink audit",
                 "netlink netfilter", "socketpair inet"):
        assert seen[name] == errno.EAFNOSUPPORT, (name, seen[name])
    for name in ("unix", "inet", "netlink route", "socketpair unix"):
        assert seen[name] == "ok", (name, seen[name])
    if _host_has_ipv6():
        assert seen["inet6"] == "ok"
    assert "lo" in seen["interfaces"]

    # clone3 refused, so CLONE_INTO_CGROUP cannot be asked for; threads and children still start.
    assert seen["clone3"] == errno.ENOSYS
    assert seen["threads"] == [0, 1, 2, 3]
    assert (seen["subprocess"], seen["posix_spawn"], seen["fork"]) == ("42", 7, 9)

    # Set-id modes refused for every caller (an unprivileged caller's setuid file hands its uid to
    # any local account); an ordinary chmod still works.
    for name in ("setuid by chmod", "setgid by chmod", "setuid by open", "setgid folder", "setuid by mknod"):
        assert seen[name] == errno.EPERM, (name, seen[name])
    assert seen["plain chmod"] == "ok"
    assert _setid_files(project) == []


# A 32-bit x86 program without libc: each call through int 0x80, its result printed as
# "name errno" (0: it worked).
I386_SOURCE = r"""
static long sc(long nr, long a, long b, long c, long d, long e) {
    long ret;
    __asm__ volatile ("int $0x80" : "=a"(ret) : "a"(nr), "b"(a), "c"(b), "d"(c), "S"(d), "D"(e) : "memory");
    return ret;
}
static char out[1024];
static int used;
static void report(const char *name, long ret) {
    while (*name) out[used++] = *name++;
    out[used++] = ' ';
    long v = ret < 0 ? -ret : 0;
    char digits[12]; int n = 0;
    do { digits[n++] = '0' + v % 10; v /= 10; } while (v);
    while (n) out[used++] = digits[--n];
    out[used++] = '\n';
}
void _start(void) {
#ifdef ONLY_EXIT
    sc(1, 0, 0, 0, 0, 0);
#endif
    long pair[2];
    long sockargs[3] = {1, 1, 0};  /* AF_UNIX, SOCK_STREAM, 0 */
    report("keyctl", sc(288, 0, -4, 0, 0, 0));                      /* KEYCTL_GET_KEYRING_ID @u */
    report("add_key", sc(286, (long)"user", (long)"egress-planted", (long)"x", 1, -4));
    report("request_key", sc(287, (long)"user", (long)"egress-planted", 0, 0, 0));
    report("vsock", sc(359, 40, 1, 0, 0, 0));                       /* socket(AF_VSOCK) */
    report("packet", sc(359, 17, 3, 0x0300, 0, 0));
    report("inet packet", sc(359, 2, 10, 0x0300, 0, 0));                /* SOCK_PACKET */
    report("netlink audit", sc(359, 16, 3, 9, 0, 0));
    report("socketpair inet", sc(360, 2, 1, 0, (long)pair, 0));
    report("socketcall socket", sc(102, 1, (long)sockargs, 0, 0, 0));  /* the family behind a pointer */
    report("socketcall socketpair", sc(102, 8, (long)sockargs, 0, 0, 0));
    report("unix", sc(359, 1, 1, 0, 0, 0));
    report("inet", sc(359, 2, 1, 0, 0, 0));
    report("netlink route", sc(359, 16, 3, 0, 0, 0));
    report("socketpair unix", sc(360, 1, 1, 0, (long)pair, 0));
    report("clone3", sc(435, 0, 0, 0, 0, 0));
    report("setuid by open", sc(5, (long)"su32", 0101, 04755, 0, 0));  /* O_CREAT|O_WRONLY */
    report("plain open", sc(5, (long)"plain32", 0101, 0644, 0, 0));
    report("setuid by chmod", sc(15, (long)"plain32", 04755, 0, 0, 0));
    report("setgid by chmod", sc(15, (long)"plain32", 02755, 0, 0, 0));
    sc(4, 1, (long)out, used, 0, 0);
    sc(1, 0, 0, 0, 0, 0);
}
"""

I386_PROBE = r"""
import json, os, subprocess, sys
os.chdir(sys.argv[2])
done = subprocess.run([sys.argv[1]], capture_output=True, text=True)
print(json.dumps({"status": done.returncode, "seen": dict(line.rsplit(" ", 1) for line in done.stdout.splitlines())}))
"""

I386_DRIVER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from sandbox.linux import SandboxSpec, start
cfg = json.loads(sys.argv[2])
args = cfg["args"]
r, w = os.pipe()
box = start(SandboxSpec([sys.executable, "-I", "-S", "-c", cfg["probe"], args["program"], args["project"]],
                        {"PATH": "/usr/bin:/bin"}, args["project"], writable=[args["project"]], stdout=w))
os.close(w)
status = box.wait(30)
box.close()
print(json.dumps({"status": status, "inside": json.loads(os.fdopen(r).read() or "null")}))
"""


@pytest.fixture
def i386_program(project):
    """The 32-bit probe, built in the project (what the sandbox shows of the host may be little else)."""
    if platform.machine() != "x86_64":
        pytest.skip("the 32-bit probe is an i386 program: x86_64 only")
    if not shutil.which("gcc"):
        pytest.skip("no gcc to build the 32-bit probe with")
    source, program, exits = (project / name for name in ("probe32.c", "probe32", "exit32"))
    source.write_text(I386_SOURCE)
    for output, defines in ((program, []), (exits, ["-DONLY_EXIT"])):
        built = subprocess.run(["gcc", "-m32", "-static", "-nostdlib", "-ffreestanding", "-fno-pic",
                                "-fno-stack-protector", "-O1", *defines, "-o", str(output), str(source)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            pytest.skip(f"gcc cannot build a 32-bit program here: {built.stderr.strip()[-200:]}")
    try:  # the probe's twin that only exits: the probe itself must not run unconfined
        subprocess.run([str(exits)], capture_output=True, check=True)
    except OSError as e:  # ENOEXEC: a kernel without IA32 emulation
        pytest.skip(f"this kernel does not run i386 programs: {e}")
    program.chmod(0o755)
    yield program


def test_32bit_programs_meet_the_same_filter(runner, project, i386_program):
    outcome = _drive(runner, I386_DRIVER, I386_PROBE, {"program": str(i386_program), "project": str(project)})
    assert outcome["inside"]["status"] == 0, outcome
    seen = {name: int(value) for name, value in outcome["inside"]["seen"].items()}
    expected = {
        "keyctl": errno.EPERM, "add_key": errno.EPERM, "request_key": errno.EPERM,
        "vsock": errno.EAFNOSUPPORT, "packet": errno.EAFNOSUPPORT, "inet packet": errno.EAFNOSUPPORT,
        "netlink audit": errno.EAFNOSUPPORT,
        "socketpair inet": errno.EAFNOSUPPORT,
        # socketcall cannot make a socket (its family is behind a pointer): the direct calls can
        "socketcall socket": errno.ENOSYS, "socketcall socketpair": errno.ENOSYS,
        "unix": 0, "inet": 0, "netlink route": 0, "socketpair unix": 0,
        "clone3": errno.ENOSYS,
        "setuid by open": errno.EPERM, "plain open": 0, "setuid by chmod": errno.EPERM, "setgid by chmod": errno.EPERM,
    }
    assert seen == expected
    assert _setid_files(project) == []
