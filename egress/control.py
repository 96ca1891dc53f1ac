"""The control socket: another terminal (or a harness) lists runs, grants hosts, follows events.

Each proxy (an `egress run` or an `egress serve`) listens on a Unix socket in
``<state dir>/runs/<id>.sock``: the folder is 0700 and the socket 0600, so only
its owner can talk to it. The protocol is one JSON request line, answered by JSON
lines:

    {"op": "info"}                      -> {"run", "command", "pid", "grants", "started"}
    {"op": "allow", "host": "x.org"}    -> {"ok": true, "host": "x.org"}   (this run only, exact name)
    {"op": "reload"}                    -> {"ok": true}   (re-read the policy files now)
    {"op": "events"}                    -> one event per line, as they happen, until the client leaves

It runs in a thread of its own, so it answers before the (lazily started) proxy exists.
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Callable

from .hosts import InvalidHost, parse_host


def runs_dir(state_dir: Path | None) -> Path:
    from .state import state_dir as default_state_dir

    return (state_dir or default_state_dir()) / "runs"


class RunState:
    """What the control socket shows and changes: grants and the event stream of one proxy."""

    def __init__(self, run_id: str, command: list[str]):
        self.run_id = run_id
        self.command = command
        self.started = time.time()
        self.grants: set[str] = set()
        self.on_grant: list[Callable[[str], None]] = []  # wakes requests held for a host
        self.on_reload: list[Callable[[], None]] = []  # the policy watcher's reload_now
        self.extra: dict = {}  # shown by info (e.g. serve's metrics address)
        self._followers: list[queue.Queue] = []
        self._lock = threading.Lock()

    def grant(self, host: str) -> str:
        name = parse_host(host)
        if name.is_ip:
            raise InvalidHost(f"{host!r}: IP literals are never granted; add them to the policy")
        self.grants.add(name.name)
        for callback in list(self.on_grant):
            callback(name.name)
        return name.name

    def publish(self, event) -> None:
        """Recorder subscriber: fan the event out to every follower."""
        line = event.to_json()
        with self._lock:
            for follower in self._followers:
                follower.put(line)

    def follow(self) -> queue.Queue:
        follower: queue.Queue = queue.Queue(maxsize=10000)
        with self._lock:
            self._followers.append(follower)
        return follower

    def unfollow(self, follower: queue.Queue) -> None:
        with self._lock:
            self._followers.remove(follower)

    def info(self) -> dict:
        return {"run": self.run_id, "command": self.command, "pid": os.getpid(),
                "grants": sorted(self.grants), "started": self.started, **self.extra}


class _Handler(socketserver.StreamRequestHandler):
    server: "ControlServer"  # socketserver's handler, driven by ControlServer's own loop

    def handle(self) -> None:
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
            except InvalidHost as e:
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
        self.wfile.write(json.dumps(obj).encode() + b"\n")


class ControlServer:
    """Serves a RunState on ``<runs dir>/<run id>.sock`` until :meth:`close`.

    Its own accept loop with a wake-up pipe: socketserver's ``shutdown`` waits for a
    0.5 s poll, which every `egress run` would pay at exit.
    """

    def __init__(self, state: RunState, state_dir: Path | None = None):
        directory = runs_dir(state_dir)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)
        self.path = directory / f"{state.run_id}.sock"
        self.state = state
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
            _Handler(conn, address, self)

    def close(self) -> None:
        self._wake_w.send(b"x")
        self._thread.join(5)
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def request(path: Path, payload: dict, timeout: float = 5.0):
    """Send one request to a control socket; yield each JSON answer line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps(payload).encode() + b"\n")
        if payload.get("op") == "events":
            sock.settimeout(None)
        with sock.makefile("rb") as answers:
            for line in answers:
                yield json.loads(line)


def list_runs(state_dir: Path | None) -> list[dict]:
    """Every live run's info; sockets left by runs that died are removed."""
    runs = []
    directory = runs_dir(state_dir)
    for path in sorted(directory.glob("*.sock")) if directory.is_dir() else []:
        try:
            runs.extend(request(path, {"op": "info"}, timeout=2.0))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
        except OSError:
            continue
    return runs

