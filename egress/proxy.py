"""The proxy: mitmproxy embedded with only the addons egress needs.

mitmdump loads ~35 default addons and dispatches every hook to each of them; that
dispatch was a third of its CPU per request (shared/research/perf-anchors.md).
Here the master carries Core, Proxyserver, NextLayer and TlsConfig, and our own
guards, in the order the road of a request needs them:

    Passthrough -> NextLayer -> ProtocolGuard      (what a tunnel may carry)
    PolicyGuard -> CredentialGuard -> AddressGuard -> Reporter
                 (decide; keep secrets in; resolve and pin; report)
    UpstreamTimeout                                (504 when upstream never answers)

Options chosen for an egress proxy: ``connection_strategy=lazy`` (nothing is
dialled before a request has been checked, so a misdirected request inside a
tunnel never reaches upstream), ``http2=False`` (intercepted h2 bulk ran 3.4x
slower), bodies over 1 MiB streamed (never buffered whole).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

from mitmproxy import master, options
from mitmproxy.addons import core, next_layer, proxyserver, tlsconfig
from mitmproxy.proxy.mode_servers import ServerInstance
from mitmproxy.proxy.mode_specs import ProxyMode

from .addons.address_guard import AddressGuard
from .addons.credential_guard import CredentialGuard
from .addons.limits import Limits, raise_fd_limit
from .addons.policy_guard import PolicyGuard
from .addons.reporter import Reporter
from .addons.tunnels import Passthrough, ProtocolGuard
from .addons.upstream_timeout import UpstreamTimeout
from .engine import Engine
from .state import ca_dir, ensure_ca, upstream_bundle

STREAM_LARGE_BODIES = "1m"


class ListenError(Exception):
    """The proxy could not listen where it was asked to."""


@dataclass
class ProxySettings:
    listen_host: str = "127.0.0.1"
    listen_port: int | None = 8080  # None: listen nowhere, serve only handed-over sockets
    state_dir: Path | None = None
    upstream_ca: Path | None = None
    upstream_timeout: float = 60.0
    extra_options: dict = field(default_factory=dict)


class EgressProxy:
    """One mitmproxy master serving the egress addons. Create inside a running event loop."""

    def __init__(self, engine: Engine, settings: ProxySettings, credentials=None):
        self.engine = engine
        self.settings = settings
        ensure_ca(settings.state_dir)
        raise_fd_limit()
        opts = options.Options(listen_host=settings.listen_host, listen_port=settings.listen_port or 0,
                               mode=["regular"], server=settings.listen_port is not None)
        self.master = master.Master(opts)
        self.proxyserver = proxyserver.Proxyserver()
        self.master.addons.add(
            core.Core(),
            self.proxyserver,
            Passthrough(engine),
            next_layer.NextLayer(),
            ProtocolGuard(engine),
            Limits(engine),  # after NextLayer and ProtocolGuard: it sees the layer they chose
            tlsconfig.TlsConfig(),
            PolicyGuard(engine),
            *([CredentialGuard(engine, credentials)] if credentials is not None else []),
            AddressGuard(engine),
            Reporter(engine),
            UpstreamTimeout(settings.upstream_timeout),
        )
        update = dict(
            confdir=str(ca_dir(settings.state_dir)),
            connection_strategy="lazy",
            http2=False,
            stream_large_bodies=STREAM_LARGE_BODIES,
        )
        if settings.upstream_ca:
            update["ssl_verify_upstream_trusted_ca"] = str(
                upstream_bundle(settings.upstream_ca, settings.state_dir))
        update.update(settings.extra_options)
        opts.update(**update)
        self._extra_servers: list[asyncio.Server] = []

    async def start(self) -> list[tuple[str, int]]:
        """Listen; return the bound addresses. Raises ListenError."""
        ok = await self.proxyserver.setup_servers()
        if not ok:
            errors = [str(s.last_exception) for s in self.proxyserver.servers if s.last_exception]
            raise ListenError("; ".join(errors) or "the proxy could not start listening")
        await self.master.running()
        return [addr[:2] for addr in self.proxyserver.listen_addrs()]

    async def serve_socket(self, sock: socket.socket) -> None:
        """Serve connections from an already-listening socket (e.g. made inside a sandbox)."""
        instance = next(iter(self.proxyserver.servers), None)
        if instance is None:  # not listening anywhere itself: a regular-mode instance of our own
            instance = ServerInstance.make(ProxyMode.parse("regular"), self.proxyserver)
        sock.setblocking(False)
        self._extra_servers.append(await asyncio.start_server(instance.handle_stream, sock=sock))

    async def run_until_stopped(self) -> None:
        try:
            await self.master.should_exit.wait()
        finally:
            for server in self._extra_servers:
                server.close()
            await self.master.done()

    def stop(self) -> None:
        """Thread-safe."""
        self.master.shutdown()


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"egress: {record.getMessage()}"


def configure_logging(level: int = logging.WARNING) -> None:
    """mitmproxy's warnings (e.g. a client that does not trust the CA) on stderr, prefixed."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Prefixed())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
