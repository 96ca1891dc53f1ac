"""Which sandbox `egress run` uses: one interface (sandbox/api.py types it), a Linux and a macOS
implementation behind it, and the members they share.

The launcher (egress/run/launcher.py) and the CLI know no platform; they ask :func:`current` (or
are handed one: tests choose ``MacOS(sandbox_exec=...)`` explicitly), or sandbox/providers.py's
select() for --provider, and use only what sandbox/api.py's Platform, Box and Listener name.
Every platform inherits :class:`BasePlatform`, so the optional members (warning,
holds_until_ready, writable_elsewhere(), environment()) always exist, with their defaults.

Linux: the listening socket is made inside the command's own network namespace, where nobody
else can reach it, on a fixed port (sandbox/linux.py). macOS: no network namespaces, so the
launcher listens on 127.0.0.1 on a port picked for the run, the Seatbelt profile lets the command
reach that port only, and the proxy asks for a secret made for the run (egress.proxy.auth), since
any program on the machine can find the port (sandbox/macos.py; :func:`loopback_listener`).
Elsewhere (Windows, the BSDs) no OS sandbox is used, so egress run refuses: a proxy the command
could go around is no allowlist.
"""

from __future__ import annotations

import os
import socket

from egress.core.contract import PROXY_USER

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from collections.abc import Iterable

    from sandbox import api
    from sandbox.api import Box
    from sandbox.spec import SandboxSpec

LINUX_PROXY_PORT = 3128  # inside the command's own network namespace, where every port is free
SANDBOX_EXEC = "/usr/bin/sandbox-exec"  # the absolute path: never one found on a PATH the caller controls


class Listener:
    """Where the run's proxy listens, as its command is told."""

    __slots__ = ("port", "socket", "secret", "guards")

    def __init__(self, port: int, sock: socket.socket | None = None, secret: str | None = None,
                 guards: Iterable[socket.socket] = ()):
        self.port = port
        self.socket = sock  # made here (macOS); None: the sandbox makes it (Linux)
        self.secret = secret  # the proxy asks for it (egress.proxy.auth); None: nobody else can reach it
        self.guards = list(guards)  # sockets that only hold the port elsewhere on loopback (macOS)

    @property
    def url(self) -> str:
        if self.secret is None:
            return f"http://127.0.0.1:{self.port}"
        return f"http://{PROXY_USER}:{self.secret}@127.0.0.1:{self.port}"

    @property
    def auth(self) -> tuple[str, str] | None:
        """(user, password) the run's proxy must ask for (egress.proxy.config.ProxyConfig.auth)."""
        if self.secret is None:
            return None
        return PROXY_USER, self.secret

    def close(self) -> None:
        for sock in (self.socket, *self.guards):
            if sock is not None:
                sock.close()


def loopback_listener(networked: bool) -> Listener:
    """A port on the host's 127.0.0.1 picked for the run, held on ::1 too, and a secret the proxy
    asks for (anyone on the machine can find the port): macOS's and --provider local's listener.
    Port 0 and no socket without network. Raises OSError when no port could be held."""
    import secrets

    if not networked:
        return Listener(0)
    error: OSError | None = None
    for _ in range(8):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))  # a port picked for the run: the profile names it
            sock.listen(1024)
            port = sock.getsockname()[1]
            # The profile's "localhost:PORT" is ::1 too: hold that port there, so no other
            # program can listen where the command may connect (a bound socket refuses).
            guards = _hold_port("::1", port, socket.AF_INET6)
        except OSError as e:
            sock.close()
            error = e
            continue
        # 32 random bytes as URL-safe text: nothing a proxy URL would need to escape
        return Listener(port, sock, secrets.token_urlsafe(32), guards)
    assert error is not None
    raise error


class BasePlatform:
    """What every platform has, with the defaults of the optional members (sandbox/api.py's
    Platform names them all). A platform sets name and overrides listener() and start()."""

    name = ""
    warm = False  # the run's proxy may be the warm per-user proxy's child
    capture = False  # the box hands over the transparent capture's sockets (sandbox/capture.py)
    warning: str | None = None  # said on stderr before anything runs (--provider local)
    holds_until_ready = False  # start() returns first; the command runs at box.ready()

    def refusal(self) -> str | None:
        return None

    def listener(self, networked: bool) -> Listener:
        raise NotImplementedError

    def environment(self, tmpdir: str) -> dict[str, str]:
        return {}

    def writable_elsewhere(self) -> list[str]:
        """Host folders the command can write besides the spec's writable trees."""
        return []

    def start(self, spec: SandboxSpec, listener: api.Listener) -> Box:
        raise NotImplementedError


class Linux(BasePlatform):
    name = "linux"
    warm = True
    # start() returns while the sandbox is made and holds the command back until box.ready(): the
    # launcher writes the files the command's environment names meanwhile (sandbox/linux.py).
    holds_until_ready = True
    capture = True  # every other road out of the namespace leads to egress (sandbox/capture.py)
    # refusal(): none; what the kernel refuses, sandbox/linux.py says when it starts

    def listener(self, networked: bool) -> Listener:
        return Listener(LINUX_PROXY_PORT)

    def start(self, spec: SandboxSpec, listener: api.Listener) -> Box:
        from sandbox.linux import begin

        return begin(spec)


class MacOS(BasePlatform):
    """Seatbelt through /usr/bin/sandbox-exec (sandbox/macos.py, sandbox/seatbelt.py).

    ``sandbox_exec``: the program that applies the profile; tests on Linux pass a stand-in that
    records what it was given and runs the command, so every step up to that process is real.
    """

    name = "darwin"
    # The warm proxy forks a child per run from a server that has imported everything: on macOS a
    # fork of a process that has loaded system frameworks (Python's own _scproxy reads the proxy
    # settings through them) is unsafe, and its peer checks (SO_PEERCRED, user namespaces, pidfds)
    # are Linux's. So a macOS run's proxy is the in-process one, started when the command first
    # connects (a command that never connects never pays for it).
    warm = False
    capture = False  # no redirect in a Seatbelt profile: other roads are refused (EPERM), unnamed

    def __init__(self, sandbox_exec: str = SANDBOX_EXEC):
        self.sandbox_exec = sandbox_exec

    def refusal(self) -> str | None:
        if not os.access(self.sandbox_exec, os.X_OK):
            return (f"{self.sandbox_exec} is missing, so the allowlist cannot be enforced here; "
                    f"egress serve still works (point the command's HTTPS_PROXY at it)")
        return None

    def listener(self, networked: bool) -> Listener:
        return loopback_listener(networked)

    def environment(self, tmpdir: str) -> dict[str, str]:
        # macOS's python3 writes bytecode under ~/Library/Caches, which the command cannot write.
        return {"PYTHONPYCACHEPREFIX": os.path.join(str(tmpdir), "cache", "pycache")}

    def start(self, spec: SandboxSpec, listener: api.Listener) -> Box:
        from sandbox.macos import start

        return start(spec, listener, self.sandbox_exec)


def _hold_port(host: str, port: int, family: int) -> list[socket.socket]:
    """A socket bound (not listening) to host:port; [] where that address does not exist. Raises
    OSError when someone else has the port there (the caller picks another)."""
    import errno

    guard = socket.socket(family, socket.SOCK_STREAM)
    try:
        guard.bind((host, port))
    except OSError as e:
        guard.close()
        if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return []
        raise
    return [guard]


class Unsupported(BasePlatform):
    """A system without an OS sandbox egress can use: egress run refuses (status 125)."""

    def __init__(self, name: str):
        self.name = name

    def refusal(self) -> str:
        return (f"egress run cannot enforce the allowlist on {self.name}: it has no OS sandbox egress can use "
                f"(Linux namespaces, macOS Seatbelt), and a proxy a command can go around is no allowlist; "
                f"egress serve works here (point the command's HTTPS_PROXY at it)")

    def listener(self, networked: bool) -> Listener:
        raise RuntimeError(self.refusal())

    def start(self, spec: SandboxSpec, listener: api.Listener) -> Box:
        raise RuntimeError(self.refusal())


def for_platform(name: str) -> BasePlatform:
    """The implementation for ``sys.platform`` value ``name``."""
    if name.startswith("linux"):
        return Linux()
    if name == "darwin":
        return MacOS()
    return Unsupported({"win32": "Windows", "cygwin": "Windows (Cygwin)"}.get(name, name))


def current() -> BasePlatform:
    import sys

    return for_platform(sys.platform)
