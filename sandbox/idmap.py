"""Who a rootful container runs as, and the project as that user sees it: an idmapped mount of it.

The container's user is no account of the host. Rootful podman and docker map no ids: the
container's uid is the host's uid, so the old fixed 1000 was the host's first human user, whose
user keyring the container could read (N5: keyrings are per uid, not per namespace), whose files
it could reach through any mount, and whose processes could signal it. container_ids() picks
ids no one else holds: from FIRST_ID (2,000,000,000) up, the first ids that are no user's and no
group's in the user database (looked up by id, so NSS sources that do not enumerate count too),
in nobody's subordinate range (/etc/subuid, /etc/subgid: rootless podman, docker's userns-remap
and LXD run containers as those), and that no process of egress's PID namespace runs with (the
containers of other runs live in PID namespaces of their own, and share the ids). The range is
above the ids systemd hands out without recording them (dynamic users 61184-65519, nspawn's
container ids up to 1879048191), below its "foreign" range (2147352576 up), and below 2^31,
which some programs read as a signed int. The same ids every run on one machine, so a --persist
volume stays its owner's.

Rootful podman cannot then write a project owned by the person who ran egress (and a project
made writable for it is writable for everyone). An idmapped mount (Linux 5.12+,
mount_setattr(MOUNT_ATTR_IDMAP)) translates ids on one mount only: through it the owner's files
show as the container's uid:gid, and what the container's user creates is stored as the owner's.
The host's files and every other mount keep their ids. The view is nosuid and nodev, and so is
nosuid_view's copy of a writable --mount: a set-id file made anyway gives nothing.

    uid, holder = container_ids()
    attached = owner_mapped("/home/ann/project", "/run/egress-container-x/work", uid, uid)
    ... podman run --user UID:UID --mount type=bind,src=/run/egress-container-x/work,dst=/work ...
    detach(attached)

Why egress makes it, not the engine: podman 4.3.1 passes `--mount ...,idmap` to the OCI runtime
as a mount option, which crun reads and runc 1.1 does not (idmapped mounts came with runc 1.2):
runc hands the unknown word to mount(2) as data, which a bind mount ignores, so the project would
be mounted unmapped without a word. crun is not usable on these machines (it needs
CAP_SYS_RESOURCE for its rlimits). A bind mount of an idmapped mount keeps its mapping, so the
engine's plain bind of the mapped copy gives the container the mapped view whatever its runtime.

The mapping is one id each way: only the owner's files are the container user's; files of other
users show as the overflow id (65534) and stay as writable as "others" may. Only root can make
these mounts (CAP_SYS_ADMIN over the mount), which is when podman maps no ids.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys

from sandbox import _libc, mounts

_MOUNT_ATTR_IDMAP = 0x00100000
_MNT_DETACH = 2
_UMOUNT_NOFOLLOW = 8  # linux/fs.h

# A process whose only purpose is to own a user namespace while its maps are written: the
# mapping is read from /proc/PID/ns/user, and the namespace lives on in that descriptor.
_NAMESPACE_HOLDER = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.unshare(0x10000000) != 0:\n"  # CLONE_NEWUSER
    "    sys.stderr.write(os.strerror(ctypes.get_errno())); sys.exit(1)\n"
    "os.write(1, b'u')\n"
    "os.read(0, 1)\n"
)


FIRST_ID = 2_000_000_000
_SUBORDINATE = ("/etc/subuid", "/etc/subgid")


class Refused(OSError):
    """The project is not one egress may show to the container's user as its owner's."""


def container_ids(count: int = 2, first: int = FIRST_ID) -> list[int]:
    """``count`` ids, each free as a uid and as a gid (see the module's docstring), lowest first
    from ``first``: the command's, then docker's holder's."""
    import grp
    import pwd

    taken = _ids_of_processes()
    ranges = _subordinate_ranges()
    found, candidate = [], first
    while len(found) < count:
        free = candidate not in taken and not any(start <= candidate < end for start, end in ranges)
        for lookup in (pwd.getpwuid, grp.getgrgid) if free else ():
            try:
                lookup(candidate)
                free = False
            except KeyError:
                pass
        if free:
            found.append(candidate)
        candidate += 1
    return found


def _subordinate_ranges() -> list[tuple[int, int]]:
    """[start, end) of every range in /etc/subuid and /etc/subgid."""
    ranges = []
    for path in _SUBORDINATE:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(":")
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                ranges.append((int(fields[1]), int(fields[1]) + int(fields[2])))
    return ranges


def _ids_of_processes() -> set[int]:
    """Every uid and gid (real, effective, saved, filesystem, supplementary) of the processes in
    this PID namespace."""
    try:
        ours = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ours = None
    ids: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if ours is not None and os.stat(f"/proc/{name}/ns/pid").st_ino != ours:
                continue
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith(("Uid:", "Gid:", "Groups:")):
                        ids.update(int(v) for v in line.split()[1:])
        except (OSError, ValueError):
            continue  # it ended
    return ids


def nosuid_view(source: str, target: str) -> str:
    """Attach at ``target`` (an empty folder, or an empty file for a file) a copy of the mount tree
    at ``source``, every mount of it nosuid and nodev; the ids are the host's. Returns target.
    Raises OSError (nothing attached)."""
    tree = mounts._clone(source)
    try:
        try:
            mounts._setattr(tree, "", mounts._MOUNT_ATTR_NOSUID | mounts._MOUNT_ATTR_NODEV, 0,
                            mounts._AT_EMPTY_PATH | mounts._AT_RECURSIVE)
        except OSError as e:
            raise OSError(e.errno, f"mount_setattr(MOUNT_ATTR_NOSUID): {os.strerror(e.errno)}") from None
        mounts._move(tree, target)
    finally:
        os.close(tree)
    return target


def owner_mapped(source: str, target: str, uid: int, gid: int) -> str:
    """Attach at ``target`` (an empty folder) a copy of the mount tree at ``source`` through which
    the files of source's owner show as uid:gid, and what uid:gid creates there is the owner's.
    Returns target. Raises Refused (a project owned by root, by a user egress cannot look up, or
    in a group that is not its owner's: owner_group), or OSError (nothing attached).

    ``source`` is opened once, and the owner checked and the tree cloned through that one
    descriptor: looked up by path twice, a project whose parent its owner can write could be
    swapped for a symlink to a root-owned folder in between, which the container's user would
    then own (a red-team race won in ~1 of 150 tries)."""
    try:
        folder = os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"cannot open the project {source}: {os.strerror(e.errno)}") from None
    try:
        info = os.fstat(folder)
        if info.st_uid == 0:
            # The container's user would write as root here: a setuid file it left would run as root.
            raise Refused(errno.EPERM, f"the project {source} is owned by root")
        owner_gid = owner_group(info.st_uid, info.st_gid)
        tree = _libc.syscall(mounts._SYS_OPEN_TREE, folder, b"", mounts._OPEN_TREE_CLONE | mounts._OPEN_TREE_CLOEXEC
                             | mounts._AT_RECURSIVE | mounts._AT_EMPTY_PATH)
    finally:
        os.close(folder)
    try:
        userns = user_namespace(f"{info.st_uid} {uid} 1", f"{owner_gid} {gid} 1")
        try:
            attr = mounts._MountAttr(_MOUNT_ATTR_IDMAP | mounts._MOUNT_ATTR_NOSUID | mounts._MOUNT_ATTR_NODEV,
                                     0, 0, userns)
            try:
                _libc.syscall(mounts._SYS_MOUNT_SETATTR, tree, b"", mounts._AT_EMPTY_PATH | mounts._AT_RECURSIVE,
                              ctypes.byref(attr), ctypes.sizeof(attr))
            except OSError as e:  # EINVAL: a filesystem without idmapped mounts (ramfs, NFS, ...) below source
                why = "; its filesystem has no idmapped mounts" if e.errno == errno.EINVAL else ""
                raise OSError(e.errno, f"mount_setattr(MOUNT_ATTR_IDMAP): {os.strerror(e.errno)}{why}") from None
            mounts._move(tree, target)
        finally:
            os.close(userns)
    finally:
        os.close(tree)
    return target


def owner_group(owner: int, folder_gid: int) -> int:
    """The project folder's group, which the container's group stands for, once known to be one of
    its owner's (by the user database) and not root's. Mapped, it is the group the container's files
    get and setgid ones run as: a project chowned to a user but left in group root gave egid 0 (a
    red-team finding). (Mapping the owner's primary group instead, over a folder of another group,
    left the owner's own folder unwritable through the mount: measured on Linux 6.18.) Raises
    Refused if the owner is not in the user database (its groups cannot be told), or the group is
    not one of its own."""
    import pwd

    try:
        entry = pwd.getpwuid(owner)
    except KeyError:
        raise Refused(errno.EPERM, f"its owner, uid {owner}, has no entry in the user database, so egress "
                                   f"cannot tell which groups it may write as") from None
    if folder_gid == 0 or folder_gid not in os.getgrouplist(entry.pw_name, entry.pw_gid):
        raise Refused(errno.EPERM, f"its group, gid {folder_gid}, is not one of its owner {entry.pw_name}'s own "
                                   f"groups (chgrp it to one, e.g. {entry.pw_gid})")
    return folder_gid


def user_namespace(uid_map: str, gid_map: str) -> int:
    """A descriptor of a new user namespace with these maps (lines "INSIDE OUTSIDE COUNT").
    Raises OSError."""
    holder = subprocess.Popen([sys.executable, "-I", "-S", "-c", _NAMESPACE_HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True)
    try:
        if holder.stdout.read(1) != b"u":
            holder.wait()
            why = holder.stderr.read().decode(errors="replace").strip() or f"status {holder.returncode}"
            raise OSError(f"cannot make a user namespace: {why}")
        for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
            with open(f"/proc/{holder.pid}/{name}", "w") as f:
                f.write(text)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.stdin.close()  # it ends; the namespace lives on in the descriptor
        holder.wait()
        holder.stdout.close()
        holder.stderr.close()


def detach(target: str) -> None:
    """Take the mount at ``target`` away (lazily: a process still inside keeps its view). A
    symlink at ``target`` is never followed (UMOUNT_NOFOLLOW): EINVAL."""
    if _libc._libc.umount2(target.encode(), _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")
