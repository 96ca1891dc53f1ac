"""Start a command on macOS under a Seatbelt profile where the run's proxy is the only road out.

    listener = MacOS().listener(True)      # 127.0.0.1:PORT, made here, and the run's secret
    box = start(SandboxSpec(argv=["curl", "https://x"], env=env, cwd=project,
                            writable=[project, run_tmp], proxy_port=listener.port,
                            socket_dirs=[run_tmp]), listener, "/usr/bin/sandbox-exec")
    serve_proxy_on(box.listen_socket)      # asks for the secret (egress.proxy.auth)
    status = box.wait()

What runs: ``/usr/bin/sandbox-exec -p PROFILE PROGRAM ARGS...``, where PROFILE is
sandbox/seatbelt.py's profile for the spec's paths (canonical: symlinks resolved, the name stored
on disk), the files in its writable trees that run later (sandbox/protected.py; none with
allow_hooks) and the trees its programs keep their code in (:func:`code_trees`), and PROGRAM is
argv[0] found on the spec's PATH from its working folder, so a missing or unexecutable program is
127/126 before anything starts, as on Linux. sandbox-exec applies the
profile to itself and execs the program, so the process started is the command itself, and
everything it starts inherits the profile; nothing can lift it.

The command gets a process group of its own, made the terminal's foreground group when egress
had it (so it reads the terminal and gets Ctrl-C as a shell's job would; egress's lines still get
out: the launcher ignores SIGTTOU). When it ends, or --timeout expires, that whole group is
killed, as Linux's PID namespace ends with its init: background jobs it left die with it. A
process that leaves the group (setsid, a daemon) is not found, and outlives the run, still
sandboxed; its proxy closes with the run, and a later run's proxy asks for another secret.

Differences from Linux are the profile's (docs/architecture.md, "The macOS sandbox"); this file
only starts, waits, signals and kills.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess

from egress.core.contract import EXIT_LAUNCHER, EXIT_TIMEOUT
from sandbox import protected, seatbelt
from sandbox.box import BaseBox
from sandbox.spec import SandboxError, SandboxSpec, find_program


class Launch:
    """What start() runs: the whole argv (sandbox-exec, its profile, the program), environment,
    working folder and profile text. :func:`plan` makes it; tests read it."""

    __slots__ = ("argv", "env", "cwd", "profile", "program")

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, profile: str, program: str):
        self.argv, self.env, self.cwd, self.profile, self.program = argv, env, cwd, profile, program


def plan(spec: SandboxSpec, sandbox_exec: str, canonical=seatbelt.canonical) -> Launch:
    """The process start() would start for ``spec``. Raises SandboxError (126/127: the program;
    125: a path no profile can hold)."""
    program = find_program(spec.argv[0], spec.env, spec.cwd)
    real = lambda paths: [canonical(path) for path in paths]  # noqa: E731
    writable = real(spec.writable)
    # Not in the run's own temporary folder, which goes with the run: nothing there runs later.
    # (getattr: a spec made before SandboxSpec had allow_hooks and abandoned protects them all.)
    gone = real(getattr(spec, "abandoned", ()))
    later = [] if getattr(spec, "allow_hooks", False) else later_run([t for t in writable if t not in gone], canonical)
    try:
        text = seatbelt.profile(
            writable, spec.proxy_port if spec.network else None,
            read_only=real(spec.read_only), hidden=real(spec.hidden), unreadable_files=real(spec.replaced),
            sockets=real(spec.socket_dirs), fs_confinement=spec.fs_confinement, later_run=later,
            code=code_trees(spec.env, real(spec.readable), canonical))
    except seatbelt.ProfileError as e:
        raise SandboxError(EXIT_LAUNCHER, f"cannot write the sandbox profile: {e}", "profile") from None
    return Launch([sandbox_exec, "-p", text, program, *spec.argv[1:]], dict(spec.env), spec.cwd, text, program)


def later_run(trees: list[str], canonical=seatbelt.canonical) -> list[str]:
    """The files in each writable tree that run later, outside the sandbox (sandbox/protected.py),
    as named inside the tree and, where a symlink leads elsewhere (a `.vscode` linked to a
    shared folder), as the kernel reports them: Seatbelt decides by that name."""
    found: list[str] = []
    for tree in trees:
        for path in protected.later_run_paths(tree):
            found += [p for p in (path, canonical(path)) if p not in found]
    return found


def code_trees(env: dict[str, str], readable: list[str], canonical=seatbelt.canonical) -> list[str]:
    """Where the run's programs keep their code, besides the system's and the installed toolchains'
    (sandbox/seatbelt.py): the caller's interpreter trees, each folder on the command's PATH and,
    for a bin, sbin or shims folder, the prefix around it, whose lib/ holds the libraries its
    programs load (~/.local for uv's and pipx's Pythons, ~/.nvm/versions/node/vN, ~/.pyenv,
    ~/.cargo); rustup's toolchains (RUSTUP_HOME, which no PATH names) and the user's own Python
    packages (~/Library/Python, pip install --user). Never "/", a folder directly under it, or
    the whole home folder."""
    home = env.get("HOME", "")
    home = canonical(home) if home.startswith("/") else ""
    trees = list(readable)
    for entry in env.get("PATH", "").split(os.pathsep):
        if not entry.startswith("/"):
            continue  # "." and relative entries name wherever the command stands
        folder = canonical(entry)
        trees.append(folder)
        if os.path.basename(folder) in ("bin", "sbin", "shims"):
            trees.append(os.path.dirname(folder))
    if home:
        rustup = env.get("RUSTUP_HOME", "") or os.path.join(home, ".rustup")
        trees += [canonical(rustup)] if rustup.startswith("/") else []
        trees.append(os.path.join(home, "Library", "Python"))
    return [tree for tree in dict.fromkeys(trees) if tree.count("/") >= 2 and tree != home]


class Sandbox(BaseBox):
    """A started command. Use as a context manager, or call close() when done."""

    def __init__(self, process: subprocess.Popen, listener, launch: Launch):
        self.process = process
        self.pid = process.pid  # also its process group
        self.listener = listener  # its socket, and the port's guards, are the box's now
        self.listen_socket = listener.socket if listener is not None else None
        # No transparent capture here (Linux's sandbox/capture.py): the profile refuses every
        # other road out, and a refused connect fails at once with EPERM.
        self.capture: list = []
        self.launch = launch
        self._exit = _ExitWatch(process.pid)

    def wait(self, timeout: float | None = None) -> int:
        """The command's exit status (128+N if killed by signal N); on timeout its whole process
        group is killed and EXIT_TIMEOUT returned."""
        if self.returncode is not None:
            return self.returncode
        if not self._exit.wait(timeout):
            self._end()
            self.returncode = EXIT_TIMEOUT
            return self.returncode
        self.returncode = self._end()
        return self.returncode

    def direct_attempts(self) -> int | None:
        return None  # Seatbelt refuses them without counting where egress can read

    def _running(self) -> bool:
        return self.process.returncode is None

    def _send(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def _release(self) -> None:
        if self.listener is not None:
            self.listener.close()  # the socket, and the port's guards
        self._exit.close()

    def _end(self) -> int:
        # The whole group, killed before the leader is reaped: its zombie keeps the group's id
        # from being reused.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.process.wait()
        return 128 - code if code < 0 else code


def start(spec: SandboxSpec, listener, sandbox_exec: str) -> Sandbox:
    """Start spec.argv under its Seatbelt profile; ``listener``'s socket becomes the box's.
    Raises SandboxError (nothing left running) if it cannot start."""
    return start_in_group(plan(spec, sandbox_exec), spec, listener, sandbox_exec)


def start_in_group(launch: Launch, spec: SandboxSpec, listener, executable: str) -> Sandbox:
    """Start ``launch`` (as ``executable``) in a process group of its own, made the terminal's
    foreground group as a shell's job is; the Seatbelt launcher's and --provider local's start."""
    terminal = _foreground_terminal()
    previous = signal.signal(signal.SIGTTOU, signal.SIG_DFL)  # not ignored in the command
    try:
        process = subprocess.Popen(launch.argv, executable=executable, env=launch.env, cwd=launch.cwd,
                                   stdin=spec.stdin, stdout=spec.stdout, stderr=spec.stderr,
                                   process_group=0, close_fds=True, restore_signals=True)
    except OSError as e:
        raise SandboxError(EXIT_LAUNCHER, f"cannot start {executable}: {e.strerror or e}", "exec") from None
    finally:
        signal.signal(signal.SIGTTOU, previous)
    if terminal is not None:
        try:
            os.tcsetpgrp(terminal, process.pid)  # the command's group reads the terminal, as a shell's job
        except OSError:
            pass
        # Had it touched the terminal first, job control stopped it: go on.
        try:
            os.killpg(process.pid, signal.SIGCONT)
        except OSError:
            pass
    return Sandbox(process, listener, launch)


def _foreground_terminal() -> int | None:
    """A descriptor of egress's terminal if egress is in its foreground group (else None)."""
    for fd in (0, 2, 1):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return fd
        except OSError:
            continue
    return None


class _ExitWatch:
    """Wait for a child's exit without reaping it: kqueue on macOS, a pidfd on Linux (where the
    tests run this launcher with a stand-in sandbox-exec)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._kq = self._fd = None
        if hasattr(select, "kqueue"):
            self._kq = select.kqueue()
            event = select.kevent(pid, filter=select.KQ_FILTER_PROC,
                                  flags=select.KQ_EV_ADD | select.KQ_EV_ONESHOT, fflags=select.KQ_NOTE_EXIT)
            try:
                self._kq.control([event], 0, 0)
            except ProcessLookupError:  # it has exited already
                self._kq.close()
                self._kq = None
        else:
            try:
                self._fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._fd = None

    def wait(self, timeout: float | None) -> bool:
        """True once the process has exited; False if ``timeout`` seconds passed first."""
        if self._kq is not None:
            return bool(self._kq.control(None, 1, timeout))
        if self._fd is not None:
            poll = select.poll()
            poll.register(self._fd, select.POLLIN)
            return bool(poll.poll(None if timeout is None else max(0, int(timeout * 1000))))
        return True

    def close(self) -> None:
        if self._kq is not None:
            self._kq.close()
            self._kq = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
