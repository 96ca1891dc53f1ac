"""`egress run --provider podman|docker --image IMAGE -- CMD`: the command in a hardened container
whose only road out is egress.

    box = Container("podman", ContainerSpec("localhost/tools:1")).start(spec, listener)

How: the namespace launcher (sandbox/linux.py) makes its network namespace exactly as for
`--provider namespace` (only `lo`, the proxy's listening socket made inside and handed out, the
transparent capture's redirects), with a small holder process in it; the engine then runs the
container with ``--network ns:/proc/HOLDER/ns/net``, so the container shares that namespace and
nothing else: the proxy socket is its only road out, and a client that ignores the proxy
variables is captured as in the namespace provider. The engine runs outside, as the caller.

Every container gets HARDENING, whatever the caller passed (the only values a caller sets are
the cpu and memory sizes, and the image). The project is mounted at /work read-write and is the
working folder; --mount adds folders read-only unless `:rw` is written; --persist NAME keeps a
named volume at /persist/NAME. The environment is made here, not inherited: the proxy variables,
the CA bundle (mounted read-only at CA_PATH) under every name clients read, HOME and TMPDIR in
/tmp. Machine-specific engine settings (a runtime, a cgroup manager, default ulimits) are the
engine's own configuration (containers.conf, CONTAINERS_CONF), never egress's flags.

Exit statuses are the engine's, which are the shell's and egress's: the command's own, 125 the
engine failed (nothing ran), 126 not executable, 127 not found; --timeout kills the container
(`ENGINE kill`) and returns 124.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from egress.contract import EXIT_LAUNCHER, EXIT_TIMEOUT
from sandbox.spec import SandboxError, SandboxSpec

WORKDIR = "/work"
CA_PATH = "/etc/egress/ca-bundle.pem"
PERSIST_ROOT = "/persist"
USER = "1000:1000"  # whatever the image says: root in a container is root on a shared kernel
DEFAULT_CPUS = "2"
DEFAULT_MEMORY = "2048m"
# Never conditional on what the caller passed (issue 14): a flag added here holds for every run.
HARDENING = (
    "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges",
    "--pids-limit", "512",
    "--read-only",
    "--tmpfs", "/tmp:rw,exec,nosuid,size=512m",
    "--tmpfs", "/run:rw,nosuid,size=16m",
    "--user", USER,
)
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ContainerSpec:
    """What the caller chose: the image, extra mounts ("SRC:DST[:rw]"), named volumes, sizes."""

    __slots__ = ("image", "mounts", "persist", "cpus", "memory")

    def __init__(self, image: str | None, mounts=(), persist=(), cpus: str | None = None,
                 memory: str | None = None):
        self.image = image
        self.mounts = [parse_mount(m) for m in mounts]
        self.persist = [check_volume(n) for n in persist]
        self.cpus = str(cpus or DEFAULT_CPUS)
        self.memory = str(memory or DEFAULT_MEMORY)

    def __eq__(self, other) -> bool:
        return isinstance(other, ContainerSpec) and all(
            getattr(self, k) == getattr(other, k) for k in self.__slots__)

    def __repr__(self) -> str:
        return "ContainerSpec(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def parse_mount(text: str) -> tuple[str, str, bool]:
    """"SRC:DST[:rw]" -> (absolute SRC, DST, writable). Read-only unless ":rw" is written; ":ro"
    is accepted. Raises ValueError."""
    parts = text.split(":")
    writable = False
    if len(parts) == 3 and parts[2] in ("rw", "ro"):
        writable = parts.pop() == "rw"
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--mount {text!r}: expected SRC:DST or SRC:DST:rw")
    source, target = parts
    if not target.startswith("/"):
        raise ValueError(f"--mount {text!r}: the container path must be absolute")
    if "," in source or "," in target:  # the engine's --mount splits on commas
        raise ValueError(f"--mount {text!r}: paths with commas cannot be mounted")
    if not os.path.exists(source):
        raise ValueError(f"--mount {text!r}: {source} does not exist")
    return os.path.abspath(source), os.path.normpath(target), writable


def check_volume(name: str) -> str:
    """A named volume's name as the engines take it (letters, digits, _.- ; not a path)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name or ""):
        raise ValueError(f"--persist {name!r}: a volume name is letters, digits, '_', '.' and '-'")
    return name


def container_environment(spec_env: dict[str, str]) -> dict[str, str]:
    """The container's environment: the run's proxy and CA variables (the bundle at CA_PATH) and
    the fail-fast settings, nothing else of the caller's."""
    from sandbox import environment

    env = {"PATH": CONTAINER_PATH, "HOME": "/tmp", "TMPDIR": "/tmp"}
    for name in environment.PROXY_VARIABLES + ("NO_PROXY", "no_proxy", "npm_config_noproxy", "NODE_USE_ENV_PROXY"):
        if name in spec_env:
            env[name] = spec_env[name]
    if "HTTPS_PROXY" in spec_env:
        env.update({"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.proxy",
                    "GIT_CONFIG_VALUE_0": spec_env["HTTPS_PROXY"]})
    if "SSL_CERT_FILE" in spec_env:
        env.update({name: CA_PATH for name in environment.CA_VARIABLES})
    env.update(environment.FAIL_FAST)
    if "TERM" in spec_env:
        env["TERM"] = spec_env["TERM"]
    return env


def engine_argv(engine: str, name: str, netns: str | None, spec: SandboxSpec, chosen: ContainerSpec,
                ca_bundle: str | None, interactive: bool = False) -> list[str]:
    """The whole `ENGINE run ...` command line (tests read it)."""
    argv = [engine, "run", "--rm", "--name", name, *HARDENING,
            "--cpus", chosen.cpus, "--memory", chosen.memory, "--memory-swap", chosen.memory,
            "--network", f"ns:{netns}" if netns else "none",
            "--mount", f"type=bind,src={spec.cwd},dst={WORKDIR}", "--workdir", WORKDIR]
    if interactive:
        argv += ["--interactive"]
    if ca_bundle:
        argv += ["--mount", f"type=bind,src={ca_bundle},dst={CA_PATH},ro"]
    for source, target, writable in chosen.mounts:
        argv += ["--mount", f"type=bind,src={source},dst={target}" + ("" if writable else ",ro")]
    for volume in chosen.persist:
        # podman's U: the volume belongs to the container's user (1000), who could not write it else
        argv += ["--volume", f"{volume}:{PERSIST_ROOT}/{volume}" + (":U" if engine == "podman" else "")]
    for key, value in sorted(container_environment(spec.env).items()):
        argv += ["--env", f"{key}={value}"]
    return argv + ["--", chosen.image, *spec.argv]


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


_HOLDER = "import os\nos.read(0, 1)\n"  # holds the namespace until its stdin closes (or it is killed)


class Container:
    """The platform interface (sandbox/platforms.py) for podman and docker."""

    warm = True  # the proxy is served from the namespace's socket, as for the namespace provider
    capture = True

    def __init__(self, engine: str, chosen: ContainerSpec | None):
        self.name = engine
        self.engine = engine
        self.chosen = chosen or ContainerSpec(None)

    def refusal(self) -> str | None:
        if not self.chosen.image:
            return (f"--provider {self.engine} needs an image: --image IMAGE, or image = \"...\" in the "
                    f"policy's [container] table")
        if shutil.which(self.engine) is None:
            return f"--provider {self.engine}: {self.engine} is not installed (not on PATH)"
        return None

    def listener(self, networked: bool):
        from sandbox.platforms import LINUX_PROXY_PORT, Listener

        return Listener(LINUX_PROXY_PORT)

    def environment(self, tmpdir) -> dict[str, str]:
        return {}

    def start(self, spec: SandboxSpec, listener) -> ContainerBox:
        from sandbox import linux

        read, write = os.pipe()
        try:
            holder = linux.start(SandboxSpec([sys.executable, "-I", "-S", "-c", _HOLDER], {"PATH": "/usr/bin:/bin"},
                                             "/", network=spec.network, proxy_port=spec.proxy_port,
                                             capture=spec.capture, fs_confinement=False, stdin=read))
        finally:
            os.close(read)
        try:
            ca = spec.env.get("SSL_CERT_FILE") if spec.network else None
            name = f"egress-{os.urandom(6).hex()}"
            argv = engine_argv(self.engine, name, f"/proc/{holder.pid}/ns/net", spec, self.chosen, ca,
                               interactive=not _isatty(spec.stdin if spec.stdin is not None else 0))
            try:
                process = subprocess.Popen(argv, stdin=spec.stdin, stdout=spec.stdout, stderr=spec.stderr,
                                           close_fds=True, restore_signals=True)
            except OSError as e:
                raise SandboxError(EXIT_LAUNCHER, f"cannot start {self.engine}: {e.strerror or e}", "exec") from None
        except BaseException:
            os.close(write)
            holder.close()
            raise
        return ContainerBox(self.engine, name, process, holder, write)


class ContainerBox:
    """A started container: the engine's client process, and the namespace's holder."""

    def __init__(self, engine: str, name: str, process: subprocess.Popen, holder, holder_pipe: int):
        self.engine, self.name, self.process = engine, name, process
        self.pid = process.pid
        self.holder = holder
        self.listen_socket = holder.listen_socket
        self.capture = holder.capture
        self.capture_error = holder.capture_error
        self.returncode: int | None = None
        self._pipe = holder_pipe

    def ready(self) -> None:
        """The engine's client is started when the box is made (sandbox/platforms.py's interface)."""

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            self.returncode = EXIT_TIMEOUT
            return self.returncode
        self.returncode = 128 - code if code < 0 else code
        return self.returncode

    def signal(self, sig: int) -> None:
        """To the engine's client, which passes it to the container's command (--sig-proxy)."""
        if self.returncode is None and self.process.poll() is None:
            try:
                self.process.send_signal(sig)
            except ProcessLookupError:
                pass

    def direct_attempts(self) -> int | None:
        return self.holder.direct_attempts()  # the container shares the holder's namespace

    def close(self) -> None:
        if self.returncode is None:
            self._kill()
            self.returncode = EXIT_LAUNCHER
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        self.holder.close()  # the namespace, its socket and the capture's go with it

    def __enter__(self) -> ContainerBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _kill(self) -> None:
        # The engine kills the container (its processes are not our children); then its client.
        subprocess.run([self.engine, "kill", self.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=60, check=False)
        subprocess.run([self.engine, "rm", "--force", self.name], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60, check=False)
        try:
            self.process.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
