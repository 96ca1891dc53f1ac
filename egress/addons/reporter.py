"""Turns allowed traffic into events and metrics: tunnels opened, requests
completed (with body bytes), upstream failures, connection counts, connect latency.

Response bodies are always streamed through a counting function, so the proxy
never holds a whole download in memory (mitmproxy buffers bodies by default).
Refusals are recorded by the guard that refused.
"""

from __future__ import annotations

from mitmproxy import connection, http
from mitmproxy.proxy import server_hooks

from ..engine import Engine, client_label
from ..events import Event


class Reporter:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.metrics = engine.recorder.metrics

    def client_connected(self, client: connection.Client) -> None:
        self.metrics.open_connections.inc()

    def client_disconnected(self, client: connection.Client) -> None:
        self.metrics.open_connections.dec()

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        server = data.server
        if server.timestamp_start and server.timestamp_tcp_setup:
            self.metrics.upstream_connect.observe(server.timestamp_tcp_setup - server.timestamp_start)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            self._record(flow, "allow", "allowed")

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.stream:  # a large upload, streamed (maybe through a guard's function)
            flow.request.stream = _Counter(flow, "egress.sent", self.metrics.upload, flow.request.stream)

    def request(self, flow: http.HTTPFlow) -> None:
        if not flow.request.stream and flow.request.raw_content:
            size = len(flow.request.raw_content)
            flow.metadata["egress.sent"] = size
            self.metrics.upload.inc(size)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and not flow.metadata.get("egress.refused"):
            flow.response.stream = _Counter(flow, "egress.received", self.metrics.download, flow.response.stream)

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("egress.refused"):
            return
        if upstream_error := flow.metadata.get("egress.upstream_error"):
            self._record(flow, "error", upstream_error)
        else:
            masked = flow.metadata.get("egress.masked")
            self._record(flow, "allow", "allowed", detail=f"masked {masked}" if masked else "")

    def error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("egress.refused") or flow.error is None:
            return
        message = flow.error.msg
        code = flow.metadata.get("egress.upstream_error", "connect-failed")
        self._record(flow, "error", code, detail=message[:200])

    def _record(self, flow: http.HTTPFlow, decision: str, reason: str, detail: str = "") -> None:
        self.engine.recorder.record(Event(
            client=client_label(flow.client_conn.peername), method=flow.request.method,
            host=flow.metadata.get("egress.host", flow.request.host), port=flow.request.port, decision=decision,
            reason=reason, rule=_rule_text(flow.metadata.get("egress.rule")), detail=detail,
            bytes_sent=flow.metadata.get("egress.sent", 0),
            bytes_received=flow.metadata.get("egress.received", 0)))


def _rule_text(rule) -> str | None:
    return str(rule) if rule is not None else None


class _Counter:
    """A mitmproxy stream function that passes chunks through and counts them."""

    __slots__ = ("flow", "key", "counter", "total", "inner")

    def __init__(self, flow: http.HTTPFlow, key: str, counter, inner=None):
        self.flow, self.key, self.counter, self.total = flow, key, counter, 0
        self.inner = inner if callable(inner) else None

    def __call__(self, chunk: bytes) -> bytes:
        end = not chunk
        if self.inner is not None:
            chunk = self.inner(chunk)
        if chunk:
            self.total += len(chunk)
            self.counter.inc(len(chunk))
        if end:
            self.flow.metadata[self.key] = self.total
        return chunk
