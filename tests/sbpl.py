"""A small SBPL (Seatbelt profile) reader for the tests: Scheme's rules for strings (only \\" and
\\\\ are escapes), #"..." regex literals, ; comments. It parses the profiles egress generates so
tests can check their structure, not their text (tests/sandbox/test_seatbelt.py, test_macos.py)."""

from __future__ import annotations

import re


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


def decide(text: str, operation: str, path: str | None = None, *, name: str | None = None,
           fallback: str | None = None) -> str:
    """What the profile decides, "allow" or "deny", for ``operation`` on ``path`` (a file
    operation) or ``name`` (a sysctl), as Seatbelt does: the last rule that names the operation,
    or a wildcard over it (file-write* names file-write-create), and whose filters match, wins;
    (deny default) when none does. ``fallback``: the operation whose decision an operation no
    rule names takes instead of the default (to show that a rule holds whatever a macOS takes
    file-map-executable to fall back to).

    Filters read: subpath, literal, regex (as POSIX does: $ only at the end), sysctl-name,
    sysctl-name-prefix; a rule for ``operation`` with any other filter is an error here, so a
    test cannot pass by not reading a rule."""
    verdict = None
    for action, operations, filters in rules(read_sbpl(text)):
        if not any(_names(op, operation) for op in operations):
            continue
        if not filters or any(_matches(f, path, name) for f in filters):
            verdict = action
    if verdict is None and fallback is not None:
        return decide(text, fallback, path, name=name)
    if verdict is None:
        verdict = decide(text, "default") if operation != "default" else "deny"
    return verdict


def _names(rule_operation: str, operation: str) -> bool:
    if rule_operation.endswith("*"):
        return operation.startswith(rule_operation[:-1])
    return rule_operation == operation


def _matches(f: list, path: str | None, name: str | None) -> bool:
    kind, argument = f[0], (f[1] if len(f) > 1 else None)
    if kind in ("subpath", "literal", "regex"):
        if path is None:
            raise AssertionError(f"a path rule {f!r} for an operation asked without a path")
        if kind == "subpath":
            return path == argument or path.startswith(argument.rstrip("/") + "/")
        if kind == "literal":
            return path == argument
        return re.search(posix_regex(argument), path, re.DOTALL) is not None
    if kind in ("sysctl-name", "sysctl-name-prefix"):
        if name is None:
            raise AssertionError(f"a sysctl rule {f!r} asked without a name")
        return name == argument if kind == "sysctl-name" else name.startswith(argument)
    raise AssertionError(f"decide() does not read the filter {f!r}")


def posix_regex(pattern: str) -> str:
    """``pattern`` for Python's re with POSIX's $: the end of the text only (Python's also
    matches before a final newline, which a file name may end with)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "$":
            c = r"\Z"
        out.append(c)
        i += 1
    return "".join(out)
