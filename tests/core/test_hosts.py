"""Host normalisation: every spelling of a destination reduces to one canonical Host.

Pure functions, no network. Each table row names the behaviour it pins down, so a
regression reads as the broken rule ("ipv4-octal"), not as a line number.
"""

from __future__ import annotations

import ipaddress

import pytest

from egress.core.hosts import (
    MAX_HOST_TEXT,
    Host,
    InvalidHost,
    parent_domains,
    parse_authority,
    parse_host,
    parse_port,
    split_host_port,
)

# ------------------------------------------------------------------ names


NAMES = [
    # (raw, canonical name)
    ("example.com", "example.com"),
    ("EXAMPLE.COM", "example.com"),
    ("Api.Example.Com", "api.example.com"),
    ("example.com.", "example.com"),  # trailing dot (FQDN form)
    ("  example.com  ", "example.com"),
    ("a_b.example.com", "a_b.example.com"),  # underscores appear in real names (SRV, _dmarc)
    ("localhost", "localhost"),
    ("bücher.de", "xn--bcher-kva.de"),  # IDN: compared in punycode
    ("BÜCHER.DE.", "xn--bcher-kva.de"),
    ("xn--bcher-kva.de", "xn--bcher-kva.de"),  # punycode stays punycode
    ("XN--BCHER-KVA.DE", "xn--bcher-kva.de"),
    ("www.münchen.de", "www.xn--mnchen-3ya.de"),
    ("ｅｘａｍｐｌｅ.com", "example.com"),  # full-width letters map to ASCII (UTS 46)
    ("example。com", "example.com"),  # ideographic full stop is a dot
    ("a" * 63 + ".com", "a" * 63 + ".com"),  # longest label
]


@pytest.mark.parametrize(("raw", "name"), NAMES, ids=[repr(r) for r, _ in NAMES])
def test_names_are_canonical(raw, name):
    host = parse_host(raw)
    assert host == Host(name)
    assert host.name == name and str(host) == name
    assert host.ip is None and not host.is_ip


# --------------------------------------------------------------- IP literals


IP_LITERALS = [
    # (id, raw, canonical address): every spelling inet_aton or a URL parser accepts
    ("dotted", "127.0.0.1", "127.0.0.1"),
    ("decimal-integer", "2130706433", "127.0.0.1"),
    ("hex-integer", "0x7f000001", "127.0.0.1"),
    ("hex-two-parts", "0x7f.1", "127.0.0.1"),
    ("octal-first-part", "0177.0.0.1", "127.0.0.1"),
    ("two-parts", "127.1", "127.0.0.1"),
    ("three-parts", "192.168.257", "192.168.1.1"),  # last part fills two bytes
    ("mixed-bases", "012.0x42.1.1", "10.66.1.1"),
    ("upper-hex", "0X7F.0X0.0X0.0X1", "127.0.0.1"),
    ("zero", "0", "0.0.0.0"),
    ("trailing-dot", "127.0.0.1.", "127.0.0.1"),
    ("metadata-decimal", "2852039166", "169.254.169.254"),
    ("ipv6-bracketed", "[::1]", "::1"),
    ("ipv6-bare", "::1", "::1"),
    ("ipv6-uppercase", "[2001:DB8::1]", "2001:db8::1"),
    ("ipv6-long-form", "[2001:0db8:0000:0000:0000:0000:0000:0001]", "2001:db8::1"),
    ("ipv4-mapped", "[::ffff:127.0.0.1]", "127.0.0.1"),
    ("ipv4-mapped-hex", "[::ffff:7f00:1]", "127.0.0.1"),
    ("ipv4-mapped-bare", "::ffff:169.254.169.254", "169.254.169.254"),
    ("zone-id", "[fe80::1%eth0]", "fe80::1"),
    ("zone-id-url-escaped", "[fe80::1%25eth0]", "fe80::1"),
    ("zone-id-bare", "fe80::1%eth0", "fe80::1"),
    ("nat64-stays-ipv6", "[64:ff9b::7f00:1]", "64:ff9b::7f00:1"),  # classified, not unwrapped
    # IDNA maps these to ASCII digits and dots: the result is an address, not a "name"
    ("ideographic-dots", "127。0。0。1", "127.0.0.1"),
    ("fullwidth-digits", "１２７.０.０.１", "127.0.0.1"),
]


@pytest.mark.parametrize(("raw", "address"), [c[1:] for c in IP_LITERALS], ids=[c[0] for c in IP_LITERALS])
def test_ip_literals_are_normalised(raw, address):
    host = parse_host(raw)
    assert host.is_ip
    assert host.ip == ipaddress.ip_address(address)
    assert host.name == address  # the compressed text of the address


def test_ipv4_mapped_is_the_ipv4_address():
    assert parse_host("[::ffff:10.0.0.1]") == parse_host("10.0.0.1")
    assert isinstance(parse_host("[::ffff:10.0.0.1]").ip, ipaddress.IPv4Address)


# ------------------------------------------------------------------ invalid


INVALID = [
    ("empty", "", "empty host"),
    ("blank", "   ", "empty host"),
    ("only-dot", ".", "is not a host name"),
    ("empty-label", "a..b", "not a valid host name"),
    ("leading-dot", ".example.com", "not a valid host name"),
    ("leading-hyphen", "-a.com", "not a valid host name"),
    ("trailing-hyphen", "a-.com", "not a valid host name"),
    ("space-inside", "exa mple.com", "not a valid host name"),
    ("label-too-long", "a" * 64 + ".com", "not a valid host name"),
    ("name-too-long", ("a" * 62 + ".") * 4 + "com", "longer than 253"),  # 255 characters
    ("five-parts", "1.2.3.4.5", "neither a host name nor an IPv4 address"),
    ("numeric-tld", "example.123", "neither a host name nor an IPv4 address"),
    ("hex-tld", "example.0x1", "neither a host name nor an IPv4 address"),
    ("bad-octal", "09.1.1.1", "not an octal number"),
    ("octet-too-big", "256.1.1.1", "out of range"),
    ("last-part-too-big", "1.2.3.256", "out of range"),
    ("integer-too-big", "4294967296", "out of range"),
    ("hex-part-too-big", "0x100.1", "out of range"),
    ("ipv4-in-brackets", "[127.0.0.1]", "not a valid IPv6 address"),
    ("bad-ipv6", "[::1::2]", "not a valid IPv6 address"),
    ("empty-brackets", "[]", "not a valid IPv6 address"),
    ("host-with-port", "example.com:443", "not a valid IPv6 address"),  # ports are split off first
    ("idna-numeric-tld", "a。1", "neither a host name nor an IPv4 address"),
    ("bidi-rule", "٣.com", "not a valid host name"),
    # bounded before parsing: 5000 decimal digits made int() raise ValueError (not InvalidHost)
    ("decimal-5000-digits", "1" * 5000, "longer than 256"),
    ("zero-padded-ip", "0" * 300 + "127.0.0.1", "longer than 256"),
    ("soft-hyphen-padding", "a" + "\u00ad" * 300 + ".com", "longer than 256"),  # IDNA maps U+00AD to nothing
]


@pytest.mark.parametrize(("raw", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_hosts_are_refused(raw, message):
    with pytest.raises(InvalidHost) as info:
        parse_host(raw)
    assert message in str(info.value)


# ---------------------------------------------------------------- host:port


SPLITS = [
    ("name", "example.com", None, ("example.com", None)),
    ("name-default", "example.com", 443, ("example.com", 443)),
    ("name-port", "example.com:8443", 443, ("example.com", 8443)),
    ("ipv4-port", "10.0.0.1:22", None, ("10.0.0.1", 22)),
    ("ipv6-bracket-port", "[::1]:8080", None, ("[::1]", 8080)),
    ("ipv6-bracket-default", "[::1]", 80, ("[::1]", 80)),
    ("ipv6-bare-not-a-port", "::1", 443, ("::1", 443)),
    ("ipv6-zone-port", "[fe80::1%eth0]:443", None, ("[fe80::1%eth0]", 443)),
    ("highest-port", "example.com:65535", None, ("example.com", 65535)),
]


@pytest.mark.parametrize(("authority", "default", "expected"), [c[1:] for c in SPLITS], ids=[c[0] for c in SPLITS])
def test_split_host_port(authority, default, expected):
    assert split_host_port(authority, default) == expected


BAD_SPLITS = [
    ("port-zero", "example.com:0", "not a port number"),
    ("port-too-big", "example.com:65536", "not a port number"),
    ("port-empty", "example.com:", "not a port number"),
    ("port-letters", "example.com:https", "not a port number"),
    ("port-negative", "example.com:-1", "not a port number"),
    ("port-superscript", "example.com:²", "not a port number"),  # isdigit() but int() fails
    ("port-fullwidth", "example.com:４４３", "not a port number"),
    ("unclosed-bracket", "[::1", "unclosed '['"),
    ("text-after-bracket", "[::1]x", "unexpected text after ']'"),
    # the Host header that crashed the policy guard (int() of 5000 digits raises ValueError)
    ("port-5000-digits", "example.com:" + "1" * 5000, "longer than 262"),
    ("port-six-digits", "example.com:000443", "not a port number"),
    ("port-4301-digits-bracketed", "[::1]:" + "9" * 4301, "longer than 262"),
    ("authority-too-long", "a" * 300 + ":443", "longer than 262"),
]


@pytest.mark.parametrize(("authority", "message"), [c[1:] for c in BAD_SPLITS], ids=[c[0] for c in BAD_SPLITS])
def test_split_host_port_refuses(authority, message):
    with pytest.raises(InvalidHost) as info:
        split_host_port(authority)
    assert message in str(info.value)


def test_every_text_gives_a_host_or_invalid_host_never_another_exception():
    # The guards catch InvalidHost only: any other exception from these parsers is a crash.
    texts = ["1" * n for n in (4299, 4300, 4301, 5000)] + ["x:" + "1" * 5000, "[::1]:" + "1" * 5000,
             "0x" + "f" * 5000, "0" + "7" * 5000, "1." * 3000, "\u00ad" * 5000, "%" * 5000, "[" + ":" * 5000 + "]"]
    for text in texts:
        for parse in (parse_host, split_host_port, parse_authority, parse_port):
            try:
                parse(text)
            except InvalidHost:
                pass


AUTHORITIES = [
    ("name-port", "Example.COM.:8443", (Host("example.com"), 8443)),
    ("ipv4-default", "0x7f.1", (Host("127.0.0.1", ipaddress.ip_address("127.0.0.1")), 80)),
    ("ipv6-port", "[::ffff:127.0.0.1]:22", (Host("127.0.0.1", ipaddress.ip_address("127.0.0.1")), 22)),
    ("longest-name", "a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61 + ":65535",
     (Host("a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61), 65535)),
]


@pytest.mark.parametrize(("authority", "expected"), [c[1:] for c in AUTHORITIES], ids=[c[0] for c in AUTHORITIES])
def test_parse_authority(authority, expected):
    assert parse_authority(authority, 80) == expected


def test_bounds_admit_every_valid_host():
    longest = ".".join(["a" * 63] * 3 + ["b" * 61]) + "."  # 254 characters with the trailing dot
    assert len(longest) <= MAX_HOST_TEXT and parse_host(longest).name == longest[:-1]
    assert parse_port("65535") == 65535 and parse_port("0", zero=True) == 0
    with pytest.raises(InvalidHost):
        parse_port("0")


# ------------------------------------------------------------------ parents


@pytest.mark.parametrize(("name", "parents"), [
    ("a.b.example.com", ["a.b.example.com", "b.example.com", "example.com", "com"]),
    ("example.com", ["example.com", "com"]),
    ("localhost", ["localhost"]),
], ids=["deep", "apex", "single-label"])
def test_parent_domains(name, parents):
    assert list(parent_domains(name)) == parents
