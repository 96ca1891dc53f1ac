"""What a client receives when egress refuses a request or cannot reach upstream.

The refusal is a contract (see README): status 403 (400 for a malformed request,
431 for an oversized head), header ``X-Egress-Blocked: <host>; reason=<code>``, body
whose first line is ``EGRESS_BLOCKED <host>: <plain words>``. Never put a secret
value in any of them.

:func:`refuse` is the one way a guard refuses: it records exactly one event per flow
and gives the client the refusal (or kills what can no longer be answered). The answer is
the same whichever part of the proxy turned the request down: a request mitmproxy refuses
itself (a ``ws://`` target, Transfer-Encoding with Content-Length) is answered with the
refusal the guard gave it, not mitmproxy's HTML page (egress.proxy.mitm.answer_invalid_requests);
a destination that is this proxy's own address is a refusal, not an upstream failure
(egress.proxy.addons.upstream_errors).
"""

from __future__ import annotations

from mitmproxy import connection, http

from egress.core import reasons
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


# How a refusal reaches the client (refuse's ``how``).
ANSWER = "answer"  # the refusal response is the flow's answer (a flow still in its request phase)
KILL = "kill"  # flow.kill(): bytes already moved (a response from upstream, a WebSocket message)
CLOSE = "close"  # close the client's and the server's connections now (from a stream function)
NONE = "none"  # the event only: the caller answers (a layer) or mitmproxy already has


def refuse(engine, target: http.HTTPFlow | connection.Client, decision, *, how: str = ANSWER,
           status: int = 403, method: str | None = None, after_allow: bool = False) -> http.Response | None:
    """Refuse ``target`` (a flow, or a client connection that has no flow) for ``decision``.

    Records exactly one ``block`` event per flow (a flow already refused or reported is
    left as it is: the first refusal stands) and, by ``how``:

    * ``ANSWER``: the refusal response (``status``, X-Egress-Blocked, EGRESS_BLOCKED body)
      becomes the flow's answer; a flow whose response came from upstream is killed instead.
      For a client connection, the response is returned for the caller (a layer) to send.
    * ``KILL``: ``flow.kill()``; ``CLOSE``: both connections closed at once (stream functions,
      which run outside hooks); ``NONE``: the event only.

    ``after_allow``: a flow already reported as allowed (an upgraded WebSocket, a response
    under way) still gets this refusal as an event of its own; only a refusal stands first.

    Host names and details pass through ``engine.recorder.clean`` (no secret reaches the
    client or the log). ``decision`` is an :class:`egress.policy.Decision` (allowed=False).
    Returns the refusal response made, if any.
    """
    clean = engine.recorder.clean
    host = clean(decision.host)
    if isinstance(target, http.HTTPFlow):
        state = flow_state(target)
        if state.refused or (state.reported and not after_allow):
            return None
        # A host name may carry a secret. The canonical name is lower-cased, which can hide
        # a token's shape from the redactor: then show the name as the client wrote it, redacted.
        written = target.request.host
        if clean(written) != written:
            host = clean(written)
        state.refused = state.reported = True
        if decision.host != host:
            decision = _replace(decision, host=host)
        client = target.client_conn
        method = method or target.request.method
    else:
        client, method = target, method or "-"
        if decision.host != host:
            decision = _replace(decision, host=host)
    if decision.detail:
        decision = _replace(decision, detail=clean(decision.detail))
    from egress.proxy.engine import client_label

    telling = engine.record_refusal(client_label(client.peername), method, decision)
    if telling is not None:  # the answer waits for the run's line (egress.proxy.addons.line_first)
        if isinstance(target, http.HTTPFlow):
            flow_state(target).telling = telling
        else:
            engine.conn(target).telling = telling
    response = None
    if how == ANSWER:
        response = refusal(host, decision.reason, decision.detail, status)
        if isinstance(target, http.HTTPFlow):
            if target.response is None:
                target.response = response
            else:  # the response head came from upstream: too late to answer, stop it
                _kill(target)
    elif how == KILL and isinstance(target, http.HTTPFlow):
        _kill(target)
    elif how == CLOSE:
        close(client, target.server_conn if isinstance(target, http.HTTPFlow) else None)
    return response


def upstream_failure(engine, flow: http.HTTPFlow, host: str, code: str, message: str) -> None:
    """An allowed request that cannot be served (DNS failed...): the 502/504 and one ``error`` event."""
    state = flow_state(flow)
    if state.reported or state.refused:
        return
    state.refused = state.reported = True  # our answer: nothing goes upstream
    state.upstream_error = code
    from egress.proxy.engine import client_label
    from egress.observe.events import Event

    host = engine.recorder.clean(host)
    flow.response = upstream_error(host, code, message)
    state.telling = engine.recorder.record(Event(
        client=client_label(flow.client_conn.peername), method=flow.request.method, host=host,
        port=flow.request.port, decision="error", reason=code, detail=message))


def _replace(decision, **changes):
    import dataclasses

    return dataclasses.replace(decision, **changes)


def _kill(flow: http.HTTPFlow) -> None:
    if flow.killable:
        flow.kill()
    else:  # no hook is waiting on it any more: close its connections
        close(flow.client_conn, flow.server_conn)


def close(client: connection.Client, server: connection.Server | None = None) -> None:
    """Close a client connection (and a server connection of it) now, from anywhere in the loop."""
    from egress.proxy import mitm

    if not mitm.cancel(client, server, client, reason="closed by egress"):
        client.error = client.error or "closed by egress"

