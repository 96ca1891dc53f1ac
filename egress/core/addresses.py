"""Which IP addresses a proxy must not dial on a client's behalf.

A public name that resolves to 127.0.0.1, 10.0.0.5 or the cloud metadata service
(DNS rebinding, SSRF) would otherwise let a sandboxed command reach what the
proxy's machine can reach. :func:`classify` names the kind of address, or returns
``None`` for an ordinary public one; :func:`address_class` names its class for a
person. The ranges follow smokescreen's classifier and the IANA special-purpose
registries. :func:`known_addresses` gives the addresses a host has without any
lookup (an IP literal; ``localhost``, loopback by definition).
"""

from __future__ import annotations

import ipaddress

from egress.core.hosts import Host, IPAddress

# Order matters: the first match names the address (metadata before link-local/ULA).
# Each range has its kind (what allow_private decides on; the metadata service must be
# named by address) and its class, the plain name a person reads in a refusal: "resolves
# to 203.0.113.80, reserved for documentation" says what the network did, "reserved" alone
# would not.
_SPECIAL: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str, str]] = [
    (ipaddress.ip_network(net), kind, name)
    for net, kind, name in [
        ("169.254.169.254/32", "metadata", "the cloud metadata service"),
        ("fd00:ec2::254/128", "metadata", "the cloud metadata service"),
        ("100.100.100.200/32", "metadata", "the cloud metadata service"),  # Alibaba Cloud
        ("0.0.0.0/8", "unspecified", "unspecified"),  # "this network": 0.x reaches the host on Linux
        ("127.0.0.0/8", "loopback", "loopback"),
        ("10.0.0.0/8", "private", "private"),
        ("172.16.0.0/12", "private", "private"),
        ("192.168.0.0/16", "private", "private"),
        ("100.64.0.0/10", "cgnat", "CGNAT shared address space"),
        ("169.254.0.0/16", "link-local", "link-local"),
        ("192.0.0.0/24", "reserved", "reserved for IETF protocol assignments"),
        ("192.0.2.0/24", "reserved", "reserved for documentation"),  # TEST-NET-1 (RFC 5737)
        ("198.18.0.0/15", "reserved", "reserved for benchmarking"),  # RFC 2544
        ("198.51.100.0/24", "reserved", "reserved for documentation"),  # TEST-NET-2
        ("203.0.113.0/24", "reserved", "reserved for documentation"),  # TEST-NET-3
        ("224.0.0.0/4", "multicast", "multicast"),
        ("255.255.255.255/32", "reserved", "broadcast"),
        ("240.0.0.0/4", "reserved", "reserved"),  # class E
        ("::/128", "unspecified", "unspecified"),
        ("::1/128", "loopback", "loopback"),
        ("::ffff:0:0/96", "ipv4-embedding", "IPv4-mapped IPv6"),
        # SIIT, "IPv4-translated" (RFC 2765; was classed public)
        ("::ffff:0:0:0/96", "ipv4-embedding", "IPv4-translated IPv6 (SIIT)"),
        ("::/96", "ipv4-embedding", "IPv4-compatible IPv6"),  # deprecated
        ("64:ff9b::/96", "ipv4-embedding", "NAT64 (IPv4-embedding IPv6)"),
        ("64:ff9b:1::/48", "ipv4-embedding", "local-use NAT64 (IPv4-embedding IPv6)"),
        # the rest of ::/8, reserved by the IETF (RFC 4291): none of it is public
        ("::/8", "reserved", "reserved"),
        ("2002::/16", "ipv4-embedding", "6to4 (IPv4-embedding IPv6)"),
        ("2001::/32", "ipv4-embedding", "Teredo (IPv4-embedding IPv6)"),
        ("100::/64", "reserved", "reserved for discard"),  # RFC 6666
        ("2001:2::/48", "reserved", "reserved for benchmarking"),  # RFC 5180
        ("2001:10::/28", "reserved", "reserved (ORCHID)"),  # deprecated (RFC 4843)
        ("2001:db8::/32", "reserved", "reserved for documentation"),  # RFC 3849
        ("3fff::/20", "reserved", "reserved for documentation"),  # RFC 9637
        ("fc00::/7", "private", "private (unique local)"),
        ("fe80::/10", "link-local", "link-local"),
        ("fec0::/10", "link-local", "link-local (site-local, deprecated)"),
        ("ff00::/8", "multicast", "multicast"),
    ]
]

KINDS = ("metadata", "unspecified", "loopback", "private", "cgnat", "link-local",
         "reserved", "multicast", "ipv4-embedding")


# The only IPv6 space IANA allocates for global unicast; the rest (4000::/3, 5f00::/16
# for SRv6, 0100::/8 beyond the discard prefix, ...) is reserved, never public.
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")


def classify(ip: IPAddress) -> str | None:
    """The kind of a non-public address (one of :data:`KINDS`), or None if public."""
    special = _lookup(ip)
    return special[0] if special else None


def address_class(ip: IPAddress) -> str | None:
    """The plain name of a non-public address's class, for a person ("loopback",
    "reserved for documentation", "NAT64 (IPv4-embedding IPv6)"), or None if public."""
    special = _lookup(ip)
    return special[1] if special else None


def _lookup(ip: IPAddress) -> tuple[str, str] | None:
    for net, kind, name in _SPECIAL:
        if ip.version == net.version and ip in net:
            return kind, name
    if ip.version == 6 and ip not in _GLOBAL_UNICAST:
        return "reserved", "reserved (outside IPv6 global unicast)"
    return None


def embedded_ipv4(ip: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address carries, by every scheme that reaches them (mapped,
    SIIT, compatible, NAT64 -- the local-use /48 read both ways --, 6to4, Teredo's client): a
    deny entry for 203.0.113.0/24 covers ``64:ff9b::cb00:7105`` too. Empty for anything else."""
    if ip.version != 6:
        return ()
    value, low = int(ip), ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.ipv4_mapped is not None:
        return (ip.ipv4_mapped,)
    if ip.sixtofour is not None:
        return (ip.sixtofour,)
    if ip.teredo is not None:
        return (ip.teredo[1],)
    for net, kind, _ in _SPECIAL:
        if kind == "ipv4-embedding" and net.version == 6 and ip in net:
            if net == _LOCAL_NAT64:  # RFC 6052: a /48 prefix puts the address around the u octet
                return (low, ipaddress.IPv4Address(((value >> 64) & 0xFFFF) << 16 | (value >> 40) & 0xFFFF))
            return (low,)
    return ()


_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")


# localhost and every name under it are loopback by definition (RFC 6761 6.3): a resolver
# must answer them itself, never ask DNS, whose answer for them can be anything.
LOCALHOST_ADDRESSES: tuple[IPAddress, ...] = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


def is_localhost(name: str) -> bool:
    """True for ``localhost`` and ``*.localhost`` (a canonical name: lower case, no trailing dot)."""
    return name == "localhost" or name.endswith(".localhost")


def known_addresses(host: Host) -> list[IPAddress] | None:
    """The addresses ``host`` has without any lookup (an IP literal's own, localhost's
    loopback), or None when only a resolver can tell."""
    if host.ip is not None:
        return [host.ip]
    if is_localhost(host.name):
        return list(LOCALHOST_ADDRESSES)
    return None
