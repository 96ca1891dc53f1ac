"""Files in a writable tree that run later, outside the sandbox: kept from the command by default.

A command confined to its project can still plant code that the user's next ordinary action
runs unconfined: a git hook (`git commit` runs `.git/hooks/pre-commit`), a `.git/config` that
names a program (`core.hooksPath`, `core.fsmonitor`, filter and diff drivers, `!` aliases,
`core.sshCommand`), a `.gitmodules` for the next `git submodule update`, an editor's folder
(VS Code's `tasks.json` with `runOn: folderOpen`, JetBrains' run configurations, an agent's
`.claude/settings.json` hooks and `.mcp.json` servers, which start commands), direnv's
`.envrc` (sourced by the user's shell on `cd`). The strongest peers keep these read-only
inside; so does egress, at the top of each writable tree (the project, `--add-dir` folders):

* what exists when the run starts is shown read-only (a bind of itself, sandbox/mounts.py);
  the folders on its way are pinned, so it cannot be moved away and replaced;
* what does not exist cannot be a mount point (that would mean creating it on the host), so
  if the command creates it, it is moved aside when the run ends (`quarantine`), into
  egress's state folder, and egress says so: nothing is lost, nothing runs;
* where `.git/config` says that hooks live elsewhere inside the tree (`core.hooksPath`), or
  includes another file inside it (`include.path`), those are protected too, and so are the
  hooks and config of each submodule under `.git/modules`, and each linked worktree's
  `commondir` and `config.worktree` (`.git/commondir`, made, would send git to a config of the
  command's: found by the macOS work of issue 25).

`egress run --allow-hooks` turns all of this off for a run. Pure path work and a small
reader of git's config syntax; no git is run (it may not be installed, and it would read
config the command wrote). The macOS profile (sandbox/seatbelt.py) denies the same paths,
existing or not: Seatbelt decides by name.
"""

from __future__ import annotations

import os

# Relative to the top of a writable tree. A folder covers everything below it.
LATER_RUN = (
    ".git/hooks",  # run by git itself
    ".git/config",  # names programs: hooksPath, fsmonitor, filters, diff drivers, aliases, sshCommand
    ".git/commondir",  # made, it sends git to another folder's config and hooks
    ".git/config.worktree",  # read as config where extensions.worktreeConfig is on
    ".gitmodules",  # the next `git submodule update`'s URLs and paths
    ".vscode",  # tasks (runOn: folderOpen), launch configurations, settings naming programs
    ".idea",  # JetBrains run configurations and startup tasks
    ".cursor",  # Cursor's rules and MCP servers (commands it starts)
    ".claude",  # Claude Code's settings: hooks are shell commands
    ".mcp.json",  # project MCP servers: commands an agent starts
    ".envrc",  # direnv: sourced by the user's shell on cd
)
# What a git config may say that points at more files to protect, relative to the repository.
_PATH_KEYS = {("core", "hookspath"), ("include", "path"), ("includeif", "path")}


def later_run_paths(tree: str) -> list[str]:
    """The absolute paths under ``tree`` whose contents run later, outside the sandbox: the fixed
    list, plus what the repository's config points at inside the tree, plus each submodule's
    hooks and config. Existing or not: the caller decides what to do with each."""
    tree = os.path.realpath(tree)
    found = [os.path.join(tree, name) for name in LATER_RUN]
    git_dir = _git_dir(tree)
    if git_dir is not None and git_dir != os.path.join(tree, ".git"):
        found += [os.path.join(git_dir, "hooks"), os.path.join(git_dir, "config")]
    if git_dir is not None:
        modules = os.path.join(git_dir, "modules")
        found += [p for module in _module_dirs(modules) for p in (os.path.join(module, "hooks"),
                                                                   os.path.join(module, "config"))]
        found += _config_targets(os.path.join(git_dir, "config"), tree)
        # each linked worktree's own pointers and config (git worktree add)
        found += [os.path.join(git_dir, "worktrees", name, leaf) for name in _names(os.path.join(git_dir, "worktrees"))
                  for leaf in ("commondir", "config.worktree")]
    seen: list[str] = []
    for path in found:
        path = os.path.normpath(path)
        if _within(path, tree) and path != tree and path not in seen:
            seen.append(path)
    return seen


def _git_dir(tree: str) -> str | None:
    """The repository folder of ``tree``: `.git`, or where a `.git` file (a worktree or a
    submodule's checkout) points, if that lies inside the tree."""
    dot_git = os.path.join(tree, ".git")
    if os.path.isdir(dot_git) and not os.path.islink(dot_git):
        return dot_git
    try:
        with open(dot_git, encoding="utf-8", errors="replace") as f:
            first = f.readline().strip()
    except OSError:
        return None
    if not first.startswith("gitdir:"):
        return None
    target = os.path.normpath(os.path.join(tree, first[len("gitdir:"):].strip()))
    return target if os.path.isdir(target) else None


def _names(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))[:256]
    except OSError:
        return []


def _module_dirs(modules: str) -> list[str]:
    """Each submodule's repository under .git/modules (nested ones too: a module's own modules)."""
    found, pending = [], [modules]
    while pending and len(found) < 256:
        folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if os.path.isfile(os.path.join(entry.path, "HEAD")):
                found.append(entry.path)
                pending.append(os.path.join(entry.path, "modules"))
            else:
                pending.append(entry.path)  # a submodule named a/b lives at modules/a/b
    return found


def _config_targets(config: str, tree: str) -> list[str]:
    """Files and folders inside ``tree`` that the repository's config takes code or config from.

    A small reader of git's syntax (no `re`: `egress run` does not import it): `[section]` or
    `[section "sub"]` headers, `key = value` lines, `#` and `;` comments."""
    try:
        with open(config, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return []
    targets = []
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            header, _, line = line[1:].partition("]")
            section = header.strip().split(None, 1)[0].split(".", 1)[0].lower() if header.strip() else ""
            line = line.strip()
        key, equals, value = line.partition("=")
        if not equals or (section, key.strip().lower()) not in _PATH_KEYS:
            continue
        value = value.strip()
        if value.startswith('"') and '"' in value[1:]:
            value = value[1:value.index('"', 1)]
        else:
            value = value.split("#", 1)[0].split(";", 1)[0].strip()
        if not value or value.startswith("~"):
            continue  # in the home folder: outside every writable tree unless it is one
        base = os.path.dirname(os.path.dirname(config)) if section == "core" else os.path.dirname(config)
        targets.append(os.path.normpath(os.path.join(base, value)))
    return targets


def _within(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")
