"""Which IP addresses a proxy must not dial on a client's behalf.

A public name that resolves to 127.0.0.1, 10.0.0.5 or the cloud metadata service
(DNS rebinding, SSRF) would otherwise let a sandboxed command reach what the
proxy's machine can reach. :func:`classify` names the kind of address, or returns
``None`` for an ordinary public one. The ranges follow smokescreen's classifier and
the IANA special-purpose registries.
"""

from __future__ import annotations

import ipaddress

from .hosts import IPAddress

# Order matters: the first match names the address (metadata before link-local/ULA).
_SPECIAL: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str]] = [
    (ipaddress.ip_network(net), kind)
    for net, kind in [
        ("169.254.169.254/32", "metadata"),
        ("fd00:ec2::254/128", "metadata"),
        ("100.100.100.200/32", "metadata"),  # Alibaba Cloud
        ("0.0.0.0/8", "unspecified"),
        ("127.0.0.0/8", "loopback"),
        ("10.0.0.0/8", "private"),
        ("172.16.0.0/12", "private"),
        ("192.168.0.0/16", "private"),
        ("100.64.0.0/10", "cgnat"),
        ("169.254.0.0/16", "link-local"),
        ("192.0.0.0/24", "reserved"),
        ("192.0.2.0/24", "reserved"),
        ("198.18.0.0/15", "reserved"),
        ("198.51.100.0/24", "reserved"),
        ("203.0.113.0/24", "reserved"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),  # includes 255.255.255.255
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::ffff:0:0/96", "ipv4-embedding"),  # mapped
        ("::ffff:0:0:0/96", "ipv4-embedding"),  # SIIT, "IPv4-translated" (RFC 2765; was classed public)
        ("::/96", "ipv4-embedding"),  # IPv4-compatible (deprecated)
        ("64:ff9b::/96", "ipv4-embedding"),  # NAT64
        ("64:ff9b:1::/48", "ipv4-embedding"),  # local-use NAT64
        ("::/8", "reserved"),  # the rest of ::/8, reserved by the IETF (RFC 4291): none of it is public
        ("2002::/16", "ipv4-embedding"),  # 6to4
        ("2001::/32", "ipv4-embedding"),  # Teredo
        ("100::/64", "reserved"),  # discard
        ("2001:2::/48", "reserved"),  # benchmarking (RFC 5180)
        ("2001:10::/28", "reserved"),  # ORCHID, deprecated (RFC 4843)
        ("2001:db8::/32", "reserved"),  # documentation
        ("3fff::/20", "reserved"),  # documentation (RFC 9637)
        ("fc00::/7", "private"),  # unique local
        ("fe80::/10", "link-local"),
        ("fec0::/10", "link-local"),  # deprecated site-local
        ("ff00::/8", "multicast"),
    ]
]

KINDS = ("metadata", "unspecified", "loopback", "private", "cgnat", "link-local",
         "reserved", "multicast", "ipv4-embedding")


# The only IPv6 space IANA allocates for global unicast; the rest (4000::/3, 5f00::/16
# for SRv6, 0100::/8 beyond the discard prefix, ...) is reserved, never public.
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")


def classify(ip: IPAddress) -> str | None:
    """The kind of a non-public address (one of :data:`KINDS`), or None if public."""
    for net, kind in _SPECIAL:
        if ip.version == net.version and ip in net:
            return kind
    if ip.version == 6 and ip not in _GLOBAL_UNICAST:
        return "reserved"
    return None
