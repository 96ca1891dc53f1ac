"""The gates ./scripts/test runs before the tests (scripts/lint): what they hold and how they ratchet."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())
PURE = ["egress/core/", "egress/scan/", "egress/agent/", "egress/policy/"]


def _lint():
    loader = importlib.machinery.SourceFileLoader("scripts_lint", str(REPO / "scripts" / "lint"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


lint = _lint()


def test_the_mypy_count_may_only_fall():
    assert lint.ratchet(10, 10)[0]
    ok, said = lint.ratchet(9, 10)
    assert ok and "write 9 in .ci/mypy-baseline" in said
    ok, said = lint.ratchet(11, 10)
    assert not ok and "more than the 10" in said


def test_an_entry_of_the_not_yet_clean_list_that_hides_nothing_is_named():
    debt = {"a.py": ["F401", "I001"], "b.py": ["B012"]}
    assert lint.stale_entries(debt, {("a.py", "F401"), ("a.py", "I001"), ("b.py", "B012")}) == []
    assert lint.stale_entries(debt, {("a.py", "I001"), ("c.py", "E731")}) == ["a.py: F401", "b.py: B012"]


def test_the_pure_packages_are_strict():
    strict, exempt = lint.strict_paths(CONFIG)
    assert sorted(strict) == sorted(PURE)
    assert all(path.endswith(".py") and path.startswith(tuple(PURE)) for path in exempt)


def test_the_strict_override_sets_every_flag_of_mypy_strict():
    """`strict = true` in an override applies to every module, so the override lists --strict's
    flags one by one: a mypy that adds one to --strict fails here until it is listed."""
    helped = subprocess.run([sys.executable, "-m", "mypy", "--help"], capture_output=True, text=True,
                            check=True).stdout
    said = re.search(r"--strict\s+Strict mode; enables the following flags:(.*?)(?=\n  --)", helped, re.S)
    flags = re.findall(r"--([a-z-]+)", re.sub(r"-\s+", "-", said.group(1)))
    mypy = CONFIG["tool"]["mypy"]
    [override] = [o for o in mypy["overrides"] if o.get("disallow_untyped_defs") is True]
    for flag in flags:
        name, value = (flag[3:], False) if flag.startswith("no-") else (flag, True)
        name = name.replace("-", "_")
        assert override.get(name, mypy.get(name)) == value, f"--{flag} is not set for the strict packages"


def test_scripts_test_runs_the_gates_first_and_hands_its_arguments_to_pytest():
    script = (REPO / "scripts" / "test").read_text()
    gates, tests = script.index("scripts/lint"), script.index("-m pytest")
    assert gates < tests
    assert script.rstrip().endswith('"$@"') and script[tests:].count("\n") == 1
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("exec ./scripts/test")


def test_the_gate_tools_are_pinned_in_the_test_extra():
    """A new ruff or mypy finds new things: the versions move in a commit of their own."""
    pins = {re.split(r"[=<>]", d)[0]: d for d in CONFIG["project"]["optional-dependencies"]["test"]}
    assert re.fullmatch(r"ruff==[0-9.]+", pins["ruff"]) and re.fullmatch(r"mypy==[0-9.]+", pins["mypy"])
