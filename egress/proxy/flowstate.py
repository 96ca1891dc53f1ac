"""What egress knows about one request (a flow) and about one client connection, typed.

One :class:`FlowState` per flow under ``flow.metadata[KEY]``, one :class:`ConnState`
per client connection in :attr:`egress.proxy.engine.Engine.connections`, which is keyed
weakly by mitmproxy's ``Client`` object (as mitmproxy's own proxyauth addon keys its
state) and also emptied on disconnect: a connection's state cannot outlive it.

    state = flow_state(flow)        # created on first use
    state.host, state.port          # the destination, parsed once by the policy guard
    engine.conn(flow.client_conn).tunnel

Every addon reads and writes this state; no string keys remain in flow.metadata besides KEY.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from egress.core.hosts import Host, IPAddress

if TYPE_CHECKING:
    from egress.observe.events import Telling
    from egress.policy.matcher import Decision, Rule

KEY = "egress"

@dataclass(slots=True, eq=False)
class FlowState:
    host: Host | None = None  # the destination in canonical form, parsed once per request
    port: int | None = None
    rule: Rule | None = None  # the policy entry that allowed it (formatted only when an event is written)
    refused: bool = False  # a guard refused it: its answer is the refusal, nothing goes upstream
    reported: bool = False  # its one event has been recorded
    sent: int = 0  # request body bytes relayed upstream
    received: int = 0  # response body bytes relayed to the client
    upstream_error: str | None = None  # an upstream-error code (reasons.UPSTREAM_ERRORS)
    upstream_detail: str = ""  # what failed, in words (the event's detail, the answer's body)
    masked: str | None = None  # what the credential guard masked, in words
    substituted: bool = False  # a brokered secret was swapped in
    echo_tail: bytes = b""  # the end of a bound host's last WebSocket messages: a value split across them
    client_tail: bytes = b""  # the end of the client's last WebSocket messages: a token split across them
    whole: bool = False  # the response body is read whole, not streamed (addons.injection_label)
    injection: str | None = None  # the injection label the response got, if any
    telling: Telling | None = None  # the run's line about its refusal, awaited before the answer (addons.line_first)
    # a WebSocket's frames as the credential guard reads them: None, no reader (websocket_start found
    # no layer: a refusal closes the connections); False, read; True, a 1008 close is due at the next frame
    websocket_close: bool | None = None
    refused_dial: bool = False  # refused at its server's dial: its answer is the refusal, not an upstream error

    @property
    def host_name(self) -> str | None:
        return self.host.name if self.host is not None else None


def flow_state(flow) -> FlowState:
    """The flow's state, created on first use."""
    state = flow.metadata.get(KEY)
    if state is None:
        state = flow.metadata[KEY] = FlowState()
    return state


def refused(flow) -> bool:
    """Whether a guard refused the flow."""
    state = flow.metadata.get(KEY)
    return state is not None and state.refused


def masked(flow) -> str | None:
    state = flow.metadata.get(KEY)
    return state.masked if state is not None else None


@dataclass(slots=True, eq=False)
class ConnState:
    """One client connection."""

    tunnel: tuple[Host, int] | None = None  # the CONNECT this connection became
    tunnel_generation: int | None = None  # Engine.policy_generation that allowed it (addons.tunnels)
    pins: dict[str, IPAddress] = field(default_factory=dict)  # host name -> the address checked for it
    counted: str | None = None  # the client address this connection counts against (limits)
    waiting_since: float | None = None  # monotonic time since which a request head is awaited
    # an upstream connection of this client that could not be opened, until its flow's error
    # hook takes it (egress.proxy.addons.upstream_errors): (code, detail, mitmproxy's message)
    open_failure: tuple[str, str, str] | None = None
    authenticated: bool = False  # its first request carried the proxy's secret (egress.proxy.auth)
    # host name -> the Engine.policy_generation that checked its pin (egress.proxy.connect.remember)
    pinned_under: dict[str, int] = field(default_factory=dict)
    # a dial refused at server_connect, until its flow's error hook takes it (egress.proxy.refusal)
    dial_refusal: Decision | None = None
    telling: Telling | None = None  # the run's line about its refusal, awaited before the answer (addons.line_first)
