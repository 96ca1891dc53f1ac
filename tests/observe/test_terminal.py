"""Lines egress writes for a person: behind a display reset on a terminal, plain elsewhere."""

from __future__ import annotations

import io
import os
import pty
import re
import sys

import pytest

from egress.observe.terminal import CONSOLE_RESET, DUMB_RESET, RESET, RESET_PARTS, say

LINE = "EGRESS_BLOCKED evil.test (not on the allow list)"


def through_pty(line: str) -> bytes:
    master, slave = pty.openpty()
    try:
        with open(slave, "w", closefd=False) as stream:
            say(line, stream)
        return os.read(master, 4096)
    finally:
        os.close(slave)
        os.close(master)


def through_pipe(line: str) -> bytes:
    read, write = os.pipe()
    with open(write, "w") as stream:
        say(line, stream)
    with open(read, "rb") as source:
        return source.read()


def through_memory(line: str) -> bytes:
    stream = io.StringIO()
    say(line, stream)
    return stream.getvalue().encode()


@pytest.mark.skipif(sys.platform == "win32", reason="no pseudo-terminals")
@pytest.mark.parametrize("write, expected", [
    (through_pty, (RESET + LINE + "\r\n").encode()),  # the terminal's ONLCR turns \n into \r\n
    (through_pipe, (LINE + "\n").encode()),
    (through_memory, (LINE + "\n").encode()),
], ids=["terminal", "pipe", "in memory"])
def test_a_reset_only_on_a_terminal(write, expected, monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    assert write(LINE) == expected


# Every display state a command can leave a terminal in that hides or disguises the text that
# follows (the red-team reviews: F22's concealment and shifted character sets, N12's default
# colours), and the sequence that puts it back.
STATES = [
    ("an unfinished escape sequence or OSC string swallows the line", "\x18"),
    ("VT52 mode: no ANSI reset is understood", "\x1b<"),
    ("printer controller mode: nothing is shown", "\x1b[4i"),
    ("output sent to the status line", "\x1b[0$}"),
    ("a shifted character set (SO)", "\x0f"),
    ("the line-drawing set in G0", "\x1b(B"),
    ("concealed text, a foreground like the background, reverse, faint", "\x1b[0m"),
    ("insert mode", "\x1b[4l"),
    ("reverse video for the whole screen", "\x1b[?5l"),
    ("no autowrap: the line cut at the right margin", "\x1b[?7h"),
    ("a double-height line: half of each glyph", "\x1b#5"),
    ("an open hyperlink: egress's line links to the command's address", "\x1b]8;;\x1b\\"),
    ("a palette whose entries are the default colours set to one colour (OSC 4)", "\x1b]104\x1b\\"),
    ("the default foreground set to the background's colour (OSC 10)", "\x1b]110\x1b\\"),
    ("the default background set to the foreground's colour (OSC 11)", "\x1b]111\x1b\\"),
]


@pytest.mark.skipif(sys.platform == "win32", reason="no pseudo-terminals")
@pytest.mark.parametrize("state, reset", STATES, ids=[s for s, _ in STATES])
def test_every_state_that_hides_text_is_reset_before_the_line(state, reset, monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    written = through_pty(LINE)
    before = written[:written.index(LINE.encode())]
    assert reset.encode() in before, (state, before)
    assert before.index(b"\x18") == 0  # first: every later part is read as a sequence of its own


SEQUENCE = re.compile(r"\x1b\[[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]|\x1b\]R(?!\w)|\x1b\][^\x1b\x07]*(?:\x1b\\|\x07)"
                      r"|\x1b[\x20-\x2f]*[\x30-\x7e]|[\x00-\x1f]")  # \x1b]R: the Linux console's palette reset


@pytest.mark.parametrize("reset", [RESET, CONSOLE_RESET, DUMB_RESET], ids=["xterm", "linux console", "dumb"])
def test_the_reset_never_moves_the_cursor_nor_flips_the_screen(reset):
    # A reset that moved the cursor (a scrolling region's reset homes it; DECSC/DECRC; a line
    # feed) would let the command choose where egress's line is drawn: over its own text.
    parts = SEQUENCE.findall(reset)
    assert "".join(parts) == reset  # nothing printable: every byte is part of a sequence
    for part in parts:
        assert not re.fullmatch(r"\x1b\[[\d;]*[ABCDEFGHJKLMPSTXZ`adefr]", part), repr(part)  # moves, erases, scrolls
        assert part not in ("\x1b7", "\x1b8", "\x1bD", "\x1bE", "\x1bM", "\x1bc", "\n", "\r", "\x0b", "\x0c", "\x08")
        assert "1049" not in part and "?47" not in part and "?1047" not in part  # the alternate screen stays


@pytest.mark.skipif(sys.platform == "win32", reason="no pseudo-terminals")
@pytest.mark.parametrize("term, reset", [("linux", CONSOLE_RESET), ("dumb", DUMB_RESET), ("screen-256color", RESET)])
def test_each_kind_of_terminal_gets_the_reset_it_understands(term, reset, monkeypatch):
    monkeypatch.setenv("TERM", term)
    assert through_pty(LINE) == (reset + LINE + "\r\n").encode()


def test_every_part_of_the_reset_says_what_it_undoes():
    assert "".join(part for part, _ in RESET_PARTS) == RESET
    assert all(why for _, why in RESET_PARTS)
