"""`egress doctor` on this machine, and with each mechanism made unavailable (EGRESS_DOCTOR_SIMULATE)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import clean_env, egress_command

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the doctor's sandbox checks are Linux's")


def doctor(tmp_path, *args: str, simulate: str = "") -> subprocess.CompletedProcess:
    env = clean_env(tmp_path, EGRESS_STATE_DIR=str(tmp_path / "state"))
    if simulate:
        env["EGRESS_DOCTOR_SIMULATE"] = simulate
    return subprocess.run([*egress_command(), "doctor", *args], capture_output=True, text=True, timeout=60, env=env)


def checks(result) -> dict[str, dict]:
    return {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}


def test_this_machine_confines_commands(tmp_path):
    probe = subprocess.run(["unshare", "-Urn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user+network namespaces are not available here")
    result = doctor(tmp_path, "--json")
    rows = checks(result)
    assert result.returncode == 0, result.stdout
    assert rows["network namespace"]["status"] == "ok"
    assert "only lo" in rows["network namespace"]["detail"]
    assert rows["landlock"]["status"] == "ok" and "Landlock ABI" in rows["landlock"]["detail"]
    # Each wall of issue 8 is tried from inside a real sandbox, not inferred from versions.
    for wall in ("tty injection", "host files", "unix sockets", "egress state", "shared memory", "capabilities"):
        assert rows[wall]["status"] == "ok", rows[wall]
    assert "dev.tty.legacy_tiocsti" in rows["tty injection"]["detail"]
    assert rows["local"]["status"] == "warning" and "not a sandbox" in rows["local"]["detail"]
    assert rows["proxy CA"]["status"] == "warning"  # a fresh state directory: no CA yet
    assert rows["policy"]["status"] == "ok"


def test_plain_output_never_says_isolated_for_local(tmp_path):
    result = doctor(tmp_path)
    local = next(line for line in result.stdout.splitlines() if " local " in line)
    assert "not a sandbox" in local and "isolated" not in local


@pytest.mark.parametrize("simulate, failing", [
    ("no-userns", "network namespace"),
    ("no-landlock", "landlock"),
    ("not-linux", "network namespace"),
])
def test_a_missing_mechanism_is_named_with_its_fix_and_fails(tmp_path, simulate, failing):
    result = doctor(tmp_path, "--json", simulate=simulate)
    rows = checks(result)
    assert result.returncode == 1
    assert rows[failing]["status"] == "unavailable"
    assert rows[failing]["fix"]
    text = doctor(tmp_path, simulate=simulate)
    assert "egress run cannot confine commands here" in text.stdout
    assert "fix:" in text.stdout


def test_no_fs_confinement_accepts_missing_landlock(tmp_path):
    assert doctor(tmp_path, "--no-fs-confinement", simulate="no-landlock").returncode == 0


def test_a_broken_policy_is_reported(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('allow = ["co.uk"]\n')
    result = doctor(tmp_path, "--json", "--policy", str(bad))
    assert result.returncode == 1
    assert "public suffix" in checks(result)["policy"]["detail"]


# `egress doctor` as Windows runs it: sys.platform is "win32" before egress is imported, and what
# CPython on Windows lacks is missing: the POSIX-only modules cannot be imported and the POSIX-only
# functions of os, socket and signal are gone. click is imported first, as itself: it supports
# Windows through msvcrt, which this Linux lacks. This proves that the doctor's path for a
# system without an OS sandbox (sandbox/platforms.py's Unsupported) needs none of them and ends
# with what is missing, not a traceback; it does not prove anything about Windows' paths or
# console, which only a Windows machine shows.
AS_WINDOWS = """
import importlib.abc, os, signal, socket, sys
import click

POSIX_ONLY = {"fcntl", "termios", "pwd", "grp", "resource", "pty", "tty", "syslog", "posix", "_posixsubprocess",
              "_posixshmem", "readline", "crypt", "spwd", "nis"}

class NoPosix(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in POSIX_ONLY:
            raise ModuleNotFoundError(f"No module named {name!r} (as on Windows)", name=name)

for name in list(sys.modules):
    if name.split(".")[0] in POSIX_ONLY - {"posix"}:
        del sys.modules[name]
sys.meta_path.insert(0, NoPosix())
for module, names in ((os, "fork geteuid getuid getegid getgid getpgrp getpgid setpgid killpg setsid tcgetpgrp "
                           "tcsetpgrp pidfd_open getloadavg"),
                      (socket, "AF_UNIX"), (signal, "SIGKILL SIGSTOP SIGCONT SIGTTOU SIGHUP SIGQUIT SIGUSR1")):
    for attribute in names.split():
        if hasattr(module, attribute):
            delattr(module, attribute)
sys.platform = "win32"
from egress.entry import main
main(sys.argv[1:])
"""


def test_on_windows_doctor_says_what_is_missing_without_a_traceback(tmp_path):
    env = clean_env(tmp_path, EGRESS_STATE_DIR=str(tmp_path / "state"))
    as_json = subprocess.run([sys.executable, "-c", AS_WINDOWS, "doctor", "--json"], capture_output=True, text=True,
                             timeout=60, env=env)
    assert "Traceback" not in as_json.stderr, as_json.stderr
    assert as_json.returncode == 1
    rows = checks(as_json)
    assert rows["os sandbox"]["status"] == "unavailable"
    assert rows["os sandbox"]["detail"].startswith("egress run cannot enforce the allowlist on Windows")
    assert "egress serve" in rows["os sandbox"]["fix"]
    assert rows["local"]["status"] == "warning" and rows["policy"]["status"] == "ok"
    assert "warm proxy" not in rows  # Linux's: nothing to say here
    plain = subprocess.run([sys.executable, "-c", AS_WINDOWS, "doctor"], capture_output=True, text=True, timeout=60,
                           env=env)
    assert "Traceback" not in plain.stderr, plain.stderr
    assert plain.returncode == 1
    assert "egress run cannot confine commands here" in plain.stdout
