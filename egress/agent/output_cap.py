"""Output caps: a command's stream kept to its first 60% and last 40% of a byte budget.

``egress run --max-output BYTES`` (and ``[limits] max_output``, ``--agent``'s 256 KiB) gives
each of the command's streams, stdout and stderr, its own budget; where egress's stdout and
stderr go to one place (a terminal, 2>&1), the command's two streams are one (one pipe, in the
order written: egress/run/relay.py's Relay) with one budget. Below it a stream passes
byte for byte. Above it the head passes as it comes, the tail is kept in a bounded buffer
until the stream ends, and the middle becomes one line::

    ... [1048576 bytes elided by egress] ...

so a reader never mistakes a cut log for a whole one. Memory stays bounded whatever the
command prints: the head is passed on, the tail buffer is trimmed once it holds twice the
tail's share (``del buf[:k]`` on a bytearray moves its start, no copy).

The cap comes *before* redaction (egress.scan.detect.StreamRedactor), so redaction works on
bounded input. A secret cut by the elision would otherwise be printed in part, unrecognisable
to the redactor; so, when a redactor follows:

- at the head's end, what the redactor still holds back (a run of token characters, an
  unfinished quoted assignment or key block: what might still become a secret) is dropped
  into the elision (``StreamRedactor.cut``);
- the tail starts at its first whole line, and after a private key's END line or a PuTTY
  key's MAC line when the tail holds no beginning of that key.

Either way the cut falls on a line break when one is near (LINE_REACH) and never splits a
UTF-8 character. The elided count is every byte of the stream that was not printed.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # typing's, without importing typing (egress run imports this module)
if TYPE_CHECKING:
    from collections.abc import Callable

    from egress.scan.detect import StreamRedactor

HEAD_SHARE = 0.6  # of the budget: the first bytes; the rest is the tail's
# The cut falls on a line break when one is this near (bytes, and at most a quarter of the
# head's or the tail's share): a log reads as whole lines. The head's last bytes wait for the
# verdict (is there a cut?) so that they can still end at that line break.
LINE_REACH = 4096
_BEFORE = 256  # bytes kept from before the tail: an escape sequence the tail's start cut is found whole

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024 ** 2, "mb": 1024 ** 2, "mib": 1024 ** 2,
          "g": 1024 ** 3, "gb": 1024 ** 3, "gib": 1024 ** 3}
_SIZE = re.compile(r"\s*(\d+)\s*([a-zA-Z]*)\s*")

# A private key's end (as egress.scan.detect writes it) and a PuTTY key's MAC line: when the tail
# holds one of these with no beginning before it, it begins inside a key.
_KEY_END = re.compile(rb"(?:-----END|---- END) (?:[A-Z0-9]{1,32} ){0,6}PRIVATE KEY(?: BLOCK)? ?-{4,5}"
                      rb"|Private-MAC: [0-9a-fA-F]{20,128}")
_KEY_BEGIN = re.compile(rb"-----BEGIN |---- BEGIN |PuTTY-User-Key-File-")


def parse_size(text: object) -> int:
    """A byte count as written: 262144, "256K", "256KiB", "1M", "1 MB" (K, M, G are 1024s).
    Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text} is negative")
        return text
    match = _SIZE.fullmatch(str(text))
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or not unit:
        raise ValueError(f"{text!r} is not a size: write bytes, or a number with K, M or G (e.g. 256K)")
    return int(match.group(1)) * unit


def elision_line(count: int) -> bytes:
    return b"... [%d byte%s elided by egress] ...\n" % (count, b"" if count == 1 else b"s")


class _Plain:
    """The stage after the cap when nothing is redacted."""

    def feed(self, data: bytes) -> bytes:
        return data

    def cut(self) -> int:
        return 0

    def finish(self) -> bytes:
        return b""


class CappedStream:
    """One stream, capped at ``limit`` bytes (0: no cap), then redacted if ``redactor`` (a
    factory of egress.scan.detect.StreamRedactor) is given. :meth:`feed` returns what can be
    written now, :meth:`finish` the rest; memory stays O(limit) whatever is fed."""

    def __init__(self, limit: int, redactor: Callable[[], StreamRedactor] | None = None):
        self.limit = limit
        self._factory = redactor
        self._stage = redactor() if redactor else _Plain()
        self.head_size = int(limit * HEAD_SHARE)
        self.tail_size = limit - self.head_size
        self._head_left = self.head_size
        self._hold = max(4, min(LINE_REACH, self.head_size // 4))
        self._pending = b""  # the head's last bytes, passed on once the verdict is known
        self._tail = bytearray()
        self._before_tail = b"\n"  # the bytes just before the tail buffer's first (at the start: a line start)
        self.total = 0
        self._passed = 0  # bytes of the stream given to the stage (head)
        self._dropped = 0  # of those, what the stage dropped at the cut
        self.cut = False
        self._last = b"\n"  # last byte written out: the elision line starts a line
        self.elided = 0

    def feed(self, chunk: bytes) -> bytes:
        if not self.limit:
            return self._out(self._stage.feed(chunk))
        self.total += len(chunk)
        out = b""
        if self._head_left:
            take = chunk[:self._head_left]
            chunk = chunk[len(take):]
            self._head_left -= len(take)
            data = self._pending + take if self._pending else take
            if self._head_left:
                out = self._pass(data)
            else:
                self._pending = data[-self._hold:]
                out = self._pass(data[:-self._hold])
        if chunk:
            tail = self._tail
            tail += chunk
            if self.cut or self.total > self.limit:
                if not self.cut:
                    out += self._cut()
                if len(tail) > 2 * self.tail_size + 65536:
                    drop = len(tail) - self.tail_size
                    self._before_tail = bytes(tail[max(0, drop - _BEFORE):drop])
                    del tail[:drop]
        return out

    def finish(self) -> bytes:
        if not self.limit or not self.cut:
            rest = bytes(self._pending) + bytes(self._tail)
            self._pending, self._tail = b"", bytearray()
            return self._out(self._stage.feed(rest) + self._stage.finish())
        tail = self._tail
        if len(tail) > self.tail_size:
            drop = len(tail) - self.tail_size
            self._before_tail = bytes(tail[max(0, drop - _BEFORE):drop])
            del tail[:drop]
        start = _tail_start(tail, self._before_tail, careful=self._factory is not None,
                            reach=max(4, min(LINE_REACH, self.tail_size // 4)))
        kept = bytes(tail[start:])
        self.elided = self.total - (self._passed - self._dropped) - len(kept)
        out = b"" if self._last == b"\n" else b"\n"
        out += elision_line(self.elided)
        if kept:
            stage = self._factory() if self._factory else _Plain()
            out += stage.feed(kept) + stage.finish()
        self._tail = bytearray()
        return self._out(out)

    def _pass(self, data: bytes) -> bytes:
        self._passed += len(data)
        return self._out(self._stage.feed(data))

    def _cut(self) -> bytes:
        """The stream is over its budget: the head ends here."""
        self.cut = True
        pending, self._pending = self._pending, b""
        line = pending.rfind(b"\n")
        keep = line + 1 if line >= 0 else _utf8_whole(pending)
        out = self._pass(pending[:keep])
        self._dropped = self._stage.cut()
        return out

    def _out(self, data: bytes) -> bytes:
        if data:
            self._last = data[-1:]
        return data


def _utf8_whole(data: bytes) -> int:
    """The length of ``data`` without an unfinished UTF-8 character at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:  # a lead byte: is its character complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= need else len(data) - back
    return len(data)


def _tail_start(tail: bytearray, before: bytes, careful: bool, reach: int) -> int:
    """Where the printed tail begins: at a line's start if one is within ``reach``, else not inside
    a UTF-8 character; when ``careful`` (a redactor follows), not inside a line or a key at all,
    since a secret's second half is not recognisable."""
    start = 0
    if before[-1:] != b"\n":
        line = tail.find(b"\n", 0, reach)
        if line >= 0:
            return _tail_start(tail[line + 1:], b"\n", careful, reach) + line + 1 if careful else line + 1
    while start < min(4, len(tail)) and 0x80 <= tail[start] < 0xC0:
        start += 1
    if not careful:
        return start
    if before[-1:] != b"\n":
        line = tail.find(b"\n")
        if line >= 0:
            start = line + 1
        else:  # one long line: at least not inside a run of token characters (or noise inside one)
            from egress.scan.detect import _NOISE  # a redactor follows: egress.scan.detect is loaded

            escape = before.rfind(b"\x1b")  # an escape sequence the tail's start cut: its rest is noise too
            cut = _NOISE.match(before + bytes(tail[:_BEFORE]), escape) if escape >= 0 else None
            if cut is not None and cut.end() > len(before):
                start = cut.end() - len(before)
            while start < len(tail):
                if tail[start:start + 1].isalnum() or tail[start] in b"+/=_.~%\\-:@":
                    start += 1
                elif noise := _NOISE.match(tail, start):
                    start = noise.end()
                else:
                    break
    window = bytes(tail[start:start + 65536])
    end = _KEY_END.search(window)
    if end is not None and not _KEY_BEGIN.search(window, 0, end.start()):
        line = tail.find(b"\n", start + end.end())
        start = len(tail) if line < 0 else line + 1
    return start
