"""egress run's macOS launcher, run here with the platform chosen explicitly, up to the process
it starts.

No Mac here, so /usr/bin/sandbox-exec is replaced by a stand-in that records what it was given
(argv, profile, environment, working folder, process group) and then runs the command without a
sandbox. Everything before that process is the real thing: the policy, the run's port and secret,
the real proxy (started in the launcher when the command first connects), the environment
matrix, EGRESS_BLOCKED lines, exit statuses, --timeout and the process group's end. What the
profile then forbids on a Mac is the profile's (tests/sandbox/test_seatbelt.py) and
scripts/smoke-macos's, which a Mac user runs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TEST_NAMES, clean_env
from sbpl import decide, filter_paths, read_sbpl, rules, writable_subpaths

from egress.core.contract import EXIT_LAUNCHER, EXIT_NOT_FOUND, EXIT_TIMEOUT, PROXY_USER as USER
from sandbox.environment import CA_VARIABLES, PROXY_VARIABLES

REPO = Path(__file__).resolve().parents[2]
POLICY = 'allow = ["allowed.test"]\nallow_private = ["allowed.test"]\n'

# The driver: egress run's own parser builds the options; the launcher runs them with the macOS
# platform and the stand-in sandbox-exec (argv[1]); the status is the run's.
DRIVER = textwrap.dedent("""
    import os, sys
    from egress.entry import parse_run
    from egress.run.launcher import LaunchError, run
    from sandbox.platforms import MacOS
    from egress.observe.terminal import say
    try:
        status = run(parse_run(sys.argv[2:], os.environ), platform=MacOS(sandbox_exec=sys.argv[1]))
    except LaunchError as e:
        say(f"egress: {e}")
        status = e.status
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(status)
""")

STAND_IN = textwrap.dedent("""\
    #!{python} -I
    import json, os, sys
    with open({record!r}, "a") as f:
        f.write(json.dumps({{"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
                            "pid": os.getpid(), "pgid": os.getpgrp()}}) + "\\n")
    assert sys.argv[1] == "-p"
    os.execv(sys.argv[3], sys.argv[3:])
""")


@pytest.fixture
def mac(tmp_path):
    """Runs `egress run ARGS` with the macOS launcher; returns (completed process, records)."""
    record = tmp_path / "sandbox-exec.jsonl"
    stand_in = tmp_path / "bin" / "sandbox-exec"
    stand_in.parent.mkdir()
    stand_in.write_text(STAND_IN.format(python=sys.executable, record=str(record)))
    stand_in.chmod(0o755)
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    project = tmp_path / "project"
    project.mkdir()
    launcher_tmp = tmp_path / "launcher-tmp"
    launcher_tmp.mkdir()

    def run(*command: str, extra=(), cwd=project, env=None, timeout=120):
        args = [sys.executable, "-c", DRIVER, str(stand_in), "--policy", str(policy),
                "--state-dir", str(tmp_path / "state"), "--proxy", "lazy"]
        for name in TEST_NAMES:
            args += ["--resolve", f"{name}:127.0.0.1"]
        args += [*extra, "--", *command]
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=clean_env(tmp_path, PYTHONPATH=str(REPO), TMPDIR=str(launcher_tmp),
                                            REQUESTS_CA_BUNDLE="/machine/ca.pem", HTTPS_PROXY="http://machine:1",
                                            **(env or {})))
        records = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
        record.unlink(missing_ok=True)
        return done, records

    run.project = project
    run.stand_in = stand_in
    run.state = tmp_path / "state"
    return run


def _profile(record) -> str:
    assert record["argv"][1] == "-p"
    return record["argv"][2]


def test_sandbox_exec_gets_the_profile_the_program_and_an_environment_with_the_runs_secret(mac):
    done, [record] = mac("sh", "-c", "exit 3")
    assert done.returncode == 3, done.stderr
    argv, env = record["argv"], record["env"]
    assert argv[0] == str(mac.stand_in) and argv[3] == shutil.which("sh") and argv[4:] == ["-c", "exit 3"]
    assert record["cwd"] == str(mac.project)
    # The proxy URL: 127.0.0.1, the port the profile names, the run's secret; the same in every variable.
    url = env["HTTPS_PROXY"]
    assert url.startswith(f"http://{USER}:") and url.rsplit(":", 1)[0].endswith("@127.0.0.1")
    secret, port = url.split(":")[2].split("@")[0], int(url.rsplit(":", 1)[1])
    assert len(secret) >= 40
    assert all(env[name] == url for name in PROXY_VARIABLES)
    assert env["GIT_CONFIG_VALUE_0"] == url and env["NODE_USE_ENV_PROXY"] == "1"
    # Set, never inherited: the machine's CA and proxy are not the command's.
    tmpdir = env["TMPDIR"]
    assert all(env[name] == os.path.join(tmpdir, "ca-bundle.pem") for name in CA_VARIABLES)
    assert env["PYTHONPYCACHEPREFIX"] == os.path.join(tmpdir, "cache", "pycache")
    # The profile: writes to the project and the run's folder only, network to that port only.
    profile = _profile(record)
    assert sorted(writable_subpaths(profile)) == sorted([os.path.realpath(mac.project), os.path.realpath(tmpdir)])
    network = [(a, ops, f) for a, ops, f in rules(read_sbpl(profile)) if "network-outbound" in ops]
    assert network[0] == ("allow", ("network-outbound",), [["remote", "ip", f"localhost:{port}"]])
    hidden = [p for a, ops, f in rules(read_sbpl(profile)) if a == "deny" and "file-read*" in ops
              for p in filter_paths(f, "subpath")]
    assert hidden == [os.path.realpath(mac.state)]
    # The command has its own process group (it is killed whole at the end).
    assert record["pgid"] == record["pid"]
    assert secret not in done.stderr and secret not in done.stdout


def test_the_proxy_serves_the_command_with_the_secret_and_answers_407_without(mac, http_upstream):
    script = textwrap.dedent(f"""
        curl -sS --max-time 30 {http_upstream.url("allowed.test")}
        curl -sS --max-time 30 -o /dev/null -w "%{{http_code}}\\n" {http_upstream.url("other.test")}
        curl -sS --max-time 30 -o /dev/null -w "%{{http_code}}\\n" --proxy "http://${{HTTPS_PROXY##*@}}" \\
            {http_upstream.url("allowed.test")}
    """)
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (.ci/run installs it)")
    done, [record] = mac("sh", "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["hello from upstream", "403", "407"]
    assert "EGRESS_BLOCKED other.test (not on the allow list)" in done.stderr
    assert len(http_upstream.requests) == 1


def test_redact_filters_the_commands_output_and_the_secret_never_shows(mac):
    rng = random.Random(12)
    token = "ghp_" + "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(36))
    done, [record] = mac("sh", "-c", f'echo "leak: $MY_SERVICE_TOKEN $HTTPS_PROXY"; echo "{token}" >&2',
                         extra=["--redact"], env={"MY_SERVICE_TOKEN": "stored-secret-of-this-install"})
    assert done.returncode == 0, done.stderr
    secret = record["env"]["HTTPS_PROXY"].split(":")[2].split("@")[0]
    assert done.stdout.startswith("leak: [redacted:MY_SERVICE_TOKEN] ")
    assert "[redacted:github-token]" in done.stderr and token not in done.stderr
    # The run's proxy secret is a password in a URL: redacted too.
    assert secret not in done.stdout and "@127.0.0.1:" in done.stdout


def test_network_off_means_no_proxy_and_no_network_rule(mac):
    done, [record] = mac("sh", "-c", "true", extra=["--network", "off"])
    assert done.returncode == 0, done.stderr
    assert not any(name in record["env"] and record["env"][name] != "http://machine:1"
                   for name in ("HTTP_PROXY",)) and "HTTPS_PROXY" not in record["env"]
    found = rules(read_sbpl(_profile(record)))
    assert not [r for r in found if r[0] == "allow" and any("network" in op for op in r[1])
                and r[2] and r[2][0][:2] == ["remote", "ip"]]


def test_the_programs_status_and_launcher_failures_keep_their_codes(mac):
    missing, records = mac("no-such-program-here")
    assert missing.returncode == EXIT_NOT_FOUND and records == []
    assert "no-such-program-here: command not found" in missing.stderr
    node, _ = mac("node", env={"PATH": "/nonexistent"})
    assert node.returncode == EXIT_NOT_FOUND and "install it with: brew install node" in node.stderr
    (mac.project / "script.sh").write_text("#!/bin/sh\n")
    unexecutable, records = mac("./script.sh")
    assert unexecutable.returncode == 126 and records == []


def test_timeout_kills_the_whole_group_and_leftovers_end_with_the_command(mac, tmp_path):
    pids = tmp_path / "pids"
    done, _ = mac("sh", "-c", f"sleep 300 & echo $! >> {pids}; sleep 300", extra=["--timeout", "1"])
    assert done.returncode == EXIT_TIMEOUT
    assert "timed out after 1 s" in done.stderr
    finished, _ = mac("sh", "-c", f"sleep 300 & echo $! >> {pids}; exit 0")
    assert finished.returncode == 0
    for pid in map(int, pids.read_text().split()):
        assert not _alive(pid), f"{pid} outlived its run"


def _alive(pid: int) -> bool:
    for _ in range(100):  # the kill is sent before the run returns; the zombie may take a moment to go
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("name", ['a "quoted" (dir)', "line\nbreak", "back\\slash", "jérôme ; (allow default)"])
def test_a_hostile_project_name_is_exactly_one_writable_path(mac, tmp_path, name):
    project = tmp_path / name
    project.mkdir()
    done, [record] = mac("sh", "-c", "exit 0", extra=["--project", str(project)], cwd=project)
    assert done.returncode == 0, done.stderr
    paths = writable_subpaths(_profile(record))
    assert os.path.realpath(project) in paths and len(paths) == 2


def test_without_an_os_sandbox_egress_run_refuses_with_125(mac, tmp_path):
    from egress.entry import parse_run
    from egress.run.launcher import LaunchError, run
    from sandbox.platforms import MacOS, for_platform

    options = parse_run(["--", "true"], {})
    with pytest.raises(LaunchError) as refused:
        run(options, platform=for_platform("win32"))
    assert refused.value.status == EXIT_LAUNCHER
    assert str(refused.value).startswith("egress run cannot enforce the allowlist on Windows")
    with pytest.raises(LaunchError) as missing:
        run(options, platform=MacOS(sandbox_exec=str(tmp_path / "no-sandbox-exec")))
    assert missing.value.status == EXIT_LAUNCHER and "is missing" in str(missing.value)


# ------------------------------------------------------------------ files that run later, code, hooks allowed


def _repository(project: Path) -> None:
    """A git repository as `git init` leaves it, with hooks elsewhere in the tree (core.hooksPath)."""
    (project / ".git" / "hooks").mkdir(parents=True)
    (project / ".git" / "hooks" / "pre-commit.sample").write_text("#!/bin/sh\n")
    (project / ".git" / "config").write_text("[core]\n\tbare = false\n\thooksPath = .husky\n")
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")


def test_the_profile_keeps_the_projects_files_that_run_later_unwritable(mac, tmp_path):
    _repository(mac.project)
    shared = tmp_path / "shared-vscode"
    shared.mkdir()
    (mac.project / ".vscode").symlink_to(shared)  # Seatbelt sees the name the kernel resolves
    done, [record] = mac("sh", "-c", "exit 0")
    assert done.returncode == 0, done.stderr
    text = _profile(record)
    project = os.path.realpath(mac.project)
    for path in (".git/hooks/pre-commit", ".git/config", ".husky/pre-commit", ".gitmodules", ".envrc",
                 ".claude/settings.json", ".GIT/HOOKS/post-checkout", ".vscode/tasks.json"):
        for operation in ("file-write-create", "file-write-data", "file-write-unlink", "file-write-mode"):
            assert decide(text, operation, f"{project}/{path}") == "deny", (operation, path)
    assert decide(text, "file-write-create", f"{shared}/tasks.json") == "deny"
    for path in (".git", ".GIT"):
        assert decide(text, "file-write-unlink", f"{project}/{path}") == "deny"
    for path in (".git/index", ".git/objects/ab/cd", ".git/refs/heads/main", "src/x.py"):
        assert decide(text, "file-write-create", f"{project}/{path}") == "allow", path
    tmpdir = os.path.realpath(record["env"]["TMPDIR"])
    assert decide(text, "file-write-create", f"{tmpdir}/work/.git/hooks/x") == "allow"


def test_with_hooks_allowed_the_profile_has_no_such_rule(mac):
    """egress run --allow-hooks: the spec's allow_hooks, read with getattr by sandbox/macos.py so a
    spec made before the field existed keeps the protection."""
    from sandbox import macos
    from sandbox.spec import SandboxSpec

    _repository(mac.project)
    spec = SandboxSpec(["sh", "-c", "true"], {"PATH": os.environ["PATH"]}, str(mac.project),
                       writable=[str(mac.project)], network=False)
    project = os.path.realpath(mac.project)
    assert decide(macos.plan(spec, str(mac.stand_in)).profile, "file-write-data",
                  f"{project}/.git/hooks/pre-commit") == "deny"
    allowed = SimpleNamespace(**{name: getattr(spec, name) for name in SandboxSpec.__slots__ if hasattr(spec, name)})
    allowed.allow_hooks = True
    text = macos.plan(allowed, str(mac.stand_in)).profile
    assert decide(text, "file-write-data", f"{project}/.git/hooks/pre-commit") == "allow"
    assert decide(text, "file-write-unlink", f"{project}/.git") == "allow"
    # The run's temporary folder goes with the run: nothing planted there runs later.
    allowed.allow_hooks, allowed.abandoned = False, [str(mac.project)]
    text = macos.plan(allowed, str(mac.stand_in)).profile
    assert decide(text, "file-write-data", f"{project}/.git/hooks/pre-commit") == "allow"
    from egress.entry import OPTIONS

    if "--allow-hooks" not in OPTIONS:
        pytest.skip("egress run --allow-hooks is not there yet")
    done, [record] = mac("sh", "-c", "exit 0", extra=["--allow-hooks"])
    assert done.returncode == 0, done.stderr
    assert decide(_profile(record), "file-write-data", f"{project}/.git/hooks/pre-commit") == "allow"


def test_code_is_mapped_from_the_run_s_interpreter_project_and_path_only(mac, tmp_path):
    tools = tmp_path / "tools"
    (tools / "bin").mkdir(parents=True)
    (tools / "lib").mkdir()
    done, [record] = mac("sh", "-c", "exit 0", env={"PATH": f"{tools / 'bin'}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    text = _profile(record)
    project = os.path.realpath(mac.project)
    for path in (f"{project}/.venv/lib/python3.12/site-packages/x.so", f"{os.path.realpath(sys.prefix)}/lib/x.so",
                 f"{os.path.realpath(tools)}/lib/libtool.dylib", "/usr/lib/libz.dylib", "/opt/homebrew/lib/x.dylib"):
        assert decide(text, "file-map-executable", path) == "allow", path
    for path in ("/Users/Shared/x.dylib", f"{os.path.realpath(tmp_path)}/elsewhere/x.so"):
        assert decide(text, "file-map-executable", path) == "deny", path
    assert decide(text, "sysctl-read", name="kern.procargs2") == "deny"


def test_code_trees_are_the_paths_prefixes_and_never_the_home_or_root():
    from sandbox.macos import code_trees

    same = lambda path: os.path.normpath(path)  # noqa: E731 (a Mac's names, without a Mac)
    env = {"HOME": "/Users/me", "PATH": os.pathsep.join([
        "/Users/me/.cargo/bin", "/Users/me/.pyenv/shims", "/Users/me/.local/bin", "/Users/me/bin", "/usr/bin", "/bin",
        "/opt/homebrew/bin", ".", "relative/bin", "/Users/me/.nvm/versions/node/v22.1.0/bin", "/"])}
    trees = code_trees(env, ["/Users/me/.local/pipx/venvs/egress"], canonical=same)
    for tree in ("/Users/me/.cargo", "/Users/me/.pyenv", "/Users/me/.local", "/Users/me/bin",
                 "/Users/me/.nvm/versions/node/v22.1.0", "/opt/homebrew", "/Users/me/.rustup",
                 "/Users/me/Library/Python", "/Users/me/.local/pipx/venvs/egress"):
        assert tree in trees, tree
    for tree in ("/Users/me", "/usr", "/", "/Users", ".", "relative/bin", "relative"):
        assert tree not in trees, tree
    assert "/Users/you/.rustup" in code_trees({**env, "RUSTUP_HOME": "/Users/you/.rustup"}, [], canonical=same)


# ------------------------------------------------------------------ egress doctor


def _doctor(tmp_path, platform: str) -> tuple[dict, bool]:
    """run_checks for ``platform`` (a Python expression), in a fresh interpreter as `egress doctor` runs."""
    code = textwrap.dedent(f"""
        import json, sys
        from egress.run.doctor import run_checks
        from sandbox.platforms import MacOS, for_platform
        from pathlib import Path
        checks, honoured = run_checks([], Path(sys.argv[1]), platform={platform})
        print(json.dumps({{"checks": [c.as_dict() for c in checks], "honoured": honoured}}))
    """)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "state")], capture_output=True, text=True,
                          timeout=120, env=clean_env(tmp_path, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    return {c["name"]: c for c in result["checks"]}, result["honoured"]


def test_doctor_on_macos_runs_egress_profile_and_says_which_promises_hold(mac, tmp_path):
    rows, honoured = _doctor(tmp_path, f"MacOS(sandbox_exec={str(mac.stand_in)!r})")
    assert honoured
    seatbelt = rows["macos seatbelt"]
    assert seatbelt["status"] == "ok" and "sandbox-exec runs egress's profile" in seatbelt["detail"]
    assert rows["tty injection"]["status"] == "warning" and rows["process tree"]["status"] == "warning"
    assert {rows[name]["status"] for name in ("unix sockets", "egress state", "host files")} == {"ok"}
    assert "network namespace" not in rows and "landlock" not in rows
    assert rows["warm proxy"]["status"] == "not-applicable" and "Linux only" in rows["warm proxy"]["detail"]
    records = (tmp_path / "sandbox-exec.jsonl").read_text().splitlines()
    trivial, own = (json.loads(line)["argv"] for line in records)
    assert trivial[1:] == ["-p", "(version 1)(allow default)", "/usr/bin/true"]
    assert own[1] == "-p" and writable_subpaths(own[2]) and own[3] == "/usr/bin/true"


def test_doctor_on_macos_says_when_sandbox_exec_refuses_the_profile(tmp_path):
    refusing = tmp_path / "sandbox-exec"
    refusing.write_text('#!/bin/sh\ncase "$2" in *egress*) echo "sandbox-exec: unbound variable: x" >&2; '
                        'exit 65;; esac\nshift 2\nexec "$@"\n')
    refusing.chmod(0o755)
    rows, honoured = _doctor(tmp_path, f"MacOS(sandbox_exec={str(refusing)!r})")
    seatbelt = rows["macos seatbelt"]
    assert not honoured and seatbelt["status"] == "unavailable"
    assert seatbelt["detail"] == "sandbox-exec refused egress's profile: status 65: sandbox-exec: unbound variable: x"
    rows, honoured = _doctor(tmp_path, f"MacOS(sandbox_exec={str(tmp_path / 'none')!r})")
    assert not honoured and rows["macos seatbelt"]["status"] == "unavailable"
    assert "is missing" in rows["macos seatbelt"]["detail"]


def test_doctor_without_an_os_sandbox_says_egress_run_refuses(tmp_path):
    rows, honoured = _doctor(tmp_path, 'for_platform("win32")')
    assert not honoured and rows["os sandbox"]["status"] == "unavailable"
    assert rows["os sandbox"]["detail"].startswith("egress run cannot enforce the allowlist on Windows")


# ------------------------------------------------------------------ the person in the loop


def test_the_grant_question_is_asked_and_answered_while_the_command_holds_the_terminal(mac, tmp_path,
                                                                                        http_upstream):
    """On macOS the command is the terminal's foreground group; egress takes the terminal back for
    its question (else reading the answer would stop it) and gives it back after."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (.ci/run installs it)")
    from test_grants import Terminal, curl_twice

    policy = tmp_path / "grant-policy.toml"
    policy.write_text('allow_private = ["other.test"]\n')
    args = [sys.executable, "-c", DRIVER, str(mac.stand_in), "--policy", str(policy), "--state-dir",
            str(tmp_path / "state"), "--proxy", "lazy", "--resolve", "other.test:127.0.0.1", "--",
            *curl_twice(http_upstream.url("other.test")), ]
    args[-1] += "; read -r line; echo got=$line"  # and the command reads the terminal after
    term = Terminal(args, tmp_path)
    term.read_until("wants to reach other.test")
    term.type("a")
    term.read_until("code=200\r\ncode=200")
    term.type("hello\n")
    term.read_until("got=hello")
    assert term.finish() == 0


# ------------------------------------------------------------------ the run's port


def test_the_runs_port_is_held_on_both_loopbacks_so_no_other_program_can_listen_there():
    import socket

    from sandbox.platforms import MacOS

    listener = MacOS().listener(True)
    try:
        assert listener.socket.getsockname() == ("127.0.0.1", listener.port)
        if not socket.has_ipv6 or not listener.guards:
            pytest.skip("no IPv6 loopback here")
        other = socket.socket(socket.AF_INET6)
        with pytest.raises(OSError):
            other.bind(("::1", listener.port))  # "localhost:PORT" in the profile: ours there too
        other.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("::1", listener.port), timeout=10)
    finally:
        listener.close()

