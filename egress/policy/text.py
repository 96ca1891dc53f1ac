"""A policy file's TOML text: its values, and the line of every entry of its lists.

tomllib gives values without positions, so a rule's file:line used to be searched for
in the file on its first use, on the proxy's event loop. And tomllib is slow on the one
thing a large policy is made of, a long list (bench/README.md, Policy). Those lists (``allow``, ``deny``, ``passthrough``,
``allow_private``) are the simplest TOML there is, an array of one-line strings, so
:func:`read_toml` reads each such array at the top level itself, noting every entry's
line as it goes, and leaves the rest of the file to tomllib with each array replaced by
a marker. tomllib is the judge of the rest: the arrays are used only if it finds each
marker, alone, under its key at the top level, so an array the scanner saw inside a
multi-line string or a table is read by tomllib after all; and if it finds an error, it
reads the whole file again to say where (a broken file costs the old time, once).

The scanner is a strict subset of tomllib: it takes an array only in the shapes it reads
exactly as tomllib does, and leaves every other array to tomllib. Taken: one-line basic
strings without a backslash and one-line literal strings (a string's value is then the
text between its quotes, as in tomllib), a comma right after each value (blanks aside),
blanks, blank lines, and comments where TOML allows them, with the same characters refused
in strings and comments as tomllib refuses (controls but tab). After the last value only
blanks, comments, newlines and the ``]`` may follow. Anything else (an escape, a multi-line
string, a number, a nested array, an inline table, a comma on the line after its value)
leaves the whole array to tomllib; its string entries' lines are then found by searching
the text for each entry, in order, from its key on. A bare carriage return anywhere, a key
taken twice, or a list key in a table leaves the whole file to tomllib.

Why the arrays taken read as tomllib reads them (tests/policy/test_policy_text.py compares both
on tables of tricky cases and on thousands of generated texts): tomllib parses the text
with each taken array's body replaced by a random marker, ``key = ["marker"]``. The prefix
up to the first ``key = [`` is the same text in both, so tomllib is in the same state
there; it reports ``key = ["marker"]`` at the top level only if that ``key = [`` opened
an array value of the top-level table (inside a multi-line string, a table or another
array it does not, and the whole file goes to tomllib). From that state tomllib's array
grammar reads the body token by token exactly as the scanner does, to the same ``]``,
after which the text is the same again.

Every regular-expression call covers at most :data:`CHUNK` characters: a reload reads
its policy in a thread, and a longer call into C would hold the GIL away from the
proxy's event loop for as long.
"""

from __future__ import annotations

import os
import re
import tomllib
from array import array
from collections.abc import Callable, Sequence
from itertools import accumulate, chain, compress, islice
from typing import TYPE_CHECKING, Any, overload

CHUNK = 1 << 16  # characters per regular-expression call: ~1,700 lines, well under a millisecond

_LIST_KEYS = ("allow_private", "allow", "deny", "passthrough")  # the longest first: allow_private is not allow
_CTRL = r"\x00-\x08\x0a-\x1f\x7f"  # what TOML allows in no one-line string or comment (tab aside)
_BASIC = rf'"[^"\\{_CTRL}]*"'
_LITERAL = rf"'[^'{_CTRL}]*'"
_COMMENT = rf"#[^{_CTRL}]*"

# `allow = [` at the start of a line, the key bare or quoted
_ARRAY_START = re.compile(rf"""^[ \t]*(["']?)({"|".join(_LIST_KEYS)})\1[ \t]*=[ \t]*\[""", re.M)
# A line of a long list written one entry per line: `  "name",  # comment`, a blank or a comment line.
_LINE = rf"[ \t]*(?:({_BASIC}|{_LITERAL})[ \t]*,[ \t]*)?(?:{_COMMENT})?\n"
_LINES = re.compile(f"(?:{_LINE})+")
_ONE_LINE = re.compile(f"^{_LINE}", re.M)  # anchored: a line of another shape yields nothing
# Anything else, one token at a time: blanks and comments (no group), a newline, a string, a comma, the end.
# Strings as above: one with an escape (or anything else) matches no token, and tomllib reads the array.
_TOKEN = re.compile(rf"""[ \t]+|{_COMMENT}|(\n)|({_BASIC}|{_LITERAL})|(,)|(\])""")

# array("I"): the line of each entry of a list, in order; 0 where it is not known
if TYPE_CHECKING:
    Lines = array[int]
else:
    Lines = array  # array[int] is a type from Python 3.12 on


class Strings(Sequence[str]):
    """A list's string entries as :func:`read_toml` reads them: one text, and where each entry
    ends in it. A slice is a list of str. A list of 1M str objects lived for a whole reload's
    build, and requests' objects allocated among them pinned the allocator's arenas when they
    went: RSS rose at a large policy's second reload (bench/README.md, "Policy").
    Made a slice at a time, the entries live for a batch each."""

    __slots__ = ("_text", "_ends")

    def __init__(self, text: str, ends: array[int]) -> None:
        self._text, self._ends = text, ends

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            ends, text = self._ends[start:max(start, stop)], self._text
            return [text[a:b] for a, b in zip(chain((self._ends[start - 1] if start else 0,), ends), ends, strict=False)]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("Strings index out of range")
        return self._text[self._ends[index - 1] if index else 0:self._ends[index]]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, Strings)):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # as a list: not hashable

    def __repr__(self) -> str:
        return repr(list(self))


def read_toml(text: str, pause: Callable[[], None] = lambda: None) -> tuple[dict[str, Any], dict[str, Lines]]:
    """The file's values (as ``tomllib.loads``, which raises the same errors) and, for each
    list key whose value is a list, the line of each of its entries. ``pause()`` is called
    between chunks (egress.policy.loader.PACE)."""
    src = text.replace("\r\n", "\n") if "\r" in text else text  # as tomllib does, once
    if "\r" in src:  # a bare carriage return, which tomllib refuses wherever it is; and tomllib
        return _tomllib_alone(text)  # given src would replace again: "\r\r\n" read as "\n" (found by the differential test)
    marker = f"egress-list-{os.urandom(8).hex()}"  # not `secrets`: it imports hashlib and random
    taken: dict[str, tuple[Strings, Lines]] = {}
    rest: list[str] = []  # the text with each array taken replaced by the marker
    copied = 0  # src[:copied] is in rest
    line, counted = 1, 0  # the line at position `counted`
    start = _next_array(src, 0)
    while start is not None:
        line += src.count("\n", counted, start.end())
        counted = start.end()
        read = _read_array(src, start.end(), line, pause)
        if read is None:  # not a plain list of strings: tomllib's
            start = _next_array(src, start.end())
            continue
        key = start.group(2)
        if key in taken:  # twice: one of them is not what it seems; let tomllib say
            return _tomllib_alone(src)
        values, lines, end, end_line = read
        rest += [src[copied:start.end()], f'"{marker}"]']
        copied, counted, line = end, end, end_line
        taken[key] = (values, lines)
        start = _next_array(src, end)
    if not taken:
        return _tomllib_alone(src)
    rest.append(src[copied:])
    try:
        data = tomllib.loads("".join(rest))
    except tomllib.TOMLDecodeError:
        return _tomllib_alone(src)  # the same error, at its line in the file
    if any(data.get(key) != [marker] for key in taken):
        return _tomllib_alone(src)  # an array was inside a string or a table: tomllib reads it all
    found = {}
    for key, (values, lines) in taken.items():
        data[key], found[key] = values, lines
    for key in _LIST_KEYS:
        if key not in found and isinstance(data.get(key), list):
            found[key] = _search_lines(src, key, data[key])
    return data, found


def _tomllib_alone(src: str) -> tuple[dict[str, Any], dict[str, Lines]]:
    data = tomllib.loads(src)  # src has no "\r" left but in "\r\n", which tomllib replaces once, as read_toml
    src = src.replace("\r\n", "\n")
    return data, {key: _search_lines(src, key, data[key]) for key in _LIST_KEYS
                  if isinstance(data.get(key), list)}


def _next_array(src: str, pos: int) -> re.Match[str] | None:
    """The next ``key = [`` from ``pos`` on, searched a chunk at a time."""
    size = len(src)
    while pos < size:
        end = min(size, pos + CHUNK)
        found = _ARRAY_START.search(src, pos, end)
        if found is not None or end == size:
            return found
        pos = end - 256  # a key line cut by the chunk's end is found whole in the next one
    return None


def _read_array(src: str, pos: int, line: int, pause: Callable[[], None]
                ) -> tuple[Strings, Lines, int, int] | None:
    """The strings of the array whose ``[`` ends at ``pos`` (on ``line``), their lines, the
    position after its ``]`` and the line there; None if it holds anything but one-line strings."""
    pieces: list[str] = []  # the values, a chunk's joined in one
    ends = array("Q")  # where each value ends in the pieces joined
    lines = array("I")
    state = _VALUE
    size = len(src)
    while True:
        if state is _VALUE and src[pos - 1] == "\n":  # whole lines of one entry each, a chunk at a time
            end = src.rfind("\n", pos, min(size, pos + CHUNK)) + 1
            found = _ONE_LINE.findall(src, pos, end)  # per line: its quoted entry, or "" (blank, comment)
            if len(found) != src.count("\n", pos, end):  # a line of another shape: up to it
                bulk = _LINES.match(src, pos, end)
                end = bulk.end() if bulk is not None else pos
                found = _ONE_LINE.findall(src, pos, end)
            if found:
                pause()
                values = [quoted[1:-1] for quoted in found if quoted]
                pieces.append("".join(values))
                ends.extend(islice(accumulate(map(len, values), initial=ends[-1] if ends else 0), 1, None))
                lines.extend(compress(range(line, line + len(found)), found))
                line += len(found)
                pos = end
                continue
        token = _TOKEN.match(src, pos)
        if token is None:
            return None
        pos = token.end()
        kind = token.lastindex
        if kind is None:  # blanks, a comment
            continue
        if kind == 1:
            line += 1
            if state is _AFTER:
                state = _CLOSING
        elif kind == 2:
            if state is not _VALUE:
                return None
            pieces.append(token.group(2)[1:-1])
            ends.append((ends[-1] if ends else 0) + len(pieces[-1]))
            lines.append(line)
            state = _AFTER
        elif kind == 3:
            if state is not _AFTER:  # `[,`, `,,`, or a comma on a line after its value (valid TOML, not taken)
                return None
            state = _VALUE
        else:
            return Strings("".join(pieces), ends), lines, pos, line


# _read_array's states: a value or the end may come (after `[` or a comma); a comma or the end
# (right after a value, on its line); only the end (a line after the last value).
_VALUE, _AFTER, _CLOSING = "value", "after", "closing"


def _search_lines(src: str, key: str, values: list[Any]) -> Lines:
    """Lines of a list tomllib read: each string entry searched for, quoted, in order from
    the key's line on (one not found as written, say with escapes, gets the key's line)."""
    lines = array("I")
    at = re.search(rf"""^[ \t]*["']?{key}["']?[ \t]*=""", src, re.M)
    pos = at.start() if at is not None else 0
    key_line = src.count("\n", 0, at.start()) + 1 if at is not None else 0
    line, counted = 1, 0  # the line at position `counted`
    for value in values:
        found = -1
        if isinstance(value, str):
            double = src.find(f'"{value}"', pos)
            single = src.find(f"'{value}'", pos, double if double >= 0 else len(src))
            found = single if single >= 0 else double
        if found < 0:
            lines.append(key_line)
            continue
        line += src.count("\n", counted, found)
        counted = found
        lines.append(line)
        pos = found + len(value) + 2
    return lines
