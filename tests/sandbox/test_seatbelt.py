"""The macOS Seatbelt profile (sandbox/seatbelt.py), proven without a Mac.

Whole profiles are compared with golden files (tests/sandbox/golden/*.sb) for representative
runs; an s-expression reader written here (a Scheme reader's rules for strings: only ``\\"``
and ``\\\\`` are escapes) parses every generated profile and checks its structure: balanced,
only version/allow/deny forms, and the set of writable subpaths exactly the set asked for,
for a table of hostile path names too.
"""

from __future__ import annotations

import os
import re
import sys
import unicodedata
from collections import Counter
from pathlib import Path

import pytest
from sbpl import (  # noqa: F401
    Atom,
    ReadError,
    Regex,
    Str,
    decide,
    filter_paths,
    posix_regex,
    read_sbpl,
    rules,
    strings,
    writable_subpaths,
)

from sandbox.protected import LATER_RUN
from sandbox.seatbelt import FOLDS, MACH_SERVICES, ProfileError, any_case, canonical, profile, sbpl_string

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


# ------------------------------------------------------------------ what the strongest peers do not grant


def test_no_sysctl_is_ever_written():
    text = profile(["/p"], 1)
    assert not [r for r in rules(read_sbpl(text)) if r[0] == "allow" and any(o.startswith("sysctl-w") for o in r[1])]
    for name in ("kern.grade_cputype", "kern.tcsm_enable", "kern.maxproc"):
        assert decide(text, "sysctl-write", name=name) == "deny"


def test_sysctls_are_read_by_name_and_no_other_process_s_arguments_are():
    text = profile(["/p"], 1)
    for name in ("hw.ncpu", "hw.memsize", "hw.cachelinesize", "hw.optional.arm.FEAT_SHA3", "hw.optional.avx2_0",
                 "kern.osproductversion", "kern.proc.pid.4242", "machdep.cpu.brand_string", "sysctl.proc_translated"):
        assert decide(text, "sysctl-read", name=name) == "allow", name
    # KERN_PROCARGS2: the arguments and environment of the user's other processes (egress's launcher,
    # the user's shells); kern.proc.all: every process on the Mac.
    for name in ("kern.procargs2", "kern.procargs", "kern.proc.all", "kern.proc.uid.501", "security.mac.sandbox.x",
                 "vm.swapusage.x"):
        assert decide(text, "sysctl-read", name=name) == "deny", name


CODE_TREES = ["/Users/me/.local", "/Users/me/.rustup"]


@pytest.mark.parametrize("fallback", [None, "file-read-data"], ids=["alone", "falling-back-to-reads"])
def test_code_is_mapped_only_from_where_code_is_installed(fallback):
    """Whether or not this macOS decides file-map-executable as it decides reads when no rule names
    it, the profile's own rules decide it: the system, toolchains, the run's trees; nowhere else."""
    text = profile(["/Users/me/project", "/private/tmp/run"], 1, code=CODE_TREES)
    for path in ("/usr/lib/libSystem.B.dylib", "/System/Library/Frameworks/Python.framework/Versions/3.9/Python",
                 "/opt/homebrew/Cellar/python@3.12/3.12.4/Frameworks/Python.framework/Versions/3.12/Python",
                 "/usr/local/lib/libpq.5.dylib", "/Applications/Xcode.app/Contents/Developer/usr/lib/libLTO.dylib",
                 "/Library/Developer/CommandLineTools/usr/lib/libclang.dylib",
                 "/Library/Ruby/Gems/2.6.0/gems/nokogiri-1.15/lib/nokogiri/nokogiri.bundle",
                 "/Users/me/project/.venv/lib/python3.12/site-packages/numpy/_core/_multiarray_umath.so",
                 "/Users/me/project/target/debug/deps/libserde_derive-1a2b.dylib", "/private/tmp/run/build/x.so",
                 "/Users/me/.rustup/toolchains/stable-aarch64-apple-darwin/lib/librustc_driver-1.dylib",
                 "/Users/me/.local/share/uv/python/cpython-3.12/lib/libpython3.12.dylib"):
        assert decide(text, "file-map-executable", path, fallback=fallback) == "allow", path
    for path in ("/Users/Shared/evil.dylib", "/Volumes/USB/lib.dylib", "/Users/me/Downloads/x.dylib",
                 "/private/var/folders/ab/cd/T/other/x.so", "/Users/me/projectile/x.so", "/tmp/x.dylib"):
        assert decide(text, "file-map-executable", path, fallback=fallback) == "deny", path
    found = rules(read_sbpl(text))
    assert found.index(("deny", ("file-map-executable",), [])) < next(
        i for i, r in enumerate(found) if r[:2] == ("allow", ("file-map-executable",)))


def test_no_dynamic_code_generation_is_granted():
    assert decide(profile(["/p"], 1), "dynamic-code-generation") == "deny"


# ------------------------------------------------------------------ files that run later (issue 25 item 7)


TREE = "/Users/me/project"
LATER = [f"{TREE}/{name}" for name in LATER_RUN] + [f"{TREE}/.git/modules/lib/hooks", f"{TREE}/.husky"]
WRITES = ("file-write-create", "file-write-data", "file-write-unlink", "file-write-mode", "file-write-xattr",
          "file-write-times", "file-write-flags", "file-write-owner", "file-write-setugid", "file-write-acl")


def _later_profile(tree=TREE, later=None, **options):
    later = [p.replace(TREE, tree, 1) for p in (LATER if later is None else later)]
    return profile([tree, "/private/tmp/run"], 1, later_run=later, **options)


@pytest.mark.parametrize("relative", [
    ".git/hooks/pre-commit", ".git/hooks", ".git/config", ".gitmodules", ".vscode/tasks.json", ".vscode",
    ".idea/workspace.xml", ".cursor/mcp.json", ".claude/settings.json", ".mcp.json", ".envrc",
    ".git/modules/lib/hooks/post-checkout", ".husky/pre-commit",
    # what a case-insensitive volume takes for the same names
    ".GIT/HOOKS/pre-commit", ".Git/Config", ".VSCODE/tasks.json", ".ENVRC", ".git/hoo\u212as/pre-commit",
    ".git/con\ufb01g", ".v\u017fcode/tasks.json", ".MCP.JSON", ".git/MODULES/lib/HOOKS/x",
])
def test_files_that_run_later_cannot_be_written_in_any_way(relative):
    text = _later_profile()
    for operation in WRITES:
        assert decide(text, operation, f"{TREE}/{relative}") == "deny", (operation, relative)


@pytest.mark.parametrize("relative", [
    ".git/index", ".git/objects/ab/cdef", ".git/refs/heads/main", ".git/HEAD", ".git/COMMIT_EDITMSG",
    ".git/config.lock", ".git/FETCH_HEAD", ".git/logs/HEAD", ".git/modules/lib/index", ".envrc.example",
    ".vscode-server-notes", ".github/workflows/ci.yml", "src/main.py", ".gitignore", "hooks/x", "config",
])
def test_everything_else_in_the_tree_stays_writable(relative):
    """git add, commit and fetch write these; the project's own files are the command's."""
    text = _later_profile()
    for operation in ("file-write-create", "file-write-data", "file-write-unlink"):
        assert decide(text, operation, f"{TREE}/{relative}") == "allow", (operation, relative)


@pytest.mark.parametrize("path", [f"{TREE}/.git", f"{TREE}/.GIT", f"{TREE}/.git/modules", f"{TREE}/.git/modules/lib",
                                  f"{TREE}/.git/Modules/LIB"])
def test_the_folders_on_the_way_cannot_be_renamed_removed_made_or_rewritten(path):
    """`mv .git .git2; write .git2/hooks/x; mv .git2 .git`; `mv staged .git` where there was none; a
    `.git` file (a worktree's `gitdir:`) rewritten to name a repository of the command's making."""
    text = _later_profile()
    for operation in WRITES:
        assert decide(text, operation, path) == "deny", (operation, path)


def test_the_tree_cannot_be_moved_away_or_replaced_but_works_inside():
    text = _later_profile()
    assert decide(text, "file-write-unlink", TREE) == "deny"  # mv project /private/tmp/run/p, write, mv back
    assert decide(text, "file-write-create", TREE) == "deny"  # a rename over an empty project
    assert decide(text, "file-write-create", f"{TREE}/new") == "allow"
    assert decide(text, "file-write-unlink", f"{TREE}/new") == "allow"


def test_the_later_run_denies_come_after_every_allow():
    found = rules(read_sbpl(_later_profile()))
    last_allow = max(i for i, r in enumerate(found) if r[0] == "allow")
    later = [i for i, r in enumerate(found) if r[0] == "deny" and any(
        TREE + "/.git" in p for p in filter_paths(r[2], "subpath") + filter_paths(r[2], "literal"))]
    assert later and min(later) > last_allow


def test_with_hooks_allowed_there_is_no_such_rule():
    text = _later_profile(later=[])
    assert decide(text, "file-write-data", f"{TREE}/.git/hooks/pre-commit") == "allow"
    assert decide(text, "file-write-unlink", f"{TREE}/.git") == "allow"


@pytest.mark.parametrize("name,tree", [(n, os.path.normpath(p)) for n, p in HOSTILE if n != "very long"],
                         ids=[n for n, _ in HOSTILE if n != "very long"])
def test_a_hostile_tree_name_keeps_the_later_run_rules_exact(name, tree):
    """The regexes name the tree as written, every character of it escaped: the rules deny its
    files, not its neighbours', whatever its name (a regex a name could widen would deny more, one
    it could narrow would deny less)."""
    text = _later_profile(tree=tree)
    assert decide(text, "file-write-create", f"{tree}/.git/hooks/x") == "deny"
    assert decide(text, "file-write-create", f"{tree}/.GIT/HOOKS/x") == "deny"
    assert decide(text, "file-write-unlink", f"{tree}/.Git") == "deny"
    assert decide(text, "file-write-create", f"{tree}/src/x") == "allow"
    assert decide(text, "file-write-create", f"{tree}/.git/index") == "allow"
    for regex in (str(f[1]) for _, _, fs in rules(read_sbpl(text)) for f in fs if f[0] == "regex"):
        if regex.startswith("^/dev/"):
            continue
        assert re.compile(posix_regex(regex))  # a regex Python reads as the same one
        assert re.search(posix_regex(regex), f"{tree}x/.git/hooks/y", re.DOTALL) is None
        assert re.search(posix_regex(regex), "/Users/me/other/.git/hooks/y", re.DOTALL) is None


def test_a_path_too_deep_for_a_seatbelt_string_is_refused_with_the_way_out():
    deep = TREE + "/" + "/".join(["hooks"] * 60)
    with pytest.raises(ProfileError, match="--allow-hooks"):
        profile([TREE], 1, later_run=[deep])
    very_long = dict(HOSTILE)["very long"]
    with pytest.raises(ProfileError, match="--allow-hooks"):
        _later_profile(tree=very_long)


def test_the_case_folding_table_is_the_unicode_databases():
    """Every character whose (full, NFD) case folding is ASCII, from this Python's Unicode data: what
    APFS takes for an ASCII name besides its two cases."""
    derived: dict[str, str] = {}
    for code in range(0x80, sys.maxunicode + 1):
        folded = unicodedata.normalize("NFD", unicodedata.normalize("NFD", chr(code)).casefold())
        if folded.isascii():
            derived[folded] = derived.get(folded, "") + chr(code)
    assert derived == FOLDS


@pytest.mark.parametrize("text", [".git/hooks", ".git/config", ".gitmodules", ".vscode", ".mcp.json", ".envrc",
                                  "ffi/st;`"])
def test_any_case_matches_every_spelling_and_nothing_else(text):
    regex = re.compile("^" + any_case(text) + "$")
    spellings = {text, text.upper(), text.title(), text.swapcase()}
    for seq, alternatives in FOLDS.items():
        for alternative in alternatives:
            spellings.add(text.replace(seq, alternative))
    for spelling in spellings:
        assert regex.match(spelling), spelling
        assert unicodedata.normalize("NFD", spelling).casefold() == text.casefold() or spelling != text
    for other in (text + "x", "x" + text, text[:-1], text.replace(".", "x"), text.replace("/", "_")):
        if other.casefold() != text.casefold():
            assert not regex.match(other), other


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
                      sockets=["/private/var/folders/ab/cd/T/egress-run-0a1b2c"],
                      later_run=[f"/Users/me/project/{name}" for name in LATER_RUN],
                      code=["/Users/me/.local", "/Users/me/.cargo", "/Users/me/.rustup", "/Users/me/Library/Python"]),
    "network-off": dict(writable=["/Users/me/project", "/private/tmp/egress-run-0a1b2c", "/Users/me/data"],
                        proxy_port=None, hidden=["/Users/me/.local/state/egress"],
                        sockets=["/private/tmp/egress-run-0a1b2c"]),
    "no-fs-confinement": dict(writable=["/Users/me/project"], proxy_port=8080,
                              hidden=["/Users/me/.local/state/egress"], fs_confinement=False),
    "hostile": dict(writable=['/Users/me/a "quoted" (dir)\n; (allow default)', "/Users/me/back\\slash\\"],
                    proxy_port=1, hidden=["/Users/jérôme/état"],
                    later_run=['/Users/me/a "quoted" (dir)\n; (allow default)/.git/hooks',
                               "/Users/me/back\\slash\\/.envrc"]),
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
