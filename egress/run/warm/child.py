"""One run in the warm proxy: the child the warm server forked for it (egress.run.warm.server).

It reads the run's request (egress.run.warm.client's protocol), becomes that run's proxy process
(the launcher's stdout and stderr, working folder, umask and environment), builds the
run's policy, credentials and proxy with the launcher's own functions (so exactly as the
in-process path would: egress.run.session.ProxySession.serve), and serves the listening
socket the launcher hands over. Its connection to the launcher is the run's channel:

    child -> launcher   {"op": "serving", "pid"}        it serves the socket from now on (it accepts
                                                        once the launcher's stdio has come)
                        {"op": "connected"}             the command's first connection came
                        {"op": "event", "event": {...}} every decision (egress.observe.events.Event's fields);
                                  (+ "said": id)        a refusal or failure: its client's answer waits
                                                        for the launcher to say its line is written
                        {"op": "ask", "id", "host"}     a held request: allow this host for the run?
                        {"op": "error", "message"}      the proxy failed; the child then exits
    launcher -> child   {"op": "socket", "fds": ["listen", tags...]} + the listening socket and
                                                        the transparent capture's (sandbox/capture.py)
                        {"op": "stdio", "fds": [names]}  the launcher's stdout and stderr, when it
                                                        sees "serving" (with `--audit-log -` stdout
                                                        comes with the request instead)
                        {"op": "answer", "id", "allowed"}
                        {"op": "said", "id"}            the line for event "said" id is written
                        {"op": "reload"}                re-read the policy files now
                        {"op": "stop"}                  the command ended (EOF means the same)

The child never serves the socket after a stop: it says "serving" first, then looks for a
stop, then serves; the launcher sends its stop, then looks for "serving". So either the
child saw the stop and does not serve, or the launcher saw "serving" and waits for the
last events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import socket
import sys
import threading
from pathlib import Path

from egress.core.contract import EXIT_OK
from egress.host.service import ProxyService
from egress.observe.events import HEARD_WAIT
from egress.policy.source import PolicySource
from egress.proxy.build import ProxyBuilder
from egress.proxy.config import DEFAULT_LIMITS, ProxyConfig
from egress.run.plan import build_policy, load_credentials
from egress.run.snapshot import PolicySnapshot
from egress.run.warm import client as warm
from sandbox.paths import command_writable

REQUEST_WAIT = 30.0  # seconds a child waits for its run's request


def run_child(conn: socket.socket, identity: dict) -> int:
    """Serve one run on ``conn`` (a connection the warm server accepted); the exit status."""
    conn.settimeout(REQUEST_WAIT)
    reader = warm.Reader(conn)
    try:
        got = reader.read()
    except (OSError, ValueError, warm.WarmError):
        return 1
    if got is None:
        return 0
    request, fds = got
    if (request.get("op") != "run" or request.get("protocol") != warm.PROTOCOL
            or request.get("installation") != identity):
        for fd in fds:
            os.close(fd)
        warm.send(conn, {"op": "refused", "reason": "protocol",
                         "message": "the launcher and the warm server are not the same egress"})
        return 1
    conn.settimeout(None)
    named = dict(zip(request["fds"], fds, strict=True))  # the Reader took as many as it names
    take_over(request, named)
    return ChildRun(conn, reader, request, named).serve()


def rehearse(state_dir: Path) -> None:
    """A spare's warm-up while it waits for a run: build the built-in policy and start (then stop) a
    proxy as a run would. A forked child's first pass over the code copies every page it touches
    from the server (copy-on-write) and fills lazy caches: done here, between runs, a run's own
    build took ~5 ms instead of ~10. It runs in a thread of the lowest priority (nice 19, that
    thread only), so it takes no CPU from the commands and launchers around it; the server hands
    a run only to a spare that has finished."""

    def load():
        policy = build_policy(PolicySource(network="allowlist", command_line=True))
        return policy, load_credentials(policy, {})

    async def once() -> None:
        builder = ProxyBuilder(ProxyConfig(state_dir=state_dir, extra_options=dict(DEFAULT_LIMITS)))
        service = ProxyService(builder, load, session="rehearsal")
        await service.start()
        service.stop()
        await service.run_until_stopped()
        service.close()

    failure: list[BaseException] = []

    def low_priority() -> None:
        try:
            # A server started under a real-time policy (`chrt`, inherited from the launcher that
            # started it) ignores nice: the rehearsal then competed as an equal with the launchers
            # and sandboxes of the runs that follow. This thread goes to the normal policy first.
            if os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR):
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        try:
            asyncio.run(once())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            failure.append(e)

    thread = threading.Thread(target=low_priority, name="egress-rehearsal")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def take_over(request: dict, fds: dict[str, int]) -> None:
    """Become the run's process: its working folder, umask, environment, and what it sent of its
    stdout and stderr (the rest comes once the proxy serves: ChildRun._before_serving)."""
    take_stdio(fds)
    os.chdir(request["cwd"])  # relative policy paths, and command_writable, as the launcher saw them
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["environ"])


def take_stdio(fds: dict[str, int]) -> None:
    """The launcher's stdout and stderr among ``fds`` become ours."""
    for name, target in (("stdout", 1), ("stderr", 2)):
        fd = fds.pop(name, None)
        if fd is not None:
            getattr(sys, name).flush()
            os.dup2(fd, target)
            os.close(fd)


class ChildRun:
    def __init__(self, conn: socket.socket, reader: warm.Reader, request: dict, fds: dict[str, int]):
        self.conn = conn
        self.reader = reader
        self.request = request
        self.fds = fds
        self.stopping = False
        self.session = None
        self.listen: asyncio.Future | None = None
        self.asker = RemoteAsker(self)
        self._lock = threading.Lock()  # events come from the recorder's observer thread
        self._said: dict[int, threading.Event] = {}  # events whose line the launcher is writing
        self._said_ids = itertools.count(1)

    def send(self, message: dict) -> None:
        with self._lock:
            try:
                warm.send(self.conn, message)
            except OSError:
                pass  # the launcher is gone; its EOF stops us

    def send_event(self, event) -> None:
        """On the recorder's reporter thread. A refusal or an upstream failure returns once the
        launcher says its line is written (at most HEARD_WAIT), since its client's answer waits
        for this (egress.proxy.addons.line_first)."""
        # plain values: marshal takes no str subclass (the decision, a Verdict)
        fields = {name: str(value) if isinstance(value, str) else value
                  for name, value in dataclasses.asdict(event).items()}
        if event.decision == "allow" or self.stopping:
            self.send({"op": "event", "event": fields})
            return
        said, key = threading.Event(), next(self._said_ids)
        self._said[key] = said
        self.send({"op": "event", "event": fields, "said": key})
        said.wait(HEARD_WAIT)
        self._said.pop(key, None)

    def serve(self) -> int:
        """Serve the run; never returns: the process ends once the proxy has stopped and its last
        events are sent (asyncio's teardown would only cancel the connections of a command
        that has ended, and log each cancelled handler)."""
        from egress.proxy.master import quiet_for_run

        quiet_for_run()  # the command's stderr is the person's: only egress's lines join it, as in-process
        asyncio.run(self._main())
        return 1  # not reached

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        self.listen = loop.create_future()
        code = 1
        try:
            self.session = self._session()
            loop.add_reader(self.conn.fileno(), self._readable)
            self._readable()  # the listening socket may have come with the request
            await self.session.serve(self.listen, before_serving=self._before_serving)
            code = 0
        except Exception as e:  # noqa: BLE001 - reported as the run's proxy failure, as in-process
            self.send({"op": "error", "message": str(e)})
        finally:
            if self.session is not None:
                self.session.builder.close()
            self._exit(code)

    def _session(self):
        """The run's ProxySession, built from the request: its policy from the run's PolicySource,
        reading the texts the launcher sealed (egress.run.snapshot), as the in-process path builds it."""
        from egress.run.session import ProxySession
        from egress.scan.credentials import Credentials

        r = self.request
        trees, read_only = r["snapshot"]["trees"], r["snapshot"]["read_only"]
        reader = PolicySnapshot.sealed(r["snapshot"]["recorded"],
                                       lambda path: command_writable(path, trees, read_only))
        source = PolicySource(r["policies"], r["allow"], r["deny"], r["mode"], command_line=True, read=reader)
        credentials = Credentials.from_dict(r["credentials"]) if r["credentials"] is not None else None
        environ = dict(os.environ)

        def prepare():
            policy = build_policy(source)
            self._readable()  # a run that already ended (`true`) need not start a proxy
            return policy, credentials or load_credentials(policy, environ)

        config = ProxyConfig.from_dict(r["config"])
        builder = ProxyBuilder(config)
        audit = None
        if config.audit_log == "-":
            audit = sys.stdout
        elif "audit" in self.fds:
            audit = os.fdopen(self.fds.pop("audit"), "a", encoding="utf-8", buffering=1)
        metrics = socket.socket(fileno=self.fds.pop("metrics")) if "metrics" in self.fds else None
        builder.adopt(audit=audit, metrics_socket=metrics)
        return ProxySession(prepare, r["run_id"], builder, on_event=self.send_event, reload=source.reload,
                            watch=r["policies"], frozen=reader.frozen_files, asker=self.asker)

    def _before_serving(self) -> bool:
        proxy = self.session.builder.proxy
        if proxy is not None:  # egress run asks, when its command failed, whether it ever connected
            proxy.on_first_accept = lambda: self.send({"op": "connected"})
        self.send({"op": "serving", "pid": os.getpid()})
        # The launcher answers with its stdout and stderr (`stdio`); nothing is accepted before
        # they are ours, so every line and audit record of a connection reaches the run's output.
        # A stop the launcher sent before it saw "serving" (or its end) comes instead.
        while not self.stopping:
            try:
                got = self.reader.read()
            except (OSError, ValueError, warm.WarmError):
                got = None
            if got is None:
                self.reader.closed = True
                self._readable()  # stops
                break
            message, fds = got
            if message.get("op") == "stdio":
                take_stdio(dict(zip(message.get("fds", []), fds, strict=True)))
                break
            self._dispatch(message, fds)
        self._readable()  # anything after it (a stop)
        return not self.stopping

    def _exit(self, code: int) -> None:
        """End the process, its descriptors first. The kernel closes them only after it has torn
        down this ~90 MB copy of the server (exit_mm comes before exit_files): the launcher waited
        ~4 ms for the link's EOF (10 ms under strace), and whoever reads the launcher's stdout or
        stderr (held here too: take_over) another ~5 ms for theirs, after the launcher had ended."""
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        os.closerange(0, os.sysconf("SC_OPEN_MAX"))
        os._exit(code)

    def _readable(self) -> None:
        try:
            messages = self.reader.read_ready()
        except (OSError, ValueError, warm.WarmError):
            messages, self.reader.closed = [], True
        for message, fds in messages:
            self._dispatch(message, fds)
        if self.reader.closed:
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self._stop()

    def _dispatch(self, message: dict, fds: list[int]) -> None:
        op = message.get("op")
        if op == "socket" and fds:
            tags = list(message.get("fds", ["listen"]))[1:]
            sock = socket.socket(fileno=fds.pop(0))
            capture = [(tag, socket.socket(fileno=fds.pop(0))) for tag in tags[:len(fds)]]
            if self.listen.done():
                sock.close()
                for _, extra in capture:
                    extra.close()
            else:
                self.session.capture = capture  # served beside the listening socket (egress.proxy.capture)
                self.listen.set_result(sock)
        elif op == "said":
            said = self._said.get(message.get("id"))
            if said is not None:
                said.set()
        elif op == "answer":
            self.asker.answer(message.get("id"), bool(message.get("allowed")))
        elif op == "reload" and self.session is not None:
            self.session.request_reload()
        elif op == "stop":
            self._stop()
        for fd in fds:
            os.close(fd)

    def _stop(self) -> None:
        self.stopping = True
        for said in list(self._said.values()):  # the launcher is done writing lines
            said.set()
        if not self.listen.done():
            self.listen.set_result(None)
        proxy = self.session._proxy if self.session is not None else None
        if proxy is not None and not proxy.accepted:
            # Served, but no connection ever came (the command ended without one): no event can
            # follow, so end now rather than after mitmproxy's shutdown, which the launcher awaits.
            self._exit(EXIT_OK)
        if self.session is not None:
            self.session.halt()
        self.asker.fail_pending()


class RemoteAsker:
    """The run's asker (egress.proxy.seams.Asker) in its proxy: the launcher's asker answers."""

    def __init__(self, run: ChildRun):
        self.run = run
        self.grants: set[str] = set()  # a yes is for the rest of the run (egress.run.ask)
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)

    @property
    def state(self) -> RemoteAsker:
        """What the run granted, as this proxy has heard it (a reload keeps such a host's tunnels)."""
        return self

    async def ask(self, host: str) -> bool:
        if host in self.grants:
            return True
        if self.run.stopping:
            return False
        request = next(self._ids)
        future = self._pending[request] = asyncio.get_running_loop().create_future()
        self.run.send({"op": "ask", "id": request, "host": host})
        try:
            allowed = await future
        finally:
            self._pending.pop(request, None)
        if allowed:
            self.grants.add(host)
        return allowed

    def answer(self, request, allowed: bool) -> None:
        future = self._pending.get(request)
        if future is not None and not future.done():
            future.set_result(allowed)

    def fail_pending(self) -> None:
        """The launcher is gone: every open question is a no."""
        for future in self._pending.values():
            if not future.done():
                future.set_result(False)
