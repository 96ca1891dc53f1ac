"""One proxy's life, written once: its policy, the proxy built and serving, its policy kept live,
its control socket fed, its observers told, its signals answered, until it stops.

    service = ProxyService(builder, load, reload=reload, paths=policies, report=say,
                           observers={"log": lines}, control=state, stop_on=(SIGINT, SIGTERM))
    service.load()                      # optional, before anything else fails (serve: status 3 first)
    await service.start(sockets)        # in the event loop: built, serving, watched, told, signalled
    ...                                 # the caller says it serves
    await service.run_until_stopped()   # stop() (thread-safe) or a stop signal ends it
    service.close()                     # once the loop has ended

Its callers differ only in where the sockets, the observers and the policy come from:
`egress serve` (egress.serve.single: its address, its control socket and stderr), each worker of
`egress serve --workers N` (egress.serve.workers: sockets and an audit stream from the
supervisor, events to it), a run's proxy in this process or in the warm proxy's child
(egress.run.session.ProxySession.serve: a socket made inside the sandbox, handed over once the
proxy is built, an asker, and the run's reporter), and the warm spare's rehearsal of a run
(egress.run.warm.child.rehearse). The policy is a ``load()`` of (policy, credentials) and a
``reload()`` of the policy: egress.policy.source.PolicySource's, with the credentials read as
serve reads them (egress.serve.single.load) or as a run brokers them (egress.run.plan).

The builder is handed in, not made here: `egress run` opens it (audit log, metrics port, upstream
CAs) before its command starts, and builds the proxy only when the command first connects.

It imports nothing heavy: mitmproxy comes with the builder's start().
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping, Sequence

from egress.host.control import RunState
from egress.host.live import PolicyWatcher, policy_marks
from egress.proxy.build import ProxyBuilder
from egress.proxy.seams import Asker

TYPE_CHECKING = False  # egress.observe.events brings prometheus_client, which serve's supervisor imports late
if TYPE_CHECKING:
    from egress.observe.events import Observer
    from egress.proxy.master import EgressProxy


class ProxyService:
    """One proxy, from its policy to its close; see the module's docstring."""

    def __init__(self, builder: ProxyBuilder, load: Callable[[], tuple], *,
                 reload: Callable[[], object] | None = None, paths: Sequence[str] = (),
                 frozen: Collection[str] = (), report: Callable[[str], None] = lambda line: None,
                 reporter: Observer | None = None, observers: Mapping[str, Observer] | None = None,
                 asker: Asker | None = None, session: str | None = None, worker: int | None = None,
                 control: RunState | None = None, stop_on: Sequence[int] = (),
                 reload_on: Sequence[int] = ()):
        """``load()``: (policy, credentials or None), raising what the caller reports (PolicyError,
        BuildError). ``reload()``: a fresh policy when the files ``paths`` (as the user gave them,
        and those the policy read) change, or raises PolicyError; None: the policy never changes.
        ``frozen``: files whose edits must not reload (egress.host.live). ``report``: one line
        per message of the watcher.

        ``reporter``: a run's reporter (a refused client's answer waits for its line);
        ``observers``: name -> callback for every event, each behind its own queue; ``asker``:
        egress run's person in the loop; ``session``, ``worker``: named in every event.
        ``control``: the control socket's state this proxy feeds (its events, its reloads).
        ``stop_on``, ``reload_on``: the signals that stop it and reload its policy.
        """
        self.builder = builder
        self._load = load
        self._reload = reload
        self.paths = list(paths)
        self.frozen = frozenset(frozen)
        self.report = report
        self.reporter = reporter
        self.observers = dict(observers or {})
        self.asker = asker
        self.session = session
        self.worker = worker
        self.control = control
        self.stop_on, self.reload_on = tuple(stop_on), tuple(reload_on)
        self.proxy: EgressProxy | None = None  # once built
        self.watcher: PolicyWatcher | None = None
        self.stopping = False
        self._loaded: list = []  # [(policy, credentials)] from load() until start() hands it on
        self._since: tuple | None = None
        self._reload_pending = False

    @property
    def engine(self):
        return self.builder.engine

    def load(self):
        """Load the policy now (else start() does), and return it: a caller that must fail for the
        policy before anything else (serve's status 3, before the audit log's 5) calls it first,
        and lets go of it before start()."""
        if not self._loaded:
            policy, credentials = self._load()
            # An edit made while the proxy starts (a second or more) is seen at the first poll.
            self._since = policy_marks(self.paths, policy)
            self._loaded.append((policy, credentials))
        return self._loaded[0][0]

    async def start(self, sockets: Sequence = ()):
        """Build the proxy and serve ``sockets`` (listening sockets that are its own address, besides
        the config's ``listen``), then its watcher, control state, observers and signals. The
        egress.proxy.master.EgressProxy; None if stop() came before it was built. Raises what
        load() raises, and egress.proxy.build.BuildError."""
        if self.stopping:
            return None
        self.load()  # its policy is not kept here
        if self.stopping:  # it ended while the policy was built: no proxy to start
            self._loaded.clear()
            return None
        policy, credentials = self._loaded.pop()
        # The engine's alone from now on: a name here would keep the first policy after a reload.
        self.proxy = proxy = await self.builder.start(
            policy, credentials, session=self.session, asker=self.asker, worker=self.worker, sockets=sockets,
            on_event=[self.reporter] if self.reporter is not None else [])
        del policy
        engine = self.engine
        for name, observer in self.observers.items():
            engine.recorder.subscribe(observer, name=name)
        loop = asyncio.get_running_loop()
        for sig in self.stop_on:
            loop.add_signal_handler(sig, self.stop)
        if self._reload is not None:
            self.watcher = PolicyWatcher(engine, load=self._reload, report=self.report, paths=self.paths,
                                         frozen=self.frozen, since=self._since)
            self.watcher.start()
            if self._reload_pending:
                self.watcher.reload_now()
        for sig in self.reload_on:
            loop.add_signal_handler(sig, self.reload)
        if self.control is not None:
            self.control.on_reload.append(self.reload)
            self.control.on_drop = engine.recorder.metrics.events_dropped.labels("follower").inc
            engine.recorder.subscribe(self.control.publish, name="control")
        if self.stopping:  # stop() came while it was being built
            proxy.stop()
        return proxy

    async def serve(self, sock, capture=()) -> None:
        """Also serve ``sock``, a listening socket that is not this proxy's own address (a run's,
        made inside its sandbox), and ``capture``, [(tag, socket)] of the sandbox's transparent
        capture (egress.proxy.capture). After start()."""
        proxy = self.proxy
        if proxy is None:
            raise RuntimeError("serve() before start() built the proxy")
        await proxy.serve_socket(sock)
        if capture:
            await proxy.serve_capture(capture)

    def reload(self) -> None:
        """Re-read the policy now (thread-safe); before the watcher runs, as soon as it does."""
        if self.watcher is not None:
            self.watcher.reload_now()
        else:
            self._reload_pending = True

    def stop(self) -> None:
        """Stop accepting and drain (thread-safe); before it is built, it never starts."""
        self.stopping = True
        if self.proxy is not None:
            self.proxy.stop()

    async def run_until_stopped(self) -> None:
        """Until stop(); then every event still queued has reached its observers."""
        try:
            if self.proxy is not None:
                await self.proxy.run_until_stopped()
        finally:
            if self.engine is not None:
                self.engine.recorder.close()

    def close(self) -> None:
        """The builder's metrics endpoint and audit log, once the loop has ended (a caller that
        lends its builder, egress run's launcher, closes it itself instead)."""
        self.builder.close()
