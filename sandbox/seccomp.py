"""The command's seccomp filter: no typing into a terminal it shares; for a root caller, no setuid files.

`ioctl(fd, TIOCSTI, &c)` pushes a byte into a terminal's *input*: a command that keeps the
caller's terminal can queue `touch ../PWNED\\n` for the caller's shell to run after the
sandbox ends, outside every namespace, or answer egress's own "Allow for this run?"
question. The kernel checks only that the terminal is the caller's controlling terminal
(`dev.tty.legacy_tiocsti = 1`, the default before Linux 6.2 and still common), which it is.
`TIOCLINUX` subcommands paste the console's selection into its input the same way.

A new session (setsid) would also stop TIOCSTI, but it takes the terminal away: no job
control, no /dev/tty for password prompts, Ctrl-C no longer reaches the command. The filter
(Flatpak's approach) keeps the terminal usable and refuses just these two requests, with
EPERM, as a kernel with `legacy_tiocsti = 0` would.

Details that matter (each a past escape in another sandbox):
* the request is compared on its low 32 bits only: the kernel truncates `cmd` to an int,
  so a filter comparing 64 bits is passed by `TIOCSTI | 1 << 32` (Flatpak CVE-2019-10063);
* every architecture the CPU can run is covered: on x86-64 a 32-bit program enters through
  the i386 table (ioctl is 54 there) and x32 through numbers with bit 30 set (refused
  outright: no distribution ships x32 programs); any other architecture value fails.

io_uring is refused (ENOSYS) for everyone: its operations are not seen by a filter on
system calls. For a root caller the filter also refuses file modes with S_ISUID/S_ISGID (see install()):
the red-team review left a setuid-root shell in the project with `chmod 4755`.

The filter is inherited by everything the command starts and cannot be removed. It needs
no_new_privs (set by Landlock, or by the caller) when the process lacks CAP_SYS_ADMIN.
Only stdlib and ctypes: this runs in the sandbox's init just before it spawns the command.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

from sandbox import _libc

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
REFUSED_IOCTLS = (TIOCSTI, TIOCLINUX)

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000

# audit architecture values (linux/audit.h)
_ARCH_X86_64, _ARCH_I386, _X32_BIT = 0xC000003E, 0x40000003, 0x40000000
_ARCH_AARCH64, _ARCH_ARM = 0xC00000B7, 0x40000028
_ARCH_RISCV64 = 0xC00000F3


class _Table:
    """One syscall table: its ioctl, and each call that sets a file mode as (nr, mode arg, flags arg)."""

    def __init__(self, arch: int, ioctl: int, modes: list[tuple[int, int, int | None]], openat2: int = 437):
        self.arch, self.ioctl, self.modes, self.openat2 = arch, ioctl, modes, openat2


# chmod, fchmod, fchmodat, fchmodat2, creat, open, openat, mknod, mknodat: (nr, mode arg, flags arg)
_GENERIC = [(52, 1, None), (53, 2, None), (452, 2, None), (56, 3, 2), (33, 2, None)]  # aarch64, riscv64
_TABLES = {
    "x86_64": [
        _Table(_ARCH_X86_64, 16, [(90, 1, None), (91, 1, None), (268, 2, None), (452, 2, None), (85, 1, None),
                                  (2, 2, 1), (257, 3, 2), (133, 1, None), (259, 2, None)]),
        _Table(_ARCH_I386, 54, [(15, 1, None), (94, 1, None), (306, 2, None), (452, 2, None), (8, 1, None),
                                (5, 2, 1), (295, 3, 2), (14, 1, None), (297, 2, None)]),
    ],
    "aarch64": [
        _Table(_ARCH_AARCH64, 29, _GENERIC),
        _Table(_ARCH_ARM, 54, [(15, 1, None), (94, 1, None), (333, 2, None), (452, 2, None), (8, 1, None),
                               (5, 2, 1), (322, 3, 2), (14, 1, None), (324, 2, None)]),
    ],
    "riscv64": [_Table(_ARCH_RISCV64, 29, _GENERIC)],
}
SETID_BITS = 0o6000  # S_ISUID | S_ISGID
IO_URING = (425, 426, 427)  # io_uring_setup, _enter, _register: the same number on every table
_CREATES = 0o100 | 0o20000000  # O_CREAT | __O_TMPFILE: the open flags that make a file with `mode`

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_OFF_NR, _OFF_ARCH = 0, 4


def _arg_low(index: int) -> int:
    """Offset of the low 32 bits of args[index] (the kernel reads modes, flags, requests as ints)."""
    return 16 + 8 * index + (0 if sys.byteorder == "little" else 4)


# classic BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_ALLOW = ("ret", _RET_ALLOW)
_EPERM = ("ret", _RET_ERRNO | errno.EPERM)
_ENOSYS = ("ret", _RET_ERRNO | errno.ENOSYS)


def supported() -> bool:
    return os.uname().machine in _TABLES


def _program(machine: str, refuse_setid: bool = False) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions.

    load arch -> the table's block, or ENOSYS for an architecture this machine cannot enter;
    in a block: ioctl with a refused request -> EPERM; with `refuse_setid`, a call that would
    set S_ISUID/S_ISGID (chmod family, or open/creat/mknod creating a file) -> EPERM, and
    openat2, whose flags sit behind a pointer the filter cannot read, -> ENOSYS (glibc then
    falls back to openat); x86-64's x32 numbers -> ENOSYS; everything else allowed.
    """
    code: list[tuple] = [("ld", _OFF_ARCH)]
    tables = _TABLES[machine]
    for i, table in enumerate(tables):
        code.append(("jeq", table.arch, f"table{i}", None))
    code.append(_ENOSYS)
    for i, table in enumerate(tables):
        code += [("label", f"table{i}"), ("ld", _OFF_NR)]
        if table.arch == _ARCH_X86_64:
            code += [("jge", _X32_BIT, f"x32-{i}", None)]
        code.append(("jeq", table.ioctl, f"ioctl{i}", None))
        # io_uring carries opens, xattrs and socket calls past every check above: a program
        # told ENOSYS falls back to plain system calls (Docker's default profile does the same).
        code += [("jeq", nr, f"uring{i}", None) for nr in IO_URING]
        if refuse_setid:
            for nr, mode_arg, flags_arg in table.modes:
                code.append(("jeq", nr, f"mode{i}-{nr}", None))
            code.append(("jeq", table.openat2, f"nosys{i}", None))
        code.append(_ALLOW)
        if table.arch == _ARCH_X86_64:
            code += [("label", f"x32-{i}"), _ENOSYS]
        code += [("label", f"ioctl{i}"), ("ld", _arg_low(1))]
        code += [("jeq", request, f"eperm{i}", None) for request in REFUSED_IOCTLS]
        code.append(_ALLOW)
        if refuse_setid:
            for nr, mode_arg, flags_arg in table.modes:
                code.append(("label", f"mode{i}-{nr}"))
                if flags_arg is not None:  # open/openat: only a creating open takes a mode
                    code += [("ld", _arg_low(flags_arg)), ("jset", _CREATES, None, f"allow{i}")]
                code += [("ld", _arg_low(mode_arg)), ("jset", SETID_BITS, f"eperm{i}", f"allow{i}")]
            code += [("label", f"nosys{i}"), _ENOSYS, ("label", f"allow{i}"), _ALLOW]
        code += [("label", f"eperm{i}"), _EPERM, ("label", f"uring{i}"), _ENOSYS]
    return _assemble(code)


def _assemble(code: list[tuple]) -> list[tuple[int, int, int, int]]:
    """Resolve labels into relative jumps (None: the next instruction)."""
    at: dict[str, int] = {}
    count = 0
    for item in code:
        if item[0] == "label":
            at[item[1]] = count
        else:
            count += 1
    program = []
    for item in code:
        kind = item[0]
        if kind == "label":
            continue
        here = len(program) + 1  # jumps count from the next instruction
        if kind == "ld":
            program.append((_LD_W_ABS, 0, 0, item[1]))
        elif kind == "ret":
            program.append((_RET_K, 0, 0, item[1]))
        else:
            op = {"jeq": _JEQ_K, "jge": _JGE_K, "jset": _JSET_K}[kind]
            jt = 0 if item[2] is None else at[item[2]] - here
            jf = 0 if item[3] is None else at[item[3]] - here
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise ValueError("seccomp jump out of range")
            program.append((op, jt, jf, item[1]))
    return program


def install(refuse_setid: bool) -> None:
    """Install the filter on the calling thread (and so on everything it later runs).

    `refuse_setid`: also refuse setting S_ISUID/S_ISGID on files. For a root caller: the
    command is uid 0 over the project, and `chmod 4755` there would leave a setuid-root
    program on the host after the run (an unprivileged caller's setuid file is only itself).
    Raises OSError if the kernel refuses it or the machine's architecture is not known.
    """
    machine = os.uname().machine  # platform.machine()'s answer, without importing platform (~2 ms)
    if machine not in _TABLES:
        raise OSError(errno.ENOSYS, f"no seccomp filter for the {machine} architecture")
    program = _program(machine, refuse_setid)
    raw = struct.pack("HBBI" * len(program), *(field for ins in program for field in ins))  # struct sock_filter[]
    buffer = ctypes.create_string_buffer(raw, len(raw))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }
    fprog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog_buffer))
