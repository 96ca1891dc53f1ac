"""Exit statuses and network modes: one list each (egress.core.contract), used everywhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from egress.core import contract

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("egress", "sandbox") for p in (ROOT / folder).rglob("*.py"))
STATUS_VALUES = {value for name, value in vars(contract).items() if name.startswith("EXIT_")}
# Calls whose argument is an exit status (the process's, or one a caller will exit with).
STATUS_CALLS = {"exit", "_exit", "Fatal", "LaunchError", "SandboxError", "_Failure", "_report"}


def _status_literals(tree: ast.AST):
    """Integer literals used as exit statuses: arguments of STATUS_CALLS, compared with a
    status-like name, or given to an EXIT_* name; and tuples assigned to NETWORK_MODES."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in STATUS_CALLS:
                for arg in node.args[:2]:
                    for part in ast.walk(arg):
                        if isinstance(part, ast.Constant) and type(part.value) is int:
                            yield node.lineno, f"{name}({part.value})"
        elif isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            names = {getattr(p, "id", getattr(p, "attr", "")) for p in parts}
            if names & {"code", "status", "returncode"}:
                for part in parts:
                    if isinstance(part, ast.Constant) and part.value in STATUS_VALUES - {0}:
                        yield node.lineno, f"compared with {part.value}"
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                name = getattr(target, "id", "")
                if (name.startswith("EXIT_") or name == "NETWORK_MODES") and not isinstance(node.value, ast.Name):
                    yield node.lineno, f"{name} defined again"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name != "contract.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_exit_status_or_network_mode_is_written_out_twice(path):
    found = list(_status_literals(ast.parse(path.read_text(), str(path))))
    assert found == [], f"{path.relative_to(ROOT)}: use egress.core.contract: {found}"


def test_every_exit_status_is_documented_in_the_reference():
    page = (ROOT / "docs/reference/exit-statuses.md").read_text()
    table = {int(m) for m in re.findall(r"^\| (\d+) \|", page, re.M)}
    assert table == {s for s in STATUS_VALUES if s < 100}
    run_section = page[page.index("Exit status of `egress run`"):].split("\n\n")[0]
    for status in sorted(s for s in STATUS_VALUES if s >= 100):
        assert f"`{status}`" in run_section, status


def test_network_modes_are_offered_and_explained_in_one_order(tmp_path):
    from egress.cli import run
    from egress.policy.loader import PolicyError, load_policy
    from egress.run.launcher import LaunchError, RunOptions, run as launch

    [network] = [p for p in run.params if p.name == "network"]
    assert tuple(network.type.choices) == contract.NETWORK_MODES
    bad = tmp_path / "p.toml"
    bad.write_text('network = "none"\n')
    with pytest.raises(PolicyError) as policy_error:
        load_policy([str(bad)])
    with pytest.raises(LaunchError) as launch_error:
        launch(RunOptions(argv=["true"], network="none"))
    listed = ", ".join(contract.NETWORK_MODES)
    assert str(policy_error.value).endswith(f"write one of {listed}")
    assert str(launch_error.value).endswith(listed) and launch_error.value.status == contract.EXIT_LAUNCHER


def test_every_reason_code_and_metric_is_documented_in_the_reference():
    from egress.core import reasons
    from egress.observe.metrics import Metrics

    pages = "".join((ROOT / "docs/reference" / name).read_text() for name in ("refusals.md", "metrics.md"))
    tables = set(re.findall(r"^\| `([a-z_-]+)` \|", pages, re.M))
    assert set(reasons.REFUSALS) | set(reasons.UPSTREAM_ERRORS) <= tables
    names = {metric.name + ("_total" if metric.type == "counter" else "")
             for metric in Metrics().registry.collect()}
    assert names <= tables, names - tables
