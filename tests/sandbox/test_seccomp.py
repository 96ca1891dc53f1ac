"""The seccomp filter's program, run on a table of real system calls.

The live filter is tested in test_escapes.py and test_seccomp_escapes.py (native calls, and i386
ones from a small 32-bit program, as root and as nobody); x32 and other architectures' entries
cannot be made here, so the program itself is run by a small interpreter of the classic BPF
subset it uses, for every table a process can enter by.
"""

from __future__ import annotations

import errno
import re
import struct
import sys
from pathlib import Path

import pytest

from sandbox import seccomp

ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
EAFNOSUPPORT = 0x00050000 | errno.EAFNOSUPPORT
ARCH = {"x86_64": 0xC000003E, "i386": 0x40000003, "aarch64": 0xC00000B7, "arm": 0x40000028,
        "riscv64": 0xC00000F3}
ENTRIES = {"x86_64": ("x86_64", "i386"), "aarch64": ("aarch64", "arm"), "riscv64": ("riscv64",)}

pytestmark = pytest.mark.skipif(sys.byteorder != "little", reason="the interpreter lays seccomp_data out little-endian")


def trace(program, arch: int, nr: int, *args: int) -> tuple[int, int]:
    """Interpret the filter for one call (seccomp_data laid out little-endian): (return, steps)."""
    args = [a & 0xFFFFFFFFFFFFFFFF for a in (list(args) + [0] * 6)[:6]]  # as the kernel passes them
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    pc, acc, steps = 0, 0, 0
    while True:
        code, jt, jf, k = program[pc]
        steps += 1
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x15:  # jeq k
            pc += jt if acc == k else jf
        elif code == 0x35:  # jge k
            pc += jt if acc >= k else jf
        elif code == 0x45:  # jset k
            pc += jt if acc & k else jf
        elif code == 0x54:  # and k
            acc &= k
        elif code == 0x06:  # ret k
            return k, steps
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1


def run(program, arch: int, nr: int, *args: int) -> int:
    return trace(program, arch, nr, *args)[0]


def programs(machine: str):
    """The filter as install() makes it."""
    return (seccomp._program(machine),)


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


@pytest.mark.parametrize(("machine", "entry", "nr", "ioctl_request", "expected"), CASES)
def test_filter_program(machine, entry, nr, ioctl_request, expected):
    for program in programs(machine):
        assert run(program, ARCH[entry], nr, 3, ioctl_request) == expected


SUID, SGID, O_CREAT, O_TMPFILE, O_RDWR = 0o4000, 0o2000, 0o100, 0o20200000, 0o2
SETID_CASES = [
    # machine, entry, nr, args, expected
    ("x86_64", "x86_64", 90, ("path", 0o4755), EPERM),           # chmod u+s
    ("x86_64", "x86_64", 90, ("path", 0o755), ALLOW),            # chmod without it
    ("x86_64", "x86_64", 91, (3, 0o2755), EPERM),                # fchmod g+s (a setgid folder too)
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


@pytest.mark.parametrize(("machine", "entry", "nr", "args", "expected"), SETID_CASES)
def test_setid_modes_refused_for_every_caller(machine, entry, nr, args, expected):
    # One filter for every caller: the old one refused these for a root caller only.
    numbers = [a if isinstance(a, int) else 0x7FFF0000 for a in args]  # pointers: any address
    for program in programs(machine):
        assert run(program, ARCH[entry], nr, *numbers) == expected


AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_ALG, AF_VSOCK = 1, 2, 10, 16, 17, 38, 40
NETLINK_ROUTE, NETLINK_SOCK_DIAG, NETLINK_AUDIT, NETLINK_NETFILTER = 0, 4, 9, 12
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_PACKET, SOCK_NONBLOCK, SOCK_CLOEXEC = 1, 2, 3, 10, 0o4000, 0o2000000
# (add_key, request_key, keyctl), socket, socketpair, socketcall: each table's own numbers
NUMBERS = {"x86_64": ((248, 249, 250), 41, 53, None), "i386": ((286, 287, 288), 359, 360, 102),
           "aarch64": ((217, 218, 219), 198, 199, None), "riscv64": ((217, 218, 219), 198, 199, None),
           "arm": ((309, 310, 311), 281, 288, 102)}
ALL_ENTRIES = [(machine, entry) for machine, entries in ENTRIES.items() for entry in entries]


@pytest.mark.parametrize(("machine", "entry"), ALL_ENTRIES)
def test_keyrings_refused_on_every_table(machine, entry):
    keys = NUMBERS[entry][0]
    for nr in keys:
        for option in (0, 1, 8, 11):  # GET_KEYRING_ID, JOIN_SESSION_KEYRING, LINK, READ
            assert run(seccomp._program(machine), ARCH[entry], nr, option, -4) == EPERM, (nr, option)


SOCKET_CASES = [
    # domain, type, protocol, expected from socket()
    (AF_UNIX, SOCK_STREAM, 0, ALLOW),
    (AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, ALLOW),
    (AF_INET, SOCK_STREAM, 6, ALLOW),
    (AF_INET6, SOCK_DGRAM, 17, ALLOW),
    (AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE, ALLOW),  # getaddrinfo(AI_ADDRCONFIG), ip, Go
    (AF_NETLINK, SOCK_RAW, NETLINK_SOCK_DIAG, EAFNOSUPPORT),
    (AF_NETLINK, SOCK_RAW, NETLINK_AUDIT, EAFNOSUPPORT),
    (AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER, EAFNOSUPPORT),
    (AF_NETLINK, SOCK_RAW, NETLINK_ROUTE | 1 << 32, ALLOW),  # the kernel reads an int: protocol 0
    (AF_VSOCK, SOCK_STREAM, 0, EAFNOSUPPORT),  # the host's port space (red-team N10)
    (AF_VSOCK | 1 << 32, SOCK_STREAM, 0, EAFNOSUPPORT),  # high bits do not hide a family
    (AF_INET | 1 << 32, SOCK_STREAM, 0, ALLOW),  # ... nor make one look foreign: the kernel sees AF_INET
    (AF_PACKET, SOCK_RAW, 0x0300, EAFNOSUPPORT),
    (AF_INET, SOCK_PACKET, 0x0300, EAFNOSUPPORT),  # the kernel makes an AF_PACKET socket of it
    (AF_INET, SOCK_PACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0x0300, EAFNOSUPPORT),
    (AF_INET, SOCK_PACKET | 1 << 32, 0x0300, EAFNOSUPPORT),
    (AF_INET, SOCK_RAW | SOCK_NONBLOCK, 1, ALLOW),  # a raw socket needs CAP_NET_RAW: not the filter's to say
    (AF_ALG, 5, 0, EAFNOSUPPORT),
    (0, SOCK_STREAM, 0, EAFNOSUPPORT),  # AF_UNSPEC
    (31, SOCK_STREAM, 0, EAFNOSUPPORT),  # AF_BLUETOOTH
    (44, SOCK_RAW, 0, EAFNOSUPPORT),  # AF_XDP
    (46, SOCK_STREAM, 0, EAFNOSUPPORT),  # AF_MAX today: and anything a later kernel adds
]


@pytest.mark.parametrize(("machine", "entry"), ALL_ENTRIES)
@pytest.mark.parametrize(("domain", "kind", "protocol", "expected"), SOCKET_CASES)
def test_socket_families_are_an_allow_list(machine, entry, domain, kind, protocol, expected):
    _, socket_nr, socketpair_nr, _ = NUMBERS[entry]
    for program in programs(machine):
        assert run(program, ARCH[entry], socket_nr, domain, kind, protocol) == expected
        # socketpair: AF_UNIX alone implements it
        pair = ALLOW if domain & 0xFFFFFFFF == AF_UNIX else EAFNOSUPPORT
        assert run(program, ARCH[entry], socketpair_nr, domain, kind, 0, 0x7FFF0000) == pair


@pytest.mark.parametrize(("machine", "entry"), [("x86_64", "i386"), ("aarch64", "arm")])
def test_socketcall_cannot_make_a_socket(machine, entry):
    # socketcall(call, args*): the family is behind the pointer, so its socket and socketpair
    # subcalls are refused (ENOSYS: use socket(2)); a subcall on a socket the command has passes.
    socketcall = NUMBERS[entry][3]
    for program in programs(machine):
        for call in (1, 8, 21, 100, 1 << 31):  # SOCKET, SOCKETPAIR, past SENDMMSG (20)
            assert run(program, ARCH[entry], socketcall, call, 0x7FFF0000) == ENOSYS, call
        for call in (2, 3, 5, 16, 17, 20):  # BIND, CONNECT, ACCEPT, SENDMSG, RECVMSG, SENDMMSG
            assert run(program, ARCH[entry], socketcall, call, 0x7FFF0000) == ALLOW, call
    # x86-64's 102 is getuid, aarch64's is getitimer: nothing to do with sockets
    assert run(seccomp._program(machine), ARCH[machine], 102, 1, 0) == ALLOW


@pytest.mark.parametrize(("machine", "entry"), ALL_ENTRIES)
def test_clone3_refused_so_libc_falls_back_to_clone(machine, entry):
    # clone3's flags (CLONE_INTO_CGROUP) are behind a pointer; clone's are not, and it has none such.
    clone = {"x86_64": 56, "i386": 120, "aarch64": 220, "riscv64": 220, "arm": 120}[entry]
    for program in programs(machine):
        assert run(program, ARCH[entry], 435, 0x7FFF0000, 88) == ENOSYS
        assert run(program, ARCH[entry], clone, 0x01200011, 0) == ALLOW  # fork's flags


@pytest.mark.parametrize("machine", sorted(ENTRIES))
def test_calls_not_looked_at_are_allowed_in_few_steps(machine):
    # The search sends every number the filter does not look at to ALLOW, whatever its arguments,
    # in a bounded path (the kernel before 5.11 runs the filter on every call).
    program = seccomp._program(machine)
    for entry in ENTRIES[machine]:
        table = next(t for t in seccomp._TABLES[machine] if t.arch == ARCH[entry])
        looked_at = seccomp._calls(table)
        for nr in [*range(0, 600), 1000, 0x3FFFFFFF]:
            if nr in looked_at:
                continue
            verdict, steps = trace(program, ARCH[entry], nr, 40, 0x5412, 0o4755, 0o100, -1, -1)
            assert verdict == ALLOW, (entry, nr)
            assert steps <= 11, (entry, nr, steps)  # seccomp.py's docstring says so


@pytest.mark.parametrize("machine", sorted(ENTRIES))
def test_every_table_assembles_within_jump_range(machine):
    program = seccomp._program(machine)
    assert len(program) < 256 and all(jt < 256 and jf < 256 for _, jt, jf, _ in program)


HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
           "i386": "/usr/include/x86_64-linux-gnu/asm/unistd_32.h",
           "aarch64": "/usr/include/asm-generic/unistd.h"}


@pytest.mark.parametrize("entry", sorted(HEADERS))
def test_numbers_match_the_kernel_headers(entry):
    # An independent source for the tables: the installed kernel headers (linux-libc-dev).
    path = Path(HEADERS[entry])
    if not path.exists():
        pytest.skip(f"{path} is not installed (linux-libc-dev)")
    found = dict(re.findall(r"#define __NR_(\w+)\s+(\d+)", path.read_text()))
    machine = {"i386": "x86_64"}.get(entry, entry)
    table = next(t for t in seccomp._TABLES[machine] if t.arch == ARCH[entry])
    names = {"ioctl": table.ioctl, "socket": table.socket, "socketpair": table.socketpair, "add_key": table.add_key,
             "request_key": table.request_key, "keyctl": table.keyctl, "clone3": seccomp.CLONE3,
             "openat2": seccomp._OPENAT2, "io_uring_setup": seccomp.IO_URING[0], "io_uring_enter": seccomp.IO_URING[1],
             "io_uring_register": seccomp.IO_URING[2]}
    if table.socketcall is not None:
        names["socketcall"] = table.socketcall
    for name, nr in names.items():
        assert int(found[name]) == nr, name
