"""What the Linux sandbox shows the command: an allow list of folders, everything else absent.

The first two reviews found host Unix sockets the sandbox had not listed: bound in another
network or mount namespace (a container's, another run's), renamed into another folder after
bind. No list of sockets can be complete, since another namespace's are invisible from this
one, and no kernel this generation has a Landlock right for connecting to one. So the command's
filesystem is built the other way round (sandbox/mounts.py `build_granted_view`): an empty
root, and only the folders granted here bound into it, read-only, plus the writable trees.
A socket anywhere else (/srv, /var/lib, /home, /mnt, other users' folders, the rest of your
home) is not there to connect to. The sockets that lie inside a granted folder when the run
starts are still covered one by one (mounts.host_sockets), as before.

Granted, by name:
* SYSTEM: the folders programs, libraries and their configuration live in (no user data);
* in the caller's home, TOOLCHAINS that exist (language runtimes and version managers, which
  hold no secrets; `~/.cargo`'s credentials files are shown empty, see HIDDEN_FILES) and
  CONFIG files tools read to behave as the user set them up (git's identity, pip's index);
* each folder on the command's PATH, and each toolchain home its variables name (RUSTUP_HOME,
  GOROOT, JAVA_HOME, ...): never the home folder itself or anything above it;
* what the launcher adds: the project, `--add-dir` and `--read` folders, the caller's Python.

Pure path work on the caller's side (a few dozen stat calls): no mounts here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/sys", "/nix",
          "/snap",
          # dpkg's and apt's databases: `dpkg -l`, `apt-get download` and pip's distro checks read them
          "/var/lib/dpkg", "/var/lib/apt", "/var/cache/apt", "/var/lib/ca-certificates")
# Empty folders every program expects to exist (read-only, except where a writable tree lies).
EMPTY = ("/tmp", "/var/tmp", "/run", "/home", "/mnt", "/srv", "/media", "/root")
LINKS = ("/var/run",)  # kept as the links they are (to /run): an empty /run
# Runtimes and version managers under the home folder (the roots, with what their shims run).
TOOLCHAINS = (".pyenv", ".rbenv", ".nodenv", ".goenv", ".jenv", ".nvm", ".volta", ".asdf", ".rustup", ".cargo",
              "go", ".bun", ".deno", ".sdkman", ".gvm", ".juliaup", ".ghcup", ".elan", ".opam", ".dotnet",
              ".local/bin", ".local/lib", ".local/share/mise", ".local/share/fnm", ".local/share/uv",
              ".local/share/pnpm")
# Variables that name a toolchain's home wherever it is (a fake HOME in CI, a shared install).
TOOLCHAIN_VARIABLES = ("RUSTUP_HOME", "CARGO_HOME", "GOROOT", "GOPATH", "PYENV_ROOT", "RBENV_ROOT", "NVM_DIR",
                       "VOLTA_HOME", "ASDF_DATA_DIR", "ASDF_DIR", "SDKMAN_DIR", "JAVA_HOME", "BUN_INSTALL",
                       "DENO_INSTALL", "MISE_DATA_DIR", "PNPM_HOME", "UV_PYTHON_INSTALL_DIR")
# Configuration tools read to behave as the user set them up. No tokens are expected here,
# and egress's proxy refuses the known formats if one is sent; `--read` adds more.
CONFIG = (".gitconfig", ".config/git", ".config/pip", ".pip", ".gitignore_global", ".inputrc")
# Shown empty inside a granted toolchain: its own credentials.
HIDDEN_FILES = (".cargo/credentials", ".cargo/credentials.toml")


def granted(env: Mapping[str, str], extra: Iterable[str] = ()) -> list[str]:
    """The folders (and files) to show read-only, existing ones only, each once, as named (the
    view recreates the symlinks on their way: /bin -> usr/bin)."""
    home = env.get("HOME") or ""
    paths = list(SYSTEM)
    if home.startswith("/") and home != "/":
        paths += [os.path.join(home, name) for name in (*TOOLCHAINS, *CONFIG)]
    paths += [env[name] for name in TOOLCHAIN_VARIABLES if env.get(name, "").startswith("/")
              and not _above_or_at(env[name], home)]
    roots = {os.path.basename(name) for name in TOOLCHAINS}
    for entry in env.get("PATH", "").split(":"):
        if entry.startswith("/") and not _above_or_at(entry, home):
            paths.append(entry)
            # a version manager's shims or bin run what lies beside them (pyenv's libexec, versions)
            parent = os.path.dirname(entry.rstrip("/"))
            if os.path.basename(parent) in roots and not _above_or_at(parent, home):
                paths.append(parent)
    paths += list(extra)
    root = os.stat("/")
    shown: list[str] = []
    for path in paths:
        try:
            found = os.stat(path)
        except (OSError, ValueError):
            continue
        # never the whole root (a PATH entry that is a link to /): compared by inode, not realpath (~10x the cost)
        if (found.st_dev, found.st_ino) != (root.st_dev, root.st_ino) and path not in shown:
            shown.append(path)
    return shown


def hidden_files(env: Mapping[str, str]) -> list[str]:
    """Files in granted toolchains that are shown empty (their credentials), in the home folder's
    and where CARGO_HOME says."""
    found = []
    for home, names in ((env.get("HOME") or "", HIDDEN_FILES),
                        (env.get("CARGO_HOME") or "", [n.split("/", 1)[1] for n in HIDDEN_FILES])):
        if home.startswith("/"):
            found += [p for p in (os.path.join(home, name) for name in names) if os.path.isfile(p)]
    return found


def _above_or_at(path: str, home: str) -> bool:
    """``path`` is the home folder or one of its parents (granting it would show the whole home)."""
    path = os.path.normpath(path)
    if not home:
        return path == "/"
    home = os.path.normpath(home)
    return path == home or home.startswith(path.rstrip("/") + "/")
