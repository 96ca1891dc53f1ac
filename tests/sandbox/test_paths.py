"""sandbox.paths.command_writable on real files and symlinks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandbox.paths import MAX_LINK_HOPS, command_writable


@pytest.fixture
def layout(tmp_path):
    """project/ (the command's) and outside/ (not), with links between them."""
    project, outside = tmp_path / "project", tmp_path / "outside"
    (project / "sub").mkdir(parents=True)
    (outside / "sub").mkdir(parents=True)
    (project / "egress.toml").write_text("")
    (outside / "policy.toml").write_text("")
    os.symlink(outside / "policy.toml", project / "out-link")      # lives in the project, points out
    os.symlink(project / "egress.toml", outside / "in-link")       # lives outside, points in
    os.symlink("../project/middle", outside / "first")             # outside -> project -> outside
    os.symlink(outside / "policy.toml", project / "middle")
    os.symlink("outside/policy.toml", tmp_path / "plain-link")     # outside -> outside
    os.symlink(project, tmp_path / "project-link")                 # a tree given as a symlink
    os.symlink("loop-b", outside / "loop-a")
    os.symlink("loop-a", outside / "loop-b")
    return tmp_path


WRITABLE = [
    # (path, writable trees, the command can change what the path reads)
    ("project/egress.toml", ["project"], True),
    ("outside/policy.toml", ["project"], False),
    ("project/out-link", ["project"], True),                 # the command can repoint the link
    ("outside/in-link", ["project"], True),                  # lands in the project
    ("outside/first", ["project"], True),                    # only the middle link is the command's
    ("plain-link", ["project"], False),
    ("project/../outside/policy.toml", ["project"], True),   # written through the project
    ("outside/../project/egress.toml", ["project"], True),
    ("outside/sub/../policy.toml", ["project"], False),
    ("project/sub/../../outside/policy.toml", ["project"], True),  # sub could become a link
    ("project/not-yet.toml", ["project"], True),             # missing files count by where they would be
    ("outside/not-yet.toml", ["project"], False),
    ("project/egress.toml", ["project-link"], True),         # the tree by its realpath
    ("project-link/egress.toml", ["project-link"], True),    # and as given
    ("project-link/egress.toml", ["project"], True),         # the link leads into the tree
    ("outside/policy.toml", ["project-link"], False),
    ("outside/policy.toml", ["project", "outside"], True),   # any tree counts (--add-dir)
    ("outside/policy.toml", [], False),
    ("outside/loop-a", ["project"], True),                   # cannot be followed: fails closed
]


@pytest.mark.parametrize("path, trees, expected", WRITABLE)
def test_command_writable(layout, path, trees, expected):
    assert command_writable(f"{layout}/{path}", [layout / tree for tree in trees]) is expected


def test_relative_paths_are_taken_from_the_current_folder(layout, monkeypatch):
    monkeypatch.chdir(layout / "outside")
    assert command_writable("in-link", ["../project"]) is True
    assert command_writable("policy.toml", ["../project"]) is False


def test_a_chain_longer_than_the_kernel_follows_fails_closed(tmp_path):
    (tmp_path / "policy.toml").write_text("")
    previous = "policy.toml"
    for number in range(MAX_LINK_HOPS + 1):
        os.symlink(previous, tmp_path / f"link{number}")
        previous = f"link{number}"
    assert command_writable(tmp_path / f"link{MAX_LINK_HOPS - 1}", [tmp_path / "project"]) is False
    assert command_writable(tmp_path / f"link{MAX_LINK_HOPS}", [tmp_path / "project"]) is True


def test_read_only_islands_are_not_the_commands(layout):
    (layout / "project" / "venv").mkdir()
    (layout / "project" / "venv" / "code.py").write_text("")
    trees, islands = [layout / "project"], [layout / "project" / "venv"]
    assert command_writable(f"{layout}/project/venv/code.py", trees, islands) is False
    assert command_writable(f"{layout}/project/egress.toml", trees, islands) is True
    # A link the command owns still leads wherever it likes, island or not.
    os.symlink(layout / "project" / "venv" / "code.py", layout / "project" / "to-venv")
    assert command_writable(f"{layout}/project/to-venv", trees, islands) is True


OWN_CODE = [
    # (code folders, import path, writable trees) -> (read-only inside, dropped from sys.path)
    (["site/egress"], ["site"], ["project"], [], []),                                   # installed elsewhere
    (["project/.venv/site/egress"], ["project/.venv/site"], ["project"],
     ["project/.venv/site"], []),                                                       # a venv in the project
    (["checkout/egress", "checkout/policies"], [""], ["checkout"], ["checkout/egress", "checkout/policies"], [""]),
    (["site/egress"], ["project", "site"], ["project"], [], ["project"]),               # python -m from the project
    (["site/egress"], ["work"], ["work/project"], [], ["work"]),                        # an entry holding the project
    (["project/.venv/lib/site/egress", "project/.venv"], ["project/.venv/lib/site"], ["project"],
     ["project/.venv"], []),                                                             # the venv's root covers all
    (["project"], [], ["project"], [], []),                                              # never the project itself
]


@pytest.mark.parametrize("code, import_path, trees, protected, dropped", OWN_CODE)
def test_own_code(tmp_path, monkeypatch, code, import_path, trees, protected, dropped):
    from sandbox.paths import own_code

    for folder in code + [p for p in import_path if p] + trees:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path / trees[0])  # "" on sys.path is the current folder
    got_protected, got_dropped = own_code([str(tmp_path / c) for c in code],
                                          [str(tmp_path / p) if p else "" for p in import_path],
                                          [str(tmp_path / t) for t in trees])
    assert got_protected == [str(tmp_path / p) for p in protected]
    assert got_dropped == [str(tmp_path / p) if p else "" for p in dropped]


# ------------------------------------------------------- the same file by another name (red team N11)


def test_a_file_with_another_name_counts_as_the_commands(layout):
    # A hard link in the project: the command edits the file outside through it. Where a file's
    # other names lie is not known without walking every tree, so any second name counts.
    os.link(layout / "outside" / "policy.toml", layout / "project" / "linked.toml")
    (layout / "outside" / "twice.toml").write_text("")
    os.link(layout / "outside" / "twice.toml", layout / "outside" / "sub" / "twice.toml")
    os.symlink(layout / "outside" / "policy.toml", layout / "outside" / "to-linked")
    trees = [layout / "project"]
    assert command_writable(layout / "outside" / "policy.toml", trees) is True
    assert command_writable(layout / "outside" / "to-linked", trees) is True  # a symlink to it outside
    assert command_writable(layout / "outside" / "twice.toml", trees) is True  # fails closed: both names outside
    (layout / "outside" / "single.toml").write_text("")
    assert command_writable(layout / "outside" / "single.toml", trees) is False
    (layout / "project" / "linked.toml").unlink()
    assert command_writable(layout / "outside" / "policy.toml", trees) is False  # one name again


MOUNTED = r"""
import json, subprocess, sys
from sandbox.paths import command_writable
base = sys.argv[1]
def bind(source, target):
    subprocess.run(["mount", "--bind", f"{base}/{source}", f"{base}/{target}"], check=True)
bind("outside/sub", "project/sub")                   # a folder from outside mounted in the project
bind("project", "outside/view")                      # the project mounted elsewhere
bind("outside/file.toml", "project/file-mount.toml")  # one file mounted in the project
trees, islands = [f"{base}/project"], [f"{base}/project/venv"]
print(json.dumps({path: command_writable(f"{base}/{path}", trees, islands) for path in sys.argv[2:]}))
"""


def test_a_file_mounted_into_a_writable_tree_or_reached_through_a_mount_of_one_is_the_commands(layout):
    # Bind mounts, made in a mount namespace of the test's own (a user namespace too: root or not).
    (layout / "outside" / "sub" / "policy.toml").write_text("")
    (layout / "outside" / "file.toml").write_text("")
    (layout / "outside" / "view").mkdir()
    (layout / "project" / "file-mount.toml").write_text("")
    (layout / "project" / "venv").mkdir()
    (layout / "project" / "venv" / "code.py").write_text("")
    expected = {
        "outside/sub/policy.toml": True,     # also project/sub/policy.toml
        "outside/view/egress.toml": True,    # project/egress.toml by another path
        "outside/view/venv/code.py": False,  # an island stays read-only by any name
        "outside/file.toml": True,           # mounted as project/file-mount.toml
        "outside/policy.toml": False,        # nothing of it in the project
    }
    result = subprocess.run(["unshare", "-Urm", sys.executable, "-c", MOUNTED, str(layout), *expected],
                            capture_output=True, text=True, cwd=os.getcwd(), timeout=60,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    if result.returncode != 0 and "unshare" in result.stderr:
        pytest.skip(f"no user and mount namespace to bind in: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == expected
