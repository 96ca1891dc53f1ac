"""Real tools still work unchanged inside the allow-list view of `egress run` (issue 25 item 3).

The command's filesystem holds only what is granted (sandbox/grants.py): system folders, the
toolchains of the home folder, PATH's folders, the project. This is the compatibility matrix
that decided the grants: each tool does a small real job, offline (`--network off`), with the
user's own HOME and PATH, as a person would run it. A tool this machine lacks is skipped by name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import egress_command

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")


def _wheel(folder: Path) -> Path:
    """A pure-Python wheel made by hand (no network, no build backend): pip installs it offline."""
    path = folder / "demo-1-py3-none-any.whl"
    files = {"demo/__init__.py": "def hi():\n    return 'pip ok'\n",
             "demo-1.dist-info/METADATA": "Metadata-Version: 2.1\nName: demo\nVersion: 1\n",
             "demo-1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files["demo-1.dist-info/RECORD"] = "".join(f"{name},,\n" for name in files) + "demo-1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


# (tool the job needs, shell job run in the project, what it prints when it worked)
JOBS = {
    "git": ("git", "git init -q r && cd r && echo a > a && git add a && git -c user.name=t -c user.email=t@e "
                   "commit -qm a && git log --format=%s", "a"),
    "python venv and pip": ("python3", "python3 -m venv v && v/bin/pip install -q --no-index {wheel} && "
                                       "v/bin/python -c 'import demo; print(demo.hi())'", "pip ok"),
    "node": ("node", "node -e \"require('fs').writeFileSync('n.txt', 'node ok'); console.log(require('fs')"
                     ".readFileSync('n.txt', 'utf8'))\"", "node ok"),
    "npm": ("npm", "mkdir p && cd p && npm init -y >/dev/null && npm pack --silent >/dev/null && ls *.tgz",
            "p-1.0.0.tgz"),
    "make and cc": ("make", "printf '#include <stdio.h>\\nint main(void){puts(\"cc ok\");return 0;}\\n' > h.c && "
                            "printf 'h: h.c\\n\\tcc -o h h.c\\n' > Makefile && make -s && ./h", "cc ok"),
    "cargo": ("cargo", "cargo new -q --offline hello && cd hello && cargo build -q --offline && ./target/debug/hello",
              "Hello, world!"),
    "go": ("go", "mkdir g && cd g && go mod init example.invalid/g >/dev/null 2>&1 && printf 'package main\\n"
                 "import \"fmt\"\\nfunc main() { fmt.Println(\"go ok\") }\\n' > m.go && go run .", "go ok"),
    "curl": ("curl", "echo curl-ok > f && curl -sS file://$PWD/f", "curl-ok"),
}


@pytest.mark.parametrize("job", list(JOBS))
def test_a_real_tool_works_unchanged(tmp_path, job):
    tool, script, expected = JOBS[job]
    if shutil.which(tool) is None or (job == "make and cc" and shutil.which("cc") is None):
        pytest.skip(f"{tool} is not installed")
    project = tmp_path / "project"
    project.mkdir()
    script = script.replace("{wheel}", str(_wheel(project)))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), "LANG": "C.UTF-8",
           "PYTHONPATH": os.getcwd()}
    for name in ("RUSTUP_HOME", "CARGO_HOME", "GOROOT", "GOPATH"):
        if name in os.environ:
            env[name] = os.environ[name]
    done = subprocess.run([*egress_command(), "run", "--network", "off", "--headless", "--state-dir",
                           str(tmp_path / "state"), "--", "sh", "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=project, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == expected, done.stdout + done.stderr
