"""Turns allowed traffic into events and metrics: tunnels opened, requests
completed (with body bytes), upstream failures, connection counts, connect latency.

Response bodies are always streamed through a counting function, so the proxy
never holds a whole download in memory (mitmproxy buffers bodies by default).
Refusals are recorded by the guard that refused (egress.proxy.refusal.refuse); each flow
gets exactly one event (FlowState.reported).
"""

from __future__ import annotations

from mitmproxy import connection, http
from mitmproxy.proxy import server_hooks

from egress.core.reasons import ALLOWED, Verdict
from egress.observe.events import Event, allow_connect
from egress.proxy.engine import Engine, client_label
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import flow_state, masked, refused


class Reporter:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.metrics = engine.recorder.metrics

    @guard
    def client_connected(self, client: connection.Client) -> None:
        self.metrics.open_connections.inc()

    @guard
    def client_disconnected(self, client: connection.Client) -> None:
        self.metrics.open_connections.dec()

    @guard
    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        server = data.server
        if server.timestamp_start and server.timestamp_tcp_setup:
            self.metrics.upstream_connect.observe(server.timestamp_tcp_setup - server.timestamp_start)

    @guard
    def http_connect(self, flow: http.HTTPFlow) -> None:
        state = flow_state(flow)
        if flow.response is None and not state.refused and not state.reported:
            state.reported = True
            allow_connect(self.engine.recorder, client_label(flow.client_conn.peername),
                          state.host_name or flow.request.host, flow.request.port, state.rule)

    @guard
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.stream:  # a large upload, streamed (maybe through a guard's function)
            flow.request.stream = _Counter(flow, "sent", self.metrics.upload, flow.request.stream)

    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        if not flow.request.stream and flow.request.raw_content:
            size = len(flow.request.raw_content)
            flow_state(flow).sent = size
            self.metrics.upload.inc(size)

    @guard
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and not refused(flow) and not flow_state(flow).whole:
            flow.response.stream = _Counter(flow, "received", self.metrics.download, flow.response.stream)

    @guard
    def response(self, flow: http.HTTPFlow) -> None:
        if refused(flow):
            return
        state = flow_state(flow)
        if state.whole and flow.response is not None and flow.response.raw_content:  # read whole (bounded)
            state.received = len(flow.response.raw_content)
            self.metrics.download.inc(state.received)
        if state.upstream_error:
            self._record(flow, Verdict.ERROR, state.upstream_error, detail=state.upstream_detail)
        else:
            what = masked(flow)
            detail = f"masked {what}" if what else ""
            if state.injection:
                detail = "; ".join(filter(None, (detail, f"injection signals: {state.injection}")))
            self._record(flow, Verdict.ALLOW, ALLOWED, detail=detail)

    @guard
    def error(self, flow: http.HTTPFlow) -> None:
        if refused(flow) or flow.error is None:
            return
        state = flow_state(flow)
        if state.upstream_error:  # named by UpstreamErrors (or UpstreamTimeout)
            self._record(flow, Verdict.ERROR, state.upstream_error,
                         detail=(state.upstream_detail or flow.error.msg)[:300])
        else:  # the client went away before the answer was complete: allowed, not an upstream failure
            self._record(flow, Verdict.ALLOW, ALLOWED, detail=f"not completed: {flow.error.msg[:200]}")

    def _record(self, flow: http.HTTPFlow, decision: Verdict, reason: str, detail: str = "") -> None:
        state = flow_state(flow)
        if state.reported:
            return
        state.reported = True
        state.telling = self.engine.recorder.record(Event(
            client=client_label(flow.client_conn.peername), method=flow.request.method,
            host=state.host_name or flow.request.host, port=flow.request.port, decision=decision,
            reason=reason, rule=str(state.rule) if state.rule is not None else None, detail=detail,
            bytes_sent=state.sent, bytes_received=state.received))


class _Counter:
    """A mitmproxy stream function that passes chunks through and counts them."""

    __slots__ = ("state", "field", "counter", "total", "inner")

    def __init__(self, flow: http.HTTPFlow, field: str, counter, inner=None):
        self.state, self.field, self.counter, self.total = flow_state(flow), field, counter, 0
        self.inner = inner if callable(inner) else None

    def __call__(self, chunk: bytes) -> bytes:
        end = not chunk
        if self.inner is not None:
            chunk = self.inner(chunk)
        if chunk:
            self.total += len(chunk)
            self.counter.inc(len(chunk))
        if end:
            setattr(self.state, self.field, self.total)
        return chunk
