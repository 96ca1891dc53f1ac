"""In-process addon tests in mitmproxy's style: taddons.context and tflow, no proxy server.

An Engine with a small policy and --resolve-style overrides (no DNS), and an audit log
in memory, so every event a hook records is read back synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import ipaddress
import json

from mitmproxy import http
from mitmproxy.test import taddons, tflow, tutils

from egress.observe.events import Recorder
from egress.observe.metrics import Metrics
from egress.policy.loader import policy_from_mapping
from egress.proxy.engine import Engine
from egress.proxy.resolver import Resolver

POLICY = {
    "allow": ["allowed.test", "public.test", "private.test", "siit.test"],
    "deny": ["denied.allowed.test"],
    "allow_private": ["allowed.test"],
}
ADDRESSES = {"allowed.test": "127.0.0.1", "public.test": "8.8.8.8", "private.test": "10.1.2.3",
             "siit.test": "::ffff:0:7f00:1"}


def make_engine(policy: dict | None = None) -> Engine:
    overrides = {name: [ipaddress.ip_address(a)] for name, a in ADDRESSES.items()}
    engine = Engine(policy_from_mapping(policy or POLICY), Resolver(overrides), Recorder(Metrics(), io.StringIO()))
    return engine


def events(engine: Engine) -> list[dict]:
    return [json.loads(line) for line in engine.recorder.audit.getvalue().splitlines()]


def request_flow(url: str, method: str = "GET", headers: dict | None = None, **kwargs) -> http.HTTPFlow:
    """An absolute-form request, with exactly ``headers`` (default: a Host header naming the URL's host)."""
    scheme, rest = url.split("://", 1)
    authority, _, path = rest.partition("/")
    host, _, port = authority.rpartition(":") if authority.count(":") == 1 else (authority, "", "")
    if headers is None:
        headers = {"Host": authority}
    request = tutils.treq(method=method.encode(), scheme=scheme.encode(), host=host or authority,
                          port=int(port) if port else (443 if scheme == "https" else 80),
                          authority=authority.encode(), path=b"/" + path.encode(),
                          headers=http.Headers([(k.encode(), v.encode()) for k, v in headers.items()]),
                          content=b"")
    flow = tflow.tflow(req=request, **kwargs)
    flow.client_conn.sni = None
    return flow


def connect_flow(host: str, port: int = 443) -> http.HTTPFlow:
    request = tutils.treq(method=b"CONNECT", host=host, port=port, scheme=b"", authority=f"{host}:{port}".encode(),
                          path=b"", headers=http.Headers(), content=b"")
    flow = tflow.tflow(req=request)
    flow.client_conn.sni = None
    return flow


def run(coroutine_function):
    """Run ``coroutine_function()`` in a fresh event loop (taddons needs one)."""
    return asyncio.run(coroutine_function())


@contextlib.contextmanager
def context(*addons):
    """taddons.context, and its master's log handler removed afterwards (it outlives its loop)."""
    with taddons.context(*addons) as tctx:
        try:
            yield tctx
        finally:
            tctx.master._legacy_log_events.uninstall()


class KeepingRecorder(Recorder):
    """A recorder that also keeps each event as it is recorded (its observers run on threads of
    their own, so a test reading right after a hook would race them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: list = []

    def record(self, event) -> None:
        super().record(event)
        self.kept.append(event)
