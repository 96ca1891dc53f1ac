"""Lines egress writes for a person, shown as written whatever the command did to the terminal;
and the lines it writes for events (EGRESS_BLOCKED, EGRESS_UPSTREAM_ERROR), once per host and reason.

The command shares egress's terminal, so it can leave it in a state that hides or disguises
what comes next, and egress's own reports (EGRESS_BLOCKED, the grant question) would then be
hidden or garbled. Each such line is written behind a reset of every such state a terminal
keeps (:data:`RESET`, what each part undoes beside it). Only on a terminal: logs and pipes get
the plain line.

What the reset does not do, on purpose:

- move the cursor. A scrolling region (DECSTBM) or origin mode does not hide a line as it is
  written (it is drawn inside the region), and resetting the region moves the cursor home:
  a command could then have egress's line drawn over text of its choosing. So neither is
  touched, nor is anything else that moves the cursor.
- leave the alternate screen. A line written there is drawn, visibly, and a full-screen
  program (less, vim, an agent's interface) legitimately lives there; leaving it would throw
  that program onto the normal screen, where it would keep drawing over the user's shell
  until it exits. A command can take a line off the screen after it was drawn in any case
  (leaving the alternate screen, clearing, moving the cursor up and overwriting: the terminal
  is shared), so the reset promises a legible line *when it is written*; the record the
  command cannot touch is the run's events (`egress events --run ID`, the audit log).

Colours: egress's line is drawn in the terminal's default colours, so those are put back as the
terminal is configured (OSC 110/111: a command that set the foreground to the background's colour
with OSC 10/11 hid egress's line), and so is the palette (OSC 104): most terminals keep the
default colours apart from it, but some draw them with palette entries (Windows' console host,
the Linux console). The cost: a colour theme a shell applied by escape codes at run time
(base16-shell) is undone by egress's first line, until it is applied again.

The Linux console (TERM=linux) keeps its default colours in its palette and shows OSC and
most DEC sequences as text, so it gets a reset of its own (ESC ] R puts its palette back);
a dumb terminal (TERM=dumb, Emacs' shell) gets only the character-set and attribute reset.
"""

from __future__ import annotations

import os
import sys

from egress.core import reasons

# Each part, in the order it must come. Nothing here moves the cursor.
RESET_PARTS = (
    ("\x18", "CAN: abandons an escape sequence or string the command left unfinished (an open OSC "
              "title would take the line in as its text)"),
    ("\x1b<", "ANSI mode back from VT52 mode (DECANM), where no later part would be understood"),
    ("\x1b[4i", "printer controller mode off: in it the terminal shows nothing it receives"),
    ("\x1b[0$}", "output to the main display, not the status line (DECSASD)"),
    ("\x0f", "SI: back from a shifted character set (SO)"),
    ("\x1b(B", "ASCII in G0 (not the line-drawing set)"),
    ("\x1b[0m", "every SGR attribute off: concealed, invisible colours, reverse, faint, blink"),
    ("\x1b[4l", "replace mode (insert mode off: IRM)"),
    ("\x1b[?5l", "normal video for the whole screen (DECSCNM off)"),
    ("\x1b[?7h", "autowrap on: a long line wraps instead of being cut at the right margin"),
    ("\x1b#5", "the line single-width and single-height (a double-height line shows half of each glyph)"),
    ("\x1b]8;;\x1b\\", "closes a hyperlink (OSC 8) the command opened: egress's line is no link"),
    ("\x1b]104\x1b\\", "every palette colour as the terminal is configured (OSC 4; where default colours are palette entries)"),
    ("\x1b]110\x1b\\", "the default foreground colour (OSC 10) as the terminal is configured"),
    ("\x1b]111\x1b\\", "the default background colour (OSC 11) as the terminal is configured"),
)
RESET = "".join(part for part, _ in RESET_PARTS)
# The Linux console: its default colours are palette entries, put back by ESC ] R; it has none
# of the xterm-only parts (and shows some of them as text).
CONSOLE_RESET = "\x18\x0f\x1b(B\x1b[0m\x1b[4l\x1b[?5l\x1b[?7h\x1b]R"
DUMB_RESET = "\x0f\x1b(B\x1b[0m"


def reset_for(term: str | None) -> str:
    """The reset for a terminal whose TERM is ``term``."""
    if term == "linux" or (term or "").startswith("linux-"):
        return CONSOLE_RESET
    if term == "dumb":
        return DUMB_RESET
    return RESET


def for_person(text: str, tty: bool) -> str:
    """``text`` as egress writes it on a stream that is (``tty``) or is not a terminal."""
    return reset_for(os.environ.get("TERM")) + text if tty else text


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


def event_line(event) -> str | None:
    """The line a person reads for an event: ``EGRESS_BLOCKED <host> (<reason>)`` for a refusal,
    ``EGRESS_UPSTREAM_ERROR <host> (<reason>[: <cause>])`` for an upstream failure, else None."""
    if event.decision == "block":
        host = event.host
        if event.reason == "not-http" and event.port is not None:  # the port is what was refused
            host = f"[{host}]:{event.port}" if ":" in host else f"{host}:{event.port}"
        return f"EGRESS_BLOCKED {host} ({reasons.for_person(event.reason, event.detail)})"
    if event.decision == "error" and event.reason in reasons.UPSTREAM_ERRORS:
        return f"EGRESS_UPSTREAM_ERROR {event.host} ({reasons.for_person(event.reason, event.detail)})"
    return None


class EventLines:
    """An event observer that says refusals and upstream failures on stderr as they happen, once
    per host and reason (a retrying client does not repeat them). ``blocked=False``: upstream
    failures only (`egress serve`, whose refusals are in its audit log and answers)."""

    def __init__(self, stream=None, blocked: bool = True):
        import threading

        self.stream = stream
        self.blocked = blocked
        self.seen: set[tuple[str, str, str]] = set()  # (decision, the line's host part, reason)
        self.lock = threading.Lock()

    def __call__(self, event) -> None:
        if event.decision == "block" and not self.blocked:
            return
        line = event_line(event)
        if line is None:
            return
        with self.lock:
            key = (event.decision, line.split(" (", 1)[0], event.reason)  # the host, with the port for not-http
            if key in self.seen:
                return
            self.seen.add(key)
        say(line, self.stream)
