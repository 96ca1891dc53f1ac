"""The Seatbelt (sandbox-exec) profile for one `egress run` on macOS: a pure function.

    text = profile(writable=["/Users/me/project", "/private/var/folders/x/T/egress-run-1"],
                   proxy_port=53117, sockets=["/private/var/folders/x/T/egress-run-1"])

Inputs are paths already canonical (:func:`canonical`: symlinks resolved, so /tmp and /var
appear as /private/tmp and /private/var, and on macOS the case stored on disk), the proxy's
port on 127.0.0.1 and a few options; the output is SBPL text for ``sandbox-exec -p``. Nothing
here reads the filesystem or the environment: the same inputs give the same profile, and the
golden tests in tests/sandbox/test_seatbelt.py hold whole profiles to that.

The profile denies by default and allows, rule by rule, what a command-line program needs;
docs/threat-model.md and docs/architecture.md ("The macOS sandbox") say what each rule is for
and what breaks without it. It grants nothing that the two public profiles that run real tools
both leave out: OpenAI Codex's (``codex-rs/sandboxing/src/seatbelt_base_policy.sbpl``, with
``restricted_read_only_platform_defaults.sbpl``) and Anthropic's sandbox-runtime
(``src/sandbox/macos-sandbox-utils.ts``). So, as in theirs:

* no ``sysctl-write`` at all (Codex allows ``kern.grade_cputype``, sandbox-runtime
  ``kern.tcsm_enable``: each a write, whatever it is used for), and ``sysctl-read`` of named
  facts only, the union of their two lists without ``kern.proc.all`` (every process on the Mac):
  an unnamed read would include ``kern.procargs2``, the arguments and environment of the user's
  other processes, egress's own launcher among them;
* ``file-map-executable`` only where code lives: the system's libraries (Codex's restricted
  list, widened to the sealed ``/System/Library``), the places programs are installed (Homebrew,
  MacPorts, Nix, Xcode, ``/usr/local``, ``/Applications``), the run's interpreter and ``PATH``
  trees and the writable trees (a project's ``.venv``, ``target/``, ``node_modules``). Not, say,
  ``/Users/Shared`` or a mounted volume. Programs still run from anywhere readable
  (``process-exec``, as in both): this keeps code that no tool installed out of processes; it
  does not confine what runs;
* no ``dynamic-code-generation`` (neither grants it; node and Java run under both).

Where egress grants less than they do (no DNS, no Launch Services, no trustd, no keychain,
Unix sockets only in the run's own folder) the architecture page says why.

Files that run later, outside the sandbox (sandbox/protected.py: git hooks and config, editor
and agent folders, ``.envrc``) are denied every write in each writable tree, existing or not,
unless the run allows hooks. Seatbelt decides by the name the kernel reports, so each is denied
by its exact name and by a regex for every spelling a case-insensitive volume takes for it
(``.GIT/HOOKS``, or ``hooks`` spelled with a Kelvin sign: :func:`any_case`), and the folders on
the way are pinned: ``.git`` can be neither renamed away (to write ``.git2/hooks`` and rename it
back), nor made from a folder of the command's own, nor rewritten where it is a ``gitdir:``
file, and the tree itself cannot be moved away or replaced.

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

# sysctl facts a program may read: hardware and OS facts programs size themselves by, and their
# own process's. The union of Codex's and sandbox-runtime's lists, without kern.proc.all (every
# process on the Mac), with the cache sizes Codex lists only as *_compat (mysqld reads
# hw.cachelinesize: openai/codex#31264), Intel's feature flags beside Arm's (hw.optional.) and
# Rosetta's flag for the process itself (sysctl.proc_translated). Nothing else: kern.procargs2
# would give the arguments and environment of the user's other processes.
SYSCTLS = (
    "hw.activecpu", "hw.busfrequency_compat", "hw.byteorder", "hw.cacheconfig", "hw.cachelinesize",
    "hw.cachelinesize_compat", "hw.cpufamily", "hw.cpufrequency", "hw.cpufrequency_compat", "hw.cputype",
    "hw.l1dcachesize", "hw.l1dcachesize_compat", "hw.l1icachesize", "hw.l1icachesize_compat", "hw.l2cachesize",
    "hw.l2cachesize_compat", "hw.l3cachesize", "hw.l3cachesize_compat", "hw.logicalcpu", "hw.logicalcpu_max",
    "hw.machine", "hw.memsize", "hw.model", "hw.ncpu", "hw.nperflevels", "hw.packages", "hw.pagesize",
    "hw.pagesize_compat", "hw.physicalcpu", "hw.physicalcpu_max", "hw.tbfrequency_compat", "hw.vectorunit",
    "kern.argmax", "kern.bootargs", "kern.hostname", "kern.maxfiles", "kern.maxfilesperproc", "kern.maxproc",
    "kern.ngroups", "kern.osproductversion", "kern.osrelease", "kern.ostype", "kern.osvariant_status",
    "kern.osversion", "kern.secure_kernel", "kern.tcsm_available", "kern.tcsm_enable", "kern.usrstack64",
    "kern.version", "kern.willshutdown", "machdep.ptrauth_enabled", "security.mac.lockdown_mode_state",
    "sysctl.proc_cputype", "sysctl.proc_translated", "vm.loadavg",
)
SYSCTL_PREFIXES = ("hw.optional.", "hw.perflevel", "kern.proc.pgrp.", "kern.proc.pid.", "machdep.cpu.",
                   "net.routetable.")

# Where code may be mapped executable, besides the run's own trees (profile's ``code``, the
# writable trees). The system's: Apple's sealed volume and SIP-protected folders, which hold
# every system library and framework (Codex's restricted list names their subfolders).
SYSTEM_CODE = ("/System/Library", "/System/iOSSupport", "/System/Cryptexes", "/System/Volumes/Preboot/Cryptexes",
               "/Library/Apple", "/usr/lib", "/usr/libexec", "/bin", "/sbin", "/usr/bin", "/usr/sbin")
# Where programs are installed: Xcode and the command line tools, python.org's and Java's
# frameworks, the system Ruby's, Python's and Perl's machine-wide packages (their compiled
# extensions), Homebrew (Apple silicon, Intel), MacPorts, Nix, applications' bundled tools.
TOOLCHAINS = ("/Library/Developer", "/Library/Frameworks", "/Library/Java", "/Library/Ruby", "/Library/Python",
              "/Library/Perl", "/Applications", "/opt/homebrew", "/usr/local", "/opt/local", "/nix/store")

# Characters (and pairs and triples) that a case-insensitive volume takes for ASCII text besides
# its two cases: APFS compares names case-folded (full folding) and normalised (NFD), so
# `ho\u212aks` is `hooks` and `con\ufb01g` is `config`. tests/sandbox/test_seatbelt.py derives
# this table again from the Unicode database.
FOLDS = {";": "\u037e", "`": "\u1fef", "k": "\u212a", "s": "\u017f", "ff": "\ufb00", "fi": "\ufb01",
         "fl": "\ufb02", "ffi": "\ufb03", "ffl": "\ufb04", "ss": "\u00df\u1e9e", "st": "\ufb05\ufb06"}
_REGEX_SPECIAL = set(".^$*+?()[]{}|\\")
# sandbox-exec refuses a profile with a string longer than 1025 bytes (sandbox-runtime's
# SBPL_STRING_MAX_BYTES note): a regex that long is refused here, with the way out, not there.
REGEX_MAX_BYTES = 1000


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


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def any_case(text: str, limit: int = REGEX_MAX_BYTES) -> str:
    """A regex for every name a case-insensitive volume takes for ``text``: each ASCII letter in
    either case, and the characters, pairs and triples that fold to it (:data:`FOLDS`). Other
    characters stand for themselves (escaped where a regex would read them). Raises ProfileError
    past ``limit`` characters (a ligature's alternative repeats what follows it)."""
    folds = [(seq, alternatives) for seq, alternatives in FOLDS.items() if len(seq) > 1]

    def one(ch: str) -> str:
        low = ch.lower()
        spellings = [ch] if not (ch.isascii() and ch.isalpha()) else [low, low.upper()]
        spellings += list(FOLDS.get(low, "")) if len(low) == 1 else []
        spellings = [_regex_literal(c) for c in dict.fromkeys(spellings)]
        if len(spellings) == 1:
            return spellings[0]
        if all(len(c) == 1 and c.isascii() for c in spellings):  # one byte each: a class
            return "[" + "".join(spellings) + "]"
        return "(" + "|".join(spellings) + ")"

    tails = [""] * (len(text) + 1)  # tails[i]: the regex for text[i:]
    for i in range(len(text) - 1, -1, -1):
        options = [one(text[i]) + tails[i + 1]]
        options += ["(" + "|".join(alternatives) + ")" + tails[i + len(seq)] for seq, alternatives in folds
                    if text[i:i + len(seq)].isascii() and text[i:i + len(seq)].lower() == seq]
        tails[i] = options[0] if len(options) == 1 else "(" + "|".join(options) + ")"
        if len(tails[i]) > limit:
            raise ProfileError(f"{text!r} is too long to match in every spelling in a Seatbelt rule")
    return tails[0]


def _tree_of(path: str, roots: Sequence[str]) -> str | None:
    """The innermost of ``roots`` that holds ``path`` (strictly below it), if any."""
    holders = [root for root in roots if path != root and _inside(path, root)]
    return max(holders, key=len) if holders else None


def _outermost(paths: Sequence[str]) -> list[str]:
    """``paths`` without those inside another of them (a subpath covers them)."""
    return [p for p in paths if not any(q != p and _inside(p, q) for q in paths)]


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
            fs_confinement: bool = True, later_run: Sequence[str] = (), code: Sequence[str] = ()) -> str:
    """The SBPL profile for one run.

    ``writable``: trees the command may change (the project, --add-dir folders, the run's own
    temporary folder); ``proxy_port``: the run's proxy on 127.0.0.1, the one network
    destination (None: no network at all); ``read_only``: folders inside writable trees that
    stay unchangeable (egress's own code); ``hidden``: folders neither readable nor writable
    (egress's state: the CA's key, control sockets); ``unreadable_files``: files neither
    readable nor writable (secret files bound to hosts, the audit log); ``sockets``: trees
    where the command may bind and connect Unix sockets (the run's temporary folder, where no
    host program has one); ``fs_confinement``: False lets it write wherever its user may
    (the hidden and unreadable paths stay so); ``later_run``: files and folders inside the
    writable trees whose contents run later, outside the sandbox (sandbox/protected.py),
    existing or not: no write of any kind, under any spelling (empty: the run allows hooks);
    ``code``: trees besides the system's (:data:`SYSTEM_CODE`), the toolchains'
    (:data:`TOOLCHAINS`) and the writable trees where code may be mapped executable (the run's
    interpreter, its PATH's prefixes). Every path must be canonical (:func:`canonical`).
    """
    if proxy_port is not None and not (isinstance(proxy_port, int) and 0 < proxy_port < 65536):
        raise ProfileError(f"the proxy port must be 1-65535, not {proxy_port!r}")
    writable = _absolute(writable, "writable paths")
    read_only = _absolute(read_only, "read-only paths")
    hidden = _absolute(hidden, "hidden paths")
    unreadable_files = _absolute(unreadable_files, "unreadable files")
    sockets = _absolute(sockets, "socket folders")
    later_run = _absolute(later_run, "files that run later")
    mappable = _outermost(_absolute([*SYSTEM_CODE, *TOOLCHAINS, *code, *writable], "code trees"))

    lines = [
        "(version 1)",
        "; egress run: generated for one run by sandbox/seatbelt.py (docs/threat-model.md says why each rule)",
        "(deny default)",
        "",
        "; the command and whatever it starts, which inherit this profile",
        "(allow process-exec)",
        "(allow process-fork)",
        "(allow signal (target same-sandbox))",
        "(allow process-info* (target same-sandbox))",
        "",
        "; reads: everywhere, as in both peers' profiles (egress's state and secret files are taken back below)",
        "(allow file-read*)",
        "",
        "; code is mapped executable only from the system, installed toolchains, the run's interpreter",
        "; and PATH, and the writable trees (denied first: this operation is decided here, whatever a",
        "; macOS would otherwise take from file-read*)",
        "(deny file-map-executable)",
        "(allow file-map-executable",
        *(f"  (subpath {sbpl_string(path)})" for path in mappable),
        ")",
        "",
        "; what programs ask of the system: named facts (no sysctl is ever written), preferences,",
        "; host facts, semaphores, power assertions, ptys",
        "(allow sysctl-read",
        *(f"  (sysctl-name {sbpl_string(name)})" for name in SYSCTLS),
        *(f"  (sysctl-name-prefix {sbpl_string(prefix)})" for prefix in SYSCTL_PREFIXES),
        ")",
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
    if later_run:
        lines += [""] + _later_run_rules(later_run, writable, roots)
    return "\n".join(lines) + "\n"


def _later_run_rules(later_run: Sequence[str], trees: Sequence[str], roots: Sequence[str]) -> list[str]:
    """Deny rules for the files that run later (sandbox/protected.py) and the folders on their way.

    Each path is denied by its exact name and, below the writable tree that holds it, by a regex
    for every spelling of its relative part (:func:`any_case`): a name the command creates is
    reported as the command spelt it, and git, direnv and editors find `.GIT/HOOKS` as
    `.git/hooks` on a case-insensitive volume. Folders between a tree and such a path (`.git`)
    cannot be written at all: not renamed away (to write `.git2/hooks` and rename it back),
    removed, made (from a folder of the command's own: `mv staged .git`) nor rewritten (a
    `.git` file names the repository). The trees themselves, and with no fs confinement every
    folder above them, can be neither moved nor replaced (a rename over an empty project)."""
    protected: list[str] = []
    inside: list[str] = []  # folders between a tree and a protected path
    outside: list[str] = []  # the trees, and the folders above them up to the roots
    for path in later_run:
        tree = _tree_of(path, trees)
        protected += [f"(subpath {sbpl_string(path)})"]
        if tree is not None:  # the path, and what is below it: two plain regexes, as the peers write them
            protected += [f"(regex {sbpl_string(_spellings(tree, path, end))})" for end in ("$", "/")]
        for folder in _ancestors(path, roots):
            if tree is not None and folder != tree and _inside(folder, tree):
                inside += [f for f in (f"(literal {sbpl_string(folder)})",
                                       f"(regex {sbpl_string(_spellings(tree, folder, '$'))})") if f not in inside]
            elif f"(literal {sbpl_string(folder)})" not in outside:
                outside.append(f"(literal {sbpl_string(folder)})")
    lines = ["; files that run later, outside the sandbox (sandbox/protected.py): no write of any kind,",
             "; existing or not, under any name a case-insensitive volume takes for theirs",
             "(deny file-write*", *(f"  {f}" for f in dict.fromkeys(protected)), ")"]
    if inside:
        lines += ["; the folders on their way: not renamed, removed, made or rewritten",
                  "(deny file-write*", *(f"  {f}" for f in inside), ")"]
    if outside:
        lines += ["; the trees holding them: not moved away, not replaced",
                  "(deny file-write-unlink file-write-create", *(f"  {f}" for f in outside), ")"]
    return lines


def _spellings(tree: str, path: str, end: str) -> str:
    """A regex for ``path`` below ``tree``: the tree as the disk names it, the rest in any case."""
    tree = tree.rstrip("/")
    try:
        regex = "^" + _regex_literal(tree) + "/" + any_case(path[len(tree) + 1:]) + end
    except ProfileError:
        regex = ""
    if not regex or len(regex.encode("utf-8", "surrogateescape")) > REGEX_MAX_BYTES:
        raise ProfileError(f"{path!r} is too deep to protect in a Seatbelt rule (files that run later: "
                           f"sandbox/protected.py); egress run --allow-hooks runs without that protection")
    return regex
