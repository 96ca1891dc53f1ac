"""The control socket: another terminal (or a harness) lists runs, grants hosts, follows events.

Each proxy (an `egress run` or an `egress serve`) listens on a Unix socket in
``<state dir>/runs/<id>.sock``: the folder is 0700 and the socket 0600, so only
its owner can talk to it. The protocol is one JSON request line, answered by JSON
lines:

    {"op": "info"}                      -> {"run", "command", "pid", "grants", "started"}
    {"op": "allow", "host": "x.org"}    -> {"ok": true, "host": "x.org"}   (this run only, exact name;
                                           an `egress serve` answers {"error": ...}: grants are per run)
    {"op": "reload"}                    -> {"ok": true}   (re-read the policy files now)
    {"op": "events"}                    -> one event per line, as they happen, until the client leaves

Who may talk: file permissions stop other users, but not the sandboxed command, which runs
as the same user (and Landlock does not mediate connect() on Unix sockets). So each peer is
checked before its request is read: it must live in the control server's own user
namespace. Every `egress run` command lives in a user namespace of its own, so this refuses
any sandboxed process, of this run or another. The peer is pinned with SO_PEERPIDFD (Linux
6.5+), its /proc/<pid>/ns/user compared with ours, then the pidfd's process confirmed alive
(so the pid we looked at was not reused meanwhile). On older kernels the pid comes from
SO_PEERCRED and is pinned with pidfd_open at accept time, which leaves the (short) window
between connect() and accept open to pid reuse. A peer we cannot establish (exited, not
visible in our pid namespace, /proc unreadable) is refused like a sandboxed one: one line
``{"error": ...}`` and the connection closed, nothing it sent acted on.

On macOS there are no user namespaces: the command's Seatbelt profile refuses it any Unix
socket outside its run's own folder (and egress's state folder is unreadable to it), and the
server itself asks the kernel about each peer: the same uid (LOCAL_PEERCRED), and not inside any
sandbox (LOCAL_PEERPID, then libsystem_sandbox's sandbox_check). A pid can be reused between
connect() and that question, as with SO_PEERCRED on older Linux kernels.

It runs in a thread of its own, so it answers before the (lazily started) proxy exists.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

from egress.proxy.ca import StateDir

TYPE_CHECKING = False  # typing is not imported on egress run's path (egress.run.launcher); mypy reads True
if TYPE_CHECKING:
    import queue

# Every `egress run` makes a RunState and a ControlServer before its command's first connection;
# queue and egress.core.hosts are imported where they are first needed (a follower, a grant), and
# socketserver not at all: together ~6 ms of `egress run -- true`. So is json (with re: ~3-5 ms),
# imported where a client's request is read.


FOLLOWER_QUEUE = 10000  # events a follower may fall behind by before they are dropped


class GrantRefused(ValueError):
    """This proxy takes no grants (an `egress serve`); the message says what to do instead."""


class RunState:
    """What the control socket shows and changes: grants and the event stream of one proxy.

    ``no_grants``: why this proxy takes no grants, or None. A grant is one person's decision
    for one command's run, gone when it ends. An `egress serve` is shared by every client
    that points at it and outlives them all; a grant there would be a policy change that no
    file records, lost at the next restart. Its road is the policy file, reloaded live.
    """

    def __init__(self, run_id: str, command: list[str], no_grants: str | None = None):
        self.run_id = run_id
        self.command = command
        self.no_grants = no_grants
        self.started = time.time()
        self.grants: set[str] = set()
        self.on_grant: list[Callable[[str], None]] = []  # wakes requests held for a host
        self.on_reload: list[Callable[[], None]] = []  # the policy watcher's reload_now
        self.extra: dict = {}  # shown by info (e.g. serve's metrics address)
        self._followers: list[queue.Queue] = []
        self._lock = threading.Lock()
        self.dropped = 0  # events a follower missed because its queue was full
        self.on_drop: Callable[[], None] = lambda: None  # e.g. the events-dropped metric's inc
        # told how many follow now, whenever that changes (serve's supervisor: whether its
        # workers send every event or only upstream failures)
        self.on_followers: Callable[[int], None] = lambda count: None

    def grant(self, host: str) -> str:
        """Allow ``host`` (that exact name) for the rest of the run. Raises egress.core.hosts.InvalidHost,
        or GrantRefused where grants are not applied (egress serve)."""
        from egress.core.hosts import InvalidHost, parse_host

        if self.no_grants is not None:
            raise GrantRefused(self.no_grants)
        name = parse_host(host)
        if name.is_ip:
            raise InvalidHost(f"{host!r}: IP literals are never granted; add them to the policy")
        self.grants.add(name.name)
        for callback in list(self.on_grant):
            callback(name.name)
        return name.name

    def publish(self, event) -> None:
        """Recorder subscriber: fan the event out to every follower; never blocks.

        A follower that stopped reading (its socket full, its queue full) loses events,
        counted in ``dropped``; it used to block here, and with it the proxy.
        """
        if not self._followers:  # nobody follows: not even the JSON is made
            return
        self.publish_line(event.to_json())

    def publish_line(self, line: str) -> None:
        """An event already made JSON (a serve worker's, relayed by its supervisor): as publish."""
        if not self._followers:
            return
        import queue

        with self._lock:
            for follower in self._followers:
                try:
                    follower.put_nowait(line)
                except queue.Full:
                    self.dropped += 1
                    self.on_drop()

    def follow(self, limit: int = FOLLOWER_QUEUE) -> queue.Queue:
        import queue

        follower: queue.Queue = queue.Queue(maxsize=limit)
        with self._lock:
            self._followers.append(follower)
            self.on_followers(len(self._followers))
        return follower

    def unfollow(self, follower: queue.Queue) -> None:
        with self._lock:
            self._followers.remove(follower)
            self.on_followers(len(self._followers))

    def info(self) -> dict:
        return {"run": self.run_id, "command": self.command, "pid": os.getpid(),
                "grants": sorted(self.grants), "started": self.started, **self.extra}


# Python 3.11's socket module predates the name; the number is the kernel's (asm-generic/socket.h).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)

REFUSED = ("this control socket answers only processes outside egress sandboxes "
           "(run `egress allow` or `egress runs` from your own terminal, not from the sandboxed command)")


def peer_pidfd(conn: socket.socket) -> int:
    """A pidfd for the process that connected ``conn`` (SO_PEERPIDFD, else SO_PEERCRED's pid)."""
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        if e.errno != errno.ENOPROTOOPT:  # only "the kernel predates it" falls back; anything else refuses
            raise
    return peercred_pidfd(conn)


def peercred_pidfd(conn: socket.socket) -> int:
    """Before Linux 6.5: the peer's pid from SO_PEERCRED, pinned from now on by a pidfd."""
    pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if pid <= 0:  # 0: the peer is in a pid namespace we cannot see
        raise ProcessLookupError(f"SO_PEERCRED gave pid {pid}")
    return os.pidfd_open(pid)


def _namespace(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def pidfd_user_namespace(pidfd: int) -> tuple[int, int]:
    """The user namespace (st_dev, st_ino) of the pidfd's process; raises if it cannot be known for sure."""
    pid = -1
    with open(f"/proc/self/fdinfo/{pidfd}") as info:  # the pid as our /proc numbers it
        for line in info:
            if line.startswith("Pid:"):
                pid = int(line.split()[1])
    if pid <= 0:  # -1: it exited; 0: not in our pid namespace
        raise ProcessLookupError(f"the peer has no pid here ({pid})")
    namespace = _namespace(f"/proc/{pid}/ns/user")
    # Still alive after we looked, so that pid was still this process (pids are reused only once freed).
    signal.pidfd_send_signal(pidfd, 0)
    return namespace


def own_user_namespace() -> tuple[int, int] | None:
    """Our user namespace, or None if /proc cannot tell (then every peer is refused)."""
    try:
        return _namespace("/proc/self/ns/user")
    except OSError:
        return None


def peer_in_namespace(conn: socket.socket, namespace: tuple[int, int] | None) -> bool:
    """True only if the peer of ``conn`` is known to live in user namespace ``namespace`` (ours:
    so outside any sandbox). Anything that cannot be established refuses."""
    try:
        pidfd = peer_pidfd(conn)
        try:
            peer = pidfd_user_namespace(pidfd)
        finally:
            os.close(pidfd)
    except Exception:  # whatever we could not establish refuses
        return False
    return namespace is not None and peer == namespace


def peer_unsandboxed_darwin(conn: socket.socket) -> bool:
    """macOS: True only if the peer runs as our uid and outside every sandbox (see the module's
    docstring); anything that cannot be established refuses."""
    import ctypes

    sol_local, local_peercred, local_peerpid = 0, 1, 2  # <sys/un.h>
    try:
        # struct xucred: u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16]
        cred = conn.getsockopt(sol_local, local_peercred, 76)
        uid = struct.unpack_from("I", cred, 4)[0]
        pid = struct.unpack("i", conn.getsockopt(sol_local, local_peerpid, 4))[0]
        check = ctypes.CDLL(None).sandbox_check  # libsystem_sandbox, part of libSystem
        check.argtypes, check.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int], ctypes.c_int
        return uid == os.getuid() and pid > 0 and check(pid, None, 0) == 0  # 0: not sandboxed
    except Exception:  # whatever we could not establish refuses
        return False


class _Handler:
    """One client of the control socket (as socketserver's StreamRequestHandler, without it)."""

    def __init__(self, connection: socket.socket, server: ControlServer):
        self.connection, self.server = connection, server
        self.rfile = connection.makefile("rb")
        self.wfile = connection.makefile("wb")
        try:
            self.handle()
            self.wfile.flush()
        except OSError:
            pass  # the client left
        finally:
            for stream in (self.rfile, self.wfile):
                try:
                    stream.close()  # the writer's close flushes: to a client that left, it fails
                except OSError:
                    pass

    def handle(self) -> None:
        import json
        import queue

        from egress.core.hosts import InvalidHost

        state = self.server.state
        try:
            request = json.loads(self.rfile.readline() or b"{}")
        except ValueError:
            return self._send({"error": "expected one JSON object per line"})
        op = request.get("op")
        if op == "info":
            self._send(state.info())
        elif op == "allow":
            try:
                host = state.grant(str(request.get("host", "")))
            except (InvalidHost, GrantRefused) as e:
                return self._send({"error": str(e)})
            self._send({"ok": True, "host": host})
        elif op == "reload":
            if not state.on_reload:
                return self._send({"error": "this proxy has not started yet: it reads the policy when it does"})
            for callback in state.on_reload:
                callback()
            self._send({"ok": True})
        elif op == "events":
            follower = state.follow()
            try:
                while True:
                    try:
                        line = follower.get(timeout=1.0)
                    except queue.Empty:
                        line = None
                    if line is None:
                        # Nothing to say: probe whether the client is still there.
                        self.connection.setblocking(False)
                        try:
                            if self.connection.recv(1, socket.MSG_PEEK) == b"":
                                return
                        except BlockingIOError:
                            pass
                        finally:
                            self.connection.setblocking(True)
                        continue
                    self.wfile.write(line.encode() + b"\n")
                    self.wfile.flush()
            except OSError:
                return
            finally:
                state.unfollow(follower)
        else:
            self._send({"error": f"unknown op {op!r}; known: info, allow, reload, events"})

    def _send(self, obj: dict) -> None:
        import json

        self.wfile.write(json.dumps(obj).encode() + b"\n")


class ControlServer:
    """Serves a RunState on ``<runs dir>/<run id>.sock`` until :meth:`close`.

    Its own accept loop with a wake-up pipe: socketserver's ``shutdown`` waits for a
    0.5 s poll, which every `egress run` would pay at exit.
    """

    def __init__(self, state: RunState, state_dir: StateDir | str | os.PathLike | None = None):
        state_dir = StateDir.of(state_dir)
        directory = state_dir.runs
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        self.path = run_socket(state_dir, state.run_id)
        self.state = state
        self._user_namespace = own_user_namespace()  # None (no /proc): every peer is refused
        self._darwin = sys.platform == "darwin"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            self._sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        self._sock.listen(16)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="egress-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self._sock, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            try:
                conn, address = self._sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn, address), daemon=True).start()

    def _handle(self, conn: socket.socket, address) -> None:
        with conn:
            if not self.peer_allowed(conn):
                import json

                try:
                    conn.sendall(json.dumps({"error": REFUSED}).encode() + b"\n")
                except OSError:
                    pass
                return
            _Handler(conn, self)

    def peer_allowed(self, conn: socket.socket) -> bool:
        """True only if the peer is known to live in our own user namespace (so outside any sandbox);
        on macOS, to run as our uid outside every sandbox."""
        if self._darwin:
            return peer_unsandboxed_darwin(conn)
        return peer_in_namespace(conn, self._user_namespace)

    def close(self) -> None:
        self._wake_w.send(b"x")
        self._thread.join(5)
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def request(path: str | os.PathLike, payload: dict, timeout: float = 5.0):
    """Send one request to a control socket; yield each JSON answer line."""
    import json

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        try:
            sock.sendall(json.dumps(payload).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # a server that refuses us may close before we write: its answer is still there to read
        if payload.get("op") == "events":
            sock.settimeout(None)
        with sock.makefile("rb") as answers:
            try:
                for line in answers:
                    yield json.loads(line)
            except ConnectionResetError:
                # A server that refuses closes with our request unread, which resets the
                # connection once its answer has been read: that answer was the last.
                return


def run_socket(state_dir: StateDir | str | os.PathLike | None, run_id: str) -> str:
    """Where run ``run_id`` (or ``serve-<pid>``) answers."""
    return os.path.join(StateDir.of(state_dir).runs, f"{run_id}.sock")


def list_runs(state_dir: StateDir | str | os.PathLike | None) -> list[dict]:
    """Every live run's info; sockets left by runs that died are removed."""
    from pathlib import Path

    runs = []
    directory = Path(StateDir.of(state_dir).runs)
    for path in sorted(directory.glob("*.sock")) if directory.is_dir() else []:
        try:
            answers = request(path, {"op": "info"}, timeout=2.0)
            runs.extend(a for a in answers if "error" not in a)  # a refused caller is shown no runs
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
        except OSError:
            continue
    return runs

