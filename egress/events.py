"""Every decision becomes one event: an audit-log line, metrics, and live listeners.

The audit log is JSON, one object per line, with the fields documented in the
README. Events carry host names, rules and reason codes, never header or body
values, so no credential can reach the log through them.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, TextIO

from .metrics import Metrics
from .policy import registrable_domain


@dataclass(slots=True)
class Event:
    client: str  # "ip:port" of the client
    method: str
    host: str
    port: int | None
    decision: str  # allow | block | error
    reason: str  # "allowed", a refusal code, or an upstream error code
    rule: str | None = None  # the policy entry that decided, with its file:line
    detail: str = ""
    bytes_sent: int = 0  # request body bytes relayed upstream
    bytes_received: int = 0  # response body bytes relayed to the client
    session: str | None = None
    time: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class Recorder:
    """Fans events out to the audit log, the metrics and any subscribers."""

    def __init__(self, metrics: Metrics, audit: TextIO | None = None, session: str | None = None):
        self.metrics = metrics
        self.audit = audit
        self.session = session
        self._subscribers: list[Callable[[Event], None]] = []
        self._lock = threading.Lock()
        # Replaces secrets in host names and details (set by the credential guard).
        self.clean: Callable[[str], str] = lambda text: text

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        self._subscribers.append(callback)

    def record(self, event: Event) -> None:
        event.time = event.time or time.time()
        event.session = event.session or self.session
        event.host, event.detail = self.clean(event.host), self.clean(event.detail)
        self.metrics.requests.labels(event.decision, event.reason).inc()
        if event.decision == "block":
            domain = event.host if event.reason == "invalid-host" else registrable_domain(event.host)
            self.metrics.blocked.labels(self.metrics.domain_label(domain), event.reason).inc()
        if self.audit is not None:
            line = event.to_json() + "\n"
            with self._lock:
                try:
                    self.audit.write(line)
                    self.audit.flush()
                except (OSError, ValueError) as e:  # a full disk must not stop the proxy
                    print(f"egress: cannot write the audit log: {e}", file=sys.stderr)
                    self.audit = None
        for callback in self._subscribers:
            callback(event)
