"""A person in the loop: the prompt on a real pseudo-terminal, `egress allow`, `egress runs`, `egress events`."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import select
import subprocess
import sys
import termios
import threading
import time

import pytest
from conftest import clean_env, egress_command

from egress.host.control import RunState
from egress.observe.terminal import RESET
from egress.run.ask import TerminalAsker

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")

POLICY = 'allow_private = ["other.test", "blocked.test"]\n'


def run_args(tmp_path, *command: str, extra=()) -> list[str]:
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    return [*egress_command(), "run", "--policy", str(policy), "--state-dir", str(tmp_path / "state"),
            "--resolve", "other.test:127.0.0.1", "--resolve", "blocked.test:127.0.0.1", *extra, "--", *command]


def env_for(tmp_path) -> dict:
    return clean_env(tmp_path, PYTHONPATH=os.getcwd(), EGRESS_STATE_DIR=str(tmp_path / "state"))


class Terminal:
    """egress run on a pseudo-terminal that is its controlling terminal, as in a shell."""

    def __init__(self, args, tmp_path):
        self.master, slave = pty.openpty()

        def controlling_tty():
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        project = tmp_path / "project"
        project.mkdir(exist_ok=True)
        self.process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=project,
                                        env=env_for(tmp_path), start_new_session=True,
                                        preexec_fn=controlling_tty)
        os.close(slave)
        self.seen = ""

    def read_until(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            assert time.monotonic() < deadline, f"never saw {text!r}; saw:\n{self.seen}"
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the other side closed
                    assert text in self.seen, f"never saw {text!r}; saw:\n{self.seen}"
        return self.seen

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def finish(self) -> int:
        status = self.process.wait(60)
        try:
            while True:
                ready, _, _ = select.select([self.master], [], [], 0.2)
                if not ready:
                    break
                chunk = os.read(self.master, 4096)
                if not chunk:
                    break
                self.seen += chunk.decode(errors="replace")
        except OSError:
            pass
        os.close(self.master)
        return status


def curl_twice(url: str) -> list[str]:
    fetch = f'curl -s -o /dev/null -w "code=%{{http_code}}\\n" {url}'
    return ["sh", "-c", f"{fetch}; {fetch}"]


# The run's proxy in the warm proxy (the default) or in the launcher: the person sees the same.
PROXY_MODES = pytest.mark.parametrize("proxy_mode", ["warm", "lazy"])


@PROXY_MODES
def test_yes_lets_the_held_request_through_and_covers_the_run(tmp_path, http_upstream, curl_path, proxy_mode):
    terminal = Terminal(run_args(tmp_path, *curl_twice(http_upstream.url("other.test")),
                                 extra=["--proxy", proxy_mode]), tmp_path)
    terminal.read_until("wants to reach other.test")
    terminal.type("a\n")
    assert terminal.finish() == 0
    assert terminal.seen.count("code=200") == 2
    assert terminal.seen.count("wants to reach") == 1  # the second request was not asked about
    assert len(http_upstream.requests) == 2


def test_keep_blocked_refuses_the_held_request(tmp_path, http_upstream, curl_path):
    url = http_upstream.url("other.test")
    terminal = Terminal(run_args(tmp_path, "sh", "-c", f'curl -s -o /dev/null -w "code=%{{http_code}}\\n" {url}'),
                        tmp_path)
    terminal.read_until("wants to reach other.test")
    terminal.type("k\n")
    terminal.finish()
    assert "code=403" in terminal.seen
    assert "EGRESS_BLOCKED other.test (not on the allow list)" in terminal.seen
    assert http_upstream.connections == 0


def test_a_denied_host_is_never_offered(tmp_path, http_upstream, curl_path):
    url = http_upstream.url("blocked.test")
    terminal = Terminal(run_args(tmp_path, "sh", "-c", f'curl -s -o /dev/null -w "code=%{{http_code}}\\n" {url}',
                                 extra=["--deny", "blocked.test"]), tmp_path)
    terminal.finish()
    assert "code=403" in terminal.seen
    assert "wants to reach" not in terminal.seen
    assert "EGRESS_BLOCKED blocked.test (on the deny list)" in terminal.seen


def test_headless_never_asks_and_says_so_once(tmp_path, http_upstream, curl_path):
    project = tmp_path / "project"
    project.mkdir()
    result = subprocess.run(run_args(tmp_path, *curl_twice(http_upstream.url("other.test")), extra=["--headless"]),
                            capture_output=True, text=True, timeout=120, cwd=project, env=env_for(tmp_path),
                            stdin=subprocess.DEVNULL)
    assert result.stdout.split() == ["code=403", "code=403"]
    assert result.stderr.count("no terminal to ask on") == 1
    assert http_upstream.connections == 0


def runs(tmp_path) -> list[dict]:
    result = subprocess.run([*egress_command(), "runs", "--json"], capture_output=True, text=True, timeout=30,
                            env=env_for(tmp_path))
    return [json.loads(line) for line in result.stdout.splitlines()]


def wait_for_run(tmp_path) -> dict:
    for _ in range(200):
        live = runs(tmp_path)
        if live:
            return live[0]
        time.sleep(0.05)
    raise AssertionError("the run never showed up in `egress runs`")


@PROXY_MODES
def test_egress_allow_from_another_process_grants_a_waiting_run(tmp_path, http_upstream, curl_path, proxy_mode):
    url = http_upstream.url("other.test")
    terminal = Terminal(run_args(tmp_path, "sh", "-c", f'curl -s -o /dev/null -w "code=%{{http_code}}\\n" {url}',
                                 extra=["--proxy", proxy_mode]), tmp_path)
    terminal.read_until("wants to reach other.test")  # the request is now held
    info = wait_for_run(tmp_path)
    assert info["command"][0] == "sh"
    granted = subprocess.run([*egress_command(), "allow", "other.test", "--run", info["run"]],
                             capture_output=True, text=True, timeout=30, env=env_for(tmp_path))
    assert granted.returncode == 0 and "allowed other.test" in granted.stdout
    assert terminal.finish() == 0
    assert "code=200" in terminal.seen
    assert runs(tmp_path) == []  # the run is over: its socket is gone


@PROXY_MODES
def test_events_follow_streams_a_runs_decisions(tmp_path, http_upstream, curl_path, proxy_mode):
    project = tmp_path / "project"
    project.mkdir()
    url = http_upstream.url("blocked.test")
    script = f'while [ ! -e go ]; do sleep 0.05; done; curl -s -o /dev/null {url}'
    run = subprocess.Popen(run_args(tmp_path, "sh", "-c", script, extra=["--headless", "--proxy", proxy_mode]),
                           cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(tmp_path),
                           stdin=subprocess.DEVNULL)
    follower = None
    try:
        info = wait_for_run(tmp_path)
        follower = subprocess.Popen([*egress_command(), "events", "--follow", "--json", "--run", info["run"]],
                                    stdout=subprocess.PIPE, text=True, env=env_for(tmp_path))
        time.sleep(0.5)  # let the follower subscribe before the command connects
        (project / "go").touch()
        line = follower.stdout.readline()
        event = json.loads(line)
        assert (event["host"], event["decision"], event["reason"]) == ("blocked.test", "block", "not-allowed")
        assert event["session"] == info["run"]
    finally:
        run.wait(60)
        if follower is not None:
            follower.kill()
            follower.wait()


# ------------------------------------------------------------------ the command cannot answer for the person


def ask_on_pty(typed_before: str, answer: str) -> tuple[bool, str]:
    """A real TerminalAsker on a pseudo-terminal: what was typed before the question, then the answer."""
    master, slave = pty.openpty()
    seen = ""

    def read_until(text: str) -> None:
        nonlocal seen
        while text not in seen:
            ready, _, _ = select.select([master], [], [], 30)
            assert ready, f"never saw {text!r}; saw {seen!r}"
            seen += os.read(master, 4096).decode(errors="replace")

    try:
        if typed_before:
            os.write(master, typed_before.encode())
            read_until(typed_before.rstrip("\n"))  # echoed: the line discipline holds it, unread
        state = RunState("ptytest", ["cmd"])
        asker = TerminalAsker(state, "cmd", tty=os.ttyname(slave))
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(asyncio.run(asker.ask("other.test"))))
        thread.start()
        read_until("(held 60 s) > ")
        os.write(master, answer.encode())
        thread.join(60)
        read_until("egress: other.test ")
        assert result[0] == ("other.test" in state.grants)
        assert termios.tcgetattr(slave)[3] & termios.ICANON, "the terminal is left out of line mode"
        return result[0], seen
    finally:
        os.close(slave)
        os.close(master)


@pytest.mark.parametrize("typed_before, answer, allowed", [
    ("", "a", True),  # one key, no Enter: what the prompt shows
    ("", "Y", True),
    ("", "k", False),
    ("", "a\n", True),
    ("", "  yes \n", True),
    ("", "ALLOW\n", True),
    ("", "y\r", True),
    ("", "k\n", False),
    ("", "\n", False),
    ("", "ab\n", False),
    ("", "\x1b[Aa\n", False),  # an escape sequence (cursor up) before the a
    ("", "\u0430\n", False),  # Cyrillic a
    ("a\n", "k\n", False),  # typed ahead of the question: discarded, so the k answers
    ("y\n", "\n", False),
], ids=repr)
def test_only_an_exact_answer_typed_after_the_question_allows(typed_before, answer, allowed):
    got, seen = ask_on_pty(typed_before, answer)
    assert got is allowed
    assert ("allowed for this run" in seen) is allowed
    assert RESET + "\r\negress: `cmd` wants to reach other.test" in seen  # asked on a reset display
    assert RESET + "egress: other.test " in seen


def test_input_queued_before_the_question_does_not_grant(tmp_path, http_upstream, curl_path):
    url = http_upstream.url("other.test")
    script = f'while [ ! -e go ]; do sleep 0.05; done; curl -s -o /dev/null -w "code=%{{http_code}}\\n" {url}'
    terminal = Terminal(run_args(tmp_path, "sh", "-c", script), tmp_path)
    terminal.type("a\n")
    terminal.read_until("a\r\n")  # echoed, so queued on the terminal before any question
    (tmp_path / "project" / "go").touch()
    terminal.read_until("wants to reach other.test")
    terminal.type("k\n")
    terminal.finish()
    assert "kept blocked" in terminal.seen and "allowed for this run" not in terminal.seen
    assert "code=403" in terminal.seen
    assert http_upstream.connections == 0


CONCEAL = "printf '\\033[8m' >&2; "  # the command leaves the terminal concealing text


def test_egress_lines_on_a_terminal_come_behind_a_display_reset(tmp_path, http_upstream, curl_path):
    url = http_upstream.url("blocked.test")
    terminal = Terminal(run_args(tmp_path, "sh", "-c", CONCEAL + f"curl -s -o /dev/null {url}",
                                 extra=["--deny", "blocked.test"]), tmp_path)
    terminal.finish()
    report = RESET + "EGRESS_BLOCKED blocked.test (on the deny list)"
    assert "\x1b[8m" in terminal.seen and report in terminal.seen
    assert terminal.seen.index("\x1b[8m") < terminal.seen.index(report)


def test_egress_lines_in_a_pipe_stay_plain_text(tmp_path, http_upstream, curl_path):
    project = tmp_path / "project"
    project.mkdir()
    url = http_upstream.url("other.test")
    result = subprocess.run(run_args(tmp_path, "sh", "-c", "printf '\\033[8m\\n' >&2; " + f"curl -s -o /dev/null {url}",
                                     extra=["--headless"]),
                            capture_output=True, text=True, timeout=120, cwd=project, env=env_for(tmp_path),
                            stdin=subprocess.DEVNULL)
    lines = result.stderr.splitlines()
    assert lines[0] == "\x1b[8m"  # the command's own bytes pass untouched
    ours = [line for line in lines[1:] if "EGRESS_BLOCKED" in line or "no terminal to ask on" in line]
    assert len(ours) == 2, result.stderr
    assert "EGRESS_BLOCKED other.test (not on the allow list)" in ours
    assert not any(c in line for line in ours for c in "\x1b\x0f")


# The sandboxed command looks for the run's control socket and asks it to allow the host it
# was refused. Whether it cannot see the socket or the socket refuses it, the host stays blocked.
SELF_GRANT = """
import glob, json, socket, sys, urllib.error, urllib.request

def fetch():
    try:
        return urllib.request.urlopen(sys.argv[1]).status
    except urllib.error.HTTPError as e:
        return e.code

print("before", fetch(), flush=True)
answers = []
for path in glob.glob(sys.argv[2] + "/runs/*.sock") + glob.glob(sys.argv[2] + "/warm/*.sock"):
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            sock.sendall(json.dumps({"op": "allow", "host": "other.test"}).encode() + b"\\n")
            answers.append(sock.makefile().readline().strip())
    except OSError as e:
        answers.append(type(e).__name__)
print("control", answers or "no socket", flush=True)
print("after", fetch(), flush=True)
"""


def test_the_sandboxed_command_cannot_grant_itself(tmp_path, http_upstream):
    project = tmp_path / "project"
    project.mkdir()
    result = subprocess.run(run_args(tmp_path, sys.executable, "-c", SELF_GRANT, http_upstream.url("other.test"),
                                     str(tmp_path / "state"), extra=["--headless"]),
                            capture_output=True, text=True, timeout=120, cwd=project, env=env_for(tmp_path),
                            stdin=subprocess.DEVNULL)
    lines = result.stdout.splitlines()
    assert lines[0] == "before 403", result.stderr
    assert lines[2] == "after 403", result.stdout + result.stderr
    assert '"ok"' not in lines[1]  # not found, or refused by the peer check
    assert "EGRESS_BLOCKED other.test (not on the allow list)" in result.stderr
    assert http_upstream.connections == 0


# ------------------------------------------------------------------ serve takes no grants


def test_egress_allow_is_refused_by_a_serve_and_nothing_changes(proxy_factory, http_upstream, tmp_path, curl_path):
    # A grant is one person's decision for one run; a serve is shared and outlives its clients,
    # so its road is the policy file (reloaded live), and `egress allow` says so instead of
    # printing a success that changes nothing.
    proxy = proxy_factory('allow_private = ["other.test"]\n')
    run_id = f"serve-{proxy.process.pid}"
    policy = proxy.audit_path.parent / "policy.toml"
    env = clean_env(tmp_path, EGRESS_STATE_DIR=str(proxy.state_dir))
    granted = subprocess.run([*egress_command(), "allow", "other.test", "--run", run_id], capture_output=True,
                             text=True, timeout=30, env=env)
    assert granted.returncode == 1 and granted.stdout == ""
    assert granted.stderr == (
        f"egress: {run_id} is an egress serve, shared by all its clients: it takes no grants (they are for one "
        f"egress run); add the host to the allow list in {policy}: serve applies the edit to the next request "
        f"(at once with `egress policy reload --run {run_id}`)\n")
    listed = subprocess.run([*egress_command(), "runs", "--json"], capture_output=True, text=True, timeout=30,
                            env=env)
    [info] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert info["run"] == run_id and info["grants"] == []
    curl = subprocess.run([curl_path, "-s", "-o", "/dev/null", "-w", "%{http_code}", "--proxy", proxy.url,
                           http_upstream.url("other.test")], capture_output=True, text=True, timeout=60,
                          env=clean_env(tmp_path))
    assert curl.stdout == "403" and http_upstream.connections == 0
    # the road it names works: the edit applies to the next request
    policy.write_text('allow = ["other.test"]\nallow_private = ["other.test"]\n')
    reloaded = subprocess.run([*egress_command(), "policy", "reload", "--run", run_id], capture_output=True,
                              text=True, timeout=30, env=env)
    assert reloaded.returncode == 0, reloaded.stderr
    for _ in range(100):
        if any("policy reloaded" in line for line in proxy.stderr_lines):
            break
        time.sleep(0.05)
    curl = subprocess.run([curl_path, "-s", "--proxy", proxy.url, http_upstream.url("other.test")],
                          capture_output=True, text=True, timeout=60, env=clean_env(tmp_path))
    assert curl.stdout == "hello from upstream\n"
