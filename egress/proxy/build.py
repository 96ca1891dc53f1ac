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

import socket
import sys

from egress.core.contract import EXIT_LISTEN, EXIT_STATE
from egress.proxy.config import ProxyConfig


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
        self.metrics = None  # egress.observe.metrics.Metrics: made by serve_metrics() or start()
        self.trust = None  # egress.proxy.trust.UpstreamTrust: checked by open()
        self.engine = None  # set by start()
        self.proxy = None  # set by start()
        self.bound: list[tuple[str, int]] = []  # where start() listens
        self._metrics_socket: socket.socket | None = None
        self._metrics_server = None

    # -- before anything runs: cheap, no thread, nothing heavy imported

    def open(self) -> None:
        """Check the upstream CAs (the system's, --upstream-ca), open the audit log and bind the
        metrics port, as configured. Raises BuildError."""
        config = self.config
        if self.trust is None:
            from egress.proxy.trust import TrustError, upstream_trust

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
                    asker=None):
        """The engine (policy, resolver, recorder) and the proxy, listening if the config says where.

        ``on_event``: callbacks for every decision; ``asker``: egress run's person in the loop.
        Returns the egress.proxy.master.EgressProxy. Raises BuildError.
        """
        from egress.proxy.engine import Engine
        from egress.observe.events import Recorder
        from egress.proxy.master import EgressProxy, ListenError
        from egress.proxy.resolver import Resolver
        from egress.proxy.ca import StateError
        from egress.proxy.trust import TrustError

        self.serve_metrics()
        config = self.config
        recorder = Recorder(self._metrics(), self.audit, session=session)
        for callback in on_event:  # a run's (ProxySession's) reporter: its clients' answers wait for it
            recorder.subscribe(callback, name="run" if session else "subscriber", heard=bool(session))
        resolver = Resolver(dict(config.resolve), timeout=config.dns_timeout, nameserver=config.dns_server)
        engine = Engine(policy, resolver, recorder)
        engine.asker = asker
        if config.auth is not None:
            from egress.proxy.auth import expected

            engine.proxy_auth = expected(config.auth)
        engine.recorder.metrics.policy_rules.set(policy.rule_count)
        try:
            proxy = EgressProxy(engine, config, credentials, trust=self.trust)
            self.bound = await proxy.start()
        except (StateError, TrustError) as e:
            raise BuildError(EXIT_STATE, str(e)) from None
        except ListenError as e:
            where = format_address(*config.listen) if config.listen else "the handed-over socket"
            raise BuildError(EXIT_LISTEN, f"cannot listen on {where}: {e}") from None
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
