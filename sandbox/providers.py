"""`egress run --provider NAME`: which sandbox holds the command (the launcher's interface is
sandbox/api.py's; each provider here is one more implementation of it).

    namespace  Linux's own launcher (sandbox/linux.py), the default on Linux
    seatbelt   macOS's (sandbox/macos.py), the default on macOS
    podman     a hardened container (sandbox/container.py) in a network namespace egress made
    docker     the same through Docker Engine (a root daemon): the namespace is a holder
               container's, set up by egress (as root) from inside
    local      no sandbox: the command runs as itself with the proxy variables; said first

The container providers reuse the namespace launcher's code for the network: the namespace with
only `lo`, the proxy's socket and the transparent capture are made exactly as for `namespace`,
and the container joins it (podman's `--network ns:PATH`; docker's `--network container:HOLDER`),
so the proxy is its only road out.
"""

from __future__ import annotations

import sys

from sandbox import platforms
from sandbox.spec import find_program

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from sandbox import api
    from sandbox.api import Box
    from sandbox.container import ContainerSpec
    from sandbox.spec import SandboxSpec

PROVIDERS = ("namespace", "seatbelt", "podman", "docker", "local")
CONTAINER_ENGINES = ("podman", "docker")

# Said before anything runs, on stderr, for `egress run --provider local` (and by egress doctor).
LOCAL_WARNING = ("egress: --provider local is NOT a sandbox: the command runs as you, with the proxy "
                 "variables only; a program that ignores them reaches the network directly, and it can "
                 "write wherever you can")


def select(name: str | None, container: ContainerSpec | None = None,
           platform_name: str | None = None) -> platforms.BasePlatform:
    """The platform (sandbox/api.py's interface) for provider ``name``; None: this
    system's default. ``container``: a sandbox.container.ContainerSpec for podman and docker.
    Raises ValueError with a sentence for a person."""
    system = sys.platform if platform_name is None else platform_name
    if name is None:
        return platforms.for_platform(system)
    if name not in PROVIDERS:
        raise ValueError(f"--provider must be one of {', '.join(PROVIDERS)}, not {name!r}")
    if name == "local":
        return Local()
    if name == "namespace":
        if not system.startswith("linux"):
            return platforms.Unsupported(f"{system} (the namespace provider needs Linux)")
        return platforms.Linux()
    if name == "seatbelt":
        if system != "darwin":
            return platforms.Unsupported(f"{system} (the seatbelt provider needs macOS)")
        return platforms.MacOS()
    from sandbox.container import Container

    if not system.startswith("linux"):
        return platforms.Unsupported(f"{system} (the {name} provider joins a Linux network namespace egress "
                                     f"makes; on macOS the engine's Linux VM is out of egress's reach)")
    return Container(name, container)


class Local(platforms.BasePlatform):
    """No sandbox: the command runs as the caller, with the proxy variables pointing at a proxy on
    127.0.0.1 (a port and a secret made for the run, as on macOS). A client that ignores the
    variables goes around it; nothing confines writes. For trusted commands and for trying a policy."""

    name = "local"
    warm = False  # the warm proxy takes sockets from sandboxes whose peers it can check
    warning: str | None = LOCAL_WARNING

    def listener(self, networked: bool) -> platforms.Listener:
        return platforms.loopback_listener(networked)

    def start(self, spec: SandboxSpec, listener: api.Listener) -> Box:
        from sandbox import macos

        program = find_program(spec.argv[0], spec.env, spec.cwd)
        launch = macos.Launch([program, *spec.argv[1:]], dict(spec.env), spec.cwd, "", program)
        return macos.start_in_group(launch, spec, listener, program)
