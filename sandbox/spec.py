"""What every platform's sandbox is asked for, and how it refuses: shared by sandbox/linux.py and
sandbox/macos.py (the launcher's interface to both is sandbox/platforms.py).

Nothing heavy is imported: sandbox/linux.py reads this on the path of every `egress run`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from egress.core.contract import EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND


class SandboxError(Exception):
    """The sandbox could not be made or the command could not be started; nothing ran.

    `code` is the exit status a launcher should use (EXIT_LAUNCHER, EXIT_CANNOT_EXECUTE,
    EXIT_NOT_FOUND); `kind` names the failing step; str(error) is one line for a person.
    """

    def __init__(self, code: int, message: str, kind: str = "sandbox") -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind


class SandboxSpec:
    """What to run and how it is confined. Paths are made absolute against the caller's cwd.

    argv: the command; argv[0] is looked up on env["PATH"] (after entering cwd) unless it has a "/".
    env: the command's whole environment (nothing is inherited).
    writable: trees the command may modify (must exist); /dev/null, ttys, a private /dev/shm are added.
    read_only: folders inside the writable trees that the command may not change (egress's own code).
    readable: folders and files shown read-only besides what the sandbox grants itself
        (sandbox/grants.py; `egress run --read`); the caller's own interpreter trees (sys.prefix,
        base_prefix) always are: a venv under /tmp stays runnable.
    hidden: folders the command sees empty (egress's state: control sockets, the CA's key).
    replaced: files the command sees with other contents (secret files -> their placeholders).
    placeholders: names of the variables in env that hold a brokered secret's placeholder; a
        sandbox that builds the command's environment afresh (a container) passes these on.
    network: hand over a listening socket on 127.0.0.1:proxy_port inside; with False the
        command still gets a fresh network namespace with only `lo`.
    capture: with network, capture every other road out too (Linux, sandbox/capture.py): routes
        to `lo`, nftables redirects, and the capture's sockets handed over (Sandbox.capture).
    fs_confinement: apply Landlock and show the host read-only with /tmp, /var/tmp masked; if
        False the command may write wherever its uid may (/run and host sockets stay masked).
    stdin, stdout, stderr: file descriptors for the command's 0, 1, 2 (None: the caller's).
    allow_hooks: let the command change the files at the top of each writable tree that run later,
        outside the sandbox (sandbox/protected.py: git hooks and config, editor folders, .envrc);
        by default they are read-only inside (Linux) or unwritable (macOS).
    abandoned: folders the sandbox removes itself if the caller dies before the command has
        ended (the run's temporary folder): a launcher killed with SIGKILL leaves nothing.
    socket_dirs: folders where the command may bind and reach Unix sockets of its own (macOS,
        where Seatbelt decides per path: the run's private folder; on Linux the command's own
        view of the filesystem decides, and this is not needed).

    On macOS (sandbox/macos.py) the same fields mean the same, with three differences that
    Seatbelt imposes: hidden folders and replaced files are unreadable and unwritable (a
    profile cannot show other contents), everything is readable (`readable` names where code
    may be mapped besides the system's and the toolchains'), and the network is outbound to
    127.0.0.1:proxy_port only, on the host's own loopback.
    """

    __slots__ = ("argv", "env", "cwd", "writable", "network", "proxy_port", "fs_confinement",
                 "read_only", "readable", "hidden", "replaced", "stdin", "stdout", "stderr", "socket_dirs",
                 "capture", "placeholders", "allow_hooks", "abandoned")

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        writable: Sequence[str] = (),
        network: bool = True,
        proxy_port: int = 3128,
        fs_confinement: bool = True,
        read_only: Sequence[str] = (),
        readable: Sequence[str] = (),
        hidden: Sequence[str] = (),
        replaced: Mapping[str, bytes] | None = None,
        stdin: int | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        socket_dirs: Sequence[str] = (),
        capture: bool = False,
        placeholders: Sequence[str] = (),
        allow_hooks: bool = False,
        abandoned: Sequence[str] = (),
    ) -> None:
        if not argv:
            raise ValueError("argv must name a command")
        if not 0 < proxy_port < 65536:
            raise ValueError(f"proxy_port out of range: {proxy_port}")
        self.argv = [os.fsdecode(a) for a in argv]
        self.env = {str(k): str(v) for k, v in env.items()}
        self.cwd = os.path.abspath(cwd)
        self.writable = [os.path.abspath(p) for p in writable]
        self.network = bool(network)
        self.capture = bool(capture) and self.network
        self.proxy_port = int(proxy_port)
        self.fs_confinement = bool(fs_confinement)
        self.read_only = [os.path.abspath(p) for p in read_only]
        self.readable = list(dict.fromkeys(os.path.abspath(p) for p in (*readable, *interpreter_trees())))
        self.hidden = [os.path.abspath(p) for p in hidden]
        self.replaced = {os.path.abspath(p): bytes(v) for p, v in (replaced or {}).items()}
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.socket_dirs = [os.path.abspath(p) for p in socket_dirs]
        self.placeholders = [str(name) for name in placeholders]
        self.allow_hooks = bool(allow_hooks)
        self.abandoned = [os.path.abspath(p) for p in abandoned]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__ if k not in ("env", "replaced"))
        return f"SandboxSpec({fields}, env=<{len(self.env)} variables>, replaced=<{len(self.replaced)} files>)"


def interpreter_trees() -> list[str]:
    """The caller's own interpreter: its prefixes, and the folder of its executable (with the
    virtual environment around it: under `python -S` sys.prefix does not name the venv)."""
    trees = [sys.prefix, sys.exec_prefix, sys.base_prefix]
    if sys.executable:
        folder = os.path.dirname(sys.executable)
        venv = os.path.dirname(folder)
        trees.append(venv if os.path.isfile(os.path.join(venv, "pyvenv.cfg")) else folder)
    return trees


def find_program(name: str, env: Mapping[str, str], cwd: str | None = None) -> str:
    """Resolve argv[0] as execvp would (relative to ``cwd``, else the current folder), with 126/127
    failures worded like a shell's (SandboxError)."""
    # Not os.get_exec_path: it enters warnings.catch_warnings, which is slow for what it does.
    search = env.get("PATH", os.defpath).split(os.pathsep)
    candidates = [name] if "/" in name else [os.path.join(d or ".", name) for d in search]
    if cwd is not None:  # relative candidates as a process started in cwd would find them
        candidates = [os.path.join(cwd, path) for path in candidates]
    refused = None
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
        if os.path.exists(path) and refused is None:
            refused = path
    if refused is not None:
        why = "is a directory" if os.path.isdir(refused) else "permission denied"
        raise SandboxError(EXIT_CANNOT_EXECUTE, f"cannot execute {refused}: {why}", "exec")
    if "/" in name:
        raise SandboxError(EXIT_NOT_FOUND, f"{name}: no such file", "exec")
    raise SandboxError(EXIT_NOT_FOUND, f"{name}: command not found (PATH={env.get('PATH', os.defpath)})", "exec")
