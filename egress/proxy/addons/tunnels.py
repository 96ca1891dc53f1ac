"""What runs inside a CONNECT tunnel: relayed untouched, or HTTP only.

Two small addons around mitmproxy's NextLayer, which picks the protocol layer:

* :class:`Passthrough` runs *before* NextLayer: tunnels to hosts on the policy's
  ``passthrough`` list are relayed as opaque bytes, never intercepted (pinned
  certificates, non-HTTP protocols such as ssh). When a reload refuses the host of an
  open tunnel, relayed or intercepted, or the address pinned for it, the tunnel is closed
  at once, with one block event naming it (``policy_changed``): a relay has no next
  request at which to decide again.
* :class:`ProtocolGuard` runs *after* NextLayer: any other tunnel must carry
  HTTP (in TLS or not); raw TCP, DNS or UDP is refused with ``protocol``. After an
  HTTP ``101``, only a WebSocket (whose messages the credential guard reads) may
  follow: mitmproxy relays any other upgrade -- a ``websocket`` one without
  ``Sec-WebSocket-Version: 13`` included -- as raw, unscanned TCP, so it is refused.

:func:`websocket_layer` finds the layer relaying a WebSocket flow, for the guards that
must act on its frames (close it properly, read ping/pong/close payloads).
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.proxy import layer

from egress.core.hosts import InvalidHost, parse_host
from egress.policy.matcher import Decision
from egress.proxy import mitm
from egress.proxy.connect import recheck
from egress.proxy.engine import Engine
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import flow_state
from egress.proxy.mitm import becomes_websocket
from egress.proxy.refusal import Refused, Stage, refuse


class Passthrough:
    def __init__(self, engine: Engine):
        self.engine = engine
        metrics = engine.recorder.metrics
        self._sent, self._received = metrics.passthrough_upload, metrics.passthrough_download
        engine.policy_watchers.append(self.policy_changed)

    def policy_changed(self) -> None:
        """Close every open tunnel (relayed or intercepted) the policy now in force refuses, by its
        host or by the address pinned for it, one block event each. Measured before: withdrawn
        from allow_private, an open passthrough tunnel kept relaying to the address (red-team P8)."""
        for client, state in list(self.engine.connections.items()):
            if state.tunnel is None or not mitm.is_open(client):
                continue
            host, port = state.tunnel
            refused = self._refusal_since_connect(client, host, port)
            if refused is not None:
                refuse(self.engine, client, refused, Stage.CONNECTION)

    def _count(self, from_client: bool, n: int) -> None:
        (self._sent if from_client else self._received).inc(n)

    @guard
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        if nextlayer.layer is not None or context.server.address is None or context.client.tls:
            return
        name, port, *_ = context.server.address
        try:
            host = parse_host(name)
        except InvalidHost:
            return
        if self.engine.policy.passthrough(host, port) is None:
            return
        refused = self._refusal_since_connect(context.client, host, port)
        if refused is not None:
            raise Refused(refused, Stage.CONNECTION)
        nextlayer.layer = mitm.opaque_relay(context, self._count)

    def _refusal_since_connect(self, client, host, port: int):
        """The policy's refusal of a tunnel whose CONNECT an earlier policy allowed; None if the
        policy is the same or still allows it (egress.proxy.connect.recheck: its host, and the
        address pinned for it, which the relay would dial). The relay starts at the client's
        first bytes, up to the head timeout after the 200: measured, 8 CONNECTs held across a
        reload that denied the host (left on passthrough) were all relayed."""
        state = self.engine.connections.get(client)
        if state is None or state.tunnel_generation in (None, self.engine.policy_generation):
            return None
        return recheck(self.engine, host, port, state.pins.get(host.name))


class ProtocolGuard:
    def __init__(self, engine: Engine):
        self.engine = engine

    @guard
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        chosen = nextlayer.layer
        if not mitm.is_opaque(chosen):
            return
        context = nextlayer.context
        name, port, *_ = context.server.address or ("unknown", 0)
        decision = Decision(name, port, False, "protocol",
                            detail="add the host to passthrough to relay it untouched")
        raise Refused(decision, Stage.CONNECTION)  # the connection gets a layer that closes it

    @guard
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        # After a 101, mitmproxy relays what follows as raw TCP unless it makes a WebSocket of
        # it, by its own test (below): anything else is refused, one event.
        if flow.response is None or flow.response.status_code != 101 or becomes_websocket(flow):
            return
        upgrade = flow.request.headers.get("upgrade", "?").strip()[:40]
        if upgrade.lower() == "websocket":
            detail = "a WebSocket upgrade mitmproxy would relay as raw TCP (no Sec-WebSocket-Version: 13)"
        else:
            detail = f"upgrade to {upgrade!r}"
        decision = Decision(flow_state(flow).host_name or flow.request.host, flow.request.port,
                            False, "protocol", detail=detail)
        raise Refused(decision, Stage.RESPONSE)  # killed: no upstream error is added for it
