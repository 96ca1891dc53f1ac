"""egress.entry: `egress run` parsed without click makes the RunOptions click makes, or leaves it to click."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import clean_env

import egress.run.launcher
from egress import cli
from egress.entry import Unparsed, parse_run
from egress.proxy.ca import ensure_ca


def by_click(args: list[str], env: dict, monkeypatch):
    made = []
    monkeypatch.setattr(egress.run.launcher, "main", made.append)
    result = CliRunner().invoke(cli.main, ["run", *args], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return made[0]


@pytest.fixture
def places(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    return tmp_path


PARSED = [
    (["--", "true"], {}),
    (["true"], {}),
    (["true", "--allow", "x.example.com", "--", "-x"], {}),  # after the command: the command's
    (["--", "--allow", "x.example.com"], {}),
    (["--allow", "a.example.com", "--allow=b.example.com", "--deny", "c.example.com", "--", "curl", "-sf", "x"], {}),
    (["--policy", "p.toml", "--policy", "dev", "--network", "all", "--", "sh", "-c", "echo hi"], {}),
    (["--network=off", "--network", "allowlist", "true"], {}),  # the last one wins
    (["--project", "{dir}", "--add-dir", "{dir}", "--add-dir={tmp}/new", "--timeout", "2.5", "true"], {}),
    (["--timeout", "1e1", "true"], {}),
    (["--read", "{dir}", "--read={file}", "--allow-hooks", "true"], {}),
    (["--no-fs-confinement", "--redact", "--headless", "--", "true"], {}),
    (["--ask", "tty", "true"], {}),
    (["--ask", "tty", "--headless", "true"], {}),
    (["--proxy", "lazy", "true"], {}),
    (["true"], {"EGRESS_PROXY": "lazy"}),
    (["--proxy", "warm", "true"], {"EGRESS_PROXY": "lazy"}),
    (["true"], {"EGRESS_PROXY": ""}),
    (["--resolve", "a.test:127.0.0.1", "--resolve", "A.test.:::1", "--resolve=b.test:[::1]", "true"], {}),
    (["--audit-log", "{tmp}/audit.jsonl", "true"], {}),
    (["--audit-log", "off", "true"], {}),
    (["--state-dir", "{tmp}/state", "true"], {}),
    (["true"], {"EGRESS_STATE_DIR": "{tmp}/env-state"}),
    (["--state-dir", "{tmp}/state", "true"], {"EGRESS_STATE_DIR": "{tmp}/env-state"}),
    (["--agent", "true"], {}),
    (["--max-output", "256K", "--guard-commands", "true"], {}),
    (["--max-output=0", "true"], {}),
    (["--max-output", "1048576", "--max-output", "2m", "true"], {}),
    (["--agent", "--max-output", "1M", "--timeout", "5", "--ask", "tty", "--", "sh", "-c", "echo hi"], {}),
]


@pytest.mark.parametrize(("args", "env"), PARSED)
def test_both_parsers_make_the_same_options(args, env, places, monkeypatch):
    fill = lambda text: text.format(tmp=places, dir=places / "dir", file=places / "file")  # noqa: E731
    args, env = [fill(a) for a in args], {k: fill(v) for k, v in env.items()}
    for name in ("EGRESS_PROXY", "EGRESS_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    expected = by_click(args, env, monkeypatch)
    assert parse_run(args, env) == expected


UNPARSED = [
    [], ["--allow", "x.example.com"], ["--"],  # no command: click's usage error
    ["--help"], ["-h"], ["--allow"], ["--bogus", "true"], ["--headless=yes", "true"],
    ["--metrics", "127.0.0.1:0", "true"], ["--upstream-ca", "ca.pem", "true"], ["--audit-log", "-", "true"],
    ["--network", "bogus", "true"], ["--ask", "always", "true"], ["--proxy", "hot", "true"],
    ["--timeout", "0", "true"], ["--timeout", "-1", "true"], ["--timeout", "nan", "true"],
    ["--timeout", "inf", "true"], ["--timeout", "soon", "true"],
    ["--resolve", "nonsense", "true"], ["--resolve", "a.test:not-an-ip", "true"],
    ["--project", "{file}", "true"], ["--add-dir", "{file}", "true"], ["--allow", "", "true"],
    ["--max-output", "lots", "true"], ["--max-output", "-5", "true"], ["--max-output", "1.5M", "true"],
    ["--agent=yes", "true"], ["--guard-commands=1", "true"],
    ["--read", "{tmp}/missing", "true"], ["--allow-hooks=yes", "true"],
]


@pytest.mark.parametrize("args", UNPARSED)
def test_what_it_does_not_take_as_click_would_goes_to_click(args, places):
    with pytest.raises(Unparsed):
        parse_run([a.format(file=places / "file", tmp=places) for a in args], {})


def test_a_bad_environment_value_goes_to_click(places):
    with pytest.raises(Unparsed):
        parse_run(["true"], {"EGRESS_PROXY": "hot"})


@pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")
def test_the_egress_command_runs_without_click_and_still_reports_usage_errors_with_it(tmp_path):
    env = clean_env(tmp_path, PYTHONPATH=os.getcwd(), EGRESS_STATE_DIR=str(tmp_path / "state"), EGRESS_PROXY="lazy")
    # -S: no site (an editable install's finder imports pathlib and re first), so every import
    # listed is the launcher's own; the CA is made first (making it takes mitmproxy, from site-packages)
    ensure_ca(str(tmp_path / "state"))
    fast = subprocess.run([sys.executable, "-S", "-X", "importtime", "-m", "egress", "run", "--", "sh", "-c", "exit 7"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert fast.returncode == 7, fast.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in fast.stderr.splitlines() if line.startswith("import time:")}
    assert "egress.run.launcher" in imported and "click" not in imported
    # each cost the launcher ~3-5 ms (bench/README.md, "Launch without pathlib and json")
    assert not imported & {"pathlib", "json", "re"}, imported & {"pathlib", "json", "re"}
    usage = subprocess.run([sys.executable, "-m", "egress", "run", "--bogus", "--", "true"], capture_output=True,
                           text=True, timeout=120, env=env, cwd=tmp_path)
    assert usage.returncode == 2 and "No such option '--bogus'" in usage.stderr
