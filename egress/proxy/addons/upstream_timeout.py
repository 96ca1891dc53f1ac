"""Give up on an upstream that accepts a request but does not answer in time.

mitmproxy waits for a response as long as the connection lives (its idle
watchdog is ten minutes). Here a timer starts when the request has been handed
to upstream; if no response head arrives before it fires:

* plain HTTP upstream: the proxy answers ``504`` with
  ``X-Egress-Error: <host>; reason=upstream-timeout``, fed in as the server's own
  response (``Connection: close`` then drops the hung connection), so every later
  hook sees an ordinary response;
* TLS upstream: bytes fed in there would be taken for ciphertext, so the hung
  connection is closed instead (also one still in its TLS handshake, which is not yet the
  flow's server_conn); mitmproxy's error that follows is answered with the same ``504`` by
  egress's HTTP/1 server side (see upstream_errors.py).
"""

from __future__ import annotations

import asyncio

from mitmproxy import connection, http

from egress.proxy import mitm, refusal
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import flow_state


class UpstreamTimeout:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self._timers: dict[str, asyncio.TimerHandle] = {}

    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is None and self.seconds > 0:
            loop = asyncio.get_running_loop()
            self._timers[flow.id] = loop.call_later(self.seconds, self._expire, flow)

    @guard
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._cancel(flow)

    @guard
    def error(self, flow: http.HTTPFlow) -> None:
        self._cancel(flow)

    def _cancel(self, flow: http.HTTPFlow) -> None:
        timer = self._timers.pop(flow.id, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, flow: http.HTTPFlow) -> None:
        self._timers.pop(flow.id, None)
        if mitm.connection_handler(flow) is None or flow.response is not None or not flow.live:
            return
        state = flow_state(flow)
        state.upstream_error = "upstream-timeout"
        state.upstream_detail = f"no response within {self.seconds:g} s"
        handshaking = _handshaking(flow)
        if flow.server_conn.tls or handshaking:
            # Bytes fed in would be read as ciphertext: close it instead. One still in its
            # TLS handshake (a ServerHello trickled a byte at a time) is not yet the flow's
            # server_conn: that one is closed too.
            mitm.close_connections(flow, flow.server_conn, *handshaking)
            return
        host = state.host_name or flow.request.host
        mitm.feed_server_response(flow, refusal.upstream_error(host, "upstream-timeout", state.upstream_detail))


def _handshaking(flow: http.HTTPFlow) -> list[connection.Server]:
    """The server connections of the flow's client connection still in their TLS handshake
    (one at most: requests on a connection are answered one at a time)."""
    handler = mitm.connection_handler(flow)
    if handler is None:
        return []
    return [conn for conn in handler.transports
            if isinstance(conn, connection.Server) and conn.tls and not conn.tls_established]
