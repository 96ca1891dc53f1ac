"""A proxy for one launched command, started only when the command first connects.

The launcher's whole interface to the proxy (DESIGN: "a listening socket handed
over, a session record, an event stream"):

    session = ProxySession(prepare, session_id, on_event=print_block)   # prepare() -> (policy, credentials)
    session.serve_lazily(listen_socket)    # returns at once
    ...                                     # the command runs
    session.stop()

Importing and starting mitmproxy costs ~0.5-0.7 s; most commands an agent runs
open no connection, so nothing is imported until the socket (which already
exists, inside the command's network namespace) becomes readable: connections
made meanwhile wait in its backlog and nothing is lost.
"""

from __future__ import annotations

import selectors
import socket
import threading
from pathlib import Path
from typing import Callable


class ProxySession:
    def __init__(self, prepare: Callable, session_id: str, on_event: Callable | None = None,
                 state_dir: Path | None = None, resolve: dict | None = None,
                 upstream_ca: Path | None = None, reload: Callable | None = None,
                 watch: list[str] = (), asker=None, state=None, frozen=frozenset()):
        """``prepare()`` returns (policy, credentials or None); it runs when the proxy starts.

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
        self.on_event = on_event
        self.state_dir = state_dir
        self.resolve = resolve or {}
        self.upstream_ca = upstream_ca
        self.started = threading.Event()
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._proxy = None

    def serve_lazily(self, sock: socket.socket) -> None:
        self._thread = threading.Thread(target=self._run, args=(sock,), name="egress-proxy", daemon=True)
        self._thread.start()

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
        if self._wake_r in ready:
            sock.close()
            return
        try:
            import asyncio

            asyncio.run(self._serve(sock))
        except BaseException as e:  # reported by the launcher; the command then sees refused connections
            self.error = e
        finally:
            sock.close()

    async def _serve(self, sock: socket.socket) -> None:
        from .engine import Engine
        from .events import Recorder
        from .metrics import Metrics
        from .proxy import EgressProxy, ProxySettings
        from .resolver import Resolver

        policy, credentials = self.prepare()
        recorder = Recorder(Metrics(), audit=None, session=self.session_id)
        if self.on_event is not None:
            recorder.subscribe(self.on_event, name="run")
        engine = Engine(policy, Resolver(self.resolve), recorder)
        engine.asker = self.asker
        proxy = EgressProxy(engine, ProxySettings(listen_port=None, state_dir=self.state_dir,
                                                  upstream_ca=self.upstream_ca), credentials)
        await proxy.start()
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
            recorder.close()  # the last reports reach the terminal before the launcher goes on
