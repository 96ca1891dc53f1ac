"""What a captured connection's first bytes name: the target of the CONNECT egress makes up for it.

Real ClientHellos come from Python's own TLS stack (a MemoryBIO handshake that never leaves the
process); hostile ones are those bytes with the SNI rewritten. Whatever the bytes, the name is a
canonical host or None: never text that could add a line to the CONNECT (egress.proxy.capture).
"""

from __future__ import annotations

import ssl
import struct

import pytest

from egress.proxy.capture import claimed_name


def client_hello(server_name: str) -> bytes:
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def with_sni(hello: bytes, old: bytes, new: bytes) -> bytes:
    """``hello`` with its SNI ``old`` replaced by ``new``, every length on the way fixed."""
    at = hello.index(old)
    delta = len(new) - len(old)
    data = bytearray(hello[:at] + new + hello[at + len(old):])
    # name length (2 bytes before), server-name list length (5 before), extension length (7 before)
    for offset in (2, 5, 7):
        (value,) = struct.unpack_from("!H", data, at - offset)
        struct.pack_into("!H", data, at - offset, value + delta)
    # extensions block, handshake body (3 bytes) and record lengths
    (record,) = struct.unpack_from("!H", data, 3)
    struct.pack_into("!H", data, 3, record + delta)
    body = int.from_bytes(data[6:9], "big") + delta
    data[6:9] = body.to_bytes(3, "big")
    p = 5 + 4 + 2 + 32
    p += 1 + data[p]
    p += 2 + struct.unpack_from("!H", data, p)[0]
    p += 1 + data[p]
    (extensions,) = struct.unpack_from("!H", data, p)
    struct.pack_into("!H", data, p, extensions + delta)
    return bytes(data)


HELLO = client_hello("allowed.test")

CASES = [
    # (what, first bytes, name)
    ("a real ClientHello", HELLO, "allowed.test"),
    ("upper case SNI", with_sni(HELLO, b"allowed.test", b"ALLOWED.test"), "allowed.test"),
    ("SNI with CR LF and a second request line",
     with_sni(HELLO, b"allowed.test", b"allowed.test:443 HTTP/1.1\r\n\r\nCONNECT other.test"), None),
    ("SNI with a space", with_sni(HELLO, b"allowed.test", b"allowed.test other.test"), None),
    ("SNI with a NUL", with_sni(HELLO, b"allowed.test", b"allowed.test\0.other.test"), None),
    ("SNI with a port", with_sni(HELLO, b"allowed.test", b"allowed.test:22"), None),
    ("a ClientHello cut short", HELLO[:40], None),
    ("HTTP Host", b"GET / HTTP/1.1\r\nHost: Allowed.Test:8080\r\n\r\n", "allowed.test"),
    ("HTTP Host, IPv6 literal", b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", "::1"),
    ("HTTP Host with a space", b"GET / HTTP/1.1\r\nHost: allowed.test other.test\r\n\r\n", None),
    ("HTTP Host with a path", b"GET / HTTP/1.1\r\nHost: allowed.test/x\r\n\r\n", None),
    ("HTTP without Host", b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n", None),
    ("neither TLS nor HTTP", b"SSH-2.0-OpenSSH_9.2\r\n", None),
]


@pytest.mark.parametrize("first, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_claimed_name(first, name):
    assert claimed_name(first) == name
