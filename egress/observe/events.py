"""Every decision becomes one event: an audit-log line, metrics, and live listeners.

The audit log is JSON, one object per line, with the fields documented in the
README. Events carry host names, rules and reason codes, never header or body
values, so no credential can reach the log through them.

The audit log is the one synchronous sink. Every other listener (``egress events
--follow`` through the control socket, ``egress run``'s reports on the terminal) is an
:class:`Observer` behind an :class:`ObserverQueue`: a bounded queue drained by a thread of its
own. Measured before: one ``egress events --follow`` that stopped reading filled its queue, and the next event
blocked the event loop, so after ~10k refusals the proxy answered nobody. Now a full
queue drops the event and counts it (``egress_events_dropped_total{observer}``).

A run's reporter (``subscribe(..., heard=True)``) is the one observer a client waits for:
``record`` gives back a :class:`Telling` for a refusal or an upstream failure, and the
client's answer is held until the reporter has written its line (bounded by HEARD_WAIT;
egress.proxy.addons.line_first). Measured before: curl writes its error one byte per write(2),
and under load its ``curl: (56) CONNECT tunnel failed`` ran into egress's
``EGRESS_BLOCKED`` line on the shared stderr, or came first; a person should read why
before what it did to the command.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol, TextIO

from egress.core.public_suffix import registrable_domain
from egress.core.reasons import ALLOWED, Verdict
from egress.observe.metrics import Metrics

if TYPE_CHECKING:
    from egress.policy.matcher import Decision


@dataclass(slots=True)
class Event:
    client: str  # "ip:port" of the client
    method: str
    host: str
    port: int | None
    decision: Verdict  # allow | block | error
    reason: str  # "allowed", a refusal code, or an upstream error code
    rule: str | None = None  # the policy entry that decided, with its file:line
    detail: str = ""
    bytes_sent: int = 0  # request body bytes relayed upstream
    bytes_received: int = 0  # response body bytes relayed to the client
    session: str | None = None
    time: float = 0.0
    worker: int | None = None  # serve --workers N (N > 1): the pid of the worker that decided

    def to_json(self) -> str:
        data = asdict(self)
        if data["worker"] is None:  # one process: the line is as it always was
            del data["worker"]
        return json.dumps(data, separators=(",", ":"))


def refusal_event(client: str, method: str, decision: Decision) -> Event:
    """The event of a refusal (``decision``: allowed=False), on every road that refuses."""
    return Event(client=client, method=method, host=decision.host, port=decision.port, decision=Verdict.BLOCK,
                 reason=decision.reason, rule=str(decision.rule) if decision.rule else None, detail=decision.detail)


def allow_connect(recorder: Recorder, client: str, host: str, port: int, rule: object) -> None:
    """Record an allowed CONNECT: one function for mitmproxy's path (egress.proxy.addons.reporter)
    and serve's front (egress.proxy.fastpath), so that both write the same event."""
    recorder.record(Event(client=client, method="CONNECT", host=host, port=port, decision=Verdict.ALLOW,
                          reason=ALLOWED, rule=str(rule) if rule is not None else None, detail=""))


class Observer(Protocol):
    """What a live listener of events is (:meth:`Recorder.subscribe`): ``egress events --follow``'s
    control state, serve's log lines, a worker's forwarder, ``egress run``'s reporter.

    It is called with each event in order, on a thread of its own behind a bounded queue
    (:class:`ObserverQueue`), so it may block (a terminal, a socket) at no one's cost but its own.
    An exception it raises is logged and that event skipped; it is called again with the next.
    """

    def __call__(self, event: Event, /) -> None: ...


OBSERVER_QUEUE = 10000  # events an observer may fall behind by before they are dropped

logger = logging.getLogger("egress")


OBSERVER_DELAY = 0.1  # seconds an event may wait for its observer's thread (batched)
OBSERVER_BATCH = 256  # queued events that wake the thread at once
# Seconds a refusal's answer waits for the run's line about it. The line takes well under a
# millisecond on a quiet machine; this bounds a reporter whose terminal does not take writes
# (a stopped pager, a full pipe): past it the answer goes anyway and later refusals stop
# waiting until the reporter has caught up (ObserverQueue.stalled).
HEARD_WAIT = 2.0


class Telling:
    """A run's reporter telling a person about one event; the client's answer waits on it."""

    __slots__ = ("future", "observer")

    def __init__(self, future: asyncio.Future, observer: ObserverQueue):
        self.future, self.observer = future, observer

    def pending(self) -> bool:
        return not self.future.done()

    async def wait(self) -> None:
        """Until the line is written, or HEARD_WAIT has passed (the observer is then stalled)."""
        try:
            await asyncio.wait_for(asyncio.shield(self.future), HEARD_WAIT)
        except TimeoutError:
            self.observer.stalled = True


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class ObserverQueue:
    """An :class:`Observer` behind a bounded queue and a thread of its own.

    ``offer`` never blocks: past ``limit`` queued events it drops the event and counts it.
    The callback runs on the observer's thread and may block (a terminal, a socket) at
    no one's cost but its own. The thread wakes every OBSERVER_DELAY, or at once when
    OBSERVER_BATCH events wait: waking it for every event handed the GIL to it once per
    request, measurable on small-request throughput. An event someone waits for
    (``offer(event, future)``) wakes it at once, and its future is settled in its loop once
    the callback has returned.
    """

    def __init__(self, callback: Observer, name: str, limit: int = OBSERVER_QUEUE,
                 on_drop: Callable[[], None] = lambda: None):
        self.callback, self.name, self.limit, self.on_drop = callback, name, limit, on_drop
        self.stalled = False  # a wait for it timed out: none waits again until its queue is empty
        self.dropped = 0
        self._queue: collections.deque = collections.deque()  # (event, future to settle or None)
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"egress-observer-{name}", daemon=True)
        self._thread.start()

    def offer(self, event: Event, future: asyncio.Future | None = None) -> bool:
        """Queue ``event``; False if it was dropped (then ``future`` is left alone)."""
        if len(self._queue) >= self.limit:
            self.dropped += 1
            self.on_drop()
            return False
        self._queue.append((event, future))
        if future is not None or len(self._queue) == OBSERVER_BATCH:
            self._wake.set()
        return True

    def _run(self) -> None:
        while True:
            self._wake.wait(OBSERVER_DELAY)
            self._wake.clear()
            while self._queue:
                event, future = self._queue.popleft()
                try:
                    self.callback(event)
                except Exception:  # one bad event must not end the observer
                    logger.exception(f"egress: the {self.name} observer failed")
                if future is not None:
                    try:
                        future.get_loop().call_soon_threadsafe(_settle, future)
                    except RuntimeError:  # its loop has closed: no one waits any more
                        pass
            self.stalled = False  # caught up
            if self._closing:
                return

    def close(self, timeout: float = 2.0) -> None:
        """Deliver what is queued (waiting up to ``timeout``), then stop."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)


def _unchanged(text: str) -> str:
    return text


class Recorder:
    """Fans events out to the audit log, the metrics and any observers."""

    def __init__(self, metrics: Metrics, audit: TextIO | None = None, session: str | None = None, *,
                 worker: int | None = None, clean: Callable[[str], str] | None = None):
        """``worker``: a serve worker's pid, in every event; ``clean``: replaces the secrets in a
        text (host names and details), so that no event carries one (egress.proxy.engine.Redactor)."""
        self.metrics = metrics
        self.audit = audit
        self.session = session
        self.worker = worker
        self._subscribers: list[ObserverQueue] = []
        self.reporter: ObserverQueue | None = None  # the run's reporter, which answers wait for (subscribe(heard=True))
        self._lock = threading.Lock()
        self.clean: Callable[[str], str] = clean if clean is not None else _unchanged

    def subscribe(self, callback: Observer, name: str = "subscriber",
                  limit: int = OBSERVER_QUEUE, heard: bool = False) -> ObserverQueue:
        """Call ``callback`` with every event, on a thread of its own, behind a bounded queue.

        ``heard``: the callback tells a person (a run's reporter; one per recorder), and a
        client refused or failed is answered only once it has returned for that event.
        """
        counter = self.metrics.events_dropped.labels(name)
        if heard and self.reporter is not None:
            raise ValueError("a recorder has one reporter a client's answer waits for")
        observer = ObserverQueue(callback, name, limit, on_drop=counter.inc)
        self._subscribers.append(observer)
        if heard:
            self.reporter = observer
        return observer

    def close(self, timeout: float = 2.0) -> None:
        """Deliver the events still queued for the observers, then stop them."""
        for observer in self._subscribers:
            observer.close(timeout)

    def record(self, event: Event) -> Telling | None:
        """Write, count and pass on ``event``. For a refusal or an upstream failure recorded in
        the event loop while a run's reporter listens: the Telling its answer should wait on."""
        event.time = event.time or time.time()
        event.session = event.session or self.session
        event.worker = event.worker or self.worker
        event.host, event.detail = self.clean(event.host), self.clean(event.detail)
        self.metrics.requests.labels(event.decision, event.reason).inc()
        if event.decision == Verdict.BLOCK:
            domain = event.host if event.reason == "invalid-host" else registrable_domain(event.host)
            self.metrics.blocked.labels(self.metrics.domain_label(domain), event.reason).inc()
        elif event.decision == Verdict.ERROR:  # an upstream failure (reasons.UPSTREAM_ERRORS)
            domain = self.metrics.domain_label(registrable_domain(event.host))
            self.metrics.upstream_errors.labels(domain, event.reason).inc()
        if self.audit is not None:
            line = event.to_json() + "\n"
            with self._lock:
                try:
                    self.audit.write(line)
                    self.audit.flush()
                except (OSError, ValueError) as e:  # a full disk must not stop the proxy
                    print(f"egress: cannot write the audit log: {e}", file=sys.stderr)
                    self.audit = None
        telling = None
        for observer in self._subscribers:
            future = None
            if observer is self.reporter and event.decision != Verdict.ALLOW and not observer.stalled:
                try:
                    future = asyncio.get_running_loop().create_future()
                except RuntimeError:  # not in an event loop: no answer to hold
                    pass
            if observer.offer(event, future) and future is not None:
                telling = Telling(future, observer)
        return telling
