"""How the warm server starts (egress.run.warm.client.spawn): ``python -E -P [-s] warmboot.py MODULE EGRESS SANDBOX ARGS...``

Runs MODULE (egress.run.warm.server) with ARGS, importing only from the interpreter's own folders,
and `egress` and `sandbox` from the folders EGRESS and SANDBOX by name alone.

The warm server outlives the run that started it, holds the CA's key and forks every later
run's child: a module a sandboxed command can write must never be importable there. Each
launcher protects its own path (sandbox.paths.own_code: folders below the command's writable
trees are shown read-only, a folder that is or holds one is dropped from sys.path), but a server
shared by runs of every project cannot know which folders some run may write. Measured before:
the server's PYTHONPATH held egress's parent folder and the caller's PYTHONPATH, ahead of the
standard library, and a .pth file's folder (an editable install of the project, as hatch and
src-layout setuptools write them) stayed on its path; a command wrote argparse.py, or socks.py
(an optional import that fails in every server), into its project, and the next server ran it
outside the sandbox, and so did the server its own run had just started (its imports take ~2 s).

So: -E ignores PYTHONPATH, -P adds neither the working folder nor this file's, and here every
sys.path entry outside the interpreter's prefixes (and the user's site folder, which the
launcher has too unless -s) is dropped. Those prefixes are folders every launcher shows
read-only to its command where it could write them (egress.run.launcher.protect_own_code).
It also closes every descriptor the launcher passed on besides 0-2 (see main).
Imports only the standard library, before anything else is imported.
"""

import importlib.util
import os
import runpy
import site
import sys


def _own_folders() -> list[str]:
    roots = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    return [os.path.join(os.path.realpath(root), "") for root in roots]


def _kept(entry: str, roots: list[str]) -> bool:
    real = os.path.join(os.path.realpath(entry or "."), "")
    return entry != "" and any(real.startswith(root) for root in roots)


class _Packages:
    """Finds `egress` and `sandbox` where the launcher imported them from, and nothing else."""

    def __init__(self, homes: dict[str, str]):
        self.homes = homes

    def find_spec(self, name, path=None, target=None):
        home = self.homes.get(name)
        if home is None:
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(home, "__init__.py"),
                                                      submodule_search_locations=[home])


def main() -> None:
    # Nothing of the launcher that started us: posix_spawn passes on every descriptor it did not
    # mark close-on-exec (a shell's `5>&1`, a harness's pipes), and this process and every run's
    # child kept them. Measured: `{ egress run -- true; } 5>&1 | cat` waited out the server's idle
    # exit (600 s) when that run started the server. Only 0-2 are ours (egress.run.warm.client.spawn).
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    module, egress, sandbox = sys.argv[1:4]
    del sys.argv[1:4]
    roots = _own_folders()
    sys.path[:] = [entry for entry in sys.path if _kept(entry, roots)]
    sys.meta_path.insert(0, _Packages({"egress": egress, "sandbox": sandbox}))
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
