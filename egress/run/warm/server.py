"""The warm proxy server: one per user (state folder) and installation, forking one child per run.

    python -m egress.run.warm.server --state-dir DIR --key KEY --idle SECONDS

Started by `egress run` (egress.run.warm.client.spawn) when none is running, in a session of its
own with its stderr in ``<state>/warm/<key>.log``. It binds its socket first (runs that
come meanwhile wait in the backlog), then imports everything a run's proxy needs and
loads the CA once. Its loop is single-threaded, so fork() is safe; for each connection:

* the peer must be a process of this user in this user namespace (egress.host.control's
  check: never a sandboxed command, whose user namespace is its own), else it is told
  so and closed, unforked;
* if egress's code changed on disk since this server imported it (an upgrade, an
  edit), the run is refused as "stale" and the server stops; the launcher serves that
  run in-process and the next run starts a fresh server;
* otherwise it forks. The child reads the run's request (egress.run.warm.client's protocol), takes
  the run's stdout and stderr, working folder, umask and environment, builds that run's
  policy, credentials and proxy exactly as the in-process path would (egress.run.session),
  and serves the listening socket the launcher hands over. The parent closes its copy
  of the connection at once and never reads a request: no run's policy, grants or
  events ever exist in the parent, so no later child can inherit them.

A child that dies takes only its run. The server exits after ``--idle`` seconds without a
run in progress, on SIGTERM or SIGINT, or when stale; it stops listening first (the socket
is removed, then what was already queued is still served), then releases its lock.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path

from egress.run.warm import client as warm

LOCK_WAIT = 3.0  # seconds to wait for a server that is stopping to release the lock
# A spare child is forked ahead of the next run, and rehearses a run's build while it waits:
# forking this ~90 MB process took 3-15 ms, and a first build in a fresh child ~10 ms against
# ~5 ms once rehearsed, on the run's critical path and competing with its sandbox for the CPUs.
# The next spare is forked when a run ends (runs follow one another), or this long after the
# last one was handed over (not to compete with that run's start), whichever comes first.
SPARE_PAUSE = 1.0
REQUEST_WAIT = 30.0  # seconds a child waits for its run's request


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} egress warm server {os.getpid()}: {message}",
          file=sys.stderr, flush=True)


# ------------------------------------------------------------------ its code


def code_folders() -> list[Path]:
    """Where the code a run's proxy executes lives, besides mitmproxy and the interpreter: every
    package folder of egress and sandbox (egress/ itself held only its top modules once the
    layers became packages, and an edit below it went unseen), and the built-in policies."""
    import egress
    import sandbox
    from egress.policy.loader import builtin_dir

    roots = [Path(egress.__file__).parent, Path(sandbox.__file__).parent]
    packages = sorted(Path(folder) for root in roots for folder, _, files in os.walk(root) if "__init__.py" in files)
    return [*packages, builtin_dir()]


def code_fingerprint(folders: list[Path]) -> tuple:
    """Every source and policy file's identity (inode, size, mtime), the mitmproxy package's
    folder (replaced by an upgrade) and the interpreter: a change to any means stale code."""
    import importlib.util

    marks = []
    for folder in folders:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            marks.append((str(folder), None))
            continue
        for entry in entries:
            if entry.name.endswith((".py", ".toml")):
                try:
                    info = entry.stat()
                except OSError:
                    marks.append((entry.path, None))
                    continue
                marks.append((entry.path, info.st_ino, info.st_size, info.st_mtime_ns))
    spec = importlib.util.find_spec("mitmproxy")
    for path in [*(spec.submodule_search_locations or []), sys.executable] if spec else [sys.executable]:
        try:
            info = os.stat(path)
            marks.append((path, info.st_ino, info.st_mtime_ns))
        except OSError:
            marks.append((path, None))
    return tuple(marks)


def warm_up(state_dir: Path) -> None:
    """Import what a run's proxy needs and do once what every run would do again."""
    import asyncio  # noqa: F401

    import dns.asyncresolver  # noqa: F401

    # Imported for their import's sake: a run's child would otherwise import them after the fork.
    import egress.run.launcher  # noqa: F401  the run's policy functions
    import sandbox.paths  # noqa: F401
    from egress.core.public_suffix import registrable_domain, suffix_rules
    from egress.host import live, service  # noqa: F401
    from egress.policy import settings  # noqa: F401
    from egress.policy.loader import _builtin_sets
    from egress.proxy import master, mitm  # noqa: F401
    from egress.proxy.addons import credential_guard  # noqa: F401
    from egress.proxy.ca import StateDir
    from egress.run import ask, session, snapshot  # noqa: F401
    from egress.run.warm import child  # noqa: F401  the run's side, with everything it imports
    from egress.scan import credentials, detect  # noqa: F401

    suffix_rules()  # every policy entry is checked against the public suffix list
    registrable_domain("example.com")  # every refusal's metric label (tldextract builds a trie)
    _builtin_sets()  # the built-in `dev` set
    mitm.preload_ca(Path(StateDir.of(state_dir).ca))


# ------------------------------------------------------------------ the parent


class Server:
    def __init__(self, paths: warm.Paths, idle: float, lock: int = -1):
        self.paths = paths
        self.idle = idle
        self.lock = lock  # the flock()ed descriptor: children close it, or they would keep it held
        self.listener: socket.socket | None = None
        self.children: set[int] = set()  # those serving a run
        self.spare: tuple[int, socket.socket] | None = None  # (pid, our end) of a child waiting for a run
        self.spare_ready = False  # it has rehearsed (it said so on its end)
        self._spare_due: float | None = 0.0  # when to fork the next spare (None: not now)
        self._lost_spares: set[int] = set()  # spares that went before they were reaped
        self.stopping = False
        self.stale = False
        self.fingerprint: tuple = ()
        self.folders: list[Path] = []
        self.identity = warm.installation()
        from egress.host.control import own_user_namespace

        self.namespace = own_user_namespace()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def listen(self) -> None:
        _unlink(self.paths.socket)  # a dead server's (we hold the lock)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # born 0600
        try:
            sock.bind(self.paths.socket)
        finally:
            os.umask(old)
        sock.listen(128)
        self.listener = sock
        info = {"pid": os.getpid(), "started": time.time(), "idle": self.idle, **self.identity}
        tmp = Path(self.paths.info).with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(self.paths.info)

    def run(self) -> None:
        signal.set_wakeup_fd(self._wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._stop)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        last_run = time.monotonic()
        while not self.stopping:
            self._reap()
            now = time.monotonic()
            if not self.children:
                last_run = max(last_run, self._last_exit)
                remaining = last_run + self.idle - now
                if remaining <= 0:
                    log(f"idle for {self.idle:g} s: exiting")
                    break
            else:
                remaining = None
            if self.spare is None and self._spare_due is not None:
                if now >= self._spare_due:
                    self._fork_spare()
                else:
                    remaining = min(remaining, self._spare_due - now) if remaining is not None else self._spare_due - now
            watched = [self.listener, self._wake_r]
            if self.spare is not None and not self.spare_ready:
                watched.append(self.spare[1])
            try:
                ready, _, _ = select.select(watched, [], [], remaining)
            except InterruptedError:
                continue
            if self._wake_r in ready:
                self._drain_wake()
            if self.spare is not None and self.spare[1] in ready:
                self._spare_spoke()
            if self.listener in ready:
                self._accept()
        self.shutdown()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _spare_spoke(self) -> None:
        """The spare said it has rehearsed, or closed its end without a word (it is ending)."""
        try:
            word = self.spare[1].recv(1)
        except OSError:
            word = b""
        if word == b"R":
            self.spare_ready = True
        else:  # reaped as a spare, not a run
            self._lost_spares.add(self.spare[0])
            self.spare[1].close()
            self.spare, self.spare_ready = None, False
            self._spare_due = time.monotonic() + 1.0

    _last_exit = 0.0

    def _stop(self, number, _frame) -> None:
        log(f"signal {number}: exiting")
        self.stopping = True

    def _reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                break
            if pid == 0:
                break
            if self.spare is not None and pid == self.spare[0]:  # it should only wait: fork another later
                self.spare[1].close()
                self.spare, self.spare_ready = None, False
                self._spare_due = time.monotonic() + 1.0
                continue
            if pid in self._lost_spares:
                self._lost_spares.discard(pid)
                continue
            self.children.discard(pid)
            self._last_exit = time.monotonic()
            if self.spare is None and self._spare_due is not None:
                self._spare_due = min(self._spare_due, self._last_exit)  # make the next one now

    def _fork_spare(self) -> None:
        self._spare_due = None
        ours, theirs = socket.socketpair()
        try:
            pid = os.fork()
        except OSError as e:
            log(f"cannot fork a spare: {e.strerror}")
            ours.close()
            theirs.close()
            return
        if pid == 0:
            ours.close()
            self._become_child(theirs, spare=True)  # never returns
        theirs.close()
        self.spare, self.spare_ready = (pid, ours), False

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            if not self._peer_allowed(conn):
                return _refuse(conn, "peer", REFUSED)
            if self.stale or code_fingerprint(self.folders) != self.fingerprint:
                if not self.stale:
                    log("egress's code changed on disk since this server started: stale, exiting")
                    self.stale = self.stopping = True
                    self._unlist()  # before the answer: the launcher's next try must not reach us
                return _refuse(conn, "stale", "this warm server runs older code; a new one starts")
            if self.stopping:
                return _refuse(conn, "stopping", "this warm server is stopping")
            self._spare_due = time.monotonic() + SPARE_PAUSE
            if self.spare is not None and self.spare_ready:  # one still rehearsing stays for a later run
                pid, end = self.spare
                self.spare, self.spare_ready = None, False
                try:
                    end.sendmsg([b"R"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", conn.fileno()))])
                    self.children.add(pid)
                    return
                except OSError:  # the spare is gone: fork one for this run
                    pass
                finally:
                    end.close()
            try:
                pid = os.fork()
            except OSError as e:
                return _refuse(conn, "fork", f"cannot fork: {e.strerror}")
            if pid == 0:
                self._become_child(conn)  # never returns
            self.children.add(pid)

    def _peer_allowed(self, conn: socket.socket) -> bool:
        """Our own user and our own user namespace (so outside every sandbox), else refused."""
        return warm.peer_is_ours(conn, self.namespace)

    def _become_child(self, conn: socket.socket, spare: bool = False) -> None:
        """The forked child's life: with ``spare``, ``conn`` is the pipe the run's connection
        will come through (or its end, and then this child's)."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self.lock >= 0:
                os.close(self.lock)  # a replacement server must be able to take it when we go
            if self.spare is not None:  # the server's end of a spare's pipe: the spare's, not ours
                self.spare[1].close()
            self.listener.close()
            gc.enable()
            from egress.run.warm.child import run_child

            if spare:
                from egress.run.warm.child import rehearse

                try:
                    rehearse(Path(self.paths.state_dir))
                except Exception as e:  # noqa: BLE001 - a spare that could not rehearse still serves
                    log(f"a spare's rehearsal failed: {e!r}")
                try:
                    conn.send(b"R")  # ready: the server may hand us a run
                except OSError:
                    code = 0
                    return
                conn = _wait_for_run(conn)
                if conn is None:
                    code = 0
                    return
            code = run_child(conn, self.identity)
        except BaseException:  # noqa: BLE001 - whatever happens, the child ends here
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def _unlist(self) -> None:
        """Remove our socket's name and our record: runs that come from now on start a new server."""
        try:
            _unlink(self.paths.socket)
            _unlink(self.paths.info)
        except OSError:
            pass

    def shutdown(self) -> None:
        """Stop listening (new runs then find no socket and start a new server), serve what
        was already queued, then go (a spare left waiting sees its pipe close, and ends)."""
        self._unlist()
        self.listener.setblocking(False)
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, OSError):
                break
            self._handle(conn)
        self.listener.close()
        self._spare_due = None
        if self.spare is not None:
            self.spare[1].close()
            self.spare, self.spare_ready = None, False


def _wait_for_run(pipe: socket.socket) -> socket.socket | None:
    """A spare's wait: the run's connection from the server, or None when the server lets it go."""
    try:
        _, ancillary, _, _ = pipe.recvmsg(1, socket.CMSG_SPACE(4))
    except OSError:
        return None
    finally:
        pipe.close()
    fds = [struct.unpack("i", data[:4])[0] for level, kind, data in ancillary
           if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS]
    return socket.socket(fileno=fds[0]) if fds else None


REFUSED = ("the warm proxy serves only its own user's egress run, outside egress sandboxes")


def _refuse(conn: socket.socket, reason: str, message: str) -> None:
    try:
        conn.settimeout(1.0)
        warm.send(conn, {"op": "refused", "reason": reason, "message": message})
    except OSError:
        pass


# ------------------------------------------------------------------ main


def _below_the_launchers() -> None:
    """Under a real-time policy, the server (and so its spares and runs' children) goes one
    priority below the launcher that started it.

    A server started under a real-time policy (`chrt`, inherited from the launcher that started
    it) forked its children with it. A run's child builds that run's proxy (5-10 ms of CPU) while
    the launcher and its sandbox's helper and init work, and the server forks the next spare (a
    copy of ~90 MB) as a run ends, when the next launcher may be starting: at the launchers' own
    priority. A FIFO task is never preempted by its equals, so on 2 CPUs a launcher that blocked
    for a moment (a thread's start, a reply) waited for that work to end. Measured
    (bench/launch_phases.py under chrt -f 20, a loaded machine): gaps of 24 and 11 ms in the
    launcher's steps, and box.wait 12 ms where 1.6 was usual. One below, the server and its
    children still run ahead of the machine's other jobs (a run's first request); at the lowest
    priority they take the normal policy.
    """
    try:
        policy = os.sched_getscheduler(0)
        if policy not in (os.SCHED_FIFO, os.SCHED_RR):
            return
        priority = os.sched_getparam(0).sched_priority
        if priority > os.sched_get_priority_min(policy):
            os.sched_setscheduler(0, policy, os.sched_param(priority - 1))
        else:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _lock(paths: warm.Paths) -> int | None:
    """The server's lock, held for its life; None if another server holds it."""
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.02)  # a server that is stopping lets go within moments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m egress.run.warm.server", description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--key", required=True, help="the installation key the launcher expects")
    parser.add_argument("--idle", type=float, default=warm.DEFAULT_IDLE)
    args = parser.parse_args(argv)
    os.umask(0o077)
    paths = warm.Paths(args.state_dir, args.key)
    paths.make_folder()
    os.chdir(paths.folder)
    identity = warm.installation()
    if warm.installation_key(identity) != args.key:
        log(f"this interpreter imports another egress ({identity}); not serving key {args.key}")
        return 1
    lock = _lock(paths)
    if lock is None:
        return 0  # another server runs
    _below_the_launchers()  # its spares and runs' children with it
    try:
        if os.path.samefile("/proc/self/fd/2", paths.log):
            os.ftruncate(2, 0)  # the log is this server's: a start that found the lock taken only appended
    except OSError:
        pass
    server = Server(paths, max(0.1, args.idle), lock)
    server.folders = code_folders()
    server.fingerprint = code_fingerprint(server.folders)  # before the imports: what they will read
    server.listen()
    log(f"listening on {paths.socket} (idle exit after {server.idle:g} s)")
    started = time.monotonic()
    warm_up(args.state_dir)
    import threading

    if threading.active_count() != 1:  # fork() copies one thread: a lock another held stays locked
        log(f"threads running after the imports ({threading.enumerate()}): not forking from here")
        return 1
    gc.collect()
    gc.freeze()  # children share these pages; the collector must not touch them (copy-on-write)
    log(f"ready in {time.monotonic() - started:.2f} s")
    try:
        server.run()
    finally:
        os.close(lock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
