"""Host names and IP literals, normalised before any decision.

A request names its destination in many spellings: case, a trailing dot, Unicode
(IDN), and IP literals in every form the C library's ``inet_aton`` accepts
(``2130706433``, ``0x7f.1``, ``0177.0.0.1``, ``127.1``) or in brackets with a zone
id (``[fe80::1%eth0]``, ``[::ffff:127.0.0.1]``). Every one of them is reduced to
one canonical :class:`Host` here, so the policy compares like with like.

Pure functions, no network.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# A plain ASCII name: the fast path for nearly every real request. Possessive (a label is all of
# its characters, a name all of its labels: giving some back never makes a match): faster than
# backtracking, the same matches (bench/README.md, "Policy": a large policy's load is much this test).
_ASCII_NAME = re.compile(r"^(?!-)[a-z0-9_-]{1,63}+(?<!-)(?:\.(?!-)[a-z0-9_-]{1,63}+(?<!-))*+$")
# One part of an inet_aton address: hex, octal (leading 0) or decimal.
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")


# Bounds checked before any parsing. No host name is longer than 253 characters (254
# with its trailing dot) and an IPv6 literal with brackets and a zone id is far
# shorter; longer text is an error or padding (leading zeros, characters IDNA maps to
# nothing) that makes the parsers work for nothing. Measured: a Host port of 5000
# digits made int() raise ValueError (CPython's 4300-digit limit), which is not
# InvalidHost, so the guard that parsed it crashed and mitmproxy forwarded the request.
MAX_HOST_TEXT = 256
MAX_PORT_TEXT = 5  # "65535"
MAX_AUTHORITY = MAX_HOST_TEXT + 1 + MAX_PORT_TEXT


class InvalidHost(ValueError):
    """The text cannot name a host (empty label, bad characters, bad IP literal...)."""


@dataclass(frozen=True, slots=True)
class Host:
    """A destination host in canonical form.

    ``name`` is the punycode, lower-case domain without trailing dot, or the
    compressed text of the IP address. ``ip`` is set for IP literals only.
    """

    name: str
    ip: IPAddress | None = None

    @property
    def is_ip(self) -> bool:
        return self.ip is not None

    def __str__(self) -> str:
        return self.name


def parse_host(raw: str) -> Host:
    """Normalise ``raw`` (a host as a client wrote it, without port) to a :class:`Host`.

    Raises :class:`InvalidHost` when it cannot name a host.
    """
    if len(raw) > MAX_HOST_TEXT:
        raise InvalidHost(f"{raw[:60]!r}...: longer than {MAX_HOST_TEXT} characters")
    text = raw.strip()
    if not text:
        raise InvalidHost("empty host")
    if text.startswith("[") and text.endswith("]"):
        return Host(*_ip_pair(_parse_ipv6(text[1:-1], raw)))
    text = text.lower()
    if ":" in text:
        return Host(*_ip_pair(_parse_ipv6(text, raw)))
    if text.endswith("."):
        text = text[:-1]
    if not text:
        raise InvalidHost(f"{raw!r} is not a host name")
    labels = text.split(".")
    # A name whose last label is a number is an IPv4 literal (as in browsers and
    # inet_aton) or nothing at all: no top-level domain is numeric.
    if _NUMERIC_LABEL.match(labels[-1]):
        return Host(*_ip_pair(_parse_ipv4(labels, raw)))
    name = _domain(text, raw)
    # IDNA mapping can turn a non-ASCII spelling into an IPv4 literal: full-width
    # digits or ideographic full stops ('127\u30020\u30020\u30021'). Check again after it,
    # so that the name is the address (or refused), never a "domain" called 127.0.0.1.
    if name != text and _NUMERIC_LABEL.match(name.rpartition(".")[2]):
        return Host(*_ip_pair(_parse_ipv4(name.split("."), raw)))
    return Host(name)


def _ip_pair(ip: IPAddress) -> tuple[str, IPAddress]:
    return str(ip), ip


def _parse_ipv6(text: str, raw: str) -> IPAddress:
    text = text.split("%", 1)[0]  # zone id (fe80::1%eth0, or %25 as in URLs)
    try:
        ip = ipaddress.IPv6Address(text)
    except ValueError:
        raise InvalidHost(f"{raw!r} is not a valid IPv6 address") from None
    # ::ffff:a.b.c.d is the IPv4 address a.b.c.d for every socket API.
    return ip.ipv4_mapped or ip


def _parse_ipv4(labels: list[str], raw: str) -> ipaddress.IPv4Address:
    if len(labels) > 4:
        raise InvalidHost(f"{raw!r} is neither a host name nor an IPv4 address")
    numbers = []
    for label in labels:
        if not _NUMERIC_LABEL.match(label):
            raise InvalidHost(f"{raw!r} is neither a host name nor an IPv4 address")
        if label.startswith("0x"):
            numbers.append(int(label[2:] or "0", 16))
        elif len(label) > 1 and label.startswith("0"):
            try:
                numbers.append(int(label, 8))
            except ValueError:
                raise InvalidHost(f"{raw!r}: {label!r} is not an octal number") from None
        else:
            numbers.append(int(label))
    # inet_aton: the last part fills all the bytes the earlier parts left.
    *leading, last = numbers
    if any(n > 255 for n in leading) or last >= 256 ** (4 - len(leading)):
        raise InvalidHost(f"{raw!r} is out of range for an IPv4 address")
    value = 0
    for n in leading:
        value = value << 8 | n
    value = value << (8 * (4 - len(leading))) | last
    return ipaddress.IPv4Address(value)


def _domain(text: str, raw: str) -> str:
    if _ASCII_NAME.match(text):
        name = text
    else:
        import idna  # only for Unicode names: keeps the common path's imports small

        try:
            name = idna.encode(text, uts46=True).decode("ascii")
        except (idna.IDNAError, UnicodeError) as e:
            raise InvalidHost(f"{raw!r} is not a valid host name ({e})") from None
        if not _ASCII_NAME.match(name):
            raise InvalidHost(f"{raw!r} is not a valid host name")
    if len(name) > 253:
        raise InvalidHost(f"{raw!r} is longer than 253 characters")
    return name


def split_host_port(authority: str, default_port: int | None = None) -> tuple[str, int | None]:
    """Split ``host:port`` / ``[v6]:port`` / ``host``; the host part is not normalised.

    The one splitter of authorities in egress (requests, policy entries, command-line
    targets). Raises :class:`InvalidHost`, never another exception, for any text.
    """
    if len(authority) > MAX_AUTHORITY:
        raise InvalidHost(f"{authority[:60]!r}...: longer than {MAX_AUTHORITY} characters")
    text = authority.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise InvalidHost(f"{authority!r}: unclosed '['")
        host, rest = text[: end + 1], text[end + 1 :]
        if not rest:
            return host, default_port
        if not rest.startswith(":"):
            raise InvalidHost(f"{authority!r}: unexpected text after ']'")
        return host, parse_port(rest[1:], authority)
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, parse_port(port, authority)
    return text, default_port  # a bare IPv6 address has several colons


def parse_authority(authority: str, default_port: int | None = None) -> tuple[Host, int | None]:
    """``host[:port]`` as a client wrote it (a Host header, a CONNECT target) -> (Host, port)."""
    host, port = split_host_port(authority, default_port)
    return parse_host(host), port


def parse_port(text: str, authority: str | None = None, *, zero: bool = False) -> int:
    """A port number written in ASCII digits: 1-65535 (0 too with ``zero``), else InvalidHost."""
    # ASCII digits only: str.isdigit() is also true for '²' (int() then raises
    # ValueError, not InvalidHost) and for full-width digits no URL parser takes.
    # At most 5 of them, checked before int() (which raises ValueError past 4300 digits).
    if len(text) <= MAX_PORT_TEXT and text.isascii() and text.isdigit() and (zero or int(text) > 0) \
            and int(text) < 65536:
        return int(text)
    lowest = 0 if zero else 1
    raise InvalidHost(f"{(authority if authority is not None else text)[:80]!r}: {text[:20]!r} "
                      f"is not a port number ({lowest}-65535)")


def parent_domains(name: str) -> Iterator[str]:
    """Yield ``name`` and each parent: a.b.c -> a.b.c, b.c, c."""
    yield name
    start = name.find(".")
    while start >= 0:
        yield name[start + 1 :]
        start = name.find(".", start + 1)


def parse_override(text: str) -> tuple[str, IPAddress]:
    """``HOST:ADDR`` (ADDR may be IPv6, optionally in brackets) -> (canonical host, address)."""
    host, sep, addr = text.partition(":")
    if not sep or not host or not addr:
        raise ValueError(f"{text!r}: expected HOST:ADDRESS, e.g. example.test:127.0.0.1")
    try:
        name = parse_host(host)
        ip = ipaddress.ip_address(addr.strip("[]"))
    except (InvalidHost, ValueError) as e:
        raise ValueError(f"{text!r}: {e}") from None
    return name.name, ip
