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


def run(program, arch: int, nr: int, *args: int) -> int:
    """Interpret the filter for one call (seccomp_data laid out little-endian)."""
    args = [a & 0xFFFFFFFFFFFFFFFF for a in (list(args) + [0] * 6)[:6]]  # as the kernel passes them
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x15:  # jeq k
            pc += jt if acc == k else jf
        elif code == 0x35:  # jge k
            pc += jt if acc >= k else jf
        elif code == 0x45:  # jset k
            pc += jt if acc & k else jf
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
    ("x86_64", "x86_64", 425, 0, ENOSYS),  # io_uring_setup: its operations would pass unseen
    ("x86_64", "i386", 426, 0, ENOSYS),
    ("aarch64", "aarch64", 427, 0, ENOSYS),
]


@pytest.mark.skipif(sys.byteorder != "little", reason="the interpreter lays seccomp_data out little-endian")
@pytest.mark.parametrize(("machine", "entry", "nr", "ioctl_request", "expected"), CASES)
def test_filter_program(machine, entry, nr, ioctl_request, expected):
    # the ioctl checks hold with or without the setuid checks
    for refuse_setid in (False, True):
        assert run(seccomp._program(machine, refuse_setid), ARCH[entry], nr, 3, ioctl_request) == expected


SUID, SGID, O_CREAT, O_TMPFILE, O_RDWR = 0o4000, 0o2000, 0o100, 0o20200000, 0o2
SETID_CASES = [
    # machine, entry, nr, args, expected with refuse_setid
    ("x86_64", "x86_64", 90, ("path", 0o4755), EPERM),           # chmod u+s
    ("x86_64", "x86_64", 90, ("path", 0o755), ALLOW),            # chmod without it
    ("x86_64", "x86_64", 91, (3, 0o2755), EPERM),                # fchmod g+s
    ("x86_64", "x86_64", 268, (-100, "path", 0o6777), EPERM),    # fchmodat
    ("x86_64", "x86_64", 452, (-100, "path", 0o4700, 0), EPERM),  # fchmodat2
    ("x86_64", "x86_64", 268, (-100, "path", 0o644 | 1 << 32), ALLOW),  # high bits are not mode bits
    ("x86_64", "x86_64", 85, ("path", 0o4755), EPERM),           # creat
    ("x86_64", "x86_64", 2, ("path", O_CREAT | O_RDWR, 0o4755), EPERM),   # open(O_CREAT, 04755)
    ("x86_64", "x86_64", 2, ("path", O_RDWR, 0o4755), ALLOW),    # no O_CREAT: the mode is ignored
    ("x86_64", "x86_64", 257, (-100, "path", O_CREAT, 0o2755), EPERM),    # openat
    ("x86_64", "x86_64", 257, (-100, "path", O_TMPFILE | O_RDWR, 0o4700), EPERM),
    ("x86_64", "x86_64", 257, (-100, "path", O_CREAT, 0o644), ALLOW),
    ("x86_64", "x86_64", 133, ("path", 0o104755, 0), EPERM),     # mknod of a setuid regular file
    ("x86_64", "x86_64", 259, (-100, "path", 0o104755, 0), EPERM),
    ("x86_64", "x86_64", 437, (-100, "path", 0, 24), ENOSYS),    # openat2: flags behind a pointer
    ("x86_64", "i386", 15, ("path", 0o4755), EPERM),             # 32-bit chmod
    ("x86_64", "i386", 5, ("path", O_CREAT, 0o4755), EPERM),     # 32-bit open
    ("x86_64", "i386", 90, ("path", 0o4755), ALLOW),             # i386's 90 is mmap
    ("aarch64", "aarch64", 53, (-100, "path", 0o4755), EPERM),
    ("aarch64", "aarch64", 56, (-100, "path", O_CREAT, 0o4755), EPERM),
    ("aarch64", "arm", 15, ("path", 0o4755), EPERM),
    ("riscv64", "riscv64", 52, (3, 0o6000), EPERM),
]


@pytest.mark.skipif(sys.byteorder != "little", reason="the interpreter lays seccomp_data out little-endian")
@pytest.mark.parametrize(("machine", "entry", "nr", "args", "expected"), SETID_CASES)
def test_setid_modes_refused_for_a_root_caller(machine, entry, nr, args, expected):
    numbers = [a if isinstance(a, int) else 0x7FFF0000 for a in args]  # pointers: any address
    assert run(seccomp._program(machine, refuse_setid=True), ARCH[entry], nr, *numbers) == expected
    assert run(seccomp._program(machine, refuse_setid=False), ARCH[entry], nr, *numbers) == ALLOW
