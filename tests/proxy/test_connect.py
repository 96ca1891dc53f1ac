"""The CONNECT decision (egress.proxy.connect), in process: one case for each of CONNECT_CHECKS,
run through mitmproxy's path (the addons' http_connect hooks, in the proxy's order) and through
serve's front (Front.check), which must agree: what one refuses, the other does not serve;
what one allows on passthrough, the other serves at the same address, under the same rule.

tests/proxy/test_front.py keeps the end-to-end cases: the bytes, events and metrics of real tunnels.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import random
import string
from types import SimpleNamespace

import pytest
from addons.helpers import connect_flow, context, events
from mitmproxy.addons import proxyserver
from mitmproxy.proxy.layers.http import HttpConnectHook

from egress.core.hosts import parse_host
from egress.observe.events import Recorder
from egress.observe.metrics import Metrics
from egress.policy.loader import policy_from_mapping
from egress.proxy.addons.address_guard import AddressGuard
from egress.proxy.addons.credential_guard import CredentialGuard
from egress.proxy.addons.limits import Limits
from egress.proxy.addons.policy_guard import PolicyGuard
from egress.proxy.addons.reporter import Reporter
from egress.proxy.addons.upstream_errors import UpstreamErrors
from egress.proxy.connect import (
    CONNECT_CHECKS,
    HAND_OVER,
    Allowed,
    ConnectContext,
    Refusal,
    decide_connect,
    settle_connect,
)
from egress.proxy.engine import Engine
from egress.proxy.fastpath import Front
from egress.proxy.resolver import Resolver
from egress.scan.credentials import Credentials

TOKEN = "ghp_" + "".join(random.Random(27).choices(string.ascii_letters + string.digits, k=36))
OWN_PORT = 48080  # this proxy's public port (Engine.own_ports): a dial there comes back here
POLICY = {
    "allow": ["passthrough.test", "intercepted.test", "own.test"],
    "deny": ["denied.passthrough.test"],
    "passthrough": ["passthrough.test", "own.test"],
    "allow_private": ["=passthrough.test", "own.test", "intercepted.test"],
}
ADDRESSES = {"passthrough.test": "127.0.0.1", "private.passthrough.test": "10.1.2.3",
             "intercepted.test": "127.0.0.1", "own.test": "127.0.0.1", "denied.passthrough.test": "127.0.0.1",
             f"{TOKEN.lower()}.passthrough.test": "127.0.0.1", "elsewhere.test": "8.8.8.8"}  # --resolve: no query


def make_engine(asker=None) -> Engine:
    overrides = {name: [ipaddress.ip_address(a)] for name, a in ADDRESSES.items()}
    return Engine(policy_from_mapping(POLICY), Resolver(overrides), Recorder(Metrics(), io.StringIO()), asker=asker,
                  own_ports={OWN_PORT})


def through_both(target: str, port: int = 443, asker=None):
    """(mitmproxy's path: (answer status or None, events, pin), the front's: served or None, decide_connect's
    outcome) for ``CONNECT target:port``."""
    engine = make_engine(asker)
    credential_guard = CredentialGuard(engine, Credentials("block", []))
    addons = [PolicyGuard(engine), credential_guard, AddressGuard(engine), UpstreamErrors(engine), Reporter(engine)]
    front = Front(engine, None, Limits(engine))

    async def go():
        with context(proxyserver.Proxyserver(), *addons) as tctx:
            flow = connect_flow(target, port)
            await tctx.master.addons.trigger_event(HttpConnectHook(flow))
            head = f"CONNECT {target}:{port} HTTP/1.1\r\nHost: {target}:{port}\r\n\r\n".encode()
            served = front.check(head)
            host = parse_host(target)
            decided = decide_connect(engine, ConnectContext(host, port, target))
            return flow, served, decided

    flow, served, decided = asyncio.run(go())
    answer = flow.response.status_code if flow.response is not None else None
    pin = engine.conn(flow.client_conn).pins.get(parse_host(target).name)
    seen = [(e["decision"], e["reason"]) for e in events(engine)]
    return (answer, seen, str(pin) if pin else None), served, decided


# One case for each check: (target, port, what mitmproxy's path does, what the front does).
CASES = {
    "check_policy": [("denied.passthrough.test", 443, "denied"), ("elsewhere.test", 443, "not-allowed")],
    "check_name": [(f"{TOKEN}.passthrough.test", 443, "credential")],
    "check_address": [("private.passthrough.test", 443, "private-address"),
                      ("own.test", OWN_PORT, "private-address")],  # this proxy's own listener
}


def test_every_connect_check_has_a_parity_case():
    assert set(CASES) == {check.__name__ for check in CONNECT_CHECKS}, \
        "a check added to CONNECT_CHECKS needs its case here (mitmproxy's path and the front, side by side)"


@pytest.mark.parametrize(("check", "target", "port", "reason"),
                         [(check, *case) for check, cases in CASES.items() for case in cases],
                         ids=[f"{check}-{case[0].split('.')[0][:12]}" for check, cases in CASES.items()
                              for case in cases])
def test_a_connect_one_check_refuses_is_refused_on_one_path_and_not_served_on_the_other(check, target, port, reason):
    (answer, seen, pin), served, decided = through_both(target, port)
    assert answer == 403 and seen == [("block", reason)] and pin is None  # mitmproxy's path: refused
    assert served is None  # the front hands it over (and mitmproxy's path refuses it, as above)
    assert isinstance(decided, Refusal) and decided.decision.reason == reason


def test_an_allowed_passthrough_connect_is_served_by_the_front_at_the_address_mitmproxy_pins():
    (answer, seen, pin), served, decided = through_both("passthrough.test")
    assert answer is None and seen == [("allow", "allowed")] and pin == "127.0.0.1"
    host, port, rule, address = served
    assert (host.name, port, str(address), str(rule)) == ("passthrough.test", 443, pin, "passthrough.test (<policy>)")
    assert isinstance(decided, Allowed) and (decided.rule, decided.address) == (rule, address)


def test_an_allowed_intercepted_connect_is_mitmproxys_alone():
    (answer, seen, pin), served, decided = through_both("intercepted.test")
    assert answer is None and seen == [("allow", "allowed")] and pin == "127.0.0.1"
    assert served is None and isinstance(decided, Allowed)  # allowed, but the front only relays


class Person:
    """egress run's asker (egress.proxy.seams.Asker), for a person who grants every name asked about."""

    def __init__(self):
        self.asked: list[str] = []
        self.state = SimpleNamespace(grants=set())

    async def ask(self, host: str) -> bool:
        self.asked.append(host)
        self.state.grants.add(host)
        return True


def test_a_check_that_waits_hands_the_connect_to_mitmproxys_path_which_waits():
    person = Person()
    (answer, seen, pin), served, decided = through_both("elsewhere.test", asker=person)
    assert decided is HAND_OVER and served is None  # a person to ask: no decision without a wait
    assert person.asked == ["elsewhere.test"]  # asked once, by mitmproxy's path, which waited
    assert answer is None and seen == [("allow", "allowed")] and pin == "8.8.8.8"  # granted for this run


def test_settle_connect_awaits_the_same_checks_decide_connect_runs():
    engine = make_engine(Person())
    ctx = ConnectContext(parse_host("own.test"), 443, "own.test")

    async def go():
        with context(proxyserver.Proxyserver()):
            return decide_connect(engine, ctx), await settle_connect(engine, ctx)

    decided, settled = asyncio.run(go())
    assert isinstance(settled, Allowed) and (decided.rule, decided.address) == (settled.rule, settled.address)
    assert str(settled.address) == "127.0.0.1" and settled.lookup is not None  # observed by the caller


@pytest.mark.parametrize(("reloaded", "front", "mitmproxys"), [
    ({**POLICY, "deny": ["passthrough.test"]}, "denied", "denied"),
    ({**POLICY, "allow_private": ["own.test"]}, "private-address", "private-address"),  # the pin refused
    ({**POLICY, "passthrough": ["own.test"]}, "protocol", None),  # mitmproxy's path intercepts it now
    (POLICY, None, None),
], ids=["denied", "address", "off-passthrough", "unchanged"])
def test_a_reload_is_applied_to_an_open_tunnel_by_one_recheck_on_both_paths(reloaded, front, mitmproxys):
    from egress.proxy.addons.tunnels import Passthrough

    engine = make_engine()
    passthrough, host = Passthrough(engine), parse_host("passthrough.test")
    client = connect_flow("passthrough.test").client_conn
    conn = engine.conn(client)
    conn.tunnel, conn.tunnel_generation = (host, 443), engine.policy_generation
    conn.pins[host.name] = ipaddress.ip_address("127.0.0.1")
    engine.replace_policy(policy_from_mapping(reloaded))
    on_front = Front(engine, None, Limits(engine)).recheck(host, 443, conn.pins[host.name])
    on_mitmproxy = passthrough._refusal_since_connect(client, host, 443)
    assert (on_front and on_front.reason, on_mitmproxy and on_mitmproxy.reason) == (front, mitmproxys)
