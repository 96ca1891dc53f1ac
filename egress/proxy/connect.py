"""The CONNECT decision: one ordered list of checks, read by mitmproxy's path and serve's front.

A CONNECT is decided once its head has been read (egress.proxy.addons.limits reads it for
mitmproxy's path, egress.proxy.fastpath for the front). :data:`CONNECT_CHECKS` holds the
checks in the order they run; each is a function over the engine and a small frozen value,
:class:`ConnectContext`:

* :func:`check_policy`: ``Policy.decide``; a name the policy does not list may be granted by
  the person `egress run` asks (a wait);
* :func:`check_name`: a credential in the host name (the credential guard's reading of it),
  before anything can look the name up: a lookup of ``<token>.attacker.example`` carries the
  token to whoever runs its name server;
* :func:`check_address`: the address to dial, known without a query (a literal, localhost,
  ``--resolve``, a cached answer) or looked up (a wait), accepted by ``Policy.choose_address``
  and not this proxy's own listener; under a reloaded policy, a pinned address checked again.

Two ways to run them, one loop (:func:`_steps`):

* :func:`decide_connect` runs them without waiting: a check that would wait makes the outcome
  :data:`HAND_OVER` (the front then gives the connection to mitmproxy, whose path decides);
* :func:`settle_connect` runs the same checks and awaits what waits
  (egress.proxy.addons.policy_guard, at ``http_connect``).

So a check added to CONNECT_CHECKS runs on both paths, or on neither; tests/proxy/
test_connect.py holds a case of each check for both, and fails for a check without one.
:func:`recheck` is the one look again at an open tunnel after a reload (the front's, and the
Passthrough addon's).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from egress.core.addresses import known_addresses
from egress.core.hosts import Host, IPAddress
from egress.policy.matcher import Decision
from egress.proxy import mitm
from egress.proxy.flowstate import ConnState
from egress.proxy.resolver import ResolveError


@dataclass(frozen=True, slots=True)
class ConnectContext:
    """What a CONNECT names, and what its client connection already holds for that name."""

    host: Host  # the target, canonical
    port: int
    written: str  # the host as the client wrote it (a token with a word-like prefix is one only in its case)
    pinned: IPAddress | None = None  # the address this connection already checked for the name
    pinned_under: int | None = None  # the Engine.policy_generation that checked it


@dataclass(frozen=True, slots=True)
class Allowed:
    """The CONNECT may go: the rule that allowed it and the address to dial (pinned)."""

    rule: object  # egress.policy.Rule, or None (a grant of this run)
    address: IPAddress
    lookup: float | None = None  # seconds the name's addresses took to look up (None: none was)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The CONNECT is refused for ``decision``."""

    decision: Decision
    lookup: float | None = None  # as Allowed's: the lookup is observed whatever came of it


@dataclass(frozen=True, slots=True)
class UpstreamFailure:
    """The name could not be looked up (egress.proxy.resolver.ResolveError): a 502/504."""

    code: str
    message: str
    lookup: float | None = None


class HandOver:
    """:func:`decide_connect` cannot decide without waiting: mitmproxy's path decides."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "HAND_OVER"


HAND_OVER = HandOver()


@dataclass(frozen=True, slots=True)
class Pin:
    """A check's answer: the address to dial (check_address)."""

    address: IPAddress
    lookup: float | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """A check's answer when deciding needs a wait (a DNS query, a person asked): ``settle()``
    gives the answer the check would have given."""

    settle: Callable[[], Awaitable[Decision | Pin | Refusal | UpstreamFailure | None]]


# ----------------------------------------------------------------------- the checks


def check_policy(engine, ctx: ConnectContext) -> Decision | Wait:
    """The policy's decision (allowed: its rule); a name it does not list may be granted for
    this run, never an IP literal or a localhost name (their addresses are known, and special)."""
    decision = engine.policy.decide(ctx.host, ctx.port)
    asker = engine.asker
    if decision.allowed or decision.reason != "not-allowed" or asker is None or known_addresses(ctx.host) is not None:
        return decision
    return Wait(lambda: ask(asker, decision))


async def ask(asker, decision: Decision) -> Decision:
    """``decision`` (not-allowed), or the grant of the person `egress run` asked."""
    if await asker.ask(decision.host):
        return Decision(decision.host, decision.port, True, "allowed", detail="allowed for this run")
    return decision


def check_name(engine, ctx: ConnectContext) -> Decision | None:
    """A credential in the host name as the client wrote it (the credential guard's HostSecrets)."""
    names = engine.host_names
    return names.connect_refusal(ctx) if names is not None else None


def check_address(engine, ctx: ConnectContext) -> Decision | Pin | Refusal | Wait:
    """The address to dial: the one pinned (checked again if the policy changed since), or one
    of the name's addresses the policy accepts; never this proxy's own listener."""
    if ctx.pinned is not None:
        chosen = ctx.pinned
        if ctx.pinned_under != engine.policy_generation:
            # the open server connection goes to that address: it is the one to check (no lookup)
            chosen = engine.policy.choose_address(ctx.host, ctx.port, [ctx.pinned])
            if isinstance(chosen, Decision):
                return chosen
        return own_address(engine, ctx.host, ctx.port, chosen) or Pin(chosen)
    started = time.perf_counter()
    addresses = engine.resolver.cached(ctx.host)
    if not addresses:
        return Wait(lambda: _look_up(engine, ctx))
    return _choose(engine, ctx, addresses, time.perf_counter() - started)


async def _look_up(engine, ctx: ConnectContext) -> Pin | Refusal | UpstreamFailure:
    started = time.perf_counter()
    try:
        addresses = await engine.resolver.resolve(ctx.host)
    except ResolveError as e:
        return UpstreamFailure(e.code, str(e), time.perf_counter() - started)
    return _choose(engine, ctx, addresses, time.perf_counter() - started)


def _choose(engine, ctx: ConnectContext, addresses: list[IPAddress], lookup: float) -> Pin | Refusal:
    lookup = lookup if ctx.host.ip is None else None  # a literal is no lookup
    chosen = engine.policy.choose_address(ctx.host, ctx.port, addresses)
    if isinstance(chosen, Decision):
        return Refusal(chosen, lookup)
    refused = own_address(engine, ctx.host, ctx.port, chosen)
    return Refusal(refused, lookup) if refused is not None else Pin(chosen, lookup)


def own_address(engine, host: Host, port: int, ip: IPAddress) -> Decision | None:
    """The refusal of ``ip``:``port`` when it is this proxy's own listener: dialled, it would come
    back here, again and again. It is no upstream that failed but a destination egress will not
    serve (``private-address``, the address in the detail)."""
    if not dials_itself(engine, ip, port):
        return None
    where = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return Decision(host.name, port, False, "private-address", detail=f"resolves to {where}, this proxy's own "
                                                                      f"listening address")


def dials_itself(engine, ip: IPAddress, port: int) -> bool:
    """Whether dialling ``ip``:``port`` would reach this proxy's own listener (a loop)."""
    if not (ip.is_loopback or ip.is_unspecified):
        return False
    return port in engine.own_ports or port in {addr[1] for addr in mitm.listen_addrs()}


CONNECT_CHECKS: tuple[Callable, ...] = (check_policy, check_name, check_address)


# ------------------------------------------------------------------- the decision


def _steps(engine, ctx: ConnectContext):
    """CONNECT_CHECKS in order: a generator that yields each Wait, is sent what it settled to,
    and returns the outcome."""
    rule = None
    address = lookup = None
    for check in CONNECT_CHECKS:
        answer = check(engine, ctx)
        if isinstance(answer, Wait):
            answer = yield answer
        if isinstance(answer, Decision):
            if not answer.allowed:
                return Refusal(answer)
            rule = answer.rule
        elif isinstance(answer, Pin):
            address, lookup = answer.address, answer.lookup
        elif answer is not None:  # a Refusal or an UpstreamFailure
            return answer
    return Allowed(rule, address, lookup)


def decide_connect(engine, ctx: ConnectContext) -> Allowed | Refusal | HandOver:
    """The decision, if it needs no wait (serve's front); else :data:`HAND_OVER`."""
    steps = _steps(engine, ctx)
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    steps.close()
    return HAND_OVER


async def settle_connect(engine, ctx: ConnectContext) -> Allowed | Refusal | UpstreamFailure:
    """The decision, waiting for what it needs (mitmproxy's path)."""
    steps = _steps(engine, ctx)
    try:
        wait = next(steps)
        while True:
            wait = steps.send(await wait.settle())
    except StopIteration as done:
        return done.value


def remember(engine, conn: ConnState, ctx: ConnectContext, outcome) -> None:
    """What a decision (a CONNECT's, or the address check of a request) leaves on its client
    connection: the address pinned for the name and the policy generation that checked it; no
    pin once the pinned address is refused. The lookup's time is observed whatever came of it."""
    lookup = getattr(outcome, "lookup", None)
    if lookup is not None:
        engine.recorder.metrics.dns_lookup.observe(lookup)
    name = ctx.host.name
    if isinstance(outcome, (Allowed, Pin)):
        conn.pins[name], conn.pinned_under[name] = outcome.address, engine.policy_generation
    elif ctx.pinned is not None and isinstance(outcome, Refusal):
        conn.pins.pop(name, None)
        conn.pinned_under.pop(name, None)


# ------------------------------------------------------------ an open tunnel, again


def recheck(engine, host: Host, port: int, pinned: IPAddress | None, *, relay_only: bool = False) -> Decision | None:
    """The refusal of an open tunnel by the policy now in force (a reload since its CONNECT), or
    None if it may go on: its host, then the address pinned for it (a new policy may refuse it
    though it still allows the name: allow_private withdrawn, the address denied). A host
    refused as only not-allowed stays open if this run granted it (a grant is the asker's, not
    the policy's). ``relay_only``: the tunnel can only be relayed untouched (serve's front), so
    a host taken off passthrough is refused too; mitmproxy's path intercepts it instead."""
    policy = engine.policy
    decision = policy.decide(host, port)
    if not decision.allowed:
        asker = engine.asker
        if decision.reason == "not-allowed" and asker is not None and host.name in asker.state.grants:
            return None
        return decision
    if relay_only and policy.passthrough(host, port) is None:
        return Decision(host.name, port, False, "protocol",
                        detail="no longer on the passthrough list (the policy was reloaded after the CONNECT)")
    if pinned is None:
        return None
    chosen = policy.choose_address(host, port, [pinned])
    return chosen if isinstance(chosen, Decision) else None
