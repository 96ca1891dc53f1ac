"""Lines egress writes for a person: behind a display reset on a terminal, plain elsewhere."""

from __future__ import annotations

import io
import os
import pty
import sys

import pytest

from egress.terminal import RESET, say

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
def test_a_reset_only_on_a_terminal(write, expected):
    assert write(LINE) == expected
