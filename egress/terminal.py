"""Lines egress writes for a person, shown as written whatever the command did to the terminal;
and the lines it writes for events (EGRESS_BLOCKED, EGRESS_UPSTREAM_ERROR), once per host and reason.

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


def event_line(event) -> str | None:
    """The line a person reads for an event: ``EGRESS_BLOCKED <host> (<reason>)`` for a refusal,
    ``EGRESS_UPSTREAM_ERROR <host> (<reason>[: <cause>])`` for an upstream failure, else None."""
    from . import reasons

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
