"""The closed vocabulary of refusal reasons.

Each code appears on the wire (``X-Egress-Blocked: host; reason=<code>``), in the
audit log, in metrics labels and in ``egress check --json``. Adding a code is a
contract change: document it in the README's table too.
"""

REFUSALS: dict[str, str] = {
    "not-allowed": "not on the allow list",
    "denied": "on the deny list",
    "invalid-host": "not a valid host name or IP address",
    "private-address": "resolves to a private or special-purpose address",
    "misdirected": "the Host header or TLS SNI names a different host than the tunnel",
    "protocol": "not well-formed HTTP/1.1, or non-HTTP traffic in a tunnel to a host that is not on the "
                "passthrough list",
    "credential": "the request carries a credential",
    "guard-error": "a check failed with an internal error, so the request was refused to be safe",
}

# Upstream failures are not refusals: the policy allowed the request but the
# destination could not be reached. They answer 502 or 504.
UPSTREAM_ERRORS: dict[str, tuple[int, str]] = {
    "dns-failed": (502, "the name does not resolve"),
    "dns-timeout": (504, "the name did not resolve in time"),
    "connect-failed": (502, "the upstream server could not be reached"),
    "upstream-timeout": (504, "the upstream server did not answer in time"),
    "upstream-certificate": (502, "the upstream server's certificate did not verify"),
    "tls-failed": (502, "the TLS handshake with the upstream server failed"),
}

ALLOWED = "allowed"


def words(code: str) -> str:
    """Plain words for a reason code."""
    if code in REFUSALS:
        return REFUSALS[code]
    if code in UPSTREAM_ERRORS:
        return UPSTREAM_ERRORS[code][1]
    if code == ALLOWED:
        return "allowed"
    raise KeyError(code)
