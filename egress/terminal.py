"""Lines egress writes for a person, shown as written whatever the command did to the terminal.

The command shares egress's terminal, so it can leave it concealing text (``\\033[8m``),
in a shifted character set (SO, ``\\033(0``) or in any colour, and egress's own reports
(EGRESS_BLOCKED, the grant question) would then be hidden or garbled. Each such line is
written behind a reset of that display state. Only on a terminal: logs and pipes get the
plain line.
"""

from __future__ import annotations

import os
import sys

# SI (back from a shifted charset), ASCII in G0, all SGR attributes off.
RESET = "\x0f\x1b(B\x1b[0m"


def for_person(text: str, tty: bool) -> str:
    """``text`` as egress writes it on a stream that is (``tty``) or is not a terminal."""
    return RESET + text if tty else text


def is_terminal(stream) -> bool:
    """True if ``stream`` (a file object or a descriptor) is a terminal; unknown counts as one,
    so a person who might be reading is never left with a concealed line."""
    try:
        return os.isatty(stream) if isinstance(stream, int) else bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return True


def say(line: str, stream=None) -> None:
    """Write one line (newline added) for a person, on stderr unless told otherwise, and flush."""
    stream = stream or sys.stderr
    stream.write(for_person(line + "\n", is_terminal(stream)))
    stream.flush()
