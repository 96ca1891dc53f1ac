"""The holder of a Docker container's namespaces: a static program of 71 bytes of machine code
that waits, and the one-file image that carries it.

Docker Engine's `--network` takes no namespace path (`ns:PATH` is podman's), so for
`--provider docker` the engine makes the namespace: egress starts a holder container with
`--network none`, enters its network namespace to set it up as its own (sandbox/linux.py's
enter_network: `lo`, the proxy's socket, the capture), and the command's container joins it with
`--network container:HOLDER --pid container:HOLDER` (sandbox/container.py).

Why a program of our own: the holder must run on any Docker whatever the user's image holds (a
distroless image has no `sleep`), and no registry may be reachable to pull a pause image. It is
written here as bytes because egress ships no compiled code: the x86_64 listing is beside them
(assembled with GNU as, `objdump -d` checked against the bytes).

What it does, as PID 1 of the PID namespace the command's container joins:

    loop: wait4(-1, NULL, WNOHANG, NULL) while it reaps a child   (orphans of the command land here)
          poll({fd 0, POLLIN}, 1, 1000 ms)
          if stdin is readable, closed or hung up: exit_group(0)

Its stdin is a pipe from egress (`docker run -i`, attached: the engine closes the container's
stdin when its client's ends). When egress ends, however it ends, SIGKILL included, the pipe
closes, the holder exits, and the kernel kills every process left in its PID namespace: the
command's container cannot outlive the run, and Docker's `--rm` removes both.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import tarfile

PROGRAM = "/hold"
IMAGE_NAME = "localhost/egress-holder"

# x86_64 (System V syscall numbers: wait4 61, poll 7, exit_group 231)
_X86_64 = bytes.fromhex(
    "bfffffffff"            # reap:  mov edi, -1            pid: any child
    "31f6"                  #        xor esi, esi           status: NULL
    "ba01000000"            #        mov edx, 1             WNOHANG
    "4531d2"                #        xor r10d, r10d         rusage: NULL
    "b83d000000"            #        mov eax, 61            wait4
    "0f05"                  #        syscall
    "85c0"                  #        test eax, eax
    "7fe6"                  #        jg reap                one reaped: maybe more
    "48b80000000001000000"  #        mov rax, 0x100000000   struct pollfd {fd 0, events POLLIN}
    "50"                    #        push rax
    "4889e7"                #        mov rdi, rsp
    "be01000000"            #        mov esi, 1             one descriptor
    "bae8030000"            #        mov edx, 1000          ms
    "b807000000"            #        mov eax, 7             poll
    "0f05"                  #        syscall
    "59"                    #        pop rcx
    "85c0"                  #        test eax, eax
    "7ec2"                  #        jle reap               timeout or EINTR: again
    "31ff"                  #        xor edi, edi
    "b8e7000000"            #        mov eax, 231           exit_group(0)
    "0f05"                  #        syscall
)
_CODE = {"x86_64": (62, _X86_64)}  # machine (uname) -> (ELF e_machine, code)
_BASE = 0x400000


class Unsupported(Exception):
    pass


def program(machine: str | None = None) -> bytes:
    """A static ELF executable: one header, one loadable read+execute segment, the code."""
    machine = machine or os.uname().machine
    if machine not in _CODE:
        raise Unsupported(f"the docker provider's holder program exists for {', '.join(_CODE)}, "
                          f"not {machine}")
    e_machine, code = _CODE[machine]
    headers = 64 + 56
    size = headers + len(code)
    elf = struct.pack("<4sBBBBB7xHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0,  # 64-bit, little-endian, SysV
                      2, e_machine, 1, _BASE + headers, 64, 0, 0, 64, 56, 1, 0, 0, 0)  # ET_EXEC, entry, 1 phdr
    segment = struct.pack("<IIQQQQQQ", 1, 5, 0, _BASE, _BASE, size, size, 0x1000)  # PT_LOAD, R+X, whole file
    return elf + segment + code


def image_tag(machine: str | None = None) -> str:
    """The image's name: named by its content, so another program is another image."""
    return f"{IMAGE_NAME}:{hashlib.sha256(program(machine)).hexdigest()[:12]}"


def image_tarball(machine: str | None = None) -> bytes:
    """The image's root filesystem for `ENGINE import`: the program alone, root's, mode 555."""
    data = program(machine)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(PROGRAM.lstrip("/"))
        info.size, info.mode, info.mtime = len(data), 0o555, 0
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
