"""What the addons share: the policy in force, the resolver, the recorder, per-connection state.

The policy is swapped whole (live edits) and read once per decision, so a
request never sees half of an old policy and half of a new one. Everything else is
given when the engine is made (egress.proxy.build), and never changed after.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection

from egress.observe.events import Recorder
from egress.policy.matcher import Policy
from egress.proxy.flowstate import ConnState
from egress.proxy.resolver import Resolver
from egress.proxy.seams import Asker, HostNames
from egress.scan.credentials import Credentials
from egress.scan.detect import Detector
from egress.scan.host_secrets import HostSecrets

PLACEHOLDER_LABEL = "placeholder"  # the detector's kind for a brokered secret's placeholder: placeholder:<label>
CLEAN_CACHED = 256  # characters: longer texts are cleaned each time, not kept


class Engine:
    def __init__(self, policy: Policy, resolver: Resolver, recorder: Recorder, *, asker: Asker | None = None,
                 proxy_auth: bytes | None = None, own_ports: Collection[int] = ()):
        """``asker``: egress run's person in the loop (egress.run.ask), or None: refusals are final.
        ``proxy_auth``: what Proxy-Authorization must carry (egress.proxy.auth), or None: no
        authentication. ``own_ports``: the ports of this proxy's public address that it serves
        from sockets it was handed (serve), besides mitmproxy's own listeners: a loopback dial to
        one would come back here."""
        self.policy = policy
        # +1 at each replace_policy: what a connection keeps to tell whether the policy changed
        # since it was decided (a reference to the policy itself would keep a replaced one alive)
        self.policy_generation = 0
        self.resolver = resolver
        self.recorder = recorder
        # mitmproxy Client -> its ConnState (tunnel, pinned addresses, limits); weak keys, and
        # forgotten on disconnect (egress.proxy.addons.limits), so no state outlives its connection
        self.connections: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.asker = asker
        self.proxy_auth = proxy_auth
        self.own_ports = frozenset(own_ports)
        # called after each replace_policy, on the event loop: what holds live tunnels closes
        # those the new policy refuses (egress.proxy.addons.tunnels, egress.proxy.fastpath)
        self.policy_watchers: list[Callable[[], None]] = []
        # What reads a credential in a CONNECT's host name (egress.proxy.connect.check_name): the
        # credential guard, given when it is made; None: no credentials, nothing to read
        self.host_names: HostNames | None = None

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


def client_label(peername) -> str:
    """``ip:port`` of a client connection (peername may be None for injected flows)."""
    if not peername:
        return "unknown"
    host, port, *_ = peername
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Redactor:
    """A text with every secret of ``credentials`` in it replaced by [redacted:<kind>]: what a
    person or a log reads (events, refusals, metric labels) must never carry one.

    Made from the credentials before any addon (egress.proxy.build) and given to the recorder,
    so that no event depends on an addon having been built to be clean. The same reading as the
    credential guard's: stored secrets and brokered placeholders in any form the detector reads,
    and what only a host name's reading finds (a token split by dots, lower-cased, glued). Its
    detector is compiled at its first use.
    """

    def __init__(self, credentials: Credentials):
        self.labelled = [(s.label, s.value) for s in credentials.secrets]
        self.labelled += [(f"{PLACEHOLDER_LABEL}:{s.label}", s.placeholder) for s in credentials.brokered
                          if s.placeholder]
        self.ignore_kinds = frozenset(credentials.ignore_kinds)
        self._host_secrets: HostSecrets | None = None
        self._cleaned: dict[str, str] = {}

    @property
    def host_secrets(self) -> HostSecrets:
        if self._host_secrets is None:
            self._host_secrets = HostSecrets(Detector(self.labelled), self.ignore_kinds)
        return self._host_secrets

    def __call__(self, text: str) -> str:
        if not text:
            return text
        cached = self._cleaned.get(text)
        if cached is None:
            host_secrets = self.host_secrets
            data = text.encode("utf-8", "surrogateescape")
            cached = host_secrets.detector.redact(data).decode("utf-8", "surrogateescape")
            cached = host_secrets.redact(cached)
            # Host names and refusal details repeat; a long text (an upstream's answer quoted in
            # an error) is rarely seen twice and would pin its size, twice, in the cache.
            if len(text) <= CLEAN_CACHED:
                if len(self._cleaned) > 4096:  # keep the cache bounded
                    self._cleaned.clear()
                self._cleaned[text] = cached
        return cached
