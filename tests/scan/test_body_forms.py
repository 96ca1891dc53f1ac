"""Every form of a request body the README says is read, is read (issue 26, item 4): end to end
through a real `egress serve`, real clients on raw sockets, upstreams on 127.0.0.1 that keep
every byte they get (the review's P3, P18 and the split WebSocket token).

* a body in UTF-16 or UTF-32 (a byte-order mark, a charset parameter, an XML declaration, or
  the NULs such text has), buffered and streamed, read transcoded to UTF-8;
* a coded body (gzip, deflate, br, zstd) read as sent as well as decoded: the coding's own
  fields (gzip's name, comment and extra field; zstd's skippable frames; brotli's metadata)
  are skipped by decoders and read by anyone;
* a token split across a client's WebSocket messages.

Every token is made up.
"""

from __future__ import annotations

import struct
import zlib

import pytest
from conftest import DEFAULT_POLICY
from test_credentials import (
    GITHUB,
    STORED,
    WS_ACCEPT,
    RawUpstream,
    after_the_chunks,
    dechunk,
    read_all,
    tunnel,
    ws_frame,
    ws_open,
)


def gzip_with(content: bytes = b"x=1", *, name: bytes = b"", comment: bytes = b"", extra: bytes = b"") -> bytes:
    """One gzip member with these header fields (FNAME, FCOMMENT, FEXTRA): decoders skip them."""
    flags = (0x04 if extra else 0) | (0x08 if name else 0) | (0x10 if comment else 0)
    head = b"\x1f\x8b\x08" + bytes([flags]) + b"\0\0\0\0\0\xff"
    if extra:
        head += struct.pack("<H", len(extra)) + extra
    for field in (name, comment):
        if field:
            head += field.replace(b"\0", b" ") + b"\0"
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return head + deflate.compress(content) + deflate.flush() + struct.pack("<II", zlib.crc32(content), len(content))


def zstd_with_skippable(data: bytes, content: bytes = b"x=1") -> bytes:
    """A zstd skippable frame holding ``data`` (decoders skip it), then a frame of ``content``."""
    import zstandard

    return struct.pack("<II", 0x184D2A50, len(data)) + data + zstandard.ZstdCompressor().compress(content)


def brotli_with_metadata(data: bytes) -> bytes:
    """A brotli stream of one metadata meta-block holding ``data`` (1-256 bytes; decoders skip
    it) and an empty last one: it decodes to nothing. Bits, first to last: WBITS 16 (0), not
    last (0), MNIBBLES "0" (11: metadata), reserved (0), MSKIPBYTES 1 (10), MSKIPLEN-1 (8 bits),
    padding to the byte; the data; ISLAST, ISLASTEMPTY (11)."""
    n = len(data) - 1
    return bytes([0x2C | (n & 1) << 7, (n >> 1) & 0x7F]) + data + b"\x03"


@pytest.fixture
def guarded(proxy_factory):
    return proxy_factory(DEFAULT_POLICY, env={"MY_SERVICE_TOKEN": STORED})


def credential_refusals(proxy, count: int = 1) -> list[str]:
    events = proxy.wait_for_audit(lambda e: len([x for x in proxy.audit() if x["reason"] == "credential"]) >= count)
    return [e["detail"] for e in events if e["reason"] == "credential"]


# ------------------------------------------------------------ WebSocket


def test_a_token_split_across_the_clients_websocket_messages_never_leaves(guarded, test_ca):
    upstream = RawUpstream(test_ca, answer=WS_ACCEPT)
    try:
        tls = ws_open(guarded, upstream)
        assert tls.recv(4096).startswith(b"HTTP/1.1 101")
        tls.sendall(ws_frame(0x1, f"token={GITHUB[:20]}".encode()))
        tls.sendall(ws_frame(0x2, GITHUB[20:].encode()))
        answer = read_all(tls)
        assert answer[:1] == b"\x88" and answer[2:4] == (1008).to_bytes(2, "big"), answer
        assert GITHUB[20:].encode() not in upstream.received
        assert credential_refusals(guarded) == ["github-token across WebSocket messages"]
    finally:
        upstream.close()


def post(proxy, upstream, body: bytes, headers: str, chunked: bool, piece: int = 1001) -> bytes:
    """POST ``body`` through a TLS tunnel: with Content-Length (buffered by the proxy) or chunked
    in ``piece``-byte chunks (streamed); the client's answer."""
    tls = tunnel(proxy, upstream.port)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    tls.sendall(f"POST /up HTTP/1.1\r\nHost: allowed.test:{upstream.port}\r\n{headers}{framing}\r\n\r\n".encode())
    try:
        if chunked:
            for k in range(0, len(body), piece):
                tls.sendall(b"%x\r\n%s\r\n" % (len(body[k:k + piece]), body[k:k + piece]))
            tls.sendall(b"0\r\n\r\n")
        else:
            tls.sendall(body)
    except OSError:
        pass  # refused: the proxy closed the connection
    return read_all(tls)


def assert_never_left(proxy, upstream, answer: bytes, chunked: bool, detail: str, *values: bytes):
    if not chunked:  # refused before anything left, with egress's answer
        assert answer.startswith(b"HTTP/1.1 403") and b"reason=credential" in answer, answer[:300]
        assert upstream.received == b""
    for value in values:
        assert value not in upstream.received
    assert credential_refusals(proxy) == [detail]


# ------------------------------------------------------------ coded bodies, as sent


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("encoding,body", [
    ("gzip", gzip_with(comment=f"c {GITHUB}".encode())),
    ("gzip", gzip_with(name=b"notes.txt", extra=f"x {STORED} ".encode())),
    ("zstd", zstd_with_skippable(f"s {GITHUB}".encode())),
    ("br", brotli_with_metadata(f"m {GITHUB}".encode())),
], ids=["gzip-comment", "gzip-name-extra", "zstd-skippable-frame", "brotli-metadata"])
def test_a_token_in_the_codings_own_fields_never_leaves(guarded, test_ca, encoding, body, chunked):
    # These decode to "x=1" or nothing: read decoded only, they went out with the token raw.
    upstream = RawUpstream(test_ca, answer=after_the_chunks)
    try:
        answer = post(guarded, upstream, body, f"Content-Encoding: {encoding}\r\n", chunked, piece=7)
        kind = "MY_SERVICE_TOKEN" if STORED.encode() in body else "github-token"
        assert_never_left(guarded, upstream, answer, chunked, f"{kind} in the body (in its coded bytes as sent)",
                          GITHUB[:8].encode(), STORED[:8].encode())
    finally:
        upstream.close()


def test_an_ordinary_gzip_upload_still_passes_whole(guarded, test_ca):
    import gzip

    body = gzip.compress(b"".join(b"line %d of an ordinary log\n" % i for i in range(100_000)))
    upstream = RawUpstream(test_ca, answer=after_the_chunks)
    try:
        answer = post(guarded, upstream, body, "Content-Encoding: gzip\r\n", chunked=True, piece=50_000)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert dechunk(upstream.received.partition(b"\r\n\r\n")[2]) == (body, b"")
    finally:
        upstream.close()


# ------------------------------------------------------------ UTF-16 and UTF-32 text


def json_in(codec: str, value: str) -> bytes:
    return ('{"note": "' + "é" * 200 + f'", "token": "{value}"}}').encode(codec)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("body,content_type,detail", [
    (json_in("utf-16", GITHUB), "application/json; charset=utf-16", "github-token in the body (read as UTF-16LE)"),
    (json_in("utf-16-be", GITHUB), "application/json; charset=utf-16", "github-token in the body (read as UTF-16BE)"),
    (json_in("utf-32-le", GITHUB), "application/json", "github-token in the body (read as UTF-32LE)"),
    (f'<?xml version="1.0" encoding="UTF-16"?>\n<c><key>{STORED}</key></c>'.encode("utf-16"), "application/xml",
     "MY_SERVICE_TOKEN in the body (read as UTF-16LE)"),
], ids=["utf-16-bom", "utf-16be-labelled", "utf-32le-unlabelled", "xml-utf-16"])
def test_a_token_in_utf16_or_utf32_text_never_leaves(guarded, test_ca, body, content_type, detail, chunked):
    upstream = RawUpstream(test_ca, answer=after_the_chunks)
    try:
        answer = post(guarded, upstream, body, f"Content-Type: {content_type}\r\n", chunked, piece=1001)
        value = STORED if "MY_SERVICE" in detail else GITHUB
        codec = detail.split("read as ")[1][:-1].lower().replace("le", "-le").replace("be", "-be")
        assert_never_left(guarded, upstream, answer, chunked, detail, value[:8].encode(codec))
    finally:
        upstream.close()
