"""Proxy authentication: a proxy that others on the host could reach answers only clients that
know its secret (``http://USER:SECRET@127.0.0.1:PORT``: Basic credentials in Proxy-Authorization).

`egress run` on macOS has no network namespace to hide its proxy in: it listens on 127.0.0.1 on a
port picked for the run, which any program of the machine can find, so each run makes a secret
(sandbox.platforms makes it) and its command's proxy variables carry it. `egress serve --auth` does the
same for a proxy shared on a host. A connection whose first request head lacks the credentials
gets 407 and is closed (egress.proxy.addons.limits.StrictHttp1Server asks :func:`accepts` before any
hook runs: no policy decision, no DNS, no event, no grant question for a stranger); one whose
first request carries them is trusted for its lifetime, tunnel included, as mitmproxy's own
proxyauth addon does, and the header is removed before anything else reads it.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from egress.core.contract import PROXY_USER as USER  # noqa: F401  the user name in a run's proxy URL


def parse(text: str) -> tuple[str, str]:
    """``USER:PASSWORD`` (as curl's --proxy-user takes it). Raises ValueError."""
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ValueError("expected USER:PASSWORD, both non-empty")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in text):
        raise ValueError("USER:PASSWORD must not hold spaces or control characters")
    return user, password


def expected(auth: tuple[str, str] | None) -> bytes | None:
    """What a client's Basic credentials must decode to (None: no authentication required)."""
    if auth is None:
        return None
    user, password = auth
    return f"{user}:{password}".encode()


def accepts(header: str | None, wanted: bytes) -> bool:
    """Whether a Proxy-Authorization value carries exactly ``wanted`` (Basic, any case)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        given = base64.b64decode(token.strip().encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return False
    return hmac.compare_digest(given, wanted)


def challenge():
    """The 407 a client without the credentials gets (and nothing else)."""
    from mitmproxy import http

    return http.Response.make(407, b"egress: proxy authentication required\n", {
        "Proxy-Authenticate": 'Basic realm="egress"', "Content-Type": "text/plain; charset=utf-8",
        "Connection": "close"})
