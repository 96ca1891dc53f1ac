"""Refuse destinations the policy does not allow, before any DNS query or connection.

* CONNECT: decided in ``http_connect``; a refusal is the CONNECT's answer.
* Plain HTTP (absolute-form): decided in ``requestheaders``.
* Inside a tunnel: each request is decided again (the policy may have changed)
  and its Host header and the TLS SNI must name the tunnel's host; anything else
  is ``misdirected`` (domain fronting through an allowed address).
"""

from __future__ import annotations

import dataclasses

from mitmproxy import connection, http

from .. import refusal
from ..engine import Engine, client_label
from ..hosts import InvalidHost, parse_host, split_host_port
from ..policy import Decision


class PolicyGuard:
    def __init__(self, engine: Engine):
        self.engine = engine

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        decision = await self._decide(flow.request.host, flow.request.port)
        if not decision.allowed:
            self._refuse(flow, decision)
            return
        self.engine.tunnels[flow.client_conn.id] = (parse_host(flow.request.host), flow.request.port)
        self._remember(flow, decision)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        tunnel = self.engine.tunnels.get(flow.client_conn.id)
        if tunnel is not None:
            host, port = tunnel
            decision = await self._decide(host, port)
            if decision.allowed:
                decision = self._misdirected(flow, host.name, port) or decision
        else:
            decision = await self._decide(flow.request.host, flow.request.port)
            if decision.allowed:
                decision = self._misdirected(flow, decision.host, decision.port) or decision
        if not decision.allowed:
            self._refuse(flow, decision)
            return
        self._remember(flow, decision)

    async def _decide(self, host, port: int) -> Decision:
        """The policy's answer; a not-allowed *name* may still be granted for this run."""
        decision = self.engine.policy.decide(host, port)
        asker = self.engine.asker
        if decision.allowed or decision.reason != "not-allowed" or asker is None:
            return decision
        if _is_ip(decision.host) or not await asker.ask(decision.host):
            return decision
        return Decision(decision.host, port, True, "allowed",
                        detail="allowed for this run")

    def client_disconnected(self, client: connection.Client) -> None:
        self.engine.tunnels.pop(client.id, None)

    def _misdirected(self, flow: http.HTTPFlow, host: str, port: int) -> Decision | None:
        """A refusal if the Host header or SNI names another host than ``host``."""
        claimed = []
        if flow.client_conn.sni:
            claimed.append(("TLS SNI", flow.client_conn.sni))
        if flow.request.host_header:
            claimed.append(("Host header", flow.request.host_header))
        for what, value in claimed:
            try:
                name = parse_host(split_host_port(value)[0]).name
            except InvalidHost:
                name = None
            if name != host:
                return Decision(host, port, False, "misdirected", detail=f"{what} names {value[:100]!r}")
        return None

    @staticmethod
    def _remember(flow: http.HTTPFlow, decision: Decision) -> None:
        """What later addons report: the canonical host and the rule that allowed it."""
        flow.metadata["egress.host"] = decision.host
        flow.metadata["egress.rule"] = decision.rule  # formatted only when an event is written

    def _refuse(self, flow: http.HTTPFlow, decision: Decision) -> None:
        # A host name or Host header may carry a secret. The canonical name is lower-cased,
        # which can hide a token's shape: redact the name as the client wrote it instead.
        clean = self.engine.recorder.clean
        written = flow.request.host
        if clean(written) != written:
            decision = dataclasses.replace(decision, host=clean(written))
        decision = dataclasses.replace(decision, detail=clean(decision.detail))
        flow.response = refusal.refusal(decision.host, decision.reason, decision.detail)
        flow.metadata["egress.refused"] = True
        self.engine.record_refusal(client_label(flow.client_conn.peername), flow.request.method, decision)


def _is_ip(host: str) -> bool:
    try:
        return parse_host(host).is_ip
    except InvalidHost:
        return True  # not a name either: never offered
