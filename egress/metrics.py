"""Prometheus metrics, on a registry of their own (served on their own port).

Names follow Prometheus conventions and start with ``egress_``. Label values come
from closed sets, except ``domain``, which is the registrable domain for the first
:data:`MAX_DOMAINS` distinct domains and ``other`` after that, so cardinality stays
bounded whatever clients ask for.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MAX_DOMAINS = 200

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
        self.open_connections = Gauge(
            "egress_open_connections", "Client connections currently open.", registry=r)
        self.policy_rules = Gauge(
            "egress_policy_rules", "Entries in the policy in force.", registry=r)
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
        self._domains: set[str] = set()
        self._lock = threading.Lock()

    def domain_label(self, domain: str | None) -> str:
        """The domain itself while fewer than MAX_DOMAINS are known, else ``other``."""
        if not domain:
            return "other"
        if domain in self._domains:
            return domain
        with self._lock:
            if len(self._domains) < MAX_DOMAINS:
                self._domains.add(domain)
                return domain
        return "other"
