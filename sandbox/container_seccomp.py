"""The seccomp profile of every container egress starts: the engine's default allow list, with
egress's refusals on top (JSON in the OCI/Docker format, for `--security-opt seccomp=PATH`).

    text = profile_text()                  # cached per process; SeccompError if it cannot be made
    path = write(folder)                   # the run's copy, mode 0600

Why on top of the engine's default: the default is an allow list (every system call not named
is refused) that the engines' authors keep up with the kernel; egress only takes away from it,
so nothing the engine refuses becomes allowed. Podman's is containers-common's
/usr/share/containers/seccomp.json (an administrator's /etc/containers/seccomp.json replaces
it, as for podman). Docker's default is compiled into the daemon, with no file and no way to
read it back, so docker gets the same file; where no file is found egress refuses both
providers (SeccompError, 125) rather than run with a weaker profile. containers-common's
profile is looser than Docker's compiled one in one way that matters: it lets a process without
capabilities make namespaces (unshare, clone with CLONE_NEW*, setns), and a new user namespace
gives back every capability --cap-drop took, over fresh namespaces: Docker refuses that, and
so does egress (which also makes the capability-gated calls Docker names, mount and the like,
moot: the kernel refuses them to a process without capabilities). It also allows syslog,
which Docker refuses (a kernel log readable where kernel.dmesg_restrict is 0).

egress's rules (each syscall egress names is governed wholly by them, intersected with what
the engine's rules for it allowed):

* keyctl, add_key, request_key: EPERM. Keyrings are not namespaced: a container's uid reaches
  that uid's user keyring on the host (N2, N5: podman's default let keyctl through).
* socket: AF_UNIX, AF_INET, AF_INET6, and AF_NETLINK with NETLINK_ROUTE only (interface
  lists: getifaddrs, if_nameindex); every other family (AF_VSOCK above all, N10: it shares the
  host's port space), other netlink protocols (audit, sock_diag, netfilter), and any value
  with high bits set: EAFNOSUPPORT, as a kernel without the family answers. socketpair:
  AF_UNIX only. socketcall (i386's multiplexer, the family behind a pointer): EAFNOSUPPORT (not
  ENOSYS, which the engine's default already says: see below).
* clone3: ENOSYS (its flags, CLONE_INTO_CGROUP among them, lie behind a pointer, N6); glibc and
  Go fall back to clone, whose flags the filter reads.
* unshare and clone with a CLONE_NEW* flag, setns, syslog: EPERM (Docker's own rules, above).
* io_uring_setup/enter/register: ENOSYS (its operations pass unseen by a syscall filter).
* set-id files (N9): S_ISUID/S_ISGID in chmod, fchmod, fchmodat, fchmodat2, creat, mknod,
  mknodat: EPERM; in open/openat only when they create (O_CREAT or O_TMPFILE: the mode of an
  open that creates nothing is whatever was in the register), so open and openat are allowed
  where (flags & (O_CREAT|__O_TMPFILE)) == 0 or (mode & 06000) == 0. openat2's flags lie behind
  a pointer: ENOSYS, and libc falls back to openat.

How the engines build the filter, and why the rules are written as they are: runc (and crun)
hand each JSON rule to libseccomp, and the conditions of one rule are ANDed, except that runc
turns a rule with two comparisons on the same argument into one rule per comparison, ORed
(libcontainer/seccomp/seccomp_linux.go, matchCall): so no rule here compares one argument twice.
runc also leaves out a rule whose action is the default's. libseccomp merges a syscall's rules
into one tree and refuses (EEXIST, and the container does not start) two rules with different
actions that end on the same comparison; on i386 it turns each socket, socketpair, ... rule into
a socketcall rule without its conditions (they lie behind socketcall's pointer), so socket rules
of two actions collide there unless socketcall is refused outright by a rule runc keeps: hence
socketcall's own errno (measured: with ENOSYS podman's runc failed "error adding seccomp rule for
syscall socket: file exists"; docker 20.10, which drops defaultErrnoRet and so defaults to
EPERM, kept the rule and started). egress's rules for a syscall never overlap unless their
action is the same: "none of these
bits" is one masked comparison ((arg & mask) == 0), and "some of them" is written as disjoint
cases, one per bit ((arg & bits up to b) == b). The engine's own rules for a governed syscall
(resolved here as the engine would: a container with no capabilities, this architecture and
kernel) are each ANDed with egress's allowing rules; two comparisons of one argument are merged
into one where they can be (masked equalities merge exactly; a point is checked against the
other), and a combination that cannot be written as one rule is left out: that only refuses more.
A call no rule matches gets the engine's default action (ENOSYS in containers-common's).

The open flags are the asm-generic ones (x86_64, aarch64, riscv64, and the 32-bit tables the
profile also covers there); other machines are refused.
"""

from __future__ import annotations

import errno
import functools
import json
import os

from egress.core.contract import EXIT_LAUNCHER
from sandbox.spec import SandboxError

DEFAULT_PROFILES = ("/etc/containers/seccomp.json", "/usr/share/containers/seccomp.json")
PACKAGE = "containers-common (Debian and Ubuntu: golang-github-containers-common)"
FILE_NAME = "seccomp.json"

ALLOW, REFUSE = "SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"
_REFUSING_DEFAULTS = {"SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD",
                      "SCMP_ACT_TRAP"}
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "riscv64": "riscv64"}  # uname -> the profiles' arch names

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0
FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
_FAMILY_BITS = 6  # families are below 64 (AF_MAX is 46 in Linux 6.x); anything above is refused too
SETID = 0o6000  # S_ISUID | S_ISGID
CREATES = 0o100 | 0o20000000  # O_CREAT | __O_TMPFILE (O_TMPFILE's own bit, without O_DIRECTORY's)
NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NEWTIME = 0x80  # unshare's only (clone's low byte is the exit signal)

_FULL = 0xFFFFFFFFFFFFFFFF
_LOW = 0xFFFFFFFF


class SeccompError(SandboxError):
    def __init__(self, message: str):
        super().__init__(EXIT_LAUNCHER, message, "seccomp")


# ------------------------------------------------------------------ egress's rules


def _cond(index: int, op: str, value: int, two: int = 0) -> tuple:
    return (index, op, value, two)


def _eq(index: int, value: int) -> tuple:
    return _cond(index, "SCMP_CMP_EQ", value)


def _masked(index: int, mask: int, value: int) -> tuple:
    return _cond(index, "SCMP_CMP_MASKED_EQ", mask, value)


def _none_of(index: int, bits: int) -> tuple:
    return _masked(index, bits, 0)


def _some_of(index: int, bits: int) -> list[tuple]:
    """Disjoint conditions, together true where (arg & bits) != 0: the lowest bit set is b."""
    found, seen = [], 0
    for shift in range(64):
        bit = 1 << shift
        if bits & bit:
            seen |= bit
            found.append(_masked(index, seen, bit))
    return found


def _families_refused(index: int) -> list[tuple]:
    """Disjoint conditions, together true for every value of the argument but FAMILIES: aligned
    blocks of [0, 64) (masked on the low 32 bits, which the kernel reads) that hold no granted
    family, and everything from 64 up (high bits included)."""
    found = []

    def cover(start: int, size: int) -> None:
        inside = [f for f in FAMILIES if start <= f < start + size]
        if not inside:
            found.append(_masked(index, _LOW & ~(size - 1), start))
        elif size > 1:  # (a block of one granted family is left alone)
            cover(start, size // 2)
            cover(start + size // 2, size // 2)

    cover(0, 1 << _FAMILY_BITS)
    return found + [_cond(index, "SCMP_CMP_GE", 1 << _FAMILY_BITS)]


def _refuse(name: str, err: int, *conds) -> tuple:
    return (name, REFUSE, err, tuple(conds))


def _allow(name: str, *conds) -> tuple:
    return (name, ALLOW, None, tuple(conds))


def _granted_unless(name: str, index: int, bits: int, err: int) -> list[tuple]:
    """``name`` allowed while none of ``bits`` is set in its argument ``index``, else ``err``."""
    return [_allow(name, _none_of(index, bits))] + [_refuse(name, err, c) for c in _some_of(index, bits)]


def egress_rules() -> list[tuple]:
    """(syscall, action, errno, conditions) for every call egress governs."""
    rules = [_refuse(name, errno.EPERM) for name in ("keyctl", "add_key", "request_key", "setns", "syslog")]
    rules += [_refuse(name, errno.ENOSYS) for name in ("clone3", "io_uring_setup", "io_uring_enter",
                                                        "io_uring_register", "openat2")]
    # Not ENOSYS, the engine's default: runc leaves out a rule that says what the default says, and
    # libseccomp would then turn each socket rule into a socketcall(SYS_SOCKET) rule without its
    # conditions (they lie behind the pointer): an i386 program would get any family.
    rules.append(_refuse("socketcall", errno.EAFNOSUPPORT))
    rules += [_allow("socket", _eq(0, family)) for family in (AF_UNIX, AF_INET, AF_INET6)]
    rules += [_allow("socket", _eq(0, AF_NETLINK), _eq(2, NETLINK_ROUTE)),
              _refuse("socket", errno.EAFNOSUPPORT, _eq(0, AF_NETLINK), _cond(2, "SCMP_CMP_NE", NETLINK_ROUTE))]
    rules += [_refuse("socket", errno.EAFNOSUPPORT, c) for c in _families_refused(0)]
    rules += [_allow("socketpair", _eq(0, AF_UNIX)),
              _refuse("socketpair", errno.EAFNOSUPPORT, _cond(0, "SCMP_CMP_NE", AF_UNIX))]
    rules += _granted_unless("unshare", 0, NEW_NAMESPACES | CLONE_NEWTIME, errno.EPERM)
    rules += _granted_unless("clone", 0, NEW_NAMESPACES, errno.EPERM)
    for name, mode in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2), ("creat", 1),
                       ("mknod", 1), ("mknodat", 2)):
        rules += _granted_unless(name, mode, SETID, errno.EPERM)
    for name, flags, mode in (("open", 1, 2), ("openat", 2, 3)):
        rules += [_allow(name, _none_of(flags, CREATES)), _allow(name, _none_of(mode, SETID))]
        rules += [_refuse(name, errno.EPERM, f, m) for f in _some_of(flags, CREATES) for m in _some_of(mode, SETID)]
    return rules


# ------------------------------------------------------------------ conditions: evaluated and merged


def _holds(cond: tuple, x: int) -> bool:
    _, op, value, two = cond
    return {"SCMP_CMP_EQ": lambda: x == value, "SCMP_CMP_NE": lambda: x != value,
            "SCMP_CMP_LT": lambda: x < value, "SCMP_CMP_LE": lambda: x <= value,
            "SCMP_CMP_GT": lambda: x > value, "SCMP_CMP_GE": lambda: x >= value,
            "SCMP_CMP_MASKED_EQ": lambda: x & value == two}[op]()


class _Unwritable(Exception):
    """Conditions that hold together but no one comparison says."""


def _merge(conds: list[tuple]) -> tuple | None:
    """One condition on one argument meaning all of ``conds``; None: they never hold together.
    Raises _Unwritable."""
    index = conds[0][0]
    mask, value, others = None, 0, []
    for cond in conds:
        _, op, a, b = cond
        if op in ("SCMP_CMP_EQ", "SCMP_CMP_MASKED_EQ"):
            m, v = (_FULL, a) if op == "SCMP_CMP_EQ" else (a, b)
            if v & ~m:
                return None  # bits the mask drops can never equal
            if mask is not None and (value & m) != (v & mask):
                return None  # the two disagree on a bit both compare
            mask, value = (m if mask is None else mask | m), value | v
        else:
            others.append(cond)
    if mask == _FULL:  # a point: every other comparison is true or false there
        return _eq(index, value) if all(_holds(c, value) for c in others) else None
    if mask is not None and others:
        raise _Unwritable
    if mask is not None:
        return _masked(index, mask, value)
    if len(set(others)) > 1:
        raise _Unwritable
    return others[0]


def _conjoin(a: tuple, b: tuple) -> tuple | None:
    """The conditions of two rules as one rule's (one comparison per argument); None if they
    never hold together. Raises _Unwritable."""
    by_index: dict[int, list] = {}
    for cond in (*a, *b):
        by_index.setdefault(cond[0], []).append(cond)
    merged = []
    for index in sorted(by_index):
        cond = _merge(by_index[index])
        if cond is None:
            return None
        merged.append(cond)
    return tuple(merged)


# ------------------------------------------------------------------ the engine's rules, resolved


def _kernel() -> tuple[int, ...]:
    parts = []
    for part in os.uname().release.replace("-", ".").split(".")[:3]:
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def _applies(entry: dict, goarch: str) -> bool | None:
    """Whether the engine applies ``entry`` to an egress container (no capabilities: HARDENING
    drops them all); None where it cannot be told (a key egress does not know)."""
    for key, wanted in (("includes", True), ("excludes", False)):
        for field, given in (entry.get(key) or {}).items():
            if not given:
                continue
            if field == "caps":
                present = False  # the container has none
            elif field == "arches":
                present = goarch in given
            elif field == "minKernel":
                present = _kernel() >= tuple(int(p) for p in str(given).split(".") if p.isdigit())
            else:
                return None
            if present != wanted:
                return False
    return True


def _engine_rules(entry: dict, goarch: str):
    """``entry`` as (action, errno, conditions) if the engine would apply it."""
    applies = _applies(entry, goarch)
    if applies is None:  # unknown: an allowing rule is left out, a refusing one kept
        applies = entry.get("action") != ALLOW
    if not applies:
        return None
    conds = tuple(_cond(a["index"], a["op"], a.get("value", 0), a.get("valueTwo", 0)) for a in entry.get("args") or ())
    return entry.get("action"), entry.get("errnoRet"), conds


def build(base: dict, machine: str | None = None) -> dict:
    """egress's profile from the engine's default ``base`` (a parsed profile)."""
    machine = machine or os.uname().machine
    if machine not in _GOARCH:
        raise SeccompError(f"egress's container seccomp profile knows {', '.join(_GOARCH)} (their open flags and "
                           f"clone's arguments), not {machine}")
    if base.get("defaultAction") not in _REFUSING_DEFAULTS:
        raise SeccompError(f"the engine's default seccomp profile is no allow list (its default action is "
                           f"{base.get('defaultAction')!r})")
    ours = egress_rules()
    governed = {name for name, *_ in ours}
    kept, theirs = [], {name: [] for name in governed}
    for entry in base.get("syscalls") or ():
        names = entry.get("names") or ([entry["name"]] if entry.get("name") else [])
        rest = [n for n in names if n not in governed]
        if rest:
            kept.append({**{k: v for k, v in entry.items() if k != "name"}, "names": rest})
        if len(rest) < len(names):
            rule = _engine_rules(entry, _GOARCH[machine])
            for name in set(names) & governed:
                if rule is not None:
                    theirs[name].append(rule)
    added = []
    for name, action, err, conds in ours:
        if action != ALLOW:
            added.append((name, action, err, conds))
            continue
        for their_action, their_err, their_conds in theirs[name]:  # within what egress allows, the engine's word
            try:
                both = _conjoin(conds, their_conds)
            except _Unwritable:
                continue  # left out: refused (by the default action)
            if both is not None:
                added.append((name, their_action, their_err, both))
    syscalls = kept + [_entry(rule) for rule in _without_repeats(added)]
    return {**{k: v for k, v in base.items() if k != "syscalls"}, "syscalls": syscalls}


def _without_repeats(rules: list[tuple]) -> list[tuple]:
    """Each rule once, and none that a rule of the same syscall and action with fewer conditions covers."""
    out = []
    for rule in rules:
        name, action, err, conds = rule
        covered = any(o[:3] == (name, action, err) and set(o[3]) <= set(conds) for o in out)
        if not covered:
            out = [o for o in out if not (o[:3] == (name, action, err) and set(conds) < set(o[3]))] + [rule]
    return out


def _entry(rule: tuple) -> dict:
    name, action, err, conds = rule
    entry = {"names": [name], "action": action, "args": [
        {"index": i, "value": v, "valueTwo": t, "op": op} for i, op, v, t in conds]}
    if err is not None:
        entry["errnoRet"] = err
    return entry


# ------------------------------------------------------------------ the engine's default, read once


def default_profile() -> str | None:
    """The file the engine's default is read from; None if there is none."""
    return next((path for path in DEFAULT_PROFILES if os.path.isfile(path)), None)


def refusal(engine: str) -> str | None:
    """Why --provider ENGINE cannot start here for want of the profile; None if it can."""
    try:
        profile_text()
    except SeccompError as e:
        return f"--provider {engine}: {e}; nothing ran"
    return None


def profile_text() -> str:
    """egress's profile as JSON; SeccompError if it cannot be made. Parsed and built once per
    process for each version of the engine's file."""
    path = default_profile()
    if path is None:
        raise SeccompError(f"egress builds the containers' seccomp profile on the engine's default allow list, "
                           f"{DEFAULT_PROFILES[-1]}, which is missing: install {PACKAGE}")
    try:
        info = os.stat(path)
    except OSError as e:
        raise SeccompError(f"cannot read {path}: {e.strerror}") from None
    return _built(path, info.st_ino, info.st_mtime_ns, info.st_size, os.uname().machine)


@functools.lru_cache(maxsize=4)
def _built(path: str, ino: int, mtime: int, size: int, machine: str) -> str:
    try:
        with open(path, "rb") as f:
            base = json.loads(f.read())
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or e
        raise SeccompError(f"cannot read the engine's default seccomp profile {path}: {why}") from None
    if not isinstance(base, dict):
        raise SeccompError(f"{path} is not a seccomp profile")
    return json.dumps(build(base, machine), separators=(",", ":"))


def write(folder: str) -> str:
    """The profile written to FILE_NAME in ``folder`` (the run's own, egress's), mode 0600."""
    path = os.path.join(folder, FILE_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        f.write(profile_text())
    return path
