"""The command deny list: commands `egress run` refuses before they start.

A guard against accidents, not against an adversary: an agent that means to run
``sudo`` can spell it in ways no list foresees (``$(printf su)do``, a script file, python's
``os.system``). What it stops is the command typed by mistake, in the forms people type.

Rules are regular expressions anchored to *command position*: the start of the argv, and
inside shell scripts (``sh -c``/``bash -c`` and the like, ``eval``) the start of a line or
what follows ``;``, ``|``, ``&``, ``&&``, ``||``, ``(``, ``$(``, a backtick, ``then``, ``do``,
``else``, ``!``, ``{``, ... So ``grep -r "sudo" .`` and ``echo "shutdown" >> notes.txt``
pass: ``sudo`` and ``shutdown`` are arguments there, not commands.

Each command found is matched as one normalised text: its words with the shell's quoting
removed, joined by single spaces, the command's name without its folder (``/usr/bin/sudo`` is
``sudo``), leading ``NAME=value`` assignments and wrappers that run their arguments (``env``,
``nohup``, ``timeout 5``, ``nice -n 10``, ``xargs``, ``command``, ``exec``, ``time``, ...)
removed, and its redirections at the end (``cat x > /dev/sda``). A command line a wrapper takes
as an option's value or runs through a shell is read like ``sh -c``'s: ``env -S 'sudo -n true'``
(split into words as env splits them, in any spelling: ``-S'...'``, ``--split-string=...``,
``-iS ...``), ``flock FILE -c SCRIPT``, ``watch 'a; b'``. A rule matches from the
command's start and must end at a word's end: ``sudo`` does not match ``sudoku``, and
``git push --force`` matches ``git push --force origin main``.

Allow rules are checked first and win over both lists, per command. A rule that is not a
valid regular expression is matched as literal text (with a warning at load), never an
exception. Pure: no files, no processes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple

BUILTIN = "built-in"

_ROOTS = (r"(?:/+\.?\*?|~/*\*?|\$HOME/*\*?|\$\{HOME\}/*\*?|"
          r"/+(?:bin|boot|dev|etc|home|lib|lib32|lib64|opt|proc|root|sbin|srv|sys|usr|var)/*\*?)")
_BLOCK = r"/dev/(?:sd|hd|vd|xvd|nvme|mmcblk|md|dm-|mapper/|disk/|loop|nbd|rbd|zd)\S*"

# (name, pattern, why): the bar for a built-in rule is that no legitimate agent task needs
# the command, and running it by accident cannot be undone.
BUILTIN_RULES = (
    ("rm-root", r"rm(?=\s(?:.*\s)?(?:-[a-zA-Z]*[rR][a-zA-Z]*|--recursive)(?:\s|$))"
                rf"(?=\s(?:.*\s)?{_ROOTS}(?:\s|$)).*",
     "recursive removal of /, ~ or a system folder"),
    ("chmod-root", r"(?:chmod|chown|chgrp)(?=\s(?:.*\s)?(?:-[a-zA-Z]*R[a-zA-Z]*|--recursive)(?:\s|$))"
                   rf"(?=\s(?:.*\s)?{_ROOTS}(?:\s|$)).*",
     "recursive permission or owner change of /, ~ or a system folder"),
    ("mkfs", r"(?:mkfs(?:\.[\w.-]+)?|mke2fs|mkswap|mkdosfs|mkntfs|wipefs)(?:\s.*)?",
     "makes or wipes a file system"),
    ("block-device", rf"(?:dd\s(?:.*\s)?of={_BLOCK}|shred\s(?:.*\s)?{_BLOCK}|.*\s(?:>|>>|>\||&>|&>>)\s{_BLOCK}).*",
     "writes onto a block device"),
    ("power", r"(?:shutdown|reboot|halt|poweroff|systemctl\s(?:.*\s)?(?:poweroff|reboot|halt|kexec|soft-reboot)"
              r"|(?:init|telinit)\s[06])(?:\s.*)?",
     "shuts down or restarts the machine"),
    ("sudo", r"(?:sudo|su|doas|pkexec|run0)(?:\s.*)?", "runs commands as another user"),
)
# Matched against a script's whole text, not at command position: the classic
# `:(){ :|:& };:` and any function that pipes itself into itself in the background.
FORK_BOMB = re.compile(r"([\w.:-]+)\s*\(\s*\)\s*\{[^}]*?(?<![\w.:-])\1\s*\|\s*&?\s*\1\s*&")

SHELLS = frozenset(("sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "posh", "yash", "busybox"))
_SHELL_VALUE_OPTIONS = frozenset(("-o", "+o", "-O", "+O", "--rcfile", "--init-file"))


class Wrapper(NamedTuple):
    """A command that runs its arguments as a command (``env``, ``nice -n 10``, ``timeout 5``).

    ``values``: its options that take a value (``-u NAME``, ``--unset=NAME``, ``-uNAME``); an
    option whose value is optional (``xargs -i``, ``watch -d``) takes it only attached, so it is
    a plain flag here. ``plain``: how many plain words (a duration, a lock file) come before the
    command. ``script``: options whose value is a shell script, read like ``sh -c``'s (``flock
    FILE -c 'sudo x'``). ``split``: options whose value is split into words that go where the
    option was, as ``env -S 'sudo -n true'`` does. ``joined``: its command's words are joined
    into one shell script (``watch 'a; b'``) unless one of these options is given (``watch -x``).
    ``dash``: a lone ``-`` is one of its options (``env -`` is ``env -i``). ``command``: whether
    the words after its options are a command (``script``'s are a log file: only ``-c`` runs one)."""

    values: frozenset[str] = frozenset()
    plain: int = 0
    script: frozenset[str] = frozenset()
    split: frozenset[str] = frozenset()
    joined: frozenset[str] | None = None
    dash: bool = False
    command: bool = True


def _options(*names: str) -> frozenset[str]:
    return frozenset(names)


# Long options may be shortened to any unambiguous prefix (getopt_long: `env --split 'sudo x'`).
WRAPPERS = {
    "env": Wrapper(_options("-u", "--unset", "-C", "--chdir", "-a", "--argv0"),
                   split=_options("-S", "--split-string"), dash=True),
    "command": Wrapper(), "builtin": Wrapper(), "exec": Wrapper(_options("-a")),
    "nohup": Wrapper(), "time": Wrapper(_options("-f", "--format", "-o", "--output")),
    "nice": Wrapper(_options("-n", "--adjustment")),
    "ionice": Wrapper(_options("-c", "--class", "-n", "--classdata", "-p", "--pid", "-P", "--pgid", "-u", "--uid")),
    "timeout": Wrapper(_options("-s", "--signal", "-k", "--kill-after"), plain=1), "setsid": Wrapper(),
    "stdbuf": Wrapper(_options("-i", "--input", "-o", "--output", "-e", "--error")),
    "chrt": Wrapper(_options("-T", "--sched-runtime", "-P", "--sched-period", "-D", "--sched-deadline"), plain=1),
    "taskset": Wrapper(plain=1),
    "xargs": Wrapper(_options("-a", "--arg-file", "-d", "--delimiter", "-E", "-I", "-L", "-n", "--max-args", "-P",
                              "--max-procs", "-s", "--max-chars", "--process-slot-var")),
    "watch": Wrapper(_options("-n", "--interval", "-q", "--equexit"), joined=_options("-x", "--exec")),
    "unbuffer": Wrapper(),
    "flock": Wrapper(_options("-w", "--wait", "--timeout", "-E", "--conflict-exit-code"), plain=1,
                     script=_options("-c", "--command")),
    "script": Wrapper(_options("-E", "--echo", "-I", "--log-in", "-O", "--log-out", "-B", "--log-io", "-T",
                               "--log-timing", "-m", "--logging-format", "-o", "--output-limit"),
                      script=_options("-c", "--command"), command=False),
    "caffeinate": Wrapper(_options("-w", "-t")),
}
# Words that start a compound command or negate one: the word after them is in command position.
RESERVED = frozenset(("!", "{", "}", "then", "do", "else", "elif", "if", "while", "until", "fi", "done", "esac"))
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\])?\+?=")
MAX_DEPTH = 16  # nested scripts (sh -c "sh -c '...'", $(...) in $(...)); deeper is refused


class Rule:
    """One deny or allow rule: as written, where it came from (``file:line`` or built-in)."""

    __slots__ = ("kind", "text", "where", "why", "pattern", "name")

    def __init__(self, kind: str, text: str, where: str, pattern: re.Pattern[str], why: str | None = None,
                 name: str | None = None):
        self.kind = kind  # "deny" | "allow"
        self.text = text
        self.where = where
        self.pattern = pattern
        self.why = why
        self.name = name  # a built-in rule's name

    def matches(self, command: str) -> bool:
        return self.pattern.match(command) is not None

    def describe(self) -> str:
        if self.where == BUILTIN:
            return f"the built-in rule {self.name!r} ({self.why})"
        key = "allow_commands" if self.kind == "allow" else "deny_commands"
        return f"{key} {self.text!r} ({self.where})"

    def __repr__(self) -> str:
        return f"Rule({self.kind!r}, {self.text!r}, {self.where!r})"


def compile_rule(text: str) -> tuple[re.Pattern[str], str | None]:
    """``text`` anchored to a command's start and a word's end; a text that is not a valid regular
    expression is matched as literal text. Returns (pattern, warning or None)."""
    try:
        re.compile(text)  # alone first: the error's position is then in the text as written
        return re.compile(rf"(?:{text})(?=\s|$)"), None
    except re.error as e:
        return (re.compile(re.escape(text) + r"(?=\s|$)"),
                f"{text!r} is not a valid regular expression ({e}); it is matched as literal text")


def builtin_rules() -> list[Rule]:
    return [Rule("deny", pattern, BUILTIN, re.compile(rf"(?:{pattern})(?=\s|$)"), why, name)
            for name, pattern, why in BUILTIN_RULES]


class Refusal:
    """Why a command line is refused: the rule, and the command (normalised) it matched."""

    __slots__ = ("rule", "command")

    def __init__(self, rule: Rule, command: str):
        self.rule = rule
        self.command = command

    def __str__(self) -> str:
        shown = self.command if len(self.command) <= 200 else self.command[:197] + "..."
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)
        return f"command refused by {self.rule.describe()}: {shown}"


def check(argv: list[str], deny: Sequence[Rule], allow: Sequence[Rule] = ()) -> Refusal | None:
    """The first refusal for ``argv`` (every command it would run, as far as the text shows), or None."""
    for command in commands(argv):
        if isinstance(command, _Special):
            return Refusal(command.rule, str(command))
        if any(rule.matches(command) for rule in allow):
            continue
        for rule in deny:
            if rule.matches(command):
                return Refusal(rule, command)
    return None


class _Special(str):
    """A finding that is not a command's text: refused by its own built-in rule, whatever allows."""

    rule: Rule

    def __new__(cls, text: str, rule: Rule) -> _Special:
        made = super().__new__(cls, text)
        made.rule = rule
        return made


_NEVER = re.compile(r"(?!)")
_TOO_DEEP_RULE = Rule("deny", "nesting", BUILTIN, _NEVER,
                      f"scripts nested more than {MAX_DEPTH} deep are not checked", "nesting")
_FORK_BOMB_RULE = Rule("deny", FORK_BOMB.pattern, BUILTIN, _NEVER,
                       "a function that starts copies of itself without end", "fork-bomb")


def commands(argv: list[str]) -> Iterator[str]:
    """Every command in command position in ``argv``, normalised (see the module's doc)."""
    yield from _from_words(list(argv), [], 0)


def _from_words(words: list[str], redirects: list[str], depth: int) -> Iterator[str]:
    if depth > MAX_DEPTH:
        yield _Special(" ".join(words), _TOO_DEEP_RULE)
        return
    words, scripts = _strip_prefix(words)
    for script in scripts:  # what a wrapper runs through a shell (flock -c, watch)
        yield from _from_script(script, depth + 1)
    if not words:
        return
    name = os.path.basename(words[0]) or words[0]
    if name == "busybox" and len(words) > 1:
        yield from _from_words(words[1:], redirects, depth + 1)
    inner: str | None = None
    if name in SHELLS:
        inner = _shell_script(words[1:])
    elif name == "eval":
        inner = " ".join(words[1:])
    if inner is not None:  # the script's commands first: a refusal then names the command inside
        yield from _from_script(inner, depth + 1)
    yield " ".join([name, *words[1:], *redirects])


def _strip_prefix(words: list[str]) -> tuple[list[str], list[str]]:
    """Without assignments, reserved words and wrappers before the command itself; and the shell
    scripts those wrappers run (``flock FILE -c SCRIPT``, ``watch 'a; b'``)."""
    words = list(words)
    scripts: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        if word in RESERVED or _ASSIGNMENT.match(word):
            index += 1
            continue
        wrapper = WRAPPERS.get(os.path.basename(word))
        if wrapper is None:
            break
        index += 1
        plain = wrapper.plain
        joined = wrapper.joined is not None
        runs = wrapper.command
        while index < len(words):
            option = words[index]
            if option == "--":
                index += 1
                break
            if option.startswith("-") and (len(option) > 1 or wrapper.dash):
                kind, value, used = _option(wrapper, words, index)
                if kind == "script":
                    scripts.append(value)
                    runs = False  # flock and script run that script, not their other words
                elif kind == "split":  # env -S: its words go where the option was, options included
                    words[index:index + used] = _split_string(value)
                    continue
                elif kind == "argv":
                    joined = False
                index += used
            elif _ASSIGNMENT.match(option):
                index += 1
            elif plain:
                plain -= 1
                index += 1
            else:
                break
        if not runs:
            return [], scripts
        if joined:  # watch runs `sh -c "<its words joined by spaces>"`
            if index < len(words):
                scripts.append(" ".join(words[index:]))
            return [], scripts
    return words[index:], scripts


def _option(wrapper: Wrapper, words: list[str], index: int) -> tuple[str, str, int]:
    """The option at ``words[index]`` as getopt reads it: (kind, its value, words used); kind is
    "value" (an option with a value, or a flag), "script", "split" or "argv" (watch -x)."""
    word = words[index]
    following = words[index + 1] if index + 1 < len(words) else ""
    kinds = (("split", wrapper.split), ("script", wrapper.script), ("value", wrapper.values),
             ("argv", wrapper.joined or frozenset()))
    if word.startswith("--"):
        name, equals, attached = word.partition("=")
        for kind, names in kinds:
            # getopt_long takes any unambiguous prefix; an ambiguous one stops the wrapper itself
            if any(len(name) > 2 and option.startswith(name) for option in names if option.startswith("--")):
                if kind == "argv":
                    return kind, "", 1
                return (kind, attached, 1) if equals else (kind, following, 2)
        return "value", "", 1
    for at in range(1, len(word)):  # a cluster of short options: -iu NAME, -iuNAME, -S'sudo x'
        option = "-" + word[at]
        for kind, names in kinds:
            if option in names:
                if kind == "argv":
                    return kind, "", 1
                rest = word[at + 1:]
                return (kind, rest, 1) if rest else (kind, following, 2)
    return "value", "", 1


# env -S's own escapes (GNU coreutils): \_ is a space that separates words outside quotes.
_SPLIT_ESCAPES = {"f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def _split_string(text: str) -> list[str]:
    """``env -S TEXT``'s words, split as GNU env splits them: blanks separate, '...' and "..." quote,
    backslash escapes (\\_ a separator outside quotes, \\c the end), # at a word's start a comment.
    ``${NAME}`` is kept as written (its value is not known here)."""
    words: list[str] = []
    word: str | None = None
    quote = None
    index, size = 0, len(text)
    while index < size:
        c = text[index]
        index += 1
        if quote == "'":
            if c == "'":
                quote = None
            elif c == "\\" and text[index:index + 1] in ("\\", "'"):
                word = (word or "") + text[index]
                index += 1
            else:
                word = (word or "") + c
        elif c == "\\":
            escaped = text[index:index + 1]
            index += 1
            if escaped == "c":
                break
            if escaped == "_" and quote is None:
                if word is not None:
                    words.append(word)
                word = None
                continue
            word = (word or "") + (" " if escaped == "_" else _SPLIT_ESCAPES.get(escaped, escaped))
        elif quote == '"':
            if c == '"':
                quote = None
            else:
                word = (word or "") + c
        elif c in " \t\n\v\f\r":
            if word is not None:
                words.append(word)
            word = None
        elif c in "'\"":
            quote = c
            word = word or ""
        elif c == "#" and word is None:
            break
        else:
            word = (word or "") + c
    if word is not None:
        words.append(word)
    return words


def _shell_script(args: list[str]) -> str | None:
    """The script of ``sh -c SCRIPT`` (``-ec``, ``-o pipefail -c``, ...), or None."""
    wants_script = False
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            index += 1
            break
        if arg[:1] in ("-", "+") and len(arg) > 1:
            if arg in _SHELL_VALUE_OPTIONS:
                index += 2
                continue
            if not arg.startswith("--") and "c" in arg[1:]:
                wants_script = True
            index += 1
            continue
        break
    if wants_script and index < len(args):
        return args[index]
    return None


def _from_script(script: str, depth: int) -> Iterator[str]:
    if depth > MAX_DEPTH:
        yield _Special(script, _TOO_DEEP_RULE)
        return
    bomb = FORK_BOMB.search(script)
    if bomb:
        yield _Special(bomb.group(0), _FORK_BOMB_RULE)
    expect_pattern = False
    for segment in _Lexer(script).segments():
        for nested in segment.nested:
            yield from _from_script(nested, depth + 1)
        words = segment.words
        if words[:1] == ["case"]:
            expect_pattern = segment.end != ")"
            continue
        if expect_pattern:  # a case pattern: `word)`, `a|b)`, `(word)`
            if segment.end == ")":
                expect_pattern = False
                continue
            if not words or segment.end == "|":
                continue
        if words[:1] == ["esac"]:
            continue
        if words[:1] == ["function"]:
            continue
        if segment.end in (";;", ";&", ";;&"):
            expect_pattern = True
        yield from _from_words(words, segment.redirects, depth)


class _Segment:
    __slots__ = ("words", "redirects", "nested", "end")

    def __init__(self) -> None:
        self.words: list[str] = []
        self.redirects: list[str] = []
        self.nested: list[str] = []
        self.end = ""


_OPERATORS = (";;&", ";;", ";&", "&&", "||", "|&", ";", "&", "|", "(", ")", "\n")
_REDIRECTS = ("<<<", "<<-", "&>>", "<<", "<>", "<&", ">&", ">>", ">|", "&>", "<", ">")


class _Lexer:
    """Splits a POSIX/bash script into simple commands: words with quoting removed, redirections
    apart, command substitutions ($(...), backticks, <(...)) kept as nested scripts. Never raises:
    an unfinished quote or substitution runs to the end of the text, as the shell would read it."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0

    def segments(self) -> list[_Segment]:
        s, n = self.s, len(self.s)
        out: list[_Segment] = []
        seg = _Segment()
        word: str | None = None
        redirect: str | None = None
        heredocs: list[tuple[str, bool]] = []

        def end_word() -> None:
            nonlocal word, redirect
            if word is None:
                return
            if redirect is not None:
                if redirect in ("<<", "<<-"):
                    heredocs.append((word, redirect == "<<-"))
                seg.redirects.append(f"{redirect} {word}")
                redirect = None
            else:
                seg.words.append(word)
            word = None

        while self.i < n:
            c = s[self.i]
            if c in " \t\r":
                end_word()
                self.i += 1
            elif c == "#" and word is None:
                end = s.find("\n", self.i)
                self.i = n if end < 0 else end
            elif c == "\\":
                if s[self.i + 1:self.i + 2] == "\n":
                    self.i += 2
                else:
                    word = (word or "") + s[self.i + 1:self.i + 2]
                    self.i += 2
            elif c == "'":
                end = s.find("'", self.i + 1)
                end = n if end < 0 else end
                word = (word or "") + s[self.i + 1:end]
                self.i = end + 1
            elif c == '"':
                word = (word or "") + self._double_quoted(seg)
            elif c == "`":
                word = (word or "") + self._backtick(seg)
            elif c == "$" and s.startswith("$((", self.i):
                end = self._closing(self.i + 1)
                word = (word or "") + s[self.i:end]
                self.i = end
            elif c == "$" and s.startswith("$(", self.i):
                word = (word or "") + self._substitution(seg, self.i + 1)
            elif c == "$" and s.startswith("${", self.i):
                end = s.find("}", self.i)
                end = n if end < 0 else end + 1
                word = (word or "") + s[self.i:end]
                self.i = end
            elif c in "<>" and s.startswith("(", self.i + 1):
                word = (word or "") + self._substitution(seg, self.i + 1)
            elif c in "<>" or (c == "&" and s.startswith(">", self.i + 1)):
                if word is not None and word.isdigit():
                    word = None  # a file descriptor: 2>err
                end_word()
                op = next(op for op in _REDIRECTS if s.startswith(op, self.i))
                self.i += len(op)
                if op in (">&", "<&"):  # 2>&1: a descriptor follows, or a file
                    m = re.compile(r"\s*(\d+-?|-)").match(s, self.i)
                    if m:
                        self.i = m.end()
                        continue
                redirect = op
            elif c in ";&|()\n":
                end_word()
                op = next(op for op in _OPERATORS if s.startswith(op, self.i))
                self.i += len(op)
                seg.end = op
                out.append(seg)
                seg = _Segment()
                if op == "\n" and heredocs:
                    self._skip_heredocs(heredocs)
                    heredocs.clear()
            else:
                word = (word or "") + c
                self.i += 1
        end_word()
        out.append(seg)
        return out

    def _double_quoted(self, seg: _Segment) -> str:
        s, n = self.s, len(self.s)
        self.i += 1
        text = []
        while self.i < n:
            c = s[self.i]
            if c == '"':
                self.i += 1
                break
            if c == "\\" and s[self.i + 1:self.i + 2] in ('"', "\\", "$", "`", "\n"):
                text.append(s[self.i + 1])
                self.i += 2
            elif c == "`":
                text.append(self._backtick(seg))
            elif s.startswith("$((", self.i):
                end = self._closing(self.i + 1)
                text.append(s[self.i:end])
                self.i = end
            elif s.startswith("$(", self.i):
                text.append(self._substitution(seg, self.i + 1))
            else:
                text.append(c)
                self.i += 1
        return "".join(text)

    def _backtick(self, seg: _Segment) -> str:
        s, n = self.s, len(self.s)
        start = self.i
        self.i += 1
        inner = []
        while self.i < n and s[self.i] != "`":
            if s[self.i] == "\\" and self.i + 1 < n:
                inner.append(s[self.i + 1])
                self.i += 2
            else:
                inner.append(s[self.i])
                self.i += 1
        self.i = min(self.i + 1, n)
        seg.nested.append("".join(inner))
        return s[start:self.i]

    def _substitution(self, seg: _Segment, open_at: int) -> str:
        """$(...) or <(...) whose "(" is at ``open_at``: its text is a nested script."""
        start = self.i
        end = self._closing(open_at)
        seg.nested.append(self.s[open_at + 1:end - 1] if end <= len(self.s) and self.s[end - 1:end] == ")"
                          else self.s[open_at + 1:end])
        self.i = end
        return self.s[start:end]

    def _closing(self, open_at: int) -> int:
        """The index after the ")" matching the "(" at ``open_at`` (quotes respected), or the end."""
        s, n = self.s, len(self.s)
        depth = 0
        i = open_at
        while i < n:
            c = s[i]
            if c == "\\":
                i += 2
                continue
            if c == "'":
                end = s.find("'", i + 1)
                i = n if end < 0 else end + 1
                continue
            if c == '"':
                i += 1
                while i < n and s[i] != '"':
                    i += 2 if s[i] == "\\" else 1
                i += 1
                continue
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return n

    def _skip_heredocs(self, heredocs: list[tuple[str, bool]]) -> None:
        s, n = self.s, len(self.s)
        for delimiter, tabs in heredocs:
            while self.i < n:
                end = s.find("\n", self.i)
                end = n if end < 0 else end
                line = s[self.i:end]
                self.i = min(end + 1, n)
                if (line.lstrip("\t") if tabs else line) == delimiter:
                    break
