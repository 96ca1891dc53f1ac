"""The platform layer's seams, typed: what `egress run` may use of a platform, of the box it starts
and of the listener it is told about.

    platform.refusal()            None, or why egress run cannot confine a command here (status 125)
    platform.warning              None, or a sentence said before anything runs (--provider local)
    platform.warm                 whether the run's proxy may be the warm per-user proxy's child
    platform.capture              whether the box hands over the transparent capture's sockets
    platform.holds_until_ready    start() returns before the command can run, and box.ready() lets
                                  it: files it will read may be written in between
    listener = platform.listener(networked)
                                  where the run's proxy listens, as the command is told
    platform.environment(tmpdir)  variables this platform's commands need on top of the matrix
    platform.writable_elsewhere() host folders the command can write besides the spec's writable
                                  trees (a container's `--mount SRC:DST:rw`)
    box = platform.start(spec, listener)
                                  the command starting; box.ready() returns once it has started
                                  (raises SandboxError); then box.listen_socket, box.capture,
                                  wait(timeout), signal(sig), direct_attempts(), close()

The implementations: sandbox/platforms.py (Linux, MacOS, Unsupported), sandbox/providers.py (Local)
and sandbox/container.py (Container); each inherits platforms.BasePlatform, which gives every
optional member its default, and each box inherits sandbox/box.py's BaseBox.
tests/sandbox/test_conformance.py holds every one to the same promises.

Protocols only, for readers, mypy and the tests: nothing on `egress run`'s start-up path imports
this module, because `typing` is not otherwise imported there.
"""

from __future__ import annotations

import socket
from typing import Protocol, runtime_checkable

from sandbox.spec import SandboxSpec


@runtime_checkable
class Listener(Protocol):
    """Where the run's proxy listens, as its command is told (platforms.Listener)."""

    port: int
    socket: socket.socket | None  # made by the platform; None: the box makes it (Linux, containers)
    secret: str | None  # what the proxy asks for; None: nobody but the command can reach it

    @property
    def url(self) -> str: ...

    @property
    def auth(self) -> tuple[str, str] | None: ...

    def close(self) -> None: ...


@runtime_checkable
class Box(Protocol):
    """A started command, its confinement and what it holds (the listening socket, the capture's)."""

    pid: int | None
    returncode: int | None
    listen_socket: socket.socket | None
    capture: list[tuple[str, socket.socket]]  # (tag, socket): sandbox/capture.py's; [] without
    capture_error: str | None  # why the capture could not be set up (the run goes on without)

    def ready(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def signal(self, sig: int) -> None: ...

    def direct_attempts(self) -> int | None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Box: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Platform(Protocol):
    """A sandbox egress run can hold a command in (one per --provider)."""

    name: str
    warm: bool
    capture: bool
    warning: str | None
    holds_until_ready: bool

    def refusal(self) -> str | None: ...

    def listener(self, networked: bool) -> Listener: ...

    def environment(self, tmpdir: str) -> dict[str, str]: ...

    def writable_elsewhere(self) -> list[str]: ...

    def start(self, spec: SandboxSpec, listener: Listener) -> Box: ...
