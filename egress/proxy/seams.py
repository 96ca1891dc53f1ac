"""What the proxy asks of the parts it is handed, as typing Protocols.

The asker is `egress run`'s person in the loop: egress.run.ask's TerminalAsker and NeverAsk, and the
warm proxy's RemoteAsker (egress.run.warm.child), which asks the launcher. Observers of events are
egress.observe.events'. Imports nothing but typing: `egress run` reads it before its command starts.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from egress.policy.matcher import Decision
    from egress.proxy.connect import ConnectContext


class Grants(Protocol):
    """What a run has granted so far: the hosts (exact names) allowed for the rest of it."""

    @property
    def grants(self) -> Collection[str]: ...


class Asker(Protocol):
    """May a host the policy refuses as only not-allowed go through, for the rest of this run?

    ``ask`` is awaited on the proxy's event loop while the request is held; its ``state`` is read
    when a reloaded policy re-decides a live tunnel (egress.proxy.addons.tunnels): a granted host's
    stays open.
    """

    @property
    def state(self) -> Grants: ...

    async def ask(self, host: str) -> bool: ...


class HostNames(Protocol):
    """What reads a CONNECT's host name for credentials (egress.proxy.addons.credential_guard):
    egress.proxy.connect.check_name asks it through Engine.host_names."""

    def connect_refusal(self, ctx: ConnectContext) -> Decision | None: ...
