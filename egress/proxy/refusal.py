"""What a client receives when egress refuses a request or cannot reach upstream.

The refusal is a contract (see README): status 403 (400 for a malformed request,
431 for an oversized head), header ``X-Egress-Blocked: <host>; reason=<code>``, body
whose first line is ``EGRESS_BLOCKED <host>: <plain words>``. Never put a secret
value in any of them.

A guard refuses by raising :class:`Refused` from a hook; the one guard wrapper
(egress.proxy.failclosed.guard) catches it and calls :func:`refuse`, which records exactly
one event per flow and acts as the refusal's :class:`Stage` says: the refusal answers the
request, or the flow is killed, or its connections are closed, or its WebSocket gets a 1008
close. Code that runs outside a hook (mitmproxy's HTTP/1 layer, a stream function, a policy
watcher) calls :func:`refuse` itself; a connection egress holds without mitmproxy (serve's
front, `egress run`'s capture) is refused with :func:`refuse_connection`.

The answer is the same whichever part of the proxy turned the request down: a request
mitmproxy refuses itself (a ``ws://`` target, Transfer-Encoding with Content-Length) is
answered with the refusal the guard gave it, not mitmproxy's HTML page
(egress.proxy.mitm.answer_invalid_requests); a dial refused at ``server_connect`` is answered
with the refusal, not as an upstream that could not be reached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum

from mitmproxy import connection, http
from mitmproxy.proxy import layer
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from egress.core import reasons
from egress.core.reasons import Verdict
from egress.observe.events import Event, Telling, refusal_event
from egress.policy.matcher import Decision
from egress.proxy import mitm
from egress.proxy.engine import client_label
from egress.proxy.flowstate import flow_state

BLOCK_HEADER = "X-Egress-Blocked"
ERROR_HEADER = "X-Egress-Error"


def refusal_line(host: str, reason: str, detail: str = "") -> str:
    """``EGRESS_BLOCKED <host>: <words>`` (the first line of a refusal body)."""
    words, detail = reasons.phrase(reason, detail)
    return f"EGRESS_BLOCKED {host}: {words}" + (f" ({detail})" if detail else "")


def refusal(host: str, reason: str, detail: str = "", status: int = 403) -> http.Response:
    """A 403 (or ``status``) naming the host and the reason code."""
    body = refusal_line(host, reason, detail) + "\n"
    if reason == "not-allowed":
        body += f"To allow it, add {host!r} (or its parent domain) to the policy's allow list.\n"
    return http.Response.make(
        status,
        body.encode(),
        {
            "Content-Type": "text/plain; charset=utf-8",
            BLOCK_HEADER: f"{host}; reason={reason}",
            "Connection": "close",
        },
    )


def upstream_error(host: str, reason: str, detail: str = "") -> http.Response:
    """A 502/504 for an allowed destination that could not be reached."""
    status, words = reasons.UPSTREAM_ERRORS[reason]
    body = f"EGRESS_UPSTREAM_ERROR {host}: {words}" + (f" ({detail})" if detail else "") + "\n"
    return http.Response.make(
        status,
        body.encode(),
        {
            "Content-Type": "text/plain; charset=utf-8",
            ERROR_HEADER: f"{host}; reason={reason}",
            "Connection": "close",
        },
    )


class Stage(Enum):
    """Where a refusal happens; it decides what :func:`refuse` does besides the event."""

    HEAD = "head"  # a request not answered yet: the refusal is its answer (a response from upstream: RESPONSE)
    RESPONSE = "response"  # a response from upstream under way: the flow is killed (once it streams, closed)
    STREAM = "stream"  # a body relayed as it is scanned (a stream function): both connections closed now
    WEBSOCKET = "websocket"  # a WebSocket: a close frame (1008) to both sides at the next frame
    CONNECTION = "connection"  # a client connection and no flow (a tunnel): closed, or given a closing layer
    SERVER_CONNECT = "server-connect"  # the dial: never made; the flow's error hook answers it with the refusal
    LAYER = "layer"  # inside mitmproxy's HTTP/1 layer (addons.limits), which sends the answer made and closes


# Refusals that come after bytes have moved: the flow may already have its allow event (an
# upgraded WebSocket, a response under way), and gets this refusal's event all the same.
AFTER_ALLOW = frozenset({Stage.RESPONSE, Stage.STREAM, Stage.WEBSOCKET, Stage.LAYER})


class Refused(Exception):
    """A guard's refusal, raised from a hook: the guard wrapper (egress.proxy.failclosed.guard)
    hands it to :func:`refuse` for the hook's data (a flow, a client, a NextLayer, a server
    connection)."""

    def __init__(self, decision: Decision, stage: Stage = Stage.HEAD, *, status: int = 403,
                 method: str | None = None):
        super().__init__(decision.reason)
        self.decision, self.stage, self.status, self.method = decision, stage, status, method


Target = http.HTTPFlow | connection.Client | layer.NextLayer | ServerConnectionHookData


def refuse(engine, target: Target, decision: Decision, stage: Stage = Stage.HEAD, *, status: int = 403,
           method: str | None = None, after_allow: bool | None = None) -> http.Response | None:
    """Refuse ``target`` for ``decision`` (allowed=False) at ``stage``.

    Records exactly one ``block`` event per flow: a flow already refused is left as it is
    (the first refusal stands), and so is one already reported as allowed, unless
    ``after_allow`` (by default: the stage comes after bytes have moved, :data:`AFTER_ALLOW`).
    Then acts as the stage says (see :class:`Stage`). A flow refused at its dial
    (SERVER_CONNECT, from server_connect: a ServerConnectionHookData) is recorded by its
    flow's error hook (:func:`take_dial_refusal`), which knows its method.

    Host names and details pass through ``engine.recorder.clean`` (no secret reaches the
    client or the log). ``method``: the event's (default: the flow's; ``WEBSOCKET``,
    ``TUNNEL`` or ``-`` without one). Returns the refusal response made, if any: for HEAD and
    LAYER, the caller (a layer) sends it when the target is a client connection.
    """
    if isinstance(target, ServerConnectionHookData):
        _refuse_dial(engine, target, decision)
        return None
    clean = engine.recorder.clean
    host = clean(decision.host)
    flow = target if isinstance(target, http.HTTPFlow) else None
    if flow is not None:
        state = flow_state(flow)
        if state.refused or (state.reported and not (stage in AFTER_ALLOW if after_allow is None else after_allow)):
            return None
        # A host name may carry a secret. The canonical name is lower-cased, which can hide
        # a token's shape from the redactor: then show the name as the client wrote it, redacted.
        written = flow.request.host
        if clean(written) != written:
            host = clean(written)
        state.refused = state.reported = True
        client = flow.client_conn
        method = method or ("WEBSOCKET" if stage is Stage.WEBSOCKET else flow.request.method)
    else:
        client = target.context.client if isinstance(target, layer.NextLayer) else target
        method = method or ("TUNNEL" if stage is Stage.CONNECTION else "-")
    if decision.host != host:
        decision = dataclasses.replace(decision, host=host)
    if decision.detail:
        decision = dataclasses.replace(decision, detail=clean(decision.detail))
    telling = engine.recorder.record(refusal_event(client_label(client.peername), method, decision))
    if telling is not None:  # the answer waits for the run's line (egress.proxy.addons.line_first)
        if flow is not None:
            flow_state(flow).telling = telling
        else:
            engine.conn(client).telling = telling
    if flow is not None:
        return _act_on_flow(flow, decision, stage, status)
    if stage is Stage.HEAD or stage is Stage.LAYER:
        return refusal(host, decision.reason, decision.detail, status)
    if isinstance(target, layer.NextLayer):
        target.layer = mitm.closing_layer(target.context)
    else:
        close(client)
    return None


def _act_on_flow(flow: http.HTTPFlow, decision: Decision, stage: Stage, status: int) -> http.Response | None:
    if stage is Stage.HEAD and flow.response is not None:
        stage = Stage.RESPONSE  # the response head came from upstream: too late to answer
    if stage is Stage.HEAD or stage is Stage.LAYER or stage is Stage.SERVER_CONNECT:
        response = refusal(decision.host, decision.reason, decision.detail, status)
        if flow.response is None and stage is not Stage.LAYER:  # a layer sends it itself
            flow.response = response
        if stage is Stage.SERVER_CONNECT:
            flow_state(flow).refused_dial = True  # answered by egress's HTTP/1 side (addons.limits)
        return response
    streaming = flow.response is not None and callable(flow.response.stream)
    if stage is Stage.RESPONSE and not streaming:  # from a hook: mitmproxy stops the flow after it
        if flow.killable:
            flow.kill()
        else:  # no hook is waiting on it any more
            close(flow.client_conn, flow.server_conn)
    elif stage is Stage.WEBSOCKET and flow_state(flow).websocket_close is not None:
        flow_state(flow).websocket_close = True  # the frame readers send 1008 (addons.credential_guard)
    elif stage is Stage.CONNECTION:
        close(flow.client_conn, flow.server_conn)
    else:  # bytes are moving in a stream function, or a WebSocket no frame reader watches
        mitm.close_connections(flow, flow.server_conn, flow.client_conn)
    return None


def _refuse_dial(engine, data: ServerConnectionHookData, decision: Decision) -> None:
    """The dial is not made (``server.error``, which mitmproxy logs); the refusal waits on the
    client connection's state for the flow's error hook, which comes next."""
    data.server.error = f"EGRESS_BLOCKED {engine.recorder.clean(decision.host)}: {decision.words()}"
    engine.conn(data.client).dial_refusal = decision


def take_dial_refusal(engine, flow: http.HTTPFlow) -> bool:
    """In ``flow``'s error hook: if its dial was refused, refuse the flow for it (one event, the
    refusal as its answer in place of an upstream error); False if it was not."""
    conn = engine.connections.get(flow.client_conn)
    decision = conn.dial_refusal if conn is not None else None
    if decision is None:
        return False
    conn.dial_refusal = None
    refuse(engine, flow, decision, Stage.SERVER_CONNECT)
    return True


def refuse_connection(record: Callable[[Event], Telling | None], client: str, decision: Decision, *,
                      method: str = "TUNNEL") -> Telling | None:
    """A connection refused where mitmproxy has no flow or client for it (serve's front, `egress
    run`'s capture): its one ``block`` event (``record``: the engine's recorder's). The caller
    closes its connection, after the returned Telling if there is one (the run's line first)."""
    return record(refusal_event(client, method, decision))


def upstream_failure(engine, flow: http.HTTPFlow, host: str, code: str, message: str) -> None:
    """An allowed request that cannot be served (DNS failed...): the 502/504 and one ``error`` event."""
    state = flow_state(flow)
    if state.reported or state.refused:
        return
    state.refused = state.reported = True  # our answer: nothing goes upstream
    state.upstream_error = code
    host = engine.recorder.clean(host)
    flow.response = upstream_error(host, code, message)
    state.telling = engine.recorder.record(Event(
        client=client_label(flow.client_conn.peername), method=flow.request.method, host=host,
        port=flow.request.port, decision=Verdict.ERROR, reason=code, detail=message))


def close(client: connection.Client, server: connection.Server | None = None) -> None:
    """Close a client connection (and a server connection of it) now, from anywhere in the loop."""
    if not mitm.cancel(client, server, client, reason="closed by egress"):
        client.error = client.error or "closed by egress"
