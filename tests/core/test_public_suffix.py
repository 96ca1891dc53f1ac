"""egress.core.public_suffix: the bundled list read fast, checked against tldextract's public API."""

from __future__ import annotations

import os
import subprocess
import sys

import idna
import pytest

from egress.core import public_suffix

CASES = [
    # (name, is a public suffix) -- from the list's ICANN and private sections, wildcards, exceptions
    ("com", True), ("uk", True), ("co.uk", True), ("github.io", True), ("githubusercontent.com", True),
    ("xn--p1ai", True),  # .рф, written in Unicode in the list
    ("xn--55qx5d.cn", True),  # 公司.cn
    ("foo.ck", True),  # *.ck
    ("www.ck", False),  # !www.ck
    ("example.com", False), ("example.co.uk", False), ("user.github.io", False), ("localhost", False),
    ("test", False),  # not in the list: a name under it counts its last two labels
]


@pytest.mark.parametrize(("name", "expected"), CASES, ids=[n for n, _ in CASES])
def test_fast_path_and_public_api_agree_on_real_cases(name, expected):
    assert public_suffix.is_public_suffix(name) is expected
    assert public_suffix.public_api_is_public_suffix(name) is expected


def _names_around_every_rule():
    exact, wild, exceptions = public_suffix.suffix_rules()
    names = set()
    for rule in exact:
        names |= {rule, f"x.{rule}", f"a.b.{rule}"}
    for rule in wild:
        names |= {rule, f"x.{rule}", f"y.x.{rule}"}
    for rule in exceptions:
        names |= {rule, f"x.{rule}"}
    return {idna.encode(name, uts46=True).decode().lower() for name in names}, wild


def test_the_fast_path_answers_as_the_public_api_for_every_rule_of_the_list():
    names, wild = _names_around_every_rule()
    differ = {name: public_suffix.is_public_suffix(name) for name in names
              if public_suffix.is_public_suffix(name) != public_suffix.public_api_is_public_suffix(name)}
    # Where they differ, the list says suffix (a wildcard rule covers it; tldextract's trie misses a
    # wildcard that also has children) and the fast path refuses more: never less.
    assert all(differ.values()), differ
    assert all(name.partition(".")[2] in wild for name in differ), differ
    assert len(differ) <= 20 and len(names) > 20000


def test_none_public_says_none_only_when_no_name_is_one():
    # A loader's batch test (none_public) against the test of each name, around every rule of the
    # list: alone, and in a batch of names that are not suffixes.
    names, _ = _names_around_every_rule()
    plain = [f"host{i}.example.com" for i in range(50)]
    assert public_suffix.none_public(plain) and public_suffix.none_public([])
    for name in sorted(names):
        if public_suffix.is_public_suffix(name):
            assert not public_suffix.none_public([name]), name
            assert not public_suffix.none_public(plain + [name]), name
    # and says none for the other real cases, but an exception to a wildcard rule (left to is_public_suffix)
    assert [name for name, suffix in CASES if public_suffix.none_public([name]) is suffix] == ["www.ck"]


def test_without_the_snapshot_file_the_public_api_answers(monkeypatch):
    monkeypatch.setattr(public_suffix, "SNAPSHOT", ".no-such-snapshot")
    public_suffix.forget()
    try:
        assert public_suffix.suffix_rules() is None
        assert [public_suffix.is_public_suffix(name) for name, _ in CASES] == [expected for _, expected in CASES]
        assert not public_suffix.none_public(["example.com"])  # each name to the public API
    finally:
        public_suffix.forget()


def test_checking_entries_imports_neither_tldextract_nor_requests(tmp_path):
    # What each `egress run --policy/--allow` pays before its command starts: no requests, no trie.
    code = ("import sys; from egress.policy import settings; "
            "settings.from_mapping({'include': ['dev'], 'allow': ['example.org'], 'passthrough': ['x.example.org:443']}); "
            "print(sorted(m for m in ('tldextract', 'requests', 'egress.scan.credentials') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


REGISTRABLE = [
    ("a.b.example.co.uk", "example.co.uk"),
    ("www.example.com", "example.com"),
    ("user.github.io", "github.io"),  # metrics group by the ICANN registrable domain
    ("api.allowed.test", "allowed.test"),  # unknown suffix: the last two labels
    ("co.uk", None),
    ("1.2.3.4", None),
]


@pytest.mark.parametrize(("host", "expected"), REGISTRABLE, ids=[h for h, _ in REGISTRABLE])
def test_registrable_domain(host, expected):
    assert public_suffix.registrable_domain(host) == expected


# ICANN section (no one's host) or only the private section (a company's own host, which an
# exact entry such as '=httpbin.org' may allow).
SECTIONS = [
    # (name, in the ICANN section)
    ("com", True), ("co.uk", True), ("foo.ck", True), ("xn--p1ai", True), ("xn--55qx5d.cn", True),
    ("github.io", False), ("httpbin.org", False), ("s3.amazonaws.com", False), ("herokuapp.com", False),
    ("githubusercontent.com", False),
    ("www.ck", False), ("example.com", False), ("test", False),
]


@pytest.mark.parametrize(("name", "icann"), SECTIONS, ids=[n for n, _ in SECTIONS])
def test_icann_section_fast_path_and_public_api_agree(name, icann):
    assert public_suffix.is_icann_suffix(name) is icann
    assert public_suffix.public_api_is_icann_suffix(name) is icann


def test_the_icann_fast_path_answers_as_the_public_api_for_every_rule_of_the_list():
    names, wild = _names_around_every_rule()
    differ = {name: public_suffix.is_icann_suffix(name) for name in names
              if public_suffix.is_icann_suffix(name) != public_suffix.public_api_is_icann_suffix(name)}
    # As for the whole list: where they differ the list says suffix and the fast path says so too.
    assert all(differ.values()), differ
    assert all(name.partition(".")[2] in wild for name in differ), differ
    icann = public_suffix.icann_rules()
    assert len(icann[0]) < len(public_suffix.suffix_rules()[0])  # the private section is left out
    # every ICANN suffix is a public suffix; the private section is the rest
    assert all(public_suffix.is_public_suffix(n) for n in names if public_suffix.is_icann_suffix(n))


def test_without_the_section_marker_the_public_api_answers(monkeypatch):
    monkeypatch.setattr(public_suffix, "ICANN_END", "===NO SUCH MARKER===")
    public_suffix.forget()
    try:
        assert public_suffix.icann_rules() is None
        assert [public_suffix.is_icann_suffix(n) for n, _ in SECTIONS] == [icann for _, icann in SECTIONS]
    finally:
        public_suffix.forget()


def test_nothing_is_ever_fetched(tmp_path):
    # Every public function, the public API included, with the network gone: a fetch would raise.
    code = """
import socket
def refuse(*args, **kwargs):
    raise AssertionError("a network call")
socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = socket.getaddrinfo = refuse
from egress.core import public_suffix as p
print(p.is_public_suffix("httpbin.org"), p.is_icann_suffix("httpbin.org"),
      p.public_api_is_public_suffix("httpbin.org"), p.public_api_is_icann_suffix("co.uk"),
      p.registrable_domain("www.example.co.uk"))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd(), "HOME": str(tmp_path),
                                               "TLDEXTRACT_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "True", "True", "example.co.uk"]
    assert not (tmp_path / "cache").exists()
