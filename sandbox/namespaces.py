"""The namespace steps of the Linux sandbox, run by its helper processes after fork.

Each function does one kernel-facing step and raises OSError; `refusal_reason` turns a
refusal into one line naming the cause and the fix. Only stdlib and ctypes: these run in a
forked copy of the caller, where importing or locking must be avoided.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct

from sandbox import _libc

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def enter(uid: int, gid: int) -> None:
    """Move the calling (single-threaded) process into new user, net, mount, IPC and PID namespaces.

    The caller keeps its own uid and gid inside (a one-id map, the only kind an unprivileged
    process may write). Its next child becomes PID 1 of the new PID namespace.
    """
    _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID)
    _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    # Keep our mounts (the private /proc) from propagating back to the host's mount tree.
    _libc.mount(None, "/", None, MS_REC | MS_PRIVATE)


def loopback_up() -> None:
    """Set `lo` up in the current network namespace (SIOCSIFFLAGS; docs/decisions/pyroute2.md says
    why not pyroute2).

    Also let every uid bind low ports there: the command holds no capability (even a root
    caller's), and a test server on port 80 of its own private loopback harms no one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))
    try:
        _write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")  # this network namespace's own
    except OSError:
        pass  # an older kernel without the knob: low ports stay privileged, nothing else changes


def interfaces_up() -> list[str]:
    """The names of the current network namespace's interfaces that are up (SIOCGIFFLAGS each)."""
    up = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            ifreq = struct.pack("16sh", name.encode(), 0)
            if struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1] & _IFF_UP:
                up.append(name)
    return up


def mount_proc() -> bool:
    """Mount a /proc that shows only the new PID namespace; False if the kernel refuses.

    Must run in PID 1 of the namespace (a /proc belongs to its mounter's PID namespace). The
    kernel refuses inside containers whose /proc has masked entries; the sandbox then keeps
    the inherited /proc (Landlock still stops ptrace and /proc/PID/mem of outside processes).
    """
    try:
        _libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        return True
    except OSError:
        return False


def drop_capabilities() -> None:
    """Empty the bounding and ambient sets: what the caller execs next starts with no capabilities.

    Inside its user namespace a root caller's command is uid 0, and the kernel gives uid 0
    every capability in the bounding set at exec. Those reach host files whose owner is
    mapped (root's, for a root caller): CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_CHOWN over /etc.
    With the bounding set empty it stays uid 0 (tools that check for root still run) and
    holds nothing. An unprivileged caller's command had none already; dropping is harmless.
    """
    with open("/proc/sys/kernel/cap_last_cap", "rb") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _libc.prctl(_libc.PR_CAPBSET_DROP, cap)
    _libc.prctl(_libc.PR_CAP_AMBIENT, _libc.PR_CAP_AMBIENT_CLEAR_ALL)


# keyctl(2)'s number by architecture (x86_64; the generic table of aarch64 and riscv64).
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219}
_KEYCTL_JOIN_SESSION_KEYRING = 1


def new_session_keyring() -> None:
    """Leave the caller's session keyring for a new, empty, anonymous one.

    Keyrings are not in any namespace the sandbox makes: a command that inherits the
    caller's session keyring (pam_keyinit, `keyctl session`) could read its keys (Kerberos
    caches, cached passwords), plant or revoke them, and the changes outlive the run. A
    named keyring of the caller cannot be joined back: lookups by name stay within the
    sandbox's user namespace.
    """
    machine = os.uname().machine  # platform.machine()'s answer
    number = _SYS_KEYCTL.get(machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"no keyctl number for {machine}")
    _libc.syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None)


def refusal_reason(err: OSError) -> str:
    """One line: why user namespaces were refused here and how to allow them."""
    if _sysctl("kernel/unprivileged_userns_clone") == "0" and os.geteuid() != 0:
        return ("unprivileged user namespaces are disabled; "
                "fix: sudo sysctl -w kernel.unprivileged_userns_clone=1")
    if _sysctl("user/max_user_namespaces") == "0":
        return "user namespaces are disabled; fix: sudo sysctl -w user.max_user_namespaces=15000"
    if _sysctl("kernel/apparmor_restrict_unprivileged_userns") == "1":
        return ("AppArmor restricts unprivileged user namespaces; fix: sudo sysctl -w "
                "kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile with 'userns,' "
                "for this Python")
    if err.errno == errno.ENOSPC:
        return "the user namespace limit is reached; fix: raise user.max_user_namespaces (sysctl)"
    return (f"the kernel refused new namespaces ({err.strerror}); a container or seccomp policy "
            "probably forbids them; fix: allow unshare(CLONE_NEWUSER) there, or run on the host")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())  # one write(2): these files reject partial writes
    finally:
        os.close(fd)


def _sysctl(name: str) -> str | None:
    try:
        with open(f"/proc/sys/{name}") as f:
            return f.read().strip()
    except OSError:
        return None
