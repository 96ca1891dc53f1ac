"""`egress serve --workers N`: N proxy processes on one port, and the process that keeps them.

The supervisor (the process the user started) does everything that can fail before a worker
exists, with serve's statuses: the policy (3), the upstream CAs, the audit log, the CA (5), the
metrics port and the proxy's address (4). It binds that address N times with SO_REUSEPORT (port
0: the first socket's port, so one real port is printed) and keeps the N sockets: the kernel
spreads new connections over them by a hash of each connection's addresses, and worker i serves
socket i. A connection that arrives while worker i is being replaced waits in socket i's
backlog instead of failing (had each worker bound its own socket, its death would have reset
every connection queued on it).

Workers are spawned (fork and exec of this module), not forked from the supervisor. A restart
happens while the supervisor runs threads (the metrics endpoint, the control socket, the relay
below), and a fork then copies the locks those threads hold; a forked restart would also start
with the policy the supervisor loaded at start, not the one in force. A spawned worker imports
mitmproxy and loads the policy files itself, as `egress serve --workers 1` does: ~1 s of CPU
per start, and each worker's memory is its own (bench/README.md has the figures). A worker
restarted after egress was reinstalled under a running serve runs the new code.

What the workers share, and how:

* metrics: prometheus_client's multiprocess files in a private folder (0700, removed at exit;
  ``PROMETHEUS_MULTIPROC_DIR``); the supervisor serves their sum (egress.observe.metrics);
* the audit log: a file is opened once, O_APPEND, by the supervisor, and each worker writes
  every line with one write(2) on that descriptor, so lines never interleave (tests prove it
  with lines over 4 KiB); standard output gives no such promise beyond PIPE_BUF (a pipe to a
  log collector), so with ``-`` each worker writes to a pipe of its own and the supervisor
  copies whole lines to its standard output;
* events: each worker sends its upstream failures (the supervisor prints each
  ``EGRESS_UPSTREAM_ERROR`` line once per host and reason, across workers) and, while someone
  follows (`egress events`; a flag in the private folder), every event, as JSON lines on a
  pipe of its own; the supervisor hands them to its followers;
* the control socket is the supervisor's (``serve-<its pid>``): reload = SIGHUP to every
  worker (so is a SIGHUP to the supervisor), grants are refused as by any serve;
* the policy: each worker loads and watches the files itself (so every edit reaches every
  worker within the watcher's second), and keeps the texts of each policy that loads in the
  private folder (the newest load's texts win). A worker that starts while the files do not
  load (a broken edit, then a crash: P14 of the 2026-12-07 review, where serve stopped with 3)
  runs those texts, the policy the others run, says so, and applies the next good edit as they
  do; only a serve where no policy ever loaded fails for it (3).

A worker that dies is restarted and said on stderr; one that fails to start, at start-up or
as a replacement, or one that ends again after RESTARTS restarts within RESTART_WINDOW seconds,
stops every worker and serve exits (3, 4 or 5 as the worker's own failure, else 6): never a
serve that silently runs fewer workers than it says. SIGTERM or SIGINT to the supervisor stops
every worker (each drains its connections, as a lone serve does); a worker whose supervisor
dies gets SIGTERM (PR_SET_PDEATHSIG).

This module imports nothing heavy: it is also the workers' entry point (``python -P -m egress.serve.workers``).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import egress
from egress.core.contract import EXIT_LISTEN, EXIT_POLICY, EXIT_STATE, EXIT_WORKERS
from egress.host.live import trim_heap
from egress.host.service import ProxyService
from egress.observe.terminal import EventLines
from egress.policy.loader import PACE, PolicyError, ReadRefused, read_file
from egress.policy.source import PolicySource
from egress.proxy import build
from egress.proxy.build import BuildError, ProxyBuilder, format_address
from egress.proxy.ca import StateError, ensure_ca
from egress.serve import single

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch to its multiprocess mode
START_SECONDS = 60.0  # a worker that serves nothing after this long has failed to start
STOP_SECONDS = 10.0  # SIGTERM to SIGKILL: the proxy's drain (2 s) and its observers' (2 s), and room
RESTARTS = 5  # a worker ending again after this many restarts within RESTART_WINDOW s: a crash loop, serve stops
RESTART_WINDOW = 60.0
BACKLOG = 128  # each socket's accept queue (asyncio's own listen() makes it 100 once a worker serves)
PIPE_BYTES = 1 << 20  # the relay pipes' buffer: a busy supervisor holds no worker back for long
_CONFIG = "worker.pickle"
_FOLLOWERS = "followers"
_LAST_GOOD = "last-good-policy"  # the texts of the newest policy a worker loaded (see LastGood)
PIECE = 1 << 20  # characters of a policy text written at a time (the loader's pause between pieces)


def default_count() -> int:
    """The CPUs this process may run on (its affinity: taskset, cpusets). Not a CPU quota (a
    container's --cpus), which no affinity shows: pass --workers there. 1 where SO_REUSEPORT does
    not spread connections over sockets (BSDs and macOS give them all to one)."""
    if not sys.platform.startswith("linux"):
        return 1
    return len(os.sched_getaffinity(0))


def private_dir() -> str:
    """A fresh folder only this user can enter (0700) for what the workers share, and
    PROMETHEUS_MULTIPROC_DIR set to it for this process and its children: call it before anything
    imports prometheus_client. The caller removes the folder; one a supervisor could not remove
    (it was killed) is removed by the next supervisor of the same user (its name holds its pid)."""
    import tempfile

    _remove_orphans(Path(tempfile.gettempdir()))
    directory = tempfile.mkdtemp(prefix=f"egress-serve-{os.getpid()}-")
    os.environ[MULTIPROC_DIR] = directory
    return directory


def _remove_orphans(where: Path) -> None:
    """Folders of supervisors of this user that no longer exist (a pid alive, whoever it is now, keeps its folder)."""
    import shutil

    for folder in where.glob("egress-serve-*-*"):
        try:
            pid = int(folder.name.split("-")[2])
            if folder.stat().st_uid != os.getuid() or Path(f"/proc/{pid}").exists():
                continue
        except (ValueError, OSError):
            continue
        shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------- the port


def listening_sockets(host: str, port: int, count: int) -> list[list[socket.socket]]:
    """For each of ``count`` workers, a socket listening with SO_REUSEPORT on every address
    ``host`` names (egress.proxy.build.listening_sockets: as a lone serve binds them), all on
    one port (port 0: the one the first socket got). Raises BuildError (status 4), also when
    another process listens there too: a second serve of the same user could otherwise join the
    group and take a share of the connections, where a lone serve would have failed with
    "address in use"."""
    workers = build.listening_sockets(host, port, count, reuse_port=True, backlog=BACKLOG)
    others = foreign_listeners([sock for sockets in workers for sock in sockets])
    if others:
        port = workers[0][0].getsockname()[1]
        for sockets in workers:
            for sock in sockets:
                sock.close()
        raise BuildError(EXIT_LISTEN, f"cannot listen on {format_address(host, port)}: {others} socket(s) of "
                                      f"another process listen there too (SO_REUSEPORT)")
    return workers


def foreign_listeners(sockets: list[socket.socket]) -> int:
    """Listening sockets on the local addresses of ``sockets`` that are not among them
    (/proc/net/tcp and tcp6 of this network namespace). Two serves starting at the same instant
    each see the other's, so both refuse: closed, never shared."""
    ours = {str(os.fstat(sock.fileno()).st_ino) for sock in sockets}
    rows = [line.split() for table in ("/proc/net/tcp", "/proc/net/tcp6")
            for line in Path(table).read_text().splitlines()[1:]]
    local = {row[1] for row in rows if row[9] in ours}
    return sum(1 for row in rows if row[3] == "0A" and row[1] in local and row[9] not in ours)  # 0A: LISTEN


# ----------------------------------------------------------- the supervisor


def serve(source: PolicySource, config, count: int) -> int:
    """`egress serve --workers N`, N > 1: the supervisor and its N workers, until SIGINT or SIGTERM
    (SIGHUP reloads every worker); the exit status. Raises BuildError: serve's status for what kept
    it from starting (the policy: 3, the addresses: 4, the audit log and the CAs: 5)."""
    import shutil

    directory = private_dir()  # before anything imports prometheus_client
    try:
        return _supervise(source, config, count, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop(MULTIPROC_DIR, None)


def _supervise(source: PolicySource, config, count: int, directory: str) -> int:
    supervisor = Supervisor(source.files, config, count, directory)
    supervisor.catch_signals()  # first: a SIGTERM from now on still removes the folder
    try:
        import json

        from egress.observe.events import Event
        from egress.observe.metrics import collected

        try:
            loaded, _ = single.load(source)  # checked here (3); each worker loads its own
        except PolicyError as e:
            raise single.unloadable(e, lambda problem: _say(f"egress: {problem}")) from None
        for warning in loaded.warnings:
            _say(f"egress: {warning.as_warning()}")
        # What the start-up line says of it, not the policy: the supervisor decides nothing, and
        # kept it (~190 MB for 1M entries) beside every worker's own for the proxy's life.
        from types import SimpleNamespace

        loaded = SimpleNamespace(files=loaded.files, size=loaded.size)
        trim_heap()
        supervisor.open()  # the CAs, the audit log (5), the metrics port, the proxy's address (4)
        supervisor.builder.serve_metrics(collected(directory), supervisor.unready)
        control_state = single.control_state(source, supervisor.builder.metrics_url)
        control_state.on_reload.append(lambda: os.kill(os.getpid(), signal.SIGHUP))  # to every worker
        control_state.on_drop = supervisor.metrics.events_dropped.labels("follower").inc
        control_state.on_followers = supervisor.following
        supervisor.on_spawn = lambda slot: control_state.extra.update(workers=supervisor.pids)
        upstream_errors = EventLines(blocked=False)  # once per host and reason, across workers

        def on_event_lines(data: bytes) -> None:
            for line in data.decode().splitlines():
                control_state.publish_line(line)
                if '"decision":"error"' in line:
                    upstream_errors(Event(**json.loads(line)))

        if not supervisor.start(on_event_lines, sys.stdout.fileno() if config.audit_log == "-" else None):
            return supervisor.status
        control = single.control_server(control_state, config.state)
        single.say_serving(supervisor.addresses, supervisor.builder, loaded, config)
        _say(f"egress: {count} workers, pids {', '.join(map(str, supervisor.pids))}")
        try:
            return supervisor.wait()
        finally:
            if control is not None:
                control.close()
    finally:
        supervisor.close()




class Slot:
    """Worker i: its sockets (one per address; kept across restarts), the process serving them now."""

    def __init__(self, index: int, socks: list[socket.socket]):
        self.index = index
        self.number = index + 1  # as people count
        self.socks = socks
        self.process: subprocess.Popen | None = None
        self.pidfd = -1
        self.ready_fd = -1  # read end: the worker writes once it serves
        self.ready = False
        self.started = 0.0
        self.restarts: deque[float] = deque()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class Supervisor:
    """Starts, restarts and stops the workers of one `egress serve --workers N`; see the module's
    docstring. ``open()`` (in the CLI: BuildError), ``start()``, ``wait()`` -> status, ``close()``."""

    def __init__(self, policies: tuple[str, ...], config, count: int, directory: str):
        self.policies, self.config, self.count, self.directory = policies, config, count, directory
        self.builder = ProxyBuilder(config._replace(listen=None))  # the audit log, the metrics port, the CAs
        self.slots: list[Slot] = []
        self.status = 0
        self.stopping = False
        self.stop_deadline = 0.0
        self.on_spawn = lambda slot: None  # told of each new worker (the control socket's info)
        self.relay: Relay | None = None
        self.audit_out: int | None = None
        self._selector = selectors.DefaultSelector()
        self._signals: list[int] = []
        self._previous: dict = {}  # the signal handlers before start()
        self._wake_r = self._wake_w = -1
        self._followers = None  # mmap of the flag the workers read
        self._env: dict[str, str] = {}
        self.metrics = None

    # -- before any worker: every check that has a status of its own

    def open(self) -> None:
        """Raises BuildError (4, 5)."""
        import mmap
        import pickle

        from egress.observe.metrics import Metrics, multiprocess_mode

        if not multiprocess_mode():  # the workers' sums would still be right; ours would be missing
            raise RuntimeError("prometheus_client was imported before egress.serve.workers.private_dir()")
        self.metrics = Metrics()  # the supervisor's own counts (events its followers missed)
        self.builder.open()
        try:
            ensure_ca(self.config.state)  # here, once: workers creating it at once would make two
        except StateError as e:
            raise BuildError(EXIT_STATE, str(e)) from None
        host, port = self.config.listen
        self.slots = [Slot(i, socks) for i, socks in enumerate(listening_sockets(host, port, self.count))]
        worker_config = self.config._replace(listen=None, metrics=None, audit_log=None,
                                             resolve=dict(self.config.resolve),
                                             extra_options=dict(self.config.extra_options))
        path = Path(self.directory, _CONFIG)
        path.write_bytes(pickle.dumps({"policies": list(self.policies), "config": worker_config}))
        flag = Path(self.directory, _FOLLOWERS)
        flag.write_bytes(b"\0")
        with open(flag, "r+b") as f:
            self._followers = mmap.mmap(f.fileno(), 1)
        # The workers import the egress this process runs, whatever their working folder holds
        # (-P keeps it off sys.path; the folder egress came from goes first).
        root = str(Path(egress.__file__).resolve().parents[1])
        self._env = dict(os.environ)
        self._env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [sock.getsockname()[:2] for sock in self.slots[0].socks]

    @property
    def pids(self) -> list[int]:
        return [slot.pid for slot in self.slots if slot.pid is not None]

    def unready(self) -> list[str]:
        """Why this serve is not ready for traffic (/readyz), in words; empty once every worker
        serves (each loaded the policy and serves its socket) and no stop was asked for. A worker
        being replaced makes serve unready until its successor serves: connections meanwhile
        wait in its socket's backlog, so a balancer that sends them elsewhere loses nothing.
        Called from the metrics thread: reads what the supervisor's thread writes, and a
        moment's stale answer is one probe's."""
        if self.stopping:
            return ["serve is stopping (its workers drain their connections)"]
        if not self.slots:
            return ["the proxy is not listening yet"]
        return [f"worker {slot.number} of {self.count} is not serving yet (starting or being replaced)"
                for slot in list(self.slots) if slot.process is None or not slot.ready]

    def following(self, count: int) -> None:
        """Someone follows the events (count > 0), or no one does any more: tell the workers."""
        flag = self._followers
        if flag is not None:
            try:
                flag[0] = 1 if count else 0
            except ValueError:  # closed: serve is ending (a follower leaves as it does)
                pass

    # -- start, supervise, stop

    def catch_signals(self) -> None:
        """From now on SIGTERM, SIGINT and SIGHUP are the supervisor's to handle (before this,
        their default action would end it without removing its folder). Call it first."""
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None, None))
        signal.set_wakeup_fd(self._wake_w)
        self._previous = {sig: signal.signal(sig, self._on_signal)
                          for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def start(self, on_event_lines, audit_out: int | None) -> bool:
        """Spawn the workers and wait until each serves. False if serve must end instead (a
        worker failed to start: ``status`` says how; or a stop was asked for meanwhile).

        ``on_event_lines(data)``: whole JSON lines of events; ``audit_out``: the descriptor the
        audit lines of ``-`` go to (None: the workers write to the audit file themselves)."""
        if {signal.SIGTERM, signal.SIGINT} & set(self._signals):  # asked to stop while serve started
            return False
        self.audit_out = audit_out
        self.relay = Relay(on_event_lines, audit_out)
        for slot in self.slots:
            self._spawn(slot)
        deadline = time.monotonic() + START_SECONDS
        self._loop(lambda: self.stopping or all(slot.ready for slot in self.slots), deadline)
        if not self.stopping and not all(slot.ready for slot in self.slots):
            late = [slot for slot in self.slots if not slot.ready]
            self._fail(EXIT_WORKERS, f"worker {late[0].number} (pid {late[0].pid}) did not start serving "
                                     f"within {START_SECONDS:.0f} s")
        if self.stopping:
            self.wait()
            return False
        return True

    def wait(self) -> int:
        """Supervise until stopped (SIGTERM, SIGINT, or a worker that cannot be kept running);
        then every worker has ended. The exit status."""
        self._loop(lambda: self.stopping and all(slot.process is None for slot in self.slots))
        if self.relay is not None:
            self.relay.close(STOP_SECONDS)  # the last lines the workers wrote
        return self.status

    def close(self) -> None:
        """Everything the supervisor holds (after wait(); also after a failed open())."""
        for slot in self.slots:
            if slot.process is not None:  # only if wait() never ran: a failure of our own
                slot.process.kill()
                slot.process.wait()
            for sock in slot.socks:
                sock.close()
        if self._followers is not None:
            flag, self._followers = self._followers, None
            flag.close()
        if self._wake_w >= 0:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(-1)
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._selector.close()
        self.builder.close()

    def _on_signal(self, signum, _frame) -> None:
        self._signals.append(signum)  # handled by the loop (the wake-up fd woke it)

    def _loop(self, done, deadline: float | None = None) -> None:
        while not done():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            if self.stopping and now >= self.stop_deadline:
                for slot in self.slots:
                    if slot.process is not None:
                        slot.process.kill()  # did not drain in time; its pidfd says when it is gone
                self.stop_deadline = float("inf")
            timeout = min(t for t in (deadline, self.stop_deadline if self.stopping else None, now + 1.0)
                          if t is not None) - now
            for key, _ in self._selector.select(max(0.0, timeout)):
                kind, slot, process = key.data
                if kind == "wake":
                    _drain(self._wake_r)
                elif slot.process is not process:
                    continue  # a worker handled earlier in this batch: its descriptors are gone
                elif kind == "ready" and slot.ready_fd == key.fd:
                    self._ready(slot)
                elif kind == "ended":
                    self._ended(slot)
            while self._signals:
                self._signal(self._signals.pop(0))

    def _signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:  # also `egress policy reload --run serve-<pid>`
            for slot in self.slots:
                # a worker still starting reads the files as they are now (and would die of a SIGHUP
                # before its interpreter reached the line that ignores it)
                if slot.process is not None and slot.ready:
                    try:
                        slot.process.send_signal(signal.SIGHUP)
                    except ProcessLookupError:
                        pass
        elif not self.stopping:
            self._stop()

    def _stop(self) -> None:
        """Stop every worker: each stops accepting and drains its connections, as a lone serve does."""
        self.stopping = True
        self.stop_deadline = time.monotonic() + STOP_SECONDS
        for slot in self.slots:
            for sock in slot.socks:
                sock.close()  # the workers' copies close as they stop: no connection waits for nobody
        for slot in self.slots:
            if slot.process is not None:
                try:
                    slot.process.terminate()
                except ProcessLookupError:
                    pass

    def _fail(self, status: int, why: str) -> None:
        _say(f"egress: {why}: stopping every worker")
        self.status = self.status or status
        if not self.stopping:
            self._stop()

    def _spawn(self, slot: Slot) -> None:
        """Start a worker for ``slot`` (called from the main thread only: PR_SET_PDEATHSIG follows
        the thread that spawned)."""
        ready_r, ready_w = os.pipe()
        events_r, events_w = os.pipe()
        audit_r, audit_w = os.pipe() if self.audit_out is not None else (-1, -1)
        if audit_w < 0 and self.builder.audit is not None:
            audit_w = self.builder.audit.fileno()  # the file, O_APPEND: shared, never ours to close
        for fd in (events_w, audit_w if audit_r >= 0 else -1):
            _grow_pipe(fd)
        socks = [sock.fileno() for sock in slot.socks]
        passed = [fd for fd in (*socks, ready_w, events_w, audit_w) if fd >= 0]
        argv = [sys.executable, "-P", "-m", "egress.serve.workers", self.directory, str(slot.number), str(os.getpid()),
                ",".join(map(str, socks)), str(audit_w), str(events_w), str(ready_w)]
        try:
            slot.process = subprocess.Popen(argv, pass_fds=passed, stdin=subprocess.DEVNULL, env=self._env)
        finally:
            for fd in (ready_w, events_w, audit_w if audit_r >= 0 else -1):
                if fd >= 0:
                    os.close(fd)  # the worker's now: EOF here when it ends
        slot.started, slot.ready = time.monotonic(), False
        slot.pidfd = os.pidfd_open(slot.process.pid)
        slot.ready_fd = ready_r
        self._selector.register(slot.pidfd, selectors.EVENT_READ, ("ended", slot, slot.process))
        self._selector.register(ready_r, selectors.EVENT_READ, ("ready", slot, slot.process))
        self.relay.add(events_r, "events")
        if audit_r >= 0:
            self.relay.add(audit_r, "audit")
        self.on_spawn(slot)

    def _close_ready(self, slot: Slot) -> None:
        if slot.ready_fd >= 0:
            self._selector.unregister(slot.ready_fd)
            os.close(slot.ready_fd)
            slot.ready_fd = -1

    def _ready(self, slot: Slot) -> None:
        if os.read(slot.ready_fd, 64):
            slot.ready = True
            if slot.restarts:
                _say(f"egress: worker {slot.number} serving again (pid {slot.pid})")
        self._close_ready(slot)  # EOF without a word: it ended first, and its pidfd says so

    def _ended(self, slot: Slot) -> None:
        process = slot.process
        status = process.wait()
        self._selector.unregister(slot.pidfd)
        os.close(slot.pidfd)
        slot.pidfd = -1
        self._close_ready(slot)
        slot.process = None
        from egress.observe.metrics import forget_process

        forget_process(process.pid, self.directory)  # its open connections ended with it
        for unfinished in Path(self.directory).glob(f"{_LAST_GOOD}.{process.pid}.*"):
            unfinished.unlink(missing_ok=True)  # a record it was writing (TextRecorder)
        if self.stopping:
            return
        how = _how_it_ended(status)
        if not slot.ready:
            failed = status if status in (EXIT_POLICY, EXIT_LISTEN, EXIT_STATE) else EXIT_WORKERS
            doing = "be restarted" if slot.restarts else "start"
            return self._fail(failed, f"worker {slot.number} (pid {process.pid}) could not {doing} ({how})")
        now = time.monotonic()
        while slot.restarts and now - slot.restarts[0] > RESTART_WINDOW:
            slot.restarts.popleft()
        if len(slot.restarts) >= RESTARTS:
            return self._fail(EXIT_WORKERS, f"worker {slot.number} (pid {process.pid}) {how}, its "
                                            f"{len(slot.restarts) + 1}th end within {RESTART_WINDOW:.0f} s")
        slot.restarts.append(now)
        _say(f"egress: worker {slot.number} (pid {process.pid}) {how}; starting another")
        self._spawn(slot)


def _how_it_ended(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _grow_pipe(fd: int) -> None:
    if fd >= 0:
        try:
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:  # above /proc/sys/fs/pipe-max-size for this user: the default 64 KiB
            pass


def write_all(fd: int, data: bytes) -> None:
    """One write(2) for ``data`` (a whole line: one append), and more only if the kernel took less."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Relay:
    """The supervisor's thread that reads every worker's pipes: audit lines (``-``) to standard
    output, event lines to ``on_event_lines``; whole lines only, each worker's in its order."""

    def __init__(self, on_event_lines, audit_out: int | None):
        self.on_event_lines = on_event_lines
        self.audit_out = audit_out
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._added: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="egress-relay", daemon=True)
        self._thread.start()

    def add(self, fd: int, kind: str) -> None:
        with self._lock:
            self._added.append((fd, kind))
        os.write(self._wake_w, b"+")

    def close(self, timeout: float) -> None:
        """Once every worker has ended: read what their pipes still hold, then stop."""
        self._closing = True
        os.write(self._wake_w, b".")
        self._thread.join(timeout)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        pending: dict[int, bytes] = {}
        while True:
            for key, _ in self._selector.select():
                if key.fd == self._wake_r:
                    _drain(self._wake_r)
                    with self._lock:
                        added, self._added = self._added, []
                    for fd, kind in added:
                        self._selector.register(fd, selectors.EVENT_READ, kind)
                        pending[fd] = b""
                    continue
                data = os.read(key.fd, 1 << 16)
                if not data:  # the worker ended (a line it was cut off in has no end: dropped)
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    del pending[key.fd]
                    continue
                buffered = pending[key.fd] + data
                end = buffered.rfind(b"\n") + 1
                pending[key.fd] = buffered[end:]
                if end:
                    self._deliver(key.data, buffered[:end])
            if self._closing and len(self._selector.get_map()) == 1:
                return

    def _deliver(self, kind: str, lines: bytes) -> None:
        try:
            if kind == "audit":
                if self.audit_out is not None:
                    write_all(self.audit_out, lines)
            else:
                self.on_event_lines(lines)
        except OSError as e:
            if kind == "audit":  # as the Recorder does: a full disk or a closed pipe must not stop the proxy
                _say(f"egress: cannot write the audit log: {e}")
                self.audit_out = None
        except Exception as e:  # one bad line must not end the relay
            _say(f"egress: the relay failed on a line ({type(e).__name__})")


# ------------------------------------------------------- the last good policy


class TextRecorder:
    """A policy read hook that reads as the loader does and keeps what it read, for a worker
    started later that cannot load the files (a broken edit): each text goes to a file of this
    worker's in the private folder as it is read, a MiB at a time with the loader's pause
    (egress.policy.loader.PACE), so a big policy's text is not held while its rules are built.
    :meth:`keep` once the policy loaded makes it the serve's last good policy, unless another
    worker's load began later; :meth:`drop` otherwise. Failing to write never fails a load: the
    policy loads, and the last good policy is what it was."""

    def __init__(self, directory: str):
        self.directory = directory
        self.order = time.monotonic_ns()  # when this load began: one clock for every worker
        self.read_at = time.time()
        # the supervisor removes it if this worker dies before it is done
        self.path = Path(directory, f"{_LAST_GOOD}.{os.getpid()}.{self.order}")
        self.error: OSError | None = None
        self._file = None
        self._resolved: dict[str, Path] = {}

    def resolve(self, path: Path) -> Path:
        """Where ``path`` leads, as the loader asks before it reads (kept: a replay follows the same)."""
        resolved = path.resolve()
        self._resolved[str(path.absolute())] = resolved
        return resolved

    def __call__(self, path: Path) -> str:
        text = read_file(path)
        if self.error is None:
            pause = PACE.get() or (lambda: None)
            try:
                import pickle

                file = self._open()
                key = str(path.absolute())
                pickle.dump((key, str(self._resolved.get(key) or path.resolve())), file)
                for start in range(0, len(text), PIECE):
                    pickle.dump(text[start:start + PIECE], file)
                    pause()
                pickle.dump(None, file)
            except OSError as e:
                self._fail(e)
        return text

    def _open(self):
        if self._file is None:
            import pickle

            self._file = open(self.path, "wb")
            pickle.dump({"order": self.order, "read_at": self.read_at}, self._file)
        return self._file

    def _fail(self, error: OSError) -> None:
        self.error = error
        self.drop()

    def keep(self) -> str | None:
        """The policy read through this loaded: make it the last good one. What went wrong, if anything."""
        import fcntl

        if self.error is None:
            try:
                self._open().close()  # a policy of built-in sets only reads no file: still a record
                with open(Path(self.directory, f"{_LAST_GOOD}.lock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # one worker at a time compares and replaces
                    newest = LastGood.header(self.directory)
                    if newest is None or newest["order"] <= self.order:
                        os.replace(self.path, Path(self.directory, _LAST_GOOD))
            except OSError as e:
                self._fail(e)
        self.drop()
        return None if self.error is None else f"cannot keep the policy's texts for a restarted worker: {self.error}"

    def drop(self) -> None:
        if self._file is not None:
            self._file.close()
        self.path.unlink(missing_ok=True)


class LastGood:
    """The texts of the newest policy a worker of this serve loaded (a :class:`TextRecorder`'s
    record), as a read hook: each file as it read then, led where it led then; a file it did not
    read is refused. ``read_at``: when that load began (time.time())."""

    def __init__(self, read_at: float, texts: dict[str, tuple[Path, str]]):
        self.read_at = read_at
        self._texts = texts

    @staticmethod
    def header(directory: str) -> dict | None:
        """The record's header (when its load began), None if there is none or it cannot be read."""
        import pickle

        try:
            with open(Path(directory, _LAST_GOOD), "rb") as file:
                return pickle.load(file)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    @classmethod
    def read(cls, directory: str) -> LastGood | None:
        """None if no worker ever loaded a policy (or its record cannot be read)."""
        import pickle

        texts: dict[str, tuple[Path, str]] = {}
        try:
            with open(Path(directory, _LAST_GOOD), "rb") as file:
                header = pickle.load(file)
                while True:
                    try:
                        key, resolved = pickle.load(file)
                    except EOFError:
                        break
                    pieces = []
                    while (piece := pickle.load(file)) is not None:
                        pieces.append(piece)
                    texts[key] = (Path(resolved), "".join(pieces))
            read_at = header["read_at"]
        except (OSError, EOFError, pickle.UnpicklingError, KeyError, ValueError, TypeError):
            return None
        return cls(read_at, texts)

    def __call__(self, path: Path) -> str:
        recorded = self._texts.get(str(path.absolute()))
        if recorded is None:
            raise ReadRefused("not part of the last good policy")
        return recorded[1]

    def resolve(self, path: Path) -> Path:
        recorded = self._texts.get(str(path.absolute()))
        return recorded[0] if recorded is not None else path.resolve()

    def since(self) -> str:
        """When it was read, as a person reads it: the time, with the date if not today."""
        when = time.localtime(self.read_at)
        same_day = time.strftime("%Y-%m-%d", when) == time.strftime("%Y-%m-%d")
        return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", when)


def load_for_worker(source: PolicySource, directory: str, report) -> tuple[object, object, bool]:
    """A worker's policy at its start: (policy, credentials, whether it is the last good one).

    The files, as `serve` loads them (egress.serve.single.load), and their texts kept for
    later workers. If they do not load (an edit broke them) and a worker of this serve loaded a
    policy before, that policy, from its texts: a worker restarted after a crash then runs what
    the others run, and its watcher applies the next good edit. ``report(line)`` says so. With no
    such policy (serve's start): BuildError, status 3, as `serve` itself."""
    recorder = TextRecorder(directory)
    try:
        policy, credentials = single.load(source.replace(read=recorder))
    except PolicyError as e:
        recorder.drop()
        problems = e.problems
    else:
        if trouble := recorder.keep():
            report(trouble)
        return policy, credentials, False
    last = LastGood.read(directory)
    if last is not None:
        try:
            policy, credentials = single.load(source.replace(read=last))
        except PolicyError as e:
            problems += e.problems  # the record's too (a stored secret's file gone since): nothing to run
        else:
            for problem in problems[1:]:
                report(f"policy not loaded: {problem}")
            more = f"; {len(problems) - 1} more above" if len(problems) > 1 else ""
            report(f"policy files do not load ({problems[0]}{more}): running the last good policy "
                   f"from {last.since()}")
            return policy, credentials, True
    raise single.unloadable(PolicyError(problems), lambda problem: report(f"policy not loaded: {problem}"))


def reload_for_worker(source: PolicySource, directory: str, report):
    """A worker's live reload (its PolicyWatcher's load, in a thread): as `serve`'s
    (PolicySource.reload), and the texts of a policy that loads kept as the last good one."""
    recorder = TextRecorder(directory)
    try:
        policy = source.replace(read=recorder).reload()
    except BaseException:
        recorder.drop()
        raise
    if trouble := recorder.keep():
        report(trouble)
    return policy


# ---------------------------------------------------------------- a worker


class LineWriter:
    """A worker's audit stream for the Recorder: each line it is given, one write(2) on ``fd``."""

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, line: str) -> None:
        write_all(self.fd, line.encode())

    def flush(self) -> None:
        pass

    def close(self) -> None:
        os.close(self.fd)


class EventForwarder:
    """A worker's events to its supervisor (a Recorder observer, on its own thread): upstream
    failures always, every other event while the followers flag is up."""

    def __init__(self, fd: int, flag):
        self.fd, self.flag = fd, flag

    def __call__(self, event) -> None:
        if self.fd < 0 or (event.decision != "error" and not self.flag[0]):
            return
        try:
            write_all(self.fd, (event.to_json() + "\n").encode())
        except OSError:  # the supervisor is gone (and with it this worker, PR_SET_PDEATHSIG)
            self.fd = -1


def _end_with_parent(parent: int) -> None:
    """SIGTERM when the supervisor ends, however it ends, so a killed supervisor leaves no
    worker serving on its own."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it ended before we asked
        os._exit(EXIT_WORKERS)


def worker(argv: list[str]) -> int:
    """A worker's life: ``DIR NUMBER PARENT SOCKETS AUDIT EVENTS READY`` (descriptors, the sockets'
    comma-separated; -1: none). The exit status: 0 once stopped, serve's own status for what kept it
    from starting."""
    directory, number, parent, sock_fds, audit_fd, events_fd, ready_fd = argv
    number, parent, audit_fd, events_fd, ready_fd = map(int, (number, parent, audit_fd, events_fd, ready_fd))
    _end_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us
    # A reload asked for while this worker starts would end it (SIGHUP's default action): it reads
    # the files now anyway, and its watcher, starting from what it read, sees any later edit.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    import asyncio
    import mmap
    import pickle

    from egress.proxy.master import configure_logging

    spec = pickle.loads(Path(directory, _CONFIG).read_bytes())
    source, config = PolicySource(spec["policies"]), spec["config"]
    configure_logging()
    prefix = f"egress: worker {number}:"
    report = lambda line: _say(f"{prefix} {line}")  # noqa: E731
    with open(Path(directory, _FOLLOWERS), "rb") as f:
        flag = mmap.mmap(f.fileno(), 1, prot=mmap.PROT_READ)
    builder = ProxyBuilder(config)
    if audit_fd >= 0:
        builder.adopt(audit=LineWriter(audit_fd))
    socks = [socket.socket(fileno=int(fd)) for fd in sock_fds.split(",")]
    fell_back: list[bool] = []

    def load():
        policy, credentials, last_good = load_for_worker(source, directory, report)
        fell_back.append(last_good)
        return policy, credentials

    # as `serve`'s own (egress.serve.single), with each good reload's texts kept
    service = ProxyService(builder, load, reload=lambda: reload_for_worker(source, directory, report),
                           paths=source.files, report=report, worker=os.getpid(),
                           observers={"control": EventForwarder(events_fd, flag)},
                           stop_on=(signal.SIGTERM,), reload_on=(signal.SIGHUP,))

    async def serve() -> None:
        await service.start(socks)
        if fell_back[0]:
            service.engine.recorder.metrics.policy_load_errors.inc()  # a failed load, as a failed reload is
        write_all(ready_fd, b"serving\n")
        os.close(ready_fd)
        await service.run_until_stopped()

    try:
        service.load()
        builder.open()
        asyncio.run(serve())
    except BuildError as e:
        _say(f"{prefix} {e}")
        return e.status
    finally:
        service.close()  # delivers what the forwarder still holds, closes the audit descriptor
    return 0


if __name__ == "__main__":
    _, *arguments = sys.argv
    sys.exit(worker(arguments))
