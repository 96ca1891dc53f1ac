"""A small SBPL (Seatbelt profile) reader for the tests: Scheme's rules for strings (only \\" and
\\\\ are escapes), #"..." regex literals, ; comments. It parses the profiles egress generates so
tests can check their structure, not their text (tests/sandbox/test_seatbelt.py, test_macos.py)."""

from __future__ import annotations


class Str(str):
    """A string literal."""


class Regex(str):
    """A regex literal, #"..."."""


class Atom(str):
    """A symbol or number."""


class ReadError(ValueError):
    pass


def read_sbpl(text: str) -> list:
    """Every top-level form of ``text``, as nested lists of Str, Regex and Atom. Raises ReadError
    on anything unbalanced, an unterminated string, or an escape other than \\" and \\\\."""
    forms: list = []
    stack: list[list] = [forms]
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
        elif c == ";":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            stack.append([])
            i += 1
        elif c == ")":
            if len(stack) == 1:
                raise ReadError(f"unbalanced ')' at {i}")
            done = stack.pop()
            stack[-1].append(done)
            i += 1
        elif c == '"' or (c == "#" and text[i + 1:i + 2] == '"'):
            kind = Str if c == '"' else Regex
            i += 1 if c == '"' else 2
            out = []
            while True:
                if i >= n:
                    raise ReadError("unterminated string")
                ch = text[i]
                if ch == "\\":
                    nxt = text[i + 1:i + 2]
                    if nxt not in ('"', "\\"):
                        raise ReadError(f"unknown escape \\{nxt!r} at {i}")
                    out.append(nxt)
                    i += 2
                elif ch == '"':
                    i += 1
                    break
                else:
                    out.append(ch)
                    i += 1
            stack[-1].append(kind("".join(out)))
        else:
            j = i
            while j < n and text[j] not in ' \t\r\n();"':
                j += 1
            stack[-1].append(Atom(text[i:j]))
            i = j
    if len(stack) != 1:
        raise ReadError(f"{len(stack) - 1} unclosed '('")
    return forms


def rules(forms: list) -> list[tuple[str, tuple[str, ...], list]]:
    """(action, operations, filters) for every allow and deny form."""
    out = []
    for form in forms:
        head = form[0]
        if head == "version":
            continue
        assert head in ("allow", "deny"), f"unexpected top-level form {form!r}"
        operations = tuple(x for x in form[1:] if isinstance(x, Atom))
        filters = [x for x in form[1:] if isinstance(x, list)]
        assert len(operations) + len(filters) == len(form) - 1, f"a bare string at the top of {form!r}"
        out.append((head, operations, filters))
    return out


def filter_paths(filters: list, kind: str) -> list[str]:
    """The strings of every ``(kind "...")`` filter, nested ones included."""
    found = []
    for f in filters:
        if f and f[0] == kind and len(f) == 2 and isinstance(f[1], Str):
            found.append(str(f[1]))
        else:
            found += filter_paths([x for x in f if isinstance(x, list)], kind)
    return found


def writable_subpaths(text: str) -> list[str]:
    found = []
    for action, operations, filters in rules(read_sbpl(text)):
        if action == "allow" and "file-write*" in operations:
            found += filter_paths(filters, "subpath")
    return found


def strings(text: str) -> list[str]:
    """Every string literal in the profile, wherever it is."""
    found: list[str] = []

    def walk(form):
        for x in form:
            if isinstance(x, list):
                walk(x)
            elif isinstance(x, Str):
                found.append(str(x))
    walk(read_sbpl(text))
    return found
