"""Which paths the sandboxed command can change: path arithmetic on the real filesystem.

The command may write anything below its writable trees, symlinks included, so a
path is the command's to change if its resolution steps anywhere inside one of
them: the path as written, any entry met on the way (every symlink among them,
and the folders that a later symlink could replace) or where it ends up.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

MAX_LINK_HOPS = 40  # the kernel's limit (MAXSYMLINKS): past it a path does not resolve


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _within(path: str, tree: str) -> bool:
    """``path`` is ``tree`` or below it, component by component, as written ('..' kept)."""
    parts, root = _parts(path), _parts(tree)
    return parts[:len(root)] == root


def resolution_steps(path: str) -> list[str] | None:
    """Every location resolving absolute ``path`` steps on, in order, ending with where it lands.

    Symlinks are followed as the kernel does (their targets are walked in turn); a
    missing component is taken as written. None when the path cannot be followed
    (a link loop, an unreadable entry): the caller must assume the worst.
    """
    pending = _parts(path)[::-1]
    current = "/"  # always free of symlinks, so '..' is its real parent
    steps: list[str] = []
    hops = 0
    while pending:
        part = pending.pop()
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        steps.append(candidate)
        try:
            mode = os.lstat(candidate).st_mode
        except (FileNotFoundError, NotADirectoryError):
            current = candidate
            continue
        except OSError:
            return None
        if not stat.S_ISLNK(mode):
            current = candidate
            continue
        hops += 1
        if hops > MAX_LINK_HOPS:
            return None
        try:
            target = os.readlink(candidate)
        except OSError:
            return None
        if target.startswith("/"):
            current = "/"
        pending.extend(_parts(target)[::-1])
    steps.append(current)
    return steps


def command_writable(path: str | os.PathLike, trees: Iterable[str | os.PathLike]) -> bool:
    """True if the command, able to write below ``trees``, can change what ``path`` reads.

    The trees count as given and by their realpath (a tree may itself be a symlink).
    Relative paths are taken from the current folder. Anything that cannot be
    followed counts as writable: the answer fails closed.
    """
    here = os.getcwd()
    path = os.path.join(here, os.fspath(path))  # absolute, not normalized: '..' stays
    roots = set()
    for tree in trees:
        tree = os.path.join(here, os.fspath(tree))
        roots.update((tree, os.path.realpath(tree)))

    def inside(location: str) -> bool:
        return any(_within(location, root) for root in roots)

    if inside(path):
        return True
    steps = resolution_steps(path)
    return steps is None or any(map(inside, steps))
