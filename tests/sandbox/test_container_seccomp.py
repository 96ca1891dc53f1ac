"""egress's seccomp profile for containers, read as the engines read it.

The profile is built on the engine's default (this machine's containers-common file where it is
installed, and small made-up defaults), then judged by an interpreter of its rules with the
semantics runc and libseccomp give them: a rule's conditions ANDed, one comparison per argument
(runc turns two into an OR), no two rules of different actions matching one call (libseccomp
refuses or picks), the default action for a call no rule matches. The live profile is tested in
real podman and docker containers in test_providers.py.
"""

from __future__ import annotations

import errno
import itertools
import json
import os

import pytest

from sandbox import container_seccomp as cs

MACHINE = os.uname().machine if os.uname().machine in ("x86_64", "aarch64", "riscv64") else "x86_64"
DEFAULT = ("SCMP_ACT_ERRNO", errno.ENOSYS)
ALLOW = ("SCMP_ACT_ALLOW", None)


def _refused(err: int) -> tuple:
    return ("SCMP_ACT_ERRNO", err)


def holds(arg: dict, args: tuple) -> bool:
    x = args[arg["index"]]
    value, two = arg.get("value", 0), arg.get("valueTwo", 0)
    return {"SCMP_CMP_EQ": x == value, "SCMP_CMP_NE": x != value, "SCMP_CMP_LT": x < value,
            "SCMP_CMP_LE": x <= value, "SCMP_CMP_GT": x > value, "SCMP_CMP_GE": x >= value,
            "SCMP_CMP_MASKED_EQ": x & value == two}[arg["op"]]


def decide(profile: dict, name: str, *args: int) -> tuple:
    """What a call gets: (action, errno). Fails if two rules of different actions both match."""
    args = tuple(a & 0xFFFFFFFFFFFFFFFF for a in (*args, 0, 0, 0, 0, 0, 0))[:6]
    matched = {(rule["action"], rule.get("errnoRet")) for rule in profile["syscalls"]
               if name in rule["names"] and all(holds(a, args) for a in rule.get("args") or ())}
    assert len(matched) <= 1, (name, args, matched)
    return matched.pop() if matched else (profile["defaultAction"], profile.get("defaultErrnoRet"))


@pytest.fixture(scope="module")
def engine_default() -> dict:
    path = cs.default_profile()
    if path is None:
        pytest.skip(f"no engine default seccomp profile here ({', '.join(cs.DEFAULT_PROFILES)}): {cs.PACKAGE}")
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def profile(engine_default) -> dict:
    return cs.build(engine_default, MACHINE)


def test_no_rule_compares_one_argument_twice(profile):
    """runc would turn the comparisons into separate rules, ORed: a refusal could become a grant."""
    for rule in profile["syscalls"]:
        indexes = [a["index"] for a in rule.get("args") or ()]
        assert len(indexes) == len(set(indexes)), rule


def test_nothing_the_engine_refuses_becomes_allowed(engine_default, profile):
    def allowed(p):
        return {n for rule in p["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for n in rule["names"]}

    assert allowed(profile) <= allowed(engine_default)
    assert {k: v for k, v in profile.items() if k != "syscalls"} == {
        k: v for k, v in engine_default.items() if k != "syscalls"}  # its default action, architectures
    ours = {name for name, *_ in cs.egress_rules()}
    for rule in engine_default["syscalls"]:  # every rule of a call egress does not govern, as it was
        rest = [n for n in rule["names"] if n not in ours]
        if rest:
            assert {**rule, "names": rest} in profile["syscalls"], rule


def test_keyrings_namespaces_syslog_are_refused(profile):
    for name in ("keyctl", "add_key", "request_key", "setns", "syslog"):
        assert decide(profile, name, 0, -4) == _refused(errno.EPERM), name
    for name in ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register", "openat2"):
        assert decide(profile, name) in (_refused(errno.ENOSYS), DEFAULT), name
    assert decide(profile, "socketcall", 1) == _refused(errno.EAFNOSUPPORT)  # i386: the family behind a pointer


def test_socket_families_are_an_allow_list(profile):
    granted = {1: "unix", 2: "inet", 10: "inet6"}
    for family in range(0, 70):
        outcome = decide(profile, "socket", family, 1, 0)
        assert outcome == (ALLOW if family in granted or family == 16 else _refused(errno.EAFNOSUPPORT)), family
    for family in (2, 40, 1):  # high bits the kernel drops: refused, never read as the low family
        assert decide(profile, "socket", family | 1 << 32, 1, 0) == _refused(errno.EAFNOSUPPORT)
    assert decide(profile, "socket", 16, 3, 0) == ALLOW  # NETLINK_ROUTE
    for protocol in (4, 9, 12, 15):  # sock_diag, audit, netfilter, uevents
        assert decide(profile, "socket", 16, 3, protocol) == _refused(errno.EAFNOSUPPORT)
    assert decide(profile, "socketpair", 1, 1, 0) == ALLOW
    assert decide(profile, "socketpair", 2, 1, 0) == _refused(errno.EAFNOSUPPORT)


def test_new_namespaces_are_refused_threads_and_forks_are_not(profile):
    thread = 0x3D0F00  # glibc's pthread_create through clone
    assert decide(profile, "clone", thread) == ALLOW and decide(profile, "clone", 0x11 | 0x1200000) == ALLOW
    for bit in range(31):
        flag = 1 << bit
        expected = _refused(errno.EPERM) if flag & cs.NEW_NAMESPACES else ALLOW
        assert decide(profile, "clone", thread | flag) == expected, hex(flag)
        expected = _refused(errno.EPERM) if flag & (cs.NEW_NAMESPACES | cs.CLONE_NEWTIME) else ALLOW
        assert decide(profile, "unshare", flag) == expected, hex(flag)


def test_set_id_modes_are_refused_wherever_a_mode_is_set(profile):
    modes = (0o644, 0o755, 0o1777, 0o4755, 0o2755, 0o6755, 0o104755, 0o4000 | 1 << 40)
    for name, index in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("creat", 1), ("mknod", 1), ("mknodat", 2)):
        for mode in modes:
            args = [3, 3, 3, 0]
            args[index] = mode
            expected = _refused(errno.EPERM) if mode & 0o6000 else ALLOW
            assert decide(profile, name, *args) == expected, (name, oct(mode))
    creating = (0o100, 0o20200000, 0o101 | 0o1000)  # O_CREAT, O_TMPFILE (with O_DIRECTORY), O_CREAT|O_WRONLY|O_TRUNC
    plain = (0, 0o2, 0o200000, 0o2000000 | 0o200000)  # O_RDONLY, O_RDWR, O_DIRECTORY, O_CLOEXEC|O_DIRECTORY
    for (name, flags_at, mode_at), flags, mode in itertools.product(
            (("open", 1, 2), ("openat", 2, 3)), creating + plain, modes + (0o6777, 0xFFFFFFFF)):
        args = [3, 3, 3, 3]
        args[flags_at], args[mode_at] = flags, mode
        expected = _refused(errno.EPERM) if flags in creating and mode & 0o6000 else ALLOW
        assert decide(profile, name, *args) == expected, (name, oct(flags), oct(mode))


def test_the_engines_own_conditions_stay_within_what_egress_allows():
    """A made-up default with conditions of its own on calls egress governs (as Docker's has on
    clone, podman's on socket): egress's grant is cut down to theirs, their refusals stay."""
    base = {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1, "syscalls": [
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 0x7E020000, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
         "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": 22,
         "args": [{"index": 0, "value": 2, "op": "SCMP_CMP_EQ"}, {"index": 1, "value": 3, "op": "SCMP_CMP_EQ"}]},
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 1, "value": 3, "op": "SCMP_CMP_NE"}]},
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 2, "op": "SCMP_CMP_NE"}]},
        {"names": ["chmod", "getpid"], "action": "SCMP_ACT_ALLOW"},
        {"names": ["open"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 1, "value": 5, "op": "SCMP_CMP_LT"}]},
        {"names": ["openat"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["no-such-arch"]}},
        {"names": ["mknod"], "action": "SCMP_ACT_ALLOW", "includes": {"someday": ["x"]}},
    ]}
    profile = cs.build(base, MACHINE)
    test_no_rule_compares_one_argument_twice(profile)
    assert decide(profile, "clone", 0x3D0F00) == ALLOW
    assert decide(profile, "clone", 0x10000000) == _refused(errno.EPERM)
    assert decide(profile, "socket", 2, 1, 0) == ALLOW
    assert decide(profile, "socket", 2, 3, 0) == _refused(22)  # the engine's refusal, within egress's grant
    assert decide(profile, "socket", 40, 3, 0) == _refused(errno.EAFNOSUPPORT)
    assert decide(profile, "getpid") == ALLOW and decide(profile, "chmod", 0, 0o755) == ALLOW
    assert decide(profile, "chmod", 0, 0o4755) == _refused(errno.EPERM)
    # "flags below 5" and "no O_CREAT" is no one comparison: left out, so refused, never granted
    assert decide(profile, "open", 0, 0, 0o4755) == ("SCMP_ACT_ERRNO", 1)
    assert decide(profile, "open", 0, 0, 0o644) == ALLOW  # flags below 5, a mode without set-id bits
    assert decide(profile, "open", 0, 9, 0o644) == ("SCMP_ACT_ERRNO", 1)  # the engine's condition holds
    assert decide(profile, "openat", 3, 0, 0, 0) == ("SCMP_ACT_ERRNO", 1)  # not this machine's
    assert decide(profile, "mknod", 0, 0o644) == ("SCMP_ACT_ERRNO", 1)  # a condition egress cannot read
    assert decide(profile, "fchmod", 3, 0o644) == ("SCMP_ACT_ERRNO", 1)  # the engine never allowed it


def test_a_default_that_is_no_allow_list_or_an_unknown_machine_is_refused():
    with pytest.raises(cs.SeccompError, match="no allow list"):
        cs.build({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}, "x86_64")
    with pytest.raises(cs.SeccompError, match="not s390x"):
        cs.build({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}, "s390x")


def test_without_the_engines_default_the_providers_refuse_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(cs, "DEFAULT_PROFILES", (str(tmp_path / "etc.json"), str(tmp_path / "share.json")))
    said = cs.refusal("docker")
    assert said == (f"--provider docker: egress builds the containers' seccomp profile on the engine's default "
                    f"allow list, {tmp_path / 'share.json'}, which is missing: install {cs.PACKAGE}; nothing ran")
    (tmp_path / "share.json").write_text("{not json")
    assert "cannot read the engine's default seccomp profile" in cs.refusal("podman")


def test_the_profile_is_built_once_and_written_for_root_alone(engine_default, tmp_path):
    assert cs.profile_text() is cs.profile_text()
    path = cs.write(str(tmp_path))
    assert path == str(tmp_path / cs.FILE_NAME) and os.stat(path).st_mode & 0o777 == 0o600
    assert json.loads(open(path).read()) == cs.build(engine_default)
    with pytest.raises(FileExistsError):  # never over a file already there
        cs.write(str(tmp_path))
