"""A person in the loop: "allow this host for this run, or keep it blocked?"

Only a refusal for ``not-allowed`` is ever offered, for a host *name*: the deny
list, private addresses, IP literals and credentials are never asked about. While
the question is open the request is held (up to :data:`HOLD_SECONDS`, then
refused), so a yes lets the waiting request through. A yes covers that exact name,
not its subdomains, for this run only. A grant from another terminal
(``egress allow HOST --run ID``) answers a pending question too.

The command shares the terminal, so the question is hardened against it: input
already queued when the question is asked (typed ahead, or pushed by the command) is
discarded first, and only an exact answer allows (:data:`ALLOW_ANSWERS`, whitespace
aside); anything else, escape sequences included, keeps the host blocked.

The answer is one key, read with the terminal out of line mode (no Enter needed,
as the prompt shows it). What arrives in one read is the answer: a key, a key and
Enter, or a paste; so a pasted ``ab`` or an arrow key's escape sequence is not an
``a``. The terminal's modes are restored and what was typed after is dropped, so
the command's next read does not get the rest of the answer.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable

from egress.observe import terminal

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    import asyncio

    from egress.host.control import RunState

# asyncio and termios are imported where they are used: the launcher makes an asker before
# the command starts, and importing them there cost 20 ms (asyncio) and 0.4 ms (termios) of
# every `egress run`.

HOLD_SECONDS = 60.0
ALLOW_ANSWERS = ("a", "y", "yes", "allow")


def allows(answer: str) -> bool:
    """True only for an exact yes; ASCII only, so no look-alike letter case-folds into one."""
    text = answer.strip()
    return text.isascii() and text.lower() in ALLOW_ANSWERS


class TerminalAsker:
    """Asks on the controlling terminal (/dev/tty), one question at a time: an asker as
    egress.proxy.seams names it (tests/run/test_ask.py holds both askers to it)."""

    def __init__(self, state: RunState, command: str, tty: str = "/dev/tty", hold: float = HOLD_SECONDS):
        self.state = state  # grants live there
        self.command = command
        self.tty = tty
        self.hold = hold
        self._pending: dict[str, asyncio.Future[bool]] = {}
        self._one_at_a_time = threading.Lock()
        state.on_grant.append(self._granted)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def ask(self, host: str) -> bool:
        """True if the person (or `egress allow`) allows ``host`` for this run."""
        import asyncio

        if host in self.state.grants:
            return True
        loop = self._loop = asyncio.get_running_loop()
        future = self._pending.get(host)
        if future is None:
            future = loop.create_future()
            self._pending[host] = future
            threading.Thread(target=self._prompt, args=(host, future), daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.hold)
        except TimeoutError:
            self._settle(host, False)
            return False

    def _granted(self, host: str) -> None:  # called from the control thread
        if self._loop is not None:
            self._settle_soon(host, True)

    def _settle_soon(self, host: str, allowed: bool) -> None:
        """From another thread: settle on the loop's next turn. A loop already closed has no
        request waiting any more (a grant also settles, so the answer can come twice)."""
        if self._loop is None:
            return  # never asked: nothing waits
        try:
            self._loop.call_soon_threadsafe(self._settle, host, allowed)
        except RuntimeError:
            pass

    def _settle(self, host: str, allowed: bool) -> None:
        future = self._pending.pop(host, None)
        if future is not None and not future.done():
            future.set_result(allowed)

    def _prompt(self, host: str, future) -> None:
        with self._one_at_a_time:
            if future.done():
                return
            import termios

            try:
                fd = os.open(self.tty, os.O_RDWR | os.O_NOCTTY)
            except OSError:
                self._settle_soon(host, False)
                return
            try:
                held = _hold_foreground(fd)
            except OSError:
                os.close(fd)
                self._settle_soon(host, False)
                return
            try:
                # Whatever is queued now was not typed in answer to this question: drop it.
                # A terminal that cannot be flushed is not asked (kept blocked).
                termios.tcflush(fd, termios.TCIFLUSH)
                self._write(fd, f"\negress: `{self.command}` wants to reach {host}, which is not on the allow list.\n"
                                f"  [a] Allow for this run   [k] Keep blocked   (held {self.hold:g} s) > ")
                answer = self._read_answer(fd, future)
                self._write(fd, "\n")
                if answer is None:
                    return
                allowed = allows(answer)
                self._write(fd, f"egress: {host} {'allowed for this run' if allowed else 'kept blocked'}\n")
                if allowed:
                    self.state.grant(host)
                self._settle_soon(host, allowed)
            except (OSError, termios.error):
                self._settle_soon(host, False)
            finally:
                _give_back(fd, held)
                os.close(fd)

    @staticmethod
    def _write(fd: int, text: str) -> None:
        os.write(fd, terminal.for_person(text, terminal.is_terminal(fd)).encode())

    def _read_answer(self, fd: int, future) -> str | None:
        """One key (what one read returns) from the terminal, or None once the question was
        settled elsewhere. The terminal's modes are restored and later input dropped."""
        import termios

        saved = termios.tcgetattr(fd)
        one_key = list(saved)
        one_key[3] = saved[3] & ~(termios.ICANON | termios.ECHO)
        one_key[6] = list(saved[6])
        one_key[6][termios.VMIN], one_key[6][termios.VTIME] = 1, 0
        termios.tcsetattr(fd, termios.TCSANOW, one_key)
        try:
            while not future.done():
                ready, _, _ = select.select([fd], [], [], 0.2)
                if ready:
                    chunk = os.read(fd, 256)
                    return chunk.decode(errors="replace") if chunk else None
            return None
        finally:
            termios.tcflush(fd, termios.TCIFLUSH)
            termios.tcsetattr(fd, termios.TCSANOW, saved)


def _hold_foreground(fd: int) -> int | None:
    """egress's own process group holds the terminal while it asks; returns the group to give it
    back to (None: egress held it already). On macOS the command is the terminal's foreground group
    (sandbox/macos.py), and anywhere a command can make itself one: reading the answer from the
    background would stop egress (SIGTTIN). Meanwhile the command, in the background, cannot read
    the answer either. Raises OSError if egress cannot take it (then nothing is asked)."""
    import signal

    try:
        current = os.tcgetpgrp(fd)
    except OSError:
        return None  # no job control on this terminal: nothing to take
    own = os.getpgrp()
    if current == own:
        return None
    if signal.getsignal(signal.SIGTTOU) is not signal.SIG_IGN:  # taking it would stop egress
        raise OSError("egress is in the terminal's background")
    os.tcsetpgrp(fd, own)
    return current


def _give_back(fd: int, group: int | None) -> None:
    if group is None:
        return
    import signal

    try:
        os.tcsetpgrp(fd, group)
        os.killpg(group, signal.SIGCONT)  # had it read the terminal meanwhile, job control stopped it
    except OSError:
        pass  # gone meanwhile


class NeverAsk:
    """Headless: never asks, keeps blocked, and says so once."""

    def __init__(self, state: RunState, say: Callable[[str], None] | None = None):
        self.state = state
        self.say = say or terminal.say
        self._said = False

    async def ask(self, host: str) -> bool:
        if host in self.state.grants:
            return True
        if not self._said:
            self._said = True
            self.say("egress: no terminal to ask on (headless): hosts not on the allow list stay blocked; "
                     "grant one with `egress allow HOST --run " + self.state.run_id + "`")
        return False
