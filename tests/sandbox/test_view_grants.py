"""sandbox/grants.py: what the Linux sandbox's view shows, by name (issue 25 item 3)."""

from __future__ import annotations

import os

from sandbox import grants


def _tree(tmp_path, *names):
    for name in names:
        (tmp_path / name).mkdir(parents=True, exist_ok=True)


def test_home_toolchains_and_config_are_shown_and_the_rest_of_home_is_not(tmp_path):
    home = tmp_path / "home"
    _tree(home, ".pyenv/shims", ".cargo/bin", ".rustup", ".ssh", ".aws", "notes", ".config/git")
    (home / ".gitconfig").write_text("[user]\n")
    shown = grants.granted({"HOME": str(home), "PATH": "/usr/bin"})
    for name in (".pyenv", ".cargo", ".rustup", ".gitconfig", ".config/git"):
        assert str(home / name) in shown, name
    for name in (".ssh", ".aws", "notes", ""):
        assert os.path.normpath(str(home / name)) not in shown, name
    assert "/usr" in shown and "/etc" in shown


def test_path_and_toolchain_variables_never_show_the_home_folder_or_above(tmp_path):
    home = tmp_path / "home"
    _tree(home, "bin", "mytools")
    _tree(tmp_path, "elsewhere/.pyenv/shims", "rustup")
    env = {"HOME": str(home), "PATH": f"{home}:{tmp_path}:/:{home}/bin:{tmp_path}/elsewhere/.pyenv/shims:relative",
           "RUSTUP_HOME": str(tmp_path / "rustup"), "GOPATH": str(home), "JAVA_HOME": "/"}
    shown = grants.granted(env)
    assert str(home / "bin") in shown  # a folder of programs on PATH
    assert str(tmp_path / "elsewhere" / ".pyenv") in shown  # the shims' manager, with what they run
    assert str(tmp_path / "rustup") in shown
    for never in (str(home), str(tmp_path), "/", "relative"):
        assert never not in shown, never


def test_a_link_to_the_root_is_not_granted(tmp_path):
    (tmp_path / "root-link").symlink_to("/")
    assert str(tmp_path / "root-link") not in grants.granted({"PATH": str(tmp_path / "root-link")})


def test_cargo_credentials_are_shown_empty_wherever_cargo_lives(tmp_path):
    home, cargo = tmp_path / "home", tmp_path / "cargo"
    _tree(home, ".cargo")
    _tree(tmp_path, "cargo")
    (home / ".cargo" / "credentials.toml").write_text("token")
    (cargo / "credentials").write_text("token")
    assert sorted(grants.hidden_files({"HOME": str(home), "CARGO_HOME": str(cargo)})) == sorted(
        [str(home / ".cargo" / "credentials.toml"), str(cargo / "credentials")])
