"""errno-checked calls into libc for what Python 3.11's os module lacks (unshare, setns, mount, prctl, raw syscalls)."""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)

# prctl options (linux/prctl.h)
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4


def _check(ret: int, what: str) -> int:
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def syscall(number: int, *args: int | ctypes._Pointer | None) -> int:
    """Raw syscall; integer arguments are passed as C longs (syscall(2) reads longs from its varargs)."""
    cargs = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return _check(_libc.syscall(ctypes.c_long(number), *cargs), f"syscall {number}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    """setns(2) (os.setns arrives in Python 3.12)."""
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    """prctl(2); pointers are passed as integers (ctypes.addressof)."""
    return _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(0),
                              ctypes.c_ulong(0)), "prctl")


MNT_DETACH = 2
# pivot_root(2) has no glibc wrapper: its number by architecture (x86_64; the generic table).
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(38, f"no pivot_root number for {os.uname().machine}")
    syscall(number, ctypes.c_char_p(new_root.encode()), ctypes.c_char_p(put_old.encode()))
