"""The terminal-injection filter's program, run on a table of real system calls.

The live filter is tested in test_escapes.py (native 64-bit calls, as root and as nobody);
32-bit and x32 entries cannot be made from Python, so the program itself is run here by a
small interpreter of the classic BPF subset it uses, for every table a process can enter by.
"""

from __future__ import annotations

import errno
import struct
import sys

import pytest

from sandbox import seccomp

ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
ARCH = {"x86_64": 0xC000003E, "i386": 0x40000003, "aarch64": 0xC00000B7, "arm": 0x40000028,
        "riscv64": 0xC00000F3}


def run(program, arch: int, nr: int, arg1: int) -> int:
    """Interpret the filter for one call (seccomp_data laid out little-endian)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, 3, arg1, 0, 0, 0, 0)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x15:  # jeq k
            pc += jt if acc == k else jf
        elif code == 0x35:  # jge k
            pc += jt if acc >= k else jf
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1


TIOCSTI, TIOCLINUX, TIOCGWINSZ = 0x5412, 0x541C, 0x5413

CASES = [
    # machine, entry, syscall nr, request, expected
    ("x86_64", "x86_64", 16, TIOCSTI, EPERM),
    ("x86_64", "x86_64", 16, TIOCSTI | 1 << 32, EPERM),  # the kernel drops the high bits: so do we
    ("x86_64", "x86_64", 16, TIOCLINUX, EPERM),
    ("x86_64", "x86_64", 16, TIOCGWINSZ, ALLOW),  # other terminal requests pass
    ("x86_64", "x86_64", 0, TIOCSTI, ALLOW),  # read(2) whose second argument happens to look like it
    ("x86_64", "i386", 54, TIOCSTI, EPERM),  # a 32-bit program's ioctl
    ("x86_64", "i386", 16, TIOCSTI, ALLOW),  # i386's 16 is lchown, not ioctl
    ("x86_64", "x86_64", 0x40000000 | 514, TIOCSTI, ENOSYS),  # x32: refused outright
    ("x86_64", "x86_64", 0x40000000 | 0, 0, ENOSYS),
    ("x86_64", "aarch64", 29, TIOCSTI, ENOSYS),  # an architecture this machine cannot enter: refused
    ("aarch64", "aarch64", 29, TIOCSTI, EPERM),
    ("aarch64", "aarch64", 29, TIOCGWINSZ, ALLOW),
    ("aarch64", "arm", 54, TIOCSTI, EPERM),
    ("aarch64", "aarch64", 16, TIOCSTI, ALLOW),
    ("riscv64", "riscv64", 29, TIOCLINUX, EPERM),
    ("riscv64", "x86_64", 16, TIOCSTI, ENOSYS),
]


@pytest.mark.skipif(sys.byteorder != "little", reason="the interpreter lays seccomp_data out little-endian")
@pytest.mark.parametrize(("machine", "entry", "nr", "ioctl_request", "expected"), CASES)
def test_filter_program(machine, entry, nr, ioctl_request, expected):
    assert run(seccomp._program(machine), ARCH[entry], nr, ioctl_request) == expected
