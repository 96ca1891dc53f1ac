"""The `egress` command's entry point: `egress run` starts without importing click when it can.

Importing click (and what it brings: inspect, typing, enum...) was a third of an `egress run --
true` (afa2038; bench/README.md, "Launcher"). So an `egress run` whose options are all in the table below, written as
click takes them (``--opt value`` or ``--opt=value``, options before the command, ``--``
optional), with values click would accept unchanged, is parsed here and run at once. Anything
else goes to click (egress.cli) exactly as typed: another command, ``--help``, an option not
in the table, a value click would refuse or convert (so click's errors stay click's). Both
parsers make the same RunOptions: tests/run/test_entry.py holds them to it on a table of real
command lines.
"""

from __future__ import annotations

import math
import os
import sys

from egress.core.contract import NETWORK_MODES, PROXY_MODE_ENV, PROXY_MODES

# option -> (kind, what it takes): kind "flag" (no value), "one" (the last one wins), "many"
OPTIONS = {
    "--network": ("one", NETWORK_MODES),
    "--policy": ("many", str),
    "--allow": ("many", str),
    "--deny": ("many", str),
    "--project": ("one", "folder"),
    "--add-dir": ("many", "folder"),
    "--read": ("many", "existing"),
    "--allow-hooks": ("flag", None),
    "--timeout": ("one", "seconds"),
    "--no-fs-confinement": ("flag", None),
    "--redact": ("flag", None),
    "--ask": ("one", ("tty", "never")),
    "--headless": ("flag", None),
    "--proxy": ("one", PROXY_MODES),
    "--resolve": ("many", "override"),
    "--audit-log": ("one", str),
    "--state-dir": ("one", "path"),
    "--agent": ("flag", None),
    "--max-output": ("one", "bytes"),
    "--guard-commands": ("flag", None),
}
ENVIRONMENT = {"--proxy": PROXY_MODE_ENV, "--state-dir": "EGRESS_STATE_DIR"}  # as click's envvar=


class Unparsed(Exception):
    """Not a command line this parser takes: click parses it."""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["run"]:
        try:
            options = parse_run(args[1:], os.environ)
        except Unparsed:
            options = None
        if options is not None:
            from egress.run.launcher import main as launch

            launch(options)  # never returns
    from egress.cli import main as click_main

    click_main(args)


def parse_run(args: list[str], environ) -> object:
    """`egress run`'s arguments (after "run") as egress.cli would make them: a RunOptions. Raises
    Unparsed for anything this parser does not take as click would."""
    given: dict[str, list[str]] = {}
    command: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            command = args[index + 1:]
            break
        if not arg.startswith("-") or arg == "-":  # the command; what follows is its own
            command = args[index:]
            break
        name, equals, value = arg.partition("=")
        kind, _ = OPTIONS.get(name, (None, None))
        if kind is None:
            raise Unparsed(name)  # --help, an option of click's only, a typo: click says
        if kind == "flag":
            if equals:
                raise Unparsed(arg)
            given.setdefault(name, []).append("")
            index += 1
            continue
        if not equals:
            if index + 1 >= len(args):
                raise Unparsed(arg)
            value = args[index + 1]
            index += 2
        else:
            index += 1
        if not value or value.startswith("-"):
            raise Unparsed(arg)  # click would take it as the value; a person rarely meant that
        given.setdefault(name, []).append(value)
    if not command:
        raise Unparsed("no command")
    for name, variable in ENVIRONMENT.items():
        if name not in given and environ.get(variable):
            given[name] = [environ[variable]]
    return _options(given, command)


def _options(given: dict[str, list[str]], command: list[str]):
    from egress.proxy.config import DEFAULT_LIMITS, ProxyConfig
    from egress.run.options import RunOptions

    values = {name: [_convert(name, value) for value in found] for name, found in given.items()}

    def one(name, default=None):
        return values[name][-1] if name in values else default

    audit = one("--audit-log", "off")
    proxy = ProxyConfig(metrics=None, audit_log=None if audit == "off" else audit,
                        resolve=_overrides(values.get("--resolve", [])), state_dir=one("--state-dir"),
                        extra_options=dict(DEFAULT_LIMITS))
    return RunOptions(argv=command, network=one("--network"), policies=values.get("--policy", []),
                      allow=values.get("--allow", []), deny=values.get("--deny", []),
                      project=one("--project", _convert("--project", ".")), add_dirs=values.get("--add-dir", []),
                      timeout=one("--timeout"), fs_confinement="--no-fs-confinement" not in values,
                      proxy=proxy, redact="--redact" in values,
                      ask="never" if "--headless" in values else one("--ask"), proxy_mode=one("--proxy"),
                      agent="--agent" in values, max_output=one("--max-output"),
                      guard_commands="--guard-commands" in values, read=values.get("--read", []),
                      allow_hooks="--allow-hooks" in values)


def _convert(name: str, value: str):
    """The value as click's type for ``name`` converts it; Unparsed where click might refuse it."""
    _, takes = OPTIONS[name]
    if takes is None or takes is str:
        return value
    if isinstance(takes, tuple):
        if value not in takes:
            raise Unparsed(value)
        return value
    if takes == "seconds":  # click.FloatRange(min=0, min_open=True)
        try:
            seconds = float(value)
        except ValueError:
            raise Unparsed(value) from None
        if not (math.isfinite(seconds) and seconds > 0):
            raise Unparsed(value)
        return seconds
    if takes == "bytes":  # cli.ByteSize
        from egress.agent.output_cap import parse_size

        try:
            return parse_size(value)
        except ValueError:
            raise Unparsed(value) from None
    if takes == "override":
        from egress.core.hosts import parse_override

        try:
            return parse_override(value)
        except ValueError:
            raise Unparsed(value) from None
    # click.Path: an existing path must be readable; "folder" (file_okay=False) must not be a
    # regular file. As str: RunOptions keeps its folders as str (pathlib is never imported).
    try:
        info = os.stat(value)
    except OSError:
        if takes == "existing":  # click.Path(exists=True) refuses it, in its own words
            raise Unparsed(value) from None
        return value
    import stat

    if (takes == "folder" and stat.S_ISREG(info.st_mode)) or not os.access(value, os.R_OK):
        raise Unparsed(value)
    return value


def _overrides(pairs) -> dict:
    result: dict = {}
    for host, address in pairs:
        result.setdefault(host, []).append(address)
    return result
