"""Credentials are parsed beside the policy (egress.policy.settings), not inside the policy loader."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from egress.policy import loader as policy_loader, settings
from egress.policy.loader import PolicyError

BROKEN = 'allow = ["example.org"]\n\n[credentials]\naction = "warn"\n'


def test_the_policy_loader_keeps_credential_tables_as_written(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(BROKEN)
    policy, problems = policy_loader.read_policy([str(path)])
    assert problems == []
    assert policy.credential_tables == [(str(path.resolve()), {"action": "warn"})]
    assert policy.decide("example.org").allowed


def test_settings_parse_them_and_locate_their_problems(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(BROKEN)
    with pytest.raises(PolicyError) as error:
        settings.load([str(path)])
    assert [str(p) for p in error.value.problems] == [
        f"{path.resolve()}:4: credentials.action: 'warn' is not an action; write one of block, mask"]


def test_policy_and_credential_problems_come_back_together_policy_first(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('allow = ["co.uk"]\n[credentials]\nscan_env = "yes"\n')
    with pytest.raises(PolicyError) as error:
        settings.load([str(path)])
    assert [(p.line, p.message.split(":")[0]) for p in error.value.problems] == [
        (1, "allow"), (3, "credentials.scan_env")]


def test_good_settings_come_with_the_policy(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('allow = ["example.org"]\n[credentials]\naction = "mask"\n')
    loaded = settings.load([str(path)])
    assert loaded.policy.decide("example.org").allowed and loaded.credentials.action == "mask"
    assert settings.from_mapping({"allow": ["example.org"]}).credentials is None  # no table: defaults


def test_loading_a_policy_does_not_import_credentials(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(BROKEN)
    code = (f"import sys; from egress.policy.loader import load_policy; load_policy([{str(path)!r}]); "
            f"print('egress.scan.credentials' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.stdout.strip() == "False", result.stderr


def test_a_live_reload_never_takes_a_policy_whose_credentials_are_wrong(tmp_path):
    from egress.host.live import PolicyWatcher
    from egress.observe.events import Recorder
    from egress.observe.metrics import Metrics
    from egress.proxy.engine import Engine
    from egress.proxy.resolver import Resolver

    path = tmp_path / "p.toml"
    path.write_text('allow = ["example.org"]\n')
    engine = Engine(settings.load([str(path)]).policy, Resolver(), Recorder(Metrics()))
    reports: list[str] = []

    async def reload_broken():
        watcher = PolicyWatcher(engine, lambda: settings.load([str(path)]).policy, reports.append, [str(path)])
        path.write_text(BROKEN.replace("example.org", "example.net"))
        await watcher.check(forced=True)

    asyncio.run(reload_broken())
    assert engine.policy.decide("example.org").allowed and not engine.policy.decide("example.net").allowed
    assert f"policy not reloaded: {path.resolve()}:4: credentials.action: 'warn' is not an action" in reports[0]
