"""The macOS Seatbelt profile (sandbox/seatbelt.py), proven without a Mac.

Whole profiles are compared with golden files (tests/sandbox/golden/*.sb) for representative
runs; an s-expression reader written here (a Scheme reader's rules for strings: only ``\\"``
and ``\\\\`` are escapes) parses every generated profile and checks its structure: balanced,
only version/allow/deny forms, and the set of writable subpaths exactly the set asked for,
for a table of hostile path names too.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from sandbox.seatbelt import MACH_SERVICES, ProfileError, canonical, profile, sbpl_string
from sbpl import Atom, ReadError, Regex, Str, filter_paths, read_sbpl, rules, strings, writable_subpaths  # noqa: F401

GOLDEN = Path(__file__).with_name("golden")


# ------------------------------------------------------------------ the reader itself


@pytest.mark.parametrize("text", ['(allow', '(allow))', '(allow (subpath "x)', '(subpath "a\\nb")'])
def test_the_reader_refuses_what_sandbox_exec_would_not_read_as_we_meant(text):
    with pytest.raises(ReadError):
        read_sbpl(text)


def test_the_reader_reads_strings_regexes_and_comments():
    forms = read_sbpl('(version 1) ; note (allow default)\n(allow file-read* (subpath "a \\"b\\" \\\\ ;()") '
                      '(regex #"^/dev/ttys[0-9]+$"))')
    assert forms == [["version", "1"], ["allow", "file-read*", ["subpath", 'a "b" \\ ;()'],
                                        ["regex", "^/dev/ttys[0-9]+$"]]]
    assert isinstance(forms[1][3][1], Regex)


# ------------------------------------------------------------------ quoting


HOSTILE = [
    ("double quote", '/Users/me/say "hi"'),
    ("backslash", "/Users/me/back\\slash"),
    ("trailing backslash", "/Users/me/ends\\"),
    ("escaped quote", '/Users/me/x\\"y'),
    ("closes the rule", '/Users/me/x")) (allow default) (allow file-write* (subpath "/'),
    ("parentheses", "/Users/me/(allow network*)"),
    ("semicolon", "/Users/me/a;b ; (allow default)"),
    ("newline", "/Users/me/line\n(allow default)\n"),
    ("carriage return and tab", "/Users/me/a\r\tb"),
    ("regex literal", '/Users/me/#"^/"'),
    ("non-ASCII", "/Users/jérôme/プロジェクト/🚀"),
    ("undecodable bytes", os.fsdecode(b"/Users/me/\xff\xfe")),
    ("very long", "/Users/me/" + "/".join(["a" * 250] * 16)),
    ("spaces", "/Users/me/My Project"),
]


@pytest.mark.parametrize("name,path", HOSTILE, ids=[name for name, _ in HOSTILE])
def test_a_hostile_path_is_one_string_and_changes_nothing_else(name, path):
    plain = profile(["/Users/me/project"], 53117, read_only=["/Users/me/project/.venv"],
                    hidden=["/Users/me/.local/state/egress"], sockets=["/private/tmp/egress-run-1"])
    hostile = profile(["/Users/me/project", path], 53117, read_only=["/Users/me/project/.venv"],
                      hidden=["/Users/me/.local/state/egress", path + "/state"],
                      unreadable_files=[path + "/secret"], sockets=["/private/tmp/egress-run-1", path])
    assert sorted(writable_subpaths(hostile)) == sorted(["/Users/me/project", os.path.normpath(path)])
    # The same rules, operation for operation: the name added strings (and the rules its
    # hidden folder and unreadable file ask for), never a form of its own making.
    count = lambda text: Counter((a, ops) for a, ops, _ in rules(read_sbpl(text)))  # noqa: E731
    assert count(hostile) - count(plain) == Counter({("deny", ("file-read*", "file-write*")): 2,
                                                    ("deny", ("network-outbound",)): 1})
    assert not count(plain) - count(hostile)
    assert os.path.normpath(path) in strings(hostile)
    assert not any(a == "allow" and not fs and ops in (("default",), ("network*",), ("file-write*",))
                   for a, ops, fs in rules(read_sbpl(hostile)))


@pytest.mark.parametrize("text", ['"', "\\", '\\"', "a\nb", "(", ")", "é", "\udcff"])
def test_sbpl_string_reads_back_to_the_same_text(text):
    assert read_sbpl(f"(x {sbpl_string(text)})") == [["x", text]]


def test_a_nul_cannot_be_written():
    with pytest.raises(ProfileError):
        profile(["/Users/me/a\0b"], 1)


@pytest.mark.parametrize("paths", [["relative/project"], ["~/project"], [""]])
def test_relative_paths_are_refused(paths):
    with pytest.raises(ProfileError):
        profile(paths, 1)


@pytest.mark.parametrize("port", [0, 65536, -1, "80", 3.5])
def test_a_bad_port_is_refused(port):
    with pytest.raises(ProfileError):
        profile(["/p"], port)


# ------------------------------------------------------------------ what the profile allows


def test_the_network_is_the_proxy_port_on_localhost_and_nothing_else():
    text = profile(["/p"], 53117, sockets=["/private/tmp/run"])
    network = [(a, ops, fs) for a, ops, fs in rules(read_sbpl(text)) if any(o.startswith("network") for o in ops)]
    assert network == [
        ("allow", ("network-outbound",), [["remote", "ip", "localhost:53117"]]),
        ("allow", ("network-bind",), [["local", "unix-socket", ["subpath", "/private/tmp/run"]]]),
        ("allow", ("network-outbound",), [["remote", "unix-socket", ["subpath", "/private/tmp/run"]]]),
    ]
    off = profile(["/p"], None)
    assert not [r for r in rules(read_sbpl(off)) if r[0] == "allow" and any(o.startswith("network") for o in r[1])]


def test_it_denies_by_default_and_looks_up_only_the_listed_services():
    forms = read_sbpl(profile(["/p"], 1))
    assert forms[0] == ["version", "1"] and forms[1] == ["deny", "default"]
    services = [f[1] for a, ops, fs in rules(forms) if ops == ("mach-lookup",) for f in fs]
    assert services == list(MACH_SERVICES)
    for escape in ("com.apple.coreservices.launchservicesd", "com.apple.trustd.agent", "com.apple.SecurityServer",
                   "com.apple.mDNSResponder", "com.apple.dnssd.service"):
        assert escape not in services


def test_taken_back_paths_come_after_the_allows_and_pin_their_folders():
    text = profile(["/Users/me/project", "/private/tmp/run"], 8080,
                   read_only=["/Users/me/project/sub/.venv"], hidden=["/Users/me/.state/egress"],
                   unreadable_files=["/Users/me/project/audit.log"])
    found = rules(read_sbpl(text))
    last_allow = max(i for i, r in enumerate(found) if r[0] == "allow")
    denies = found[last_allow + 1:]
    assert denies == [
        ("deny", ("file-write*",), [["subpath", "/Users/me/project/sub/.venv"]]),
        ("deny", ("file-read*", "file-write*"), [["subpath", "/Users/me/.state/egress"]]),
        ("deny", ("file-read*", "file-write*"), [["literal", "/Users/me/project/audit.log"]]),
        ("deny", ("file-write-unlink",), [["literal", "/Users/me/project/sub"], ["literal", "/Users/me/project"]]),
        ("deny", ("network-outbound",), [["remote", "unix-socket", ["subpath", "/Users/me/.state/egress"]]]),
    ]


def test_without_fs_confinement_writes_are_open_but_hidden_paths_stay_hidden():
    text = profile(["/p"], 1, hidden=["/Users/me/.state/egress"], fs_confinement=False)
    found = rules(read_sbpl(text))
    assert ("allow", ("file-write*",), []) in found
    assert ("deny", ("file-read*", "file-write*"), [["subpath", "/Users/me/.state/egress"]]) in found


def test_paths_are_normalised_and_deduplicated():
    text = profile(["/Users/me/project/", "/Users/me/project/./", "//Users//me/x/.."], 1)
    assert writable_subpaths(text) == ["/Users/me/project", "/Users/me"]


# ------------------------------------------------------------------ canonical paths


def test_canonical_resolves_symlinks_as_seatbelt_sees_them(tmp_path):
    real = tmp_path / "private" / "tmp"
    real.mkdir(parents=True)
    link = tmp_path / "tmp"
    link.symlink_to(real)
    (real / "run").mkdir()
    assert canonical(str(link / "run")) == str(real / "run")
    assert canonical(str(link / "run" / ".." / "run")) == str(real / "run")


def test_canonical_prefers_the_name_stored_on_disk():
    # On macOS fcntl(F_GETPATH) answers with the case a case-insensitive volume stored.
    assert canonical("/Users/me/Project", realpath=lambda p: p,
                     getpath=lambda p: p.replace("Project", "project")) == "/Users/me/project"
    assert canonical("/Users/me/new", realpath=lambda p: p, getpath=lambda p: None) == "/Users/me/new"


def test_canonical_macos_symlinks_with_a_table_realpath():
    links = {"/tmp": "/private/tmp", "/var": "/private/var", "/etc": "/private/etc"}

    def realpath(path):
        for link, target in links.items():
            if path == link or path.startswith(link + "/"):
                return target + path[len(link):]
        return path

    assert canonical("/tmp/x", realpath=realpath, getpath=lambda p: None) == "/private/tmp/x"
    assert canonical("/var/folders/ab/cd/T/egress-run-1", realpath=realpath,
                     getpath=lambda p: None) == "/private/var/folders/ab/cd/T/egress-run-1"


# ------------------------------------------------------------------ golden profiles


CASES = {
    "allowlist": dict(writable=["/Users/me/project", "/private/var/folders/ab/cd/T/egress-run-0a1b2c"],
                      proxy_port=53117, read_only=["/Users/me/project/.venv"],
                      hidden=["/Users/me/.local/state/egress"],
                      unreadable_files=["/Users/me/project/audit.log"],
                      sockets=["/private/var/folders/ab/cd/T/egress-run-0a1b2c"]),
    "network-off": dict(writable=["/Users/me/project", "/private/tmp/egress-run-0a1b2c", "/Users/me/data"],
                        proxy_port=None, hidden=["/Users/me/.local/state/egress"],
                        sockets=["/private/tmp/egress-run-0a1b2c"]),
    "no-fs-confinement": dict(writable=["/Users/me/project"], proxy_port=8080,
                              hidden=["/Users/me/.local/state/egress"], fs_confinement=False),
    "hostile": dict(writable=['/Users/me/a "quoted" (dir)\n; (allow default)', "/Users/me/back\\slash\\"],
                    proxy_port=1, hidden=["/Users/jérôme/état"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_profile(case):
    """The whole profile, as written: a change to any rule shows up here, to be reviewed. Set
    EGRESS_UPDATE_GOLDEN=1 to rewrite the files (then read the diff)."""
    arguments = dict(CASES[case])
    text = profile(arguments.pop("writable"), arguments.pop("proxy_port"), **arguments)
    path = GOLDEN / f"{case}.sb"
    if os.environ.get("EGRESS_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")
    read_sbpl(text)
