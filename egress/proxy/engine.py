"""What the addons share: the policy in force, the resolver, the recorder, per-connection state.

The policy is swapped whole (live edits) and read once per decision, so a
request never sees half of an old policy and half of a new one.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

from egress.observe.events import Event, Recorder
from egress.proxy.flowstate import ConnState
from egress.policy.matcher import Decision, Policy
from egress.proxy.resolver import Resolver


class Engine:
    def __init__(self, policy: Policy, resolver: Resolver, recorder: Recorder):
        self.policy = policy
        # +1 at each replace_policy: what a connection keeps to tell whether the policy changed
        # since it was decided (a reference to the policy itself would keep a replaced one alive)
        self.policy_generation = 0
        self.resolver = resolver
        self.recorder = recorder
        # mitmproxy Client -> its ConnState (tunnel, pinned addresses, limits); weak keys, and
        # forgotten on disconnect (egress.proxy.addons.limits), so no state outlives its connection
        self.connections: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # egress run's person in the loop (egress.run.ask), or None: refusals are final
        self.asker = None
        # what Proxy-Authorization must carry (egress.proxy.auth), or None: no authentication
        self.proxy_auth: bytes | None = None
        # ports served from handed-over sockets that are this proxy's public address (serve's
        # workers), besides mitmproxy's own listeners: a loopback dial to one would come back here
        self.own_ports: set[int] = set()
        # called after each replace_policy, on the event loop: what holds live tunnels closes
        # those the new policy refuses (egress.proxy.addons.tunnels, egress.proxy.fastpath)
        self.policy_watchers: list[Callable[[], None]] = []

    def conn(self, client) -> ConnState:
        """The state of a client connection (created on first use)."""
        state = self.connections.get(client)
        if state is None:
            state = self.connections[client] = ConnState()
        return state

    def forget(self, client) -> None:
        self.connections.pop(client, None)

    def replace_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.policy_generation += 1
        self.recorder.metrics.policy_rules.set(policy.rule_count)
        for watcher in list(self.policy_watchers):
            try:
                watcher()
            except Exception:  # one watcher's bug must not keep the others from closing theirs
                logging.getLogger("egress").exception("closing what the reloaded policy refuses failed")

    def record_refusal(self, client: str, method: str, decision: Decision):
        """The refusal's event; the Telling its answer waits on, if a run's reporter listens."""
        return self.recorder.record(Event(
            client=client, method=method, host=decision.host, port=decision.port,
            decision="block", reason=decision.reason,
            rule=str(decision.rule) if decision.rule else None, detail=decision.detail))


def client_label(peername) -> str:
    """``ip:port`` of a client connection (peername may be None for injected flows)."""
    if not peername:
        return "unknown"
    host, port, *_ = peername
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
