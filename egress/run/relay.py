"""The command's output and signals, as egress relays them: stdout and stderr through pipes
egress copies out (redacted, capped), the terminal kept in its mode, and signals forwarded.
"""

from __future__ import annotations

import os
import signal
import stat
import sys


def stdio_fds(names=("stdout", "stderr")) -> dict[str, int]:
    """This process's stdout and stderr descriptors (those that are open), by name."""
    fds = {}
    for name in names:
        fd = {"stdout": 1, "stderr": 2}[name]
        try:
            os.fstat(fd)
            fds[name] = fd
        except OSError:
            pass
    return fds


class Relay:
    """Pipes for the command's stdout and/or stderr, copied out by egress as they stream.

    For --redact (both streams, secrets redacted), --max-output, and whenever egress's stderr
    is a regular file: sharing that file's open description would let the command truncate or
    overwrite egress's own report lines (the red-team review erased them with `ftruncate(2, 0)`);
    through a pipe it can only add to them.

    Where egress's stdout and stderr are one place (the same terminal, pipe or file: 2>&1), the
    command gets one pipe for both, copied to egress's stdout: its two streams arrive there in
    the order it wrote them, as they would without egress, and the redactor sees them as the one
    stream a reader sees (red team N8: a token's first half on stdout and the rest on stderr was
    printed whole). --max-output then caps that one stream. Where they are two places, each is
    its own stream, capped and redacted on its own.
    """

    def __init__(self, streams: tuple[bool, bool], detector=None, limit: int = 0, merged: bool = False):
        self.detector = detector
        self.limit = limit  # each stream's cap in bytes (egress.agent.output_cap); 0: none
        if merged:  # one pipe for both, relayed to stdout
            self._pipes = [os.pipe(), None]
            self.stdout = self.stderr = self._pipes[0][1]
        else:
            self._pipes = [os.pipe() if wanted else None for wanted in streams]
            self.stdout, self.stderr = (pipe[1] if pipe else None for pipe in self._pipes)
        self._threads: list = []

    @classmethod
    def for_run(cls, redact: bool, credentials, limit: int = 0) -> Relay | None:
        if redact:
            from egress.scan.detect import Detector

            secrets = [(s.label, s.value) for s in credentials.secrets] if credentials else []
            secrets += [(s.label, s.placeholder) for s in credentials.brokered] if credentials else []
            return cls((True, True), Detector(secrets), limit, merged=cls.one_place())
        if limit:
            return cls((True, True), None, limit, merged=cls.one_place())
        try:
            err = os.fstat(2)
        except OSError:
            return None
        if not stat.S_ISREG(err.st_mode):
            return None
        same = cls.one_place()
        return cls((same, True), merged=same)  # stdout too when it is that same file (2>&1 > log)

    @staticmethod
    def one_place() -> bool:
        """Whether egress's stdout and stderr lead to one place: the same file or pipe, or the
        same device (a terminal, whichever of its names was opened)."""
        try:
            out, err = os.fstat(1), os.fstat(2)
        except OSError:
            return False
        if (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino):
            return True
        return stat.S_ISCHR(out.st_mode) and stat.S_ISCHR(err.st_mode) and out.st_rdev == err.st_rdev

    def start(self) -> None:
        import threading  # here: the launcher's path to the sandbox's fork has no use for it

        # Our copies of the write ends go: the pipes end when the command's side closes.
        for pipe, sink in zip(self._pipes, (sys.stdout, sys.stderr), strict=True):
            if pipe is None:
                continue
            os.close(pipe[1])
            thread = threading.Thread(target=self._copy, args=(pipe[0], sink), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _copy(self, fd: int, sink) -> None:
        stream = None
        if self.detector is not None or self.limit:
            from egress.agent.output_cap import CappedStream

            factory = None
            if self.detector is not None:  # only then: a run without --redact never imports the detector
                from egress.scan.detect import StreamRedactor

                detector = self.detector
                factory = lambda: StreamRedactor(detector)  # noqa: E731
            stream = CappedStream(self.limit, factory)  # the cap first, then redaction
        sink.flush()
        out = sink.buffer
        with os.fdopen(fd, "rb", buffering=0) as source:
            while chunk := source.read(65536):
                data = stream.feed(chunk) if stream else chunk
                if data:
                    out.write(data)
                    out.flush()
        if stream:
            out.write(stream.finish())
        out.flush()

    def finish(self) -> None:
        for thread in self._threads:
            thread.join(30)


class TerminalGuard:
    """egress's terminal for the run: its own lines always get out, and it is put back after.

    The command shares the terminal: with TOSTOP set it can make its own process group the
    foreground one (setpgid, tcsetpgrp), and egress, now in the background, would be stopped
    by SIGTTOU on its next report line (the red-team review hid every EGRESS_BLOCKED line this
    way, and hung a run). egress ignores SIGTTOU for the run (a background write then goes
    through), and afterwards puts back the foreground group and the terminal's modes.
    """

    def __init__(self) -> None:
        self.fd = next((fd for fd in (2, 0, 1) if _isatty(fd)), None)
        self.state = None
        self.previous = None
        if self.fd is None:
            return
        import termios

        try:
            self.state = (os.tcgetpgrp(self.fd), termios.tcgetattr(self.fd))
        except (OSError, termios.error):
            self.state = None
        try:
            self.previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        except ValueError:  # not the main thread: cannot change dispositions
            self.previous = None

    def restore(self) -> None:
        if self.state is not None:
            import termios

            group, modes = self.state
            try:
                termios.tcsetattr(self.fd, termios.TCSADRAIN, modes)
                os.tcsetpgrp(self.fd, group)
            except (OSError, termios.error):
                pass  # the terminal is gone, or was handed on: nothing of ours to put back
        if self.previous is not None:
            signal.signal(signal.SIGTTOU, self.previous)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def forward_signals(box) -> dict:
    """Signals sent to egress reach the command (Ctrl-C from a terminal reaches it directly)."""
    def forward(number, _frame):
        if number in (signal.SIGINT, signal.SIGQUIT) and _terminal_sent_it():
            return  # the terminal signalled the whole foreground group, the command included
        box.signal(number)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        try:
            previous[sig] = signal.signal(sig, forward)
        except (ValueError, OSError):  # not the main thread
            pass
    return previous


def _terminal_sent_it() -> bool:
    """True if we are in the terminal's foreground process group (so the command is too)."""
    for fd in (0, 1, 2):
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


def restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
