"""egress.policy.source: one policy source for serve, run, the warm child and doctor; its two forms
load exactly as serve and run always have (the loader's problems worded as they were)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from egress.policy import settings
from egress.policy.loader import PolicyError
from egress.policy.source import PolicySource
from egress.run.snapshot import PolicySnapshot

SECRET = '\n[[credentials.secret]]\nenv = "EGRESS_TEST_NEVER_SET"\nhosts = ["allowed.test"]\n'


def problems(source: PolicySource) -> list[str]:
    with pytest.raises(PolicyError) as error:
        source.load()
    return [str(problem) for problem in error.value.problems]


def run_source(files=(), allow=(), deny=(), network=None, read=None) -> PolicySource:
    return PolicySource(files, allow, deny, network, command_line=True, read=read)


# ------------------------------------------------------------ serve's form


def test_without_files_serve_loads_the_built_in_set():
    assert PolicySource().load().files == settings.load(["dev"]).policy.files


def test_serve_loads_its_files_as_they_are_and_their_network_key_decides(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('network = "all"\nallow = ["example.org"]\n')
    policy = PolicySource([str(path)]).load()
    assert policy.files == [str(path.resolve())] and policy.allow_all


def test_serve_words_a_missing_file_as_the_loader_does(tmp_path):
    missing = tmp_path / "nope.toml"
    assert problems(PolicySource([str(missing)])) == [f"{missing}: no such file"]


def test_serve_reload_refuses_a_secret_that_cannot_be_read_and_a_run_reload_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv("EGRESS_TEST_NEVER_SET", raising=False)
    path = tmp_path / "p.toml"
    path.write_text('allow = ["allowed.test"]\nallow_private = ["allowed.test"]\n' + SECRET)
    with pytest.raises(PolicyError):
        PolicySource([str(path)]).reload()
    assert run_source([str(path)], network="allowlist").reload().decide("allowed.test").allowed


def test_allow_and_deny_are_a_run_s_flags():
    with pytest.raises(ValueError):
        PolicySource(allow=["example.org"])


# -------------------------------------------------------------- run's form


def test_a_run_in_allowlist_mode_loads_the_built_in_set_then_its_flags():
    policy = run_source(allow=["example.org"], network="allowlist").load()
    assert policy.files[0] == "<command line>" and len(policy.files) == 2
    assert policy.decide("example.org").allowed and not policy.allow_all


@pytest.mark.parametrize("mode", ["all", "off"])
def test_other_modes_load_no_built_in_set_and_only_all_allows_all(mode):
    policy = run_source(network=mode).load()
    assert policy.files == ["<command line>"]
    assert policy.allow_all is (mode == "all")


def test_the_mode_given_wins_over_the_files_network_key(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('network = "all"\n')
    assert not run_source([str(path)], network="allowlist").load().allow_all
    assert run_source([str(path)]).load().allow_all  # no mode given: the file's


def test_a_run_words_its_problems_at_the_command_line(tmp_path):
    missing = tmp_path / "nope.toml"
    assert problems(run_source([str(missing)], network="allowlist")) == [
        f"<command line>: include: {str(missing)!r}: no such file ({missing})"]
    assert problems(run_source(allow=["com"], network="off")) == [
        "<command line>: allow: 'com' is a top-level domain: it would cover every site under it; "
        "write a registrable domain such as 'example.com'"]


def test_own_is_the_user_s_files_and_flags_alone(tmp_path):
    assert run_source(network="allowlist").own() is None
    path = tmp_path / "p.toml"
    path.write_text('network = "off"\nprofile = "agent"\n')
    own = run_source([str(path)], deny=["example.org"]).own()
    assert own.files == ["<command line>", str(path.resolve())]
    assert own.network == "off" and own.profile == "agent"


def test_decided_takes_the_mode_given_else_the_files_else_allowlist(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('network = "off"\n')
    source = run_source([str(path)])
    assert source.decided(source.own()).network == "off"
    assert run_source([str(path)], network="all").decided(source.own()).network == "all"
    assert run_source().decided(None).network == "allowlist"


def test_every_read_goes_through_the_reader(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('allow = ["first.example"]\n')
    reader = PolicySnapshot()
    source = run_source([str(path)], network="off", read=reader)
    source.own()
    reader.seal(lambda name: True)  # as if the command could write it: its text of now is kept
    path.write_text('allow = ["second.example"]\n')
    policy = source.reload()
    assert policy.decide("first.example").allowed and not policy.decide("second.example").allowed


# ------------------------------------------------------------- the value


def test_a_source_is_a_value():
    source = run_source(["a.toml"], network="allowlist")
    with pytest.raises(AttributeError):
        source.network = "all"
    assert source.replace(network="all") == run_source(["a.toml"], network="all")
    assert source == run_source(["a.toml"], network="allowlist") and source != PolicySource(["a.toml"])
    with pytest.raises(ValueError):
        run_source(network="everything")


def test_making_a_source_imports_no_loader():
    # every `egress run` makes one; most never load a policy before their command ends
    code = ("import sys; from egress.policy.source import PolicySource; "
            "PolicySource(['p.toml'], network='allowlist', command_line=True); "
            "print(sorted(m for m in ('egress.policy.loader', 'tomllib', 'dataclasses') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.stdout.strip() == "[]", result.stderr
