"""What the addons share: the policy in force, the resolver, the recorder, the tunnels.

The policy is swapped whole (live edits) and read once per decision, so a
request never sees half of an old policy and half of a new one.
"""

from __future__ import annotations

from .events import Event, Recorder
from .hosts import Host
from .policy import Decision, Policy
from .resolver import Resolver


class Engine:
    def __init__(self, policy: Policy, resolver: Resolver, recorder: Recorder):
        self.policy = policy
        self.resolver = resolver
        self.recorder = recorder
        # client connection id -> (host, port) of the CONNECT tunnel it became
        self.tunnels: dict[str, tuple[Host, int]] = {}
        # egress run's person in the loop (egress.ask), or None: refusals are final
        self.asker = None

    def replace_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.recorder.metrics.policy_rules.set(policy.rule_count)

    def record_refusal(self, client: str, method: str, decision: Decision) -> None:
        self.recorder.record(Event(
            client=client, method=method, host=decision.host, port=decision.port,
            decision="block", reason=decision.reason,
            rule=str(decision.rule) if decision.rule else None, detail=decision.detail))


def client_label(peername) -> str:
    """``ip:port`` of a client connection (peername may be None for injected flows)."""
    if not peername:
        return "unknown"
    host, port, *_ = peername
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
