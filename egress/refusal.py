"""What a client receives when egress refuses a request or cannot reach upstream.

The refusal is a contract (see README): status 403, header
``X-Egress-Blocked: <host>; reason=<code>``, body whose first line is
``EGRESS_BLOCKED <host>: <plain words>``. Never put a secret value in any of them.
"""

from __future__ import annotations

from mitmproxy import http

from . import reasons

BLOCK_HEADER = "X-Egress-Blocked"
ERROR_HEADER = "X-Egress-Error"


def refusal_line(host: str, reason: str, detail: str = "") -> str:
    """``EGRESS_BLOCKED <host>: <words>`` (the first line of a refusal body)."""
    words = reasons.words(reason)
    return f"EGRESS_BLOCKED {host}: {words}" + (f" ({detail})" if detail else "")


def refusal(host: str, reason: str, detail: str = "") -> http.Response:
    """A 403 naming the host and the reason code."""
    body = refusal_line(host, reason, detail) + "\n"
    if reason == "not-allowed":
        body += f"To allow it, add {host!r} (or its parent domain) to the policy's allow list.\n"
    return http.Response.make(
        403,
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
