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
working folder; with podman run as root, through an idmapped mount in which the project's owner
is the container's user (sandbox/idmap.py; a root-owned project is refused). --mount adds folders
read-only unless `:rw` is written; --persist NAME keeps a named volume at /persist/NAME. The
environment is made here, not inherited: the brokered secrets' placeholders (the launcher's,
as for every sandbox), the proxy variables, the CA bundle (mounted read-only at CA_PATH) under
every name clients read, HOME and TMPDIR in /tmp. What the namespace provider's mounts promise
(a secret file shows its placeholder, egress's state is hidden, its code read-only) becomes
mounts wherever the container sees those paths (covers()). Rootless podman is refused
(ROOTLESS_REASON). Machine-specific engine settings (a runtime, a cgroup manager, default
ulimits) are the engine's own configuration (containers.conf, CONTAINERS_CONF), never egress's flags.

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
import tempfile

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


def container_environment(spec_env: dict[str, str], placeholders=()) -> dict[str, str]:
    """The container's environment: the brokered secrets' placeholders (``placeholders`` names
    them; the launcher put them in spec_env for every sandbox), the run's proxy and CA variables
    (the bundle at CA_PATH) and the fail-fast settings, nothing else of the caller's."""
    from sandbox import environment

    env = {name: spec_env[name] for name in placeholders if name in spec_env}
    env.update({"PATH": CONTAINER_PATH, "HOME": "/tmp", "TMPDIR": "/tmp"})
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
                ca_bundle: str | None, interactive: bool = False, work: str | None = None,
                shown: dict[str, str] | None = None) -> list[str]:
    """The whole `ENGINE run ...` command line (tests read it). ``work``: what to mount at /work
    instead of the project itself (its owner-mapped view, sandbox/idmap.py); ``shown``: each of
    spec.replaced's files -> the host file holding what the container sees instead (covers())."""
    argv = [engine, "run", "--rm", "--name", name, *HARDENING,
            "--cpus", chosen.cpus, "--memory", chosen.memory, "--memory-swap", chosen.memory,
            "--network", f"ns:{netns}" if netns else "none",
            "--mount", f"type=bind,src={work or spec.cwd},dst={WORKDIR}", "--workdir", WORKDIR]
    if interactive:
        argv += ["--interactive"]
    if ca_bundle:
        argv += ["--mount", f"type=bind,src={ca_bundle},dst={CA_PATH},ro"]
    for source, target, writable in chosen.mounts:
        argv += ["--mount", f"type=bind,src={source},dst={target}" + ("" if writable else ",ro")]
    for volume in chosen.persist:
        # podman's U: the volume belongs to the container's user (1000), who could not write it else
        argv += ["--volume", f"{volume}:{PERSIST_ROOT}/{volume}" + (":U" if engine == "podman" else "")]
    for mount in covers(spec, chosen, shown or {}):
        argv += ["--mount", mount]
    for key, value in sorted(container_environment(spec.env, spec.placeholders).items()):
        argv += ["--env", f"{key}={value}"]
    return argv + ["--", chosen.image, *spec.argv]


def container_paths(path: str, spec: SandboxSpec, chosen: ContainerSpec) -> list[str]:
    """Where the host's ``path`` shows in the container: under /work for the project, under a
    --mount's target for its source (every one: mounts may overlap); [] where no mount shows it."""
    real = os.path.realpath(path)
    found = []
    for source, target in [(spec.cwd, WORKDIR), *((s, t) for s, t, _ in chosen.mounts)]:
        source = os.path.realpath(source)
        if real == source or real.startswith(source.rstrip("/") + "/"):
            found.append(os.path.normpath(os.path.join(target, os.path.relpath(real, source))))
    return found


def covers(spec: SandboxSpec, chosen: ContainerSpec, shown: dict[str, str]) -> list[str]:
    """--mount values that keep, inside the container, what the namespace provider's mounts keep
    (sandbox/mounts.py): a hidden folder (egress's state) shows empty, egress's own code read-only,
    wherever a mount shows them; a replaced file (a secret bound to hosts, the audit log) shows
    its stand-in (``shown[path]``, on the host) read-only, where a mount shows it, else at its own
    path as the namespace provider does: a program reading the secret's file finds the placeholder."""
    mounts = []
    hidden = [os.path.realpath(p) for p in spec.hidden if os.path.isdir(p)]
    for folder in hidden:
        mounts += [f"type=tmpfs,dst={_plain(p)},ro,tmpfs-size=4096" for p in container_paths(folder, spec, chosen)]
    for folder in spec.read_only:
        if os.path.isdir(folder):
            mounts += [f"type=bind,src={_plain(folder)},dst={_plain(p)},ro"
                       for p in container_paths(folder, spec, chosen)]
    for path, stand_in in sorted(shown.items()):
        real = os.path.realpath(path)
        if any(real == h or real.startswith(h.rstrip("/") + "/") for h in hidden):
            continue  # hidden with its folder, as in the namespace provider
        for target in container_paths(real, spec, chosen) or [real]:
            mounts.append(f"type=bind,src={stand_in},dst={_plain(target)},ro")
    return mounts


def _plain(path: str) -> str:
    """``path`` as --mount takes it; a comma would split the option (and uncover what it covers)."""
    if "," in path:
        raise SandboxError(EXIT_LAUNCHER, f"{path}: a path with a comma cannot be covered in a container", "mount")
    return path


# Measured with rootless podman 4.3.1 and runc 1.1.5 (a user with /etc/subuid entries): podman,
# inside its own user namespace, cannot open /proc/PID/ns/net of egress's holder ("stat: permission
# denied"); handed a bind-mounted path instead, runc fails "setns into net namespace: invalid
# argument". A namespace made inside podman's user namespace (`podman unshare unshare -n`) is
# joined fine (the container sees only lo): see docs/architecture.md for what that would take.
ROOTLESS_REASON = ("rootless podman cannot join the network namespace egress makes: podman runs the "
                   "container from a user namespace of its own, a sibling of the one that owns egress's "
                   "namespace, with no privilege over it (it cannot even open it)")
ROOTLESS_FIX = ("run egress as root (sudo egress run --provider podman ...: rootful podman), or use "
                "--provider namespace (the same network confinement, without an engine)")


def rootless_refusal(engine: str, euid: int | None = None) -> str | None:
    """Why egress run refuses --provider podman for an unprivileged caller (whose podman is rootless)."""
    if engine != "podman" or (os.geteuid() if euid is None else euid) == 0:
        return None
    return f"--provider podman as an unprivileged user: {ROOTLESS_REASON}; nothing ran. Fix: {ROOTLESS_FIX}"


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
        return rootless_refusal(self.engine)

    def listener(self, networked: bool):
        from sandbox.platforms import LINUX_PROXY_PORT, Listener

        return Listener(LINUX_PROXY_PORT)

    def environment(self, tmpdir) -> dict[str, str]:
        return {}

    def start(self, spec: SandboxSpec, listener) -> ContainerBox:
        from sandbox import linux

        view = HostView.make(self.engine, spec)  # before the namespace: a refusal costs nothing else
        try:
            read, write = os.pipe()
            try:
                holder = linux.start(SandboxSpec([sys.executable, "-I", "-S", "-c", _HOLDER],
                                                 {"PATH": "/usr/bin:/bin"}, "/", network=spec.network,
                                                 proxy_port=spec.proxy_port, capture=spec.capture,
                                                 fs_confinement=False, stdin=read))
            finally:
                os.close(read)
        except BaseException:
            view.close()
            raise
        try:
            ca = spec.env.get("SSL_CERT_FILE") if spec.network else None
            name = f"egress-{os.urandom(6).hex()}"
            argv = engine_argv(self.engine, name, f"/proc/{holder.pid}/ns/net", spec, self.chosen, ca,
                               interactive=not _isatty(spec.stdin if spec.stdin is not None else 0),
                               work=view.work, shown=view.shown)
            try:
                process = subprocess.Popen(argv, stdin=spec.stdin, stdout=spec.stdout, stderr=spec.stderr,
                                           close_fds=True, restore_signals=True)
            except OSError as e:
                raise SandboxError(EXIT_LAUNCHER, f"cannot start {self.engine}: {e.strerror or e}", "exec") from None
        except BaseException:
            os.close(write)
            holder.close()
            view.close()
            raise
        return ContainerBox(self.engine, name, process, holder, write, view)


class HostView:
    """What a container's mounts need on the host, made before it starts and taken away after:
    the stand-ins of spec.replaced's files, and (podman run as root) the project's owner-mapped
    view (sandbox/idmap.py), all in one private folder."""

    def __init__(self):
        self.folder: str | None = None
        self.work: str | None = None  # the owner-mapped project, mounted at /work; None: the project itself
        self.shown: dict[str, str] = {}

    @classmethod
    def make(cls, engine: str, spec: SandboxSpec) -> HostView:
        view = cls()
        replaced = {path: data for path, data in spec.replaced.items() if os.path.isfile(path)}
        mapped = engine == "podman" and os.geteuid() == 0  # rootful: the engine maps no ids
        if not (replaced or mapped):
            return view
        _sweep()
        # /run: root's runtime folder, which no age-based cleaner walks (one walking into a view
        # left attached by a killed egress would delete the project through it)
        where = RUNTIME_DIR if mapped and os.access(RUNTIME_DIR, os.W_OK) else None
        view.folder = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=where)
        try:
            for index, (path, data) in enumerate(sorted(replaced.items())):
                stand_in = os.path.join(view.folder, f"shown{index}")
                fd = os.open(stand_in, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
                with open(fd, "wb") as f:
                    f.write(data)
                view.shown[path] = stand_in
            if mapped:
                view._map_work(spec.cwd)
        except BaseException:
            view.close()
            raise
        return view

    def _map_work(self, project: str) -> None:
        from sandbox import idmap

        owner = os.stat(project).st_uid
        if owner == 0:
            # The container's user would write as root here: a setuid file it left would run as root.
            raise SandboxError(EXIT_LAUNCHER, f"the project {project} is owned by root, and the container's user "
                                              f"writes there as the project's owner: run it from a project owned "
                                              f"by an unprivileged user (chown), or use --provider namespace",
                               "mount")
        target = os.path.join(self.folder, "work")
        os.mkdir(target, 0o700)
        uid, gid = map(int, USER.split(":"))
        try:
            self.work = idmap.owner_mapped(project, target, uid, gid)
        except OSError as e:
            raise SandboxError(EXIT_LAUNCHER, f"cannot show the project {project} to the container's user as its "
                                              f"owner's (an idmapped mount: {e.strerror or e}); nothing ran (unmapped, "
                                              f"the project is not the container user's to write). Idmapped mounts "
                                              f"need Linux 5.12+ and a filesystem that has them (ext4, xfs, btrfs, "
                                              f"tmpfs 6.3+); --provider namespace needs none", "mount") from None

    def close(self) -> None:
        if self.folder is not None:
            _take_away(self.folder)
            self.folder = self.work = None


RUNTIME_DIR = "/run"
_PREFIX = "egress-container-"


def _take_away(folder: str) -> None:
    """Remove a HostView's folder: detach the project's view first; rmdir only, never a recursive
    removal (the folder held the project). Left in place if the view cannot be detached."""
    import errno

    from sandbox import idmap

    work = os.path.join(folder, "work")
    try:
        if os.path.isdir(work):
            try:  # (os.path.ismount cannot tell: a bind of the same filesystem keeps its st_dev)
                idmap.detach(work)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: not a mount (any more)
                    raise
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith("shown"):
                os.unlink(path)
            else:
                os.rmdir(path)
        os.rmdir(folder)
    except OSError:
        pass  # a view still attached stays so: removing through it would remove the project's files


def _sweep() -> None:
    """Take away the folders of egress runs that were killed before their close (SIGKILL)."""
    for where in {RUNTIME_DIR, tempfile.gettempdir()}:
        try:
            names = [n for n in os.listdir(where) if n.startswith(_PREFIX)]
        except OSError:
            continue
        for name in names:
            pid = name[len(_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                _take_away(os.path.join(where, name))


class ContainerBox:
    """A started container: the engine's client process, and the namespace's holder."""

    def __init__(self, engine: str, name: str, process: subprocess.Popen, holder, holder_pipe: int,
                 view: HostView | None = None):
        self.engine, self.name, self.process = engine, name, process
        self.pid = process.pid
        self.holder = holder
        self.view = view or HostView()
        self.listen_socket = holder.listen_socket
        self.capture = holder.capture
        self.capture_error = holder.capture_error
        self.returncode: int | None = None
        self._pipe = holder_pipe

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
        self.view.close()

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
