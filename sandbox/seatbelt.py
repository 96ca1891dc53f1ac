"""The Seatbelt (sandbox-exec) profile for one `egress run` on macOS: a pure function.

    text = profile(writable=["/Users/me/project", "/private/var/folders/x/T/egress-run-1"],
                   proxy_port=53117, sockets=["/private/var/folders/x/T/egress-run-1"])

Inputs are paths already canonical (:func:`canonical`: symlinks resolved, so /tmp and /var
appear as /private/tmp and /private/var, and on macOS the case stored on disk), the proxy's
port on 127.0.0.1 and a few options; the output is SBPL text for ``sandbox-exec -p``. Nothing
here reads the filesystem or the environment: the same inputs give the same profile, and the
golden tests in tests/sandbox/test_seatbelt.py hold whole profiles to that.

The profile denies by default and allows, rule by rule, what a command-line program needs;
docs/architecture.md ("The macOS sandbox") says what each rule is for. It was written for
egress after reading two public profiles that run real tools: OpenAI Codex's
``seatbelt_base_policy.sbpl`` and Anthropic's sandbox-runtime (``macos-sandbox-utils.ts``);
where egress differs (no DNS, no Launch Services, no trustd, no keychain, Unix sockets only
in the run's own folder) the architecture page says why.

Quoting: every path is written as an SBPL string literal by :func:`sbpl_string`. SBPL's reader
is a Scheme reader (TinyScheme): inside ``"..."`` only ``"`` ends the string and only ``\\``
starts an escape, so those two are escaped (``\\"``, ``\\\\``) and every other character,
newlines, parentheses, semicolons and non-ASCII included, stands for itself. No path can
close its string early, so none can add or remove a rule; a path with a NUL (no file system
allows one) is refused. tests/sandbox/test_seatbelt.py reads the profile back with an
s-expression reader of its own, for a table of hostile names.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence

# Mach services a command line program may look up; everything else (Launch Services, which
# opens URLs in a browser outside the sandbox; trustd, which fetches OCSP and CA issuers for
# whoever asks; the keychain; mDNSResponder, DNS) stays denied. Each is explained in
# docs/architecture.md.
MACH_SERVICES = (
    "com.apple.system.opendirectoryd.libinfo",  # getpwuid, getgrgid: user and group names
    "com.apple.system.opendirectoryd.membership",  # group membership (access checks, id)
    "com.apple.bsd.dirhelper",  # confstr(_CS_DARWIN_USER_TEMP_DIR) and friends
    "com.apple.system.logger",  # syslog(3) and asl
    "com.apple.logd",  # os_log: messages stay on the machine
    "com.apple.system.notification_center",  # notify(3): libc's time zone and configuration changes
    "com.apple.PowerManagement.control",  # IOPM assertions (caffeinate, build tools)
)

# Device files a program writes to without it being a write to anything kept.
DEVICES = ("/dev/null", "/dev/zero", "/dev/tty", "/dev/dtracehelper", "/dev/ptmx")


class ProfileError(ValueError):
    """An input the profile cannot express safely (a relative path, a NUL, a bad port)."""


def sbpl_string(text: str) -> str:
    """``text`` as an SBPL string literal: ``"`` and ``\\`` escaped, everything else as is."""
    if "\0" in text:
        raise ProfileError(f"a path with a NUL character cannot be written in a profile: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def canonical(path: str, realpath=os.path.realpath, getpath=None) -> str:
    """The path as the kernel names it, which is what Seatbelt matches: absolute, symlinks
    resolved (``/tmp/x`` -> ``/private/tmp/x``, ``$TMPDIR`` under ``/private/var/folders``), and,
    where the file exists on macOS, the name stored on disk (``fcntl(F_GETPATH)``: a
    case-insensitive volume accepts ``~/Project`` for ``~/project``, and a rule naming the
    first would not match the second)."""
    resolved = realpath(os.path.abspath(path))
    getpath = getpath if getpath is not None else _disk_name
    stored = getpath(resolved)
    return stored if stored else resolved


def _disk_name(path: str) -> str | None:
    import fcntl

    if sys.platform != "darwin" or not hasattr(fcntl, "F_GETPATH"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a folder opens read-only; a FIFO does not block
    except OSError:
        return None
    try:
        raw = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024))
    except OSError:
        return None
    finally:
        os.close(fd)
    return os.fsdecode(raw.split(b"\0", 1)[0]) or None


def _absolute(paths: Iterable[str], what: str) -> list[str]:
    out = []
    for path in paths:
        if not path.startswith("/"):
            raise ProfileError(f"{what} must be absolute and canonical: {path!r}")
        normal = os.path.normpath(path)
        if normal.startswith("//"):
            normal = "/" + normal.lstrip("/")
        if normal not in out:
            out.append(normal)
    return out


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def _ancestors(path: str, roots: Sequence[str]) -> list[str]:
    """The folders from ``path``'s parent up to the writable root that holds it (included): renaming
    any of them would carry ``path`` away and let a new folder take its name."""
    out: list[str] = []
    for root in roots:
        if path == root or not _inside(path, root):
            continue
        parent = os.path.dirname(path)
        while _inside(parent, root):
            if parent not in out:
                out.append(parent)
            if parent == root:
                break
            parent = os.path.dirname(parent)
    return out


def profile(writable: Sequence[str], proxy_port: int | None, *, read_only: Sequence[str] = (),
            hidden: Sequence[str] = (), unreadable_files: Sequence[str] = (), sockets: Sequence[str] = (),
            fs_confinement: bool = True) -> str:
    """The SBPL profile for one run.

    ``writable``: trees the command may change (the project, --add-dir folders, the run's own
    temporary folder); ``proxy_port``: the run's proxy on 127.0.0.1, the one network
    destination (None: no network at all); ``read_only``: folders inside writable trees that
    stay unchangeable (egress's own code); ``hidden``: folders neither readable nor writable
    (egress's state: the CA's key, control sockets); ``unreadable_files``: files neither
    readable nor writable (secret files bound to hosts, the audit log); ``sockets``: trees
    where the command may bind and connect Unix sockets (the run's temporary folder, where no
    host program has one); ``fs_confinement``: False lets it write wherever its user may
    (the hidden and unreadable paths stay so). Every path must be canonical (:func:`canonical`).
    """
    if proxy_port is not None and not (isinstance(proxy_port, int) and 0 < proxy_port < 65536):
        raise ProfileError(f"the proxy port must be 1-65535, not {proxy_port!r}")
    writable = _absolute(writable, "writable paths")
    read_only = _absolute(read_only, "read-only paths")
    hidden = _absolute(hidden, "hidden paths")
    unreadable_files = _absolute(unreadable_files, "unreadable files")
    sockets = _absolute(sockets, "socket folders")

    lines = [
        "(version 1)",
        "; egress run: generated for one run by sandbox/seatbelt.py (docs/architecture.md says why each rule)",
        "(deny default)",
        "",
        "; the command and whatever it starts, which inherit this profile",
        "(allow process-exec)",
        "(allow process-fork)",
        "(allow signal (target same-sandbox))",
        "(allow process-info* (target same-sandbox))",
        "",
        "; reads: everywhere, as on Linux (the hidden paths are taken back below)",
        "(allow file-read*)",
        "",
        "; code: libraries mapped executable, JIT pages (node, bun, java); nothing beyond what is readable",
        "(allow file-map-executable)",
        "(allow dynamic-code-generation)",
        "",
        "; what programs ask of the system: sysctls, preferences, host facts, semaphores, ptys",
        "(allow sysctl-read)",
        '(allow sysctl-write (sysctl-name "kern.grade_cputype"))',
        "(allow user-preference-read)",
        "(allow mach-host*)",
        "(allow ipc-posix-sem)",
        '(allow iokit-open (iokit-registry-entry-class "RootDomainUserClient"))',
        "(allow pseudo-tty)",
        "(allow mach-lookup",
        *(f"  (global-name {sbpl_string(name)})" for name in MACH_SERVICES),
        ")",
        '(allow ipc-posix-shm-read* (ipc-posix-name "apple.shm.notification_center"))  ; notify(3) state',
        "",
        "; devices: the null and zero devices, the terminal, ptys, descriptors already open",
        "(allow file-write-data file-ioctl",
        *(f"  (literal {sbpl_string(device)})" for device in DEVICES),
        '  (regex #"^/dev/ttys[0-9]+$")',
        '  (subpath "/dev/fd"))',
        "",
    ]
    lines.append("; writes")
    if fs_confinement:
        if writable:
            lines.append("(allow file-write*")
            lines += [f"  (subpath {sbpl_string(path)})" for path in writable]
            lines.append(")")
    else:
        lines.append("(allow file-write*)  ; --no-fs-confinement")
    lines.append("")

    lines.append("; network: the run's proxy on 127.0.0.1 only (no DNS: the proxy resolves)")
    lines.append("(allow system-socket (socket-domain AF_UNIX))  ; socketpair(), unnamed sockets")
    if proxy_port is not None:
        lines.append(f'(allow network-outbound (remote ip "localhost:{proxy_port}"))')
    if sockets:
        lines.append("; Unix sockets: bound and reached only inside the run's own folders")
        for verb, side in (("network-bind", "local"), ("network-outbound", "remote")):
            lines.append(f"(allow {verb}")
            lines += [f"  ({side} unix-socket (subpath {sbpl_string(path)}))" for path in sockets]
            lines.append(")")
    lines.append("")

    roots = writable if fs_confinement else ["/"]
    taken_back = [(path, "subpath", "file-write*") for path in read_only]
    taken_back += [(path, "subpath", "file-read* file-write*") for path in hidden]
    taken_back += [(path, "literal", "file-read* file-write*") for path in unreadable_files]
    if taken_back:
        lines.append("; taken back from the rules above (a later rule wins)")
        for path, kind, operations in taken_back:
            lines.append(f"(deny {operations} ({kind} {sbpl_string(path)}))")
        pinned = []
        for path, _, _ in taken_back:
            pinned += [folder for folder in _ancestors(path, roots) if folder not in pinned]
        if pinned:
            lines.append("; the folders leading to them cannot be renamed away")
            lines.append("(deny file-write-unlink")
            lines += [f"  (literal {sbpl_string(folder)})" for folder in pinned]
            lines.append(")")
        for path in hidden:
            lines.append(f"(deny network-outbound (remote unix-socket (subpath {sbpl_string(path)})))")
    return "\n".join(lines) + "\n"
