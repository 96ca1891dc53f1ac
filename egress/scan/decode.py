"""Decoding for the credential detector: HTTP content-encodings and the text layers
(percent, JSON string escapes, quoted-printable, base64, hex) a token can hide under.

:class:`ContentDecoder` undoes ``Content-Encoding`` (gzip, deflate, br, zstd) as a body
arrives, in bounded pieces, with a size cap and each coding's window capped
(:func:`decode_content`: all at once); anything it cannot read raises
:class:`UndecodableBody` so the caller can fail closed.

The layer functions find *segments* of a buffer that are encoded -- only where there
is evidence (``%`` + two hex digits, a ``\\u``/``\\/`` escape, a quoted-printable escape
or soft line break, a long base64 run or one whose text starts a few characters in, a long
run of hex digits) -- and return each one decoded, with a map from decoded offsets back to
the span of the encoded text in the buffer. :mod:`egress.scan.detect` scans the decoded
segments and reports findings on the encoded spans; it finds the evidence for most of them
in its one compiled pass (:data:`RUN_TRIGGERS`), and each layer here has the slower search
that pass stands in for, which the tests hold it to.
"""

from __future__ import annotations

import binascii
import re
import zlib
from bisect import bisect_right
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any, NamedTuple

__all__ = ["UndecodableBody", "WindowTooLarge", "decode_content", "ContentDecoder", "codings", "KNOWN_CODINGS", "ZSTD_MAX_WINDOW", "Segment",
           "span", "layer_segments", "basic_segment", "B64_MIN_RUN", "HEX_MIN_RUN", "WRAP_MIN", "SHIFT_MAX", "RUN_TABLE",
           "RUN_TRIGGERS", "Triggers", "run_starts", "run_start", "run_shifts", "hex_starts", "edge_hexes",
           "run_segments", "qp_segments"]


# ------------------------------------------------------------------ content-encoding


DEFAULT_LIMIT = 64 * 2**20  # decoded bytes; more is a bomb
KNOWN_CODINGS = ("identity", "gzip", "x-gzip", "deflate", "br", "zstd")


class UndecodableBody(Exception):
    """A body whose content-encoding cannot be read (unknown, corrupt, truncated or too big)."""


class WindowTooLarge(UndecodableBody):
    """A zstd frame that needs a window over ZSTD_MAX_WINDOW: valid zstd all the same, which a
    lenient client may decode (so a body sniffed as zstd is not "not compressed" for this)."""


def decode_content(data: bytes, encoding: str, limit: int = DEFAULT_LIMIT) -> bytes:
    """``data`` with the ``Content-Encoding`` header value ``encoding`` undone.

    ``encoding`` may list several codings (``"gzip, br"``: applied in that order, so
    undone in reverse). Known: identity, gzip/x-gzip, deflate (zlib or raw), br, zstd.
    Raises UndecodableBody for an unknown coding, corrupt or truncated data, trailing
    garbage, or when the output would exceed ``limit`` bytes (a decompression bomb).
    The whole-body form of :class:`ContentDecoder`.
    """
    decoder = ContentDecoder(encoding, limit)
    return b"".join([*decoder.feed(data), *decoder.finish()])


def codings(encoding: str) -> list[str]:
    """The codings a ``Content-Encoding`` value names, lower-cased, identity left out."""
    return [c for c in (c.strip().lower() for c in encoding.split(",")) if c and c != "identity"]


class ContentDecoder:
    """Undoes ``Content-Encoding`` as a body arrives, for scanning it as it streams.

    :meth:`feed` and :meth:`finish` return iterators over the decoded bytes they make
    available, in pieces of at most ``piece`` bytes, so a caller can stop -- or look at its
    time budget -- between pieces, and never holds more than a piece (plus what one
    decompressor call makes: gzip and deflate ``piece``, zstd 2 MiB, brotli up to ~16 MiB
    from 16 input bytes) in memory, besides each coding's window: deflate 32 KiB, zstd at
    most ZSTD_MAX_WINDOW (8 MiB, RFC 9659's limit: a frame that needs more is refused),
    brotli at most 16 MiB (the format's). An unknown coding raises UndecodableBody here,
    before a byte has been relayed; corrupt or truncated data, trailing garbage, a zstd
    window over the limit and more than ``limit`` decoded bytes raise it while iterating.
    """

    def __init__(self, encoding: str, limit: int = DEFAULT_LIMIT, piece: int = 2**18):
        self._stages: list[_Inflate | _Brotli | _Zstd] = []
        for coding in reversed(codings(encoding)):
            if coding in ("gzip", "x-gzip"):
                self._stages.append(_Inflate(True, piece))
            elif coding == "deflate":
                self._stages.append(_Inflate(False, piece))
            elif coding == "br":
                self._stages.append(_Brotli())
            elif coding == "zstd":
                self._stages.append(_Zstd())
            else:
                raise UndecodableBody(f"unknown content-encoding {coding!r}")
        self._limit = limit
        self._piece = piece
        self._sizes = [0] * (len(self._stages) + 1)  # bytes out of each stage so far (the last: decoded)

    @property
    def identity(self) -> bool:
        """Nothing to undo: what goes in comes out."""
        return not self._stages

    @property
    def size(self) -> int:
        """Decoded bytes produced so far."""
        return self._sizes[-1]

    def feed(self, data: bytes) -> Iterator[bytes]:
        return self._push(0, data)

    def finish(self) -> Iterator[bytes]:
        return self._close(0)

    def close(self) -> None:
        """Let go of the decompressors' windows now (a body cut off, refused, or its connection
        gone), not when the collector gets to the flow that holds this decoder. Each stage lets
        go of its own when its stream ends or fails."""
        for stage in self._stages:
            stage.close()

    def _push(self, i: int, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        if i == len(self._stages):
            yield from self._out(data)
            return
        for out in self._stages[i].feed(data):
            yield from self._through(i, out)

    def _close(self, i: int) -> Iterator[bytes]:
        if i == len(self._stages):
            return
        for out in self._stages[i].finish():
            yield from self._through(i, out)
        yield from self._close(i + 1)

    def _through(self, i: int, out: bytes) -> Iterator[bytes]:
        # every stage's output counts against the cap, not only the last one's
        self._sizes[i] += len(out)
        if self._sizes[i] > self._limit:
            raise _too_big(self._limit)
        yield from self._push(i + 1, out)

    def _out(self, data: bytes) -> Iterator[bytes]:
        self._sizes[-1] += len(data)
        if self._sizes[-1] > self._limit:
            raise _too_big(self._limit)
        piece = self._piece
        if len(data) <= piece:
            yield data
        else:
            for k in range(0, len(data), piece):
                yield data[k:k + piece]


def _too_big(limit: int) -> UndecodableBody:
    return UndecodableBody(f"decoded body exceeds {limit} bytes")


class _Inflate:
    """gzip (members one after another, zero padding after the last tolerated) or deflate
    (RFC 9110's zlib format, or raw deflate as some senders use: told apart by the header)."""

    def __init__(self, gzip: bool, piece: int):
        self.gzip = gzip
        self.piece = piece
        self.d: zlib._Decompress | None = None  # the stream (member) being inflated
        self.pending = b""  # a start too short to tell what it is
        self.started = False
        self.padding = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        data = self.pending + data
        self.pending = b""
        while data:
            if self.padding:
                if data.strip(b"\0"):
                    raise UndecodableBody("trailing garbage after gzip data")
                return
            if self.d is None:
                if len(data) < 2:
                    self.pending = data
                    return
                if self.gzip:
                    if self.started and data[:2] != b"\x1f\x8b":
                        if data[0] == 0:
                            self.padding = True
                            continue
                        raise UndecodableBody("trailing garbage after gzip data")
                    wbits = 16 + zlib.MAX_WBITS
                else:
                    if self.started:
                        raise UndecodableBody("trailing garbage after deflate data")
                    zlib_header = data[0] & 0x0F == 8 and data[0] >> 4 <= 7 and (data[0] << 8 | data[1]) % 31 == 0
                    wbits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
                self.d = zlib.decompressobj(wbits)
                self.started = True
            d = self.d
            while True:  # max_length keeps each piece small; drain what the input holds
                try:
                    out = d.decompress(data, self.piece)
                except zlib.error as e:
                    raise UndecodableBody(f"corrupt data: {e}") from None
                if out:
                    yield out
                if d.eof:
                    data = d.unused_data
                    self.d = None
                    break
                data = d.unconsumed_tail
                if not data and len(out) < self.piece:
                    break

    def finish(self) -> Iterator[bytes]:
        if self.pending or (self.d is not None):
            raise UndecodableBody("truncated data")
        return iter(())

    def close(self) -> None:
        self.d = None


class _Brotli:
    # brotli's Decompressor has no output cap (one input byte can finish an 8 MiB block):
    # feed 16 bytes at a time so that one call cannot make much more than that. Its window is
    # the stream's own, at most 16 MiB by the format (RFC 7932; this module's decoder reads no
    # large-window streams): a stream that runs long holds a ring buffer that size (and what one
    # call makes: bench/README.md, Scanner), let go as soon as the stream ends or fails.
    STEP = 16

    def __init__(self) -> None:
        try:
            import brotli
        except ImportError:  # pragma: no cover - mitmproxy depends on it
            raise UndecodableBody("br: the brotli module is not installed") from None
        self.error = brotli.error
        self.d: Any = brotli.Decompressor()  # brotli has no types
        self.started = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        self.started = True
        process, step = self.d.process, self.STEP
        try:
            for pos in range(0, len(data), step):
                out = process(data[pos:pos + step])
                if out:
                    yield out
        except self.error as e:
            self.close()
            raise UndecodableBody(f"corrupt data: {e}") from None

    def finish(self) -> Iterator[bytes]:
        finished = not self.started or self.d.is_finished()
        self.close()
        if not finished:
            raise UndecodableBody("truncated data")
        return iter(())

    def close(self) -> None:
        self.d = None


class _Zstd:
    # One input byte can finish a 128 KiB block, and the smallest block (RLE) is 4 bytes: 64
    # bytes at a time make at most 2 MiB a call. The window is capped at ZSTD_MAX_WINDOW, as
    # RFC 9659 caps it for the HTTP content coding: a frame that asks for more is refused
    # before a byte of it is decoded (a 64 MiB window pinned its 64 MiB per upload; red team
    # P9), and the decoder's buffers are let go as soon as the body ends or fails.
    STEP = 64

    def __init__(self) -> None:
        try:
            import zstandard
        except ImportError:
            raise UndecodableBody("zstd: the zstandard module is not installed") from None
        self.error = zstandard.ZstdError
        self.parameters = zstandard.get_frame_parameters
        self.decompressor: zstandard.ZstdDecompressor | None = zstandard.ZstdDecompressor(
            max_window_size=ZSTD_MAX_WINDOW)
        self.d: zstandard.ZstdDecompressionObj | None = None
        self.head = b""  # the first bytes of the frame being decoded: its header, for a refusal's reason

    def feed(self, data: bytes) -> Iterator[bytes]:
        step = self.STEP
        pos = 0
        while pos < len(data):
            if self.d is None:  # frames one after another, as mitmproxy reads them
                assert self.decompressor is not None  # a closed decoder is fed no more
                self.d = self.decompressor.decompressobj()
                self.head = b""
            piece = data[pos:pos + step]
            if len(self.head) < _ZSTD_HEADER_MAX:
                self.head += piece[:_ZSTD_HEADER_MAX - len(self.head)]
            try:
                out = self.d.decompress(piece)
            except self.error as e:
                raise self._unreadable(e) from None
            pos += step
            if out:
                yield out
            if self.d.eof:
                rest = self.d.unused_data
                self.d = None
                if rest:
                    yield from self.feed(rest)

    def _unreadable(self, error: Exception) -> UndecodableBody:
        try:
            window = self.parameters(self.head).window_size
        except Exception:  # not even a frame header: corrupt
            window = 0
        self.close()
        if window > ZSTD_MAX_WINDOW:
            return WindowTooLarge(f"a zstd window of {window >> 20} MiB, over the {ZSTD_MAX_WINDOW >> 20} MiB "
                                  f"RFC 9659 allows the zstd content coding")
        return UndecodableBody(f"corrupt data: {error}")

    def finish(self) -> Iterator[bytes]:
        truncated = self.d is not None
        self.close()
        if truncated:
            raise UndecodableBody("truncated data")
        return iter(())

    def close(self) -> None:
        self.decompressor = self.d = None


ZSTD_MAX_WINDOW = 8 * 2**20
_ZSTD_HEADER_MAX = 18  # a frame header's largest size (RFC 8878 3.1.1)


# ------------------------------------------------------------------------- layers

# A segment of a buffer, decoded: (decoded bytes, mapper, arg). ``span(segment, ds, de)``
# maps a decoded span back to the encoded span in the buffer it came from. Plain tuples:
# near-miss data makes one per ~80 bytes, and a NamedTuple costs twice as much to build.
Segment = tuple[bytes, Callable[[Any, int, int], tuple[int, int]], Any]  # (decoded, mapper, arg)


def span(segment: Segment, s: int, e: int) -> tuple[int, int]:
    """The encoded span in the scanned buffer that carries ``segment``'s decoded [s, e)."""
    return segment[1](segment[2], s, e)


B64_MIN_RUN = 20  # base64 runs shorter than this are decoded only after "Basic "
HEX_MIN_RUN = 32  # hex runs: 16 decoded bytes

_JSON_ESCAPE = re.compile(rb'\\(?:u([dD][89abAB][0-9A-Fa-f]{2})\\u([dD][c-fC-F][0-9A-Fa-f]{2})'  # a surrogate pair
                          rb'|u([0-9A-Fa-f]{4})|(["\\\\/bfnrt]))')
_JSON_SIMPLE = {b'"': b'"', b"\\": b"\\", b"/": b"/", b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t"}
# An escaped segment reaches out to these (never past the previous segment). A percent
# segment is a run of URL/form text; a JSON one is a whole member, `"key": "value"`, so
# that a value keeps its key as context (`"SecretAccessKey": "…\/…"`).
#
# _PCT_SEGMENT and _JSON_SEGMENT match the evidence (``%`` + two hex digits; a ``\\u``
# or ``\\/`` escape) and the rest of the segment to its right in one call: up to the
# first delimiter, or for JSON the first quote not after a backslash or a line break
# (what ``(?<!\\)"|[\r\n]`` finds: a pattern that starts with a look-behind is tried at
# every byte, where ``[^"\r\n]*`` runs in a tight loop).
_JSON_RIGHT = rb'[^"\r\n]*(?:(?<=\\)"[^"\r\n]*)*'
_PCT_SEGMENT = re.compile(rb"%[0-9A-Fa-f]{2}[^ \t\r\n\"'<>]*")
_JSON_SEGMENT = re.compile(rb"\\(?:u[0-9A-Fa-f]{4}|/)" + _JSON_RIGHT)


def _json_right(buf: bytes, pos: int, _right: Callable[[bytes, int], re.Match[bytes] | None]
                = re.compile(_JSON_RIGHT).match) -> int:
    """Where a JSON segment whose evidence ends at ``pos`` ends (for the tests: _JSON_SEGMENT
    matches it with the evidence)."""
    return _right(buf, pos).end()  # type: ignore[union-attr]  # (a pattern that matches nothing too)


_HEX_BYTE = {bytes(f"{i:02x}".encode()): bytes([i]) for i in range(256)}
_HEX_BYTE.update({bytes([a, b]): v for k, v in list(_HEX_BYTE.items())
                  for a in {k[0], ord(chr(k[0]).upper())} for b in {k[1], ord(chr(k[1]).upper())}})

# Base64/hex runs are found on a translated copy of the buffer (run characters -> "a",
# the rest -> " "), where a literal search for "a" * B64_MIN_RUN does what a character
# class regex would do at a third of the speed.
_RUN_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-"
RUN_TABLE = bytes(ord("a") if c in _RUN_CHARS else ord(" ") for c in range(256))
_RUN = re.compile(b"a" * B64_MIN_RUN + b"a*")
_ANY_RUN_RAW = re.compile(rb"[A-Za-z0-9+/_\-]+")
_URLSAFE_TO_STD = bytes.maketrans(b"-_", b"+/")
_HEX_CHARS = b"0123456789abcdefABCDEF"
# Wrapped base64 (``base64 -w W``, PEM 64, MIME 76, YAML block scalars): lines of one
# width W joined by one line break (raw or JSON-escaped) and the same indentation. W is
# at least WRAP_MIN: a whole line of 16+ run characters over another is base64, a list of
# ids or a hex dump, never prose. (16, not more: `base64 -w 16..39` got a token out, each
# line decoded alone; red-team pass.)
WRAP_MIN = 16
_BREAK = re.compile(rb"(?:\r?\n|\\r\\n|\\n)[ \t]*")  # a line break and the next line's indentation
_BREAK_FIRST = frozenset(b"\r\n\\")


# A decoded escape: (dec_start, dec_end, raw_start, raw_end); the text around escapes is copied 1:1.
Piece = tuple[int, int, int, int]
Decode = Callable[[bytes, int, bool], tuple[bytes, list[Piece]]]  # (raw, raw_start, want_pieces)
DecodeAll = Callable[[list[bytes]], list[bytes] | None]


def _linear_point(pieces: list[Piece], dec_starts: list[int], d: int, end: bool) -> int:
    i = bisect_right(dec_starts, d - 1 if end else d) - 1
    if i < 0:
        return pieces[0][2] - (pieces[0][0] - d)
    ds, de, rs, re_ = pieces[i]
    if d < de or (end and d == de):
        return re_ if end else rs
    return re_ + (d - de)


class _Escaped:
    """The map back for the segments one call of _escape_segments found: segment ``i`` was
    decoded from buf[los[i]:his[i]] escape by escape. Its pieces -- (dec_start, dec_end,
    raw_start, raw_end) of each escape, in order, the text around them copied 1:1 -- are
    worked out when a finding is mapped, and kept. (A segment is then one tuple with an
    index, not a list and a tuple more: a clean scan makes thousands.)"""

    __slots__ = ("buf", "los", "his", "decode", "pieces")

    def __init__(self, buf: bytes, los: list[int], his: list[int], decode: Decode):
        self.buf, self.los, self.his, self.decode = buf, los, his, decode
        self.pieces: dict[int, tuple[list[Piece], list[int]]] = {}

    def span(self, i: int, s: int, e: int) -> tuple[int, int]:
        known = self.pieces.get(i)
        if known is None:
            lo = self.los[i]
            pieces = self.decode(self.buf[lo:self.his[i]], lo, True)[1]
            known = self.pieces[i] = (pieces, [p[0] for p in pieces])
        pieces, dec_starts = known
        return _linear_point(pieces, dec_starts, s, False), _linear_point(pieces, dec_starts, e, True)


def _marks(chars: bytes) -> bytes:
    """A translate table that maps ``chars`` to ``|`` and everything else to ``.``."""
    return bytes(ord("|") if c in chars else ord(".") for c in range(256))


_PCT_MARKS = _marks(b" \t\r\n\"'<>")
_JSON_MARKS = _marks(b"{[,\r\n")


def _far_left_edge(buf: bytes, floor: int, hi: int, marks: bytes) -> int:
    """The position after the last delimiter (per ``marks``) in buf[floor:hi], or floor,
    512 bytes at a time."""
    while hi > floor:
        lo = max(floor, hi - 512)
        k = buf[lo:hi].translate(marks).rfind(b"|")
        if k >= 0:
            return lo + k + 1
        hi = lo
    return floor


# Between segments decoded together: no escape contains it, and in both layers a decoded
# NUL comes only from an escape ("%00", "\u0000"), which the count before splitting sees.
_JOIN = b"\0"


def _escape_segments(buf: bytes, lead: bytes | None, segment: re.Pattern[bytes], marks: bytes, decode: Decode,
                     decode_all: DecodeAll, start: int = 0) -> list[Segment]:
    """Segments around the evidence that ``segment`` matches, with the rest of the segment
    to its right; on the left, out to the last delimiter (per ``marks``) before it, never
    into the segment before. ``lead``: the byte the evidence starts with, where it is rare
    in text (``%``), so that ``find`` (memchr) gets to the next one faster than the regex
    engine's search; None: ``finditer`` from ``start`` (JSON's backslashes come close
    together, and a Python step per search cost more; quoted-printable's first evidence is
    found by the compiled pass). Decoded all at once by ``decode_all(raws)``, or if
    it returns None one by one by ``decode(raw, raw_start, pieces) -> (bytes, pieces)``.
    The map back (which needs the pieces) is only worked out for a segment something is
    found in."""
    los: list[int] = []  # two lists of ints, not a tuple per segment (see _Escaped)
    his: list[int] = []
    floor = 0
    if lead is None:
        matches = segment.finditer(buf, start)
    else:
        matches = _led(buf, lead, segment.search)
    for m in matches:
        first, hi = m.span()
        # the delimiter is looked for in the 64 bytes before first (a JSON member's key is near)
        lo = first - 64 if first - 64 > floor else floor
        k = buf[lo:first].translate(marks).rfind(b"|")
        if k >= 0:
            lo += k + 1
        elif lo > floor:
            lo = _far_left_edge(buf, floor, lo, marks)
        los.append(lo)
        his.append(hi)
        floor = hi
    if not los:
        return []
    raws = list(map(buf.__getitem__, map(slice, los, his)))
    decoded = decode_all(raws) if len(raws) > 1 else None  # (a header or URL: one segment)
    if decoded is None:
        decoded = [decode(raw, 0, False)[0] for raw in raws]
    back = _Escaped(buf, los, his, decode).span
    return [(text, back, i) for i, text in enumerate(decoded)]


def _led(buf: bytes, lead: bytes, search: Callable[[bytes, int], re.Match[bytes] | None]
         ) -> Iterator[re.Match[bytes]]:
    """What ``finditer`` yields, each search started at the next ``lead`` byte."""
    floor = 0
    find = buf.find
    while (k := find(lead, floor)) >= 0 and (m := search(buf, k)) is not None:
        yield m
        floor = m.end()


def _percent_decode(raw: bytes, base: int, want_pieces: bool) -> tuple[bytes, list[Piece]]:
    parts = raw.split(b"%")
    out = [parts[0]]
    pieces: list[Piece] = []
    hexbyte = _HEX_BYTE
    if not want_pieces:
        for part in parts[1:]:
            b = hexbyte.get(part[:2])
            if b is None:
                out.append(b"%" + part)
            else:
                out.append(b)
                out.append(part[2:])
        return b"".join(out), pieces
    d = len(parts[0])
    r = base + len(parts[0])
    for part in parts[1:]:
        b = hexbyte.get(part[:2])
        if b is None:
            out.append(b"%")
            out.append(part)
            d += 1 + len(part)
            r += 1 + len(part)
            continue
        out.append(b)
        out.append(part[2:])
        pieces.append((d, d + 1, r, r + 3))
        d += 1 + len(part) - 2
        r += 1 + len(part)
    return b"".join(out), pieces


_JSON_SIMPLE_ORDER = tuple((b"\\" + k, v) for k, v in _JSON_SIMPLE.items() if k != b"\\")


def _json_decode(raw: bytes, base: int, want_pieces: bool) -> tuple[bytes, list[Piece]]:
    if not want_pieces and _JSON_HARD(raw) is None:
        return _json_simple(raw), []
    out = []
    pieces = []
    last = 0
    d = 0
    for m in _JSON_ESCAPE.finditer(raw):
        text = raw[last:m.start()]
        out.append(text)
        d += len(text)
        hi, lo, unit, simple = m.groups()
        if simple is not None:
            b = _JSON_SIMPLE[simple]
        elif unit is not None:
            b = chr(int(unit, 16)).encode("utf-8", "surrogatepass")
        else:
            b = (chr(0x10000 + ((int(hi, 16) - 0xD800) << 10) + int(lo, 16) - 0xDC00)).encode("utf-8")
        out.append(b)
        pieces.append((d, d + len(b), base + m.start(), base + m.end()))
        d += len(b)
        last = m.end()
    out.append(raw[last:])
    return b"".join(out), pieces


def _percent_decode_all(raws: list[bytes]) -> list[bytes] | None:
    """_percent_decode of each of ``raws``, as one buffer (a Python step per escape, not per
    segment), or None if a raw holds a NUL or one decodes to it (decoding never removes one)."""
    joined = _JOIN.join(raws)
    # A space cannot be part of another escape, so decoding "%20" first changes nothing
    # else, and it is most of them (form and query text).
    joined = joined.replace(b"%20", b" ")
    if b"%" in joined:
        joined = _percent_decode(joined, 0, False)[0]
    return joined.split(_JOIN) if joined.count(_JOIN) == len(raws) - 1 else None


_Q_WORD = re.compile(rb"=\?[^?\s]+\?[Qq]\?[^?\s]*\?=")


def _q_words(raw: bytes) -> bytes:
    """``raw`` with the "_" of each MIME Q word (``=?utf-8?Q?...?=``) read as the space it
    stands for (one byte for one: the map back holds)."""
    return _Q_WORD.sub(lambda m: m.group().replace(b"_", b" "), raw)


def _qp_decode(raw: bytes, base: int, want_pieces: bool) -> tuple[bytes, list[Piece]]:
    """Quoted-printable: "=XX" escapes undone (either case, as decoders take them), soft line
    breaks ("=" and CRLF or LF) dropped, any other "=" kept; in a MIME Q word "_" is a space.
    A soft break is a piece that decodes to nothing."""
    if b"?Q?" in raw or b"?q?" in raw:
        raw = _q_words(raw)
    parts = raw.split(b"=")
    out = [parts[0]]
    pieces: list[Piece] = []
    hexbyte = _HEX_BYTE
    if not want_pieces:
        for part in parts[1:]:
            b = hexbyte.get(part[:2])
            if b is not None:
                out.append(b)
                out.append(part[2:])
            elif part[:1] == b"\n":
                out.append(part[1:])
            elif part[:2] == b"\r\n":
                out.append(part[2:])
            else:
                out.append(b"=")
                out.append(part)
        return b"".join(out), pieces
    d = len(parts[0])
    r = base + len(parts[0])
    for part in parts[1:]:
        b = hexbyte.get(part[:2])
        if b is not None:
            out.append(b)
            out.append(part[2:])
            pieces.append((d, d + 1, r, r + 3))
            d += len(part) - 1
        else:
            k = 1 if part[:1] == b"\n" else 2 if part[:2] == b"\r\n" else 0
            if k:
                out.append(part[k:])
                pieces.append((d, d, r, r + 1 + k))
                d += len(part) - k
            else:
                out.append(b"=")
                out.append(part)
                d += 1 + len(part)
        r += 1 + len(part)
    return b"".join(out), pieces


def _qp_decode_all(raws: list[bytes]) -> list[bytes] | None:
    """_qp_decode of each of ``raws``, as one buffer, or None if one holds a NUL or decodes
    to one (as _percent_decode_all)."""
    joined = _qp_decode(_JOIN.join(raws), 0, False)[0]
    return joined.split(_JOIN) if joined.count(_JOIN) == len(raws) - 1 else None


def _json_simple(raw: bytes) -> bytes:
    """``raw`` decoded when every backslash in it starts a one-character escape (no
    ``\\u``, no ``\\\\``): plain replaces do it. ("\\/" alone, from PHP-style encoders, is
    the common case; it and "\\"" go first: a replace is cheap where a backslash is common,
    ``in`` a memchr where it is not.)"""
    raw = raw.replace(b"\\/", b"/")
    if b"\\" in raw:
        raw = raw.replace(b'\\"', b'"')
        if b"\\" in raw:
            for escape, char in _JSON_SIMPLE_ORDER:
                raw = raw.replace(escape, char)
    return raw


_JSON_HARD = re.compile(rb"\\[u\\]").search  # one search, not two "in": half the time


def _json_decode_all(raws: list[bytes]) -> list[bytes] | None:
    """_json_decode of each of ``raws`` when all are one-character escapes (_json_simple on
    all of them at once), else None."""
    joined = _JOIN.join(raws)
    if _JSON_HARD(joined) is not None or joined.count(_JOIN) != len(raws) - 1:
        return None
    return _json_simple(joined).split(_JOIN)


def _b64_span(line: tuple[int, int], s: int, e: int) -> tuple[int, int]:
    """Map for one base64 run buf[line[0]:line[1]]: a decoded span maps to the characters
    that carry its bits."""
    a, b = line
    return a + s * 4 // 3, min(b, a + -(-e * 4 // 3))


def _wrapped_span(arg: tuple[bytes, int, int, bytes, int], s: int, e: int) -> tuple[int, int]:
    """Map for a wrapped base64 text, buf[start:end] with its line breaks (``gap``) left
    out and decoded from character ``phase`` on: the characters that carry a decoded span's
    bits, which may be on several lines. (The lines are worked out here: only for a text
    something was found in.)"""
    buf, start, end, gap, phase = arg
    cs, ce = phase + s * 4 // 3, phase + -(-e * 4 // 3)
    lengths = [len(line) for line in buf[start:end].split(gap)]
    offsets = list(accumulate(lengths, initial=0))
    i = min(bisect_right(offsets, cs) - 1, len(lengths) - 1)
    j = min(bisect_right(offsets, ce - 1) - 1, len(lengths) - 1)
    g = len(gap)
    return (start + offsets[i] + i * g + cs - offsets[i],
            start + offsets[j] + j * g + min(lengths[j], ce - offsets[j]))


_PADDING = (b"", b"", b"==", b"=")


def _b64_decode(text: bytes) -> bytes | None:
    """Standard or URL-safe base64, padded or not; None if it does not decode."""
    if b"-" in text or b"_" in text:
        text = text.translate(_URLSAFE_TO_STD)
    n = len(text) % 4
    if n:
        text = text.rstrip(b"=")
        n = len(text) % 4
        text = text[:-1] if n == 1 else text + _PADDING[n]
    try:
        # strict: faster a character (bench/README.md, Scanner); what it turns down (padding
        # inside, or too much) is decoded as before
        return binascii.a2b_base64(text, strict_mode=True)
    except binascii.Error:
        pass
    try:
        return binascii.a2b_base64(text)
    except binascii.Error:
        return None


def _mixed_case(run: bytes) -> bool:
    return not run.islower() and not run.isupper()


def run_starts(buf: bytes) -> list[int]:
    """Where each run of B64_MIN_RUN or more run characters in ``buf`` starts, and each line
    of WRAP_MIN or more after a line of WRAP_MIN to B64_MIN_RUN - 1 (wrapped base64). What
    :data:`RUN_TRIGGERS` stand in for: the detector finds the runs that matter with those
    in its one compiled pass, and the tests check it against this."""
    return sorted([m.start() for m in _RUN.finditer(buf.translate(RUN_TABLE))] + [m.end() for m in _SHORT_LINES.finditer(buf)])


def run_start(buf: bytes, end: int) -> int:
    """The start of the run of run characters that holds ``buf[end - 1]``."""
    hi = end
    while hi > 0:
        lo = max(0, hi - 4096)
        r = buf[lo:hi].translate(RUN_TABLE).rfind(b" ")
        if r >= 0:
            return lo + r + 1
        hi = lo
    return 0


# Base64 out of phase: a run whose base64 starts 1 to SHIFT_MAX characters in, after a prefix
# a receiver drops (`v1-`, `x`, `ab`, `sha256-`; red team P2), decodes to garbage from the
# run's first character. Where the text it encodes starts, its characters say so: an ASCII
# byte needs the top bit of its 8 to be 0, so in each group of 4 base64 characters that
# carries 3 ASCII bytes the 1st is under 32 (A-Z, a-f), the 2nd has its bit 3 clear and the
# 3rd its bit 1 (_ASCII_QUAD). 5 such groups (15 ASCII bytes) 1-15 characters into a
# mixed-case run, at a phase other than the run's own: the run is decoded from that phase
# too. (2^-15 a position in random base64: an image run is decoded again ~once in 3,000.)
# Looked for by run_segments in each mixed-case run it is given: a look-ahead in the regex it
# matches a run with anyway (_RUN_AT) sees whether groups 4 and 5 of any phase are ASCII, as
# they are if 5 groups start 1-15 characters in (~5% of random runs); only then the exact
# test (run_shifts): cheaper than a Hyperscan trigger, a regex call of its own or every phase
# of every run decoded (bench/README.md, Scanner).
SHIFT_MAX = 15
_B64_VALUES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"  # 62, 63 (+/ -_) fit no slot


def _b64_class(fits: Callable[[int], bool]) -> bytes:
    return b"[" + bytes(c for v, c in enumerate(_B64_VALUES) if fits(v)) + b"]"


_ASCII_QUAD = (_b64_class(lambda v: v < 32) + _b64_class(lambda v: not v & 8) + _b64_class(lambda v: not v & 2)
               + rb"[A-Za-z0-9+/_\-]")
_ASCII_QUADS = b"(?:" + _ASCII_QUAD + b"){5}"
# A run, and (group 1 set) whether it may hold shifted base64: groups 4 and 5 of phase 1, 2
# or 3 (at 13 + phase and 17 + phase) ASCII.
_RUN_AT = re.compile(rb"(?:(?=[A-Za-z0-9+/_\-]{13}[A-Za-z0-9+/_\-]{0,2}" + _ASCII_QUAD + _ASCII_QUAD + rb")())?"
                     rb"[A-Za-z0-9+/_\-]+").match
_SHIFTED_AT = [(shift, re.compile(rb"[A-Za-z0-9+/_\-]{%d}(?:[A-Za-z0-9+/_\-]{4}){0,%d}" % (shift, (SHIFT_MAX - shift) // 4)
                                   + _ASCII_QUADS).match) for shift in (1, 2, 3)]


def run_shifts(buf: bytes, s: int) -> list[int]:
    """The phases (1-3) other than its own at which the run that starts at ``s`` holds
    base64 of text 1 to SHIFT_MAX characters in."""
    return [shift for shift, at in _SHIFTED_AT if at(buf, s)]


# Quoted-printable (RFC 2045 6.7; MIME's Q words, RFC 2047 4.2): "=XX" escapes, and soft line
# breaks -- "=" at a line's end joins the next line to it. An encoder escapes "=", bytes over
# 126 and spaces at a line's end, never a letter; a token's characters escaped, or a token
# broken over two lines, are what hides one. The evidence, found in the compiled pass
# (:data:`RUN_TRIGGERS`): an escape of a printable character glued to a run character or
# another escape after it, or to 12 run characters before it (a token's last character
# escaped; a form's "per_page=50" has a shorter name), or "=" at a line's end after anything
# but "=" (base64 padding). A segment is a run of text around it, as a percent one, that goes
# on over soft breaks. The compiled pass reports only the first evidence of each kind
# (Hyperscan's single-match flag: a report is a Python call, and "=41=42=43..." made one per
# escape; bench/README.md, Scanner); the segments are found from there by one regex, evidence
# and the rest of its segment in one match, as JSON's are.
_QP_SEGMENT = re.compile(rb"=(?:[2-7][0-9A-Fa-f](?=[A-Za-z0-9+/_\-=])|(?<=[A-Za-z0-9+/_\-]{12}=)[2-7][0-9A-Fa-f]"
                         rb"|(?<=[^=]=)\r?\n)[^ \t\r\n\"'<>=]*(?:=(?:\r?\n)?[^ \t\r\n\"'<>=]*)*")


class Triggers(NamedTuple):
    """Where the layers have work, as the compiled pass found it (:data:`RUN_TRIGGERS`, by
    kind): run starts (``run``), hex that may decode (``hex``: where its ASCII pairs start)
    and quoted-printable evidence (``qp``: the first of each kind); unsorted, perhaps
    repeated."""

    runs: list[int]
    hexes: list[int]
    qp: list[int]


# Hyperscan expressions (see egress.scan.multimatch) that between them match wherever the layers
# have work -- at the start of every run that run_segments does something with, once per
# run, and never on the runs that make up most text (lower-case hex digests, UUIDs, paths),
# so that a clean buffer costs no Python step per run:
#   * the first 20 characters hold an upper-case letter (mixed-case base64, or upper case);
#   * the first upper-case letter comes later (reported at it, so its start is looked up);
#   * hex: 16 hex pairs that are ASCII bytes (HEX_PAIRS), starting at the first or second
#     digit of a run of hex digits, where that run of digits starts a run, or follows a
#     character that is no hex digit in a run with no upper-case letter before it
#     (`/upload/<hex>`, `v1-<hex>`, `req_<HEX>`), or follows "-", "_" or "0x" in any run
#     (reported where the pairs start; hex_starts is the reference);
#   * a line of WRAP_MIN+ after a whole line of WRAP_MIN to 19 (base64 wrapped that short);
#   * quoted-printable evidence (the first of each kind, reported at its "="; _QP_SEGMENT).
# A run of digits and +/_- only is left alone: such base64 decodes to a byte over 0xCF in
# every 3, so never to 3 ASCII bytes in a row.
# Each is (expression, kind, distance from the match's end back to what it reports; for a
# run, 0: unknown, look its start up). Those that start with _NOT_R leave out a run at the
# very start of the buffer (Hyperscan ran them slower with "^|"): the caller adds position 0,
# and the hex of that run (edge_hexes), when a run starts there.
#
# Each was weighed against other forms (several as one expression, one per position of the
# upper-case letter, a trigger where a run ends, every line after a break reported) and is the
# cheapest found for what it finds (the figures: bench/README.md, Scanner, "Run triggers in
# other forms"). Hex (issue 26, red team P1) could hide anywhere in a run, but an expression
# that may start inside any run wakes on every byte of a base64 image, where the others sleep
# until its run ends (Hyperscan skips ahead to a byte that can wake them): so hex after a
# non-hex character is looked for only in a run whose earlier part has no upper case (its
# prefix cannot go on far in base64), and after "-", "_" or "0x", which standard base64 holds
# no or few of, in any run. The digits-only run trigger it replaced is needless: see below.
# The QP evidence sleeps the same way. These costs do not add up: Hyperscan builds its engines
# for the set (so the shifted-base64 test is a regex look-ahead in run_segments, _RUN_AT).
_R = rb"[A-Za-z0-9+/_\-]"
_NOT_R = rb"[^A-Za-z0-9+/_\-]"
_RUN_EDGE = rb"(?:^|[^A-Za-z0-9+/_\-])"
_NOT_UPPER = rb"[a-z0-9+/_\-]"
_LINE_BREAK = rb"(?:\r?\n|(?:\\r)?\\n)[ \t]*"  # _BREAK
_HEX_PAIRS = rb"(?:[0-7][0-9a-fA-F]){%d}" % (HEX_MIN_RUN // 2)  # ASCII bytes in hex


def _times(chars: bytes, n: int) -> bytes:
    return chars + b"{%d}" % n if n else b""  # Hyperscan refuses {0}


RUN_TRIGGERS: tuple[tuple[bytes, str, int], ...] = (
    (_NOT_R + b"(?:" + b"|".join(_times(_NOT_UPPER, k) + b"[A-Z]" + _times(_R, B64_MIN_RUN - 1 - k)
                                 for k in range(B64_MIN_RUN)) + b")", "run", B64_MIN_RUN),
    (_NOT_R + _NOT_UPPER + b"{%d,}[A-Z]" % B64_MIN_RUN, "run", 0),
    (_NOT_R + rb"(?:[a-z0-9+/_\-]*[g-z+/_\-])?[0-9a-fA-F]?" + _HEX_PAIRS, "hex", HEX_MIN_RUN),
    (rb"[\-_][0-9a-fA-F]?" + _HEX_PAIRS, "hex", HEX_MIN_RUN),
    (rb"0[xX][0-9a-fA-F]?" + _HEX_PAIRS, "hex", HEX_MIN_RUN),
    # base64 wrapped at 16-19 characters, whose lines are too short for the others: the
    # start of each line after such a line (run_segments joins the lines before it)
    (_RUN_EDGE + _R + b"{%d,%d}" % (WRAP_MIN, B64_MIN_RUN - 1) + _LINE_BREAK + _R + b"{%d}" % WRAP_MIN, "run", WRAP_MIN),
    (rb"=[2-7][0-9A-Fa-f][A-Za-z0-9+/_\-=]", "qp", 4),
    (_R + rb"{12}=[2-7][0-9A-Fa-f]", "qp", 3),
    (rb"[^=]=\n", "qp", 2),
    (rb"[^=]=\r\n", "qp", 3),
)
# run_starts' form of the wrapped-line trigger
_SHORT_LINES = re.compile(rb"(?:^|(?<=[^A-Za-z0-9+/_\-]))" + _R + b"{%d,%d}" % (WRAP_MIN, B64_MIN_RUN - 1) + _LINE_BREAK
                          + b"(?=" + _R + b"{%d})" % WRAP_MIN)
_LETTERLESS = b"0123456789+/_-"


def run_segments(buf: bytes, starts: list[int] | None = None, hexes: list[int] | None = None) -> list[Segment]:
    """Base64 runs (mixed case, at least B64_MIN_RUN characters; the lines of a wrapped
    base64 text are joined, see _wrapped; decoded also from a phase where text starts a few
    characters in, see run_shifts) and hex in runs (_hex_candidate), decoded. ``starts``:
    where runs start, at least every one that decodes (:data:`RUN_TRIGGERS`); by default
    every run (:func:`run_starts`). ``hexes``: where the hex triggers found ASCII pairs start
    (those that want a character before the run miss the run at position 0, a start: its
    hex is looked for here, :func:`edge_hexes`); by default :func:`hex_starts`."""
    out: list[Segment] = []
    n = len(buf)
    run_at = _RUN_AT
    pos = 0
    for s in run_starts(buf) if starts is None else sorted(set(starts)):
        if s < pos:
            continue  # a line already joined to the run before
        m = run_at(buf, s)
        if m is None:
            continue
        e = m.end()
        if e - s < WRAP_MIN:
            continue
        if s == 0 and hexes is not None and e >= HEX_MIN_RUN:
            hexes = hexes + edge_hexes(buf)
        run = buf[s:e]
        if run.islower() or run.isupper() or not run.strip(_HEX_CHARS) or not run.strip(_LETTERLESS):
            continue  # UUIDs, digests, words, slugs, numbers: not base64
        if m.lastindex:
            shifts = run_shifts(buf, s)
            if shifts:
                _b64_shifted(buf, s, e, shifts, out)
        if e < n and buf[e] in _BREAK_FIRST:
            # a line of a wrapped text? (after a JSON "\n" the run starts at the "n")
            wrapped = _wrapped(buf, s + 1 if buf[s] == 0x6E and s and buf[s - 1] == 0x5C else s, e, pos)
            if wrapped is not None:
                start, end, gap, pos = wrapped
                _b64_wrapped(buf, start, end, gap, out)
                continue
        if e - s < B64_MIN_RUN:
            continue
        pos = e
        while e < n and buf[e] == 0x3D and e - pos < 2:  # "=" padding
            e += 1
        _b64_candidate(buf, s, e, out)
        if b"/" in run and len(run) < 256:
            # a URL path: a component may be base64 on its own
            offset = s
            for part in run.split(b"/"):
                if 16 <= len(part) < len(run) and _mixed_case(part):
                    _b64_candidate(buf, offset, offset + len(part), out)
                offset += len(part) + 1
    last = -1
    for q in hex_starts(buf) if hexes is None else sorted(set(hexes)) if hexes else ():
        a = q - 1 if q and buf[q - 1] in _HEX_CHARS else q  # the first digit of the run of them
        if a > last:
            last = a
            _hex_candidate(buf, a, _HEX_DIGITS_AT(buf, a).end(), out)  # type: ignore[union-attr]  # [...]* matches
    return out


def _b64_shifted(buf: bytes, s: int, e: int, shifts: list[int], out: list[Segment]) -> None:
    """The run buf[s:e] decoded from each of ``shifts`` (its own "=" padding taken)."""
    n = len(buf)
    end = e
    while end < n and buf[end] == 0x3D and end - e < 2:
        end += 1
    for shift in shifts:
        _b64_candidate(buf, s + shift, end, out)


def _wrapped(buf: bytes, s: int, e: int, floor: int) -> tuple[int, int, bytes, int] | None:
    """The wrapped base64 text that the run buf[s:e] is a line of -- (start, end, line
    break and indentation) -- and where the next run may start; None if it is not one.
    Lines of run characters joined by one line break and indentation (_BREAK, the same
    every time), every one but the first and the last exactly W long, W at least WRAP_MIN.
    The first may be shorter (text before it on its line, or a stream window that starts
    inside it); the last may be any length, and if longer than W it is also looked at as
    the first line of a text of its own. Lines before buf[s:e] (back to ``floor``) are
    joined too: a line in one case is no run start, nor is a line under B64_MIN_RUN after
    one over it.

    Such a text is decoded from each phase a line starts at (see _b64_wrapped), so a line
    joined that is not part of the text (a first line, a last line) hides nothing that
    its decoding on its own would find."""
    brk = _BREAK.match(buf, e)
    if brk is None:
        return None
    p = brk.end()
    m = _ANY_RUN_RAW.match(buf, p)
    if m is None:
        return None
    gap = buf[e:p]
    g = len(gap)
    first, second = e - s, m.end() - p
    width = first if first > second else second
    if width < WRAP_MIN:
        return None
    q = p
    if second == width:
        # full lines 64 at a time (a Python step a line was most of a wrapped text's cost)
        period = width + g
        chunk = (b"a" * width + gap.translate(_WRAP_TABLE)) * 64
        exact = gap.translate(RUN_TABLE).count(b"a") == 0  # no "n" of a JSON "\n" to tell apart
        while (buf[q:q + 64 * period].translate(_WRAP_TABLE) == chunk
               and (exact or buf.count(gap, q, q + 64 * period) == 64)):
            q += 64 * period
    run_at = _ANY_RUN_RAW.match
    while (m := run_at(buf, q)) is not None:  # forward: full lines, then the last
        end = m.end()
        if end - q != width or buf[end:end + g] != gap:
            break
        q = end + g
    if m is None:
        end = q - g  # the text ends with a full line
        after = end
    else:
        after = q if end - q > width else end
        while end < len(buf) and buf[end] == 0x3D and end - after < 2:  # "=" padding
            end += 1
        if after != q:
            after = end
    start = s
    if first == width:  # back: full lines, then a shorter first one
        while start - g > floor and buf[start - g:start] == gap:
            hi = start - g
            lo = max(floor, hi - width - 1)
            r = buf[lo:hi].translate(RUN_TABLE).rfind(b" ")
            if r >= 0:
                lo += r + 1
            elif lo > 0:
                break  # longer than W, or reaching back past floor
            if lo == hi:
                break
            start = lo
            if hi - lo != width:
                break
    return start, end, gap, after


_WRAP_TABLE = bytes(ord("a") if RUN_TABLE[c] == 0x61 else c for c in range(256))


def _b64_wrapped(buf: bytes, start: int, end: int, gap: bytes, out: list[Segment]) -> None:
    """A wrapped base64 text, its lines joined and decoded as one, once from each phase
    (mod 4) a line starts at: from its own first character a line decodes as it would
    alone, and as it does where a reader joins the lines from any earlier one on (W a
    multiple of 4: one decoding; W = 4k + 2: two; odd W: four). So a line joined by
    mistake, a first line that was not the text's, and a stream window's cut anywhere in
    the text leave the text's own decoding among these."""
    text = buf[start:end].replace(gap, b"")
    head = buf[start:end].split(gap, 5)  # the first lines give every phase there is; and the last
    offsets = [*accumulate([len(line) for line in head[:-1]], initial=0), len(text) - len(head[-1].rsplit(gap, 1)[-1])]
    for phase in sorted({offset % 4 for offset in offsets}):
        dec = _b64_decode(text[phase:])
        if dec:
            out.append((dec, _wrapped_span, (buf, start, end, gap, phase)))


def _b64_candidate(buf: bytes, s: int, e: int, out: list[Segment]) -> None:
    dec = _b64_decode(buf[s:e])
    if dec:
        out.append((dec, _b64_span, (s, e)))


# Hex in a run (red team P1: `/upload/<hex>`, `"0x<hex>"`, `req_<HEX>`): a run of HEX_MIN_RUN+
# hex digits, where the hex triggers say (see RUN_TRIGGERS), decoded where 16 pairs that are
# ASCII bytes start at its first or second digit, both ways of pairing its digits, and cut
# into the stretches of 16+ ASCII bytes that decode (a token is one; digests, UUIDs and hex
# dumps of binary are none).
_HEX_PAIRS_AT = re.compile(_HEX_PAIRS).match
_HEX_DIGITS_AT = re.compile(rb"[0-9a-fA-F]*").match
_HEX_DIGITS = re.compile(rb"[0-9a-fA-F]{%d,}" % HEX_MIN_RUN)
_ASCII_STRETCH = re.compile(rb"[\x00-\x7f]{%d,}" % (HEX_MIN_RUN // 2))
_UPPER = re.compile(rb"[A-Z]").search


def hex_starts(buf: bytes) -> list[int]:
    """Where the hex triggers report ASCII pairs in ``buf``, found by a regex search: the
    reference they stand in for."""
    out = []
    for m in _HEX_DIGITS.finditer(buf):
        a, b = m.span()
        if _glued(buf, a) or _UPPER(buf, run_start(buf, a + 1), a) is None:
            out += _pairs_from(buf, a, b)
    return out


def edge_hexes(buf: bytes) -> list[int]:
    """What the hex triggers miss in the run that starts ``buf`` (theirs want a character
    before the run): where its ASCII pairs start, before its first upper-case letter."""
    e = _ANY_RUN_RAW.match(buf).end()  # type: ignore[union-attr]  # buf starts with a run (run_segments)
    if e < HEX_MIN_RUN:
        return []
    upper = _UPPER(buf, 0, e)
    limit = upper.start() if upper else e
    out = []
    pos = 0
    while (m := _HEX_DIGITS.search(buf, pos, min(e, limit + HEX_MIN_RUN))) is not None and m.start() <= limit:
        a = m.start()
        b = _HEX_DIGITS_AT(buf, a).end()  # type: ignore[union-attr]  # [...]* matches
        if not _glued(buf, a):
            out += _pairs_from(buf, a, b)
        pos = b
    return out


def _glued(buf: bytes, a: int) -> bool:
    """Whether the hex digits from ``a`` on follow "-", "_" or "0x"."""
    return bool(a and buf[a - 1] in b"-_") or (a >= 2 and buf[a - 2:a] in (b"0x", b"0X"))


def _pairs_from(buf: bytes, a: int, b: int) -> list[int]:
    return [q for q in (a, a + 1) if b - q >= HEX_MIN_RUN and _HEX_PAIRS_AT(buf, q)]


def _hex_candidate(buf: bytes, s: int, e: int, out: list[Segment]) -> None:
    """The hex digits buf[s:e] (a whole run of them), decoded as said above."""
    for lo in (s, s + 1):
        if e - lo < HEX_MIN_RUN or not _HEX_PAIRS_AT(buf, lo):
            continue
        decoded = binascii.unhexlify(buf[lo:e - (e - lo) % 2])
        if decoded.isascii():
            out.append((decoded, _hex_span, lo))
        else:
            out += [(m.group(), _hex_span, lo + 2 * m.start()) for m in _ASCII_STRETCH.finditer(decoded)]


def _hex_span(start: int, s: int, e: int) -> tuple[int, int]:
    return start + 2 * s, start + 2 * e


_BASIC_VALUE = re.compile(rb"[ \t]*([A-Za-z0-9+/_-]{8,}=*)")


def basic_segment(buf: bytes, pos: int) -> Segment | None:
    """The base64 credentials of a ``Basic`` authorization whose value starts at ``pos``."""
    m = _BASIC_VALUE.match(buf, pos)
    if m is None:
        return None
    out: list[Segment] = []
    _b64_candidate(buf, *m.span(1), out)
    return out[0] if out else None


def percent_segments(buf: bytes) -> list[Segment]:
    return _escape_segments(buf, b"%", _PCT_SEGMENT, _PCT_MARKS, _percent_decode, _percent_decode_all) if b"%" in buf else []


def json_segments(buf: bytes) -> list[Segment]:
    # (`in` first: finditer's own search would step through a buffer without a backslash)
    return _escape_segments(buf, None, _JSON_SEGMENT, _JSON_MARKS, _json_decode, _json_decode_all) if b"\\" in buf else []


def qp_segments(buf: bytes, first: list[int] | None = None) -> list[Segment]:
    """Quoted-printable segments, from the first evidence the QP triggers reported
    (``first``; by default the whole of ``buf`` is searched)."""
    if first is None:
        return _escape_segments(buf, None, _QP_SEGMENT, _PCT_MARKS, _qp_decode, _qp_decode_all) if b"=" in buf else []
    if not first:
        return []
    return _escape_segments(buf, None, _QP_SEGMENT, _PCT_MARKS, _qp_decode, _qp_decode_all, min(first))


def layer_segments(buf: bytes, found: Triggers | None = None) -> list[Segment]:
    """Every encoded segment of ``buf`` there is evidence for, decoded (``found``: what the
    compiled pass's triggers reported; None: look for all of it here, the slow way)."""
    if found is None:
        return percent_segments(buf) + json_segments(buf) + qp_segments(buf) + run_segments(buf)
    segments = percent_segments(buf) + json_segments(buf)
    if found.qp:
        segments += qp_segments(buf, found.qp)
    if found.runs or found.hexes:
        segments += run_segments(buf, found.runs, found.hexes)
    return segments
