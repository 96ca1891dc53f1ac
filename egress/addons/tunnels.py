"""What runs inside a CONNECT tunnel: relayed untouched, or HTTP only.

Two small addons around mitmproxy's NextLayer, which picks the protocol layer:

* :class:`Passthrough` runs *before* NextLayer: tunnels to hosts on the policy's
  ``passthrough`` list are relayed as opaque bytes, never intercepted (pinned
  certificates, non-HTTP protocols such as ssh).
* :class:`ProtocolGuard` runs *after* NextLayer: any other tunnel must carry
  HTTP (in TLS or not); raw TCP, DNS or UDP is refused with ``protocol``.
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import DNSLayer, TCPLayer, UDPLayer

from ..engine import Engine, client_label
from ..hosts import InvalidHost, parse_host
from ..policy import Decision


class Passthrough:
    def __init__(self, engine: Engine):
        self.engine = engine

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        if nextlayer.layer is not None or context.server.address is None or context.client.tls:
            return
        name, port, *_ = context.server.address
        try:
            host = parse_host(name)
        except InvalidHost:
            return
        if self.engine.policy.passthrough(host, port) is not None:
            nextlayer.layer = TCPLayer(context, ignore=True)


class ProtocolGuard:
    def __init__(self, engine: Engine):
        self.engine = engine

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        chosen = nextlayer.layer
        opaque = (isinstance(chosen, TCPLayer) and chosen.flow is not None) or isinstance(
            chosen, (DNSLayer, UDPLayer))
        if not opaque:
            return
        context = nextlayer.context
        name, port, *_ = context.server.address or ("unknown", 0)
        decision = Decision(name, port, False, "protocol",
                            detail="add the host to passthrough to relay it untouched")
        self.engine.record_refusal(client_label(context.client.peername), "TUNNEL", decision)
        nextlayer.layer = _Close(context)


    def responseheaders(self, flow: http.HTTPFlow) -> None:
        # After a 101, mitmproxy relays whatever follows as raw TCP unless it is a WebSocket
        # (whose messages the credential guard reads): any other upgrade is refused.
        if flow.response is not None and flow.response.status_code == 101 and \
                flow.request.headers.get("upgrade", "").strip().lower() != "websocket":
            decision = Decision(flow.metadata.get("egress.host") or flow.request.host, flow.request.port,
                                False, "protocol", detail=f"upgrade to {flow.request.headers.get('upgrade', '?')[:40]!r}")
            self.engine.record_refusal(client_label(flow.client_conn.peername), flow.request.method, decision)
            flow.kill()


class _Close(layer.Layer):
    """Closes the client connection and ignores everything else."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)
