"""A proxy for one launched command, started only when the command first connects.

The launcher's whole interface to the proxy (DESIGN: "a listening socket handed
over, a session record, an event stream"):

    builder = ProxyBuilder(config)          # egress.wiring: the same builder as `egress serve`
    builder.open()
    session = ProxySession(prepare, session_id, builder, on_event=print_block)   # prepare() -> (policy, credentials)
    session.serve_lazily(listen_socket)    # returns at once
    ...                                     # the command runs
    session.stop()
    builder.close()

Importing and starting mitmproxy costs ~0.5-0.7 s; most commands an agent runs
open no connection, so nothing is imported until the socket (which already
exists, inside the command's network namespace) becomes readable: connections
made meanwhile wait in its backlog and nothing is lost.
"""

from __future__ import annotations

import select
import selectors
import socket
import threading
from typing import Callable


class ProxySession:
    def __init__(self, prepare: Callable, session_id: str, builder, on_event: Callable | None = None,
                 reload: Callable | None = None, watch: list[str] = (), asker=None, state=None,
                 frozen=frozenset()):
        """``prepare()`` returns (policy, credentials or None); it runs when the proxy starts.

        ``builder``: an egress.wiring.ProxyBuilder whose config listens nowhere.

        ``reload()`` returns a fresh policy (or raises PolicyError) when its files change;
        ``frozen``: files the command can write, whose edits must not reload (egress.live).
        """
        self.prepare = prepare
        self.reload = reload
        self.watch = list(watch)
        self.frozen = frozenset(frozen)
        self.asker = asker
        self.state = state  # egress.control.RunState: reload requests arrive there
        self.session_id = session_id
        self.builder = builder
        self.on_event = on_event
        self.started = threading.Event()
        self.connected = False  # a client connected: set as soon as the socket is seen readable
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._proxy = None

    def serve_lazily(self, sock: socket.socket) -> None:
        self._sock = sock
        self._thread = threading.Thread(target=self._run, args=(sock,), name="egress-proxy", daemon=True)
        self._thread.start()

    def saw_connection(self) -> bool:
        """Whether any client has connected to the handed-over socket, by now (call before stop()).

        Exact: a connection the thread has not yet noticed is still waiting in the backlog,
        where the socket shows readable; the thread sets ``connected`` before it closes the socket.
        """
        if self.connected or self._sock is None:
            return self.connected
        try:
            return bool(select.select([self._sock], [], [], 0)[0])
        except (ValueError, OSError):  # closed by the thread meanwhile, after setting connected
            return self.connected

    def stop(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        proxy = self._proxy
        if proxy is not None:
            proxy.stop()
        if self._thread is not None:
            self._thread.join(10)
        self._wake_r.close()
        self._wake_w.close()

    def _run(self, sock: socket.socket) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            ready = {key.fileobj for key, _ in selector.select()}
        if sock in ready:
            self.connected = True
        if self._wake_r in ready:
            sock.close()
            return
        try:
            import asyncio

            from .proxy import quiet_for_run

            quiet_for_run()  # the command's stderr is the person's: only egress's lines join it
            asyncio.run(self._serve(sock))
        except BaseException as e:  # reported by the launcher; the command then sees refused connections
            self.error = e
        finally:
            sock.close()

    async def _serve(self, sock: socket.socket) -> None:
        policy, credentials = self.prepare()
        proxy = await self.builder.start(policy, credentials, session=self.session_id, asker=self.asker,
                                         on_event=[self.on_event] if self.on_event is not None else [])
        del policy  # the engine's from now on: a reload must leave nothing else holding the first
        engine = self.builder.engine
        await proxy.serve_socket(sock)
        self._proxy = proxy
        if self.reload is not None:
            from .live import PolicyWatcher
            from .terminal import say

            watcher = PolicyWatcher(engine, self.reload, report=lambda line: say(f"egress: {line}"),
                                    paths=self.watch, frozen=self.frozen)
            watcher.start()
            if self.state is not None:
                self.state.on_reload.append(watcher.reload_now)
        self.started.set()
        if self._stopping.is_set():  # stop() came while we were starting
            proxy.stop()
        try:
            await proxy.run_until_stopped()
        finally:
            engine.recorder.close()  # the last reports reach the terminal before the launcher goes on
