"""`egress run` attacked from inside, as a prompt-injected agent would (issue 8), end to end.

Each test is one escape a review carried out with the real launcher; each now fails. The
sandbox-level matrix (also as `nobody`) is tests/sandbox/test_escapes.py; the control
socket, the policy file and the terminal's display attributes have tests of their own.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import os
import pty
import shutil
import socket
import subprocess
import sys
import termios
import textwrap

import pytest
from conftest import TEST_NAMES, clean_env, egress_command

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")

POLICY = 'allow = ["allowed.test"]\nallow_private = ["allowed.test"]\n'
SECRET = "egress-test-secret-4d1f2e9ab07c5e3186f2"


@pytest.fixture(scope="module", autouse=True)
def namespaces_available():
    probe = subprocess.run(["unshare", "-Urn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user+network namespaces are not available here: {probe.stderr.decode().strip()}")


def run_args(tmp_path, project, *command, policy=POLICY, extra=()):
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(policy)
    args = [*egress_command(), "run", "--policy", str(policy_file), "--state-dir", str(tmp_path / "state"),
            "--project", str(project)]
    for name in TEST_NAMES:
        args += ["--resolve", f"{name}:127.0.0.1"]
    return [*args, *extra, "--", *command]


def egress_run(tmp_path, project, *command, policy=POLICY, extra=(), **kw):
    project.mkdir(exist_ok=True)
    return subprocess.run(run_args(tmp_path, project, *command, policy=policy, extra=extra), capture_output=True,
                          text=True, timeout=120, cwd=project, env=clean_env(tmp_path, PYTHONPATH=os.getcwd()), **kw)


def test_the_command_cannot_type_into_the_callers_terminal(tmp_path):
    # The attack: TIOCSTI on the shared terminal queues a command line that the caller's shell
    # would read and run after egress exits, outside every namespace.
    master, slave = pty.openpty()
    project = tmp_path / "project"
    project.mkdir()
    script = textwrap.dedent("""
        import fcntl, termios
        try:
            for c in b"touch ../PWNED\\n":
                fcntl.ioctl(0, termios.TIOCSTI, bytes([c]))
            print("injected")
        except OSError as e:
            print("refused", e.errno)
    """)
    try:
        seen, _ = on_terminal(master, slave, run_args(tmp_path, project, sys.executable, "-c", script),
                              project, tmp_path)
        pending = array.array("i", [0])
        fcntl.ioctl(slave, termios.FIONREAD, pending)  # bytes waiting in the terminal's input queue
    finally:
        os.close(master)
        os.close(slave)
    assert f"refused {errno.EPERM}".encode() in seen, seen
    assert pending[0] == 0  # nothing for the caller's shell to run
    assert not (tmp_path / "PWNED").exists()


def on_terminal(master: int, slave: int, args: list[str], project, tmp_path, **env: str) -> tuple[bytes, int]:
    """Run ``args`` with the pty's slave as its controlling terminal, as a shell would; return
    everything it wrote there and its exit status. ``env``: more variables (TERM)."""
    process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=project, start_new_session=True,
                               env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), **env),
                               preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    seen = b""
    while process.poll() is None or _readable(master):
        if _readable(master, 0.2):
            try:
                seen += os.read(master, 4096)
            except OSError:
                break
    return seen, process.wait(timeout=60)


def _readable(fd, timeout=0.0):
    import select

    return bool(select.select([fd], [], [], timeout)[0])


def test_host_files_keep_their_metadata(tmp_path, host_dir):
    victim = host_dir / "victim.txt"
    victim.write_text("keep")
    victim.chmod(0o644)
    before = victim.stat()
    script = textwrap.dedent("""
        import os
        for name, change in [("chmod", lambda: os.chmod("../victim.txt", 0o4777)),
                             ("chown", lambda: os.chown("../victim.txt", os.getuid(), os.getgid())),
                             ("utime", lambda: os.utime("../victim.txt", (0, 0))),
                             ("xattr", lambda: os.setxattr("../victim.txt", "user.egress", b"1"))]:
            try:
                change()
                print(name, "changed")
            except OSError as e:
                print(name, e.errno)
    """)
    # Granted read-only (--read): the command sees the file, and can change nothing of it.
    result = egress_run(tmp_path, host_dir / "project", sys.executable, "-c", script, extra=["--read", str(host_dir)])
    assert result.returncode == 0, result.stderr
    # The issue's own attack sets the setuid bit: refused by seccomp before the read-only mount is reached.
    chmod = errno.EPERM
    assert result.stdout.split("\n")[:4] == [f"chmod {chmod}"] + [f"{n} {errno.EROFS}" for n in ("chown", "utime", "xattr")]
    after = victim.stat()
    assert (after.st_mode, after.st_uid, after.st_mtime_ns) == (before.st_mode, before.st_uid, before.st_mtime_ns)


@pytest.mark.parametrize("network", ["off", "allowlist"])
def test_host_unix_sockets_are_no_way_out(tmp_path, host_dir, network):
    # A relay on the host (socat UNIX-LISTEN:relay.sock,fork TCP:...) would carry anything out.
    listeners, paths = [], [str(host_dir / "relay.sock"), str(tmp_path / "relay.sock")]
    for path in paths:
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen()
        server.setblocking(False)
        listeners.append(server)
    script = textwrap.dedent(f"""
        import socket
        for path in {paths!r}:
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
                print("connected")
            except OSError as e:
                print(e.errno)
    """)
    try:
        result = egress_run(tmp_path, host_dir / "project", sys.executable, "-c", script,
                            extra=["--network", network, "--read", str(host_dir)])
        # Covered where the folder is shown (--read); gone where it is not (/tmp).
        assert result.stdout.split() == [str(errno.EACCES), str(errno.ENOENT)], result.stderr
        for server in listeners:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in listeners:
            server.close()


def test_egress_state_is_hidden(tmp_path, host_dir):
    state = host_dir / "state"  # visible on the host side, outside every masked folder
    project = host_dir / "project"
    project.mkdir()
    args = run_args(tmp_path, project, "sh", "-c",
                    f"ls -A {state}; cat {state}/ca/mitmproxy-ca.pem 2>/dev/null || echo no-key")
    args[args.index("--state-dir") + 1] = str(state)
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=project,
                            env=clean_env(tmp_path, PYTHONPATH=os.getcwd()))
    assert result.returncode == 0, result.stderr
    assert (state / "ca" / "mitmproxy-ca.pem").is_file()  # the CA exists; the command just cannot see it
    assert result.stdout == "no-key\n"


# The state folder inside the project (a run whose project is $HOME): the red team renamed the
# hidden folder's parent (`mv ~/.local ~/.local2`), the hiding mount went with it, the rename
# stuck on the host, and the command made ~/.local/state/egress again with its own CA for the
# next run. Every folder on the way is now a mount point: each attempt below must fail so.
STATE_ATTACKS = textwrap.dedent("""
    import ctypes, errno, json, os, sys
    home, state = sys.argv[1], sys.argv[2]
    local, parent = os.path.join(home, ".local"), os.path.dirname(state)
    libc = ctypes.CDLL(None, use_errno=True)
    seen = {}
    def attempt(name, call):
        try:
            call()
            seen[name] = 0
        except OSError as e:
            seen[name] = e.errno
    def umount(path):
        if libc.umount2(path.encode(), 2) != 0:  # MNT_DETACH
            raise OSError(ctypes.get_errno(), path)
    attempt("mv grandparent", lambda: os.rename(local, local + "2"))
    attempt("mv parent", lambda: os.rename(parent, parent + "2"))
    attempt("mv state", lambda: os.rename(state, state + "2"))
    for name, path in (("state", state), ("parent", parent), ("grandparent", local)):
        attempt("rmdir " + name, lambda: os.rmdir(path))
        attempt("umount " + name, lambda: umount(path))
    # With a user and mount namespace of its own (capabilities there), the mounts are locked.
    if libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS
        attempt("nested umount grandparent", lambda: umount(local))
        attempt("nested mv grandparent", lambda: os.rename(local, local + "2"))
    print(json.dumps(seen))
""")


def test_the_state_folder_in_the_project_cannot_be_moved_away(tmp_path, host_dir, https_upstream, test_ca_file,
                                                               curl_path):
    home = host_dir / "home"
    state = home / ".local" / "state" / "egress"
    (home / "work").mkdir(parents=True)

    def run(*command):
        args = run_args(tmp_path, home, *command, extra=["--upstream-ca", str(test_ca_file)])
        args[args.index("--state-dir") + 1] = str(state)
        return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=home,
                              env=clean_env(tmp_path, PYTHONPATH=os.getcwd()))

    first = run("true")  # the state folder and its CA, as a first run leaves them
    assert first.returncode == 0, first.stderr
    chain = [home / ".local", home / ".local" / "state", state, state / "ca"]
    before = {path: os.lstat(path).st_ino for path in chain}
    ca = (state / "ca" / "mitmproxy-ca.pem").read_bytes()
    entries = sorted(p.name for p in home.iterdir())

    url = https_upstream.url("allowed.test", "/small")
    result = run("sh", "-c", f'"$0" -c "$1" {home} {state} && curl -sS {url}', sys.executable, STATE_ATTACKS)
    attacks, _, body = result.stdout.partition("\n")
    seen = json.loads(attacks)  # {attempt: errno}, 0 where it succeeded
    assert {"mv grandparent", "mv parent", "mv state", "rmdir state", "umount state"} <= set(seen)
    for name, error in seen.items():
        if name.startswith("umount"):
            assert error == errno.EPERM, (name, seen)  # no capability left to unmount
        elif name.startswith("nested umount"):
            assert error == errno.EINVAL, (name, seen)  # locked (MNT_LOCKED)
        else:
            assert error == errno.EBUSY, (name, seen)  # a mount point
    assert result.returncode == 0, result.stderr
    # Nothing changed on the host, and the run still works through its proxy.
    assert {path: os.lstat(path).st_ino for path in chain} == before
    assert (state / "ca" / "mitmproxy-ca.pem").read_bytes() == ca
    assert sorted(p.name for p in home.iterdir()) == entries
    assert body == "hello from upstream\n"


def test_a_secret_file_bound_to_a_host_shows_its_placeholder(tmp_path, host_dir, https_upstream, test_ca_file,
                                                              curl_path):
    token = host_dir / "token"
    token.write_text(SECRET + "\n")
    policy = POLICY + f'[[credentials.secret]]\nfile = "{token}"\nhosts = ["allowed.test"]\n'
    url = https_upstream.url("allowed.test", "/small")
    result = egress_run(tmp_path, host_dir / "project", "sh", "-c",
                        f'cat {token}; curl -sS -H "Authorization: Bearer $(cat {token})" {url}',
                        policy=policy, extra=["--upstream-ca", str(test_ca_file)])
    assert result.returncode == 0, result.stderr
    shown, body = result.stdout.split("\n", 1)
    assert SECRET not in result.stdout and len(shown) == len(SECRET) and shown != SECRET
    assert body == "hello from upstream\n"
    # The bound host received the real value, swapped in by egress.
    assert https_upstream.requests[-1]["headers"]["Authorization"] == f"Bearer {SECRET}"
    assert token.read_text() == SECRET + "\n"


# Where a secret's file may lie (a red-team finding): the command can change anything a path it
# can write is on the way to, and then the next run would read its decoy as the secret.
SECRET_FILE_PLACES = [
    # (case, how the secret file is laid out under host_dir, refused?)
    ("in the project", lambda d: _place(d / "project" / "secrets" / "token"), True),
    ("at the project's top", lambda d: _place(d / "project" / "token"), True),
    ("in an --add-dir", lambda d: _place(d / "extra" / "token"), True),
    ("through a link in the project", lambda d: _link(d / "project" / "cfg", _place(d / "outside" / "token").parent)
     / "token", True),
    ("through a link outside into the project", lambda d: _link(d / "cfg", (d / "project" / "keys")) / "token", True),
    ("beside the project", lambda d: _place(d / "outside" / "token"), False),
]


def _place(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SECRET + "\n")
    return path


def _link(link, target):
    target.mkdir(parents=True, exist_ok=True)
    _place(target / "token")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


@pytest.mark.parametrize("case,layout,refused", SECRET_FILE_PLACES, ids=[c[0] for c in SECRET_FILE_PLACES])
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "unbound"])
def test_a_secret_file_the_command_could_change_stops_the_run(tmp_path, host_dir, case, layout, refused, bound):
    (host_dir / "project").mkdir()
    (host_dir / "extra").mkdir()
    token = layout(host_dir)
    hosts = 'hosts = ["allowed.test"]\n' if bound else ""
    policy = POLICY + f'[[credentials.secret]]\nfile = "{token}"\n{hosts}'
    result = egress_run(tmp_path, host_dir / "project", "sh", "-c", "echo ran > ran", policy=policy,
                        extra=["--add-dir", str(host_dir / "extra")])
    if refused:
        assert result.returncode == 125, result.stderr
        assert f"egress: the secret 'token' is read from {token}, which the command could change" in result.stderr
        assert "nothing ran" in result.stderr and not (host_dir / "project" / "ran").exists()
    else:
        assert result.returncode == 0, result.stderr
        assert (host_dir / "project" / "ran").read_text() == "ran\n"


def test_shared_memory_is_private(tmp_path):
    marker = f"egress-run-shm-{os.getpid()}"
    try:
        result = egress_run(tmp_path, tmp_path / "project", "sh", "-c", f"ls /dev/shm; touch /dev/shm/{marker}")
        assert result.returncode == 0, result.stderr
        assert not os.path.exists(f"/dev/shm/{marker}")
    finally:
        if os.path.exists(f"/dev/shm/{marker}"):
            os.unlink(f"/dev/shm/{marker}")
    assert shutil.which("sh")


def test_egress_code_inside_the_project_stays_out_of_the_commands_reach(tmp_path, http_upstream):
    # egress installed inside the project (a venv in it, an editable checkout): its proxy imports
    # most of its code only when the command first connects, so rewriting that code first would
    # run the command's code outside the sandbox. A copy of egress inside the project stands in.
    project = tmp_path / "project"
    lib = project / "lib"
    lib.mkdir(parents=True)
    for part in ("egress", "sandbox", "policies"):
        shutil.copytree(os.path.join(os.getcwd(), part), lib / part, ignore=shutil.ignore_patterns("__pycache__"))
    guard = lib / "egress" / "proxy" / "addons" / "policy_guard.py"
    before = guard.read_text()
    (project / "policy.toml").write_text('allow_private = ["allowed.test"]\nallow = ["allowed.test"]\n')
    script = (f'mv lib lib-moved 2>/dev/null || echo kept; echo "raise SystemExit" >> {guard} || echo refused; '
              f'curl -sS {http_upstream.url("allowed.test")}')
    result = subprocess.run([sys.executable, "-m", "egress.cli", "run", "--policy", "policy.toml",
                             "--state-dir", str(tmp_path / "state"), "--resolve", "allowed.test:127.0.0.1",
                             "--", "sh", "-c", script],
                            capture_output=True, text=True, timeout=120, cwd=project,
                            env=clean_env(tmp_path, PYTHONPATH=str(lib)))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "kept\nrefused\nhello from upstream\n"  # the proxy still starts, from untouched code
    assert guard.read_text() == before
    assert "egress's own code lies in a folder the command can write" in result.stderr


def test_a_venv_in_the_project_that_runs_egress_stays_as_it_was(tmp_path, http_upstream):
    # The review edited the venv's pyvenv.cfg (`home = <project>/evil/bin`): the user's next
    # `egress` ran the command's Python outside any sandbox. The interpreter's own tree is
    # read-only inside when egress runs from it.
    import sysconfig

    project = tmp_path / "project"
    project.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(project / ".venv")], check=True,
                   capture_output=True)
    python = project / ".venv" / "bin" / "python"
    cfg = project / ".venv" / "pyvenv.cfg"
    before = cfg.read_text()
    site = sysconfig.get_paths()["purelib"]  # where this suite's mitmproxy lives
    script = f"echo 'home = {project}/evil/bin' >> .venv/pyvenv.cfg || echo refused; touch .venv/x || echo refused"
    result = subprocess.run([str(python), "-m", "egress.cli", "run", "--state-dir", str(tmp_path / "state"),
                             "--", "sh", "-c", script], capture_output=True, text=True, timeout=120, cwd=project,
                            env=clean_env(tmp_path, PYTHONPATH=f"{os.getcwd()}:{site}"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "refused\nrefused\n"
    assert cfg.read_text() == before


def test_report_lines_reach_a_terminal_the_command_took_over(tmp_path, http_upstream):
    # The command takes the terminal's foreground with TOSTOP set: egress, now in the
    # background, used to be stopped by SIGTTOU on its report line (hidden; the run hung).
    master, slave = pty.openpty()
    project = tmp_path / "project"
    project.mkdir()
    script = textwrap.dedent(f"""
        import os, signal, termios, urllib.request
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        attrs = termios.tcgetattr(0)
        attrs[3] |= termios.TOSTOP
        termios.tcsetattr(0, termios.TCSANOW, attrs)
        os.setpgid(0, 0)
        os.tcsetpgrp(0, os.getpgrp())
        try:
            urllib.request.urlopen({http_upstream.url("blocked.test")!r}, timeout=30)
        except Exception as e:
            print("refused", getattr(e, "code", e))
    """)
    try:
        seen, status = on_terminal(master, slave, run_args(tmp_path, project, sys.executable, "-c", script,
                                                            extra=["--headless"]), project, tmp_path)
        tostop = termios.tcgetattr(slave)[3] & termios.TOSTOP
    finally:
        os.close(master)
        os.close(slave)
    assert status == 0, seen
    assert b"refused 403" in seen
    assert b"EGRESS_BLOCKED blocked.test (not on the allow list)" in seen
    assert not tostop  # the terminal's modes are put back as they were


def test_report_lines_in_a_log_file_cannot_be_erased(tmp_path, http_upstream):
    # With stderr a file, the command shared its open description: ftruncate(2, 0) erased
    # egress's lines. Now it writes through a pipe egress copies from.
    log = tmp_path / "err.log"
    project = tmp_path / "project"
    project.mkdir()
    script = textwrap.dedent(f"""
        import os, sys, time, urllib.request
        try:
            urllib.request.urlopen({http_upstream.url("blocked.test")!r}, timeout=30)
        except Exception:
            pass
        time.sleep(0.5)
        try:
            os.ftruncate(2, 0)
            print("truncated", file=sys.stderr)
        except OSError:
            print("cannot truncate", file=sys.stderr)
    """)
    with open(log, "wb") as err:
        done = subprocess.run(run_args(tmp_path, project, sys.executable, "-c", script), stderr=err,
                              stdout=subprocess.PIPE, cwd=project, timeout=120,
                              env=clean_env(tmp_path, PYTHONPATH=os.getcwd()))
    text = log.read_text()
    assert done.returncode == 0, text
    assert "EGRESS_BLOCKED blocked.test (not on the allow list)" in text
    assert "cannot truncate" in text


def test_an_audit_log_in_the_project_is_out_of_the_commands_reach(tmp_path, http_upstream):
    project = tmp_path / "project"
    project.mkdir()
    forged = '{"decision": "allow", "host": "forged.test"}'
    script = (f"curl -s -o /dev/null {http_upstream.url('blocked.test')}; "
              f"true > audit.jsonl 2>/dev/null || echo kept; echo '{forged}' >> audit.jsonl 2>/dev/null || echo kept")
    result = egress_run(tmp_path, project, "sh", "-c", script, extra=["--audit-log", "audit.jsonl"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "kept\nkept\n"
    events = [json.loads(line) for line in (project / "audit.jsonl").read_text().splitlines()]
    assert any(e["host"] == "blocked.test" and e["decision"] == "block" for e in events)
    assert not any(e["host"] == "forged.test" for e in events)


# ------------------------------------------------ egress's lines on a terminal the command set up

# What the red team's N12 left before a refused request: the default foreground and background
# set to one colour (OSC 10/11), so that egress's line, in the default colours after its SGR
# reset, was drawn in the background's colour; and here also concealed text, a hyperlink left
# open, insert mode and an unfinished title that would take the next text in.
CONCEALING = ("\x1b]10;#000000\x07\x1b]11;#000000\x07\x1b[8m\x1b]8;;https://evil.test/\x1b\\\x1b[4h"
              "\x1b]0;unfinished-title")


def test_egress_lines_on_a_terminal_are_drawn_after_the_commands_colours_are_undone(tmp_path, http_upstream):
    from egress.observe.terminal import RESET

    master, slave = pty.openpty()
    project = tmp_path / "project"
    project.mkdir()
    script = textwrap.dedent(f"""
        import os, urllib.request
        os.write(2, {CONCEALING.encode()!r})
        try:
            urllib.request.urlopen({http_upstream.url("blocked.test")!r}, timeout=30)
        except Exception as e:
            pass
    """)
    args = run_args(tmp_path, project, sys.executable, "-c", script, extra=["--headless"])
    try:
        seen, status = on_terminal(master, slave, args, project, tmp_path, TERM="xterm-256color")
    finally:
        os.close(master)
        os.close(slave)
    assert status == 0, seen
    concealed = seen.index(CONCEALING.encode())  # the command's bytes reached the terminal as written
    line = seen.index(b"EGRESS_BLOCKED blocked.test (not on the allow list)")
    between = seen[concealed + len(CONCEALING):line]
    # egress's line comes right behind its whole reset: the title cancelled, no link, the
    # default colours as the terminal is configured, nothing concealed, replace mode
    assert between.endswith(RESET.encode()), between
    for undo in (b"\x18", b"\x1b]8;;\x1b\\", b"\x1b]110\x1b\\", b"\x1b]111\x1b\\", b"\x1b[0m", b"\x1b[4l"):
        assert undo in between, (undo, between)


# ------------------------------------------------- a file outside the project with a name inside it

def test_a_policy_file_hard_linked_into_the_project_is_read_once(tmp_path, http_upstream, curl_path):
    # Red team N11: `--policy /outside/p.toml` with `ln /outside/p.toml project/p.toml`: the command
    # rewrote it through the link, egress reloaded it and other.test went 403 -> 200.
    from egress.host.live import POLL_SECONDS

    project = tmp_path / "project"
    project.mkdir()
    opened = 'allow = ["other.test"]\nallow_private = ["other.test"]\n'
    status = 'curl -s -o /dev/null -w "%{http_code}\\n"'
    script = (f"{status} {http_upstream.url('blocked.test')}; "  # the first connection: the proxy and its watcher start
              f"printf '{opened}' > linked.toml; sleep {2 * POLL_SECONDS + 0.5}; "  # past the watcher's next look
              f"{status} {http_upstream.url('other.test')}")
    args = run_args(tmp_path, project, "sh", "-c", script, policy='allow_private = ["other.test"]\n')
    os.link(tmp_path / "policy.toml", project / "linked.toml")
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=project,
                            env=clean_env(tmp_path, PYTHONPATH=os.getcwd()))
    assert result.stdout.split() == ["403", "403"], result.stderr
    assert "EGRESS_BLOCKED other.test (not on the allow list)" in result.stderr
    assert (tmp_path / "policy.toml").read_text() == opened  # the edit went through the link
    assert f"{tmp_path / 'policy.toml'} changed, but the command can write it" in result.stderr
    assert http_upstream.connections == 0


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "unbound"])
def test_a_secret_file_with_a_hard_link_in_the_project_stops_the_run(tmp_path, host_dir, bound):
    token = _place(host_dir / "outside" / "token")
    (host_dir / "project").mkdir()
    os.link(token, host_dir / "project" / "token-link")
    hosts = 'hosts = ["allowed.test"]\n' if bound else ""
    policy = POLICY + f'[[credentials.secret]]\nfile = "{token}"\n{hosts}'
    result = egress_run(tmp_path, host_dir / "project", "sh", "-c", "echo ran > ran", policy=policy)
    assert result.returncode == 125, result.stderr
    assert f"egress: the secret 'token' is read from {token}, which the command could change" in result.stderr
    assert not (host_dir / "project" / "ran").exists()


# ----------------------------------------------------------------- --redact against a disguised token

TOKEN = "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"


def _no_piece_of(token: str, output: str) -> bool:
    return not any(token[i:i + 8] in output for i in range(len(token) - 7))


def test_redact_sees_a_token_through_escape_codes_backspaces_and_invisible_characters(tmp_path):
    # Red team N8: an SGR reset inside the token; the terminal (or a harness that strips escape
    # codes) shows it whole. Also an OSC title, X-backspace, a carriage return, U+200B and U+00AD.
    half, rest = TOKEN[:20], TOKEN[20:]
    noises = ["\\033[0m", "\\033]0;title\\007", "X\\b", "\\r", "\\342\\200\\213", "\\302\\255"]
    script = "".join(f"printf 'tok {half}{noise}{rest} end\\n'; " for noise in noises)
    result = egress_run(tmp_path, tmp_path / "project", "sh", "-c", script, extra=["--redact", "--network", "off"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "tok [redacted:github-token] end\n" * len(noises)
    assert _no_piece_of(TOKEN, result.stdout + result.stderr)


def _run_to_one_pipe(tmp_path, *command, extra=()):
    """egress run with its stdout and stderr the same pipe (2>&1), as a harness reading one stream."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    return subprocess.run(run_args(tmp_path, project, *command, extra=["--network", "off", *extra]),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, cwd=project,
                          env=clean_env(tmp_path, PYTHONPATH=os.getcwd()))


def test_redact_sees_a_token_split_over_stdout_and_stderr_that_go_to_one_place(tmp_path):
    # Red team N8: the first half on stdout, the second on stderr: both were printed. Where the two
    # streams reach one place, the command now writes them into one pipe, in the order it wrote.
    script = f"printf 'tok {TOKEN[:20]}'; sleep 0.3; printf '{TOKEN[20:]} end\\n' >&2; echo out; echo err >&2; echo out"
    result = _run_to_one_pipe(tmp_path, "sh", "-c", script, extra=["--redact"])
    assert result.returncode == 0, result.stdout
    assert result.stdout.endswith("tok [redacted:github-token] end\nout\nerr\nout\n"), result.stdout
    assert _no_piece_of(TOKEN, result.stdout)


def test_max_output_caps_stdout_and_stderr_that_go_to_one_place_together(tmp_path):
    script = "seq 100000; seq 100000 >&2"
    result = _run_to_one_pipe(tmp_path, "sh", "-c", script, extra=["--max-output", "1K"])
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("bytes elided by egress") == 1 and len(result.stdout) < 1024 + 100
    assert result.stdout.startswith("1\n2\n") and result.stdout.endswith("\n99999\n100000\n")


def test_streams_that_go_to_two_places_stay_two(tmp_path):
    script = "echo out; echo err >&2; echo out2"
    result = egress_run(tmp_path, tmp_path / "project", "sh", "-c", script, extra=["--redact", "--network", "off"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "out\nout2\n" and result.stderr.endswith("err\n")
