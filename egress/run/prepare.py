"""`egress run`'s preparation: what the plan needs made before its command can start.

    prepare(plan) -> Prepared     the run's private folder, the listener the command is told about,
                                  the proxy's builder opened and egress's CA (networked runs), the
                                  files the command's environment names, the output relay and
                                  the SandboxSpec; nothing runs yet

Everything made is held by the Prepared, whose close() undoes it (execute closes it when the run
ends; prepare itself when it fails halfway). The command never starts if a check here refuses:
a secret read from a file the command could change.
"""

from __future__ import annotations

import os
import sys

import egress
import sandbox
from egress.observe.terminal import say
from egress.proxy.ca import StateError, ensure_ca
from egress.run.options import LaunchError
from egress.run.plan import RunPlan
from egress.run.relay import Relay
from sandbox import environment
from sandbox.paths import command_writable, own_code
from sandbox.protected import later_run_paths

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from egress.proxy.build import ProxyBuilder
    from egress.run.relay import TerminalGuard
    from sandbox.api import Box, Listener
    from sandbox.spec import SandboxSpec


class Prepared:
    """What prepare() made for one run, held until it ends. Not a value: it owns the folder, the
    listener and the builder, and close() gives them back."""

    __slots__ = ("plan", "run_id", "tmpdir", "listener", "builder", "egress_ca", "ca_bundle", "files", "env",
                 "outputs", "own_code", "writable_anywhere", "absent", "spec")

    def __init__(self, plan: RunPlan, run_id: str, tmpdir: str):
        self.plan = plan
        self.run_id = run_id
        self.tmpdir = tmpdir  # the run's private folder: the command's TMPDIR, its sockets, the trust bundle
        self.listener: Listener | None = None  # where the proxy listens, as the command is told (until a box takes it)
        self.builder: ProxyBuilder | None = None  # networked runs: the proxy's, opened (no thread yet)
        self.egress_ca: str | None = None  # the CA's certificate (networked runs)
        self.ca_bundle: str | None = None  # the trust bundle the command is told about
        self.files: dict = {}  # the files the command's environment names: path -> text
        self.env: dict[str, str] = {}
        self.outputs: Relay | None = None  # the command's output, when egress copies it out
        self.own_code: list[str] = []  # egress's own folders the command could write: shown read-only
        self.writable_anywhere: list[str] = []  # every host folder the command can write
        self.absent: list[str] = []  # paths that run later, absent at the start (moved aside if made)
        self.spec: SandboxSpec | None = None

    def write_files(self) -> None:
        """The trust bundle (the upstream roots and egress's CA) and the clients' configuration
        files. Raises LaunchError."""
        if self.ca_bundle is not None:
            builder, egress_ca = self.builder, self.egress_ca
            assert builder is not None and builder.trust is not None and egress_ca is not None  # made with it
            try:
                environment.trust_bundle(builder.trust.roots, egress_ca, self.ca_bundle)
            except OSError as e:
                raise LaunchError(str(e)) from None
        environment.write_files(self.files)

    def close(self, box: Box | None = None, terminal: TerminalGuard | None = None) -> None:
        """Give back what the run made, with ``box`` and ``terminal`` (execute's), in this order: the
        proxy's builder (its last events delivered), the sandbox, the listener no box took, the
        terminal (once the command and its lines are done), the run's folder."""
        if self.builder is not None:
            self.builder.close()
        if box is not None:
            box.close()
        if self.listener is not None:  # no box took it
            self.listener.close()
        if terminal is not None:
            terminal.restore()
        _remove_tree(self.tmpdir)


def prepare(plan: RunPlan) -> Prepared:
    """Make what ``plan`` needs before its command starts (see the module). Raises LaunchError,
    having given back what it made."""
    run_id = os.urandom(6).hex()
    made = Prepared(plan, run_id, _private_folder(f"egress-run-{run_id}-"))
    try:
        listener = made.listener = listen(plan)
        if plan.networked:
            made.builder = open_builder(plan, listener)
            made.egress_ca = make_ca(plan)
            made.ca_bundle = os.path.join(made.tmpdir, "ca-bundle.pem")
        made.env = plan.environment(made.tmpdir, listener, made.ca_bundle, made.files)
        # Where the platform holds the command back until box.ready() (Linux), execute writes them
        # while its sandbox is made
        if not plan.platform.holds_until_ready:
            made.write_files()
        os.mkdir(os.path.join(made.tmpdir, "cache"))
        made.outputs = Relay.for_run(plan.options.redact, plan.credentials, plan.options.max_output or 0)
        writable = plan.writable(made.tmpdir)
        made.own_code = protect_own_code(writable)
        # a container's writable mounts too
        made.writable_anywhere = writable + list(plan.platform.writable_elsewhere())
        if not plan.options.allow_hooks:
            made.absent = later_run_absent([t for t in made.writable_anywhere if t != made.tmpdir])
        refusal = secret_file_refusal(plan.credentials, made.writable_anywhere, made.own_code)
        if refusal is not None:
            raise LaunchError(refusal)
        made.spec = plan.sandbox_spec(made.env, made.tmpdir, listener, made.own_code, made.outputs)
    except BaseException:
        made.close()
        raise
    return made


def listen(plan: RunPlan) -> Listener:
    """Where the proxy listens, as the command is told (the platform's listener). Raises LaunchError."""
    try:
        return plan.platform.listener(plan.networked)
    except OSError as e:
        raise LaunchError(f"cannot listen for the run's proxy: {e.strerror or e}") from None


def open_builder(plan: RunPlan, listener: Listener) -> ProxyBuilder:
    """The run's proxy builder (egress.proxy.build), asking for the listener's secret if it has one,
    opened: the upstream CAs, the audit log and the metrics port, before the command runs; no
    thread yet. Raises LaunchError."""
    from egress.proxy.build import BuildError, ProxyBuilder  # socket: not on a --network off run's path

    config = plan.options.proxy
    if listener.auth is not None:
        config = config._replace(auth=listener.auth)
    builder = ProxyBuilder(config)
    try:
        builder.open()
    except BuildError as e:
        raise LaunchError(str(e)) from None
    return builder


def make_ca(plan: RunPlan) -> str:
    """egress's CA (and the state folder), made before the sandbox: a folder it should hide that
    does not exist yet when its view is built is not hidden (its CA's key visible inside).
    Raises LaunchError."""
    try:
        return ensure_ca(plan.options.state_dir)
    except StateError as e:
        raise LaunchError(str(e)) from None


def protect_own_code(writable: list[str]) -> list[str]:
    """Folders of egress's own code inside writable trees, to be shown read-only to the command;
    sys.path entries that are (or hold) a writable tree are dropped (see sandbox.paths.own_code)."""
    package = os.path.dirname(egress.__file__)
    # The built-in policies: egress/policies when installed, a mapped folder when editable, or
    # policies/ beside the package in a source tree (egress.policy.builtin_dir's fallback).
    code = [package, os.path.dirname(sandbox.__file__), os.path.join(os.path.dirname(package), "policies"),
            # the interpreter's own trees: a venv's pyvenv.cfg names the Python the next egress runs
            sys.prefix, sys.exec_prefix, sys.base_prefix]
    code += _package_folders("egress.policies", egress.__path__)
    protect, drop = own_code(code, sys.path, writable)
    sys.path[:] = [entry for entry in sys.path if entry not in drop]
    if protect:
        say(f"egress: egress's own code lies in a folder the command can write; it stays read-only for "
            f"the command ({', '.join(protect)}). Install egress outside the project to lift this.")
    return protect


def _package_folders(name: str, parent_path) -> list[str]:
    """The folders package ``name`` would be imported from, as importlib.util.find_spec finds
    them (the module already imported, else the first finder on sys.meta_path that knows it),
    without importing importlib.util, which every `egress run` would pay for (b3840e1 measured it)."""
    module = sys.modules.get(name)
    if module is not None:
        return list(getattr(module, "__path__", None) or [])
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, parent_path) if find is not None else None
        if spec is not None:
            return list(spec.submodule_search_locations or [])
    return []


def later_run_absent(trees: list[str]) -> list[str]:
    """The paths that run later, outside the sandbox (sandbox/protected.py), missing at the start:
    what cannot be shown read-only, moved aside after the run if made (egress.run.execute.quarantine).
    A repository without a hooks folder gets an empty one (as `git init` makes it): shown read-only,
    it cannot be filled with hooks."""
    absent = []
    for tree in trees:
        for path in later_run_paths(tree):
            if os.path.lexists(path):
                continue
            if os.path.basename(path) == "hooks" and os.path.isdir(os.path.dirname(path)):
                try:
                    os.mkdir(path, 0o755)
                    continue
                except OSError:
                    pass
            absent.append(path)
    return absent


def secret_file_refusal(credentials, trees: list[str], read_only: list[str]) -> str | None:
    """Why the run must not start with a secret read from a file the command can change, or None.

    A red-team pass: with the file in the project, the command (which sees only a placeholder
    there) moved the folder holding it and left a decoy at the path; the next run read the decoy
    as the secret, no longer knew the real value, and the command read and sent the real file
    unmasked. An unbound secret's file the command can simply rewrite. So a secret file must lie
    where nothing the command can write is on its way (sandbox.paths.command_writable: the path,
    every folder and symlink resolving it steps on, and where it lands)."""
    if credentials is None:
        return None
    for secret in credentials.secrets:
        if secret.file is not None and command_writable(secret.file, trees, read_only):
            where = next((t for t in trees if command_writable(secret.file, [t], read_only)), trees[0])
            return (f"the secret {secret.label!r} is read from {secret.file}, which the command could change: it "
                    f"lies in, is reached through, or has another name in (a hard link, a bind mount) {where}, "
                    f"which the run can write. The command could "
                    f"move it and leave a decoy that the next run would take for the secret. Keep the file "
                    f"outside the folders the run writes (e.g. in ~/.config/egress/) and point file = \"...\" "
                    f"at it; nothing ran")
    return None


def _private_folder(prefix: str) -> str:
    """A new folder only we can use, as tempfile.mkdtemp makes it (0700, a name no one had), in
    the first usable of $TMPDIR, $TEMP, $TMP, /tmp, /var/tmp, /usr/tmp: `egress run` imports no
    tempfile, shutil nor random (bench/README.md, "Launcher")."""
    bases = [os.environ.get(name) for name in ("TMPDIR", "TEMP", "TMP")] + ["/tmp", "/var/tmp", "/usr/tmp"]
    error: OSError | None = None
    for base in filter(None, bases):
        for _ in range(16):
            path = os.path.join(os.path.abspath(base), prefix + os.urandom(6).hex())
            try:
                os.mkdir(path, 0o700)
                return path
            except FileExistsError:
                continue
            except OSError as e:  # not a folder, not ours to write: the next candidate
                error = e
                break
    raise LaunchError(f"cannot make the run's temporary folder: {error}")


def _remove_tree(root: str) -> None:
    """Remove the run's temporary folder and everything the command left in it, never following a
    symlink (everything in the sandbox has ended: nothing changes it meanwhile), without recursion
    (however deep the command nested folders); what cannot be removed stays, as with
    shutil.rmtree(ignore_errors=True), whose import the run is spared (bench/README.md, "Launcher")."""
    stack = [(root, False)]
    while stack:
        path, emptied = stack.pop()
        if emptied:
            try:
                os.rmdir(path)
            except OSError:
                pass
            continue
        stack.append((path, True))
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, False))
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
