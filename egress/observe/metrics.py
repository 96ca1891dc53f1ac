"""Prometheus metrics, on a registry of their own (served on their own port).

Names follow Prometheus conventions and start with ``egress_``. Label values come
from closed sets, except ``domain``, which is the registrable domain for the first
:data:`MAX_DOMAINS` distinct domains and ``other`` after that, so cardinality stays
bounded whatever clients ask for.

Under `egress serve --workers N` every worker keeps its metrics in prometheus_client's
multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor before anything
imports prometheus_client) and the supervisor serves their sum (:func:`collected`):
counters and histograms add up, the gauges say how (``multiprocess_mode``), and the
``domain`` bound is shared through a file in that folder (:class:`DomainLabels`), so it
holds for the sum, not per worker.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MAX_DOMAINS = 200
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch to multiprocess mode

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "egress_requests", "Decisions taken, by outcome (allow/block/error) and reason code.",
            ["decision", "reason"], registry=r)
        self.blocked = Counter(
            "egress_blocked", "Refused requests by registrable domain (bounded) and reason.",
            ["domain", "reason"], registry=r)
        self.upstream_errors = Counter(
            "egress_upstream_errors", "Allowed requests whose upstream could not be reached, by registrable "
            "domain (bounded, as egress_blocked_total) and reason (dns-failed, dns-timeout, connect-failed, "
            "upstream-timeout, upstream-certificate, tls-failed).", ["domain", "reason"], registry=r)
        self.upstream_connect = Histogram(
            "egress_upstream_connect_seconds", "Time to open the TCP connection to upstream.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.dns_lookup = Histogram(
            "egress_dns_lookup_seconds", "Time to resolve a destination name.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.transferred = Counter(
            "egress_transferred_bytes", "HTTP body bytes relayed, by direction (upload/download).",
            ["direction"], registry=r)
        self.passthrough = Counter(
            "egress_passthrough_bytes", "Bytes relayed through passthrough tunnels, by direction "
            "(upload: from the client).", ["direction"], registry=r)
        self.front_tunnels = Counter(
            "egress_passthrough_front_tunnels", "Passthrough tunnels answered and relayed by serve's "
            "front (egress.proxy.fastpath) rather than by mitmproxy.", registry=r)
        # Across workers: the sum of the live ones' (a dead worker's connections are gone).
        self.open_connections = Gauge(
            "egress_open_connections", "Client connections currently open.", registry=r,
            multiprocess_mode="livesum")
        # Across workers: the policy loaded last (each worker loads the same files; a reload
        # reaches them within a second of each other).
        self.policy_rules = Gauge(
            "egress_policy_rules", "Entries in the policy in force.", registry=r,
            multiprocess_mode="livemostrecent")
        self.policy_load_errors = Counter(
            "egress_policy_load_errors", "Policy loads that failed (the last good policy stays).",
            registry=r)
        self.events_dropped = Counter(
            "egress_events_dropped", "Events an observer missed because it did not keep up "
            "(observer: a subscriber's name, or follower for `egress events`); the audit log never drops.",
            ["observer"], registry=r)
        self.connections_limited = Counter(
            "egress_connections_limited", "Client connections cut short by a limit "
            "(client-connections, head-timeout, head-size).", ["limit"], registry=r)
        self.upload = self.transferred.labels("upload")
        self.download = self.transferred.labels("download")
        self.passthrough_upload = self.passthrough.labels("upload")
        self.passthrough_download = self.passthrough.labels("download")
        directory = os.environ.get(MULTIPROC_DIR)
        self.domain_label = DomainLabels(os.path.join(directory, "domains") if directory else None).label


class DomainLabels:
    """The ``domain`` label: the domain itself for the first ``limit`` distinct domains, then ``other``.

    With ``path`` (workers whose metrics are summed), the admitted names are shared through
    that file: each is appended as one JSON line under an exclusive flock, after reading what
    the others appended. So at most ``limit`` names exist across all workers, and a name one
    worker admitted is its own label in every worker. The lock is taken only for a name this
    process has not seen while the table is not full (at most ``limit`` times per worker);
    once full, the table never changes, and answers need no lock.
    """

    def __init__(self, path: str | None = None, limit: int = MAX_DOMAINS):
        self.limit = limit
        self._known: set[str] = set()
        self._full = False
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600) if path else None
        self._read = 0  # bytes of the file already read

    def label(self, domain: str | None) -> str:
        if not domain:
            return "other"
        if domain in self._known:
            return domain
        if self._full:
            return "other"
        with self._lock:
            if self._fd is None:
                return self._admit(domain)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._catch_up(self._fd)
                if domain in self._known:
                    return domain
                label = self._admit(domain)
                if label == domain:
                    line = json.dumps(domain).encode() + b"\n"
                    os.write(self._fd, line)  # O_APPEND, under the lock: the file's end
                    self._read += len(line)
                return label
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _admit(self, domain: str) -> str:
        if len(self._known) < self.limit:
            self._known.add(domain)
            return domain
        self._full = True
        return "other"

    def _catch_up(self, fd: int) -> None:
        """Read the names other workers appended to ``fd`` since we last looked (whole lines only)."""
        while chunk := os.pread(fd, 65536, self._read):
            end = chunk.rfind(b"\n") + 1
            if not end:
                return
            self._known.update(json.loads(line) for line in chunk[:end].splitlines())
            self._read += end
        self._full = len(self._known) >= self.limit


def collected(directory: str) -> CollectorRegistry:
    """A registry that answers with the sum of every worker's metrics in ``directory``."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry


def forget_process(pid: int, directory: str) -> None:
    """A worker ended: its live gauges (open connections, policy rules) no longer count."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, directory)


def multiprocess_mode() -> bool:
    """Whether this process's metrics go to the multiprocess files (MULTIPROC_DIR was set in time)."""
    from prometheus_client import values

    return bool(getattr(values.ValueClass, "_multiprocess", False))
