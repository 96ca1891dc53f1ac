"""Start a command on Linux where one handed-over listening socket is the only road out.

    box = start(SandboxSpec(argv=["curl", "https://x"], env=env, cwd=project,
                            writable=[project, run_tmp], proxy_port=3128))
    serve_proxy_on(box.listen_socket)  # 127.0.0.1:3128 inside the sandbox, accepted outside
    status = box.wait()

enter_network(fd, spec) sets up a network namespace someone else made (a container engine's,
for --provider docker: sandbox/container.py) the same way: `lo`, the listening socket, the capture.

Process tree::

    caller --fork--> helper (caller's PID ns) --fork--> init (PID 1) --posix_spawn--> command (PID 2)

The helper lists the host's Unix sockets (before its own network namespace hides them),
unshares new user, network, mount, IPC and PID namespaces, maps the caller's own uid/gid,
sets `lo` up, makes the listening socket and sends it to the caller over a Unix socket pair
(SCM_RIGHTS), forks init, sets up the transparent capture (sandbox/capture.py) while init
works, says it is done, then supervises: init's end, the caller's death (it then ends the
sandbox and removes the run's folder), job control (Ctrl-Z and `fg`, through the terminal).
Init builds the command's view of the filesystem (sandbox/mounts.py `build_granted_view`: an
allow list of folders, sandbox/grants.py, with a /dev and /proc of its own; host sockets inside
it covered, egress's state hidden, the files that run later read-only), enters the working
directory, finds the program on the spec's PATH, applies Landlock (with its signal scope), a new
session keyring, the seccomp filter (sandbox/seccomp.py) and an empty capability bounding set
to itself (its children inherit them), takes a process group of its own (the terminal's
foreground one, or a session of its own without a terminal), waits for the
caller's go (`begin` returns as soon as the helper is forked; the caller sets up its side and
`Sandbox.ready()` says go; `start` is both) and spawns the command with vfork+exec, so that
no third copy of the caller's memory is made. It then reaps orphans and exits with the
command's status as soon as the command ends: the kernel kills whatever else is left in the PID namespace. Init and
the helper send the caller pidfds of their own children (only a parent can open one without
racing the child's reaping); exit statuses travel up as exit codes. The caller learns of
success when the socket pair reaches EOF, and of any failure before exec from an error
message on it.

Root or not, the command always gets a user namespace. Without one, root inside would hold
real capabilities and could `setns` back into the host's network namespace through
/proc/PID/ns/net, move interfaces in, or unmount what hides the host. With one, its
capabilities reach only namespaces owned by that user namespace, so it cannot undo the
confinement. Inside, it keeps the caller's uid: root stays uid 0, but with the bounding set
emptied no one holds a capability after exec. Files owned by
other ids appear as `nobody`. If user namespaces are refused, start() fails: it never runs
the command unconfined. /sys is the host's (sysfs shows the network namespace of whoever
mounted it): inside, /sys/class/net lists the host's interfaces, while `ip link` and
socket.if_nameindex() show the truth, `lo` alone.

Choices, with figures measured on this project's dev VM (2 cores, Linux 6.18, Python 3.11.7;
medians of 50 runs interleaved; the VM is shared and noisy, runs differ by up to ~2x):

* `lo` is set up with one SIOCSIFFLAGS ioctl, not pyroute2, whose import alone costs several
  times a whole run (docs/decisions/pyroute2.md).
* No dataclasses or typing on this path (importing dataclasses alone cost ~17 ms here).
  Importing this module costs ~7 ms, mostly socket (~3 ms) and ctypes (~1.5 ms).
* ``start(spec)`` + ``wait()`` for ``true``, from a small caller, over three quiet runs:
  network=False 5.7-6.3 ms, network=True 5.6-6.7 ms, against 0.93-0.97 ms for
  ``subprocess.run(["true"])`` (x6.1-7.0) and 2.1-2.3 ms for ``unshare -rn true``
  (x2.6-3.0). Without Landlock: 5.4-6.2 ms. Forking the command itself instead of
  posix_spawn cost ~10 ms (x3.8 of unshare -rn).
  From a caller that has imported mitmproxy (69 MB RSS): ~10 ms, because the two forks copy
  the caller's page tables (22-50 ms with three forks). So call start() before importing
  heavy modules: connections made meanwhile wait in the socket's backlog.

Failures before exec raise SandboxError with `.code` (shell conventions, as `env` and `docker run`):
EXIT_SANDBOX (125) the sandbox could not be made, or the directory could not be entered;
EXIT_CANNOT_EXECUTE (126) the program was found but cannot be executed;
EXIT_NOT_FOUND (127) the program was not found. `wait()` returns EXIT_TIMEOUT (124) on timeout.
`.kind` names the failing step: "namespaces", "network", "mounts", "landlock", "privileges", "cwd",
"exec", "internal".

Caveats: start() forks the caller, preferably before other threads exist (when the caller
process dies, however it dies, the helper ends the sandbox and removes `spec.abandoned`); the
caller must not reap children it did not start (waitpid(-1), or SIGCHLD set to SIG_IGN), or
wait() loses the status and reports EXIT_SANDBOX.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import select
import signal
import socket
import struct
from collections.abc import Mapping, Sequence

from egress.core.contract import (
    EXIT_CANNOT_EXECUTE,
    EXIT_LAUNCHER as EXIT_SANDBOX,  # the sandbox failing is the launcher failing
    EXIT_NOT_FOUND,
    EXIT_TIMEOUT,
)
from sandbox import _libc, capture, grants, landlock, mounts, namespaces, netcount, protected, seccomp
from sandbox.box import BaseBox
from sandbox.spec import SandboxError, SandboxSpec, find_program

__all__ = ["Network", "Sandbox", "SandboxError", "SandboxSpec", "begin", "enter_network", "start"]

_BACKLOG = 1024
_HANDSHAKE_TIMEOUT = 30.0  # seconds; only a bug or a frozen machine makes the helper this slow
# Signals the helper and init ignore: terminal and job-control signals go to the command only.
_SUPERVISOR_IGNORES = (
    signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP,
    signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE,
)
# posix_spawn resets these to default in the command (init ignores some, Python others).
_ALL_SIGNALS = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


class Sandbox(BaseBox):
    """A started sandbox. Use as a context manager, or call close() when done."""

    def __init__(self, helper_pid: int, helper_fd: int) -> None:
        self.pid: int | None = None  # the command, in the caller's PID namespace
        self.listen_socket: socket.socket | None = None
        self.capture: list[tuple[str, socket.socket]] = []  # (tag, socket): sandbox/capture.py's
        self.capture_error: str | None = None  # why the capture could not be set up (the run goes on without)
        self.returncode: int | None = None
        self._helper_pid = helper_pid
        self._helper_fd = helper_fd  # pidfd: poll()able for a timed wait
        self._init_fd = -1  # pidfd of PID 1: killing it ends the whole namespace
        self._command_fd = -1  # pidfd of the command: for forwarding signals
        self._netcount: list[int] = []  # the namespace's /proc/net/snmp{,6}, read after the end (netcount)
        self._chan: socket.socket | None = None  # the handshake's socket pair, until ready()

    def ready(self) -> None:
        """Let the command start (once the helper is done), and return once it has been exec'd (at
        once if it has been seen to be). Until then init holds it back, confined and ready, so the
        caller may still write what the command's environment names. Raises SandboxError if the
        sandbox could not be made or the command not started: the box is closed then (nothing
        left running, no descriptor leaked)."""
        chan, self._chan = self._chan, None
        if chan is None:
            return
        try:
            _handshake(self, chan)
            if self.pid is None:  # the helper died without a word (e.g. killed)
                raise SandboxError(EXIT_SANDBOX, "the sandbox helper exited before running the command", "internal")
        except BaseException:
            self.close()
            raise
        finally:
            chan.close()

    def wait(self, timeout: float | None = None) -> int:
        """The command's exit status (128+N if killed by signal N).

        On timeout, kills everything in the sandbox and returns EXIT_TIMEOUT.
        """
        if self.returncode is not None:
            return self.returncode
        self.ready()
        if timeout is not None:
            ready = select.poll()
            ready.register(self._helper_fd, select.POLLIN)
            if not ready.poll(max(0, int(timeout * 1000))):
                self._kill()
                self._reap()
                self.returncode = EXIT_TIMEOUT
                return self.returncode
        self.returncode = self._reap()
        return self.returncode

    def direct_attempts(self) -> int | None:
        """Packets the command tried to send out of its namespace other than through the
        handed-over socket (sandbox/netcount.py); None without the counters (network=False)."""
        return netcount.read(self._netcount) if self._netcount else None

    def close(self) -> None:
        """Kill whatever still runs in the sandbox and release every descriptor. Idempotent."""
        if self._chan is not None:  # closed before ready(): the sandbox goes unfinished
            self._chan.close()
            self._chan = None
        super().close()

    def _running(self) -> bool:
        return self._command_fd >= 0

    def _send(self, sig: int) -> None:
        signal.pidfd_send_signal(self._command_fd, sig)

    def _end(self) -> int:
        if not self._helper_pid:  # reaped already
            return EXIT_SANDBOX
        self._kill()
        return self._reap()

    def _release(self) -> None:
        if self.listen_socket is not None:
            self.listen_socket.close()
        for _, sock in self.capture:
            sock.close()
        for fd in self._netcount:
            os.close(fd)
        self._netcount = []

    def _kill(self) -> None:
        # PID 1 dying makes the kernel kill the rest of its namespace; the helper then exits.
        fd = self._init_fd if self._init_fd >= 0 else self._helper_fd
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self) -> int:
        try:
            _, status = os.waitpid(self._helper_pid, 0)
            code = _exit_code(status)
        except ChildProcessError:  # reaped elsewhere (waitpid(-1) or SIGCHLD ignored by the caller)
            code = EXIT_SANDBOX
        self._helper_pid = 0
        for fd in (self._helper_fd, self._init_fd, self._command_fd):
            if fd >= 0:
                os.close(fd)
        self._helper_fd = self._init_fd = self._command_fd = -1
        return code


def start(spec: SandboxSpec) -> Sandbox:
    """Make the sandbox and exec spec.argv in it; return once exec has succeeded.

    Raises SandboxError (nothing left running, no descriptor leaked) if anything fails first.
    """
    box = begin(spec)
    box.ready()
    return box


def begin(spec: SandboxSpec) -> Sandbox:
    """Start making the sandbox and return at once: the helper and init build it, and exec
    spec.argv, while the caller goes on; :meth:`Sandbox.ready` waits for that (raising
    SandboxError as start() does). The launcher sets up its side meanwhile: in `egress run --
    true` the sandbox took ~9 ms of which the caller only waited.

    Raises SandboxError at once if Landlock is needed and missing (nothing was started).
    """
    if spec.fs_confinement and landlock.abi_version() == 0:
        raise SandboxError(
            EXIT_SANDBOX,
            f"cannot confine writes: {landlock.unavailable_reason()}; "
            "use --no-fs-confinement to run without write confinement",
            "landlock",
        )
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        caller = os.getpid()
        pid = os.fork()
        if pid == 0:
            _run_helper(spec, theirs, caller)  # never returns
        box = Sandbox(pid, os.pidfd_open(pid))
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    box._chan = ours
    return box


class Network:
    """A network namespace someone else made, set up by enter_network(): the sockets made inside."""

    def __init__(self) -> None:
        self.listen_socket: socket.socket | None = None
        self.capture: list[tuple[str, socket.socket]] = []
        self.capture_error: str | None = None

    def close(self) -> None:
        if self.listen_socket is not None:
            self.listen_socket.close()
        for _, sock in self.capture:
            sock.close()


def enter_network(netns: int, spec: SandboxSpec) -> Network:
    """Set up the network namespace behind the descriptor ``netns`` (one a container engine made)
    as start() sets up its own: `lo` up, the proxy's listening socket on 127.0.0.1:spec.proxy_port
    and, with spec.capture, the transparent capture, all made inside by a forked child that entered
    the namespace (setns needs CAP_SYS_ADMIN over it: root, for a namespace Docker made).

    The namespace must have no interface up but `lo`: one that is would be a road out egress did not
    make, and is refused. Raises SandboxError (nothing kept) if anything fails; the capture alone
    failing is said in .capture_error, as by start() (the namespace then has no route out at all).
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    net = Network()
    pid = 0
    try:
        caller = os.getpid()
        pid = os.fork()
        if pid == 0:
            _run_network(spec, theirs, caller, netns)  # never returns
        theirs.close()
        _handshake(net, ours)
        if spec.network and net.listen_socket is None:
            raise SandboxError(EXIT_SANDBOX, "the network helper exited before making the proxy's socket", "internal")
        return net
    except BaseException:
        net.close()
        if pid > 0:  # a child that timed out must not outlive us
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    finally:
        if pid > 0:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # reaped elsewhere: nothing to wait for
                pass
        ours.close()
        theirs.close()


# --- the caller's side of the socket pair --------------------------------------------------
# Messages: b"L" + the listening socket; b"K<tag>" + a capture socket; b"X<why>" the capture
# could not be set up; b"B" + init's pidfd; b"C<pid>" + the command's pidfd;
# b"R" the helper is done (after the capture's); b"E<code>\0<kind>\0<message>" for a failure.
# EOF once init has closed its end after exec. The other way, one message: b"G", which init
# waits for before it spawns, sent by Sandbox.ready() once the helper's b"R" has come.


def _handshake(box: Sandbox | Network, chan: socket.socket) -> None:
    chan.settimeout(_HANDSHAKE_TIMEOUT)
    error: SandboxError | None = None
    while True:
        try:
            msg, anc, _, _ = chan.recvmsg(4096, socket.CMSG_SPACE(4))
        except TimeoutError:
            raise SandboxError(EXIT_SANDBOX, "the sandbox did not start in time", "internal") from None
        except ConnectionResetError:
            # It ended with our go unread. The kernel says so once, possibly before what it had
            # queued for us (a failure's reason): keep reading up to the end.
            continue
        if not msg:
            break
        fds = [struct.unpack("i", data[:4])[0] for level, kind, data in anc
               if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS]
        tag, payload = msg[:1], msg[1:]
        if tag == b"L" and fds:
            box.listen_socket = socket.socket(fileno=fds.pop())
            if isinstance(box, Sandbox):
                # The helper is in the new network namespace now, waiting for init: its counters.
                box._netcount = netcount.open_files(box._helper_pid)
        elif tag == b"K" and fds:
            box.capture.append((payload.decode(), socket.socket(fileno=fds.pop())))
        elif tag == b"X":
            box.capture_error = payload.decode(errors="replace")
        elif tag == b"B" and fds:
            box._init_fd = fds.pop()
        elif tag == b"R":  # the helper is done (the capture set up): the command may start
            try:
                chan.send(b"G")
            except OSError:
                pass  # the sandbox gave up already: its reason is read next
        elif tag == b"C" and fds:
            box._command_fd = fds.pop()
            box.pid = int(payload)
        elif tag == b"E":
            code, step, text = payload.decode(errors="replace").split("\0", 2)
            error = SandboxError(int(code), text, step)
        for fd in fds:
            os.close(fd)
    if error is not None:
        raise error


# --- the sandbox side: helper and init, forked copies of the caller -----------------------------
# They end with os._exit and report failures on the socket pair before exiting with the code.


class _Failure(Exception):
    def __init__(self, code: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.code, self.kind = code, kind


def _child(body):
    """Wrap a forked child's body: report any failure on the socket pair; never return."""

    def run(spec: SandboxSpec, chan: socket.socket, *args: object) -> None:
        code = EXIT_SANDBOX
        try:
            code = body(spec, chan, *args)
        except _Failure as f:
            code = f.code
            _report(chan, f.code, f.kind, str(f))
        except BaseException as e:  # noqa: BLE001 - any surprise must still reach the caller
            _report(chan, EXIT_SANDBOX, "internal", f"sandbox internal error: {e!r}")
        finally:
            os._exit(code)

    return run


def _report(chan: socket.socket, code: int, kind: str, message: str) -> None:
    try:
        chan.send(f"E{code}\0{kind}\0{message.splitlines()[0] if message else kind}".encode())
    except OSError:
        pass


def _send_fd(chan: socket.socket, message: bytes, fd: int) -> None:
    chan.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])


@_child
def _run_helper(spec: SandboxSpec, chan: socket.socket, caller: int) -> int:
    gc.disable()  # collecting the caller's garbage here could close descriptors we reuse
    _quiet_signals(ignore=_SUPERVISOR_IGNORES)
    # No death signal: when the caller dies we must live on long enough to end the sandbox and
    # remove its folders (_supervise watches the caller's pidfd). Init keeps one (on us).
    _install_stdio(spec)
    _close_fds_except({0, 1, 2, chan.fileno()})
    # The host's sockets, read before our own network namespace hides them from /proc/net/unix.
    masked = mounts.MASKED if spec.fs_confinement else ("/run", "/var/run")
    sockets = mounts.host_sockets(home=spec.env.get("HOME"), skip=masked)
    view = _View(spec, sockets)
    # Our own pidfd of the caller: when it dies (even by SIGKILL) we end the sandbox and remove
    # the folders it would have removed. Opened before the check: a caller that died first fails it.
    caller_fd = os.pidfd_open(caller)
    if os.getppid() != caller:
        return EXIT_SANDBOX
    abandoned = _open_parents(spec.abandoned)
    try:
        return _make_and_supervise(spec, chan, view, caller_fd, abandoned)
    finally:
        if select.select([caller_fd], [], [], 0)[0]:  # the caller is gone, whatever happened meanwhile
            _remove_abandoned(abandoned)


def _make_and_supervise(spec: SandboxSpec, chan: socket.socket, view: _View, caller_fd: int,
                        abandoned: list[tuple[int, str]]) -> int:
    # The terminal the command gets as its foreground job: egress's, if egress is in its
    # foreground process group now (else the command gets a session of its own, no terminal).
    terminal = next((fd for fd in (0, 1, 2) if _foreground(fd)), None)
    try:
        namespaces.enter(os.geteuid(), os.getegid())
    except OSError as e:
        raise _Failure(EXIT_SANDBOX, "namespaces", f"cannot make the sandbox: {namespaces.refusal_reason(e)}")
    try:
        _set_up_listener(spec, chan)
    except OSError as e:
        raise _network_failure(e)
    # The capture is set up before init is forked, not while init builds the command's view
    # (which saved ~1 ms): set up meanwhile, the IPv6 default route was acknowledged and in the
    # table when setup returned (a dump said so), yet gone when the command started, in ~1 run
    # of 6 on a loaded machine (IPv4's stayed): the command's IPv6 connections then failed with
    # ENETUNREACH instead of being captured. One after the other: 40 of 40 under the same load.
    try:
        if spec.network and spec.capture:
            _hand_over_capture(chan)
    except OSError as e:
        raise _network_failure(e)
    helper = os.pidfd_open(os.getpid())  # init's way to see that we died before it could notice
    stops = os.pipe() if terminal is not None else None  # init says "the command stopped" (Ctrl-Z)
    init = os.fork()
    if init == 0:
        os.close(caller_fd)
        for parent, _ in abandoned:
            os.close(parent)
        if stops is not None:
            os.close(stops[0])
        _run_init(spec, chan, view, helper, terminal, stops[1] if stops else None)  # never returns
    os.close(helper)
    if stops is not None:
        os.close(stops[1])
    _send_pidfd(chan, b"B", init)
    try:
        chan.send(b"R")
    except OSError as e:
        raise _network_failure(e)
    chan.close()
    return _supervise(init, caller_fd, abandoned, terminal, stops[0] if stops else None)


class _View:
    """What init builds the command's filesystem from, worked out before the namespaces are made."""

    def __init__(self, spec: SandboxSpec, sockets: list[str]) -> None:
        self.sockets = sockets
        later = [] if spec.allow_hooks else [p for tree in spec.writable for p in protected.later_run_paths(tree)]
        # What runs later and exists now is shown read-only (what does not exist is the launcher's:
        # it moves aside what the command made of it, sandbox/protected.py).
        self.read_only = [*spec.read_only, *(p for p in later if os.path.lexists(p))]
        self.replaced = dict(spec.replaced)
        if spec.fs_confinement:
            self.granted = grants.granted(spec.env)
            home = spec.env.get("HOME", "")
            self.empty = [*grants.EMPTY, *grants.LINKS, *([home] if home.startswith("/") else [])]
            self.replaced.update((path, b"") for path in grants.hidden_files(spec.env) if path not in self.replaced)
            # A secret file bound to hosts is shown, with its placeholder, wherever it lies.
            self.granted += [path for path in spec.replaced if os.path.isfile(path)]


def _supervise(init: int, caller_fd: int, abandoned: list[tuple[int, str]], terminal: int | None,
               stops: int | None) -> int:
    """Wait for init; if the caller dies first, end the sandbox and remove the folders it would have.

    Job control, when the command has egress's terminal as a group of its own: the command
    stopped (Ctrl-Z) -> the terminal goes back to egress's group, which is stopped as a shell's
    job is (the shell prints "Stopped" and takes the terminal); egress continued in the
    foreground (`fg`) -> the terminal goes back to the command, which is continued."""
    init_fd = os.pidfd_open(init)
    ready = select.poll()
    ready.register(init_fd, select.POLLIN)
    ready.register(caller_fd, select.POLLIN)
    woken = -1
    if stops is not None:
        ready.register(stops, select.POLLIN)
        woken, wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake)
        signal.signal(signal.SIGCONT, lambda *_: None)  # heard through the wakeup descriptor
        ready.register(woken, select.POLLIN)
    while True:
        events = dict(ready.poll())
        if init_fd in events:
            return _exit_code(os.waitpid(init, 0)[1])
        if caller_fd in events:
            signal.pidfd_send_signal(init_fd, signal.SIGKILL)  # PID 1's end ends the namespace
            os.waitpid(init, 0)
            _remove_abandoned(abandoned)
            return EXIT_SANDBOX
        if stops is not None and stops in events:
            if not os.read(stops, 64):
                ready.unregister(stops)
                continue
            try:
                os.tcsetpgrp(terminal, os.getpgrp())
            except OSError:
                pass
            os.kill(0, signal.SIGTSTP)  # egress's group; we ignore it ourselves
        if woken in events:
            os.read(woken, 512)
            try:
                if os.tcgetpgrp(terminal) == os.getpgrp():  # `fg`, not `bg`: the terminal is ours to hand on
                    os.tcsetpgrp(terminal, init)
            except OSError:
                pass
            try:
                os.killpg(init, signal.SIGCONT)
            except OSError:
                pass


def _open_parents(folders: Sequence[str]) -> list[tuple[int, str]]:
    """(descriptor of the parent, name) for each folder: they reach the host's folder even once
    init has made another view of the filesystem in the mount namespace we share."""
    opened = []
    for folder in folders:
        try:
            opened.append((os.open(os.path.dirname(folder), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC),
                           os.path.basename(folder)))
        except OSError:
            continue
    return opened


def _remove_abandoned(abandoned: list[tuple[int, str]]) -> None:
    import shutil  # only on this rare path

    for parent, name in abandoned:
        shutil.rmtree(name, ignore_errors=True, dir_fd=parent)


def _foreground(fd: int) -> bool:
    try:
        return os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


def _network_failure(error: OSError) -> _Failure:
    # Ubuntu's AppArmor lets unshare succeed but strips the new namespace's capabilities.
    return _Failure(EXIT_SANDBOX, "network", f"cannot set up the sandbox network ({error.strerror}): "
                    f"{namespaces.refusal_reason(error)}")


@_child
def _run_network(spec: SandboxSpec, chan: socket.socket, caller: int, netns: int) -> int:
    """enter_network's child: into the namespace, check it, set it up, exit (its sockets live on)."""
    gc.disable()
    _quiet_signals(ignore=_SUPERVISOR_IGNORES)
    _libc.prctl(_libc.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != caller:
        return EXIT_SANDBOX
    _close_fds_except({0, 1, 2, chan.fileno(), netns})
    try:
        _libc.setns(netns, namespaces.CLONE_NEWNET)
    except OSError as e:
        raise _Failure(EXIT_SANDBOX, "network", f"cannot enter the container's network namespace ({e.strerror}): "
                       "egress must run as root for this")
    others = [name for name in namespaces.interfaces_up() if name != "lo"]
    if others:
        raise _Failure(EXIT_SANDBOX, "network", f"the container's network namespace has interfaces up besides lo "
                       f"({', '.join(others)}): a road out around egress")
    try:
        _set_up_listener(spec, chan)
        if spec.network and spec.capture:
            _hand_over_capture(chan)
    except OSError as e:
        raise _Failure(EXIT_SANDBOX, "network", f"cannot set up the container's network ({e.strerror})")
    return 0


def _set_up_listener(spec: SandboxSpec, chan: socket.socket) -> None:
    """In the namespace: `lo` up, and the proxy's listening socket sent on ``chan`` (the capture's
    come after: _hand_over_capture)."""
    namespaces.loopback_up()
    if spec.network:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ls:
            ls.bind(("127.0.0.1", spec.proxy_port))
            ls.listen(_BACKLOG)
            _send_fd(chan, b"L", ls.fileno())


@_child
def _run_init(spec: SandboxSpec, chan: socket.socket, view: _View, helper: int, terminal: int | None,
              stops: int | None) -> int:
    """PID 1: confine itself (its children inherit it), spawn the command, reap, relay its status."""
    _libc.prctl(_libc.PR_SET_PDEATHSIG, signal.SIGKILL)  # the helper gone -> the namespace goes
    # A helper killed before that line (the caller closed the box while the sandbox was being
    # made) sent no death signal: never start a command nobody waits for.
    if select.select([helper], [], [], 0)[0]:
        return EXIT_SANDBOX
    os.close(helper)
    # Init keeps the namespace's capabilities (it never execs): a command without them must
    # not be able to ptrace it or open its descriptors through /proc/1/fd.
    _libc.prctl(_libc.PR_SET_DUMPABLE, 0)
    host_proc = os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # to tell the caller our pids
    try:
        if spec.fs_confinement:  # an allow list: nothing of the host is there unless granted (sandbox/grants.py)
            mounts.build_granted_view(spec.writable, granted=view.granted, empty=view.empty,
                                      readable=[spec.cwd, *spec.readable], read_only=view.read_only,
                                      hidden=spec.hidden, replaced=view.replaced, sockets=view.sockets)
        else:  # writes anywhere the caller may: the host's own tree, less /run and its sockets
            mounts.build_view(spec.writable, read_only_host=False, mask_tmp=False, readable=[spec.cwd, *spec.readable],
                              read_only=view.read_only, hidden=spec.hidden, replaced=view.replaced,
                              sockets=view.sockets)
    except OSError as e:
        raise _Failure(EXIT_SANDBOX, "mounts", f"cannot make the command's view of the filesystem: {e.strerror}")
    if not spec.fs_confinement:
        namespaces.mount_proc()
    try:
        os.chdir(spec.cwd)
    except OSError as e:
        raise _Failure(EXIT_SANDBOX, "cwd", f"cannot change directory to {spec.cwd}: {e.strerror}")
    path = _find_program(spec.argv[0], spec.env)
    if spec.fs_confinement:
        # The command's own terminal, by the descriptors it gets (reopened as /dev/stdout, /dev/tty's
        # target): its devpts is not in the view, and no other terminal of the user is granted.
        own = [f"/proc/self/fd/{fd}" for fd in (0, 1, 2) if _isatty(fd)]
        try:
            landlock.restrict_writes(spec.writable, devices=(*landlock.DEVICES, *own))
        except OSError as e:
            raise _Failure(EXIT_SANDBOX, "landlock", f"cannot confine writes: {e.strerror}")
    else:
        _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries gain nothing either way
    try:
        namespaces.new_session_keyring()  # before the filter, which refuses keyctl to the command
        seccomp.install()
        namespaces.drop_capabilities()
    except OSError as e:
        raise _Failure(EXIT_SANDBOX, "privileges", f"cannot drop the command's privileges: {e.strerror}")
    # A process group of its own (init's, which the command joins), so that kill(0, ...) and the
    # terminal's signals reach the run and nothing of the caller's: made the terminal's
    # foreground group when egress had the terminal, else a session of its own (no terminal).
    try:
        if terminal is not None:
            os.setpgid(0, 0)
            os.tcsetpgrp(terminal, os.getpgrp())  # init ignores SIGTTOU: allowed from the background
        else:
            os.setsid()
    except OSError as e:
        raise _Failure(EXIT_SANDBOX, "internal", f"cannot give the command a process group of its own: {e.strerror}")
    _wait_for_go(chan)
    try:
        # vfork+exec: no copy of the caller's memory for a process that only execs.
        command = os.posix_spawn(path, spec.argv, spec.env, setsigdef=_ALL_SIGNALS, setsigmask=())
    except OSError as e:
        code = EXIT_NOT_FOUND if e.errno == errno.ENOENT and not os.path.exists(path) else EXIT_CANNOT_EXECUTE
        raise _Failure(code, "exec", f"cannot execute {path}: {e.strerror}")
    _send_pidfd(chan, b"C", command, host_proc)
    os.close(host_proc)
    chan.close()
    while True:  # PID 1 adopts orphans: reap them until the command itself ends
        pid, status = os.waitpid(-1, os.WUNTRACED if stops is not None else 0)
        if pid == command and os.WIFSTOPPED(status):
            # Stopped by the terminal (Ctrl-Z, or reading it from the background): the helper hands
            # the terminal back and stops egress, as a shell would. A SIGSTOP the command sends
            # itself stops only itself: --timeout still ends it.
            if os.WSTOPSIG(status) in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
                try:
                    os.write(stops, b"S")
                except OSError:
                    pass
        elif pid == command:
            return _exit_code(status)


def _wait_for_go(chan: socket.socket) -> None:
    """Hold the command back until the caller's Sandbox.ready() says go (b"G"); the caller's end
    closing instead means it gave up (a launcher failure, a signal): nothing is started."""
    try:
        word = chan.recv(16)
    except OSError:
        word = b""
    if word != b"G":
        raise _Failure(EXIT_SANDBOX, "internal", "the caller gave up before the command started")


def _hand_over_capture(chan: socket.socket) -> None:
    """Set up the transparent capture (sandbox/capture.py) and send its sockets; if the kernel
    refuses (no nf_tables), say why and go on: the namespace stays without a route out."""
    try:
        made = capture.setup(_BACKLOG)
    except OSError as e:
        chan.send(b"X" + f"{e.strerror or e}".encode())
        return
    for tag, sock in made:
        _send_fd(chan, b"K" + tag, sock.fileno())
        sock.close()


def _send_pidfd(chan: socket.socket, tag: bytes, child: int, host_proc: int | None = None) -> None:
    """Send a pidfd of our own child (only its parent can open one without racing its reaping).

    With `host_proc` (a /proc of the caller's PID namespace), also send the child's pid as the
    caller sees it, read from the pidfd's fdinfo.
    """
    fd = os.pidfd_open(child)
    try:
        if host_proc is not None:
            info = os.open(f"self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=host_proc)
            try:
                text = os.read(info, 4096).decode()
            finally:
                os.close(info)
            tag += text.split("\nPid:", 1)[1].split()[0].encode()
        _send_fd(chan, tag, fd)
    finally:
        os.close(fd)


def _find_program(name: str, env: Mapping[str, str]) -> str:
    try:
        return find_program(name, env)
    except SandboxError as e:
        raise _Failure(e.code, e.kind, str(e)) from None


# --- small process plumbing -------------------------------------------------------------------


def _quiet_signals(ignore: Sequence[int]) -> None:
    """Drop the caller's Python signal handlers and wakeup fd; ignore `ignore`, default the rest."""
    signal.set_wakeup_fd(-1)
    for sig in range(1, signal.NSIG):  # not valid_signals(): that builds an enum member per number
        wanted = signal.SIG_IGN if sig in ignore else signal.SIG_DFL
        # getsignal reads Python's own record (no syscall); most signals already match.
        if sig in (signal.SIGKILL, signal.SIGSTOP) or signal.getsignal(sig) is wanted:
            continue
        try:
            signal.signal(sig, wanted)
        except (OSError, ValueError):
            pass  # signals reserved by the C library


def _install_stdio(spec: SandboxSpec) -> None:
    # Duplicate above 2 first so that swapping (e.g. stdout=2, stderr=1) cannot clobber.
    staged = [(i, fcntl.fcntl(fd, fcntl.F_DUPFD, 3)) for i, fd in enumerate((spec.stdin, spec.stdout, spec.stderr))
              if fd is not None]
    for target, fd in staged:
        os.dup2(fd, target)
        os.close(fd)


def _close_fds_except(keep: set[int]) -> None:
    """Close every descriptor the caller had open, so none reaches the sandbox."""
    # Never pass an empty range: CPython 3.11 hands closerange(n, n) to close_range(n, n - 1),
    # which the kernel reads as "n to the end" and closes everything.
    bounds = sorted(keep) + [max(os.sysconf("SC_OPEN_MAX"), max(keep) + 1)]
    low = 0
    for high in bounds:
        if high > low:
            os.closerange(low, high)
        low = high + 1


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code
