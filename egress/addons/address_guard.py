"""Resolve each allowed destination once, refuse special-purpose addresses, dial the checked one.

A public name may resolve to 127.0.0.1, 10.x or the metadata service (SSRF, DNS
rebinding). After the policy allows a host, its addresses are resolved here
(dnspython, bounded time) and classified; loopback, private, link-local, CGNAT,
metadata, multicast, reserved and IPv4-embedding IPv6 addresses are refused
unless ``allow_private`` names the host or range. The address that passed is
pinned for the client connection and ``server_connect`` dials exactly it.
"""

from __future__ import annotations

import time

from mitmproxy import connection, ctx, http
from mitmproxy.proxy import server_hooks

from .. import refusal
from ..addresses import classify
from ..engine import Engine, client_label
from ..events import Event
from ..hosts import Host, InvalidHost, IPAddress, parse_host
from ..policy import Decision
from ..resolver import ResolveError


class AddressGuard:
    def __init__(self, engine: Engine):
        self.engine = engine
        # client connection id -> {host name: the address that was checked}; per client, so
        # a disconnect drops its pins in O(1) whatever the number of open connections
        self.pins: dict[str, dict[str, IPAddress]] = {}
        # server connection id -> the name it was opened for (restored once connected)
        self._names: dict[str, str] = {}

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            await self._check(flow, parse_host(flow.request.host), flow.request.port)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None and flow.client_conn.id not in self.engine.tunnels:
            await self._check(flow, parse_host(flow.request.host), flow.request.port)

    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if data.server.error or not data.server.address:
            return
        name, port, *_ = data.server.address
        try:
            host = parse_host(name)
        except InvalidHost as e:
            data.server.error = f"EGRESS_BLOCKED {name}: {e}"
            return
        ip = self.pins.get(data.client.id, {}).get(host.name)
        if ip is None:  # a connection no request checked (should not happen): check it now
            result = await self._resolve_checked(host, port)
            if not isinstance(result, tuple):
                data.server.error = f"EGRESS_BLOCKED {host.name}: {result.words()}"
                return
            ip = result[0]
        if ip.is_loopback or ip.is_unspecified:
            own = {addr[1] for addr in ctx.master.addons.get("proxyserver").listen_addrs()}
            if port in own:  # it would be served by this very proxy, again and again
                data.server.error = f"EGRESS_BLOCKED {host.name}: {port} is this proxy's own port"
                return
        if data.server.sni is None and host.ip is None:
            data.server.sni = host.name  # verify the upstream certificate against the name
        data.server.address = (str(ip), port)
        self._names[data.server.id] = name

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # Give the connection its name back so that mitmproxy reuses it by name.
        # mitmproxy forbids changing the address of an open connection because it
        # would not reroute it; here it only relabels it (peername keeps the real
        # address), so the guard is bypassed deliberately.
        name = self._names.pop(data.server.id, None)
        if name is not None and data.server.address:
            object.__setattr__(data.server, "address", (name, data.server.address[1]))

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._names.pop(data.server.id, None)

    def client_disconnected(self, client: connection.Client) -> None:
        self.pins.pop(client.id, None)

    async def _check(self, flow: http.HTTPFlow, host: Host, port: int) -> None:
        if host.name in self.pins.get(flow.client_conn.id, ()):
            return
        result = await self._resolve_checked(host, port)
        client = client_label(flow.client_conn.peername)
        if isinstance(result, tuple):
            self.pins.setdefault(flow.client_conn.id, {})[host.name] = result[0]
            return
        flow.metadata["egress.refused"] = True
        clean = self.engine.recorder.clean
        if isinstance(result, Decision):
            flow.response = refusal.refusal(clean(host.name), result.reason, result.detail)
            self.engine.record_refusal(client, flow.request.method, result)
        else:
            code, message = result.code, str(result)
            flow.response = refusal.upstream_error(clean(host.name), code, message)
            self.engine.recorder.record(Event(
                client=client, method=flow.request.method, host=host.name, port=port,
                decision="error", reason=code, detail=message))

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
        policy = self.engine.policy
        refused = []
        for ip in addresses:
            kind = classify(ip)
            if kind is None or policy.private_allowed(host, ip, kind) is not None:
                return (ip,)
            refused.append(f"{ip} is {kind}")
        return Decision(host.name, port, False, "private-address", detail="; ".join(refused[:3]))
