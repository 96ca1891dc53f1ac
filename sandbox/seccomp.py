"""The command's seccomp filter: kernel interfaces the sandbox does not grant, refused by name.

What it refuses, and why each:

* Typing into a terminal it shares. `ioctl(fd, TIOCSTI, &c)` pushes a byte into a terminal's
  *input*: a command that keeps the caller's terminal can queue `touch ../PWNED\\n` for the
  caller's shell to run after the sandbox ends, outside every namespace, or answer egress's own
  "Allow for this run?" question. The kernel checks only that the terminal is the caller's
  controlling terminal (`dev.tty.legacy_tiocsti = 1`, the default before Linux 6.2 and still
  common), which it is. `TIOCLINUX` subcommands paste the console's selection into its input the
  same way. A new session (setsid) would also stop TIOCSTI, but it takes the terminal away: no job
  control, no /dev/tty for password prompts, Ctrl-C no longer reaches the command. The filter
  (Flatpak's approach) keeps the terminal usable and refuses just these two requests, with EPERM,
  as a kernel with `legacy_tiocsti = 0` would.
* Kernel keyrings: `keyctl`, `add_key`, `request_key`, EPERM (Docker's default profile does the
  same). Keyrings are in no namespace: the caller's user keyring (`_uid.N`) stays reachable by
  serial from inside, so a command could link it into its own session keyring, read every key in
  it (Kerberos caches, cached passwords) and plant keys that outlive the run (red-team N2). Joining
  a new session keyring (sandbox/namespaces.py) only removes possession; this removes the calls.
* Socket families outside an allow list, EAFNOSUPPORT (what a kernel without the family says, so
  programs fall back). A family is a kernel subsystem with its own reach: AF_VSOCK shares the
  host's port space whatever the network namespace (red-team N10), AF_PACKET, AF_ALG, AF_BLUETOOTH,
  AF_XDP... are code the command has no use for. `socket()` is allowed for:
    - AF_UNIX: pipes between the command's own processes (socketpair, asyncio, libuv), its own
      servers; host listeners are kept out by the mount view (sandbox/mounts.py), not here;
    - AF_INET, AF_INET6: the network the sandbox grants (its namespace's loopback and the proxy);
    - AF_NETLINK with protocol NETLINK_ROUTE only: glibc's getaddrinfo with AI_ADDRCONFIG,
      getifaddrs and if_nameindex, `ip`, Go's net.Interfaces and libuv read the namespace's own
      interfaces and addresses through it. Every other netlink protocol (audit, sock_diag, xfrm,
      netfilter, generic, uevents) is refused: `ss` and `ip xfrm` do not work inside.
  `socketpair()` only for AF_UNIX (no other family implements it). AF_INET with SOCK_PACKET is
  refused too: the kernel makes an AF_PACKET socket of it. The family is compared on the low 32
  bits, as the kernel reads it (an int).
  i386's `socketcall` multiplexer passes its arguments behind a pointer the filter cannot read:
  its SOCKET and SOCKETPAIR subcalls (and any subcall number the kernel does not know) are refused
  with ENOSYS, the rest (connect, sendmsg... on a socket the command already has) pass. glibc
  built for kernels from 4.3 on, and musl, make sockets with the direct calls, which are filtered;
  a 32-bit program whose libc makes them through socketcall gets no socket at all.
* `clone3`, ENOSYS. Its flags sit behind a pointer, and one of them, CLONE_INTO_CGROUP, puts the
  child in any cgroup whose `cgroup.procs` the caller could write, read-only mount or not (a root
  caller's command left its CPU, memory and pids limits: red-team N6). glibc (2.34 on: threads,
  posix_spawn) falls back to `clone` on ENOSYS, whose flags a filter can read and which has no
  such flag; `fork()`, musl and Go's runtime use `clone` already (Go's os/exec asks for clone3
  only to place a child in a cgroup, which is what is refused).
* io_uring, ENOSYS: its operations (opens, socket creation, xattrs) are not seen by a filter on
  system calls. Programs told ENOSYS fall back to plain system calls (Docker's default profile
  does the same).
* File modes with S_ISUID or S_ISGID, EPERM, for every caller: the chmod family, and open/creat/
  mknod when they create a file; `openat2`, whose flags sit behind a pointer, ENOSYS (glibc then
  falls back to openat). A root caller's `chmod 4755` would leave a setuid-root program in the
  project, and an unprivileged caller's a program that gives any local account the caller's uid
  (red-team N9). This also refuses setgid folders (`chmod g+s dir`, `cp -a` or `shutil.copytree`
  of one such as Debian's /usr/local/lib/python3.X): a folder inherits its parent's setgid bit
  without a mode, which stays allowed.

Details that matter (each a past escape in another sandbox):
* arguments are compared on their low 32 bits only: the kernel truncates `cmd`, modes, flags and
  the socket family to an int, so a filter comparing 64 bits is passed by `TIOCSTI | 1 << 32`
  (Flatpak CVE-2019-10063);
* every architecture the CPU can run is covered: on x86-64 a 32-bit program enters through the
  i386 table (ioctl is 54 there) and x32 through numbers with bit 30 set (refused outright: no
  distribution ships x32 programs); any other architecture value fails.

Cost: the kernel (5.11 on) remembers, per table, each system call whose answer cannot depend on its
arguments and skips the filter for it; only the calls looked at here (ioctl, the opens, chmod,
socket...) run it. Each table finds the number by a binary search, so on older kernels a call
passes at most 11 instructions (up to 20 before, one comparison after another). Measured in a
sandbox on Linux 6.18 (2-vCPU VM, C loops, fastest of 11 rounds) against the filter before these
rules: for a root caller, whose filter already looked at the modes, getppid, socket()+close(),
open()+close() and ioctl all 0.99x to 1.01x; for an unprivileged caller, whose opens now go through the
filter, open()+close() 1.06x (~0.2 us here), socket()+close() 1.02x, getppid and ioctl 1.00x. Any
filter at all costs getppid ~60 ns here (the kernel's slower system call path), before as now.

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

# socket families (linux/socket.h), netlink protocols (linux/netlink.h)
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)  # AF_NETLINK: NETLINK_ROUTE only
SOCKETPAIR_FAMILIES = (AF_UNIX,)
_SOCK_TYPE_MASK, _SOCK_PACKET = 0xF, 10
# socketcall(2) subcalls (linux/net.h): the two that make sockets, and the last one there is
_SYS_SOCKET, _SYS_SOCKETPAIR, _SYS_SENDMMSG = 1, 8, 20

SETID_BITS = 0o6000  # S_ISUID | S_ISGID
IO_URING = (425, 426, 427)  # io_uring_setup, _enter, _register: the same number on every table
CLONE3 = 435  # the same on every table
_OPENAT2 = 437  # the same on every table
_CREATES = 0o100 | 0o20000000  # O_CREAT | __O_TMPFILE: the open flags that make a file with `mode`

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000

# audit architecture values (linux/audit.h)
_ARCH_X86_64, _ARCH_I386, _X32_BIT = 0xC000003E, 0x40000003, 0x40000000
_ARCH_AARCH64, _ARCH_ARM = 0xC00000B7, 0x40000028
_ARCH_RISCV64 = 0xC00000F3


class _Table:
    """One syscall table: the numbers of the calls the filter looks at (the kernel's syscall.tbl
    for the architecture; include/uapi/asm-generic/unistd.h for aarch64 and riscv64)."""

    def __init__(self, arch: int, *, ioctl: int, socket: int, socketpair: int, keys: tuple[int, int, int],
                 modes: list[tuple[int, int, int | None]], socketcall: int | None = None):
        self.arch, self.ioctl, self.socket, self.socketpair = arch, ioctl, socket, socketpair
        self.add_key, self.request_key, self.keyctl = keys
        self.modes, self.socketcall = modes, socketcall


# chmod, fchmod, fchmodat, fchmodat2, creat, open, openat, mknod, mknodat: (nr, mode arg, flags arg)
_GENERIC_MODES = [(52, 1, None), (53, 2, None), (452, 2, None), (56, 3, 2), (33, 2, None)]  # aarch64, riscv64
_I386 = _Table(_ARCH_I386, ioctl=54, socket=359, socketpair=360, keys=(286, 287, 288), socketcall=102,
               modes=[(15, 1, None), (94, 1, None), (306, 2, None), (452, 2, None), (8, 1, None),
                      (5, 2, 1), (295, 3, 2), (14, 1, None), (297, 2, None)])
# arm's socketcall (102) exists for OABI programs only; refused the same way wherever a kernel has it.
_ARM = _Table(_ARCH_ARM, ioctl=54, socket=281, socketpair=288, keys=(309, 310, 311), socketcall=102,
              modes=[(15, 1, None), (94, 1, None), (333, 2, None), (452, 2, None), (8, 1, None),
                     (5, 2, 1), (322, 3, 2), (14, 1, None), (324, 2, None)])
_GENERIC = dict(ioctl=29, socket=198, socketpair=199, keys=(217, 218, 219), modes=_GENERIC_MODES)
_TABLES = {
    "x86_64": [
        _Table(_ARCH_X86_64, ioctl=16, socket=41, socketpair=53, keys=(248, 249, 250),
               modes=[(90, 1, None), (91, 1, None), (268, 2, None), (452, 2, None), (85, 1, None),
                      (2, 2, 1), (257, 3, 2), (133, 1, None), (259, 2, None)]),
        _I386,
    ],
    "aarch64": [_Table(_ARCH_AARCH64, **_GENERIC), _ARM],
    "riscv64": [_Table(_ARCH_RISCV64, **_GENERIC)],
}

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
_ALU_AND_K = 0x54
_ALLOW = ("ret", _RET_ALLOW)

# where a call goes once its number is known: a shared return, or a shared block that reads arguments
_RETURNS = {"allow": _RET_ALLOW, "eperm": _RET_ERRNO | errno.EPERM, "enosys": _RET_ERRNO | errno.ENOSYS,
            "eafnosupport": _RET_ERRNO | errno.EAFNOSUPPORT}


def native_numbers() -> dict[str, int]:
    """This machine's own numbers of the calls refused outright, for a probe that tries them
    (egress/run/doctor.py): keyctl, add_key, request_key, socket, socketpair, clone3."""
    table = _TABLES[os.uname().machine][0]
    return {"keyctl": table.keyctl, "add_key": table.add_key, "request_key": table.request_key,
            "socket": table.socket, "socketpair": table.socketpair, "clone3": CLONE3}


def _calls(table: _Table) -> dict[int, str]:
    """Each number the filter looks at in this table, and the label it goes to."""
    calls = {table.ioctl: "ioctl", table.socket: "socket", table.socketpair: "socketpair",
             table.add_key: "eperm", table.request_key: "eperm",
             table.keyctl: "eperm",
             CLONE3: "enosys", _OPENAT2: "enosys", **{nr: "enosys" for nr in IO_URING}}
    if table.socketcall is not None:
        calls[table.socketcall] = "socketcall"
    for nr, mode_arg, flags_arg in table.modes:
        calls[nr] = f"mode-{mode_arg}-{flags_arg}"
    return calls


def _search(calls: list[tuple[int, str]], name: str) -> list[tuple]:
    """Find the loaded number among sorted `calls`: jge halves the list, a short jeq run ends it.

    About log2(n) + 3 instructions for any number; one that is not listed is allowed."""
    if len(calls) <= 3:
        return [("jeq", nr, label, None) for nr, label in calls] + [_ALLOW]
    half = len(calls) // 2
    upper = f"{name}>"
    return ([("jge", calls[half][0], upper, None)] + _search(calls[:half], name + "<")
            + [("label", upper)] + _search(calls[half:], upper))


def _program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions.

    load arch -> the table's block, or ENOSYS for an architecture this machine cannot enter; in a
    block: x86-64's x32 numbers -> ENOSYS; the system call number found by a binary search -> a
    shared return, or a shared block that reads its arguments (ioctl's request, socket's family,
    a mode); a number not looked at -> allowed. Blocks and returns are shared by every table, so
    the program grows by one search per table (each jump stays within classic BPF's 255).
    """
    code: list[tuple] = [("ld", _OFF_ARCH)]
    tables = _TABLES[machine]
    for i, table in enumerate(tables):
        code.append(("jeq", table.arch, f"table{i}", None))
    code.append(("ret", _RETURNS["enosys"]))
    for i, table in enumerate(tables):
        code += [("label", f"table{i}"), ("ld", _OFF_NR)]
        if table.arch == _ARCH_X86_64:
            code.append(("jge", _X32_BIT, "enosys", None))
        code += _search(sorted(_calls(table).items()), f"t{i}")
    # the blocks that read arguments; each ends in a shared return
    code += [("label", "ioctl"), ("ld", _arg_low(1))]
    code += [("jeq", request, "eperm", None) for request in REFUSED_IOCTLS] + [_ALLOW]
    code += [("label", "socket"), ("ld", _arg_low(0)), ("jeq", AF_INET, "inet", None)]
    code += [("jeq", family, "allow", None) for family in SOCKET_FAMILIES if family != AF_INET]
    code += [("jeq", AF_NETLINK, None, "eafnosupport"), ("ld", _arg_low(2)),
             ("jeq", NETLINK_ROUTE, "allow", "eafnosupport")]
    # The kernel turns (AF_INET, SOCK_PACKET) into AF_PACKET (its type without SOCK_NONBLOCK/CLOEXEC).
    code += [("label", "inet"), ("ld", _arg_low(1)), ("and", _SOCK_TYPE_MASK),
             ("jeq", _SOCK_PACKET, "eafnosupport", "allow")]
    code += [("label", "socketpair"), ("ld", _arg_low(0))]
    code += [("jeq", family, "allow", None) for family in SOCKETPAIR_FAMILIES] + [("ret", _RETURNS["eafnosupport"])]
    code += [("label", "socketcall"), ("ld", _arg_low(0)), ("jeq", _SYS_SOCKET, "enosys", None),
             ("jeq", _SYS_SOCKETPAIR, "enosys", None), ("jge", _SYS_SENDMMSG + 1, "enosys", "allow")]
    for mode_arg, flags_arg in sorted({(m, f) for t in tables for _, m, f in t.modes}, key=str):
        code.append(("label", f"mode-{mode_arg}-{flags_arg}"))
        if flags_arg is not None:  # open/openat: only a creating open takes a mode
            code += [("ld", _arg_low(flags_arg)), ("jset", _CREATES, None, "allow")]
        code += [("ld", _arg_low(mode_arg)), ("jset", SETID_BITS, "eperm", "allow")]
    for label, value in _RETURNS.items():
        code += [("label", label), ("ret", value)]
    return _assemble(code)


def _assemble(code: list[tuple]) -> list[tuple[int, int, int, int]]:
    """Resolve labels into relative jumps (None: the next instruction)."""
    at: dict[str, int] = {}
    count = 0
    for item in code:
        if item[0] == "label":
            if item[1] in at:
                raise ValueError(f"seccomp label {item[1]} defined twice")
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
        elif kind == "and":
            program.append((_ALU_AND_K, 0, 0, item[1]))
        else:
            op = {"jeq": _JEQ_K, "jge": _JGE_K, "jset": _JSET_K}[kind]
            jt = 0 if item[2] is None else at[item[2]] - here
            jf = 0 if item[3] is None else at[item[3]] - here
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise ValueError("seccomp jump out of range")
            program.append((op, jt, jf, item[1]))
    return program


def install() -> None:
    """Install the filter on the calling thread (and so on everything it later runs).

    Call it after joining the command's new session keyring: keyctl is refused from here on.
    Raises OSError if the kernel refuses it or the machine's architecture is not known.
    """
    machine = os.uname().machine  # platform.machine()'s answer, without importing platform (~2 ms)
    if machine not in _TABLES:
        raise OSError(errno.ENOSYS, f"no seccomp filter for the {machine} architecture")
    program = _program(machine)
    raw = struct.pack("HBBI" * len(program), *(field for ins in program for field in ins))  # struct sock_filter[]
    buffer = ctypes.create_string_buffer(raw, len(raw))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }
    fprog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog_buffer))
