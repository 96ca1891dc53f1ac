"""egress.host.service.ProxyService: the one lifecycle of serve, a serve worker, a run's proxy and the
warm spare's rehearsal, in this process: a real proxy on 127.0.0.1 and a real upstream, clients in
a thread.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket

import requests

from egress.host.control import RunState
from egress.host.service import ProxyService
from egress.observe.events import Recorder
from egress.observe.metrics import Metrics
from egress.policy import settings
from egress.proxy.addons.credential_guard import CredentialGuard
from egress.proxy.auth import expected
from egress.proxy.build import ProxyBuilder
from egress.proxy.config import ProxyConfig
from egress.proxy.engine import Engine, Redactor
from egress.proxy.resolver import Resolver
from egress.scan.credentials import Credentials, StoredSecret

LOCAL = {"allowed.test": [ipaddress.ip_address("127.0.0.1")], "other.test": [ipaddress.ip_address("127.0.0.1")]}


def policy(*hosts: str):
    return settings.from_mapping({"allow": list(hosts), "allow_private": list(hosts)}).policy


def builder(tmp_path, **config) -> ProxyBuilder:
    return ProxyBuilder(ProxyConfig(resolve=LOCAL, state_dir=tmp_path / "state", **config))


def through(proxy_url: str, url: str) -> int:
    session = requests.Session()
    session.trust_env = False
    session.proxies = {"http": proxy_url}
    return session.get(url, timeout=30).status_code


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


async def until(condition) -> None:
    """Wait for ``condition()`` on the loop (the watcher's poll is a second)."""
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never came")


def test_a_service_serves_its_sockets_feeds_its_control_state_and_observers_until_stopped(tmp_path, http_upstream):
    sock = listening()
    port = sock.getsockname()[1]
    events, state = [], RunState("serve-test", ["egress", "serve"])
    follower = state.follow()
    service = ProxyService(builder(tmp_path), lambda: (policy("allowed.test"), None), control=state,
                           observers={"test": events.append}, worker=4242)

    async def main():
        await service.start([sock])
        try:
            return await asyncio.to_thread(through, f"http://127.0.0.1:{port}", http_upstream.url("allowed.test"))
        finally:
            service.stop()
            await service.run_until_stopped()  # every queued event delivered by then

    try:
        assert asyncio.run(main()) == 200
    finally:
        service.close()
    # the engine was given what it keeps: serve's own port (a loopback dial to it would loop)
    assert service.engine.own_ports == {port}
    assert [(e.host, e.decision, e.worker) for e in events] == [("allowed.test", "allow", 4242)]
    assert json.loads(follower.get_nowait())["host"] == "allowed.test"
    assert state.on_reload == [service.reload]
    with socket.socket() as again:  # stopped: it listens no more
        assert again.connect_ex(("127.0.0.1", port)) != 0


def test_a_service_stopped_before_it_starts_or_while_its_policy_loads_builds_nothing(tmp_path):
    loads = []
    early = ProxyService(builder(tmp_path), lambda: loads.append("early") or (policy(), None))
    early.stop()
    assert asyncio.run(early.start()) is None and loads == [] and early.engine is None

    def load():  # a run that ended while its policy was built (the warm child's `true`)
        late.stop()
        return policy(), None

    late = ProxyService(builder(tmp_path), load)
    assert asyncio.run(late.start()) is None and late.engine is None


def test_a_reload_asked_for_before_the_watcher_runs_applies_once_it_does(tmp_path):
    reloads, lines = [], []

    def reload():
        reloads.append(1)
        return policy("allowed.test", "other.test")

    service = ProxyService(builder(tmp_path), lambda: (policy("allowed.test"), None), reload=reload,
                           report=lines.append)
    service.reload()  # egress run's `egress policy reload` before its proxy starts

    async def main():
        await service.start()
        try:
            await until(lambda: service.engine.policy.decide("other.test").allowed)
            service.reload()
            await until(lambda: len(reloads) == 2)
        finally:
            service.stop()
            await service.run_until_stopped()

    try:
        asyncio.run(main())
    finally:
        service.close()
    assert lines[0].startswith("policy reloaded: ")


def test_what_the_engine_keeps_is_given_when_it_is_made(tmp_path):
    # asker, proxy_auth and own_ports: constructor arguments, never patched after
    asker = object()
    service = ProxyService(builder(tmp_path, auth=("user", "secret")), lambda: (policy("allowed.test"), None),
                           asker=asker)

    async def main():
        await service.start()
        service.stop()
        await service.run_until_stopped()

    try:
        asyncio.run(main())
    finally:
        service.close()
    engine = service.engine
    assert engine.asker is asker and engine.proxy_auth == expected(("user", "secret")) and engine.own_ports == set()


STORED = "MY-STORED-SECRET-1234567"
REAL = "ghp_" + "R" * 36
PLACEHOLDER = "ghp_" + "P" * 36


def test_the_redactor_made_before_any_addon_cleans_as_the_credential_guard_does():
    credentials = Credentials("block", [StoredSecret("MY_SERVICE_TOKEN", STORED),
                                        StoredSecret("GITHUB_TOKEN", REAL, hosts=("bound.test",),
                                                     placeholder=PLACEHOLDER)])
    redactor = Redactor(credentials)
    engine = Engine(policy(), Resolver(), Recorder(Metrics()))
    guard = CredentialGuard(engine, credentials)
    texts = [f"{STORED}.attacker.test", f"x-{STORED.lower()}.example.com", f"token {REAL} and {PLACEHOLDER}",
             ".".join(STORED[i:i + 5] for i in range(0, len(STORED), 5)) + ".evil.test", "clean.example.com", ""]
    assert [redactor(t) for t in texts] == [guard.clean(t) for t in texts]
    assert STORED not in redactor(texts[0]) and "[redacted:" in redactor(texts[0])
