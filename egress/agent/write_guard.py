"""The redaction write guard: a file read through redaction is not written back with its placeholders.

An agent that reads ``config.env`` through ``egress redact`` (or ``egress run --redact``) sees
``API_TOKEN=[redacted:env-secret]``; if it then writes the file back, edited, the real token is
gone, replaced by the placeholder. :func:`clobbers` compares the new content with the file as
it is: a ``[redacted:<kind>]`` placeholder in a changed line, where the file's corresponding
line holds a value at that place (the placeholder's line with the placeholder as a wildcard
matches it, and what the wildcard covers is not itself a placeholder), is a clobber, named by
its line. Lines are paired by difflib's matching of the two texts, so moved and edited lines are
still compared with their old selves; a placeholder on a line that replaces nothing (an insert),
or one the file already holds, is not a clobber. Pure but for :func:`guarded_write`.
"""

from __future__ import annotations

import difflib
import os
import re

PLACEHOLDER = re.compile(r"\[redacted:[^\]\n]{1,100}\]")


class Clobber:
    """A placeholder that would replace a value: where, in the new text and in the file."""

    __slots__ = ("line", "old_line", "placeholder")

    def __init__(self, line: int, old_line: int, placeholder: str):
        self.line = line  # 1-based, in the new content
        self.old_line = old_line  # 1-based, in the file as it is
        self.placeholder = placeholder

    def __str__(self) -> str:
        return (f"line {self.line} writes {self.placeholder} where the file's line {self.old_line} holds a value "
                f"(the file was read through redaction; edit it without the placeholder)")


class WriteRefused(Exception):
    def __init__(self, path: str, clobbers: list[Clobber]):
        self.path = path
        self.clobbers = clobbers
        super().__init__(f"{path}: " + "; ".join(map(str, clobbers)))


def clobbers(old: str, new: str) -> list[Clobber]:
    """Every placeholder in ``new`` that would replace a value ``old`` holds (see the module's doc)."""
    if "[redacted:" not in new:
        return []
    old_lines, new_lines = old.splitlines(), new.splitlines()
    found: list[Clobber] = []
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "replace":
            continue  # equal: the file already says so; insert: nothing replaced; delete: no new line
        for j in range(j1, j2):
            line = new_lines[j]
            if "[redacted:" not in line:
                continue
            hit = _replaced_value(line, old_lines, i1, i2, i1 + (j - j1))
            if hit is not None:
                found.append(Clobber(j + 1, hit[0] + 1, hit[1]))
    return found


_ASSIGNED = re.compile(r"""(?:[\w.-]+|"[^"]*"|'[^']*')\s*[=:]\s*["']?$""")


def _replaced_value(line: str, old_lines: list[str], i1: int, i2: int, near: int) -> tuple[int, str] | None:
    """(old line index, placeholder) where ``line``'s placeholders cover a value in old_lines[i1:i2]."""
    parts = PLACEHOLDER.split(line)
    holders = PLACEHOLDER.findall(line)
    if not holders:
        return None
    body = "".join(re.escape(part) + (r"(.+?)" if k < len(holders) else "") for k, part in enumerate(parts))
    pattern = re.compile(r"\s*" + body.strip() + r"\s*") if body.strip() else None
    # Nearest first: the old line at the same offset in the block, then the others.
    order = sorted(range(i1, i2), key=lambda i: abs(i - near))
    for i in order:
        old = old_lines[i]
        match = pattern.fullmatch(old) if pattern is not None else None
        if match is None:
            continue
        for k, value in enumerate(match.groups()):
            if not PLACEHOLDER.fullmatch(value.strip()):
                return i, holders[k]
    # The rest of the line edited too (a comment added): an assignment's placeholder, `NAME=`,
    # `"key": "`, whose old line assigns a value there.
    for k, holder in enumerate(holders):
        assigned = _ASSIGNED.search(parts[k])
        if assigned is None:
            continue
        prefix = assigned.group(0)
        for i in order:
            at = old_lines[i].find(prefix)
            if at < 0:
                continue
            rest = old_lines[i][at + len(prefix):]
            if rest.strip() and not rest.lstrip().startswith("[redacted:"):
                return i, holder
    # A line that is only a placeholder (a redacted key block, a bare token) stands for lines
    # that the redaction took whole: refused when the block replaced holds anything that is not one.
    for i in order:
        if PLACEHOLDER.fullmatch(line.strip()) and old_lines[i].strip() and not PLACEHOLDER.fullmatch(
                old_lines[i].strip()):
            return i, holders[0]
    return None


def guarded_write(path: str, new: bytes) -> None:
    """Write ``new`` to ``path`` (atomically, keeping its mode) unless a placeholder in it would
    replace a value the file holds: then raise WriteRefused and leave the file as it is."""
    try:
        with open(path, "rb") as f:
            old = f.read()
    except FileNotFoundError:
        old = b""
    found = clobbers(old.decode("utf-8", "surrogateescape"), new.decode("utf-8", "surrogateescape"))
    if found:
        raise WriteRefused(path, found)
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f".{os.path.basename(path)}.egress-{os.urandom(4).hex()}")
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
