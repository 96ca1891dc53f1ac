"""How a proxy is wired: one configuration value and one builder, for `egress serve` and `egress run`.

    config = ProxyConfig(listen=("127.0.0.1", 8080), metrics=("127.0.0.1", 9464), audit_log="-")
    builder = ProxyBuilder(config)
    builder.open()               # the audit log, the metrics port, the upstream CAs: fails before anything runs
    builder.serve_metrics()      # the metrics endpoint answers from now on (a thread)
    proxy = await builder.start(policy, credentials)   # inside the event loop: engine, proxy, listening
    await proxy.run_until_stopped()
    builder.close()

`egress serve` does all of it at once. `egress run` opens before the sandbox starts (a bad
--audit-log, a metrics port in use or a bad --upstream-ca stops it before the command runs; no thread exists
yet, as the sandbox's fork wants), serves metrics just after, and starts the proxy in its
ProxySession when the command first connects. Importing this module costs nothing heavy:
prometheus_client, dnspython and mitmproxy are imported by serve_metrics() and start().
"""

from __future__ import annotations

import errno
import socket
import sys

from egress.core.contract import EXIT_LISTEN, EXIT_STATE
from egress.proxy.ca import StateError, ensure_ca
from egress.proxy.config import ProxyConfig
from egress.proxy.trust import TrustError, UpstreamTrust, upstream_trust

TYPE_CHECKING = False  # typing is not imported on egress run's path (egress.run.launcher); mypy reads True
if TYPE_CHECKING:
    from egress.observe.metrics import Metrics
    from egress.proxy.engine import Engine
    from egress.proxy.master import EgressProxy


class BuildError(Exception):
    """The proxy cannot be built as configured; ``status`` is egress serve's exit status for it."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ProxyBuilder:
    """Builds the proxy a :class:`ProxyConfig` describes; see the module's docstring."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.audit = None  # the audit log's stream
        self.metrics: Metrics | None = None  # made by serve_metrics() or start()
        self.trust: UpstreamTrust | None = None  # the upstream CAs: checked by open()
        self.engine: Engine | None = None  # set by start()
        self.proxy: EgressProxy | None = None  # set by start()
        self.bound: list[tuple[str, int]] = []  # where start() listens
        self._metrics_socket: socket.socket | None = None
        self._metrics_server = None

    # -- before anything runs: cheap, no thread, nothing heavy imported

    def open(self) -> None:
        """Check the upstream CAs (the system's, --upstream-ca), open the audit log and bind the
        metrics port, as configured. Raises BuildError."""
        config = self.config
        if self.trust is None:
            try:
                self.trust = upstream_trust(config.upstream_ca)
            except TrustError as e:
                raise BuildError(EXIT_STATE, str(e)) from None
        if config.audit_log is not None and self.audit is None:
            self.audit = open_audit(config.audit_log)
        if config.metrics is not None and self._metrics_socket is None:
            self._metrics_socket = _listening_socket(*config.metrics)

    def adopt(self, audit=None, metrics_socket: socket.socket | None = None) -> None:
        """Use an audit stream and a bound metrics socket someone else opened (egress run opens
        them before its command starts and hands them to its warm proxy), as open() would."""
        if audit is not None:
            self.audit = audit
        if metrics_socket is not None:
            self._metrics_socket = metrics_socket

    @property
    def metrics_socket(self) -> socket.socket | None:
        """The bound metrics socket (open() made it), for handing over; None without one."""
        return self._metrics_socket

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where the metrics endpoint listens (the port chosen for port 0), or None."""
        return self._metrics_socket.getsockname()[:2] if self._metrics_socket is not None else None

    @property
    def metrics_url(self) -> str | None:
        address = self.metrics_address
        return f"http://{format_address(*address)}/metrics" if address else None

    def serve_metrics(self, registry=None, unready=None) -> None:
        """Answer on the metrics port from now on (a thread), if one is configured: this proxy's
        metrics, or ``registry``'s (serve's supervisor: the sum of its workers'), and /healthz and
        /readyz, whose readiness is ``unready()`` (default: this builder's). Raises BuildError."""
        self.open()
        if self._metrics_socket is None or self._metrics_server is not None:
            return
        self._metrics_server = _serve_metrics(self._metrics_socket,
                                              registry if registry is not None else self._metrics().registry,
                                              unready if unready is not None else self.unready)

    def unready(self) -> list[str]:
        """Why this proxy is not ready for traffic (/readyz), in words; empty once it is: started
        (its policy loaded and in force), listening, and not stopping. Called from the metrics thread."""
        proxy, engine = self.proxy, self.engine
        if proxy is None or engine is None:
            return ["the proxy is not listening yet"]
        if proxy.stopping:
            return ["the proxy is stopping (draining its connections)"]
        return []

    # -- in the event loop

    async def start(self, policy, credentials=None, *, session: str | None = None, on_event=(),
                    asker=None, worker: int | None = None, sockets=()):
        """The engine (policy, resolver, recorder) and the proxy, serving ``sockets`` and listening
        where the config says (``bound``).

        ``on_event``: callbacks for every decision (a run's first one is its reporter, whose
        line a refused client's answer waits for); ``asker``: egress run's person in the loop;
        ``worker``: a serve worker's pid, in every event; ``sockets``: listening sockets that are
        this proxy's public address (serve's workers). Returns the egress.proxy.master.EgressProxy.
        Raises BuildError.
        """
        from egress.observe.events import Recorder
        from egress.proxy.engine import Engine, Redactor
        from egress.proxy.master import EgressProxy
        from egress.proxy.resolver import Resolver

        self.serve_metrics()
        config = self.config
        try:
            ensure_ca(config.state)  # before the address: a state folder it cannot use is status 5, first
        except StateError as e:
            raise BuildError(EXIT_STATE, str(e)) from None
        listening = [sock for family in listening_sockets(*config.listen) for sock in family] if config.listen else []
        sockets = [*listening, *sockets]
        try:
            # no event depends on an addon to be clean: the redactor is the recorder's from the start
            recorder = Recorder(self._metrics(), self.audit, session=session, worker=worker,
                                clean=Redactor(credentials) if credentials is not None else None)
            for callback in on_event:  # a run's (ProxySession's) reporter: its clients' answers wait for it
                recorder.subscribe(callback, name="run" if session else "subscriber", heard=bool(session))
            resolver = Resolver(dict(config.resolve), timeout=config.dns_timeout, nameserver=config.dns_server)
            engine = Engine(policy, resolver, recorder, asker=asker, proxy_auth=_proxy_auth(config.auth),
                            own_ports={sock.getsockname()[1] for sock in sockets})
            recorder.metrics.policy_rules.set(policy.rule_count)
            proxy = EgressProxy(engine, config, credentials, trust=self.trust)
            await proxy.start()
            for sock in sockets:
                await proxy.serve_socket(sock)
        except BaseException as e:
            for sock in listening:
                sock.close()
            if isinstance(e, (StateError, TrustError)):
                raise BuildError(EXIT_STATE, str(e)) from None
            raise
        self.bound = [sock.getsockname()[:2] for sock in listening]
        self.engine, self.proxy = engine, proxy
        # Everything built so far (mitmproxy's modules, the policy, the CA) lives as long as the
        # proxy: move it out of the collector's sight, so a full collection under load walks
        # only what requests allocate (31-44 ms pauses before; issue 11). Garbage first: frozen
        # cycles are never collected, and mitmproxy's option checks leave exception-traceback-
        # frame cycles whose frames lead back here, to the first policy: after a reload it was
        # kept for good (+200 MB with 1M entries).
        import gc

        gc.collect()
        gc.freeze()
        return proxy

    def close(self) -> None:
        """Deliver the events still queued for observers, stop the metrics endpoint and close the
        audit log (the proxy stops on its own)."""
        if self.engine is not None:
            self.engine.recorder.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        elif self._metrics_socket is not None:
            self._metrics_socket.close()
        self._metrics_socket = None
        if self.audit not in (None, sys.stdout):
            self.audit.close()
        self.audit = None

    def _metrics(self):
        if self.metrics is None:
            from egress.observe.metrics import Metrics

            self.metrics = Metrics()
        return self.metrics


def _proxy_auth(auth: tuple[str, str] | None) -> bytes | None:
    if auth is None:
        return None
    from egress.proxy.auth import expected

    return expected(auth)


def listening_sockets(host: str, port: int, copies: int = 1, *, reuse_port: bool = False,
                      backlog: int = 128) -> list[list[socket.socket]]:
    """For each of ``copies``, a socket listening on every address ``host`` names (as asyncio's
    servers bind them: ``localhost`` may be 127.0.0.1 and ::1; ``""``: every interface), all on
    one port (port 0: one free for every address). ``reuse_port``: SO_REUSEPORT, so that the
    copies share the port (serve's workers). Raises BuildError (status 4)."""
    tries = 8 if port == 0 else 1  # port 0: the first address's free port may be taken on another
    for attempt in range(1, tries + 1):
        try:
            return _bind(host, port, copies, reuse_port, backlog)
        except OSError as e:
            if attempt < tries and e.errno == errno.EADDRINUSE:
                continue
            raise BuildError(EXIT_LISTEN, f"cannot listen on {format_address(host, port)}: {e.strerror or e}") from None
    raise AssertionError("not reached")


def _bind(host: str, port: int, copies: int, reuse_port: bool, backlog: int) -> list[list[socket.socket]]:
    copied: list[list[socket.socket]] = [[] for _ in range(copies)]
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            for sockets in copied:
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], port, *address[2:]))
                port = sock.getsockname()[1]
                sock.listen(backlog)
    except OSError:
        for sockets in copied:
            for sock in sockets:
                sock.close()
        raise
    return copied


def open_audit(target: str):
    """The audit log's stream: standard output for ``-``, else the file, appended to. Raises BuildError."""
    if target == "-":
        return sys.stdout
    try:
        return open(target, "a", encoding="utf-8", buffering=1)
    except OSError as e:
        raise BuildError(EXIT_STATE, f"cannot open the audit log {target}: {e.strerror or e}") from None


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: any free one). Raises BuildError."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            sock.bind(address)
            sock.listen(64)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise BuildError(EXIT_LISTEN, f"cannot serve metrics on {format_address(host, port)}: "
                                      f"{e.strerror or e}") from None
    return sock


def health_app(metrics_app, unready):
    """The metrics port's WSGI app: /healthz (the process answers: 200), /readyz (200 when
    ``unready()`` is empty, else 503 with each reason on a line) and the metrics on every other
    path, as prometheus_client answers them. Probes need no metrics library and a human reads
    the 503's reason with curl."""

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            status, body = "200 OK", "ok\n"
        elif path == "/readyz":
            try:
                reasons = unready()
            except Exception as e:  # fails closed: a readiness check that broke says not ready
                reasons = [f"readiness check failed ({type(e).__name__}: {e})"]
            status, body = (("503 Service Unavailable", "".join(f"not ready: {r}\n" for r in reasons))
                            if reasons else ("200 OK", "ready\n"))
        else:
            return metrics_app(environ, start_response)
        data = body.encode() if environ.get("REQUEST_METHOD") != "HEAD" else b""
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                ("Content-Length", str(len(body.encode()))), ("Cache-Control", "no-store")])
        return [data]

    return app


def _serve_metrics(sock: socket.socket, registry, unready):
    """prometheus_client's WSGI app (and /healthz, /readyz) on an already-listening socket, one
    thread per request."""
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    from prometheus_client import make_wsgi_app

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # a scrape is not news
            pass

    server = Server(sock.getsockname()[:2], Quiet, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_address = sock.getsockname()
    server.server_name, server.server_port = server.server_address[:2]  # no reverse DNS lookup
    server.setup_environ()
    server.set_app(health_app(make_wsgi_app(registry), unready))
    threading.Thread(target=server.serve_forever, name="egress-metrics", daemon=True).start()
    return server
