"""Where each entry of a policy's lists is written, noted once, when the file is read.

The proxy names the deciding rule's file:line in every event; it used to search the file
for it on the rule's first use, on its event loop (up to 70 ms per rule at 1M entries).
The line is now noted while the file is read (egress.policy.text.read_toml). These tables
pin that the line noted is the line a person finds the entry on, the line the old search
(policy_loader.find_line) gave wherever that search was right, and that read_toml reads
exactly what tomllib reads (values and errors).
"""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path

import pytest

from egress.policy.loader import find_line, load_policy, read_file
from egress.policy.text import read_toml

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
     """, {"allow": [1, 1]}),  # an escape leaves the list to tomllib; neither is found as written: the key's line
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
    from egress.policy.loader import policy_from_mapping

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


# --- read_toml against tomllib: a second reader of the policy must never read it another way ---
#
# read_toml reads plain lists itself (egress/policy/text.py says which shapes and why that is
# exact); anything else goes to tomllib. These cases pin, for each tricky shape, who reads it
# and that the values (or the error) are tomllib's. "scanner": at least one list read by
# read_toml itself; "tomllib": the whole file read by tomllib; "error": tomllib refuses it.

TRICKY = [
    ("one-per-line", 'allow = [\n  "a.example",\n  "b.example",\n]\n', "scanner"),
    ("one-line", "allow = [\"a.example\", 'b.example']  # c\n", "scanner"),
    ("no-spaces-no-newline-at-end", 'allow=["a.example"]', "scanner"),
    ("indented-key", '  allow = [ "a.example" ]\n', "scanner"),
    ("quoted-keys", '"allow" = ["a"]\n\'deny\' = ["b"]\n', "scanner"),
    ("last-value-then-newline-then-bracket", 'allow = [\n  "a",\n  "b"\n]\n', "scanner"),
    ("last-value-then-comment", 'allow = [\n  "a" # why\n  # more\n]\n', "scanner"),
    ("trailing-comma", 'allow = ["a",]\n', "scanner"),
    ("empty", 'allow = []\ndeny = [\n]\n', "scanner"),
    ("empty-strings", "allow = [\"\", '']\n", "scanner"),
    ("hash-and-brackets-in-strings", 'allow = ["a#b", "a]b", "[c", "d,e"]\n', "scanner"),
    ("the-other-quote-inside", "allow = [\"it's\", 'say \"hi\"', \"a'''b\", 'a\"\"\"b']\n", "scanner"),
    ("backslash-in-a-literal-string", "allow = ['a\\b', 'c\\u0061']\n", "scanner"),
    ("tab-in-strings-and-comments", 'allow = [\t"a\tb",\t# c\td\n]\n', "scanner"),
    ("comment-with-quotes-and-brackets", 'allow = [ # ] "x", [ \'\n  "a", # """ \'\'\' ]\n]\n', "scanner"),
    ("unicode", 'allow = ["bücher.de", "日本.jp", "😀", "a\u2028b", "a\x85b"]  # ü\n', "scanner"),
    ("crlf", 'allow = [\r\n  "a",\r\n]\r\n', "scanner"),
    ("list-keys-not-lists-elsewhere", 'allowx = ["a"]\nallow_privatex = ["b"]\nallow = ["c"]\n', "scanner"),
    ("after-the-list-a-table", 'allow = ["a"]\n[t]\nx = ["b"]\n', "scanner"),
    # tomllib's, whole
    ("basic-escape-quote", 'allow = ["a\\"b"]\n', "tomllib"),
    ("basic-escape-unicode", 'allow = ["caf\\u00e9.example"]\n', "tomllib"),
    ("basic-escaped-backslash-before-quote", 'allow = ["a\\\\", "b"]\n', "tomllib"),
    ("comma-on-the-next-line", 'allow = [\n  "a"\n  , "b"\n]\n', "tomllib"),
    ("comment-between-value-and-comma", 'allow = [\n  "a" # c\n  , "b"\n]\n', "tomllib"),
    ("multi-line-basic-string", 'allow = ["""a"""]\n', "tomllib"),
    ("multi-line-literal-string", "allow = ['''a\nb''']\n", "tomllib"),
    ("four-quotes", 'allow = [""""a""""]\n', "tomllib"),
    ("nested-array", 'allow = [["a"]]\n', "tomllib"),
    ("inline-table", 'allow = [{ x = "a" }]\n', "tomllib"),
    ("number", "allow = [1]\n", "tomllib"),
    ("key-in-a-table", '[t]\nallow = ["a"]\n', "tomllib"),
    # a list key in a table (no policy has one) sends the whole file to tomllib, the top-level list too
    ("top-level-list-and-one-in-a-table", 'allow = ["a"]\n[t]\ndeny = ["b"]\n', "tomllib"),
    ("key-in-an-array-of-tables", '[[t]]\nallow = ["a"]\n[[t]]\nallow = ["b"]\n', "tomllib"),
    ("key-in-a-multi-line-string", 's = """\nallow = ["evil"]\n"""\n', "tomllib"),
    ("key-in-a-multi-line-literal-string", "s = '''\nallow = [\"evil\"]\n'''\ndeny = [\"d\"]\n", "tomllib"),
    ("key-in-a-multi-line-string-in-a-list", 'deny = ["""\nallow = ["evil"]\n"""]\n', "tomllib"),
    ("allow-as-a-table", '[allow]\nx = ["a"]\n', "tomllib"),
    ("dotted-key", 'allow.x = ["a"]\n', "tomllib"),
    ("escaped-key", '"\\u0061llow" = ["a"]\n', "tomllib"),
    # refused by tomllib, whatever read_toml would have made of it
    ("duplicate-key", 'allow = ["a"]\nallow = ["b"]\n', "error"),
    ("duplicate-key-quoted", 'allow = ["a"]\n"allow" = ["b"]\n', "error"),
    ("duplicate-key-escaped", 'allow = ["a"]\n"\\u0061llow" = ["b"]\n', "error"),
    ("duplicate-key-one-not-plain", 'allow = ["a"]\nallow = [1]\n', "error"),
    ("list-then-table", 'allow = ["a"]\n[allow]\n', "error"),
    ("list-then-array-of-tables", 'allow = ["a"]\n[[allow]]\n', "error"),
    ("list-then-dotted", 'allow = ["a"]\nallow.x = 1\n', "error"),
    ("key-in-another-list", 'x = [\nallow = ["a"]\n]\n', "error"),
    ("string-closed-in-a-comment-of-the-list", 's = """\nallow = [ # """\n"x" ]\n', "error"),
    ("string-closed-in-a-string-of-the-list", 's = """\nallow = [\'x"""\', "y"]\nz = """\n"""\n', "error"),
    ("only-comma", "allow = [,]\n", "error"),
    ("double-comma", 'allow = ["a",,]\n', "error"),
    ("unclosed-at-the-end", 'allow = [\n  "a",', "error"),
    ("unclosed-string", 'allow = ["a]\n', "error"),
    ("text-after", 'allow = ["a"] x\n', "error"),
    ("bracket-after", 'allow = ["a"]]\n', "error"),
    ("bare-cr-in-the-list", 'allow = [\r  "a",\r\n]\n', "error"),
    ("bare-cr-in-a-comment", 'allow = [ # c\r\n  "a", # d\re\n]\n', "error"),
    ("control-in-a-string", 'allow = ["a\x01"]\n', "error"),
    ("delete-in-a-string", 'allow = ["a\x7f"]\n', "error"),
    ("nul-in-a-literal", "allow = ['a\x00']\n", "error"),
    ("newline-in-a-string", 'allow = ["a\n"]\n', "error"),
    ("bad-escape", 'allow = ["a\\q"]\n', "error"),
    ("byte-order-mark", '\ufeffallow = ["a"]\n', "error"),
]


def read_noting_who(text: str) -> tuple[tuple[dict, dict], str]:
    """read_toml's answer and who read it: "scanner" (some list read by read_toml) or "tomllib"."""
    from egress.policy import text as policy_text

    took, alone = [], []
    read_array, tomllib_alone = policy_text._read_array, policy_text._tomllib_alone

    def noting_read_array(*args):
        read = read_array(*args)
        took.append(read is not None and read[1])
        return read

    def noting_alone(src):
        alone.append(True)
        return tomllib_alone(src)

    policy_text._read_array, policy_text._tomllib_alone = noting_read_array, noting_alone
    try:
        got = read_toml(text)
    finally:
        policy_text._read_array, policy_text._tomllib_alone = read_array, tomllib_alone
    if alone or not any(t is not False for t in took):
        return got, "tomllib"
    data, lines = got  # the scanner's lists only: tomllib's have lines searched for (_search_lines)
    return (data, {key: found for key, found in lines.items() if any(found is t for t in took)}), "scanner"


def tomllib_or_error(text: str):
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return ("error", str(e))


def read_toml_or_error(text: str):
    try:
        (data, lines), who = read_noting_who(text)
    except tomllib.TOMLDecodeError as e:
        return ("error", str(e)), "error", {}
    return data, who, lines


def assert_lines_plausible(text: str, data: dict, lines: dict) -> None:
    """Each entry of a list the scanner read is on its line, quoted, and the lines never go back."""
    rows = text.replace("\r\n", "\n").split("\n")
    assert lines
    for key, found in lines.items():
        assert len(found) == len(data[key]), key
        assert list(found) == sorted(found), key
        for value, line in zip(data[key], found):
            assert f'"{value}"' in rows[line - 1] or f"'{value}'" in rows[line - 1], (key, value, line)


@pytest.mark.parametrize(("text", "who"), [c[1:] for c in TRICKY], ids=[c[0] for c in TRICKY])
def test_tricky_texts_read_as_tomllib_reads_them(text, who):
    expected = tomllib_or_error(text)
    got, got_who, lines = read_toml_or_error(text)
    assert got == expected
    assert got_who == who
    if who == "scanner":
        assert_lines_plausible(text, got, lines)


# The pieces random policies are made of: values (valid, escaped, multi-line, broken), what goes
# between them, keys in every spelling, and statements around the lists.
_VALUES = [
    '"a.example"', "'b.example'", '""', "''", '"a#b"', '"a]b"', '"[c"', '"d,e"', "'a\"b'", "\"a'b\"",
    '"a\tb"', '"bücher.de"', "'日本'", '"😀"', '"a\u2028b"', '"a\x85b"', "'a\\b'", '"a\'\'\'b"',
    '"a\\"b"', '"\\u00e9"', '"\\t"', '"a\\\\"', '"\\q"', '"\\"', '"""a"""', "'''a'''", '"""a\nb"""',
    "'''\nx'''", '""""a""""', '"a\x01"', '"a\x7f"', '"a\r"', "1", "true", "{ x = 1 }", '["a"]', "[]",
    '"abc', "'abc", "'a = [\"b\"]'", '"allow = ["',
]
_BETWEEN = [",", ", ", " ,", ",,", "", "\n", ",\n", ", # c \"q\" ] [ , '\n", ",  # \"\"\" '''\n", "\n\n",
            "\t,", ",\r\n", "\r", " # c\n,", "\n, ", ",\n  # only a comment\n"]
_KEYS = ["allow", "deny", "passthrough", "allow_private", '"allow"', "'deny'", "  allow", "allowx",
         "allow.x", '"\\u0061llow"', "Allow", "allow ", "\tdeny"]
_OTHER = ['network = "allowlist"', "x = 1", "# a comment with allow = [\"x\"]", "", "[t]", "[[t]]",
          "[allow]", "[[allow]]", 's = """\n{list}\n"""', "s = '''\n{list}\n'''", "x = [\n{list}\n]",
          'include = ["a.toml"]', "[credentials]\nignore_env = [\"X\"]", 's = """', "'''"]
_NOISE = ['"', "'", "\\", "#", "[", "]", ",", "\n", "\r", "=", " ", "\x01", '"""', "\r\n"]


def random_list(rng, key: str) -> str:
    if rng.random() < 0.8:  # mostly what a policy looks like: plain values, one per line or a few on one
        parts = [rng.choice(["\n", "", " # c\n"])]
        for _ in range(rng.randrange(0, 8)):
            value = rng.choice(_VALUES) if rng.random() < 0.1 else rng.choice(_VALUES[:18])
            parts += [rng.choice(["  ", "", "\t"]), value, rng.choice([",\n", ", ", ",", ",  # x\n"])]
        if parts[-1] in (", ", ",") and rng.random() < 0.5:
            parts[-1] = ""
        parts.append(rng.choice(["]", "\n]", " ] # end", "]"]))
        return f"{key} = [" + "".join(parts)
    parts = [rng.choice(_VALUES) if i % 2 == 0 else rng.choice(_BETWEEN) for i in range(rng.randrange(0, 9))]
    return f"{key} = [" + "".join(parts) + rng.choice(["]", "", "]]", "] x", " ]  # c", "\n]"])


def random_policy(rng) -> str:
    statements, keys = [], rng.sample(_KEYS[:4], 4)  # mostly each key once (a duplicate is an error)

    def key() -> str:
        return rng.choice(_KEYS) if rng.random() < 0.2 or not keys else keys.pop()

    for _ in range(rng.randrange(1, 5)):
        if rng.random() < 0.7:
            statements.append(random_list(rng, key()))
        else:
            statements.append(rng.choice(_OTHER).replace("{list}", random_list(rng, key())))
    text = "\n".join(statements) + rng.choice(["\n", "", "\n\n"])
    if rng.random() < 0.15:
        text = text.replace("\n", "\r\n")
    for _ in range(rng.choice([0, 0, 0, 0, 0, 1, 2])):  # a few texts broken at random
        at = rng.randrange(len(text) + 1)
        cut = rng.choice([0, 0, 1])
        text = text[:at] + rng.choice(_NOISE + [""]) + text[at + cut:]
    return text


@pytest.mark.parametrize("chunk", [65536, 300], ids=["chunk-64k", "chunk-300"])
def test_random_policies_read_as_tomllib_reads_them(monkeypatch, chunk):
    """Thousands of generated policies: read_toml's values (or error) are tomllib's, every time.
    A small chunk makes every scan cross chunk boundaries. EGRESS_DIFF_TEXTS=N runs N per chunk."""
    import os
    import random

    from egress.policy import text as policy_text

    monkeypatch.setattr(policy_text, "CHUNK", chunk)
    rng = random.Random(11_06 + chunk)
    who = {"scanner": 0, "tomllib": 0, "error": 0}
    for _ in range(int(os.environ.get("EGRESS_DIFF_TEXTS", "4000"))):
        text = random_policy(rng)
        if chunk < 1000 and rng.random() < 0.3:  # long enough to cross chunks
            text = "allow = [\n" + '  "pad.example", # pad\n' * rng.randrange(10, 60) + "]\n" + text
        expected = tomllib_or_error(text)
        got, got_who, lines = read_toml_or_error(text)
        assert got == expected, text
        who[got_who] += 1
        if got_who == "scanner":
            assert_lines_plausible(text, got, lines)
    # Not vacuous: each side read a good share.
    total = sum(who.values())
    assert all(n > total // 10 for n in who.values()), who


def test_a_list_read_is_sliced_as_a_list():
    # The loader takes a list's entries a batch at a time, as slices (policy_text.Strings).
    text = 'allow = [\n' + "".join(f'  "e{i}.example",\n' for i in range(10)) + '  "",\n]\n'
    data, _ = read_toml(text)
    entries, expected = data["allow"], tomllib.loads(text)["allow"]
    assert not isinstance(entries, list) and entries == expected and len(entries) == 11
    for piece in (slice(0, 4), slice(4, 8), slice(8, 256), slice(3, 3), slice(5, 2), slice(None, None, 3),
                  slice(-3, None), slice(20, 30)):
        assert entries[piece] == expected[piece], piece
    assert [entries[i] for i in (0, 9, 10, -1, -11)] == [expected[i] for i in (0, 9, 10, -1, -11)]
    with pytest.raises(IndexError):
        entries[11]
