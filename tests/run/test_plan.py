"""egress.run.plan, in process: the run `egress run` decides before it makes anything (its
refusals word for word, in the order they come), and the SandboxSpec it asks for.

The platforms are the real ones (sandbox/platforms.py, sandbox/providers.py): a plan only asks
them what they are, never to start anything, so these tests run on any machine."""

from __future__ import annotations

import os

import pytest

from egress.core.contract import EXIT_LAUNCHER
from egress.proxy.config import ProxyConfig
from egress.run.options import LaunchError, RunOptions
from egress.run.plan import choose_provider, plan
from egress.run.snapshot import PolicySnapshot
from sandbox.platforms import Linux, Listener, Unsupported
from sandbox.providers import Local

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}


@pytest.fixture
def project(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    return folder


def options(project, *argv: str, **given) -> RunOptions:
    given.setdefault("proxy", ProxyConfig(state_dir=str(project.parent / "state")))
    return RunOptions(argv=list(argv or ["true"]), project=project, **given)


def refusal(run: RunOptions, platform=None, environ=ENV) -> str:
    with pytest.raises(LaunchError) as error:
        plan(run, platform or Linux(), environ)
    assert error.value.status == EXIT_LAUNCHER
    return str(error.value)


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- decided


def test_a_plain_run_is_networked_through_the_warm_proxy_and_loads_nothing_yet(project):
    planned = plan(options(project), Linux(), ENV)
    assert (planned.mode, planned.where, planned.networked) == ("allowlist", "warm", True)
    assert planned.project == os.path.realpath(project)
    # no policy named: nothing loaded before the command starts (its proxy loads when it starts)
    assert planned.user is None and planned.policy is None and planned.credentials is None
    assert planned.environ == ENV and planned.reader.recorded() == []


def test_where_the_proxy_lives(project):
    assert plan(options(project), Linux(), {**ENV, "EGRESS_PROXY": "lazy"}).where == "lazy"
    assert plan(options(project, proxy_mode="lazy"), Linux(), ENV).where == "lazy"
    assert plan(options(project), Local(), ENV).where == "lazy"  # its sandbox cannot hand a socket over


def test_the_network_mode_is_the_flag_else_the_files_else_allowlist(project, tmp_path):
    policy = write(tmp_path / "p.toml", 'network = "off"\n')
    assert plan(options(project, policies=[policy]), Linux(), ENV).mode == "off"
    assert plan(options(project, policies=[policy], network="all"), Linux(), ENV).mode == "all"
    planned = plan(options(project, network="all"), Linux(), ENV)
    assert planned.source.network == "all" and planned.networked


def test_the_user_s_files_are_read_once_through_the_run_s_snapshot(project, tmp_path):
    policy = write(tmp_path / "p.toml", 'allow = ["example.org"]\n')
    planned = plan(options(project, policies=[policy]), Linux(), ENV)
    assert isinstance(planned.reader, PolicySnapshot) and planned.source.read is planned.reader
    assert [text for _, _, text in planned.reader.recorded()] == ['allow = ["example.org"]\n']
    assert planned.user.files == ["<command line>", str((tmp_path / "p.toml").resolve())]


def test_a_policy_s_agent_profile_settles_the_options_and_loads_the_policy_now(project, tmp_path):
    policy = write(tmp_path / "p.toml", 'profile = "agent"\nallow = ["example.org"]\n')
    planned = plan(options(project, policies=[policy]), Linux(), ENV)
    settled = planned.options
    assert (settled.agent, settled.redact, settled.ask, settled.timeout, settled.guard_commands) == (
        True, True, "never", 120.0, True)
    # redacted output needs the secrets before the command starts: loaded with the plan
    assert planned.policy.decide("example.org").allowed and planned.credentials is not None
    assert planned.policy_and_credentials() == (planned.policy, planned.credentials)


def test_the_proxy_s_policy_is_loaded_when_asked(project):
    planned = plan(options(project, allow=["example.org"]), Linux(), ENV)
    policy, credentials = planned.policy_and_credentials()
    assert policy.decide("example.org").allowed and policy.files[0] == "<command line>"
    assert planned.source.reload().decide("example.org").allowed


# --------------------------------------------------------------- refused


def test_the_platform_s_refusal_comes_first(project):
    assert refusal(options(project, network="nowhere"), Unsupported("plan9")) == Unsupported("plan9").refusal()


def test_each_option_refused_word_for_word(project, tmp_path):
    assert refusal(options(project, network="nowhere")) == "--network must be one of allowlist, all, off"
    assert refusal(options(project, proxy=ProxyConfig(listen=("127.0.0.1", 0)))) == (
        "egress run's proxy listens only inside the sandbox; use egress serve to listen")
    assert refusal(options(project), environ={"EGRESS_PROXY": "hot"}) == (
        "--proxy (or $EGRESS_PROXY) must be one of warm, lazy, not 'hot'")
    assert refusal(options(tmp_path / "gone")) == f"the project folder {tmp_path / 'gone'} does not exist"
    assert refusal(options(project, add_dirs=[tmp_path / "x"])) == f"--add-dir {tmp_path / 'x'} does not exist"
    assert refusal(options(project, read=[tmp_path / "y"])) == f"--read {tmp_path / 'y'} does not exist"


def test_a_missing_project_is_said_before_a_bad_policy(tmp_path):
    assert refusal(options(tmp_path / "gone", allow=["com"])).startswith("the project folder")


def test_a_policy_that_does_not_load_lists_every_problem_at_the_command_line(project, tmp_path):
    missing = tmp_path / "nope.toml"
    assert refusal(options(project, policies=[str(missing)], allow=["com"])) == (
        "the policy cannot be loaded:\n"
        f"  <command line>: include: {str(missing)!r}: no such file ({missing})\n"
        "  <command line>: allow: 'com' is a top-level domain: it would cover every site under it; "
        "write a registrable domain such as 'example.com'")


def test_a_guarded_command_is_refused_after_the_guardrails_warnings(project, tmp_path):
    policy = write(tmp_path / "p.toml", '[guardrails]\ndeny_commands = ["npm (publish"]\n')
    told: list[str] = []
    with pytest.raises(LaunchError) as error:
        plan(options(project, "npm", "(publish", policies=[policy]), Linux(), ENV, tell=told.append)
    assert told == [f"egress: {tmp_path / 'p.toml'}:2: warning: guardrails: deny_commands: 'npm (publish' is not "
                    "a valid regular expression (missing ), unterminated subpattern at position 4); it is "
                    "matched as literal text"]
    assert str(error.value) == (f"command refused by deny_commands 'npm (publish' ({tmp_path / 'p.toml'}:2): "
                                "npm (publish; it was not run")
    assert refusal(options(project, "rm", "-rf", "/", guard_commands=True)).startswith(
        "command refused by the built-in rule 'rm-root'")


def test_provider_choice(project, tmp_path):
    assert isinstance(choose_provider(options(project, provider="local")), Local)
    with pytest.raises(LaunchError, match="--image, --mount and --persist are for --provider podman or docker"):
        choose_provider(options(project, image="alpine"))
    with pytest.raises(LaunchError, match="--provider must be one of"):
        choose_provider(options(project, provider="jail"))
    policy = write(tmp_path / "p.toml", '[container]\nimage = 3\n')
    with pytest.raises(LaunchError) as error:
        choose_provider(options(project, provider="podman", policies=[policy]))
    assert str(error.value) == (f"{policy}: [container] image: expected one of image (text), mounts (list), "
                                "persist (list), cpus, memory (text)")


# ------------------------------------------------------- what it asks for


def test_the_sandbox_spec(project, tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    audit = project / "audit.log"
    run = options(project, "make", "test", add_dirs=[extra], read=[tmp_path],
                  proxy=ProxyConfig(state_dir=str(tmp_path / "state"), audit_log=str(audit)))
    planned = plan(run, Linux(), ENV)
    files: dict = {}
    listener = Listener(3128)
    env = planned.environment("/tmp/run", listener, "/tmp/run/ca-bundle.pem", files)
    assert env["HTTPS_PROXY"] == listener.url and env["TMPDIR"] == "/tmp/run"
    spec = planned.sandbox_spec(env, "/tmp/run", listener, ["/opt/egress"], None)
    assert spec.argv == ["make", "test"] and spec.cwd == planned.project and spec.env == env
    assert spec.writable == [planned.project, "/tmp/run", str(extra)] and spec.read_only == ["/opt/egress"]
    assert (spec.network, spec.proxy_port, spec.capture) == (True, 3128, True)
    assert spec.hidden == [str(tmp_path / "state")] and spec.socket_dirs == spec.abandoned == ["/tmp/run"]
    assert spec.replaced == {str(audit): b""}  # the command sees the run's audit log empty
    assert str(tmp_path) in spec.readable and spec.stdout is spec.stderr is None


def test_without_network_the_command_is_told_of_no_proxy(project):
    planned = plan(options(project, network="off"), Linux(), ENV)
    env = planned.environment("/tmp/run", Listener(0), None, {})
    assert "HTTPS_PROXY" not in env and "https_proxy" not in env
    spec = planned.sandbox_spec(env, "/tmp/run", Listener(0), [], None)
    assert (spec.network, spec.capture) == (False, False)


def test_a_plan_makes_nothing(project, tmp_path):
    before = sorted(os.listdir(tmp_path))
    plan(options(project, allow=["example.org"], redact=True), Linux(), ENV)
    assert sorted(os.listdir(tmp_path)) == before  # no state folder, no run folder, no CA
