"""The warm proxy: `egress run` hands its sandbox's socket to a per-user process that is already warm.

Real runs through the real launcher, a real warm server (egress.run.warm.server) and its real
children, real namespaces; upstreams on 127.0.0.1 reached through --resolve. Each test's
state folder is its own, so each starts its own server; the autouse fixture in conftest.py
stops it (by pid) when the test ends.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_NAMES, clean_env, egress_command, stop_warm_servers, warm_server_pids

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")

POLICY = 'allow = ["allowed.test"]\nallow_private = ["allowed.test", "other.test", "blocked.test"]\n'


@pytest.fixture(scope="module", autouse=True)
def namespaces_available():
    probe = subprocess.run(["unshare", "-Urn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user+network namespaces are not available here: {probe.stderr.decode().strip()}")


def run_args(tmp_path, *command: str, policy: str = POLICY, extra=(), name: str = "policy.toml") -> list[str]:
    policy_file = tmp_path / name
    policy_file.write_text(policy)
    args = [*egress_command(), "run", "--policy", str(policy_file), "--state-dir", str(tmp_path / "state"),
            "--headless"]
    for host in TEST_NAMES:
        args += ["--resolve", f"{host}:127.0.0.1"]
    return [*args, *extra, "--", *command]


def env_for(tmp_path, **extra) -> dict:
    (tmp_path / "launcher-tmp").mkdir(exist_ok=True)
    return clean_env(tmp_path, **{"PYTHONPATH": os.getcwd(), "TMPDIR": str(tmp_path / "launcher-tmp"), **extra})


def egress_run(tmp_path, *command: str, project: Path | None = None, env=None, **kwargs) -> subprocess.CompletedProcess:
    project = project or tmp_path / "project"
    project.mkdir(exist_ok=True)
    return subprocess.run(run_args(tmp_path, *command, **kwargs), capture_output=True, text=True, timeout=120,
                          cwd=project, env=env or env_for(tmp_path), stdin=subprocess.DEVNULL)


def fetch(*urls: str) -> list[str]:
    """A command that prints each URL's status as `host=code` (000: no answer at all)."""
    lines = [f'curl -s -o /dev/null -w "{url.split("/")[2].split(":")[0]}=%{{http_code}}\\n" {url}' for url in urls]
    return ["sh", "-c", "; ".join(lines)]


def server(tmp_path) -> dict | None:
    """The record of the warm server for this test's state folder (pid, started, idle...)."""
    records = list((tmp_path / "state" / "warm").glob("*.json"))
    return json.loads(records[0].read_text()) if records else None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    except OSError:
        return False


def wait_until(predicate, what: str, timeout: float = 60.0):
    """Poll until ``predicate()`` is true (a generous deadline: this is not a speed check)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def why(result: subprocess.CompletedProcess, tmp_path, upstream=None) -> str:
    """What to read when a run did not fetch: its stderr, what reached the upstream, the warm log."""
    text = f"stderr: {result.stderr!r}"
    if upstream is not None:
        text += f"\nupstream: {upstream.connections} connections, requests {[r['path'] for r in upstream.requests]}"
    for log in (tmp_path / "state" / "warm").glob("*.log"):
        text += f"\n{log.name}: {log.read_text(errors='replace')[-3000:]}"
    return text


def runs(tmp_path) -> list[dict]:
    result = subprocess.run([*egress_command(), "runs", "--json", "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=30, env=env_for(tmp_path))
    return [json.loads(line) for line in result.stdout.splitlines()]


# ------------------------------------------------------------ started once, reused, gone when idle


def test_the_first_run_starts_the_warm_proxy_and_the_next_run_reuses_it(tmp_path, http_upstream, curl_path):
    url = http_upstream.url("allowed.test")
    first = egress_run(tmp_path, *fetch(url))
    assert first.stdout == "allowed.test=200\n", why(first, tmp_path, http_upstream)
    record = wait_until(lambda: server(tmp_path), "the warm server wrote its record")
    assert alive(record["pid"])
    second = egress_run(tmp_path, *fetch(url, http_upstream.url("blocked.test")))
    assert second.stdout == "allowed.test=200\nblocked.test=403\n", why(second, tmp_path, http_upstream)
    assert "EGRESS_BLOCKED blocked.test (not on the allow list)" in second.stderr
    assert server(tmp_path)["pid"] == record["pid"]
    doctor = subprocess.run([*egress_command(), "doctor", "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=120, env=env_for(tmp_path))
    assert f"warm proxy         running: pid {record['pid']} since" in doctor.stdout


def test_a_run_that_never_connects_starts_the_warm_proxy_for_the_next(tmp_path, http_upstream, curl_path):
    assert egress_run(tmp_path, "true").returncode == 0
    record = wait_until(lambda: server(tmp_path), "the warm server wrote its record")
    result = egress_run(tmp_path, *fetch(http_upstream.url("allowed.test")))
    assert result.stdout == "allowed.test=200\n", why(result, tmp_path, http_upstream)
    assert server(tmp_path)["pid"] == record["pid"]


def test_the_warm_proxy_exits_when_idle(tmp_path, http_upstream, curl_path):
    env = env_for(tmp_path, EGRESS_WARM_IDLE="1")
    result = egress_run(tmp_path, *fetch(http_upstream.url("allowed.test")), env=env)
    assert result.stdout == "allowed.test=200\n", why(result, tmp_path, http_upstream)
    pid = wait_until(lambda: server(tmp_path), "the warm server wrote its record")["pid"]
    wait_until(lambda: not alive(pid), "the idle warm server exited")
    assert server(tmp_path) is None  # its record goes with it
    doctor = subprocess.run([*egress_command(), "doctor", "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert "warm proxy         not running; the next networked egress run starts it" in doctor.stdout


def test_a_killed_warm_proxy_is_replaced_without_a_word(tmp_path, http_upstream, curl_path):
    url = http_upstream.url("allowed.test")
    egress_run(tmp_path, *fetch(url))
    old = wait_until(lambda: server(tmp_path), "the warm server wrote its record")["pid"]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: not alive(old), "the killed server is gone")
    result = egress_run(tmp_path, *fetch(url))
    assert result.stdout == "allowed.test=200\n" and result.stderr == "", result.stderr
    new = wait_until(lambda: (server(tmp_path) or {}).get("pid") not in (None, old) and server(tmp_path),
                     "a new warm server")["pid"]
    assert alive(new)


def test_code_changed_on_disk_restarts_the_warm_proxy(tmp_path, http_upstream, curl_path):
    # egress imported from a copy of the source (its own installation, so its own server); then
    # the copy changes, as an upgrade or an edit would change it.
    lib = tmp_path / "lib"
    for part in ("egress", "sandbox", "policies"):
        shutil.copytree(os.path.join(os.getcwd(), part), lib / part, ignore=shutil.ignore_patterns("__pycache__"))
    env = env_for(tmp_path, PYTHONPATH=str(lib))
    url = http_upstream.url("allowed.test")
    assert egress_run(tmp_path, *fetch(url), env=env).stdout == "allowed.test=200\n"
    old = wait_until(lambda: server(tmp_path), "the warm server wrote its record")
    assert old["egress"] == str(lib / "egress")
    with open(lib / "egress" / "core" / "reasons.py", "a") as f:  # a module below egress/, as most are
        f.write("\n# an upgrade\n")
    result = egress_run(tmp_path, *fetch(url), env=env)
    assert result.stdout == "allowed.test=200\n" and result.stderr == "", result.stderr
    wait_until(lambda: not alive(old["pid"]), "the stale server exited")
    new = wait_until(lambda: server(tmp_path), "a new warm server")
    assert new["pid"] != old["pid"]


def test_with_proxy_lazy_no_warm_proxy_is_started(tmp_path, http_upstream, curl_path):
    for how in ({"extra": ["--proxy", "lazy"]}, {"env": env_for(tmp_path, EGRESS_PROXY="lazy")}):
        result = egress_run(tmp_path, *fetch(http_upstream.url("allowed.test")), **how)
        assert result.stdout == "allowed.test=200\n", why(result, tmp_path, http_upstream)
    assert warm_server_pids(tmp_path) == [] and server(tmp_path) is None


# ------------------------------------------------------------ warm and lazy: one behaviour


SCENARIO = 'printf "%s\\n" "$(curl -s {ok})"; curl -s -o /dev/null -w "%{{http_code}}\\n" {blocked}; ' \
           'curl -s -o /dev/null -w "%{{http_code}}\\n" {denied}; ' \
           'curl -s -o /dev/null -w "%{{http_code}}\\n" {blocked}; exit 3'


def test_warm_and_lazy_look_the_same_to_the_user(tmp_path, http_upstream, curl_path):
    script = SCENARIO.format(ok=http_upstream.url("allowed.test"), blocked=http_upstream.url("blocked.test"),
                             denied=http_upstream.url("other.test"))
    seen = {}
    for mode in ("warm", "lazy"):
        audit = tmp_path / f"audit-{mode}.jsonl"
        result = egress_run(tmp_path, "sh", "-c", script,
                            extra=["--proxy", mode, "--deny", "other.test", "--audit-log", str(audit)])
        events = [json.loads(line) for line in audit.read_text().splitlines()]
        assert len({e["session"] for e in events}) == 1
        stderr = re.sub(r"--run [0-9a-f]+", "--run ID", result.stderr)
        seen[mode] = (result.returncode, result.stdout, stderr,
                      [(e["method"], e["host"], e["port"], e["decision"], e["reason"], e["rule"]) for e in events])
    assert seen["warm"] == seen["lazy"]
    status, stdout, stderr, events = seen["warm"]
    assert (status, stdout) == (3, "hello from upstream\n403\n403\n403\n")
    assert stderr.splitlines() == [
        "egress: no terminal to ask on (headless): hosts not on the allow list stay blocked; "
        "grant one with `egress allow HOST --run ID`",
        "EGRESS_BLOCKED blocked.test (not on the allow list)",
        "EGRESS_BLOCKED other.test (on the deny list)"]
    assert [(host, decision, reason) for _, host, _, decision, reason, _ in events] == [
        ("allowed.test", "allow", "allowed"), ("blocked.test", "block", "not-allowed"),
        ("other.test", "block", "denied"), ("blocked.test", "block", "not-allowed")]


# ------------------------------------------------------------ runs do not see each other


CONCURRENT = ('code() {{ curl -s -o /dev/null -w "$1=%{{http_code}}\\n" http://$1:{port}/small; }}; '
              'code a.test; code b.test; while [ ! -e go ]; do sleep 0.05; done; code granted.test')


def test_two_runs_at_once_see_only_their_own_policy_grants_and_events(tmp_path, http_upstream, curl_path):
    names = ["a.test", "b.test", "granted.test"]
    policy = f'allow_private = {json.dumps(names)}\n'
    script = CONCURRENT.format(port=http_upstream.port)
    processes = {}
    for run, allowed in (("A", "a.test"), ("B", "b.test")):
        project = tmp_path / f"project-{run}"
        project.mkdir()
        args = run_args(tmp_path, "sh", "-c", script, policy=policy, name=f"policy-{run}.toml",
                        extra=["--allow", allowed, "--audit-log", str(tmp_path / f"audit-{run}.jsonl"),
                               *[f"--resolve={name}:127.0.0.1" for name in names]])
        processes[run] = subprocess.Popen(args, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env_for(tmp_path), stdin=subprocess.DEVNULL)
    try:
        live = wait_until(lambda: (r := runs(tmp_path)) and len(r) == 2 and all(x.get("proxy") == "warm" for x in r)
                          and r, "both runs served by the warm proxy")
        ids = {run: info["run"] for info in live for run, process in processes.items() if process.pid == info["pid"]}
        assert sorted(ids) == ["A", "B"] and len({info["proxy_pid"] for info in live}) == 2  # a child each
        server_pid = server(tmp_path)["pid"]
        assert all(info["proxy_pid"] in children_of(server_pid) for info in live)
        granted = subprocess.run([*egress_command(), "allow", "granted.test", "--run", ids["A"],
                                  "--state-dir", str(tmp_path / "state")],
                                 capture_output=True, text=True, timeout=30, env=env_for(tmp_path))
        assert granted.returncode == 0, granted.stderr
        for run in processes:
            (tmp_path / f"project-{run}" / "go").touch()
        out = {run: process.communicate(timeout=120) for run, process in processes.items()}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    assert out["A"][0].split() == ["a.test=200", "b.test=403", "granted.test=200"], out["A"][1]
    assert out["B"][0].split() == ["a.test=403", "b.test=200", "granted.test=403"], out["B"][1]
    assert [line for line in out["A"][1].splitlines() if "EGRESS_BLOCKED" in line] == \
        ["EGRESS_BLOCKED b.test (not on the allow list)"]
    assert [line for line in out["B"][1].splitlines() if "EGRESS_BLOCKED" in line] == \
        ["EGRESS_BLOCKED a.test (not on the allow list)", "EGRESS_BLOCKED granted.test (not on the allow list)"]
    for run in ("A", "B"):
        events = [json.loads(line) for line in (tmp_path / f"audit-{run}.jsonl").read_text().splitlines()]
        assert {e["session"] for e in events} == {ids[run]}
        assert len(events) == 3


def test_a_run_whose_server_found_another_starting_waits_for_that_one(tmp_path):
    """Two first runs at once each start a server; the later server finds the lock taken and exits.
    Its run must wait for the server that holds the lock, not give up on the warm proxy."""
    import fcntl

    from egress.run.warm import client as warm

    paths = warm.Paths(tmp_path / "state", "0badc0de")
    paths.make_folder()
    handover = warm.Handover(paths, {}, {})
    exited = subprocess.Popen(["true"])
    exited.wait()  # reaped: as a server is once it has exited
    handover._spawned = exited.pid
    lock = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run's server: it holds the lock, not yet listening
        assert handover.try_send() is False
        assert not handover.failed  # it waits for that server
    finally:
        os.close(lock)  # that server is gone too, and none listens
    assert handover.try_send() is False
    assert handover.failed and "could not start" in handover.note


# ------------------------------------------------------------ walls


PROBE = """
import glob, json, marshal, socket, sys
answers = []
for path in glob.glob(sys.argv[1] + "/warm/*.sock"):
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            body = marshal.dumps({"op": "run"})  # a frame as egress.run.warm.client sends one
            try:
                sock.sendall(len(body).to_bytes(4, "big") + body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused and closed before we wrote: its answer is still there to read
            answer = sock.makefile("rb")
            size = int.from_bytes(answer.read(4), "big")
            answers.append(marshal.loads(answer.read(size)) if size else "closed")
    except OSError as e:
        answers.append(type(e).__name__)
print(json.dumps(answers or "no socket"))
"""


def test_the_sandboxed_command_cannot_reach_the_warm_proxy(tmp_path, http_upstream, curl_path):
    egress_run(tmp_path, *fetch(http_upstream.url("allowed.test")))  # the server runs now
    wait_until(lambda: server(tmp_path), "the warm server wrote its record")
    socket_path = next((tmp_path / "state" / "warm").glob("*.sock"))
    result = egress_run(tmp_path, sys.executable, "-c", PROBE, str(tmp_path / "state"))
    assert json.loads(result.stdout) == "no socket", result.stderr  # the state folder is hidden
    # Even given the path, a process in a user namespace of its own (as every sandboxed command
    # is) is refused by the server itself ("peer"), before any child reads what it sent (a
    # child would have answered that this is no launcher: "protocol").
    probe = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", PROBE,
                            str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    answers = json.loads(probe.stdout)
    assert len(answers) == 1 and answers[0]["reason"] == "peer", probe.stdout
    assert socket_path.stat().st_mode & 0o777 == 0o600


HOLD = '{fetch}; touch ready; while [ ! -e go ]; do sleep 0.05; done'


# Modules a sandboxed command writes into its project. Whatever imports `argparse` with the
# project ahead of the standard library runs the first (it then hands over the real one); a
# name that every import path lacks (an optional import, which fails) is looked up in every
# folder of the path, the last too: the second is for those. The warm server imports both
# kinds; `egress run`'s launcher imports argparse not at all.
PLANTED = """
import os, sys
with open({mark!r}, "a") as f:
    f.write(f"{{__name__}} {{os.getpid()}} {{os.readlink('/proc/self/ns/user')}} {{sys.argv}}\\n")
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules["argparse"]
import importlib
sys.modules["argparse"] = importlib.import_module("argparse")
"""
PLANTED_MISSING = """
import os, sys
with open({mark!r}, "a") as f:
    f.write(f"{{__name__}} {{os.getpid()}} {{os.readlink('/proc/self/ns/user')}} {{sys.argv}}\\n")
raise ImportError(__name__)
"""
# The top-level names a warm server's start looks for and finds nowhere (e.g. socks, chardet:
# optional imports of its libraries), found as it would: its flags, egress from ``lib``.
MISSING = """
import json, sys
sys.path.insert(0, sys.argv[1])
missing = set()
class Last:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is None:  # top-level, and every finder before this one failed
            missing.add(name)
sys.meta_path.append(Last)
from pathlib import Path
from egress.run.warm.server import warm_up
warm_up(Path(sys.argv[2]))
print(json.dumps(sorted(missing)))
"""


def interpreter_with_pth(tmp_path, folder: Path) -> str:
    """A virtual environment with this one's packages (linked, not copied) whose site folder has a
    .pth naming ``folder``, as an editable install of a project there writes one (hatch, or
    setuptools with a src layout)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    shutil.rmtree(site)
    import sysconfig

    subprocess.run(["cp", "-as", sysconfig.get_paths()["purelib"], str(site)], check=True, timeout=120)
    (site / "the_project.pth").write_text(f"{folder}\n")
    return str(venv / "bin" / "python")


WAYS_IN = ["egress's source tree is the project", "the caller's PYTHONPATH names the project",
           "a .pth in the interpreter's site folder names the project"]


@pytest.mark.parametrize("where", WAYS_IN)
def test_a_command_cannot_put_code_on_the_warm_servers_import_path(tmp_path, http_upstream, curl_path, where):
    """The warm server outlives the run, holds the CA's key and forks every later run's child: a
    module the command can write must never be importable there. It was, each of these ways:
    the server got egress's parent folder and the caller's PYTHONPATH ahead of the standard
    library, and kept a .pth file's folder at the end of its path."""
    lib = tmp_path / "lib"
    for part in ("egress", "sandbox", "policies"):
        shutil.copytree(os.path.join(os.getcwd(), part), lib / part, ignore=shutil.ignore_patterns("__pycache__"))
    project, pythonpath, python = tmp_path / "project", str(lib), sys.executable
    if where == WAYS_IN[0]:  # a developer's checkout, run from itself
        project = lib
    else:
        project.mkdir()
    if where == WAYS_IN[1]:
        pythonpath = os.pathsep.join([str(lib), str(project)])
    mark = tmp_path / "escaped"
    (project / "planted").mkdir()
    (project / "planted" / "argparse.py").write_text(PLANTED.format(mark=str(mark)))
    if where == WAYS_IN[2]:
        python = interpreter_with_pth(tmp_path, project)
        found = subprocess.run([python, "-E", "-P", "-s", "-c", MISSING, str(lib), str(tmp_path / "state")],
                               capture_output=True, text=True, timeout=120, check=True)
        missing = [name for name in json.loads(found.stdout) if "." not in name]
        assert missing  # else this case would prove nothing
        for name in missing:
            (project / "planted" / f"{name}.py").write_text(PLANTED_MISSING.format(mark=str(mark)))
    env = env_for(tmp_path, PYTHONPATH=pythonpath)

    def args(*command):  # -P: no working folder on the launcher's path either, as the `egress` script has none
        return [python, "-P", *run_args(tmp_path, *command)[1:]]

    url = http_upstream.url("allowed.test")
    planted = subprocess.run(args("sh", "-c", f"cp planted/*.py . && {fetch(url)[2]}"), capture_output=True,
                             text=True, timeout=120, cwd=project, env=env, stdin=subprocess.DEVNULL)
    assert planted.stdout == "allowed.test=200\n", why(planted, tmp_path, http_upstream)
    assert (project / "argparse.py").exists()  # the command could write it
    stop_warm_servers(tmp_path)  # the next run starts a server (as after an idle exit or an upgrade)
    process = subprocess.Popen(args("sh", "-c", HOLD.format(fetch=fetch(url)[2])), cwd=project,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: (project / "ready").exists(), "the next run fetched")
        served = [i.get("proxy") for i in runs(tmp_path)]
        (project / "go").touch()
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    said = [line for line in err.splitlines() if not line.startswith("egress: egress's own code lies in")]
    assert (out, said) == ("allowed.test=200\n", []), \
        why(subprocess.CompletedProcess(process.args, process.returncode, out, err), tmp_path, http_upstream)
    assert served == ["warm"]  # by the new server, which imported egress from where the launcher did:
    assert server(tmp_path)["egress"] == str(lib / "egress")
    # In the .pth case the interpreter itself imports from the project, the launcher included, before
    # any code of egress runs (at least `sitecustomize`, from Python's startup): that launcher's marks
    # are the installation's to avoid; a server must leave none.
    marks = mark.read_text().splitlines() if mark.exists() else []
    assert [line for line in marks if "warmserver" in line] == [], "planted modules ran in a warm server"


def held_by(pids, target: str) -> list[int]:
    """Which of ``pids`` have a descriptor on ``target`` (a path, or "pipe:[inode]")."""
    holders = []
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if target in links:
            holders.append(pid)
    return holders


@pytest.mark.parametrize("kind", ["a pipe (a shell's 5>&1, a harness's)", "an open file"])
def test_the_warm_server_keeps_no_descriptor_of_the_launcher_that_started_it(tmp_path, kind):
    """posix_spawn passes on what the caller did not mark close-on-exec: the server, and every later
    run's child, held it until the server's idle exit. A pipe held so kept its reader waiting for
    EOF (`{ egress run -- true; } 5>&1 | cat` waited out the 600 s)."""
    if kind.startswith("a pipe"):
        read, passed = os.pipe()
        target = f"pipe:[{os.fstat(passed).st_ino}]"
    else:
        (tmp_path / "notes.txt").write_text("the caller's\n")
        read, passed = -1, os.open(tmp_path / "notes.txt", os.O_RDONLY)
        target = str(tmp_path / "notes.txt")
    try:
        project = tmp_path / "project"
        project.mkdir()
        result = subprocess.run(run_args(tmp_path, "true"), capture_output=True, text=True, timeout=120,
                                cwd=project, env=env_for(tmp_path), stdin=subprocess.DEVNULL, pass_fds=(passed,))
        assert result.returncode == 0, result.stderr
        pid = wait_until(lambda: server(tmp_path), "the run started the warm server")["pid"]
        wait_until(lambda: children_of(pid), "its spare")  # forked after its start, so as a run's child is
        assert held_by([pid, *children_of(pid)], target) == []
    finally:
        os.close(passed)
    if read >= 0:
        os.set_blocking(read, False)
        try:
            assert os.read(read, 1) == b""  # EOF at once: nobody else holds the pipe
        finally:
            os.close(read)


# A listener at the warm server's path that is not the server: a process in a user namespace of
# its own (as every sandboxed command is) took the path, and writes down what the next launcher
# that connects sends it. (A command reached it from its sandbox by renaming the state folder's
# parent in its project; mounts now pin that folder, test_run_escapes.py: this is the launcher's
# own check, for whatever else might put a stranger there.)
IMPOSTOR = """
import json, marshal, os, socket, sys
state, name = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(state, "warm"), exist_ok=True)
with socket.socket(socket.AF_UNIX) as listener:
    listener.bind(os.path.join(state, "warm", name))
    listener.listen(8)
    open("listening", "w").close()
    listener.settimeout(100)
    conn, _ = listener.accept()
    data = b""
    while chunk := conn.recv(1 << 20):  # until the launcher hangs up (a real server would answer)
        data += chunk
        if len(data) >= 4 and len(data) >= 4 + int.from_bytes(data[:4], "big"):
            break
got = marshal.loads(data[4:4 + int.from_bytes(data[:4], "big")]) if data else {}
json.dump({key: got.get(key) for key in ("op", "argv", "environ")}, open("heard.json", "w"))
"""


def test_a_launcher_sends_nothing_to_a_listener_that_is_not_its_warm_server(tmp_path, http_upstream, curl_path):
    """The server checks each launcher; the launcher did not check the server. A command that could
    write the folder holding egress's state listened at the warm server's path from its sandbox,
    and a concurrent run's launcher sent it its request (environment, argv, policy) and then its
    listening socket. Now the launcher sends nothing, serves the run itself, and says why."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: it puts the impostor in a user namespace")
    home = tmp_path / "h"
    home.mkdir()
    state = home / "s" / "e"  # short: a control socket's path must fit sockaddr_un
    name = subprocess.run([sys.executable, "-c", "from egress.run.warm import client as warm; import os, sys; "
                           "print(os.path.basename(warm.Paths.for_state(sys.argv[1]).socket))", str(state)],
                          capture_output=True, text=True, check=True, env=env_for(tmp_path),
                          timeout=60).stdout.strip()  # as the launchers name it
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    env = env_for(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    a = subprocess.Popen(["unshare", "--user", "--map-root-user", sys.executable, "-c", IMPOSTOR, str(state), name],
                         cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: (home / "listening").exists() or a.poll() is not None, "the impostor listens")
        assert a.poll() is None, a.communicate()
        b = subprocess.run([*egress_command(), "run", "--policy", str(policy), "--state-dir", str(state), "--headless",
                            "--resolve", "allowed.test:127.0.0.1", "--", *fetch(http_upstream.url("allowed.test"))],
                           cwd=project, capture_output=True, text=True, timeout=120,
                           env={**env, "B_SECRET": "b's own"}, stdin=subprocess.DEVNULL)
        a_out, a_err = a.communicate(timeout=120)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert a.returncode == 0, a_err
    heard = json.loads((home / "heard.json").read_text())
    # the connection, and not a byte on it
    assert heard == {"op": None, "argv": None, "environ": None}, (heard, b.stderr, a_err)
    assert b.stdout == "allowed.test=200\n", (b.stderr, a_err)  # served, by its own process
    assert b.stderr == (f"egress: {state}/warm/{name} is not served by this user's warm proxy (a process of "
                        f"another user, or inside a sandbox, listens there); nothing was sent to it; this run's "
                        f"proxy starts in its own process\n"), (b.stderr, a_err)


CRASH = ('curl -s -o /dev/null -w "first=%{{http_code}}\\n" {url}; touch ready; '
         'while [ ! -e go ]; do sleep 0.05; done; curl -s -o /dev/null -w "after=%{{http_code}}\\n" {url}; exit 5')


def test_a_crashed_warm_child_fails_its_runs_connections_and_the_run_says_so(tmp_path, http_upstream, curl_path):
    url = http_upstream.url("allowed.test")
    egress_run(tmp_path, *fetch(url))  # start the server, so this run is served warm from its start
    server_pid = wait_until(lambda: server(tmp_path), "the warm server wrote its record")["pid"]
    project = tmp_path / "project"
    process = subprocess.Popen(run_args(tmp_path, "sh", "-c", CRASH.format(url=url)), cwd=project,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(tmp_path),
                               stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: (project / "ready").exists(), "the first request went through")
        child = wait_until(lambda: [i["proxy_pid"] for i in runs(tmp_path) if i.get("proxy") == "warm"],
                           "the run's warm child")[0]
        assert child in children_of(server_pid)
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: not alive(child), "the child is gone")
        (project / "go").touch()
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 5  # the command's own status
    assert out.split() == ["first=200", "after=000"], err  # refused: nobody serves the socket
    assert f"egress: the proxy failed: the warm proxy's process for this run ({child}) ended unexpectedly" in err
    assert alive(server_pid)  # the server and other runs carry on
    assert egress_run(tmp_path, *fetch(url)).stdout == "allowed.test=200\n"


def test_the_warm_childs_asker_is_an_asker_as_the_proxy_names_it():
    # A reload re-decides each live passthrough tunnel and keeps one to a host this run granted
    # (egress.proxy.seams.Asker: state.grants). The child's asker had no state: in a warm run, the
    # re-check of a tunnel to a host the new policy no longer allows raised, and the tunnel stayed open.
    import asyncio
    import inspect
    from types import SimpleNamespace
    from typing import Protocol, runtime_checkable

    from egress.proxy.seams import Asker
    from egress.run.warm.child import RemoteAsker

    @runtime_checkable
    class CheckedAsker(Asker, Protocol):
        """egress.proxy.seams.Asker, checkable at run time."""

    async def main():
        loop = asyncio.get_running_loop()
        asker = RemoteAsker(SimpleNamespace(stopping=False, send=lambda message: loop.call_soon(
            asker.answer, message["id"], message["host"] == "yes.test")))
        assert isinstance(asker, CheckedAsker) and inspect.iscoroutinefunction(asker.ask)
        assert await asker.ask("yes.test") and not await asker.ask("no.test")
        return asker.state.grants

    assert asyncio.run(main()) == {"yes.test"}
