"""Which paths the sandboxed command can change: path arithmetic on the real filesystem.

The command may write anything below its writable trees, symlinks included, so a
path is the command's to change if its resolution steps anywhere inside one of
them: the path as written, any entry met on the way (every symlink among them,
and the folders that a later symlink could replace) or where it ends up.

A file can also be the command's by another name than its path (red team N11: a policy
file outside the project, hard-linked into it, was edited through the link and reloaded):

- a hard link: a regular file with more than one link counts as the command's. Where its
  other names lie cannot be known without walking every writable tree for its inode (a
  project with node_modules holds hundreds of thousands of files: seconds, at every run),
  so the answer fails closed. The command cannot make such a link itself: link() across
  mounts fails (EXDEV), and everything outside its trees is another mount in the sandbox.
- a mount: a folder or file mounted (bound) inside a writable tree from elsewhere, or a
  writable tree reachable elsewhere through a bind mount, shows the same files under two
  paths. /proc/self/mountinfo says, for each mount, which folder of which file system it
  shows; a location whose folder of its file system lies within what a writable tree (or a
  mount inside one) shows is the command's. That is a read of one small file, not a walk.
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


def pinned_chain(islands: Iterable[str], trees: Iterable[str]) -> list[str]:
    """The folders strictly between a writable tree and each island inside it, outermost first."""
    chain: list[str] = []
    for island in islands:
        for tree in trees:
            if island != tree and _within(island, tree):
                parts = island[len(tree.rstrip("/")) + 1:].split("/")[:-1]
                for depth in range(1, len(parts) + 1):
                    folder = os.path.join(tree, *parts[:depth])
                    if folder not in chain:
                        chain.append(folder)
    return sorted(chain, key=len)


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


def command_writable(path: str | os.PathLike, trees: Iterable[str | os.PathLike],
                     read_only: Iterable[str | os.PathLike] = ()) -> bool:
    """True if the command, able to write below ``trees``, can change what ``path`` reads.

    The trees count as given and by their realpath (a tree may itself be a symlink).
    ``read_only``: real folders inside the trees that the sandbox mounts read-only.
    Relative paths are taken from the current folder. Anything that cannot be
    followed counts as writable: the answer fails closed.
    """
    here = os.getcwd()
    path = os.path.join(here, os.fspath(path))  # absolute, not normalized: '..' stays
    roots = set()
    for tree in trees:
        tree = os.path.join(here, os.fspath(tree))
        roots.update((tree, os.path.realpath(tree)))
    islands = [os.path.realpath(os.path.join(here, os.fspath(p))) for p in read_only]
    # Mount points inside the sandbox (sandbox.mounts): the folders leading to an island and
    # the trees holding one cannot be renamed or replaced by the command.
    real_roots = [r for r in roots if any(_within(i, r) for i in islands)]
    pinned = set(pinned_chain(islands, real_roots)) | set(real_roots)

    def inside(location: str) -> bool:
        return (any(_within(location, root) for root in roots) and location not in pinned
                and not any(_within(location, island) for island in islands))

    if inside(path):
        return True
    steps = resolution_steps(path)
    if steps is None or any(map(inside, steps)):
        return True
    return _linked(steps[-1]) or _mounted_inside(steps, roots, inside)


def _linked(location: str) -> bool:
    """A regular file with another name (a hard link) that may lie in a writable tree."""
    try:
        info = os.stat(location)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat.S_ISREG(info.st_mode) and info.st_nlink > 1


def _mounted_inside(steps: list[str], roots: Iterable[str], inside) -> bool:
    """Whether a location of ``steps`` has another name inside a root through a mount (a bind
    mount of it in the tree, or of the tree elsewhere), that name being the command's (``inside``:
    islands stay read-only whatever name they are reached by)."""
    table = mount_table()
    if table is None:  # no /proc/self/mountinfo (macOS): no bind mounts to follow
        return False
    points = {point: (folder, device) for point, folder, device in table}  # the last mount on a point hides the others
    views = []  # (path, device, folder of that file system shown there), as parts: each tree, each mount in one
    for root in {os.path.realpath(r) for r in roots}:
        tree = tuple(_parts(root))
        views.append((tree, *_on_file_system(tree, points)))
        views += [(point, device, folder) for point, folder, device in table
                  if len(point) > len(tree) and point[:len(tree)] == tree]
    devices = {device for _, device, _ in views}
    for location in steps:
        parts = tuple(_parts(location))
        device, folder = _on_file_system(parts, points)
        if device not in devices:
            continue
        for path, shown_device, shown in views:
            if device == shown_device and folder[:len(shown)] == shown:
                name = path + folder[len(shown):]
                if name != parts and inside("/" + "/".join(name)):
                    return True
    return False


_parsed: tuple[bytes, list] = (b"", [])  # mount_table's last text and what it read from it


def mount_table() -> list[tuple[tuple[str, ...], tuple[str, ...], bytes]] | None:
    """(mount point, the folder of its file system it shows, the file system's device
    b"major:minor") for each mount of this process's namespace in mount order, paths as their
    parts; None where there is no /proc/self/mountinfo."""
    global _parsed
    try:
        with open("/proc/self/mountinfo", "rb") as file:
            text = file.read()
    except OSError:
        return None
    if _parsed[0] == text:  # a run asks for each policy and secret file: parse once while mounts stay
        return _parsed[1]
    table = []
    for line in text.splitlines():
        fields = line.split(b" ", 5)
        if len(fields) < 5:
            continue
        root, point = fields[3], fields[4]
        if b"\\" in line:  # a space, tab, newline or backslash in a path: written as \ooo
            root, point = _unescape(root), _unescape(point)
        table.append((tuple(_parts(os.fsdecode(point))), tuple(_parts(os.fsdecode(root))), fields[2]))
    _parsed = (text, table)
    return table


def _unescape(field: bytes) -> bytes:
    """mountinfo's \\ooo escapes decoded (without `re`: egress run's path imports none, ~3 ms)."""
    parts = field.split(b"\\")
    out = [parts[0]]
    for part in parts[1:]:
        code = part[:3]
        if len(code) == 3 and all(48 <= c <= 55 for c in code):
            out.append(bytes([int(code, 8) & 0xFF]) + part[3:])
        else:
            out.append(b"\\" + part)
    return b"".join(out)


def _on_file_system(parts: tuple[str, ...], points: dict) -> tuple[bytes, tuple[str, ...]]:
    """(device, folder of that file system) that an absolute path (as its ``parts``) shows, through
    the mount on the longest mount point holding it (``points``: mount point -> (folder, device),
    the last mount on each point)."""
    for depth in range(len(parts), -1, -1):
        mount = points.get(parts[:depth])
        if mount is not None:
            return mount[1], mount[0] + parts[depth:]
    return b"", parts


def own_code(code_dirs: Iterable[str], import_path: Iterable[str], trees: Iterable[str]) -> tuple[list[str], list[str]]:
    """What of egress's own code the command could rewrite, and what to do about it.

    The proxy of `egress run` imports most of its code (mitmproxy, egress's addons, the
    built-in policies) only when the command first connects: code inside a writable tree
    (an editable install of the project, a virtual environment in it) would be the
    command's to replace, and would then run outside the sandbox. Returns
    (folders to mount read-only inside the sandbox: ``code_dirs`` and ``import_path``
    entries lying below a writable tree, as real paths;
    ``import_path`` entries to drop from sys.path: those that *are* or contain a writable
    tree, which cannot be made read-only without taking the project away).
    """
    real_trees = [os.path.realpath(t) for t in trees]
    protect: list[str] = []
    drop: list[str] = []
    for entry in import_path:
        real = os.path.realpath(entry or ".")
        if any(real == t or _within(t, real) for t in real_trees):
            drop.append(entry)
        elif any(_within(real, t) for t in real_trees) and os.path.isdir(real) and real not in protect:
            protect.append(real)
    for folder in code_dirs:
        real = os.path.realpath(folder)
        # strictly below a tree: a code folder that is (or holds) the project cannot be made read-only
        if any(_within(real, t) and real != t for t in real_trees) and os.path.isdir(real) and real not in protect:
            protect.append(real)
    # one mount covers what lies below it (a venv's root covers its site-packages)
    protect = [p for p in protect if not any(p != q and _within(p, q) for q in protect)]
    return protect, drop
