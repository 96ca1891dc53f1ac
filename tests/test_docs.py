"""The README and docs/ say only what the code does: every example parses, every pointer points somewhere.

- Every command example (the `egress ...` lines of ```sh, ```bash and ```console blocks, and
  `$(egress ...)` inside any line) is parsed by egress.cli's own click commands: the subcommand
  exists, click accepts its options, their values and its arguments. Nothing runs. A line of
  another program is not checked, except `printf '...' > FILE.toml`, whose text is a policy.
- Every ```toml block, and every policy written with printf, loads with egress.policy (the loader,
  and the [credentials] settings beside it); every ```json block is JSON.
- Relative links reach a file, and an anchor a heading of that file (GitHub's slugs).
- Source paths the docs name exist; `path.py `name`` names something in that file;
  `tests/x.py::name` names a test there.
- docs/reference/cli.md documents every command and option; docs/architecture.md names every module.
- README.md stays short enough to read in five minutes (issue 27: 250 lines at most).

In process and fast: click parses, nothing is started.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import textwrap
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250

# Example lines that are not parsed, each with the reason. Empty: every example parses as written.
UNCHECKED: dict[str, str] = {}

# ```toml blocks that are not egress policies, by the file their info string names, with the reason.
NOT_POLICIES = {
    "containers.conf": "podman's own configuration (docs/guide/containers.md): podman reads it, not egress",
}

# Pages another engineer writes, linked before they exist (issue 27 item 6's decision).
PENDING_PAGES: set[str] = set()

FENCE = re.compile(r"^[ \t]*```(\w*)([^\n]*)\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _blocks(path: Path):
    """(language, the rest of its info string, first line number, text) of each fenced block."""
    text = path.read_text()
    for m in FENCE.finditer(text):
        yield m.group(1).lower(), m.group(2).strip(), text.count("\n", 0, m.start(3)) + 1, m.group(3)


def _prose(path: Path) -> str:
    """The page without its fenced blocks and inline code spans (where links are not links)."""
    text = FENCE.sub("", path.read_text())
    return re.sub(r"`[^`\n]*`", "", text)


# ------------------------------------------------------------------ command lines


def _command_lines(language: str, text: str):
    """The shell lines of a block: a console block's `$ ` lines; every line of a sh block but
    its comments (which show output). Continuation lines are joined."""
    lines, held = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if language == "console" and not held:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if not held and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            held += line[:-1] + " "
            continue
        lines.append(held + line)
        held = ""
    return lines


SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
SEPARATORS = {"|", "||", "&", "&&", ";", "(", ")"}
REDIRECTIONS = {">", ">>", "<", "<<", ">&", "<&", "&>"}


def _simple_commands(line: str):
    """The simple commands of one shell line, as word lists: `$(...)` substitutions are commands
    of their own (and one word where they stand); pipes, lists and redirections are taken apart."""
    for inner in SUBSTITUTION.findall(line):
        yield from _simple_commands(inner)
    line = SUBSTITUTION.sub("SUBSTITUTED", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in SEPARATORS or set(token) <= set("|&;()"):
            if words:
                yield words
            words = []
        elif set(token) <= set("<>&"):  # a redirection: its target is no word of the command
            words.append(token)
            if i + 1 < len(tokens) and not set(tokens[i + 1]) <= set("<>&|;()"):
                words.append(tokens[i + 1])
                i += 1
        else:
            words.append(token)
        i += 1
    if words:
        yield words


def _split_redirections(words: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    args, redirections = [], []
    i = 0
    while i < len(words):
        word = words[i]
        if set(word) <= set("<>&") and i + 1 < len(words):
            if args and args[-1].isdigit():  # 2>err.log: the descriptor is no argument
                args.pop()
            redirections.append((word, words[i + 1]))
            i += 2
            continue
        args.append(word)
        i += 1
    return args, redirections


def _examples():
    """(where, words) of every egress command line, and (where, text) of printf'd policies."""
    commands, policies = [], []
    for path in DOCS:
        for language, _, start, text in _blocks(path):
            if language not in ("sh", "bash", "shell", "console"):
                continue
            for line in _command_lines(language, textwrap.dedent(text)):
                for words in _simple_commands(line):
                    args, redirections = _split_redirections(words)
                    while args and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", args[0]):
                        args = args[1:]  # NAME=value before the command
                    if not args:
                        continue
                    where = f"{_rel(path)}:{start}: {line.strip()}"
                    if args[0] == "egress" or args[0].endswith("/egress"):
                        commands.append((where, args[1:]))
                    elif args[0] == "printf" and any(target.endswith(".toml") for _, target in redirections):
                        policies.append((where, args[1].encode().decode("unicode_escape")))
    return commands, policies


COMMANDS, PRINTED_POLICIES = _examples()


def parse(args: list[str]) -> click.Context:
    """egress's click commands parse ``args`` as the console script would, and call nothing."""
    from egress.cli import main

    ctx = main.make_context("egress", list(args))
    command = main
    while isinstance(command, click.Group):
        held = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args  # click < 8.2
        rest = [*held, *ctx.args]
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx


def test_the_docs_hold_command_examples_to_check():
    assert len(COMMANDS) >= 50, len(COMMANDS)
    subcommands = {words[0] for _, words in COMMANDS if words}
    assert {"run", "serve", "check", "policy", "ca", "allow", "events", "runs", "fence", "redact",
            "doctor"} <= subcommands


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_every_egress_command_example_parses(where, args):
    if where.split(": ", 1)[1] in UNCHECKED:
        pytest.skip(UNCHECKED[where.split(": ", 1)[1]])
    try:
        parse(args)
    except click.exceptions.Exit:  # --help, --version: they exist
        pass
    except click.BadParameter as e:
        # a file the example names (--read PATH) need not exist here
        if not (isinstance(getattr(e.param, "type", None), click.Path) and "does not exist" in e.format_message()):
            pytest.fail(f"{where}\n  click: {e.format_message()}")
    except click.UsageError as e:
        pytest.fail(f"{where}\n  click: {e.format_message()}")


def test_a_wrong_example_would_be_caught():
    for args in (["serve", "--workers", "N"], ["run", "--no-such-option", "--", "true"], ["nosuchcommand"],
                 ["run", "--max-output", "12Q", "--", "true"], ["check"]):
        with pytest.raises(click.UsageError):
            parse(args)


# ------------------------------------------------------------------ policies


def _policies():
    found = list(PRINTED_POLICIES)
    for path in DOCS:
        for language, info, start, text in _blocks(path):
            if language == "toml" and info not in NOT_POLICIES:
                found.append((f"{_rel(path)}:{start}", textwrap.dedent(text)))
    return found


POLICIES = _policies()


@pytest.mark.parametrize(("where", "text"), POLICIES, ids=[where for where, _ in POLICIES])
def test_every_policy_example_loads(where, text, tmp_path):
    from egress.policy import settings
    from egress.policy.loader import PolicyError

    path = tmp_path / "example.toml"
    path.write_text(text)
    try:
        settings.load([str(path)])
    except PolicyError as e:
        pytest.fail(f"{where}: {e}")


def test_every_block_left_unchecked_is_still_there():
    infos = {info for path in DOCS for language, info, _, _ in _blocks(path) if language == "toml"}
    assert set(NOT_POLICIES) <= infos


def test_json_examples_are_json():
    for path in DOCS:
        for language, _, start, text in _blocks(path):
            if language == "json":
                for number, line in enumerate(text.splitlines(), start):
                    if line.strip():
                        try:
                            json.loads(line)
                        except ValueError as e:
                            pytest.fail(f"{_rel(path)}:{number}: {e}")


# ------------------------------------------------------------------ links and names


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            slug = _slug(m.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_reaches_a_file_and_a_heading():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
            if re.match(r"^[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if _rel(dest) in PENDING_PAGES:
                continue
            if not dest.exists():
                broken.append(f"{_rel(path)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(path)}: {target}: no such heading")
    assert not broken, "\n".join(broken)


SOURCE_PATH = re.compile(r"(?<![\w/.~$-])((?:egress|sandbox|tests|bench|deploy|scripts|policies)/[\w./-]*\w)")


def test_every_source_path_named_exists():
    missing = sorted({f"{_rel(path)}: {name}" for path in DOCS
                      for name in SOURCE_PATH.findall(FENCE.sub("", path.read_text()))
                      if not (ROOT / name).exists()})
    assert not missing, "\n".join(missing)


def test_names_given_beside_a_source_file_are_in_it():
    """`egress/x.py `a`, `b`` (the threat model's mechanisms): each name is defined or used there."""
    missing = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"((?:egress|sandbox)/[\w/]+\.py)((?: `[\w.]+`(?:,| and)?)+)", text):
            source = ROOT / m.group(1)
            if not source.exists():
                continue  # test_every_source_path_named_exists says so
            code = source.read_text()
            for name in re.findall(r"`([\w.]+)`", m.group(2)):
                if not re.search(rf"\b{re.escape(name.split('.')[-1])}\b", code):
                    missing.append(f"{_rel(path)}: {m.group(1)} `{name}`")
    assert not missing, "\n".join(missing)


def test_every_test_named_exists():
    missing = []
    for path in DOCS:
        for m in re.finditer(r"(tests/[\w/]+\.py)((?:,? ?::\w+)+)", path.read_text()):
            test_file = ROOT / m.group(1)
            if not test_file.exists():
                missing.append(f"{_rel(path)}: {m.group(1)}")
                continue
            defined = {node.name for node in ast.walk(ast.parse(test_file.read_text()))
                       if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            missing += [f"{_rel(path)}: {m.group(1)}::{name}" for name in re.findall(r"::(\w+)", m.group(2))
                        if name not in defined]
    assert not missing, "\n".join(missing)


# ------------------------------------------------------------------ completeness


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## `egress ([^`]+)`\n", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _leaf_commands(command: click.Command, path: tuple[str, ...] = ()):
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from _leaf_commands(sub, (*path, name))
    else:
        yield " ".join(path), command


def test_the_cli_reference_documents_every_command_and_option():
    from egress.cli import main

    sections = _sections((ROOT / "docs/reference/cli.md").read_text())
    missing = []
    for name, command in _leaf_commands(main):
        if name not in sections:
            missing.append(f"egress {name}: no section")
            continue
        # run's proxy options are documented once, with serve's
        text = sections[name] + (sections.get("serve", "") if name == "run" else "")
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                long = max(param.opts, key=len)
                if not re.search(rf"(?<![\w-]){re.escape(long)}(?![\w-])", text):
                    missing.append(f"egress {name} {long}")
    assert not missing, "\n".join(missing)


def _modules() -> list[str]:
    """The repository's modules: git's list where there is one (a module still being written in
    this checkout is not the repository's yet), else every file."""
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "egress", "sandbox"], capture_output=True,
                                text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        listed = [_rel(p) for folder in ("egress", "sandbox") for p in (ROOT / folder).rglob("*.py")]
    return sorted(name for name in listed if name.endswith(".py") and not name.endswith("__init__.py"))


def test_the_architecture_names_every_module():
    text = (ROOT / "docs/architecture.md").read_text()
    modules = _modules()
    missing = [m for m in modules if f"`{m}`" not in text]
    assert not missing, "modules docs/architecture.md does not name:\n" + "\n".join(missing)


def test_the_readme_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/guide/"
