"""The proxy: mitmproxy embedded with only the addons egress needs.

mitmdump loads ~35 default addons and dispatches every hook to each of them; that
dispatch was a third of its CPU per request (shared/research/perf-anchors.md).
Here the master carries Core, Proxyserver, NextLayer and TlsConfig, and our own
guards, in the order the road of a request needs them:

    Passthrough -> NextLayer -> ProtocolGuard      (what a tunnel may carry)
    PolicyGuard -> CredentialGuard -> AddressGuard -> UpstreamErrors -> Reporter
                 (decide; keep secrets in; resolve and pin; name upstream failures; report)
    UpstreamTimeout                                (504 when upstream never answers)
    LineFirst              (egress run: a refusal is answered after the person's line about it)

Options chosen for an egress proxy: ``connection_strategy=lazy`` (nothing is
dialled before a request has been checked, so a misdirected request inside a
tunnel never reaches upstream), ``http2=False`` (intercepted h2 bulk ran 3.4x
slower), bodies over 1 MiB streamed (never buffered whole).
"""

from __future__ import annotations

import asyncio
import logging
import socket

from egress.proxy import mitm
from egress.proxy.addons.address_guard import AddressGuard
from egress.proxy.addons.credential_guard import CredentialGuard
from egress.proxy.addons.injection_label import InjectionLabel
from egress.proxy.addons.limits import Limits, raise_fd_limit
from egress.proxy.addons.line_first import LineFirst
from egress.proxy.addons.policy_guard import PolicyGuard
from egress.proxy.addons.reporter import Reporter
from egress.proxy.addons.tunnels import Passthrough, ProtocolGuard
from egress.proxy.addons.upstream_errors import UpstreamErrors
from egress.proxy.addons.upstream_timeout import UpstreamTimeout
from egress.proxy.config import ProxyConfig
from egress.proxy.engine import Engine
from egress.proxy.fastpath import Front
from egress.proxy.trust import UpstreamTrust, proxy_locations, upstream_trust

STREAM_LARGE_BODIES = "1m"
DRAIN_SECONDS = 2.0  # at stop, how long client connections may take to end once told to

ListenError = mitm.ListenError


class EgressProxy:
    """One mitmproxy master serving the egress addons. Create inside a running event loop.

    Built by egress.proxy.build.ProxyBuilder, for `egress serve` and `egress run` alike.
    """

    def __init__(self, engine: Engine, config: ProxyConfig, credentials=None, trust: UpstreamTrust | None = None):
        """``trust``: the upstream CAs, as ProxyBuilder.open() checked them (default: checked now).
        The CA must exist (egress.proxy.ca.ensure_ca). Raises egress.proxy.trust.TrustError.

        It listens nowhere itself: it serves the sockets it is handed (serve_socket), which
        ProxyBuilder.start binds for ``config.listen``; with the front (serve), the front takes
        each connection first and hands mitmproxy what it does not serve itself.
        """
        self.engine = engine
        self.config = config
        state = config.state
        raise_fd_limit()
        self.master, own = mitm.new_master(listen_host="127.0.0.1", listen_port=0, mode=["regular"], server=False)
        self.proxyserver = own.proxyserver
        limits = Limits(engine)
        credential_guard = CredentialGuard(engine, credentials) if credentials is not None else None
        self.master.addons.add(
            own.core,
            own.proxyserver,
            Passthrough(engine),
            own.next_layer,
            ProtocolGuard(engine),
            limits,  # after NextLayer and ProtocolGuard: it sees the layer they chose
            own.tls_config,
            PolicyGuard(engine),
            *([credential_guard] if credential_guard is not None else []),
            AddressGuard(engine),
            UpstreamErrors(engine),  # before the Reporter: it records the code named here
            InjectionLabel(engine),  # before the Reporter: a body it reads whole is not streamed
            Reporter(engine),
            UpstreamTimeout(config.upstream_timeout),
            # last: a refusal's answer after the run's line about it (no reporter, as in serve: no cost)
            *([LineFirst(engine)] if engine.recorder.reporter is not None else []),
        )
        update = dict(
            confdir=state.ca,
            connection_strategy="lazy",
            http2=False,
            stream_large_bodies=STREAM_LARGE_BODIES,
        )
        # The system's CAs (and --upstream-ca), not mitmproxy's default of certifi's only.
        trust = trust or upstream_trust(config.upstream_ca)
        cafile, capath = proxy_locations(trust, state.root)
        update["ssl_verify_upstream_trusted_ca"] = cafile
        if capath is not None:
            update["ssl_verify_upstream_trusted_confdir"] = capath
        update.update(config.extra_options)
        self.master.options.update(**update)
        self._extra_servers: list[asyncio.Server] = []
        self._captures: list = []  # egress.proxy.capture.Capture, one per run
        self.accepted = False  # a connection came through a handed-over socket
        self.on_first_accept = None  # called when it does, the first time (the warm proxy tells egress run)
        self.stopping = False  # stop() was called: /readyz says so while connections drain
        self.front = None
        if config.front:
            self.front = Front(engine, mitm.regular_handler(self.proxyserver), limits)
        asyncio.get_running_loop().set_exception_handler(_loop_exception)

    async def start(self) -> None:
        """Run mitmproxy's start-up (its ``running`` hook); serve_socket() then serves."""
        await mitm.start(self.master, self.proxyserver)

    async def serve_socket(self, sock: socket.socket) -> None:
        """Serve connections from an already-listening socket (serve's address, or one made
        inside a sandbox)."""
        if self.front is not None:
            await self.front.serve_socket(sock)
            return
        self._extra_servers.append(await mitm.serve_socket(self.proxyserver, sock, on_accept=self._accepted))

    async def serve_capture(self, sockets) -> None:
        """Serve `egress run`'s transparent capture sockets ([(tag, socket)], sandbox/capture.py)."""
        from egress.proxy.capture import Capture

        engine = self.engine
        capture = Capture(mitm.regular_handler(self.proxyserver), decide=lambda host: engine.policy.decide(host),
                          record=engine.recorder.record, on_activity=self._accepted)
        await capture.serve(list(sockets))
        self._captures.append(capture)

    def _accepted(self) -> None:
        if not self.accepted:
            self.accepted = True
            if self.on_first_accept is not None:
                self.on_first_accept()

    async def run_until_stopped(self) -> None:
        """Returns once stop() was called and every client connection has ended (at most
        DRAIN_SECONDS later): none is left for the loop's end to cancel mid-flight, so each
        one's last events are recorded."""
        try:
            await mitm.stopped(self.master)
        finally:
            if self.front is not None:
                self.front.close()
            for server in self._extra_servers:
                server.close()
            for capture in self._captures:
                capture.close()
            await mitm.stop_serving(self.proxyserver, DRAIN_SECONDS)
            await mitm.done(self.master)

    def stop(self) -> None:
        """Thread-safe."""
        self.stopping = True
        mitm.stop(self.master)


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The proxy loop's exception handler: a cancelled task is not an error.

    Python 3.11's asyncio.start_server reports a connection task cancelled as the loop ends
    ("Exception in callback StreamReaderProtocol.connection_made...": its done-callback calls
    task.exception(), which raises CancelledError; 3.12 checks task.cancelled() first). That
    traceback reached `egress run`'s stderr in 2 of 80 runs, and in every run whose command
    connected and exited at once. run_until_stopped ends connections before the loop does;
    this covers one accepted in the last instant. Everything else goes to asyncio's default
    handler, i.e. to logging.
    """
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


class _Prefixed(logging.Formatter):
    """``egress: <message>`` on one line: no traceback, no second line (a harness parses stderr)."""

    def format(self, record: logging.LogRecord) -> str:
        message = "; ".join(line.strip() for line in record.getMessage().splitlines() if line.strip())
        return f"egress: {message}"


class _Levels(logging.Filter):
    """egress's own records from ``own``, everyone else's (mitmproxy, asyncio) from ``others``."""

    def __init__(self, own: int, others: int):
        super().__init__()
        self.own, self.others = own, others

    def filter(self, record: logging.LogRecord) -> bool:
        mine = record.name == "egress" or record.name.startswith("egress.")
        return record.levelno >= (self.own if mine else self.others)


def configure_logging(level: int = logging.WARNING, others: int | None = None) -> None:
    """Log records on stderr as one ``egress: ...`` line each: egress's from ``level``, other
    libraries' (mitmproxy's warnings, e.g. a client that does not trust the CA) from ``others``
    (default: ``level`` too).

    `egress run` passes ``others=logging.ERROR``: the command's stderr is the person's, and only
    egress's own lines may join it (mitmproxy's warnings say what EGRESS_* lines say better).
    A handler always being there also keeps Python's last-resort handler, which prints
    tracebacks, from ever writing there.
    """
    handler = logging.StreamHandler()
    handler.setFormatter(_Prefixed())
    handler.addFilter(_Levels(level, level if others is None else others))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(min(level, level if others is None else others))


def quiet_for_run() -> None:
    """Under `egress run`, nothing but egress's own lines reaches stderr: log records as above,
    warnings (``warnings.warn``) and exceptions escaping a thread as one ``egress:`` line too."""
    import threading

    configure_logging(logging.WARNING, others=logging.ERROR)
    logging.captureWarnings(True)  # py.warnings records: below ERROR, so not shown

    def thread_failed(args) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "a"
        # the type only: an exception's message may quote what a request carried
        logging.getLogger("egress").error(f"the {name} thread failed ({args.exc_type.__name__})")

    threading.excepthook = thread_failed
