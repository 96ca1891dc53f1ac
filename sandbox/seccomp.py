"""A seccomp filter that keeps the command from typing into a terminal it shares.

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

The filter is inherited by everything the command starts and cannot be removed. It needs
no_new_privs (set by Landlock, or by the caller) when the process lacks CAP_SYS_ADMIN.
Only stdlib and ctypes: this runs in the sandbox's init just before it spawns the command.
"""

from __future__ import annotations

import ctypes
import errno
import platform
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

# audit architecture values (linux/audit.h) and each one's ioctl number
_ARCH_X86_64, _ARCH_I386, _X32_BIT = 0xC000003E, 0x40000003, 0x40000000
_ARCH_AARCH64, _ARCH_ARM = 0xC00000B7, 0x40000028
_ARCH_RISCV64 = 0xC00000F3
# native architecture -> [(audit arch, ioctl number)] for every table a process may enter through
_TABLES = {
    "x86_64": [(_ARCH_X86_64, 16), (_ARCH_I386, 54)],
    "aarch64": [(_ARCH_AARCH64, 29), (_ARCH_ARM, 54)],
    "riscv64": [(_ARCH_RISCV64, 29)],
}

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_OFF_NR, _OFF_ARCH = 0, 4
_OFF_ARG1_LOW = 24 if sys.byteorder == "little" else 28

# classic BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06


def supported() -> bool:
    return platform.machine() in _TABLES


def _program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; jt/jf count the instructions skipped.

        load arch; for each table: arch == T -> T's block; unknown arch -> ENOSYS
        T's block: load nr; [x86-64: nr >= x32 bit -> ENOSYS]; nr != ioctl -> ALLOW;
                   load request (low 32 bits); request in REFUSED_IOCTLS -> EPERM; ALLOW
    """
    blocks = []
    for arch, ioctl in _TABLES[machine]:
        block = [(_LD_W_ABS, 0, 0, _OFF_NR)]
        if arch == _ARCH_X86_64:
            block += [(_JGE_K, 0, 1, _X32_BIT), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]
        block += [(_JEQ_K, 1, 0, ioctl), (_RET_K, 0, 0, _RET_ALLOW), (_LD_W_ABS, 0, 0, _OFF_ARG1_LOW)]
        for i, request in enumerate(REFUSED_IOCTLS):
            block.append((_JEQ_K, len(REFUSED_IOCTLS) - i, 0, request))  # -> past the rest and ALLOW
        block += [(_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM)]
        blocks.append((arch, block))
    program = [(_LD_W_ABS, 0, 0, _OFF_ARCH)]
    dispatch_end = 1 + len(blocks) + 1  # the arch load, one compare per table, the unknown-arch return
    start = dispatch_end
    for arch, block in blocks:
        program.append((_JEQ_K, start - (len(program) + 1), 0, arch))
        start += len(block)
    program.append((_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS))
    for _, block in blocks:
        program.extend(block)
    return program


def refuse_terminal_injection() -> None:
    """Install the filter on the calling thread (and so on everything it later runs).

    Raises OSError if the kernel refuses it or the machine's architecture is not known.
    """
    machine = platform.machine()
    if machine not in _TABLES:
        raise OSError(errno.ENOSYS, f"no seccomp filter for the {machine} architecture")
    program = _program(machine)
    raw = b"".join(struct.pack("HBBI", *ins) for ins in program)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }
    fprog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog_buffer))
