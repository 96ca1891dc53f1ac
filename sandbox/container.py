"""`egress run --provider podman|docker --image IMAGE -- CMD`: the command in a hardened container
whose only road out is egress.

    box = Container("podman", ContainerSpec("localhost/tools:1")).start(spec, listener)

The container's network namespace holds only `lo`, the proxy's listening socket made inside and
handed out, and the transparent capture's redirects, exactly as for `--provider namespace`: the
proxy socket is its only road out, and a client that ignores the proxy variables is captured.
There are two ways in, one per engine, both made of sandbox/linux.py's code:

* podman (OwnNamespace): the namespace launcher makes its network namespace with a small holder
  process in it, and podman joins it by path: ``--network ns:/proc/HOLDER/ns/net --pid
  ns:/proc/HOLDER/ns/pid``; the run's init is the container's PID 1, so when egress's pipe to the
  holder closes (egress ended, even by SIGKILL) the kernel ends the container with the namespace.
* docker (EngineNamespace): Docker Engine's --network takes no namespace path, so the engine
  makes the namespace. A holder container (sandbox/holder.py: a 71-byte program that waits on its
  stdin) runs with ``--network none``; egress, as root, enters its network namespace
  (linux.enter_network: setns in a forked child, which refuses a namespace with an interface up
  besides `lo`, or egress's own) and makes the same socket and capture there; the command's
  container joins with ``--network container:HOLDER --pid container:HOLDER``. The holder is PID 1
  of that PID namespace and exits when egress's pipe to it closes, so the command cannot outlive
  egress, even a SIGKILLed one. If any step fails, nothing runs (125).

The engine runs outside, as the caller.

Every container gets HARDENING, whatever the caller passed (the only values a caller sets are
the cpu and memory sizes, and the image), and hardening()'s two: egress's seccomp profile
(sandbox/container_seccomp.py: the engine's default allow list, with keyrings, socket families
but four, clone3, new namespaces, io_uring and set-id modes refused) and a user that is no account
of the host (sandbox/idmap.py's container_ids: the engines map no ids, so the container's uid is
the host's); docker's holder too, with a user of its own. The project is mounted at /work
read-write and is the working folder; with the engine run as root, through an idmapped, nosuid
mount in which the project's owner is the container's user (sandbox/idmap.py; a root-owned
project is refused). --mount adds folders read-only unless `:rw` is written (a writable one
through a nosuid copy of its mount: docker's --mount cannot say nosuid); --persist NAME keeps a
named volume at /persist/NAME, given to the container's user (podman's `:U`, nosuid; docker has
neither, so egress makes the volume and gives its folder to the container's user, and there the
profile's set-id refusal and no-new-privileges hold alone). The environment is made here, not
inherited: the brokered secrets' placeholders (the launcher's, as for every sandbox), the proxy
variables, the CA bundle (mounted read-only at CA_PATH) under every name clients read, HOME and
TMPDIR in /tmp. What the namespace provider's mounts promise (a secret
file shows its placeholder, egress's state is hidden, its code read-only) becomes mounts wherever
the container sees those paths (covers()). Rootless podman is refused (ROOTLESS_REASON).
Machine-specific engine settings (a runtime, a cgroup manager, default ulimits) are the engine's
own configuration (containers.conf, CONTAINERS_CONF, daemon.json), never egress's flags.

Exit statuses are the engine's, which are the shell's and egress's: the command's own, 125 the
engine failed (nothing ran), 126 not executable, 127 not found; --timeout kills the container
(`ENGINE kill`) and returns 124.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from egress.core.contract import EXIT_LAUNCHER, EXIT_TIMEOUT
from sandbox import environment, netcount
from sandbox.box import BaseBox
from sandbox.paths import pinned_chain
from sandbox.platforms import LINUX_PROXY_PORT, BasePlatform, Listener
from sandbox.protected import later_run_paths
from sandbox.spec import SandboxError, SandboxSpec

TYPE_CHECKING = False  # mypy reads this name as True
if TYPE_CHECKING:
    from sandbox import api

WORKDIR = "/work"
CA_PATH = "/etc/egress/ca-bundle.pem"
PERSIST_ROOT = "/persist"
DEFAULT_CPUS = str(min(2, os.cpu_count() or 1))  # docker refuses more than the machine has
DEFAULT_MEMORY = "2048m"
# Never conditional on what the caller passed (issue 14): a flag added here holds for every run.
HARDENING = (
    "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges",
    "--pids-limit", "512",
    "--read-only",
    "--tmpfs", "/tmp:rw,exec,nosuid,size=512m",
    "--tmpfs", "/run:rw,nosuid,size=16m",
)
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def hardening(user: int, profile: str) -> list[str]:
    """HARDENING, with egress's seccomp profile (the file at ``profile``) and ``user`` as uid and
    gid: never whatever the image says (root in a container is root on a shared kernel), never an
    account of the host (idmap.container_ids)."""
    return [*HARDENING, "--security-opt", f"seccomp={profile}", "--user", f"{user}:{user}"]


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


def engine_argv(engine: str, name: str, network: list[str], spec: SandboxSpec, chosen: ContainerSpec,
                ca_bundle: str | None, interactive: bool = False, work: str | None = None,
                shown: dict[str, str] | None = None, *, user: int, profile: str,
                writable: dict[str, str] | None = None, cidfile: str | None = None) -> list[str]:
    """The whole `ENGINE run ...` command line (tests read it). ``network``: the way in's flags;
    ``work``: what to mount at /work instead of the project itself (its owner-mapped view,
    sandbox/idmap.py); ``shown``: each of spec.replaced's files -> the host file holding what the
    container sees instead (covers()); ``user``, ``profile``: hardening()'s; ``writable``: each
    writable --mount's source -> what to mount instead (its nosuid view); ``cidfile``: where the
    engine writes the container's id once it has made it (ContainerBox._kill waits for it)."""
    writable = writable or {}
    argv = [engine, "run", "--rm", "--name", name, *(["--cidfile", cidfile] if cidfile else []),
            *hardening(user, profile),
            "--cpus", chosen.cpus, "--memory", chosen.memory, "--memory-swap", chosen.memory,
            *network,
            "--mount", f"type=bind,src={work or spec.cwd},dst={WORKDIR}", "--workdir", WORKDIR]
    if interactive:
        argv += ["--interactive"]
    if ca_bundle:
        argv += ["--mount", f"type=bind,src={ca_bundle},dst={CA_PATH},ro"]
    for source, target, rw in chosen.mounts:
        argv += ["--mount", f"type=bind,src={writable.get(source, source)},dst={target}" + ("" if rw else ",ro")]
    for volume in chosen.persist:
        # podman's U: the volume belongs to the container's user, who could not write it else; nosuid
        # (docker has neither: EngineNamespace.give_volumes does the first)
        argv += ["--volume", f"{volume}:{PERSIST_ROOT}/{volume}" + (":U,nosuid" if engine == "podman" else "")]
    for mount in covers(spec, chosen, shown or {}, work, writable):
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


def covers(spec: SandboxSpec, chosen: ContainerSpec, shown: dict[str, str], work: str | None = None,
           writable: dict[str, str] | None = None) -> list[str]:
    """--mount values that keep, inside the container, what the namespace provider's mounts keep
    (sandbox/mounts.py): a hidden folder (egress's state) shows empty, egress's own code read-only,
    wherever a mount shows them; a replaced file (a secret bound to hosts, the audit log) shows
    its stand-in (``shown[path]``, on the host) read-only, where a mount shows it, else at its own
    path as the namespace provider does: a program reading the secret's file finds the placeholder."""
    hidden = [os.path.realpath(p) for p in spec.hidden if os.path.isdir(p)]
    later = later_run(spec, chosen)
    islands = [os.path.realpath(p) for p in spec.read_only if os.path.isdir(p)] + later
    # (nothing inside a hidden folder is pinned: a bind from the host there would show what it hides)
    inside_hidden = [p for p in [*islands, *map(os.path.realpath, shown)]
                     if any(p != h and p.startswith(h.rstrip("/") + "/") for h in hidden)]
    mounts = pins(spec, chosen, [p for p in [*hidden, *islands, *map(os.path.realpath, shown)]
                                 if p not in inside_hidden], work, writable)
    for folder in hidden:
        mounts += [f"type=tmpfs,dst={_plain(p)},ro,tmpfs-size=4096" for p in container_paths(folder, spec, chosen)]
    for folder in spec.read_only:
        if os.path.isdir(folder):
            mounts += [f"type=bind,src={_plain(folder)},dst={_plain(p)},ro"
                       for p in container_paths(folder, spec, chosen)]
    for path in later:  # files that run later, outside the sandbox: read-only (sandbox/protected.py)
        mounts += [f"type=bind,src={_plain(path)},dst={_plain(p)},ro" for p in container_paths(path, spec, chosen)]
    for path, stand_in in sorted(shown.items()):
        real = os.path.realpath(path)
        if any(real == h or real.startswith(h.rstrip("/") + "/") for h in hidden):
            continue  # hidden with its folder, as in the namespace provider
        for target in container_paths(real, spec, chosen) or [real]:
            mounts.append(f"type=bind,src={stand_in},dst={_plain(target)},ro")
    return mounts


def later_run(spec: SandboxSpec, chosen: ContainerSpec) -> list[str]:
    """What exists now of the files that run later outside the sandbox (sandbox/protected.py), at
    the top of the project and of each writable --mount; none with --allow-hooks. (What does not
    exist, the launcher moves aside after the run if the command made it.)"""
    if spec.allow_hooks:
        return []
    trees = [spec.cwd, *(source for source, _, rw in chosen.mounts if rw)]
    return [os.path.realpath(p) for tree in trees for p in later_run_paths(tree) if os.path.lexists(p)]


def pins(spec: SandboxSpec, chosen: ContainerSpec, covered: list[str], work: str | None,
         writable: dict[str, str] | None = None) -> list[str]:
    """--mount values binding each folder between a writable tree (/work, a `--mount ...:rw`) and a
    covered path inside it onto itself, outermost first: a mount point cannot be renamed or removed
    (EBUSY), so the command cannot move a cover away with its parent. Measured before: docker ran
    `mv /work/.local /work/.local2` with the state folder in the project, the rename stuck on the
    host (the tmpfs cover went with it), and the command made the state folder again with its own
    CA for the next run (as sandbox/mounts.py pins for the namespace provider). The project's pins
    come from ``work``, its owner-mapped view: bound from the project itself they would show the
    host's ids, and the owner's folders would no longer be the container user's; a writable
    --mount's from ``writable``, its nosuid view."""
    trees = [(os.path.realpath(spec.cwd), work or spec.cwd, WORKDIR)]
    trees += [(os.path.realpath(source), (writable or {}).get(source, source), target)
              for source, target, rw in chosen.mounts if rw]
    mounts, seen = [], set()
    for real, source, target in trees:
        for folder in pinned_chain(covered, [real]):
            if folder in covered:
                continue  # covered itself: its cover is a mount point already
            inside = os.path.relpath(folder, real)
            dst = os.path.normpath(os.path.join(target, inside))
            if dst not in seen:  # (the engines refuse two mounts at one path)
                seen.add(dst)
                mounts.append(f"type=bind,src={_plain(os.path.join(source, inside))},dst={_plain(dst)}")
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
_ENGINE_TIMEOUT = 120  # seconds for one engine step (start, inspect, kill); a busy daemon is slow
_SAID = 300  # characters of an engine's complaint that egress repeats


def engine_run(engine: str, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
    """``ENGINE ARGS...`` to its end, its output kept (text, unless ``input`` is bytes); an engine
    that cannot be started or does not answer in _ENGINE_TIMEOUT is a failed run, never an exception."""
    text = input is None
    try:
        return subprocess.run([engine, *args], input=input, capture_output=True, text=text,
                              timeout=_ENGINE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(args, 1, "" if text else b"", str(e) if text else str(e).encode())


def engine_start(engine: str, argv: list[str], **kwargs) -> subprocess.Popen:
    """The engine's client started on ``argv``; SandboxError (125, nothing ran) if it cannot be."""
    try:
        return subprocess.Popen(argv, close_fds=True, restore_signals=True, **kwargs)
    except OSError as e:
        raise SandboxError(EXIT_LAUNCHER, f"cannot start {engine}: {e.strerror or e}", "exec") from None


class Container(BasePlatform):
    """The platform interface (sandbox/api.py) for podman and docker."""

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
        from sandbox import container_seccomp

        refused = EngineNamespace.refusal() if self.engine == "docker" else rootless_refusal(self.engine)
        return refused or container_seccomp.refusal(self.engine)

    def listener(self, networked: bool) -> Listener:
        return Listener(LINUX_PROXY_PORT)

    def writable_elsewhere(self) -> list[str]:
        """The sources of `--mount SRC:DST:rw`: the container writes them as it writes /work."""
        return [source for source, _, writable in self.chosen.mounts if writable]

    def start(self, spec: SandboxSpec, listener: api.Listener) -> ContainerBox:
        from sandbox import idmap

        way = EngineNamespace if self.engine == "docker" else OwnNamespace
        user, holder_user = idmap.container_ids()
        view = HostView.make(spec, self.chosen, user)  # before the namespace: a refusal costs nothing else
        try:
            network = way(self.engine, spec, view.profile, holder_user)
        except BaseException:
            view.close()
            raise
        try:
            network.give_volumes(self.chosen.persist, user)
            ca = spec.env.get("SSL_CERT_FILE") if spec.network else None
            name = f"egress-{os.urandom(6).hex()}"
            argv = engine_argv(self.engine, name, network.flags, spec, self.chosen, ca,
                               interactive=not _isatty(spec.stdin if spec.stdin is not None else 0),
                               work=view.work, shown=view.shown, user=user, profile=view.profile,
                               writable=view.writable, cidfile=view.cidfile)
            process = engine_start(self.engine, argv, stdin=spec.stdin, stdout=spec.stdout, stderr=spec.stderr)
        except BaseException:
            network.close()
            view.close()
            raise
        return ContainerBox(self.engine, name, process, network, view)


class OwnNamespace:
    """podman's way in: sandbox/linux.py's namespace, held by a Python reading its stdin; the
    engine joins it by path."""

    def __init__(self, engine: str, spec: SandboxSpec, profile: str, holder_user: int):
        # (profile, holder_user: docker's holder is a container; this one is a process of egress's)
        from sandbox import linux

        read, write = os.pipe()
        try:
            self.holder = linux.start(SandboxSpec([sys.executable, "-I", "-S", "-c", _HOLDER], {"PATH": "/usr/bin:/bin"},
                                                  "/", network=spec.network, proxy_port=spec.proxy_port,
                                                  capture=spec.capture, fs_confinement=False, stdin=read))
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._pipe = write
        # The PID namespace too: when egress ends, however it ends (SIGKILL included), the pipe
        # closes, the holder exits, its init with it, and the kernel kills every process left in
        # the namespace -- the command's container cannot outlive the run (as docker's holder).
        self.flags = ["--network", f"ns:/proc/{self.holder.pid}/ns/net", "--pid", f"ns:/proc/{self.holder.pid}/ns/pid"]
        self.listen_socket, self.capture = self.holder.listen_socket, self.holder.capture
        self.capture_error = self.holder.capture_error

    def give_volumes(self, names, user: int) -> None:
        pass  # engine_argv's :U

    def direct_attempts(self) -> int | None:
        return self.holder.direct_attempts()  # the container shares the holder's namespace

    def close(self) -> None:
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        self.holder.close()  # the namespace, its socket and the capture's go with it


class EngineNamespace:
    """docker's way in: a holder container (sandbox/holder.py) in a namespace the engine made with
    --network none, set up from inside by linux.enter_network; the command's container joins the
    holder's network and PID namespaces."""

    @staticmethod
    def refusal() -> str | None:
        from sandbox import holder

        if os.geteuid() != 0:
            return ("--provider docker: egress must run as root: Docker makes the container's network namespace "
                    "as root, and egress enters it to make its proxy socket and capture there (or use "
                    "--provider podman)")
        try:
            holder.program()
        except holder.Unsupported as e:
            return f"--provider docker: {e}"
        return None

    def __init__(self, engine: str, spec: SandboxSpec, profile: str, holder_user: int):
        from sandbox import holder, linux

        self.engine = engine
        self.name = f"egress-{os.urandom(6).hex()}-holder"
        self._netcount: list[int] = []
        self._client = None
        self.network = None
        read, write = os.pipe()
        self._pipe = write
        try:
            image = self._holder_image()
            argv = [engine, "run", "--rm", "--interactive", "--pull", "never", "--name", self.name,
                    *hardening(holder_user, profile), "--network", "none", "--memory", "32m",
                    "--memory-swap", "32m", "--log-driver", "none", "--", image, holder.PROGRAM]
            # Its own session: a terminal's Ctrl-C is for the command, not for the holder's client.
            self._client = engine_start(engine, argv, stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       start_new_session=True)
            os.close(read)
            read = -1
            pid, ident = self._wait_running()
            netns = self._open_namespace(pid, ident)
            try:
                self.network = linux.enter_network(netns, spec)
            finally:
                os.close(netns)
        except BaseException:
            if read >= 0:
                os.close(read)
            self.close()
            raise
        self.flags = ["--network", f"container:{self.name}", "--pid", f"container:{self.name}"]
        self.listen_socket, self.capture = self.network.listen_socket, self.network.capture
        self.capture_error = self.network.capture_error

    def _open_namespace(self, pid: int, ident: str) -> int:
        """The holder's network namespace, opened through /proc/PID, once PID is known to be the
        holder's: in the container's cgroup (a daemon on another machine, or egress in another PID
        namespace, would name some other process here), and still alive after the open (a pidfd
        held meanwhile: the pid cannot have passed to another process). Also its counters."""
        def refuse(why: str) -> SandboxError:
            return SandboxError(EXIT_LAUNCHER, f"cannot set up the holder container's network: {why}", "network")

        try:
            alive = os.pidfd_open(pid)
        except OSError:
            raise refuse(f"no process {pid} here: it ended, or the {self.engine} daemon is not on this machine "
                         f"(or not in egress's PID namespace)") from None
        try:
            try:
                with open(f"/proc/{pid}/cgroup") as f:
                    ours = ident in f.read()
                netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise refuse(f"{e.strerror} (is the {self.engine} daemon on this machine?)") from None
            if not ours:
                os.close(netns)
                raise refuse(f"process {pid} here is not the holder (is the {self.engine} daemon on this "
                             f"machine, and egress in its PID namespace?)")
            self._netcount = netcount.open_files(pid)
            ended = select.poll()
            ended.register(alive, select.POLLIN)
            problem = ("it ended while starting" if ended.poll(0) else
                       "it shares egress's own network namespace"
                       if os.fstat(netns).st_ino == os.stat("/proc/self/ns/net").st_ino else None)
            if problem:
                os.close(netns)
                raise refuse(problem)
            return netns
        finally:
            os.close(alive)

    def give_volumes(self, names, user: int) -> None:
        """Docker's stand-in for podman's :U: the volume (made now if new) is given to the container's
        user, who could not write its root-owned folder else."""
        for name in names:
            made = engine_run(self.engine, "volume", "create", name)
            where = engine_run(self.engine, "volume", "inspect", "--format", "{{.Mountpoint}}", name)
            try:
                if made.returncode != 0 or where.returncode != 0:
                    raise OSError(0, (made.stderr or where.stderr).strip())
                os.chown(where.stdout.strip(), user, user)
            except OSError as e:
                raise SandboxError(EXIT_LAUNCHER, f"--persist {name}: cannot give the volume to the container's "
                                   f"user: {e.strerror or e}", "mounts") from None

    def direct_attempts(self) -> int | None:
        return netcount.read(self._netcount) if self._netcount else None

    def close(self) -> None:
        """The sockets, then the holder: its stdin closes, it exits, and the engine removes it."""
        if self.network is not None:
            self.network.close()
            self.network = None
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        if self._client is not None:
            try:
                self._client.wait(_ENGINE_TIMEOUT)
            except subprocess.TimeoutExpired:
                engine_run(self.engine, "rm", "--force", self.name)
                self._client.kill()
                self._client.wait()
            if self._client.stderr is not None:
                self._client.stderr.close()
            self._client = None
        for fd in self._netcount:
            os.close(fd)
        self._netcount = []

    def _holder_image(self) -> str:
        """The holder image's id, imported if missing. Its one layer must be exactly holder.py's
        tarball (Docker names a layer by the sha256 of the tar it was given): an image of that
        name with other content is replaced, and the run uses the id, not the name."""
        import hashlib

        from sandbox import holder

        tag, tarball = holder.image_tag(), holder.image_tarball()
        layers = f'["sha256:{hashlib.sha256(tarball).hexdigest()}"]'
        for attempt in range(2):
            found = engine_run(self.engine, "image", "inspect", "--format", "{{.Id}} {{json .RootFS.Layers}}", tag)
            ident, _, content = found.stdout.strip().partition(" ")
            if found.returncode == 0 and content == layers:
                return ident
            if attempt == 0:
                made = engine_run(self.engine, "import", "-", tag, input=tarball)
                if made.returncode != 0:
                    raise SandboxError(EXIT_LAUNCHER, f"{self.engine} cannot import the holder image: "
                                       f"{made.stderr.decode(errors='replace').strip()[:_SAID]}", "exec")
        raise SandboxError(EXIT_LAUNCHER, f"{self.engine} holds {tag} with other content than egress's holder",
                           "exec")

    def _wait_running(self) -> tuple[int, str]:
        """The holder's pid (as the engine's machine sees it) and id, once it runs; SandboxError if
        it ended."""
        deadline = time.monotonic() + _ENGINE_TIMEOUT
        while time.monotonic() < deadline:
            if self._client.poll() is not None:
                said = self._client.stderr.read().decode(errors="replace").strip()
                raise SandboxError(EXIT_LAUNCHER, f"{self.engine} could not start the holder container: "
                                   f"{said[:_SAID] or f'exit status {self._client.returncode}'}", "network")
            answer = engine_run(self.engine, "inspect", "--type", "container", "--format",
                                  "{{.State.Running}} {{.State.Pid}} {{.Id}}", self.name).stdout.split()
            if len(answer) == 3 and answer[0] == "true" and answer[1].isdigit() and int(answer[1]) > 0:
                return int(answer[1]), answer[2]
            time.sleep(0.05)
        raise SandboxError(EXIT_LAUNCHER, f"the holder container did not start within {_ENGINE_TIMEOUT} s", "network")


class HostView:
    """What a container's mounts and flags need on the host, made before it starts and taken away
    after: egress's seccomp profile, the stand-ins of spec.replaced's files, and (an engine run as
    root) the project's owner-mapped view and the nosuid views of writable --mounts
    (sandbox/idmap.py), all in one private folder."""

    def __init__(self):
        self.folder: str | None = None
        self.cidfile: str | None = None  # where the engine writes the container's id once it has made it
        self.profile: str | None = None  # egress's seccomp profile (sandbox/container_seccomp.py)
        self.work: str | None = None  # the owner-mapped project, mounted at /work; None: the project itself
        self.shown: dict[str, str] = {}
        self.writable: dict[str, str] = {}  # a writable --mount's source -> its nosuid view

    @classmethod
    def make(cls, spec: SandboxSpec, chosen: ContainerSpec, user: int) -> HostView:
        from sandbox import container_seccomp

        view = cls()
        replaced = {path: data for path, data in spec.replaced.items() if os.path.isfile(path)}
        # An engine run as root maps no ids (rootless podman is refused; docker is refused unless root)
        mapped = os.geteuid() == 0
        _sweep()
        # /run: root's runtime folder, which no age-based cleaner walks (one walking into a view
        # left attached by a killed egress would delete the project through it)
        where = RUNTIME_DIR if mapped else None  # (unmapped: files only, no mount to sweep)
        try:
            view.folder = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=where)
        except OSError as e:
            raise SandboxError(EXIT_LAUNCHER, f"cannot make the container's view of the project in "
                                              f"{where or tempfile.gettempdir()}: {e.strerror or e}", "mount") from None
        view.cidfile = os.path.join(view.folder, _CIDFILE)
        try:
            try:
                view.profile = container_seccomp.write(view.folder)
            except OSError as e:
                raise SandboxError(EXIT_LAUNCHER, f"cannot write the containers' seccomp profile in {view.folder}: "
                                                  f"{e.strerror or e}", "seccomp") from None
            for index, (path, data) in enumerate(sorted(replaced.items())):
                stand_in = os.path.join(view.folder, f"shown{index}")
                fd = os.open(stand_in, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
                with open(fd, "wb") as f:
                    f.write(data)
                view.shown[path] = stand_in
            if mapped:
                view._map_work(spec.cwd, user)
                view._view_writable(chosen)
        except BaseException:
            view.close()
            raise
        return view

    def _map_work(self, project: str, user: int) -> None:
        from sandbox import idmap

        target = os.path.join(self.folder, "work")
        os.mkdir(target, 0o700)
        try:
            self.work = idmap.owner_mapped(project, target, user, user)
        except idmap.Refused as e:
            raise SandboxError(EXIT_LAUNCHER, f"{e.strerror}, and the container's user writes there as the project's "
                                              f"owner: run it from a project owned by an unprivileged user (chown "
                                              f"USER:GROUP), or use --provider namespace", "mount") from None
        except OSError as e:
            raise SandboxError(EXIT_LAUNCHER, f"cannot show the project {project} to the container's user as its "
                                              f"owner's (an idmapped mount: {e.strerror or e}); nothing ran (unmapped, "
                                              f"the project is not the container user's to write). Idmapped mounts "
                                              f"need Linux 5.12+ and a filesystem that has them (ext4, xfs, btrfs, "
                                              f"tmpfs 6.3+); --provider namespace needs none", "mount") from None

    def _view_writable(self, chosen: ContainerSpec) -> None:
        """A nosuid view of each writable --mount (docker's --mount cannot say nosuid): a set-id file
        made there anyway (egress's profile refuses the modes) gives nothing, in this container or
        the next."""
        from sandbox import idmap

        for index, source in enumerate(sorted({s for s, _, rw in chosen.mounts if rw})):
            target = os.path.join(self.folder, f"{_VIEW}{index}")
            if os.path.isdir(source):
                os.mkdir(target, 0o700)
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            try:
                self.writable[source] = idmap.nosuid_view(source, target)
            except OSError as e:
                raise SandboxError(EXIT_LAUNCHER, f"--mount {source}: cannot make its nosuid view "
                                                  f"({e.strerror or e}); nothing ran", "mount") from None

    def close(self) -> None:
        if self.folder is not None:
            _take_away(self.folder)
            self.folder = self.work = self.profile = self.cidfile = None
            self.writable = {}


RUNTIME_DIR = "/run"
_PREFIX = "egress-container-"
_VIEW = "rw"  # a writable --mount's view: rw0, rw1, ...
_CIDFILE = "cid"


def _take_away(folder: str) -> None:
    """Remove a HostView's folder: detach the views first (the project's, the writable mounts');
    rmdir or unlink only, never a recursive removal (the folder held the project). Left in place if
    a view cannot be detached."""
    import errno

    from sandbox import container_seccomp, idmap

    try:
        names = os.listdir(folder)
        views = [n for n in names if n == "work" or n.startswith(_VIEW)]
        for name in views:
            path = os.path.join(folder, name)
            if not stat.S_ISLNK(os.lstat(path).st_mode):  # a symlink is no view (never followed)
                try:  # (os.path.ismount cannot tell: a bind of the same filesystem keeps its st_dev)
                    idmap.detach(path)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: not a mount (any more)
                        raise
        for name in names:
            path = os.path.join(folder, name)
            if name.startswith("shown") or name in (container_seccomp.FILE_NAME, _CIDFILE):
                os.unlink(path)
            elif stat.S_ISDIR(os.lstat(path).st_mode):
                os.rmdir(path)
            elif name in views:
                os.unlink(path)  # a file's view, detached
        os.rmdir(folder)
    except OSError:
        pass  # a view still attached stays so: removing through it would remove the project's files


def _sweep() -> None:
    """Take away the folders of egress runs that were killed before their close (SIGKILL).

    Only in RUNTIME_DIR, and only real folders of this user's: views are attached there alone (a
    run that maps none leaves no mount to take away), and a name in a folder others can write
    (/tmp) could be their symlink, turning a root egress's detach and unlink against any path."""
    try:
        names = [n for n in os.listdir(RUNTIME_DIR) if n.startswith(_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_PREFIX):].split("-", 1)[0]
        path = os.path.join(RUNTIME_DIR, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if (pid.isdigit() and not os.path.exists(f"/proc/{pid}") and stat.S_ISDIR(info.st_mode)
                and info.st_uid == os.geteuid()):
            _take_away(path)


class ContainerBox(BaseBox):
    """A started container: the engine's client process, and the way in (the namespace's holder)."""

    def __init__(self, engine: str, name: str, process: subprocess.Popen, network, view: HostView | None = None):
        self.engine, self.name, self.process = engine, name, process
        self.pid = process.pid
        self.network = network
        self.view = view or HostView()
        self.listen_socket = network.listen_socket
        self.capture = network.capture
        self.capture_error = network.capture_error

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

    def direct_attempts(self) -> int | None:
        return self.network.direct_attempts()

    def _running(self) -> bool:
        return self.process.poll() is None

    def _send(self, sig: int) -> None:
        # Through the engine, not its client's --sig-proxy: podman's client catches signals for
        # the container only once it has started it, and one that came first ended the client
        # (status 0) while the command ran on. Before the container runs, the client gets it.
        if engine_run(self.engine, "kill", "--signal", str(sig), self.name).returncode != 0:
            self.process.send_signal(sig)

    def _end(self) -> int:
        self._kill()
        return EXIT_LAUNCHER

    def _release(self) -> None:
        self.network.close()  # the namespace, its socket and the capture's go with it
        self.view.close()

    def _made(self) -> bool:
        try:
            return self.view.cidfile is None or os.path.getsize(self.view.cidfile) > 0
        except OSError:
            return False

    def _kill(self) -> None:
        # An engine still making the container finishes making it though its client is killed, and
        # --rm never removes a container made but never started: first wait until it is made (its id
        # written) or the client has ended, so that it can be found by name.
        deadline = time.monotonic() + _ENGINE_TIMEOUT
        while not self._made() and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        # The engine kills the container (its processes are not our children); then its client.
        engine_run(self.engine, "kill", self.name)
        engine_run(self.engine, "rm", "--force", self.name)
        try:
            self.process.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
