"""`egress run -- CMD`: the command in its own sandbox, the egress proxy its only road out.

    policy  ->  sandbox (netns with only lo, a listening socket inside, Landlock)  ->  command
                     \\-> the socket is handed to a ProxySession outside, started lazily

The sandbox is the platform's (sandbox/platforms.py: Linux namespaces and Landlock, macOS
Seatbelt; elsewhere egress run refuses); nothing here depends on which.

The launcher talks to the proxy only through egress.run.session.ProxySession: a socket
handed over and a stream of events (DESIGN: no mitmproxy internals here).

Exit statuses: the command's own; 124 when --timeout expired (everything killed);
125 when egress run itself failed before the command started (bad policy, missing
project folder, sandbox refused); 126 not executable; 127 not found.
"""

from __future__ import annotations

import errno
import os
import sys

from egress.core.contract import (
    DEFAULT_NETWORK,
    EXIT_LAUNCHER,
    EXIT_NOT_FOUND,
    EXIT_TIMEOUT,
    NETWORK_MODES,
    PROXY_MODE_ENV,
    PROXY_MODES,
)
from egress.observe.terminal import EventLines, say
from egress.policy.source import PolicySource
from egress.proxy.config import ProxyConfig
from egress.run.relay import (
    forward_signals,
    Relay,
    restore_signals,
    TerminalGuard,
    stdio_fds,
)

from sandbox import environment

# `egress run --agent` (or a policy's `profile = "agent"`): what an agent harness would otherwise
# set by hand. Each can still be set on its own (--timeout, --max-output 0, --ask tty).
# (It also turns on --headless, --redact and --guard-commands.)
AGENT_PROFILE = {"max_output": 256 * 1024, "timeout": 120.0}


class LaunchError(Exception):
    """egress run could not start the command; nothing ran."""

    def __init__(self, message: str, status: int = EXIT_LAUNCHER):
        self.status = status
        super().__init__(message)


class RunOptions:
    """What `egress run` was asked to do. A plain class: a dataclass's import and generated
    methods cost ~10 ms of a ~40 ms `egress run -- true`. Its folders (project, add_dirs, the
    proxy's state_dir) are str, as both parsers (egress.entry, click) give them, or made str
    from a caller's PathLike: `egress run` never imports pathlib, whose import (with urllib.parse,
    ipaddress, fnmatch and ntpath) cost ~4-5 ms of every run (bench/README.md, "Launch without
    pathlib and json")."""

    __slots__ = ("argv", "network", "policies", "allow", "deny", "project", "add_dirs", "timeout",
                 "fs_confinement", "proxy", "redact", "ask", "proxy_mode", "agent", "max_output", "guard_commands",
                 "provider", "image", "mounts", "persist", "read", "allow_hooks")

    def __init__(self, argv: list[str], network: str | None = None, policies: list[str] = (),
                 allow: list[str] = (), deny: list[str] = (), project: str | os.PathLike | None = None,
                 add_dirs: list[str | os.PathLike] = (), timeout: float | None = None, fs_confinement: bool = True,
                 proxy: ProxyConfig = ProxyConfig(), redact: bool = False, ask: str | None = None,
                 proxy_mode: str | None = None, agent: bool = False, max_output: int | None = None,
                 guard_commands: bool = False, provider: str | None = None, image: str | None = None,
                 mounts: list[str] = (), persist: list[str] = (), read: list[str | os.PathLike] = (),
                 allow_hooks: bool = False):
        self.argv = list(argv)
        self.network = network  # None: the policy files' `network` key, else "allowlist"
        self.policies = list(policies)
        self.allow = list(allow)
        self.deny = list(deny)
        self.project = os.getcwd() if project is None else os.fspath(project)
        self.add_dirs = [os.fspath(directory) for directory in add_dirs]
        self.timeout = timeout
        self.fs_confinement = fs_confinement
        # the run's proxy, as `egress serve` takes it (egress.proxy.build); it listens only on the sandbox's socket
        if proxy.state_dir is not None and not isinstance(proxy.state_dir, str):  # a caller's Path
            proxy = proxy._replace(state_dir=os.fspath(proxy.state_dir))
        self.proxy = proxy  # immutable: one default serves every RunOptions
        self.redact = redact  # the command's stdout and stderr pass through the secret redactor
        self.ask = ask  # "tty" | "never"; None: tty when egress run has a terminal
        self.proxy_mode = proxy_mode  # "warm" | "lazy"; None: $EGRESS_PROXY, else warm (egress.run.warm.client)
        self.agent = agent  # the agent profile (AGENT_PROFILE), as a policy's `profile = "agent"`
        self.max_output = max_output  # bytes per stream (0: no cap); None: the policy's, else the profile's
        self.guard_commands = guard_commands  # refuse commands on the deny list (egress.agent.commands)
        self.provider = provider  # sandbox/providers.py; None: the system's (namespace, seatbelt)
        self.image = image  # podman, docker: the image; None: the policy's [container] image
        self.mounts = list(mounts)  # podman, docker: "SRC:DST[:rw]", read-only unless :rw
        self.persist = list(persist)  # podman, docker: named volumes kept at /persist/NAME
        self.read = [os.fspath(path) for path in read]  # more folders and files shown read-only (sandbox/grants.py)
        self.allow_hooks = allow_hooks  # the files that run later (sandbox/protected.py) are the command's to change

    @property
    def state_dir(self) -> str | None:
        return self.proxy.state_dir

    def settled(self, user=None) -> RunOptions:
        """These options with the agent profile and the policy's guardrails applied: a flag given
        wins over the policy, which wins over the profile (AGENT_PROFILE)."""
        agent = self.agent or (user is not None and user.profile == "agent")
        rules = bool(user is not None and user.command_rules)
        policy_cap = user.max_output if user is not None else None
        if not (agent or rules or policy_cap is not None):
            return self
        made = RunOptions.__new__(RunOptions)
        for name in self.__slots__:
            setattr(made, name, getattr(self, name))
        made.agent = agent
        if self.max_output is None:
            made.max_output = policy_cap if policy_cap is not None else (
                AGENT_PROFILE["max_output"] if agent else None)
        # a policy that names commands to deny wants them denied, the built-in ones with them
        made.guard_commands = self.guard_commands or agent or (rules and any(
            rule.kind == "deny" for rule in user.command_rules))
        if agent:
            made.redact = True
            made.ask = self.ask or "never"
            if self.timeout is None:
                made.timeout = AGENT_PROFILE["timeout"]
        return made

    def _fields(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other) -> bool:
        return isinstance(other, RunOptions) and self._fields() == other._fields()

    def __repr__(self) -> str:
        return "RunOptions(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__) + ")"


def policy_source(options: RunOptions, mode: str | None = None, read=None) -> PolicySource:
    """The run's policy source (egress.policy.source): its files, --allow/--deny and network mode,
    read through ``read`` (the run's PolicySnapshot)."""
    return PolicySource(options.policies, options.allow, options.deny, mode, command_line=True, read=read)


def user_policy(options: RunOptions, read=None):
    """The user's own policy files and flags, loaded (so checked) before anything runs; None if none.

    ``read``: the run's PolicySnapshot, so that the files read now are the ones used later.
    """
    source = policy_source(options, read=read)
    if not source.given:
        return None  # the loader is not even imported
    from egress.policy.loader import PolicyError

    try:
        return source.own()
    except PolicyError as e:
        raise _policy_failure(e) from None


def policy_reader():
    """The run's policy reader, holding what the policy files say as the run starts.

    Every load of the run goes through it (see egress.run.snapshot): the user's files
    now, the full policy when the proxy starts, each live reload.
    """
    from egress.run.snapshot import PolicySnapshot

    return PolicySnapshot()


def seal_policy(reader, writable: list[str], read_only: list[str] = ()) -> list[str]:
    """The command runs from now on: files it can write are no longer read (only their text of now).
    Returns the writable trees as the predicate takes them."""
    from sandbox.paths import command_writable

    trees = [os.path.join(os.getcwd(), tree) for tree in writable]  # as the sandbox took them
    reader.seal(lambda path: command_writable(path, trees, read_only))
    return trees


def proxy_mode(options: RunOptions, platform=None) -> str:
    """Where the run's proxy lives: "warm" (the per-user warm proxy, egress.run.warm.client) or "lazy" (this
    process, started when the command first connects); always lazy where the platform's sandbox
    cannot hand its socket to the warm proxy (sandbox/platforms.py says why)."""
    mode = options.proxy_mode or os.environ.get(PROXY_MODE_ENV) or "warm"
    if mode not in PROXY_MODES:
        raise LaunchError(f"--proxy (or ${PROXY_MODE_ENV}) must be one of {', '.join(PROXY_MODES)}, not {mode!r}")
    if platform is not None and not platform.warm:
        return "lazy"
    return mode


def offer_warm(options: RunOptions, mode: str, reader, trees: list[str], own_code: list[str], credentials,
               caller_env: dict, builder, run_id: str):
    """The run's request to the warm proxy, sent now if it runs (see egress.run.warm.client.Handover); None
    if it cannot be used (the run's proxy then starts in this process)."""
    from egress.run.warm.client import Handover, installation

    # stdout and stderr go when the run's child says it serves (egress.run.session): a child holding
    # them while it builds a proxy that a `true` never uses kept whoever reads egress's output
    # waiting 2-4 ms after egress had ended. With `--audit-log -` the audit lines are stdout.
    fds = stdio_fds(("stdout",) if builder.audit is sys.stdout else ())
    if builder.audit is not None and builder.audit is not sys.stdout:
        fds["audit"] = builder.audit.fileno()
    if builder.metrics_socket is not None:
        fds["metrics"] = builder.metrics_socket.fileno()
    umask = os.umask(0o077)
    os.umask(umask)
    request = {"installation": installation(), "run_id": run_id, "argv": options.argv, "cwd": os.getcwd(),
               "umask": umask, "environ": caller_env, "config": options.proxy.to_dict(), "mode": mode,
               "network": options.network, "policies": options.policies, "allow": options.allow,
               "deny": options.deny,
               "snapshot": {"recorded": reader.recorded(), "trees": trees, "read_only": own_code},
               "credentials": credentials.to_dict() if credentials is not None else None}
    return Handover.offer(options.state_dir, request, fds)


def protect_own_code(writable: list[str]) -> list[str]:
    """Folders of egress's own code inside writable trees, to be shown read-only to the command;
    sys.path entries that are (or hold) a writable tree are dropped (see sandbox.paths.own_code)."""
    import egress
    import sandbox
    from sandbox.paths import own_code

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
    without importing importlib.util: ~1.3 ms of every `egress run`."""
    module = sys.modules.get(name)
    if module is not None:
        return list(getattr(module, "__path__", None) or [])
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, parent_path) if find is not None else None
        if spec is not None:
            return list(spec.submodule_search_locations or [])
    return []


def network_mode(options: RunOptions, user=None) -> str:
    """--network if given, else the policy files' `network` key, else allowlist."""
    if options.network is not None:
        return options.network
    return (user.network if user is not None else None) or DEFAULT_NETWORK


def build_policy(options: RunOptions, mode: str, read=None):
    """The run's policy: built-in 'dev' (allowlist mode), the user's files, then --allow/--deny."""
    from egress.policy.loader import PolicyError

    try:
        return policy_source(options, mode, read).load()
    except PolicyError as e:
        raise _policy_failure(e) from None


def load_credentials(policy, environ: dict[str, str]):
    """Stored secrets and placeholders for this run (bound secrets are brokered)."""
    from egress.policy.loader import PolicyError
    from egress.policy.matcher import Policy
    from egress.policy.settings import read_credentials

    try:
        return read_credentials(policy or Policy(), environ, broker=policy is not None)
    except PolicyError as e:
        raise LaunchError("the credential settings cannot be honoured:\n  " +
                          "\n  ".join(map(str, e.problems))) from None


def fresh_policy(options: RunOptions, mode: str, read=None):
    """The run's policy, as build_policy, raising PolicyError (for live reloads)."""
    return policy_source(options, mode, read).reload()


def guard_command(options: RunOptions, user=None) -> None:
    """Refuse the command if it is on the deny list (egress.agent.commands), before anything starts:
    one line naming the rule and where it came from (status 125)."""
    from egress.agent.commands import builtin_rules, check

    rules = list(user.command_rules) if user is not None else []
    for problem in (user.warnings if user is not None else []):
        if problem.message.startswith("guardrails:"):
            say(f"egress: {problem.as_warning()}")
    refusal = check(options.argv, builtin_rules() + [r for r in rules if r.kind == "deny"],
                    [r for r in rules if r.kind == "allow"])
    if refusal is not None:
        text = str(refusal)
        if options.redact:
            from egress.scan.detect import Detector

            text = Detector().redact(text.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")
        raise LaunchError(text + "; it was not run")


def _policy_failure(error) -> LaunchError:
    return LaunchError("the policy cannot be loaded:\n  " + "\n  ".join(map(str, error.problems)))


def choose_provider(options: RunOptions):
    """The platform object for --provider (sandbox/providers.py), with the container's image,
    mounts and volumes (the flags, else the policy files' [container] table). Raises LaunchError."""
    from sandbox.providers import CONTAINER_ENGINES, select

    container = None
    if options.provider in CONTAINER_ENGINES:
        from sandbox.container import ContainerSpec

        table = _container_table(options.policies)
        try:
            container = ContainerSpec(options.image or table.get("image"),
                                      [*table.get("mounts", []), *options.mounts],
                                      [*table.get("persist", []), *options.persist],
                                      cpus=table.get("cpus"), memory=table.get("memory"))
        except ValueError as e:
            raise LaunchError(str(e)) from None
    elif options.image or options.mounts or options.persist:
        raise LaunchError("--image, --mount and --persist are for --provider podman or docker")
    try:
        return select(options.provider, container)
    except ValueError as e:
        raise LaunchError(str(e)) from None


def _container_table(policies: list[str]) -> dict:
    """The [container] table of the policy files named on the command line (the last file that has
    one wins): image, mounts, persist, cpus, memory. Raises LaunchError on a malformed one."""
    import tomllib

    found: dict = {}
    for name in policies:
        if not os.path.isfile(name):
            continue  # a built-in policy name: they have no [container] table
        try:
            with open(name, "rb") as f:
                table = tomllib.load(f).get("container")
        except (OSError, tomllib.TOMLDecodeError):
            continue  # the policy loader says what is wrong with it
        if table is None:
            continue
        known = {"image": str, "mounts": list, "persist": list, "cpus": (str, int, float), "memory": str}
        for key, value in table.items():
            if key not in known or not isinstance(value, known[key]):
                raise LaunchError(f"{name}: [container] {key}: expected one of "
                                  f"image (text), mounts (list), persist (list), cpus, memory (text)")
        found = table
    return found


def run(options: RunOptions, platform=None) -> int:
    """Run the command; return its exit status (or a launcher status). Raises LaunchError.

    ``platform``: the sandbox to use (sandbox/platforms.py); None: --provider's, else this system's."""
    if platform is None:
        platform = choose_provider(options)
    warning = getattr(platform, "warning", None)
    if warning:  # --provider local: said first, before anything else can scroll it away
        say(warning)
    refusal = platform.refusal()
    if refusal is not None:
        raise LaunchError(refusal)
    if options.network not in NETWORK_MODES + (None,):
        raise LaunchError(f"--network must be one of {', '.join(NETWORK_MODES)}")
    if options.proxy.listen is not None:  # the run's proxy serves its sandbox, and nothing else
        raise LaunchError("egress run's proxy listens only inside the sandbox; use egress serve to listen")
    where = proxy_mode(options, platform)
    project = os.path.realpath(options.project)  # as pathlib's Path.resolve()
    if not os.path.isdir(project):
        raise LaunchError(f"the project folder {options.project} does not exist")
    for directory in options.add_dirs:
        if not os.path.isdir(directory):
            raise LaunchError(f"--add-dir {directory} does not exist")
    for path in options.read:
        if not os.path.exists(path):
            raise LaunchError(f"--read {path} does not exist")
    reader = policy_reader()
    user = user_policy(options, reader)
    options = options.settled(user)
    if options.guard_commands:
        guard_command(options, user)
    mode = network_mode(options, user)
    networked = mode != "off"
    caller_env = dict(os.environ)
    # The full policy and the credentials are needed before the command starts only when
    # secrets are brokered (the command's environment holds placeholders) or output is
    # redacted; otherwise they are built when the proxy starts, so a command that opens
    # no connection never pays for them (the user's own files were checked just above).
    eager = options.redact or (user is not None and bool(user.credential_tables))
    policy = build_policy(options, mode, reader) if networked and eager else None
    credentials = load_credentials(policy, caller_env) if eager else None

    def prepare():
        ready = policy or build_policy(options, mode, reader)
        return ready, credentials or load_credentials(ready, caller_env)

    from sandbox.spec import SandboxError, SandboxSpec

    run_id = os.urandom(6).hex()
    tmpdir = _private_folder(f"egress-run-{run_id}-")
    session = box = control = builder = terminal = handover = listener = None
    try:
        ca_bundle = egress_ca = None
        try:
            listener = platform.listener(networked)  # where the proxy listens, as the command is told
        except OSError as e:
            raise LaunchError(f"cannot listen for the run's proxy: {e.strerror or e}") from None
        if networked:
            from egress.proxy.ca import StateError, ensure_ca
            from egress.proxy.build import BuildError, ProxyBuilder

            config = options.proxy if listener.auth is None else options.proxy._replace(auth=listener.auth)
            builder = ProxyBuilder(config)
            try:
                # the upstream CAs, the audit log and the metrics port, before the command runs; no thread yet
                builder.open()
            except BuildError as e:
                raise LaunchError(str(e)) from None

            try:
                # Made (with the state folder) before the sandbox: a folder it should hide that does
                # not exist yet when its view is built is not hidden (its CA's key visible inside).
                egress_ca = ensure_ca(options.state_dir)
            except StateError as e:
                raise LaunchError(str(e)) from None
            ca_bundle = os.path.join(tmpdir, "ca-bundle.pem")
        # The files the command's environment names: where the platform holds the command back
        # until box.ready() (Linux), written while its sandbox is made (below), else now.
        files: dict = {}
        command_env = dict(caller_env)
        # the command holds placeholders, never the bound secrets (whichever sandbox holds it)
        placeholders = credentials.placeholder_environment() if credentials is not None else {}
        command_env.update(placeholders)
        env = environment.command_environment(
            command_env, proxy_url=listener.url if networked else None, ca_bundle=ca_bundle, tmpdir=tmpdir,
            files=files)
        env.update(platform.environment(tmpdir))
        held = getattr(platform, "holds_until_ready", False)
        if not held:
            _write_files(builder, egress_ca, ca_bundle, files)
        os.mkdir(os.path.join(tmpdir, "cache"))
        outputs = Relay.for_run(options.redact, credentials, options.max_output or 0)
        writable = [project, tmpdir, *options.add_dirs]
        own_code = protect_own_code(writable)
        # every host folder the command can write, a container's writable mounts included
        writable_anywhere = writable + list(getattr(platform, "writable_elsewhere", list)())
        # What runs later and does not exist yet cannot be shown read-only: moved aside after the run if made
        absent = [] if options.allow_hooks else later_run_absent([t for t in writable_anywhere if t != tmpdir])
        refusal = secret_file_refusal(credentials, writable_anywhere, own_code)
        if refusal is not None:
            raise LaunchError(refusal)
        spec = SandboxSpec(argv=options.argv, env=env, cwd=project,
                           writable=writable, read_only=own_code,
                           network=networked, proxy_port=listener.port or 3128,  # (any port without network)
                           capture=networked and platform.capture, socket_dirs=[tmpdir],
                           fs_confinement=options.fs_confinement,
                           # The command never sees egress's state (control sockets, the CA's key)
                           # nor a secret file bound to hosts (it reads the placeholder instead).
                           hidden=[str(_state_dir(options))],
                           replaced=_replaced_files(options, credentials),
                           placeholders=list(placeholders), readable=options.read,
                           allow_hooks=options.allow_hooks, abandoned=[tmpdir],
                           stdout=outputs.stdout if outputs else None,
                           stderr=outputs.stderr if outputs else None)
        terminal = TerminalGuard()  # before the command can take the terminal's foreground
        try:
            # Linux: the sandbox is made (~9 ms) while this process sets up its side, below.
            box = platform.start(spec, listener)
            listener = None  # the box holds its socket now
        except SandboxError as e:
            raise _sandbox_failure(e, options, platform) from None
        if held:
            _write_files(builder, egress_ca, ca_bundle, files)
        if networked:
            # From now on files the command can write are read no more (egress.run.snapshot): the
            # warm proxy gets their texts of now, and builds the run's proxy while the sandbox starts.
            # (Nothing has read a policy file since the user's were loaded, above.)
            trees = seal_policy(reader, writable_anywhere, own_code)
            if where == "warm":
                handover = offer_warm(options, mode, reader, trees, own_code, credentials, caller_env, builder,
                                      run_id)
            from egress.host.control import ControlServer, RunState
            from egress.run.session import ProxySession

            if handover is None:  # else the warm proxy serves them (or this process, if it falls back)
                builder.serve_metrics()  # its port was bound before the command started; threads only now
            state = RunState(run_id, options.argv)
            if builder.metrics_url:
                state.extra["metrics"] = builder.metrics_url
                say(f"egress: metrics on {builder.metrics_url}")
            control = ControlServer(state, options.state_dir)
            reporter = EventLines()  # EGRESS_BLOCKED and EGRESS_UPSTREAM_ERROR, once per host and reason
            asker = _asker(options, state)

            def on_event(event) -> None:
                reporter(event)
                state.publish(event)
        try:
            box.ready()  # the command started
        except SandboxError as e:
            raise _sandbox_failure(e, options, platform) from None
        if networked:
            session = ProxySession(prepare, run_id, builder, on_event=on_event,
                                   reload=lambda: fresh_policy(options, mode, reader),
                                   watch=list(options.policies), frozen=reader.frozen_files,
                                   asker=asker, state=state, warm=handover)
            session.serve_lazily(box.listen_socket, box.capture)
            if box.capture_error is not None:
                state.extra["capture"] = f"unavailable: {box.capture_error}"
        if outputs is not None:
            outputs.start()
        previous = forward_signals(box)
        try:
            status = box.wait(options.timeout)
        finally:
            restore_signals(previous)
            if outputs is not None:
                outputs.finish()
        if status == EXIT_TIMEOUT and options.timeout is not None:
            say(f"egress: timed out after {options.timeout:g} s; the command and everything it "
                f"started were killed")
        elif status != 0 and session is not None and box.direct_attempts() and not session.saw_connection():
            # It failed, egress's proxy never saw it, and it tried the network around it: a
            # client that ignores the proxy variables (node's fetch() before Node 22.21/24.5).
            say(environment.direct_connection_hint(options.argv[0], env["PATH"], project, env["HTTPS_PROXY"]))
        if session is not None and session.error is not None:
            say(f"egress: the proxy failed: {session.error}")
        for line in quarantine(absent, _state_dir(options), run_id):
            say(line)
        return status
    finally:
        if session is not None:
            session.stop()
        elif handover is not None:
            handover.close()  # the command never ran: the warm proxy's child ends at this EOF
        if control is not None:
            control.close()
        if builder is not None:
            builder.close()
        if box is not None:
            box.close()
        if listener is not None:
            listener.close()
        if terminal is not None:
            terminal.restore()
        _remove_tree(tmpdir)


def later_run_absent(trees: list[str]) -> list[str]:
    """The paths that run later, outside the sandbox (sandbox/protected.py), missing at the start.
    A repository without a hooks folder gets an empty one (as `git init` makes it): shown read-only,
    it cannot be filled with hooks."""
    from sandbox.protected import later_run_paths

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


def quarantine(absent: list[str], state_dir: str, run_id: str) -> list[str]:
    """Move aside what the command made of the paths that run later (missing when it started),
    into the state folder; one line each for the user. Nothing is deleted."""
    made = [path for path in absent if os.path.lexists(path)]
    if not made:
        return []
    folder = os.path.join(state_dir, "quarantine", run_id)
    lines = []
    for path in made:
        target = os.path.join(folder, path.lstrip("/"))
        try:
            try:
                os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
                os.rename(path, target)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                target = f"{path}.egress-quarantine-{run_id}"  # another file system: beside it, under a name nothing runs
                os.rename(path, target)
            lines.append(f"egress: the command made {path}, which would run outside the sandbox later; "
                         f"moved to {target} (egress run --allow-hooks lets a command make it)")
        except OSError as e:
            lines.append(f"egress: the command made {path}, which would run outside the sandbox later, and it "
                         f"could not be moved aside ({e.strerror}): look at it before you use this folder")
    return lines


def _write_files(builder, egress_ca, ca_bundle, files: dict) -> None:
    """The trust bundle (the upstream roots and egress's CA) and the clients' configuration files."""
    if ca_bundle is not None:
        try:
            environment.trust_bundle(builder.trust.roots, egress_ca, ca_bundle)
        except OSError as e:
            raise LaunchError(str(e)) from None
    environment.write_files(files)


def _sandbox_failure(error, options: RunOptions, platform) -> LaunchError:
    """The sandbox's refusal as egress run says it, with an install hint for a missing runtime."""
    missing = error.code == EXIT_NOT_FOUND
    hint = environment.missing_runtime_hint(options.argv[0], platform.name) if missing else None
    return LaunchError(str(error) + (f"\n{hint}" if hint else ""), error.code)


def main(options: RunOptions):
    """`egress run` for the command line (egress.cli, egress.entry): run; on a launcher failure
    its one-line reason and status; else exit with the command's status, at once."""
    try:
        status = run(options)
    except LaunchError as e:
        say(f"egress: {e}")
        sys.exit(e.status)
    # Everything the run made is gone (run cleans up before returning); skip the
    # interpreter's teardown, which took 20 ms, and 0.2-0.3 s once mitmproxy was loaded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _private_folder(prefix: str) -> str:
    """A new folder only we can use, as tempfile.mkdtemp makes it (0700, a name no one had), in
    the first usable of $TMPDIR, $TEMP, $TMP, /tmp, /var/tmp, /usr/tmp: importing tempfile (with
    shutil and random) cost ~5 ms of every `egress run`."""
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
    shutil.rmtree(ignore_errors=True), whose import (~3 ms) the run is spared."""
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


def _replaced_files(options: RunOptions, credentials) -> dict[str, bytes]:
    """Files the command sees with other contents: secret files bound to hosts (their
    placeholder), and the run's audit log, shown empty: inside the project it would otherwise
    be the command's to truncate or to fill with forged events."""
    shown = credentials.placeholder_files() if credentials is not None else {}
    audit = options.proxy.audit_log
    if audit not in (None, "-"):
        shown[os.path.abspath(audit)] = b""
    return shown


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
    from sandbox.paths import command_writable

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


def _state_dir(options: RunOptions) -> str:
    from egress.proxy.ca import state_dir

    return options.state_dir or state_dir()


def _asker(options: RunOptions, state):
    """Who answers "allow this host for this run?": the terminal, or nobody (headless)."""
    from egress.run.ask import NeverAsk, TerminalAsker

    has_terminal = sys.stdin.isatty() and sys.stderr.isatty()
    if options.ask == "tty" or (options.ask is None and has_terminal):
        return TerminalAsker(state, " ".join(options.argv)[:80])
    return NeverAsk(state)
