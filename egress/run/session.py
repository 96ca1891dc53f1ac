"""The proxy for one launched command: in a warm per-user process, or started lazily in this one.

The launcher's whole interface to the proxy (DESIGN: "a listening socket handed
over, a session record, an event stream"):

    builder = ProxyBuilder(config)          # egress.proxy.build: the same builder as `egress serve`
    builder.open()
    handover = warm.Handover.offer(...)     # optional, before the sandbox starts: the run's request sent
    session = ProxySession(prepare, session_id, builder, on_event=print_block, warm=handover)
    session.serve_lazily(listen_socket)    # returns at once
    ...                                     # the command runs
    session.stop()
    builder.close()

Warm (egress.run.warm.client, egress.run.warm.server): the listening socket goes to the run's child of the
per-user warm server, which has everything imported and builds the run's proxy while the
sandbox starts. Events and grant questions come back over the run's connection; answers,
grants and reload requests go forth. Once the child says it serves, this process keeps no
copy of the socket: if the child dies, the command's connections are refused (and the run
says so), never served by nobody silently nor by anything else.

In-process (lazy; the fallback when the warm proxy cannot take the run): importing and
starting mitmproxy costs ~0.5-0.7 s; most commands an agent runs open no connection, so
nothing is imported until the socket (which already exists, inside the command's network
namespace) becomes readable: connections made meanwhile wait in its backlog and nothing is
lost.
"""

from __future__ import annotations

import select
import selectors
import socket
import threading
import time
from collections.abc import Callable

from egress.observe.terminal import say

TYPE_CHECKING = False  # typing is not imported on egress run's path (egress.run.launcher); mypy reads True
if TYPE_CHECKING:
    from egress.host.service import ProxyService

WARM_START_WAIT = 5.0  # seconds for a server started by this run to listen (its interpreter's start)
WARM_SERVE_WAIT = 60.0  # seconds for the warm proxy to serve once it has the run (imports if it just started)
STOP_WAIT = 10.0  # seconds stop() waits for the last events
WARM_CONNECTED_WAIT = 0.2  # seconds saw_connection() waits for the warm proxy's word of a connection


class ProxyFailure(Exception):
    """The run's proxy failed (reported by the warm proxy, or its process ended)."""


class RemoteEvent:
    """An event as the warm proxy sent it: the fields of egress.observe.events.Event, and its JSON."""

    def __init__(self, fields: dict):
        self.fields = fields
        self.__dict__.update(fields)

    def to_json(self) -> str:
        import json  # only for a follower of the control socket: `egress run` imports json no more

        return json.dumps(self.fields, separators=(",", ":"))


class ProxySession:
    def __init__(self, prepare: Callable, session_id: str, builder, on_event: Callable | None = None,
                 reload: Callable | None = None, watch: list[str] = (), asker=None, state=None,
                 frozen=frozenset(), warm=None):
        """``prepare()`` returns (policy, credentials or None); it runs when the proxy starts.

        ``builder``: an egress.proxy.build.ProxyBuilder whose config listens nowhere.

        ``reload()`` returns a fresh policy (or raises PolicyError) when its files change;
        ``frozen``: files the command can write, whose edits must not reload (egress.host.live).
        ``warm``: an egress.run.warm.client.Handover to serve the run in the warm proxy; None: in-process.
        """
        self.prepare = prepare
        self.reload = reload
        self.watch = list(watch)
        self.frozen = frozenset(frozen)
        self.asker = asker
        self.state = state  # egress.host.control.RunState: reload requests arrive there
        self.session_id = session_id
        self.builder = builder
        self.on_event = on_event
        self.warm = warm
        self.served_warm = False  # the warm proxy took the run
        self.started = threading.Event()
        self.connected = False  # a client connected: set as soon as the socket is seen readable
        self._connected = threading.Event()  # the same, from the warm proxy's word
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.capture: list[tuple[str, socket.socket]] = []  # transparent capture's sockets (egress.proxy.capture)
        self._proxy = None  # egress.proxy.master.EgressProxy, once it serves the socket
        self._service: ProxyService | None = None  # once serve() began
        self._reload_pending = False  # a reload asked for before serve() began
        self._bridge = None  # an event loop for the asker, made on the warm proxy's first question

    def serve_lazily(self, sock: socket.socket, capture=()) -> None:
        """``capture``: [(tag, socket)] of the sandbox's transparent capture (sandbox/capture.py),
        served beside ``sock``; any of them becoming readable starts the proxy."""
        self._sock = sock
        self.capture = list(capture)
        target = self._run_warm if self.warm is not None else self._run
        self._thread = threading.Thread(target=target, args=(sock,), name="egress-proxy", daemon=True)
        self._thread.start()

    def saw_connection(self) -> bool:
        """Whether any client has connected to the handed-over socket, by now (call before stop()).

        Exact: a connection the thread has not yet noticed is still waiting in the backlog,
        where the socket shows readable; the thread sets ``connected`` before it closes the socket.
        Once the warm proxy serves, it holds the socket alone and says so at its first accept; its
        word may still be on the way, so this waits for it a moment (WARM_CONNECTED_WAIT).
        """
        if self.connected:
            return True
        if self.served_warm:
            return self._connected.wait(WARM_CONNECTED_WAIT)
        if self._sock is None:
            return self.connected
        try:
            return bool(select.select([self._sock, *(s for _, s in self.capture)], [], [], 0)[0])
        except (ValueError, OSError):  # closed by the thread meanwhile, after setting connected
            return self.connected

    def stop(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        if self._service is not None:
            self._service.stop()
        if self._thread is not None:
            self._thread.join(STOP_WAIT)
        self._wake_r.close()
        self._wake_w.close()
        if self._bridge is not None:
            self._bridge.call_soon_threadsafe(self._bridge.stop)

    def halt(self) -> None:
        """Stop the proxy from its own event loop (the warm proxy's child: no thread to join)."""
        self._stopping.set()
        if self._service is not None:
            self._service.stop()

    def request_reload(self) -> None:
        """Re-read the policy files now (thread-safe); before the proxy runs, as soon as it does."""
        if self._service is not None:
            self._service.reload()
        else:
            self._reload_pending = True

    # -- in this process

    def _run(self, sock: socket.socket) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            for _, extra in self.capture:
                selector.register(extra, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            ready = {key.fileobj for key, _ in selector.select()}
        if ready - {self._wake_r}:
            self.connected = True
        if self._wake_r in ready:
            self._close_sockets(sock)
            return
        try:
            import asyncio

            from egress.proxy.master import quiet_for_run

            quiet_for_run()  # the command's stderr is the person's: only egress's lines join it
            asyncio.run(self.serve(sock))
        except BaseException as e:  # reported by the launcher; the command then sees refused connections
            self.error = e
        finally:
            self._close_sockets(sock)

    def _close_sockets(self, sock: socket.socket) -> None:
        sock.close()
        for _, extra in self.capture:
            extra.close()

    async def serve(self, sock, before_serving: Callable[[], bool] | None = None) -> None:
        """Build the proxy and serve ``sock`` until stopped (egress.host.service.ProxyService).

        ``sock``: a listening socket, or an awaitable giving one (None: do not serve), so the
        proxy can be built before the socket exists. ``before_serving()`` is asked just before
        the socket is served; False stops instead.
        """
        from egress.host.service import ProxyService

        service = self._service = ProxyService(
            self.builder, self.prepare, reload=self.reload, paths=self.watch, frozen=self.frozen,
            report=lambda line: say(f"egress: {line}"), reporter=self.on_event, asker=self.asker,
            session=self.session_id)
        if self._reload_pending:
            service.reload()
        if self._stopping.is_set():
            service.stop()
        try:
            proxy = await service.start()
            if proxy is None:  # the run ended before its proxy was built
                return
            if not isinstance(sock, socket.socket):
                sock = await sock
            if sock is None or service.stopping or (before_serving is not None and not before_serving()):
                service.stop()
                await service.run_until_stopped()
                return
            await service.serve(sock, self.capture)
            self._proxy = proxy
            if self.state is not None:
                self.state.on_reload.append(service.reload)
                self.state.extra["proxy"] = "in-process"  # shown by `egress runs --json`
            self.started.set()
            await service.run_until_stopped()  # the last reports reach the terminal before the launcher goes on
        finally:
            if service.engine is not None:
                service.engine.recorder.close()

    # -- in the warm proxy

    def _run_warm(self, sock: socket.socket) -> None:
        try:
            outcome = self._relay(sock)
        except Exception as e:  # noqa: BLE001 - a broken link must not leave the socket unserved
            outcome = "fallback" if not self.served_warm else "done"
            if self.served_warm:
                self.error = ProxyFailure(f"lost the warm proxy: {e}")
            elif not isinstance(e, OSError):
                self.warm.note = f"the warm proxy could not take this run ({e})"
        finally:
            self.warm.close()
        if self.warm.note:
            say(f"egress: {self.warm.note}; this run's proxy starts in its own process")
        if outcome == "fallback" and not self._stopping.is_set():
            try:
                self.builder.serve_metrics()  # the warm proxy was to serve them
            except Exception as e:  # noqa: BLE001 - reported as the proxy's failure
                self.error = e
                self._close_sockets(sock)
                return
            self._run(sock)
        elif not self.served_warm:
            self._close_sockets(sock)

    def _relay(self, sock: socket.socket) -> str:
        """Hand ``sock`` to the warm proxy and relay its messages until the run ends.

        "fallback": it did not take the run (this process still holds the socket and must
        serve it); "done": it served the run, or the run ended before it did.
        """
        link = self.warm
        for _ in range(2):  # a server that is stopping refuses; its successor gets a second try
            if not link.sent and not self._wait_for_server(link):
                return "fallback"
            try:
                link.send({"op": "socket", "fds": ["listen", *(tag for tag, _ in self.capture)]},
                          [sock.fileno(), *(s.fileno() for _, s in self.capture)])
            except OSError:
                pass  # a server that refused the run closed first: its answer is read next
            outcome = self._exchange(link, sock)
            if outcome != "again":
                return outcome
            link.again()
        return "fallback"

    def _exchange(self, link, sock: socket.socket) -> str:
        """Relay the warm proxy's messages until the run ends (see _relay); "again" when its
        server was stopping and a new one should take the run."""
        deadline = time.monotonic() + WARM_SERVE_WAIT
        stop_sent = False
        while True:
            if self._stopping.is_set() and not stop_sent:
                stop_sent = True
                link.send_quietly({"op": "stop"})
                for message, fds in link.reader.read_ready():  # whatever it said before it saw the stop
                    self._on_message(message, fds, sock)
                if not self.served_warm:
                    return "done"  # it will not serve: it reads the stop before it would
                deadline = time.monotonic() + STOP_WAIT
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                if self.served_warm:
                    self.error = ProxyFailure("the warm proxy did not finish in time; its last events may be missing")
                    return "done"
                link.note = f"the warm proxy did not answer within {WARM_SERVE_WAIT:g} s"
                link.send_quietly({"op": "stop"})
                for message, fds in link.reader.read_ready():
                    self._on_message(message, fds, sock)
                return "done" if self.served_warm else "fallback"
            watched = [link.sock] if stop_sent else [link.sock, self._wake_r]
            if link.sock not in select.select(watched, [], [], timeout)[0]:
                continue  # a stop (sent at the top), or the deadline
            for message, fds in link.reader.read_ready():
                outcome = self._on_message(message, fds, sock)
                if outcome is not None:
                    return outcome
            if link.reader.closed:
                if self.served_warm:
                    if self.error is None and not stop_sent:
                        self.error = ProxyFailure(
                            f"the warm proxy's process for this run ({link.pid or 'unknown pid'}) ended "
                            f"unexpectedly; the command's connections are refused from now on")
                    return "done"
                return "done" if (self.error is not None or stop_sent) else "fallback"

    def _wait_for_server(self, link) -> bool:
        """Connect to a server that was starting when the run began; False if none came in time."""
        deadline = time.monotonic() + WARM_START_WAIT
        while not self._stopping.is_set():
            if link.try_send():
                return True
            if time.monotonic() > deadline or link.failed:
                return False
            select.select([self._wake_r], [], [], 0.005)
        return False

    def _on_message(self, message: dict, fds: list[int], sock: socket.socket) -> str | None:
        import os

        for fd in fds:  # the warm proxy sends no descriptors
            os.close(fd)
        op = message.get("op")
        if op == "event":
            if self.on_event is not None:
                self.on_event(RemoteEvent(message["event"]))
            if "said" in message:  # its client's answer waits for this word (egress.proxy.addons.line_first)
                self.warm.send_quietly({"op": "said", "id": message["said"]})
        elif op == "serving":
            # From now on the warm proxy alone holds the socket: if it dies, connections are refused.
            self._close_sockets(sock)
            self.served_warm = True
            # Our stdout and stderr, which it waits for before it accepts (egress.run.warm.child): its lines
            # and (--audit-log -) audit records are the run's output from its first connection on.
            from egress.run.relay import stdio_fds

            fds = {name: fd for name, fd in stdio_fds().items() if name not in self.warm.request["fds"]}
            self.warm.send_quietly({"op": "stdio", "fds": list(fds)}, list(fds.values()))
            self.warm.pid = message.get("pid")
            self.started.set()
            if self.state is not None:
                self.state.on_reload.append(lambda: self.warm.send_quietly({"op": "reload"}))
                self.state.extra.update(proxy="warm", proxy_pid=self.warm.pid)
        elif op == "connected":
            self.connected = True
            self._connected.set()
        elif op == "ask":
            self._ask(message["id"], message["host"])
        elif op == "error":
            self.error = ProxyFailure(message.get("message", "the warm proxy failed"))
        elif op == "refused":
            if not self.served_warm:
                if message.get("reason") in ("stale", "stopping"):  # a restart is transparent
                    return "again"
                self.warm.note = f"the warm proxy refused this run ({message.get('message', '?')})"
                return "fallback"
        return None

    def _ask(self, request: int, host: str) -> None:
        """A question from the warm proxy: asked here (the terminal, `egress allow`), answered there."""
        link = self.warm
        if self.asker is None:
            link.send_quietly({"op": "answer", "id": request, "allowed": False})
            return
        import asyncio

        if self._bridge is None:
            self._bridge = asyncio.new_event_loop()
            threading.Thread(target=self._bridge.run_forever, name="egress-asker", daemon=True).start()

        def answer(future) -> None:
            try:
                allowed = bool(future.result())
            except BaseException:  # noqa: BLE001 - a question that failed keeps the host blocked
                allowed = False
            link.send_quietly({"op": "answer", "id": request, "allowed": allowed})

        asyncio.run_coroutine_threadsafe(self.asker.ask(host), self._bridge).add_done_callback(answer)

