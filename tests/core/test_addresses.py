"""Address classes the proxy refuses to dial after resolution.

The first table is smokescreen's TestClassifyAddr (pkg/smokescreen/smokescreen_test.go)
plus the boundaries of each range; the kind names are egress's own.
"""

from __future__ import annotations

import ipaddress

import pytest

from egress.core.addresses import _SPECIAL, KINDS, address_class, classify, is_localhost, known_addresses
from egress.core.hosts import parse_host

PUBLIC = None

ADDRESSES = [
    # smokescreen's vectors
    ("8.8.8.8", PUBLIC),
    ("8.8.9.8", PUBLIC),
    ("1.1.1.1", PUBLIC),
    ("10.0.0.1", "private"),
    ("172.16.0.1", "private"),
    ("192.168.0.1", "private"),
    ("127.0.0.1", "loopback"),
    ("127.255.255.255", "loopback"),
    ("::1", "loopback"),
    ("169.254.169.254", "metadata"),
    ("255.255.255.255", "reserved"),  # broadcast
    ("ff02::2", "multicast"),  # ff02:0:0:0:0:0:0:2
    ("100.64.0.1", "cgnat"),
    ("100.63.255.254", PUBLIC),  # just below CGNAT
    ("64:ff9b::a00:1", "ipv4-embedding"),  # NAT64 of 10.0.0.1
    # range boundaries
    ("100.127.255.255", "cgnat"),
    ("100.128.0.0", PUBLIC),
    ("10.255.255.255", "private"),
    ("11.0.0.0", PUBLIC),
    ("172.15.255.255", PUBLIC),
    ("172.31.255.255", "private"),
    ("172.32.0.0", PUBLIC),
    ("192.167.255.255", PUBLIC),
    ("192.168.255.255", "private"),
    ("126.255.255.255", PUBLIC),
    ("128.0.0.0", PUBLIC),
    # metadata services: before link-local / ULA, so allow_private can single them out
    ("fd00:ec2::254", "metadata"),
    ("100.100.100.200", "metadata"),  # Alibaba Cloud
    ("169.254.169.253", "link-local"),  # next to metadata: link-local, not metadata
    ("169.254.0.1", "link-local"),
    ("fe80::1", "link-local"),
    ("febf:ffff::1", "link-local"),
    ("fec0::1", "link-local"),  # deprecated site-local
    ("fc00::1", "private"),  # ULA
    ("fd12:3456:789a::1", "private"),
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "unspecified"),  # 0.0.0.0/8: "this network", reaches the host on Linux
    ("::", "unspecified"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("ff05::1:3", "multicast"),
    ("240.0.0.1", "reserved"),
    ("192.0.0.8", "reserved"),
    ("192.0.2.1", "reserved"),  # TEST-NET-1
    ("198.18.0.1", "reserved"),  # benchmarking
    ("198.51.100.1", "reserved"),
    ("203.0.113.1", "reserved"),
    ("2001:db8::1", "reserved"),  # documentation
    ("100::1", "reserved"),  # discard
    # IPv4 inside IPv6: refused whatever the IPv4 address, public or not
    ("::ffff:8.8.8.8", "ipv4-embedding"),  # mapped (a raw address; parse_host unwraps it)
    ("::ffff:127.0.0.1", "ipv4-embedding"),
    ("::127.0.0.1", "ipv4-embedding"),  # IPv4-compatible, deprecated
    ("64:ff9b::808:808", "ipv4-embedding"),  # NAT64 of a public address
    ("64:ff9b:1::1", "ipv4-embedding"),  # local-use NAT64
    ("2002:7f00:1::1", "ipv4-embedding"),  # 6to4 of 127.0.0.1
    ("2001::1", "ipv4-embedding"),  # Teredo
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "ipv4-embedding"),
    # SIIT (::ffff:0:0:0/96): was classed public
    ("::ffff:0:7f00:1", "ipv4-embedding"),  # SIIT of 127.0.0.1
    ("::ffff:0:808:808", "ipv4-embedding"),  # SIIT of a public address
    ("::ffff:0:0:0", "ipv4-embedding"),
    ("::ffff:0:ffff:ffff", "ipv4-embedding"),
    # the rest of ::/8 is reserved, none of it public (each was classed public)
    ("::1:0:0:1", "reserved"),  # just past ::/96 and the mapped/SIIT ranges
    ("::fffe:0:0:1", "reserved"),
    ("0:1::1", "reserved"),
    ("ff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "reserved"),  # the last address of ::/8
    ("::2", "ipv4-embedding"),  # inside ::/96 (IPv4-compatible), as before
    # outside 2000::/3 nothing is public; inside it, the special-purpose blocks
    ("100:0:0:1::", "reserved"),  # 0100::/8 past the discard /64
    ("5f00::1", "reserved"),  # SRv6 SIDs
    ("4000::1", "reserved"),
    ("1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "reserved"),  # just below 2000::/3
    ("2001:2::1", "reserved"),  # benchmarking
    ("2001:10::1", "reserved"),  # ORCHID
    ("3fff::1", "reserved"),  # documentation (RFC 9637)
    ("3ffe:ffff::1", PUBLIC),  # below 3fff::/20 (old 6bone space, global unicast)
    ("2000::1", PUBLIC),  # the first global unicast address
    ("3fff:1000::1", PUBLIC),  # just past 3fff::/20
    # public IPv6
    ("2001:4860:4860::8888", PUBLIC),
    ("2606:4700:4700::1111", PUBLIC),
    ("2a00:1450:4001::1", PUBLIC),
    ("2001:1::1", PUBLIC),  # outside Teredo's /32
]


@pytest.mark.parametrize(("address", "kind"), ADDRESSES, ids=[a for a, _ in ADDRESSES])
def test_classify(address, kind):
    assert classify(ipaddress.ip_address(address)) == kind


def test_every_kind_is_named_in_KINDS():
    kinds = {k for _, k in ADDRESSES if k is not None}
    assert kinds == set(KINDS)


# A name that resolves to nothing special is fine; every obfuscated spelling of a
# special address is caught once parse_host has normalised it.
SPELLINGS = [
    ("2130706433", "loopback"),
    ("0x7f.1", "loopback"),
    ("0177.0.0.1", "loopback"),
    ("127.1", "loopback"),
    ("[::ffff:127.0.0.1]", "loopback"),  # unwrapped to IPv4, then loopback
    ("[fe80::1%eth0]", "link-local"),
    ("2852039166", "metadata"),
    ("0xa9.0xfe.0xa9.0xfe", "metadata"),
    ("[::ffff:a9fe:a9fe]", "metadata"),
    ("0", "unspecified"),
    ("[::]", "unspecified"),
    ("10.1", "private"),
    ("127。0。0。1", "loopback"),
    ("[64:ff9b::7f00:1]", "ipv4-embedding"),
]


@pytest.mark.parametrize(("raw", "kind"), SPELLINGS, ids=[r for r, _ in SPELLINGS])
def test_obfuscated_spellings_are_classified(raw, kind):
    host = parse_host(raw)
    assert host.ip is not None
    assert classify(host.ip) == kind


# The class a person reads in a refusal ("resolves to 203.0.113.80, reserved for documentation"):
# one case per range, the same table as classify's (egress/core/addresses.py _SPECIAL).
CLASSES = [
    ("8.8.8.8", None),
    ("2606:4700:4700::1111", None),
    ("169.254.169.254", "the cloud metadata service"),
    ("fd00:ec2::254", "the cloud metadata service"),
    ("100.100.100.200", "the cloud metadata service"),
    ("0.1.2.3", "unspecified"),
    ("::", "unspecified"),
    ("127.0.0.1", "loopback"),
    ("::1", "loopback"),
    ("10.0.0.1", "private"),
    ("172.16.0.1", "private"),
    ("192.168.1.1", "private"),
    ("fd12::1", "private (unique local)"),
    ("100.64.0.1", "CGNAT shared address space"),
    ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"),
    ("fec0::1", "link-local (site-local, deprecated)"),
    ("192.0.0.8", "reserved for IETF protocol assignments"),
    ("192.0.2.1", "reserved for documentation"),
    ("198.51.100.7", "reserved for documentation"),
    ("203.0.113.80", "reserved for documentation"),  # what a company DNS answered for pypi.org
    ("2001:db8::1", "reserved for documentation"),
    ("3fff::1", "reserved for documentation"),
    ("198.18.0.1", "reserved for benchmarking"),
    ("2001:2::1", "reserved for benchmarking"),
    ("100::1", "reserved for discard"),
    ("2001:10::1", "reserved (ORCHID)"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "broadcast"),
    ("::1:0:0:1", "reserved"),
    ("4000::1", "reserved (outside IPv6 global unicast)"),
    ("224.0.0.1", "multicast"),
    ("ff02::2", "multicast"),
    ("::ffff:8.8.8.8", "IPv4-mapped IPv6"),
    ("::ffff:0:7f00:1", "IPv4-translated IPv6 (SIIT)"),
    ("::127.0.0.1", "IPv4-compatible IPv6"),
    ("64:ff9b::808:808", "NAT64 (IPv4-embedding IPv6)"),
    ("64:ff9b:1::1", "local-use NAT64 (IPv4-embedding IPv6)"),
    ("2002:7f00:1::1", "6to4 (IPv4-embedding IPv6)"),
    ("2001::1", "Teredo (IPv4-embedding IPv6)"),
]


@pytest.mark.parametrize(("address", "name"), CLASSES, ids=[a for a, _ in CLASSES])
def test_address_class(address, name):
    ip = ipaddress.ip_address(address)
    assert address_class(ip) == name
    assert (classify(ip) is None) == (name is None)  # one table: a class exactly when a kind


def test_every_range_has_a_class_case():
    named = {address_class(ipaddress.ip_address(a)) for a, _ in CLASSES}
    assert {name for _, _, name in _SPECIAL} <= named


# localhost is loopback by definition (RFC 6761): its addresses are known without a lookup,
# as an IP literal's are; any other name needs the resolver.
LOOPBACK = [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
KNOWN = [
    ("localhost", LOOPBACK),
    ("LOCALHOST.", LOOPBACK),
    ("foo.localhost", LOOPBACK),
    ("a.b.localhost", LOOPBACK),
    ("localhost.example.com", None),  # a name under example.com: DNS decides
    ("notlocalhost", None),
    ("xlocalhost.", None),
    ("example.com", None),
    ("0x7f.1", [ipaddress.ip_address("127.0.0.1")]),
    ("[::1]", [ipaddress.ip_address("::1")]),
    ("203.0.113.80", [ipaddress.ip_address("203.0.113.80")]),
]


@pytest.mark.parametrize(("raw", "addresses"), KNOWN, ids=[r for r, _ in KNOWN])
def test_known_addresses(raw, addresses):
    host = parse_host(raw)
    assert known_addresses(host) == addresses
    assert is_localhost(host.name) == (addresses == LOOPBACK)
