"""`egress run` refuses what it does not grant (issue 25), end to end with the real launcher.

Each test is an attack of the second red-team review, made the way a prompt-injected agent
would: signalling the harness that started egress (N3), stopping the launcher to outlive
--timeout, killing it to leave its run folder behind, planting a git hook or an editor task
for the user's next ordinary action (item 7). The sandbox-level matrix, as root and as
nobody, is tests/sandbox/test_default_deny.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import clean_env, egress_command

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")


@pytest.fixture(scope="module", autouse=True)
def namespaces_available():
    probe = subprocess.run(["unshare", "-Urn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user+network namespaces are not available here: {probe.stderr.decode().strip()}")


def run_args(tmp_path: Path, project: Path, *command: str, extra=()) -> list[str]:
    return [*egress_command(), "run", "--network", "off", "--headless", "--state-dir", str(tmp_path / "state"),
            "--project", str(project), *extra, "--", *command]


def env_for(tmp_path: Path) -> dict:
    runs = tmp_path / "runs"  # the run's folder is made here: what a killed launcher would leave
    runs.mkdir(exist_ok=True)
    return clean_env(tmp_path, PYTHONPATH=os.getcwd(), TMPDIR=str(runs))


def test_the_command_cannot_signal_the_harness_that_started_egress(tmp_path):
    # The harness and egress share a process group (a script without job control); before,
    # the command's kill(0, SIGUSR1) reached the harness, a sibling, and egress itself (-10).
    project = tmp_path / "project"
    project.mkdir()
    inner = " ".join(map(_quote, run_args(tmp_path, project, sys.executable, "-c",
                                          "import os, signal; os.kill(0, signal.SIGUSR1); print('sent')")))
    harness = f"trap 'echo HARNESS-SIGNALLED' USR1; sleep 30 & sibling=$!; {inner}; echo status=$?; " \
              f"kill $sibling; wait $sibling; echo sibling=$?"
    done = subprocess.run(["sh", "-c", harness], capture_output=True, text=True, timeout=120, cwd=project,
                          env=env_for(tmp_path))
    lines = done.stdout.split()
    # The command's own group got it (it was killed by it, as kill(0) asks): nothing outside did.
    assert "HARNESS-SIGNALLED" not in lines, done.stdout + done.stderr
    assert f"status={128 + signal.SIGUSR1}" in lines, done.stdout + done.stderr
    assert f"sibling={128 + signal.SIGTERM}" in lines, done.stdout  # killed by the harness, not by the command


def test_timeout_holds_when_the_command_stops_its_group(tmp_path):
    # Red team N3: a child leaves the group, the parent stops "its" group (then the launcher's)
    # with SIGSTOP: the child ran on past --timeout until someone sent SIGCONT.
    project = tmp_path / "project"
    project.mkdir()
    stopper = textwrap.dedent("""
        import os, signal, time
        if os.fork() == 0:
            os.setpgid(0, 0)
            while True:
                time.sleep(0.2)
        time.sleep(0.5)
        os.kill(0, signal.SIGSTOP)
    """)
    # egress in a session of its own, as the red team ran it: only the sandbox could stop it
    done = subprocess.run(run_args(tmp_path, project, sys.executable, "-c", stopper, extra=["--timeout", "2"]),
                          capture_output=True, text=True, timeout=90, cwd=project, env=env_for(tmp_path),
                          start_new_session=True)
    assert done.returncode == 124, done.stderr
    assert "timed out after 2 s" in done.stderr


def test_a_killed_launcher_leaves_no_run_folder(tmp_path):
    # Red team N3: a launcher killed mid-run left /tmp/egress-run-<id>-... (the command's TMPDIR,
    # with whatever it wrote there) on the host. Its sandbox helper now removes it.
    project = tmp_path / "project"
    project.mkdir()
    env = env_for(tmp_path)
    launcher = subprocess.Popen(run_args(tmp_path, project, "sh", "-c", 'echo x > "$TMPDIR/left"; echo "$TMPDIR"; '
                                         'exec sleep 60'), stdout=subprocess.PIPE, text=True, cwd=project, env=env)
    try:
        folder = Path(launcher.stdout.readline().strip())
        assert folder.parent == Path(env["TMPDIR"]) and (folder / "left").exists()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        for _ in range(300):  # a bound on the wait, not on its speed
            if not folder.exists():
                break
            time.sleep(0.1)
        assert not folder.exists(), sorted(p.name for p in folder.iterdir())
        assert list(Path(env["TMPDIR"]).iterdir()) == []
    finally:
        launcher.kill()
        launcher.wait()


@pytest.fixture
def repository(tmp_path):
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    project = tmp_path / "project"
    project.mkdir()
    remote = project / "remote.git"  # a remote the sandbox can reach: inside the project
    subprocess.run([git, "init", "-q", "--bare", str(remote)], check=True)
    subprocess.run([git, "init", "-q", str(project)], check=True)
    for key, value in (("user.name", "t"), ("user.email", "t@example.invalid"), ("remote.origin.url", str(remote))):
        subprocess.run([git, "-C", str(project), "config", key, value], check=True)
    return project


PLANT = """
    for path in .git/hooks/pre-commit .git/config .gitmodules .envrc .vscode/tasks.json .claude/settings.json; do
        mkdir -p "$(dirname "$path")" 2>/dev/null
        if (echo '#!/bin/sh' >> "$path") 2>/dev/null; then echo "wrote $path"; else echo "refused $path"; fi
    done
    mv .git .git-moved 2>/dev/null && echo "moved .git" || echo "pinned .git"
    git config core.hooksPath /tmp/x 2>/dev/null && echo "configured" || echo "config refused"
    echo one > a.txt && git add a.txt && git commit -qm one && echo committed
    git push -q origin HEAD:main 2>&1 && git fetch -q origin main && echo fetched
    echo "$PWD/elsewhere" > .git/commondir && echo "wrote .git/commondir"  # git would read config there
"""


def test_files_that_run_later_are_read_only_inside(tmp_path, repository):
    # Item 7: git hooks and config, .gitmodules, editor and agent folders, .envrc: the user's next
    # `git commit`, `cd` or editor start would run what the command planted, unconfined.
    done = subprocess.run(run_args(tmp_path, repository, "sh", "-c", PLANT), capture_output=True, text=True,
                          timeout=120, cwd=repository, env=env_for(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "refused .git/hooks/pre-commit" in lines and "refused .git/config" in lines, lines
    assert "pinned .git" in lines and "config refused" in lines, lines
    assert "committed" in lines and "fetched" in lines, done.stdout + done.stderr  # git still works
    assert not (repository / ".git" / "hooks" / "pre-commit").exists()
    assert "hooksPath" not in (repository / ".git" / "config").read_text()
    # What did not exist could be made inside, and was moved aside after the run, with a line each.
    for name in (".gitmodules", ".envrc", ".vscode", ".claude", ".git/commondir"):
        assert not (repository / name).exists(), name
        assert f"the command made {repository / name}" in done.stderr, done.stderr
    quarantined = tmp_path / "state" / "quarantine"
    assert any(p.name == "tasks.json" for p in quarantined.rglob("*")), done.stderr  # nothing is lost


def test_allow_hooks_lets_the_command_write_them(tmp_path, repository):
    done = subprocess.run(run_args(tmp_path, repository, "sh", "-c", PLANT, extra=["--allow-hooks"]),
                          capture_output=True, text=True, timeout=120, cwd=repository, env=env_for(tmp_path))
    assert "wrote .git/hooks/pre-commit" in done.stdout.splitlines(), done.stdout + done.stderr
    assert (repository / ".envrc").exists() and (repository / ".vscode" / "tasks.json").exists()
    assert "the command made" not in done.stderr


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


SHELL_JOB = r"""
import os, signal, sys, time
# A shell's job control, as bash does it: the job (egress) in a process group of its own, made
# the terminal's foreground group; stopped (Ctrl-Z), the shell takes the terminal and says so;
# `fg` gives it back and continues the group.
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
child = os.fork()
if child == 0:
    os.setpgid(0, 0)
    while os.tcgetpgrp(0) != os.getpgrp():  # a job starts once it is the foreground one
        time.sleep(0.01)
    signal.signal(signal.SIGTTOU, signal.SIG_DFL)
    os.execvpe(sys.argv[1], sys.argv[1:], os.environ)
os.setpgid(child, child)
os.tcsetpgrp(0, child)
_, status = os.waitpid(child, os.WUNTRACED)
os.tcsetpgrp(0, os.getpgrp())
print("SHELL: stopped" if os.WIFSTOPPED(status) else "SHELL: ended early", flush=True)
time.sleep(1)
print("SHELL: fg", flush=True)
os.tcsetpgrp(0, child)
os.killpg(child, signal.SIGCONT)
_, status = os.waitpid(child, 0)
os.tcsetpgrp(0, os.getpgrp())
print("SHELL: status", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_ctrl_z_stops_the_run_as_a_shells_job_and_fg_continues_it(tmp_path):
    # The command has a process group of its own, the terminal's foreground one: Ctrl-Z stops
    # it, and egress's helper hands the terminal back and stops egress, so the shell sees a
    # stopped job (not a hung terminal); `fg` continues both; Ctrl-C reaches the command.
    import pty
    import select

    project = tmp_path / "project"
    project.mkdir()
    ticker = "i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.2; done"
    command = run_args(tmp_path, project, "sh", "-c", ticker)
    pid, master = pty.fork()
    if pid == 0:
        try:
            os.chdir(project)
            os.execve(sys.executable, [sys.executable, "-c", SHELL_JOB, *command], env_for(tmp_path))
        finally:
            os._exit(127)
    seen = b""

    def read_until(marker: bytes) -> bytes:
        nonlocal seen
        for _ in range(600):  # a bound on the wait, not on its speed
            if marker in seen:
                return seen
            if select.select([master], [], [], 0.1)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        raise AssertionError(f"never saw {marker!r} in {seen.decode(errors='replace')}")

    try:
        read_until(b"tick 2")
        os.write(master, b"\x1a")  # Ctrl-Z
        read_until(b"SHELL: stopped")
        ticks_while_stopped = seen.count(b"tick")
        read_until(b"SHELL: fg")
        stopped = seen[seen.index(b"SHELL: stopped"):seen.index(b"SHELL: fg")]
        assert b"tick" not in stopped, stopped  # the command stopped with egress, for the shell's second
        read_until(f"tick {ticks_while_stopped + 2}".encode())  # it goes on after fg
        os.write(master, b"\x03")  # Ctrl-C
        read_until(b"SHELL: status")
        assert b"SHELL: status 130" in seen, seen.decode(errors="replace")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        os.close(master)


def test_as_an_unprivileged_user_signals_and_files_that_run_later_are_held(user_venv):
    # The same attacks through the real launcher, as nobody: the harness that started egress is
    # not signalled, a hook cannot be written, a made .envrc is moved aside.
    from conftest import make_host_dir

    venv, nobody = user_venv
    home = make_host_dir(for_everyone=True)
    try:
        project, state = home / "project", home / "state"
        (project / ".git" / "hooks").mkdir(parents=True)
        (project / ".git" / "config").write_text("[core]\n")
        for path in (home, project, project / ".git", project / ".git" / "hooks", project / ".git" / "config"):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        inner = " ".join(map(_quote, [f"{venv}/bin/egress", "run", "--network", "off", "--headless", "--state-dir",
                                      str(state), "--", "sh", "-c",
                                      "trap '' USR1; kill -USR1 0; echo x > .git/hooks/pre-commit || echo hook-refused; "
                                      "echo planted > .envrc"]))
        harness = f"trap 'echo HARNESS-SIGNALLED' USR1; {inner}; echo status=$?"
        done = subprocess.run(["sh", "-c", harness], capture_output=True, text=True, timeout=120, cwd=project,
                              user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                              env={"PATH": "/usr/bin:/bin", "HOME": str(home)})
        lines = done.stdout.split()
        assert "HARNESS-SIGNALLED" not in lines, done.stdout + done.stderr
        assert "status=0" in lines and "hook-refused" in lines, done.stdout + done.stderr
        assert not (project / ".git" / "hooks" / "pre-commit").exists()
        assert not (project / ".envrc").exists() and "the command made" in done.stderr, done.stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)
