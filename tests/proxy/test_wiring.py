"""egress.proxy.build: one ProxyConfig and one ProxyBuilder for `egress serve` and `egress run`.

The builder runs in this process: a real mitmproxy, a real DNS server and real upstreams
on 127.0.0.1, clients in a thread. The CLI tests check that both commands make the same
configuration from the same options.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import urllib.request
from pathlib import Path

import pytest
import requests
from test_dns import DnsServer

from egress.core.contract import EXIT_LISTEN, EXIT_STATE
from egress.policy import settings
from egress.proxy.build import BuildError, ProxyBuilder
from egress.proxy.config import ProxyConfig

POLICY = {"allow": ["named.test", "silent.test", "override.test"], "allow_private": ["127.0.0.1/32"]}


@pytest.fixture
def dns_server():
    server = DnsServer()
    yield server
    server.close()


def through(proxy_url: str, url: str) -> requests.Response:
    session = requests.Session()
    session.trust_env = False
    session.proxies = {"http": proxy_url}
    return session.get(url, timeout=30)


def scrape(url: str) -> str:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=10) as response:
        return response.read().decode()


def serve_with(builder: ProxyBuilder, client, *, session: str | None = None, handed: socket.socket | None = None):
    """Start the builder's proxy in a fresh loop, run ``client(proxy_url)`` in a thread, stop; its result."""
    events = []

    async def main():
        proxy = await builder.start(settings.from_mapping(POLICY).policy, session=session, on_event=[events.append])
        if handed is not None:
            await proxy.serve_socket(handed)
        port = (handed.getsockname() if handed is not None else builder.bound[0])[1]
        try:
            return await asyncio.to_thread(client, f"http://127.0.0.1:{port}")
        finally:
            proxy.stop()
            await proxy.run_until_stopped()

    try:
        return asyncio.run(main()), events
    finally:
        builder.close()


def test_every_option_reaches_the_proxy_it_builds(tmp_path, dns_server, http_upstream):
    dns_server.answers["named.test"] = ["127.0.0.1"]
    dns_server.silent.add("silent.test")
    audit = tmp_path / "audit.jsonl"
    config = ProxyConfig(listen=("127.0.0.1", 0), metrics=("127.0.0.1", 0), audit_log=str(audit),
                         resolve={"override.test": [__import__("ipaddress").ip_address("127.0.0.1")]},
                         dns_server=("127.0.0.1", dns_server.port), dns_timeout=1, upstream_timeout=1,
                         state_dir=tmp_path / "state")
    builder = ProxyBuilder(config)
    port = http_upstream.port

    def client(proxy_url):
        return {
            "dns-server": through(proxy_url, f"http://named.test:{port}/small").status_code,
            "resolve": through(proxy_url, f"http://override.test:{port}/small").status_code,
            "dns-timeout": through(proxy_url, f"http://silent.test:{port}/small").headers.get("X-Egress-Error"),
            "upstream-timeout": through(proxy_url, f"http://named.test:{port}/hang").headers.get("X-Egress-Error"),
            "metrics": scrape(builder.metrics_url),
        }

    answers, events = serve_with(builder, client)
    assert answers.pop("dns-server") == answers.pop("resolve") == 200
    assert answers.pop("dns-timeout") == "silent.test; reason=dns-timeout"
    assert answers.pop("upstream-timeout") == "named.test; reason=upstream-timeout"
    metrics = answers.pop("metrics")
    assert 'egress_requests_total{decision="allow",reason="allowed"}' in metrics
    assert "egress_policy_rules 4.0" in metrics
    assert dns_server.a_queries("named.test") >= 1 and dns_server.a_queries("override.test") == 0
    logged = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(e["host"], e["reason"]) for e in logged] == [(e.host, e.reason) for e in events]
    assert ("silent.test", "dns-timeout") in [(e["host"], e["reason"]) for e in logged]


def test_a_builder_that_listens_nowhere_serves_a_handed_over_socket(tmp_path, http_upstream):
    # egress run's road: the same builder, no listener of its own, a session id on every event.
    handed = socket.socket()
    handed.bind(("127.0.0.1", 0))
    handed.listen()
    builder = ProxyBuilder(ProxyConfig(resolve={"override.test": [__import__("ipaddress").ip_address("127.0.0.1")]},
                                       state_dir=tmp_path / "state"))
    try:
        (status, events) = serve_with(
            builder, lambda proxy_url: through(proxy_url, http_upstream.url("override.test")).status_code,
            session="run-1", handed=handed)
    finally:
        handed.close()
    assert status == 200 and builder.bound == []
    assert [(e.host, e.session) for e in events] == [("override.test", "run-1")]


def test_open_refuses_an_unusable_audit_log_or_metrics_port_before_anything_runs(tmp_path):
    with pytest.raises(BuildError) as audit:
        ProxyBuilder(ProxyConfig(audit_log=str(tmp_path / "missing" / "audit.jsonl"))).open()
    assert audit.value.status == EXIT_STATE and "cannot open the audit log" in str(audit.value)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BuildError) as metrics:
            ProxyBuilder(ProxyConfig(metrics=("127.0.0.1", port))).open()
    assert metrics.value.status == EXIT_LISTEN
    assert str(metrics.value).startswith(f"cannot serve metrics on 127.0.0.1:{port}: ")


def test_a_listen_port_in_use_is_a_build_error(tmp_path):
    async def main(port):
        await ProxyBuilder(ProxyConfig(listen=("127.0.0.1", port), state_dir=tmp_path / "state")).start(
            settings.from_mapping(POLICY).policy)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BuildError) as error:
            asyncio.run(main(port))
    assert error.value.status == EXIT_LISTEN and str(error.value).startswith(f"cannot listen on 127.0.0.1:{port}: ")


def test_close_stops_the_metrics_endpoint_and_frees_its_port():
    builder = ProxyBuilder(ProxyConfig(metrics=("127.0.0.1", 0)))
    builder.serve_metrics()
    address = builder.metrics_address
    assert "egress_requests_total" in scrape(builder.metrics_url)
    builder.close()
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(address)  # free again


# ----------------------------------------------------- one configuration, two commands


PROXY_OPTIONS = {"metrics", "audit_log", "overrides", "dns_server", "dns_timeout", "upstream_timeout",
                 "upstream_ca", "state_dir"}


def test_serve_and_run_take_the_same_proxy_options_with_the_same_meaning():
    from egress.cli import run, serve

    def options(command):
        return {p.name: p for p in command.params if p.name in PROXY_OPTIONS}

    served, ran = options(serve), options(run)
    assert set(served) == set(ran) == PROXY_OPTIONS
    for name in PROXY_OPTIONS:  # names, types, help, environment variable: all but the default
        assert ({**served[name].to_info_dict(), "default": None} ==
                {**ran[name].to_info_dict(), "default": None}), name
    differ = {n for n in PROXY_OPTIONS if served[n].default != ran[n].default}
    assert differ == {"metrics", "audit_log"}
    assert (ran["metrics"].default, ran["audit_log"].default) == ("off", "off")  # a run's stdout is the command's


@pytest.mark.parametrize("command", ["serve", "run"])
def test_both_commands_make_one_proxy_config_from_their_options(command, monkeypatch, tmp_path):
    from click.testing import CliRunner

    import egress.cli as cli
    import egress.run.launcher
    import egress.serve.single
    import egress.serve.workers

    made = []
    monkeypatch.setattr(egress.serve.single, "serve", lambda source, config: made.append(config))
    monkeypatch.setattr(egress.serve.workers, "serve", lambda source, config, count: made.append(config))
    monkeypatch.setattr(egress.run.launcher, "run", lambda options: made.append(options.proxy) or 0)
    monkeypatch.setattr(cli.os, "_exit", lambda status: None)
    args = ["--metrics", "127.0.0.1:0", "--audit-log", str(tmp_path / "a.jsonl"), "--resolve", "a.test:127.0.0.1",
            "--dns-server", "127.0.0.1:5353", "--dns-timeout", "2", "--upstream-timeout", "3",
            "--state-dir", str(tmp_path / "state")]
    result = CliRunner().invoke(cli.main, [command, *args, *(["--", "true"] if command == "run" else [])])
    assert result.exit_code == 0, result.output
    [config] = made
    expected = cli.proxy_config(metrics="127.0.0.1:0", audit_log=str(tmp_path / "a.jsonl"),
                                overrides=("a.test:127.0.0.1",), dns_server="127.0.0.1:5353", dns_timeout=2,
                                upstream_timeout=3, state_dir=str(tmp_path / "state"))
    listen = ("127.0.0.1", 8080) if command == "serve" else None
    # serve's front (egress.proxy.fastpath) answers passthrough CONNECTs; run's proxy has none
    assert config == expected._replace(listen=listen, front=command == "serve")


def test_importing_the_wiring_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, egress.proxy.build, egress.cli; "
            "print(sorted(m for m in ('mitmproxy', 'prometheus_client', 'dns', 'tldextract') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("config", [
    ProxyConfig(),
    ProxyConfig(metrics=("127.0.0.1", 0), audit_log="-", resolve={"a.test": [ipaddress.ip_address("127.0.0.1"),
                                                                           ipaddress.ip_address("::1")]},
                dns_server=("127.0.0.1", 5353), dns_timeout=1.5, upstream_timeout=0.0,
                upstream_ca=Path("/etc/ca.pem"), state_dir=Path("/srv/state"),
                extra_options={"egress_max_client_connections": 7}, front=True),
])
def test_a_config_survives_the_trip_to_the_warm_proxy(config):
    # egress run sends its proxy's configuration to the warm proxy as JSON.
    assert ProxyConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
