"""Where each entry of a policy's lists is written, noted once, when the file is read.

The proxy names the deciding rule's file:line in every event; it used to search the file
for it on the rule's first use, on its event loop (up to 70 ms per rule at 1M entries).
The line is now noted while the file is read (egress.policy_text.read_toml). These tables
pin that the line noted is the line a person finds the entry on, the line the old search
(policy_loader.find_line) gave wherever that search was right, and that read_toml reads
exactly what tomllib reads (values and errors).
"""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path

import pytest

from egress.policy import load_policy
from egress.policy_loader import find_line, read_file
from egress.policy_text import read_toml

# (id, file text, {list key: line of each entry, in order})
LAYOUTS = [
    ("one-per-line", """
        allow = [
          "a.example",
          "b.example",
        ]
     """, {"allow": [2, 3]}),
    ("several-per-line-no-trailing-comma", """
        allow = ["a.example", "b.example",
          "c.example"]
        deny = ['d.example']
     """, {"allow": [1, 1, 2], "deny": [3]}),
    ("comments-and-blank-lines", """
        allow = [
          # "b.example" is explained below
          "a.example",  # a comment with "quotes" and 'more'

          "b.example",
        ]
     """, {"allow": [3, 5]}),  # the old search gave 2 for b.example: the comment
    ("literal-strings-and-quoted-key", """
        "allow" = [
          'a.example',
          "b.example" ,
        ]
     """, {"allow": [2, 3]}),
    ("escapes-decoded", r"""
        allow = [
          "caf\u00e9.example",
          "tab\tin.example",
        ]
     """, {"allow": [2, 3]}),  # the old search found neither as written: the key's line, 1
    ("unicode", """
        # 日本語のコメント
        allow = [
          "bücher.de",  # ü
          "münchen.de",
        ]
     """, {"allow": [3, 4]}),
    ("same-text-in-two-lists", """
        allow = [
          "github.com",
        ]
        passthrough = [
          "github.com",
        ]
        allow_private = ["10.0.0.0/8"]
        deny = ["10.0.0.0/8"]
     """, {"allow": [2], "passthrough": [5], "allow_private": [7], "deny": [8]}),
    ("allow-is-not-allow_private", """
        allow_private = ["x.example"]
        allow = ["x.example"]
     """, {"allow_private": [1], "allow": [2]}),
    ("duplicates-each-on-its-own-line", """
        allow = [
          "a.example",
          "a.example",
        ]
     """, {"allow": [2, 3]}),  # the old search gave 2 for both (the first decides: same answer)
    ("exact-entries", """
        allow = [
          "=httpbin.org",
          "=s3.amazonaws.com:443",
        ]
     """, {"allow": [2, 3]}),
    ("tables-and-inline-tables-around", """
        network = "allowlist"
        include = ["dev"]
        allow = [
          "api.example.com",
        ]
        [credentials]
        ignore_env = ["X"]
        [[credentials.secret]]
        env = "TOKEN"
        hosts = ["api.example.com"]
        [[credentials.secret]]
        file = "/dev/null"
        hosts = [ { not_a = "host" } ]
     """, {"allow": [4]}),
    ("an-inline-table-in-a-list", """
        allow = [
          "a.example",
          { x = 1 },
        ]
     """, {"allow": [2, 1]}),  # read by tomllib; not a string: the key's line, as before
    ("a-multi-line-string-in-a-list", '''
        allow = [
          "a.example",
          """b.example""",
        ]
     ''', {"allow": [2, 3]}),  # read by tomllib, each entry searched for in order
    ("an-array-inside-a-multi-line-string", '''
        note = """
        allow = ["evil.example"]
        """
        allow = [
          "good.example",
        ]
     ''', {"allow": [5]}),
    ("an-array-inside-a-table", """
        allow = ["a.example"]
        [extra]
        deny = ["b.example"]
     """, {"allow": [1]}),
    ("empty-lists", """
        allow = []
        deny = [
        ]
     """, {"allow": [], "deny": []}),
]


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


@pytest.mark.parametrize(("text", "lines"), [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_each_entry_has_the_line_it_is_written_on(text, lines):
    text = dedent(text)
    data, found = read_toml(text)
    assert data == tomllib.loads(text)
    assert {key: list(found[key]) for key in found} == lines
    crlf, crlf_found = read_toml(text.replace("\n", "\r\n"))
    assert crlf == data and crlf_found == found


# Texts tomllib refuses: read_toml raises the same error (message and line).
INVALID = [
    ("double-comma", 'allow = ["a.example",,]\n'),
    ("text-after-the-list", 'allow = ["a.example"] x\n'),
    ("control-character", 'allow = [\n  "a\x01.example",\n]\n'),
    ("control-character-in-a-comment", 'allow = [\n  "a.example", # \x01\n]\n'),
    ("duplicate-key", 'allow = ["a.example"]\nallow = ["b.example"]\n'),
    ("unclosed", 'allow = [\n  "a.example",\n'),
    ("bare-carriage-return", 'allow = ["a.example"\r]\n'),
    ("missing-comma", 'allow = ["a.example" "b.example"]\n'),
    ("bad-escape", 'allow = ["a\\q.example"]\n'),
    ("error-after-a-long-list", 'allow = [\n' + '  "a.example",\n' * 3000 + ']\ndeny = [1, 2\n'),
    ("error-before-a-long-list", 'x = \nallow = [\n' + '  "a.example",\n' * 3000 + ']\n'),
]


@pytest.mark.parametrize("text", [c[1] for c in INVALID], ids=[c[0] for c in INVALID])
def test_what_tomllib_refuses_is_refused_alike(text):
    with pytest.raises(tomllib.TOMLDecodeError) as expected:
        tomllib.loads(text)
    with pytest.raises(tomllib.TOMLDecodeError) as got:
        read_toml(text)
    assert str(got.value) == str(expected.value)


# Every form of entry, and a request each one decides.
FORMS = [
    ("host{i}.example.com", "host{i}.example.com", 80),
    ("*.wild{i}.example.org", "a.wild{i}.example.org", 80),
    ("port{i}.example.net:443", "port{i}.example.net", 443),
    ("=exact{i}.example.io", "exact{i}.example.io", 80),
    ("Upper{i}.Example.COM.", "www.upper{i}.example.com", 80),
    ("bücher{i}.de", "BÜCHER{i}.de", 80),
    ("10.{a}.{b}.0/24", "10.{a}.{b}.9", 80),
    ("10.{a}.{b}.7", "10.{a}.{b}.7", 80),
    ("[2001:db8::{i:x}]:443", "2001:db8::{i:x}", 443),
]


def entry(i: int) -> str:
    return FORMS[i % len(FORMS)][0].format(i=i, a=(i >> 8) & 255, b=i & 255)


def request(i: int) -> tuple[str, int]:
    _, host, port = FORMS[i % len(FORMS)]
    return host.format(i=i, a=(i >> 8) & 255, b=i & 255), port


def generated_policy(directory: Path) -> tuple[Path, Path]:
    """Two files, one including the other, with every form of entry in every layout: entries
    0-1499 in the included file's allow list, 1500-2999 in the main file's, 3000-3599 denied."""

    def body(start: int, count: int) -> str:
        out, i = [], start
        while i < start + count:
            if i % 11 == 0:
                out.append("")
            if i % 7 == 0:
                out.append(f'  # "{entry(i + 3)}" comes later')  # a comment quoting a later entry
            if i % 5 == 0:
                out.append("  " + ", ".join(f'"{entry(j)}"' for j in range(i, i + 3)) + ",  # three")
                i += 3
            else:
                out.append(f"  '{entry(i)}'," if i % 13 == 0 else f'  "{entry(i)}",')
                i += 1
        return "\n".join(out) + "\n"

    included = directory / "included.toml"
    included.write_text(f"# included\nallow = [\n{body(0, 1500)}]\n", encoding="utf-8")
    main = directory / "main.toml"
    main.write_text(f'include = ["included.toml"]\n\nallow = [\n{body(1500, 1500)}]\n'
                    f'deny = [\n{body(3000, 600)}]\npassthrough = [\n{body(1500, 40)}]\n', encoding="utf-8")
    return main, included


def written_at(path: Path, text: str, key: str) -> int:
    """The line a person finds an entry on: quoted, from its list's line on, not in a comment."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith(f"{key} = ["))
    return next(n + 1 for n in range(start, len(lines)) if not lines[n].lstrip().startswith("#")
                and (f'"{text}"' in lines[n] or f"'{text}'" in lines[n]))


def test_a_generated_policy_has_the_lines_the_old_search_found(tmp_path):
    main, included = generated_policy(tmp_path)
    for path in (main, included):
        text = path.read_text(encoding="utf-8")
        data, found = read_toml(text)
        assert data == tomllib.loads(text)
        for key, entries in data.items():
            if key == "include":
                continue
            assert list(found[key]) == [written_at(path, entry, key) for entry in entries], key
            for entry, line in zip(entries, found[key]):
                old = find_line(str(path), entry, key)
                if old != line:  # only where the old search landed on a comment quoting it first
                    assert text.splitlines()[old - 1].lstrip().startswith("#"), (key, entry)


def test_rules_name_their_file_and_line_through_includes(tmp_path):
    main, included = generated_policy(tmp_path)
    policy = load_policy([str(main)])
    for i in range(0, 3600, 7):
        key, path = ("allow", included) if i < 1500 else ("allow", main) if i < 3000 else ("deny", main)
        decision = policy.decide(*request(i))
        assert (decision.allowed, decision.rule.text) == (key == "allow", entry(i)), (i, decision)
        assert str(decision.rule) == f"{entry(i)} ({path.resolve()}:{written_at(path, entry(i), key)})"


def test_a_duplicate_entry_decides_at_its_first_line(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('allow = [\n  "a.example",\n  "b.example",\n  "a.example",\n]\n', encoding="utf-8")
    assert load_policy([str(path)]).decide("a.example").rule.location() == f"{path.resolve()}:2"


def test_a_mapping_has_no_lines(tmp_path):
    from egress.policy import policy_from_mapping

    rule = policy_from_mapping({"allow": ["a.example"]}, "<command line>").decide("a.example").rule
    assert (rule.line, rule.location()) == (None, "<command line>")


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_a_large_file_reads_as_read_text_does(tmp_path, newline):
    path = tmp_path / "big.toml"
    line = '  "bücher-ß-日本.example",  # ü\n'.replace("\n", newline)
    path.write_bytes(("allow = [" + newline + line * 70_000 + "]" + newline).encode())  # ~2.4 MiB
    assert path.stat().st_size > 2 << 20
    assert read_file(path) == path.read_text(encoding="utf-8")


def test_a_large_file_that_is_not_utf8_is_refused_as_read_text_refuses_it(tmp_path):
    path = tmp_path / "big.toml"
    path.write_bytes(b"allow = [\n" + b'  "a.example",\n' * 200_000 + b'  "\xff",\n]\n')
    with pytest.raises(UnicodeDecodeError) as expected:
        path.read_text(encoding="utf-8")
    with pytest.raises(UnicodeDecodeError) as got:
        read_file(path)
    assert str(got.value) == str(expected.value)
