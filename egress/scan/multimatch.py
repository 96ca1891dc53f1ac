"""Many patterns in one pass of compiled code: a thin layer over Hyperscan.

The credential detector (:mod:`egress.scan.detect`) looks for ~100 token prefixes, the
install's stored secrets and the starts of base64/hex runs in every body. In CPython's
``re`` that took nine passes and a Python step per run; one Hyperscan database does it
in one pass of SIMD code, and Python only sees the places where something may be
(``bench/README.md``, Scanner, has the speeds).

Hyperscan reports the *end* of each match (and its start only for patterns compiled
with ``HS_FLAG_SOM_LEFTMOST``); each (pattern, end) once. A callback per match crosses
into Python, so the patterns are written to match rarely on ordinary text: a match is a
candidate that the caller checks with its own regexes.

A database is immutable and may be shared; the scratch space a scan needs may not, so
each thread gets its own. A scan's errors (and an exception in the callback) raise.
"""

from __future__ import annotations

import threading
from typing import Any

import hyperscan

SOM = hyperscan.HS_FLAG_SOM_LEFTMOST
CASELESS = hyperscan.HS_FLAG_CASELESS
SINGLE = hyperscan.HS_FLAG_SINGLEMATCH  # report an expression's first match only

Match = tuple[int, int, int]  # (id, start, end)


def _collect(id_: int, start: int, end: int, flags: int, out: Any) -> None:  # out: the list[Match] scan was given
    out.append((id_, start, end))


class Database:
    """Patterns compiled for block scans; ``scan`` lists (id, start, end) of every match.

    ``expressions``: regexes in Hyperscan's (PCRE-like) syntax, or byte strings to match
    exactly with ``literal=True``; ids are their indexes. ``flags``: one per expression."""

    def __init__(self, expressions: list[bytes], flags: list[int], literal: bool = False):
        self.size = len(expressions)
        self._db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        if expressions:
            self._db.compile(expressions=list(expressions), ids=list(range(len(expressions))), flags=list(flags),
                             literal=literal)
        self._local = threading.local()

    def scan(self, data: bytes, out: list[Match]) -> list[Match]:
        """Appends (id, start, end) to ``out`` for each match in ``data``; start is 0 for
        patterns without SOM. Matches come in order of their end."""
        if not self.size:
            return out
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = hyperscan.Scratch(self._db)
        self._db.scan(data, match_event_handler=_collect, context=out, scratch=scratch)
        return out
