"""The warm proxy: where `egress run` finds it, how it is started, and how the two talk.

A per-user process (egress/run/warm/server.py) that has imported mitmproxy and loaded the CA
once, and forks one child per run. `egress run` connects to it and hands over, through
SCM_RIGHTS, the audit log and metrics socket it opened, the listening socket made inside the
command's network namespace, and once the child serves its stdout and stderr (a child that
held them while building a proxy a `true` never used kept egress's readers waiting); the child builds that run's
proxy from the run's configuration and policy texts, and the connection stays the run's
channel (events and grant questions back, answers, grants and reload requests forth).
This module is the launcher's side and what both sides share; it imports nothing heavy,
because every `egress run` reads it.

Files, in ``<state dir>/warm/`` (0700; the state folder is hidden from sandboxed commands):

    <key>.sock   the server's socket (0600)
    <key>.lock   flock()ed by the running server: at most one per key
    <key>.json   {"pid", "started", "idle", "python", "egress"} of the running server
    <key>.log    the server's own stderr

``<key>`` names the installation (interpreter and the folders egress and sandbox are
imported from), so two installations sharing a state folder never use each other's code.

The protocol is messages (dicts) in frames: 4 bytes of length (big-endian), then the message
as `marshal` writes it; a message with ``"fds": [names]`` carries that many descriptors, sent
with its frame's first byte (descriptors are queued as they arrive and taken in order, so a read
that spans two frames cannot mismatch them). marshal, not JSON: it is built into the interpreter,
and importing json (with re, which compiles its patterns at import) cost ~3-5 ms of every
`egress run`, in the launcher's part of the sandbox's start, its longer one (bench/README.md,
"Launch without pathlib and json"). marshal reads only what the same interpreter wrote (the
installation key names it) and trusts its input: both ends are the same user outside every
sandbox (the server checks each peer before reading: egress.run.warm.server), as with every other
process of that user.
"""

from __future__ import annotations

import errno
import fcntl
import marshal
import os
import socket
import sys
import zlib

import egress
import sandbox
from egress.proxy.ca import StateDir

# Paths are str here: `egress run` reads this module, and never imports pathlib (egress.proxy.ca says why).

# 2: stdout and stderr come with a `stdio` op once the child serves; 3: marshal frames;
# 4: a refusal's event asks to be "said" back once its line is written (egress.proxy.addons.line_first)
PROTOCOL = 4
DEFAULT_IDLE = 600.0  # seconds the server lingers without a run before it exits
IDLE_ENV = "EGRESS_WARM_IDLE"  # seconds; read by the launcher that starts the server
MAX_FDS = 8
MAX_MESSAGE = 64 * 1024 * 1024  # bytes of one message (a request holds the environment and policy texts)
SUN_PATH_MAX = 108  # sockaddr_un.sun_path, with its terminating NUL


class WarmError(Exception):
    """The warm proxy could not take the run (the launcher then serves it in-process)."""


def installation() -> dict:
    """What makes a server's code ours: the interpreter as invoked (a venv's python names the venv,
    so its mitmproxy; resolving the link would name only the base interpreter), its prefix, and
    where egress and sandbox come from."""
    return {"python": os.path.abspath(sys.executable), "prefix": sys.prefix,
            "egress": os.path.dirname(os.path.realpath(egress.__file__)),
            "sandbox": os.path.dirname(os.path.realpath(sandbox.__file__))}


def installation_key(identity: dict) -> str:
    """With the protocol's version: a server speaking another never gets this installation's runs."""
    text = "\0".join([*(identity[k] for k in ("python", "prefix", "egress", "sandbox")), str(PROTOCOL)])
    return f"{zlib.crc32(text.encode()):08x}"


class Paths:
    """The warm server's files for one state folder and installation."""

    def __init__(self, state_dir: StateDir | str | os.PathLike, key: str):
        state = StateDir.of(state_dir)
        self.state_dir = state.root
        self.key = key
        self.folder = state.warm
        self.socket = os.path.join(self.folder, f"{key}.sock")
        self.lock = os.path.join(self.folder, f"{key}.lock")
        self.info = os.path.join(self.folder, f"{key}.json")
        self.log = os.path.join(self.folder, f"{key}.log")

    @classmethod
    def for_state(cls, state_dir: StateDir | str | os.PathLike | None) -> Paths:
        return cls(os.path.abspath(StateDir.of(state_dir).root), installation_key(installation()))

    def make_folder(self) -> None:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        os.chmod(self.folder, 0o700)


def idle_seconds(environ=os.environ) -> float:
    try:
        return max(0.1, float(environ.get(IDLE_ENV, DEFAULT_IDLE)))
    except ValueError:
        return DEFAULT_IDLE


# ------------------------------------------------------------------ framing


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    """One frame; with ``fds``, the descriptors go with its first byte."""
    body = marshal.dumps(message)
    data = len(body).to_bytes(4, "big") + body
    if fds:
        import array

        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


class Reader:
    """Messages and the descriptors that came with them, from a stream socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = b""
        self._fds: list[int] = []
        self.closed = False

    def _fill(self, flags: int = 0) -> None:
        import array

        fds = array.array("i")
        data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(MAX_FDS * fds.itemsize),
                                                  flags | socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        self._fds.extend(fds)
        if not data:
            self.closed = True
        self._buffer += data

    def read(self) -> tuple[dict, list[int]] | None:
        """The next message and its descriptors (blocking as the socket does); None at EOF."""
        while not self._complete():
            if self.closed:
                return None
            self._fill()
        return self._pop()

    def read_ready(self) -> list[tuple[dict, list[int]]]:
        """Whatever can be read without blocking: one recv, then every complete message.
        (The socket itself stays blocking, for the writers.)"""
        if not self.closed:
            try:
                self._fill(socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                pass
        messages = []
        while self._complete():
            messages.append(self._pop())
        return messages

    def _complete(self) -> bool:
        """True if the buffer holds a whole frame. Raises WarmError for a length past MAX_MESSAGE."""
        if len(self._buffer) < 4:
            return False
        size = int.from_bytes(self._buffer[:4], "big")
        if size > MAX_MESSAGE:
            raise WarmError(f"a message of {size} bytes (at most {MAX_MESSAGE})")
        return len(self._buffer) >= 4 + size

    def _pop(self) -> tuple[dict, list[int]]:
        size = int.from_bytes(self._buffer[:4], "big")
        body, self._buffer = self._buffer[4:4 + size], self._buffer[4 + size:]
        try:
            message = marshal.loads(body)
        except (ValueError, EOFError, TypeError) as e:
            raise WarmError(f"an unreadable message ({e})") from None
        if not isinstance(message, dict):
            raise WarmError(f"a message that is no dict ({type(message).__name__})")
        count = len(message.get("fds", ()))
        if count > len(self._fds):
            raise WarmError(f"a message announced {count} descriptors and brought {len(self._fds)}")
        fds, self._fds = self._fds[:count], self._fds[count:]
        return message, fds

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


# ------------------------------------------------------------ the launcher's side


def connect(paths: Paths) -> socket.socket | None:
    """A connection to the running server, or None if none is listening now (never waits)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(paths.socket)
    except OSError:  # no socket (ENOENT), a dead server's (ECONNREFUSED), a full backlog (EAGAIN)
        sock.close()
        return None
    sock.setblocking(True)
    return sock


def peer_is_ours(sock: socket.socket, namespace: tuple[int, int] | None) -> bool:
    """The process at the other end of ``sock`` (for a launcher, the one that listens) runs as our
    user in user namespace ``namespace`` (ours: so outside every sandbox). Both ends ask it: the
    server of each launcher, and each launcher of the server, before it sends a word (see
    Handover.try_send). Anything that cannot be established is a no."""
    import struct

    from egress.host.control import peer_in_namespace

    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return False
    return uid == os.geteuid() and peer_in_namespace(sock, namespace)


def server_running(paths: Paths) -> bool:
    """True if a server holds the lock (it may still be starting)."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


def spawn(paths: Paths, idle: float) -> int | None:
    """Start a server in the background (its own session, stderr to its log); its pid, or None.

    Its environment is the bare minimum to import the same code: no variable of the
    caller's (a long-lived process must not keep the caller's secrets); each run's child
    gets that run's environment from the launcher. Its import path is the interpreter's own,
    and egress's two packages: egress/run/warm/boot.py says why.
    """
    try:
        paths.make_folder()
        identity = installation()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": os.environ.get("LANG", "C.UTF-8")}
        if "HOME" in os.environ:
            env["HOME"] = os.environ["HOME"]
        import site

        flags = ["-E", "-P"] if site.ENABLE_USER_SITE else ["-E", "-P", "-s"]
        argv = [sys.executable, *flags, os.path.join(identity["egress"], "run", "warm", "boot.py"), "egress.run.warm.server",
                identity["egress"], identity["sandbox"],
                "--state-dir", paths.state_dir, "--key", paths.key, "--idle", f"{idle:g}"]
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 2, paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)]
        return os.posix_spawn(sys.executable, argv, env, file_actions=actions, setsid=True)
    except OSError:
        return None


def _exited(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done != 0


def read_info(paths: Paths) -> dict | None:
    """The running server's record, or None if no server runs (a stale record is ignored)."""
    if not server_running(paths):
        return None
    import json  # the record is JSON (for people and tools); only `egress doctor` reads it here

    try:
        with open(paths.info, encoding="utf-8") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


class Handover:
    """One run's link to the warm proxy: its request, and the connection it travels on.

    Made on the launcher's main thread before the sandbox starts (no thread yet, as the
    sandbox's fork wants): the request goes at once if a server listens, so the run's
    child builds the proxy while the sandbox starts; if none listens, one is started and
    the session thread sends the request once it does (:meth:`try_send`).
    """

    def __init__(self, paths: Paths, request: dict, fds: dict[str, int]):
        self.paths = paths
        self.request = dict(request, op="run", protocol=PROTOCOL, fds=list(fds))
        self._fds = list(fds.values())
        self.sock: socket.socket | None = None
        self.reader: Reader | None = None
        self.sent = False
        self.failed = False  # no server will come: the one started for this run died
        self.note: str | None = None  # why the run was not served warm, if a person should know
        self.pid: int | None = None  # the run's child, once it serves
        self._spawned: int | None = None
        import threading

        self._lock = threading.Lock()

    @classmethod
    def offer(cls, state_dir: str | os.PathLike | None, request: dict, fds: dict[str, int]) -> Handover | None:
        """Send the run's request to the warm server now, or start one; None if the state
        folder cannot hold one (the run is then served in-process)."""
        try:
            paths = Paths.for_state(state_dir)
            if len(os.fsencode(paths.socket)) >= SUN_PATH_MAX:
                return None  # no Unix socket can be bound there
            paths.make_folder()
        except OSError:
            return None
        handover = cls(paths, request, fds)
        handover.try_send()
        return handover

    def try_send(self) -> bool:
        """Connect and send the request if a server listens now, else make sure one is starting
        (started by this run at most once); True once the request is sent."""
        if self.sent:
            return True
        sock = connect(self.paths)
        if sock is None:
            if self._spawned is None and not server_running(self.paths):
                self._spawned = spawn(self.paths, idle_seconds()) or -1
            if self._spawned == -1 or (self._spawned is not None and _exited(self._spawned)
                                       and not server_running(self.paths)):
                # The server this run started could not start, or died. (One that found the lock
                # taken exits too: another run's server is starting, and this run waits for it;
                # two first runs at once made the later one fall back to lazy.)
                self.failed = True
                self.note = f"the warm proxy could not start (its log: {self.paths.log})"
            return False
        from egress.host.control import own_user_namespace

        if not peer_is_ours(sock, own_user_namespace()):
            # Measured: a command whose writable tree held the state folder moved it away (a hidden
            # folder's parent could be renamed; the sandbox now pins it), listened at this path from
            # inside its sandbox, and was sent the next run's request (its environment, credentials,
            # stdio) and listening socket. Not a word goes to such a listener; the run serves
            # itself, and says why.
            sock.close()
            self.failed = True
            self.note = (f"{self.paths.socket} is not served by this user's warm proxy (a process of "
                         f"another user, or inside a sandbox, listens there); nothing was sent to it")
            return False
        try:
            sock.settimeout(5.0)  # a large request to a server still importing: not forever
            send(sock, self.request, self._fds)
            sock.settimeout(None)
        except OSError:
            sock.close()
            return False
        self.sock, self.reader, self.sent = sock, Reader(sock), True
        return True

    def again(self) -> None:
        """The server refused the run because it is stopping (stale code, a signal): drop this
        connection; the next :meth:`try_send` goes to (or starts) its successor."""
        self.close()
        self.sock = self.reader = None
        self.sent = False

    def send(self, message: dict, fds: list[int] = ()) -> None:
        with self._lock:
            send(self.sock, message, fds)

    def send_quietly(self, message: dict, fds: list[int] = ()) -> None:
        """Send if the link is still up (an answer or a stop to a proxy that is gone is moot)."""
        try:
            self.send(message, fds)
        except (OSError, AttributeError):
            pass

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.sock is not None:
            self.sock.close()
