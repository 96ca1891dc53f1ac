"""A refused client hears its answer only after the person has read why.

In `egress run` the command and egress share stderr. Every refusal and upstream failure
becomes a line there (EGRESS_BLOCKED, EGRESS_UPSTREAM_ERROR), written by the run's
reporter on a thread of its own, or by the launcher in the warm mode. The refusal itself
went to the client at once, so the command's own error raced the line: curl writes its
error one byte per write(2), and under load stderr read
``cEGRESS_BLOCKED blocked.test (not on the allow list)`` then ``url: (56) CONNECT tunnel
failed, response 403``.

The guards record the event where they refuse (egress.proxy.refusal); the recorder hands back a
:class:`egress.observe.events.Telling` when a run's reporter listens, kept in the flow's (or the
connection's) state. This addon, the last in the chain, holds the hook that carries the
answer (mitmproxy sends a hook's response once every addon has returned) until the line is
written, at most egress.observe.events.HEARD_WAIT. Nothing is waited for where no one reads:
`egress serve` has no such reporter, and allowed flows never carry a Telling.

Not held: refusals a layer sends itself (a malformed head, 400/431) and streams closed
mid-body (a credential in a streamed upload): those stop at once, before ordering.
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.proxy import layer

from egress.proxy.engine import Engine
from egress.proxy.failclosed import guard
from egress.proxy.flowstate import KEY


def _held(state):
    """The wait for ``state``'s Telling, if its line is still being written (else None, at no cost)."""
    if state is None:
        return None
    telling = state.telling
    if telling is None:
        return None
    state.telling = None  # one wait per event
    return telling.wait() if telling.pending() else None


class LineFirst:
    def __init__(self, engine: Engine):
        self.engine = engine

    @guard
    def _flow_answer(self, flow: http.HTTPFlow):
        return _held(flow.metadata.get(KEY))

    # Every flow hook after which mitmproxy may send a refusal, an upstream failure, or close on a kill.
    http_connect = requestheaders = request = responseheaders = response = error = _flow_answer

    @guard
    def next_layer(self, nextlayer: layer.NextLayer):  # a tunnel refused as not HTTP: closed after
        return _held(self.engine.connections.get(nextlayer.context.client))
