"""The command's view of the filesystem: the host read-only, its own trees writable, doors closed.

Landlock confines writes to file *contents* and names; it does not mediate chmod, chown,
utime or extended attributes, nor connect() to a Unix socket file. Both were ways out:
`os.chmod("../victim", 0o4777)` succeeded outside the project (as root, /etc/shadow too),
and a host socket that relays to TCP, the docker daemon or an ssh-agent reached past the
network namespace. The mount namespace the sandbox already has closes both:

1. every writable tree is cloned (open_tree) before anything changes, so it can be put back
   where it was even when a mask below hides its parent;
2. the whole host tree is made read-only (one recursive mount_setattr): chmod, chown, utime,
   xattrs, writes and creations anywhere fail with EROFS, whatever the caller's uid;
3. the folders where sockets and shared scratch live are replaced by empty, read-only tmpfs
   mounts: /tmp, /var/tmp, /run (and /var/run when it is not a link to /run); the writable
   trees that lay inside them are attached again at the same paths;
4. /dev/shm becomes a private tmpfs (what the command leaves there dies with it);
5. `hidden` folders (egress's state: the run's control socket, the CA's private key) show as
   empty; `replaced` files (secrets bound to hosts) show other contents (their placeholder);
   the folders leading to a covered path from a writable tree are pinned as mount points;
6. every pathname socket of the host found when the run starts (see host_sockets: the ones
   /proc/net/unix lists, read before the namespaces are made, and every socket file in the
   folders they lie in and in ~/.ssh, ~/.gnupg, ~/.docker) and still visible gets an empty
   read-only file mounted over it: connect() then fails with EACCES.

Why mounts rather than seccomp for sockets: a classic-BPF filter cannot read the address
passed to connect(), and refusing socket(AF_UNIX) would break every program that runs a
server of its own (databases in tests, multiprocessing managers). What remains reachable:
a socket that a host program binds *after* the run started, outside the masked folders
(for example in the home folder). A Landlock right for socket lookups
(LANDLOCK_ACCESS_FS_RESOLVE_UNIX, merged in 2026) would close that; this kernel generation
lacks it.

The new mounts are owned by the sandbox's user namespace; copied into any namespace the
command makes, the kernel locks them (MNT_LOCKED, MNT_LOCK_READONLY): it can neither unmount
a mask nor make the host writable again.

Costs (this VM, 20 mounts, 3 sockets): measured in the launcher benchmark, see bench/README.md.
Only stdlib and ctypes: this runs in the sandbox's init, a forked copy of the caller.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable, Mapping

from sandbox import _libc
from sandbox.paths import pinned_chain

# Syscall numbers of the mount API (Linux 5.2+, mount_setattr 5.12+): the same on every
# architecture using the unified table (x86_64, aarch64, riscv64).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
_SYS_MOUNT_SETATTR = 442

_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_FSOPEN_CLOEXEC = 1
_FSMOUNT_CLOEXEC = 1
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4

MS_NOSUID = 0x2
MS_NODEV = 0x4
_MS_NOEXEC = 0x8

# Where host programs keep their sockets (ssh-agent, tmux, X11, docker, podman, dbus,
# systemd, user runtime folders) and shared scratch: shown empty inside.
MASKED = ("/tmp", "/var/tmp", "/run", "/var/run")
PRIVATE_SHM = "/dev/shm"
_SHM_SIZE = "size=50%"  # tmpfs' own default, said explicitly


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def host_sockets(home: str | None = None, skip: Iterable[str] = (), table: str = "/proc/net/unix") -> list[str]:
    """Paths of the host's pathname sockets to cover, read in the caller's network namespace.

    /proc/net/unix names each socket as it was *bound*, which is not always where it is now:
    OpenSSH's ControlMaster binds a temporary name, links it to the ControlPath and unlinks
    the first (the red-team review reached remote hosts through one in ~/.ssh), and a name
    bound relative to the binder's working folder is listed relative. So the answer is:
    every listed absolute name; relative names joined to the working folder of a process
    holding that socket; and every socket file found in the folders those names lie in and
    in the home folder's usual socket folders (.ssh, .gnupg, .docker). Folders in `skip`
    (masked anyway) are not searched.
    """
    try:
        with open(table, "rb") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    named, relative = [], {}
    for line in lines:
        fields = line.split(None, 7)
        if len(fields) < 8 or fields[7].startswith(b"@"):  # unnamed, or abstract (per network namespace)
            continue
        name = os.fsdecode(fields[7])
        if name.startswith("/"):
            named.append(name)
        else:
            relative[fields[6].decode()] = name  # socket inode -> name as bound
    if relative:
        named += _resolve_relative(relative)
    folders = {os.path.dirname(p) for p in named}
    if home:
        folders.update(os.path.join(home, d) for d in (".ssh", ".gnupg", ".docker", ".docker/run"))
    found = set(named)
    for folder in folders:
        if any(_within(folder, m) for m in skip):
            continue
        try:
            with os.scandir(folder) as entries:
                found.update(e.path for e in entries if _entry_is_socket(e))
        except OSError:
            continue
    return sorted(found)


def _entry_is_socket(entry: os.DirEntry) -> bool:
    try:
        return stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return False


def _resolve_relative(relative: dict[str, str]) -> list[str]:
    """Join each relatively bound socket's name to the working folder of a process holding it.

    Walks /proc/PID/fd only when such a socket exists (rare: a name bound after chdir to
    fit the 108-byte limit); processes we may not inspect are skipped.
    """
    wanted = {f"socket:[{inode}]": name for inode, name in relative.items()}
    paths = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                name = wanted.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
                if name is not None:
                    paths.append(os.path.join(os.readlink(f"/proc/{pid}/cwd"), name))
        except OSError:
            continue
    return paths


def build_view(writable: Iterable[str], *, read_only_host: bool, mask_tmp: bool, readable: Iterable[str] = (),
               read_only: Iterable[str] = (), hidden: Iterable[str] = (), replaced: Mapping[str, bytes] | None = None,
               sockets: Iterable[str] = ()) -> None:
    """Make the calling process's (private) mount namespace the command's view. Raises OSError.

    `writable` trees stay writable, and visible even inside masked folders; `readable` trees
    (the working directory) stay visible, read-only; `read_only` folders inside writable
    trees are shown read-only (egress's own code, which its proxy imports later); with `read_only_host` everything else is
    read-only; `mask_tmp` masks /tmp and /var/tmp too (without it, as with
    --no-fs-confinement, where writes may go anywhere, only /run is masked).
    """
    trees = sorted({os.path.realpath(p) for p in writable}, key=len)
    for path in trees:
        if not os.path.isdir(path):
            raise OSError(errno.ENOENT, f"writable path {path}: no such folder")
    masks = [m for m in _existing_dirs(MASKED if mask_tmp else ("/run", "/var/run"))
             if not any(_within(m, t) for t in trees)]
    shown = [p for p in {os.path.realpath(p) for p in readable} if os.path.isdir(p)
             and any(_within(p, m) for m in masks) and not any(_within(p, t) for t in trees)]
    # Cloned before anything changes: a tree under a mask is put back from its clone.
    clones = [(path, _clone(path), True) for path in trees] + [(path, _clone(path), False) for path in shown]
    clones.sort(key=lambda c: len(c[0]))
    try:
        if read_only_host:
            _setattr(_AT_FDCWD, "/", _MOUNT_ATTR_RDONLY, 0, _AT_RECURSIVE)
        for folder in masks:
            _libc.mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        for path, clone, rw in clones:
            if not rw:
                _setattr(clone, "", _MOUNT_ATTR_RDONLY, 0, _AT_EMPTY_PATH | _AT_RECURSIVE)
            if not os.path.isdir(path):  # it lay under a mask: make its mount point
                os.makedirs(path, mode=0o755, exist_ok=True)
            _move(clone, path)
        if os.path.isdir(PRIVATE_SHM):  # before the covered paths are listed: what lies there is gone
            _libc.mount("tmpfs", PRIVATE_SHM, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{_SHM_SIZE}")
        covered = _covered(hidden, replaced or {}, sockets)
        _pin_islands(read_only, covered, trees)
        for folder in masks:
            _setattr(_AT_FDCWD, folder, _MOUNT_ATTR_RDONLY, 0, 0)
    finally:
        for _, clone, _ in clones:
            os.close(clone)
    _cover(covered)


# The host's device files a program needs, bound into the view's own /dev (sandbox/grants.py's
# default deny: no /dev/vsock, /dev/kvm, /dev/fuse, /dev/log, nor the user's other terminals).
DEVICE_NAMES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}
_ATTACH_POINTS = ("/tmp", "/mnt", "/var/tmp", "/media")  # where the new root is put together


def build_granted_view(writable: Iterable[str], *, granted: Iterable[str], empty: Iterable[str] = (),
                       readable: Iterable[str] = (), read_only: Iterable[str] = (), hidden: Iterable[str] = (),
                       replaced: Mapping[str, bytes] | None = None, sockets: Iterable[str] = ()) -> None:
    """Make the calling process's (private) mount namespace a view built from an allow list, and
    make it its root (pivot_root): nothing of the host is there unless named. Raises OSError.

    `writable` trees are bound writable; `granted` and `readable` paths (folders or files) are
    bound read-only; `empty` folders exist, empty and read-only; /dev holds only DEVICE_NAMES, a
    devpts of the command's own (its ptys, none of the user's other terminals) and a private
    /dev/shm; /proc is the PID namespace's own. Every bind is nosuid and nodev. Then, as in
    build_view: `read_only` islands (folders or files) inside writable trees, `hidden`
    folders, `replaced` files and still-visible `sockets` are covered, the folders on the way
    to each pinned. The root itself is read-only: nothing can be created beside the grants.
    Paths named through symlinks (/bin -> usr/bin, /var/run -> /run, a project reached through
    a link) find the same links inside.
    """
    paths = _Resolver()
    trees = sorted({paths.real(p) for p in writable}, key=len)
    for path in trees:
        if not paths.is_dir(path):
            raise OSError(errno.ENOENT, f"writable path {path}: no such folder")
    shown: list[str] = []
    for path in sorted({paths.real(p) for p in (*readable, *granted)}, key=len):
        if paths.exists(path) and not any(_within(path, t) for t in trees) \
                and not any(_within(path, s) for s in shown if paths.is_dir(s)):
            shown.append(path)
    folders = [paths.real(p) for p in empty]
    covered_by_binds = [*trees, *(s for s in shown if paths.is_dir(s))]
    links = sorted(((link, target) for link, target in paths.links.items()
                    if not any(_within(link, tree) for tree in covered_by_binds)), key=lambda item: len(item[0]))
    # Cloned before anything changes: the attach point may hide some of them.
    clones = [(path, _clone(path), True) for path in trees] + [(path, _clone(path), False) for path in shown]
    clones.sort(key=lambda c: len(c[0]))
    folder_kind = {path: paths.is_dir(path) for path, _, _ in clones}  # before the attach point hides some
    devices = [(name, _clone(f"/dev/{name}")) for name in DEVICE_NAMES if os.path.exists(f"/dev/{name}")]
    # The command's own terminal (its devpts is not in the view) at /dev/console, as bubblewrap
    # does: ttyname() and `tty` find it there, and nothing else of the host's terminals is shown.
    terminal = next((fd for fd in (0, 1, 2) if _isatty(fd)), None)
    if terminal is not None:
        try:  # by its name in our copy of the host's mounts (a clone of the descriptor's own mount: EINVAL)
            devices.append(("console", _clone(os.ttyname(terminal))))
        except OSError:
            pass  # a terminal of another devpts: `tty` says "not a tty", nothing else changes
    host_proc = _clone("/proc")
    try:
        base = next(p for p in _ATTACH_POINTS if os.path.isdir(p) and not os.path.islink(p))
        _libc.mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for link, target in links:
            _make_link(base + link, target)
        for path, clone, rw in clones:
            _setattr(clone, "", _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | (0 if rw else _MOUNT_ATTR_RDONLY), 0,
                     _AT_EMPTY_PATH | _AT_RECURSIVE)
            _mount_point(base + path, folder_kind[path])
            _move(clone, base + path)
        for path in folders:
            os.makedirs(base + path, mode=0o755, exist_ok=True)
        _build_dev(base + "/dev", devices)
        os.makedirs(base + "/proc", exist_ok=True)
        if not _mount_own_proc(base + "/proc"):
            _move(host_proc, base + "/proc")  # a container whose /proc has masked entries refuses a new one
        os.chdir(base)
        _libc.pivot_root(".", ".")  # the old root now lies over the new one: detached next
        _libc.umount2(".", _libc.MNT_DETACH)
        os.chdir("/")
    finally:
        for _, clone, _ in clones:
            os.close(clone)
        for _, clone in devices:
            os.close(clone)
        os.close(host_proc)
    covered = _covered(hidden, replaced or {}, sockets)
    _pin_islands(read_only, covered, trees)
    _cover(covered)
    for mount in ("/dev", "/"):
        _setattr(_AT_FDCWD, mount, _MOUNT_ATTR_RDONLY, 0, 0)


class _Resolver:
    """Real paths, the symlinks met on the way to them, and what each is: one lstat per distinct
    prefix (the grants share /usr, /var/lib, the home folder), where os.path.realpath walked every
    component of every path again (0.6 ms of a 1 ms view)."""

    def __init__(self) -> None:
        self.links: dict[str, str] = {}  # each symlink met (its real location) -> its target
        self._real: dict[str, str] = {"/": "/"}
        self._modes: dict[str, int | None] = {}

    def real(self, path: str, _hops: int = 0) -> str:
        path = os.path.abspath(path)
        found = self._real.get(path)
        if found is not None:
            return found
        parent, name = os.path.split(path)
        candidate = os.path.join(self.real(parent, _hops), name)
        mode = self._mode(candidate)
        if mode is not None and stat.S_ISLNK(mode) and _hops < 40:  # the kernel's MAXSYMLINKS
            try:
                target = os.readlink(candidate)
            except OSError:
                target = None
            if target is not None:
                self.links.setdefault(candidate, target)
                candidate = self.real(os.path.join(os.path.dirname(candidate), target), _hops + 1)
        self._real[path] = candidate
        return candidate

    def exists(self, real: str) -> bool:
        return self._mode(real) is not None

    def is_dir(self, real: str) -> bool:
        mode = self._mode(real)
        return mode is not None and stat.S_ISDIR(mode)

    def _mode(self, path: str) -> int | None:
        if path not in self._modes:
            try:
                self._modes[path] = os.lstat(path).st_mode
            except OSError:
                self._modes[path] = None
        return self._modes[path]


def _make_link(where: str, target: str) -> None:
    os.makedirs(os.path.dirname(where), mode=0o755, exist_ok=True)
    try:
        os.symlink(target, where)
    except FileExistsError:
        pass


def _mount_point(where: str, folder: bool) -> None:
    """An empty folder or file at ``where`` in the new root, with its parents."""
    if folder:
        os.makedirs(where, mode=0o755, exist_ok=True)
        return
    os.makedirs(os.path.dirname(where), mode=0o755, exist_ok=True)
    os.close(os.open(where, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o444))


def _build_dev(dev: str, devices: list[tuple[str, int]]) -> None:
    """/dev with the host's ordinary devices, a devpts of the command's own and a private /dev/shm."""
    os.makedirs(dev, exist_ok=True)
    _libc.mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755,size=64k")
    for name, clone in devices:
        _mount_point(f"{dev}/{name}", folder=False)
        _move(clone, f"{dev}/{name}")
    for name, target in _DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/pts")
    # A new instance: the command's own ptys (pty.openpty, script, expect), none of the host's.
    _libc.mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | _MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    os.mkdir(f"{dev}/shm")
    _libc.mount("tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{_SHM_SIZE}")


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _mount_own_proc(where: str) -> bool:
    try:
        _libc.mount("proc", where, "proc", MS_NOSUID | MS_NODEV | _MS_NOEXEC)
        return True
    except OSError:
        return False


def _pin_islands(read_only: Iterable[str], covered: _Covered, trees: list[str]) -> None:
    """Each folder between a writable tree and an island (a read-only folder or file in it) or a
    covered path becomes a mount point of its own (a bind onto itself, still writable): a mount
    point cannot be renamed or removed (EBUSY), so the command cannot move the island away and put
    its own folder at the path the proxy imports from (or a `.git` of its own with hooks), nor move
    a hidden folder's parent away (the cover goes with it: measured, `mv ~/.local ~/.local2` with
    the state folder in a project at $HOME stuck on the host) and plant its own CA or control
    socket at the state folder's path for the next run. Then each island is put on read-only.
    No mount at all when nothing lies inside a writable tree."""
    islands = sorted({os.path.realpath(p) for p in read_only if os.path.lexists(p)}, key=len)
    for folder in pinned_chain([*islands, *covered.targets()], trees):
        try:
            _rebind(folder, read_only=False)
        except OSError as e:
            raise OSError(e.errno, f"cannot pin {folder} (a folder on the way to a hidden or read-only "
                                   f"path in a writable tree; the command could move it): {e.strerror}") from e
    for path in islands:
        _rebind(path, read_only=True)


def _rebind(folder: str, read_only: bool) -> None:
    """Mount `folder` (with what is mounted below it) onto itself, read-only or not."""
    tree = _clone(folder)
    try:
        if read_only:
            _setattr(tree, "", _MOUNT_ATTR_RDONLY, 0, _AT_EMPTY_PATH | _AT_RECURSIVE)
        _move(tree, folder)
    finally:
        os.close(tree)


def _within(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


class _Covered:
    """The paths to cover, by their real paths, as they are found once the writable trees are back."""

    def __init__(self, hidden: list[str], replaced: dict[str, bytes], sockets: list[str]):
        self.hidden, self.replaced, self.sockets = hidden, replaced, sockets

    def targets(self) -> list[str]:
        return [*self.hidden, *self.replaced, *self.sockets]


def _covered(hidden: Iterable[str], replaced: Mapping[str, bytes], sockets: Iterable[str]) -> _Covered:
    # Mount targets are named by their real paths: a mount over a link would not cover its target.
    hidden = [os.path.realpath(p) for p in hidden if os.path.isdir(p)]
    replaced = {os.path.realpath(p): data for p, data in replaced.items() if os.path.isfile(p)}
    sockets = [os.path.realpath(p) for p in sockets if _is_socket(p)]
    # What lies inside a hidden folder is hidden with it, and gone from the view once the
    # folder is covered: a mount onto it would fail (ENOENT) and stop the run. (The warm
    # proxy's socket lives in egress's state folder, which is hidden.)
    replaced = {p: data for p, data in replaced.items() if not any(_within(p, h) for h in hidden)}
    sockets = [p for p in sockets if not any(_within(p, h) for h in hidden)]
    return _Covered(hidden, replaced, sockets)


def _cover(covered: _Covered) -> None:
    """Mount an empty folder over each hidden one, other contents over each replaced file,
    an empty file over each socket; all from one detached read-only tmpfs."""
    hidden, replaced, sockets = covered.hidden, covered.replaced, covered.sockets
    if not (hidden or replaced or sockets):
        return
    staging = _tmpfs_detached()
    try:
        os.mkdir("empty", 0o555, dir_fd=staging)
        _write(staging, "nothing", b"")
        for index, data in enumerate(replaced.values()):
            _write(staging, f"file{index}", data)
        _setattr(staging, "", _MOUNT_ATTR_RDONLY, 0, _AT_EMPTY_PATH)
        for path in hidden:
            _attach(staging, "empty", path)
        for index, path in enumerate(replaced):
            _attach(staging, f"file{index}", path)
        for path in sockets:
            _attach(staging, "nothing", path)
    finally:
        os.close(staging)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False  # hidden by a mask already, or gone


def _existing_dirs(paths: Iterable[str]) -> list[str]:
    """The real folders among `paths`, each once (/var/run is usually a link to /run)."""
    found: list[str] = []
    for path in paths:
        if not os.path.islink(path) and os.path.isdir(path) and path not in found:
            found.append(path)
    return found


def _write(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444, dir_fd=dir_fd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


# --- the mount API, through raw syscalls (Python 3.11's os module has none of it) ----------


def _clone(path: str) -> int:
    """A detached copy of the mount tree at `path` (recursive: locked submounts come along)."""
    return _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, path.encode(),
                         _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE)


def _move(tree: int, target: str) -> None:
    _libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH)


def _attach(staging: int, name: str, target: str) -> None:
    """Bind staging/name onto target."""
    tree = _libc.syscall(_SYS_OPEN_TREE, staging, name.encode(), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    try:
        _move(tree, target)
    finally:
        os.close(tree)


def _setattr(dir_fd: int, path: str, set_: int, clear: int, flags: int) -> None:
    attr = _MountAttr(set_, clear, 0, 0)
    _libc.syscall(_SYS_MOUNT_SETATTR, dir_fd, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr))


def _tmpfs_detached() -> int:
    """A small tmpfs attached nowhere; its root as a descriptor."""
    fs = _libc.syscall(_SYS_FSOPEN, b"tmpfs", _FSOPEN_CLOEXEC)
    try:
        _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, b"size", b"1m", 0)
        _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, b"mode", b"0755", 0)
        _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0)
        return _libc.syscall(_SYS_FSMOUNT, fs, _FSMOUNT_CLOEXEC, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV)
    finally:
        os.close(fs)

