"""Landlock write confinement: read and execute anywhere, write only beneath chosen paths.

Landlock (Linux 5.13+, no privilege needed) lets a process restrict itself and all its future
children. We *handle* only the rights that change the filesystem, so everything not handled
(reading files, listing directories, executing) stays allowed everywhere without a rule, and
each handled right is granted back beneath the writable trees only.

Rights the running kernel does not know are masked out by ABI version:
REFER (moving/linking between directories) needs ABI 2, TRUNCATE ABI 3, IOCTL_DEV ABI 5.
Without REFER (ABI 1) the kernel refuses every cross-directory rename or link, even inside
the writable trees; that is Landlock's own rule, not ours.

Not covered by Landlock (and so not by this module): connecting to an existing Unix socket
file, writes through file descriptors opened before the restriction, and /proc/self/fd
re-opens of such descriptors' targets.

Only stdlib and ctypes: this module runs in the forked child just before exec.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable

from sandbox import _libc

# Syscall numbers are the same on x86_64 and aarch64 (and every arch using the unified table).
_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446

_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

# linux/landlock.h, LANDLOCK_ACCESS_FS_*
WRITE_FILE = 1 << 1
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5

_ABI_RIGHTS = {
    1: WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG
    | MAKE_SOCK | MAKE_FIFO | MAKE_BLOCK | MAKE_SYM,
    2: REFER,
    3: TRUNCATE,
    5: IOCTL_DEV,
}
# The only rights the kernel accepts on a rule whose path is a file rather than a directory.
_FILE_RIGHTS = WRITE_FILE | TRUNCATE | IOCTL_DEV
# What a device needs: write to it, open it with O_TRUNC (`> /dev/null`), ioctl it (terminals).
DEVICE_RIGHTS = WRITE_FILE | TRUNCATE | IOCTL_DEV

# Devices an ordinary shell and its tools write to. Missing ones are skipped.
DEVICES = (
    "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
    "/dev/tty", "/dev/ptmx", "/dev/pts",
)
# Shared-memory scratch (POSIX shm, semaphores, multiprocessing): full write rights. Missing ones are skipped.
SCRATCH = ("/dev/shm",)


class LandlockError(OSError):
    """Landlock is unavailable or refused the ruleset."""


# linux/landlock.h, LANDLOCK_SCOPE_* (ABI 6, Linux 6.12): what a process in the domain may not
# reach outside it. SIGNAL: no signal to any process outside the domain (egress, the shell
# that started it, its siblings: kill(0, ...) and kill(-pgid, ...) included); ABSTRACT_UNIX_SOCKET:
# no connect to an abstract socket made outside it.
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1
SCOPES_ABI = 6


class _RulesetAttr(ctypes.Structure):
    # Only the first field: every Landlock kernel accepts this size, and we handle no net rights.
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _ScopedRulesetAttr(ctypes.Structure):
    # The size ABI 6 reads: no net rights handled, the scopes set.
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel struct is __attribute__((packed))
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_abi: int | None = None
_abi_errno = 0


def abi_version() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is unavailable (cached)."""
    global _abi, _abi_errno
    if _abi is None:
        try:
            _abi = _libc.syscall(_SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
        except OSError as e:
            _abi, _abi_errno = 0, e.errno
    return _abi


def unavailable_reason() -> str | None:
    """Why Landlock cannot be used here, in one line with the fix; None when it can."""
    if abi_version() > 0:
        return None
    if _abi_errno == errno.EOPNOTSUPP:
        return "Landlock is built into this kernel but disabled at boot (add 'landlock' to the lsm= kernel parameter)"
    return "this kernel has no Landlock (needs Linux 5.13+ built with CONFIG_SECURITY_LANDLOCK)"


def handled_rights(abi: int) -> int:
    """Every write-type right the given ABI understands."""
    rights = 0
    for version, bits in _ABI_RIGHTS.items():
        if abi >= version:
            rights |= bits
    return rights


def restrict_writes(
    writable: Iterable[str],
    devices: Iterable[str] = DEVICES,
    scratch: Iterable[str] = SCRATCH,
) -> None:
    """Confine the calling thread (and what it later runs) to writing beneath `writable`.

    `writable` paths must exist; `devices` get DEVICE_RIGHTS and `scratch` trees full write
    rights, each skipped when missing. Where the kernel has Landlock's scopes (ABI 6), the
    domain also keeps signals and abstract Unix sockets in: see SCOPE_SIGNAL. Sets no_new_privs, which restrict_self requires of an
    unprivileged caller. Raises LandlockError.
    """
    abi = abi_version()
    if abi < 1:
        raise LandlockError(errno.ENOSYS, unavailable_reason())
    handled = handled_rights(abi)
    if abi >= SCOPES_ABI:
        attr = _ScopedRulesetAttr(handled, 0, SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET)
    else:
        attr = _RulesetAttr(handled)
    try:
        ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    except OSError as e:
        raise LandlockError(e.errno, f"landlock_create_ruleset: {e.strerror}") from None
    try:
        for path in writable:
            _allow(ruleset, path, handled, required=True)
        for path in devices:
            _allow(ruleset, path, DEVICE_RIGHTS & handled, required=False)
        for path in scratch:
            _allow(ruleset, path, handled, required=False)
        _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
        try:
            _libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0)
        except OSError as e:
            raise LandlockError(e.errno, f"landlock_restrict_self: {e.strerror}") from None
    finally:
        os.close(ruleset)


def _allow(ruleset: int, path: str, rights: int, required: bool) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as e:
        if required:
            raise LandlockError(e.errno, f"writable path {path}: {e.strerror}") from None
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _FILE_RIGHTS
        if rights:
            attr = _PathBeneathAttr(rights, fd)
            _libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(attr), 0)
    except OSError as e:
        raise LandlockError(e.errno, f"landlock_add_rule {path}: {e.strerror}") from None
    finally:
        os.close(fd)
