"""Refuse destinations the policy does not allow, before any DNS query or connection.

* CONNECT: decided whole in ``http_connect``, by the checks serve's front reads too
  (egress.proxy.connect: the policy, a credential in the name, the address to dial); a
  refusal is the CONNECT's answer.
* Plain HTTP (absolute-form): decided in ``requestheaders``.
* Inside a tunnel: each request is decided again (the policy may have changed)
  and everything that names a host must name the tunnel's host: the TLS SNI, the
  Host header, and the request target when it is in absolute form (RFC 9112 §3.2.2:
  the server then ignores the Host header and serves the target's virtual host,
  so ``CONNECT ok.test`` then ``GET http://evil.test/`` reached evil.test's site).
  Anything else is ``misdirected`` (domain fronting through an allowed address).
* A request mitmproxy itself refused (its request-smuggling checks) reaches
  ``requestheaders`` with ``flow.error`` set: it is reported as a ``protocol`` refusal.

The destination is parsed once per request, into the flow's :class:`FlowState`.
"""

from __future__ import annotations

from mitmproxy import http

from egress.core.hosts import Host, InvalidHost, parse_authority, parse_host
from egress.policy.matcher import Decision
from egress.proxy.connect import ConnectContext, Refusal, UpstreamFailure, Wait, check_policy, remember, settle_connect
from egress.proxy.engine import Engine
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import FlowState, flow_state
from egress.proxy.refusal import Refused, upstream_failure


class PolicyGuard:
    def __init__(self, engine: Engine):
        self.engine = engine

    @guard
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        state = flow_state(flow)
        written, port = flow.request.host, flow.request.port
        try:
            host = parse_host(written)
        except InvalidHost as e:
            raise Refused(Decision(written[:300], port, False, "invalid-host", detail=str(e))) from None
        state.host, state.port = host, port
        engine, conn = self.engine, self.engine.conn(flow.client_conn)
        ctx = ConnectContext(host, port, written, conn.pins.get(host.name), conn.pinned_under.get(host.name))
        outcome = await settle_connect(engine, ctx)
        remember(engine, conn, ctx, outcome)
        if isinstance(outcome, Refusal):
            raise Refused(outcome.decision)
        if isinstance(outcome, UpstreamFailure):
            upstream_failure(engine, flow, host.name, outcome.code, outcome.message)
            return
        conn.tunnel, conn.tunnel_generation = (host, port), engine.policy_generation
        state.rule = outcome.rule  # formatted only when an event is written (the Reporter's)

    @guard
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = flow_state(flow)
        if flow.error is not None:  # mitmproxy refused it already; egress answers 400 (egress/proxy/mitm.py)
            tunnel = self.engine.conn(flow.client_conn).tunnel
            # inside a tunnel the request names no host of its own: the tunnel's is the one to name
            host = flow.request.host or (tunnel[0].name if tunnel is not None else "") or "unknown"
            # mitmproxy's hint ("Disable the validate_inbound_headers option...") is no option of egress's
            detail = flow.error.msg.split(" Disable the ", 1)[0]
            raise Refused(Decision(host, flow.request.port, False, "protocol", detail=detail[:200]))
        tunnel = self.engine.conn(flow.client_conn).tunnel
        if tunnel is not None:
            host, port = tunnel
            state.host = host
            decision = await self._decide(state, host, port)
            if decision.allowed:
                decision = self._misdirected(flow, host, port, in_tunnel=True) or decision
        else:
            decision = await self._decide(state, flow.request.host, flow.request.port)
            if decision.allowed:
                decision = self._misdirected(flow, state.host, decision.port, in_tunnel=False) or decision
        if not decision.allowed:
            raise Refused(decision)
        self._remember(flow, state, decision)

    async def _decide(self, state: FlowState, host: str | Host, port: int) -> Decision:
        """The policy's answer, as a CONNECT's (egress.proxy.connect.check_policy): a not-allowed
        name may still be granted for this run."""
        if not isinstance(host, Host):
            try:
                host = parse_host(host)
            except InvalidHost as e:
                return Decision(host[:300], port, False, "invalid-host", detail=str(e))
        state.host, state.port = host, port
        answer = check_policy(self.engine, ConnectContext(host, port, host.name))
        return await answer.settle() if isinstance(answer, Wait) else answer

    @staticmethod
    def _misdirected(flow: http.HTTPFlow, host: Host, port: int, in_tunnel: bool) -> Decision | None:
        """A refusal if the SNI, the Host header or an absolute-form target names another host."""
        claimed = []
        if flow.client_conn.sni:
            claimed.append(("TLS SNI", flow.client_conn.sni))
        if flow.request.host_header:
            claimed.append(("Host header", flow.request.host_header))
        # Outside a tunnel the target is what was decided on (mitmproxy sends it upstream in
        # origin form); inside one, mitmproxy forwards an absolute-form target as it came.
        if in_tunnel and flow.request.authority:
            claimed.append(("request target", flow.request.authority))
        for what, value in claimed:
            try:
                name = parse_authority(value)[0].name
            except InvalidHost:
                name = None
            if name != host.name:
                return Decision(host.name, port, False, "misdirected", detail=f"{what} names {value[:100]!r}")
        return None

    @staticmethod
    def _remember(flow: http.HTTPFlow, state: FlowState, decision: Decision) -> None:
        """What later addons report: the rule that allowed it (the host is already in state)."""
        state.rule = decision.rule  # formatted only when an event is written
