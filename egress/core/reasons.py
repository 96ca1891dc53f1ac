"""The closed vocabulary of refusal reasons.

Each code appears on the wire (``X-Egress-Blocked: host; reason=<code>``), in the
audit log, in metrics labels and in ``egress check --json``. Adding a code is a
contract change: document it in the README's table too.
"""

from enum import StrEnum


class Verdict(StrEnum):
    """What an event says egress did with a request (the audit log's ``decision``).

    str-valued: the audit log's JSON, metric labels and every printed line read as before.
    """

    ALLOW = "allow"
    BLOCK = "block"  # refused (a code of REFUSALS)
    ERROR = "error"  # allowed, but the upstream could not be reached (a code of UPSTREAM_ERRORS)


REFUSALS: dict[str, str] = {
    "not-allowed": "not on the allow list",
    "denied": "on the deny list",
    "invalid-host": "not a valid host name or IP address",
    "private-address": "resolves to a private or special-purpose address",
    "misdirected": "the Host header or TLS SNI names a different host than the tunnel",
    "protocol": "not well-formed HTTP/1.1, or non-HTTP traffic in a tunnel to a host that is not on the "
                "passthrough list",
    "credential": "the request carries a credential",
    "exfiltration": "the name looks like data smuggled out in its labels",
    "not-http": "only HTTP(S) passes",
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

# Refusals whose detail, when there is one, says precisely what their words say in general:
# for a person it replaces them ("resolves to 203.0.113.80, reserved for documentation; to
# allow it, ..." rather than "resolves to a private or special-purpose address").
SPECIFIC_DETAIL = frozenset({"private-address"})


# Upstream errors whose words stand for many causes (refused or unreachable; which certificate
# check failed, and whether --upstream-ca is the fix): a person's line also says which one.
CAUSE_IN_DETAIL = frozenset({"connect-failed", "upstream-certificate", "tls-failed",
                             "exfiltration", "not-http"})  # which shape; which protocol was guessed


def words(code: str) -> str:
    """Plain words for a reason code."""
    if code in REFUSALS:
        return REFUSALS[code]
    if code in UPSTREAM_ERRORS:
        return UPSTREAM_ERRORS[code][1]
    if code == ALLOWED:
        return "allowed"
    raise KeyError(code)


def phrase(code: str, detail: str = "") -> tuple[str, str]:
    """(what to say, the detail still to add) for a refusal: the detail itself for the codes
    in :data:`SPECIFIC_DETAIL`, else the code's words and the detail unchanged."""
    if detail and code in SPECIFIC_DETAIL:
        return detail, ""
    return words(code), detail


def for_person(code: str, detail: str = "") -> str:
    """The reason as the line a person reads says it (``EGRESS_BLOCKED host (<this>)``): the
    detail instead of the words for :data:`SPECIFIC_DETAIL`, the words and the cause for
    :data:`CAUSE_IN_DETAIL`, else the words alone."""
    text, rest = phrase(code, detail)
    if rest and code in CAUSE_IN_DETAIL:
        text += f": {' '.join(rest.split())}"  # one line, whatever the detail holds
    return text
