"""sandbox/protected.py: which files in a writable tree run later, outside the sandbox (issue 25 item 7)."""

from __future__ import annotations

import subprocess

import pytest

from sandbox.protected import LATER_RUN, later_run_paths


def test_the_fixed_list_is_found_without_a_repository(tmp_path):
    assert later_run_paths(str(tmp_path)) == [str(tmp_path / name) for name in LATER_RUN]


def test_what_the_repositorys_config_points_at_inside_the_tree_is_protected_too(tmp_path):
    git = tmp_path / ".git"
    (git / "modules" / "lib" / "nested").mkdir(parents=True)
    (git / "modules" / "lib" / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "worktrees" / "wt").mkdir(parents=True)
    (git / "config").write_text(
        '[core]\n\thooksPath = .husky ; hooks in the work tree\n'
        '[include]\n\tpath = ../shared.gitconfig\n'
        '[includeIf "gitdir:~/x/"]\n\tpath = "../inc 2.cfg"\n'
        '[include]\n\tpath = ~/elsewhere.cfg\n'  # the home folder: not this tree's
        '[core]\n\tHOOKSPATH = /outside/hooks\n')  # outside the tree
    found = later_run_paths(str(tmp_path))
    for name in (".husky", "shared.gitconfig", "inc 2.cfg", ".git/modules/lib/hooks", ".git/modules/lib/config",
                 ".git/worktrees/wt/commondir", ".git/worktrees/wt/config.worktree"):
        assert str(tmp_path / name) in found, name
    assert not any("elsewhere" in p or p.startswith("/outside") for p in found)


def test_a_git_file_points_at_the_repository(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / ".git").write_text("gitdir: ../repo\n")
    found = later_run_paths(str(tmp_path / "work"))
    assert str(tmp_path / "work" / ".git" / "hooks") in found  # the fixed names, as written
    # the repository it points at lies outside this tree: the tree's own list holds nothing of it
    assert not any(p.startswith(str(tmp_path / "repo")) for p in found)


def test_real_gits_config_is_read(tmp_path):
    try:
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "config", "core.hooksPath", "tools/hooks"], check=True)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    assert str(tmp_path / "tools" / "hooks") in later_run_paths(str(tmp_path))
