"""What every started box shares (sandbox/api.py's Box): a signal reaches the command only until it
has ended, close() ends what still runs and lets go of what the box holds, once, and a box is its
own context manager. Each platform's box says only how: _running(), _send(sig), _end(), _release().
"""

from __future__ import annotations

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from typing import Self


class BaseBox:
    pid: int | None = None  # the command (or what stands for it: the engine's client)
    returncode: int | None = None
    capture_error: str | None = None

    def ready(self) -> None:
        """Returns once the command has started: at once where start() started it."""

    def direct_attempts(self) -> int | None:
        """Packets the command tried to send around the proxy; None: not counted here."""
        return None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command (not to what it started). No-op once it has ended."""
        if self.returncode is None and self._running():
            try:
                self._send(sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """End whatever of the command still runs and let go of what the box holds. Idempotent."""
        if self.returncode is None:
            self.returncode = self._end()
        self._release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _running(self) -> bool:
        return True

    def _send(self, sig: int) -> None:
        raise NotImplementedError

    def _end(self) -> int:
        """Kill what still runs and return the status the box ends with."""
        raise NotImplementedError

    def _release(self) -> None:
        """Close what the box holds (sockets, descriptors, the namespace's holder)."""
