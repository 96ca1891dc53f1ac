"""Resolve each allowed destination once, refuse special-purpose addresses, dial the checked one.

A public name may resolve to 127.0.0.1, 10.x or the metadata service (SSRF, DNS
rebinding). After the policy allows a host, its addresses are resolved here
(dnspython, bounded time; localhost is loopback without a lookup) and the policy
chooses one (``Policy.choose_address``, the decision ``egress check`` makes too):
loopback, private, link-local, CGNAT, metadata, multicast, reserved and
IPv4-embedding IPv6 addresses are refused unless ``allow_private`` names the host or
range, and the refusal names the address, its class and the entry that would allow
it; so is this proxy's own listening address (a loop, not an upstream). The address that
passed is pinned for the client connection (its ConnState) and ``server_connect`` dials
exactly it.

The check is the CONNECT decision's (egress.proxy.connect.check_address): a CONNECT's
address is checked there, with the rest of its decision (egress.proxy.addons.policy_guard);
each request's here, before anything is dialled.

A pin holds only under the policy that checked it. After a reload (Engine.policy_generation),
the next request that would use a pinned address -- on a kept-alive connection, or inside a
tunnel, whose server connection mitmproxy reuses without dialling again -- has that address
checked again by the new policy (``choose_address``, no new lookup: the open connection goes
to that address, whatever DNS says now). Refused, the request gets the refusal and the client
connection is closed with its server connections (the refusal's ``Connection: close``).
Measured before: ``allow_private`` withdrawn, a kept-alive connection's next request and a
request in an open TLS tunnel were still served by the address (red-team P8).
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.proxy import server_hooks

from egress.core.hosts import InvalidHost, parse_host
from egress.policy.matcher import Decision
from egress.proxy import mitm
from egress.proxy.connect import ConnectContext, Refusal, UpstreamFailure, Wait, check_address, remember
from egress.proxy.engine import Engine
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import flow_state, refused
from egress.proxy.refusal import Refused, Stage, upstream_failure


class AddressGuard:
    def __init__(self, engine: Engine):
        self.engine = engine
        # server connection id -> the name it was opened for (restored once connected)
        self._names: dict[str, str] = {}

    @guard
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        # inside a tunnel too: its address was pinned at the CONNECT, and a reload may refuse it since
        if flow.response is not None or refused(flow):
            return
        state = flow_state(flow)
        conn = self.engine.conn(flow.client_conn)
        if conn.tunnel is not None:
            host, port = conn.tunnel  # PolicyGuard decided the tunnel's host (misdirected otherwise)
        else:
            host = state.host if state.host is not None else parse_host(flow.request.host)
            port = flow.request.port
        ctx = ConnectContext(host, port, flow.request.host, conn.pins.get(host.name), conn.pinned_under.get(host.name))
        # the CONNECT decision's own address check (egress.proxy.connect), for each request
        answer = check_address(self.engine, ctx)
        if isinstance(answer, Wait):
            answer = await answer.settle()
        if isinstance(answer, Decision):
            answer = Refusal(answer)
        remember(self.engine, conn, ctx, answer)
        if isinstance(answer, Refusal):
            raise Refused(answer.decision)
        if isinstance(answer, UpstreamFailure):
            upstream_failure(self.engine, flow, host.name, answer.code, answer.message)

    @guard
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if data.server.error or not data.server.address:
            return
        name, port, *_ = data.server.address
        try:
            host = parse_host(name)
        except InvalidHost as e:
            invalid = Decision(name[:300], port, False, "invalid-host", detail=str(e))
            raise Refused(invalid, Stage.SERVER_CONNECT) from None
        # the pinned address (never this proxy's own listener); a connection no request checked
        # (should not happen) is checked now
        pinned = self.engine.conn(data.client).pins.get(host.name)
        answer = check_address(self.engine, ConnectContext(host, port, name, pinned, self.engine.policy_generation))
        if isinstance(answer, Wait):
            answer = await answer.settle()
        lookup = getattr(answer, "lookup", None)
        if lookup is not None:
            self.engine.recorder.metrics.dns_lookup.observe(lookup)
        if isinstance(answer, (Decision, Refusal)):
            raise Refused(answer if isinstance(answer, Decision) else answer.decision, Stage.SERVER_CONNECT)
        if isinstance(answer, UpstreamFailure):
            data.server.error = f"{host.name}: {answer.message}"
            return
        if data.server.sni is None and host.ip is None:
            data.server.sni = host.name  # verify the upstream certificate against the name
        data.server.address = (str(answer.address), port)
        self._names[data.server.id] = name

    @guard
    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # Give the connection its name back so that mitmproxy reuses it by name.
        # mitmproxy forbids changing the address of an open connection because it
        # would not reroute it; here it only relabels it (peername keeps the real
        # address), so the guard is bypassed deliberately.
        name = self._names.pop(data.server.id, None)
        if name is not None and data.server.address:
            mitm.relabel_server_address(data.server, (name, data.server.address[1]))

    @guard
    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._names.pop(data.server.id, None)
