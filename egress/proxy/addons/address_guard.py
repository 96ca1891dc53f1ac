"""Resolve each allowed destination once, refuse special-purpose addresses, dial the checked one.

A public name may resolve to 127.0.0.1, 10.x or the metadata service (SSRF, DNS
rebinding). After the policy allows a host, its addresses are resolved here
(dnspython, bounded time; localhost is loopback without a lookup) and the policy
chooses one (``Policy.choose_address``, the decision ``egress check`` makes too):
loopback, private, link-local, CGNAT, metadata, multicast, reserved and
IPv4-embedding IPv6 addresses are refused unless ``allow_private`` names the host or
range, and the refusal names the address, its class and the entry that would allow
it. The address that passed is pinned for the client connection (its ConnState) and
``server_connect`` dials exactly it.

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

import time
import weakref

from mitmproxy import http
from mitmproxy.proxy import server_hooks

from egress.proxy import mitm
from egress.proxy.engine import Engine
from egress.proxy.failclosed import fail_closed
from egress.proxy.flowstate import flow_state, refused
from egress.core.hosts import Host, InvalidHost, IPAddress, parse_host
from egress.policy.matcher import Decision
from egress.proxy.refusal import refuse, upstream_failure
from egress.proxy.resolver import ResolveError


class AddressGuard:
    def __init__(self, engine: Engine):
        self.engine = engine
        # server connection id -> the name it was opened for (restored once connected)
        self._names: dict[str, str] = {}
        # mitmproxy Client -> {pinned name: the Engine.policy_generation that checked its address};
        # weak keys, as Engine.connections, so nothing outlives the client connection
        self._checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @fail_closed
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is None and not refused(flow):
            await self._check(flow)

    @fail_closed
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        # inside a tunnel too: its address was pinned at the CONNECT, and a reload may refuse it since
        if flow.response is None and not refused(flow):
            await self._check(flow)

    @fail_closed
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if data.server.error or not data.server.address:
            return
        name, port, *_ = data.server.address
        try:
            host = parse_host(name)
        except InvalidHost as e:
            data.server.error = f"EGRESS_BLOCKED {name}: {e}"
            return
        ip = self.engine.conn(data.client).pins.get(host.name)
        if ip is None:  # a connection no request checked (should not happen): check it now
            result = await self._resolve_checked(host, port)
            if not isinstance(result, tuple):
                data.server.error = f"EGRESS_BLOCKED {host.name}: {result.words()}"
                return
            ip = result[0]
        if dials_itself(self.engine, ip, port):  # it would be served by this very proxy, again and again
            data.server.error = f"EGRESS_BLOCKED {host.name}: {port} is this proxy's own port"
            return
        if data.server.sni is None and host.ip is None:
            data.server.sni = host.name  # verify the upstream certificate against the name
        data.server.address = (str(ip), port)
        self._names[data.server.id] = name

    @fail_closed
    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # Give the connection its name back so that mitmproxy reuses it by name.
        # mitmproxy forbids changing the address of an open connection because it
        # would not reroute it; here it only relabels it (peername keeps the real
        # address), so the guard is bypassed deliberately.
        name = self._names.pop(data.server.id, None)
        if name is not None and data.server.address:
            mitm.relabel_server_address(data.server, (name, data.server.address[1]))

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._names.pop(data.server.id, None)

    async def _check(self, flow: http.HTTPFlow) -> None:
        state = flow_state(flow)
        conn = self.engine.conn(flow.client_conn)
        if conn.tunnel is not None and flow.request.method != "CONNECT":
            host, port = conn.tunnel  # PolicyGuard decided the tunnel's host (misdirected otherwise)
        else:
            host = state.host if state.host is not None else parse_host(flow.request.host)
            port = flow.request.port
        pins, generation = conn.pins, self.engine.policy_generation
        checked = self._checked.get(flow.client_conn)
        if checked is None:
            checked = self._checked[flow.client_conn] = {}
        pinned = pins.get(host.name)
        if pinned is not None:
            if checked.get(host.name) == generation:
                return
            # the policy changed since this address was checked: the open server connection goes to
            # it, so it is the address to check again (no lookup)
            result = self.engine.policy.choose_address(host, port, [pinned])
            if not isinstance(result, Decision):
                checked[host.name] = generation
                return
            del pins[host.name]
            checked.pop(host.name, None)
            refuse(self.engine, flow, result)
            return
        result = await self._resolve_checked(host, port)
        if isinstance(result, tuple):
            pins[host.name] = result[0]
            checked[host.name] = generation
        elif isinstance(result, Decision):
            refuse(self.engine, flow, result)
        else:
            upstream_failure(self.engine, flow, host.name, result.code, str(result))

    async def _resolve_checked(self, host: Host, port: int) -> tuple[IPAddress] | Decision | ResolveError:
        """The first usable address, a private-address refusal, or the resolution error."""
        started = time.perf_counter()
        try:
            addresses = await self.engine.resolver.resolve(host)
        except ResolveError as e:
            return e
        finally:
            if host.ip is None:
                self.engine.recorder.metrics.dns_lookup.observe(time.perf_counter() - started)
        chosen = self.engine.policy.choose_address(host, port, addresses)
        return chosen if isinstance(chosen, Decision) else (chosen,)


def checked_without_query(engine: Engine, host: Host, port: int) -> IPAddress | None:
    """The address AddressGuard would pin and dial for ``host``:``port``, when resolving it needs no
    query (egress.proxy.resolver.Resolver.cached: a literal, localhost, --resolve, a cached answer) and
    the policy accepts one of its addresses and the dial would not come back to this proxy; None
    in every other case (a query to make, a refusal, a failure), which the caller leaves to the
    guard itself (egress.proxy.fastpath). Observes the lookup's time as the guard does, only when it
    returns an address (the guard observes its own for the rest)."""
    started = time.perf_counter()
    addresses = engine.resolver.cached(host)
    elapsed = time.perf_counter() - started
    if not addresses:
        return None
    chosen = engine.policy.choose_address(host, port, addresses)
    if isinstance(chosen, Decision) or dials_itself(engine, chosen, port):
        return None
    if host.ip is None:
        engine.recorder.metrics.dns_lookup.observe(elapsed)
    return chosen


def dials_itself(engine: Engine, ip: IPAddress, port: int) -> bool:
    """Whether dialling ``ip``:``port`` would reach this proxy's own listener (a loop)."""
    if not (ip.is_loopback or ip.is_unspecified):
        return False
    return port in engine.own_ports or port in {addr[1] for addr in mitm.listen_addrs()}
