"""`egress run`'s plan: what the run will be, decided before anything is made.

    plan(options, platform) -> RunPlan       here: reads, makes nothing
    prepare(plan) -> Prepared                egress.run.prepare: folders, the CA, the proxy's builder, files
    execute(prepared) -> status              egress.run.execute: sandbox, proxy, relay, signals

A plan reads what the run depends on (the policy files, the folders named, the caller's
environment) and decides: the checked options, the network mode, where the proxy lives, the
policy source and, from what prepare makes, the command's environment and its SandboxSpec. It
makes no folder, socket or process; what it has to say (the guardrails' warnings) goes to the
caller's ``tell``; a refusal is a LaunchError. So a plan is tested in process
(tests/run/test_plan.py), on any machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from egress.core.contract import DEFAULT_NETWORK, NETWORK_MODES, PROXY_MODE_ENV, PROXY_MODES
from egress.observe.terminal import say
from egress.policy.source import PolicySource
from egress.proxy.ca import StateDir
from egress.run.options import LaunchError, RunOptions
from egress.run.snapshot import PolicySnapshot
from sandbox import environment
from sandbox.spec import SandboxSpec

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from sandbox.api import Listener, Platform


class RunPlan:
    """One run, decided (see the module). Its fields do not change once plan() returns."""

    __slots__ = ("options", "platform", "project", "where", "mode", "source", "reader", "user", "environ", "policy",
                 "credentials")

    def __init__(self, options: RunOptions, platform: Platform, project: str, where: str, mode: str,
                 source: PolicySource, reader: PolicySnapshot, user, environ: dict[str, str], policy=None,
                 credentials=None):
        self.options = options  # settled: the agent profile and the policy's guardrails applied
        self.platform = platform
        self.project = project  # the project folder, resolved
        self.where = where  # the run's proxy: "warm" (the per-user warm proxy's child) or "lazy"
        self.mode = mode  # the network mode: allowlist, all or off
        self.source = source  # the run's policy, in that mode, read through ``reader``
        self.reader = reader  # the run's PolicySnapshot: the policy files read, sealed by execute
        self.user = user  # the user's own files and flags, loaded (None: none named)
        self.environ = environ  # the caller's environment, as the run started
        self.policy = policy  # loaded with the plan where the command's start needs it, else None
        self.credentials = credentials  # the same

    @property
    def networked(self) -> bool:
        return self.mode != "off"

    @property
    def state_dir(self) -> str:
        return StateDir.of(self.options.state_dir).root

    def policy_and_credentials(self):
        """(policy, credentials) for the run's proxy, when it starts: those loaded with the plan,
        else loaded now (most commands never connect, and never pay for them). Raises LaunchError."""
        policy = self.policy or build_policy(self.source)
        return policy, self.credentials or load_credentials(policy, self.environ)

    def environment(self, tmpdir: str, listener: Listener, ca_bundle: str | None, files: dict) -> dict[str, str]:
        """The command's environment: the caller's, with the placeholders of bound secrets (never
        the secrets, whichever sandbox holds it), the proxy variables and the platform's own.
        ``files`` gets the files it names (path -> text), for prepare to write."""
        command_env = dict(self.environ)
        command_env.update(self.placeholders())
        env = environment.command_environment(
            command_env, proxy_url=listener.url if self.networked else None, ca_bundle=ca_bundle, tmpdir=tmpdir,
            files=files)
        env.update(self.platform.environment(tmpdir))
        return env

    def placeholders(self) -> dict[str, str]:
        return self.credentials.placeholder_environment() if self.credentials is not None else {}

    def writable(self, tmpdir: str) -> list[str]:
        """The folders the command can write, as its sandbox takes them."""
        return [self.project, tmpdir, *self.options.add_dirs]

    def sandbox_spec(self, env: dict[str, str], tmpdir: str, listener: Listener, own_code: list[str],
                     outputs) -> SandboxSpec:
        """What the sandbox holds the command to, from what prepare made: its folder, the listener,
        egress's own code to show read-only, the output relay (egress.run.relay.Relay, or None)."""
        options, networked = self.options, self.networked
        return SandboxSpec(argv=options.argv, env=env, cwd=self.project,
                           writable=self.writable(tmpdir), read_only=own_code,
                           network=networked, proxy_port=listener.port or 3128,  # (any port without network)
                           capture=networked and self.platform.capture, socket_dirs=[tmpdir],
                           fs_confinement=options.fs_confinement,
                           # The command never sees egress's state (control sockets, the CA's key)
                           # nor a secret file bound to hosts (it reads the placeholder instead).
                           hidden=[self.state_dir],
                           replaced=self.replaced_files(),
                           placeholders=list(self.placeholders()), readable=options.read,
                           allow_hooks=options.allow_hooks, abandoned=[tmpdir],
                           stdout=outputs.stdout if outputs else None,
                           stderr=outputs.stderr if outputs else None)

    def replaced_files(self) -> dict[str, bytes]:
        """Files the command sees with other contents: secret files bound to hosts (their
        placeholder), and the run's audit log, shown empty: inside the project it would otherwise
        be the command's to truncate or to fill with forged events."""
        shown = self.credentials.placeholder_files() if self.credentials is not None else {}
        audit = self.options.proxy.audit_log
        if audit not in (None, "-"):
            shown[os.path.abspath(audit)] = b""
        return shown


def plan(options: RunOptions, platform: Platform, environ=None, tell: Callable[[str], None] = say) -> RunPlan:
    """The run ``options`` ask for on ``platform`` (choose_provider's), checked; ``environ``: the
    caller's environment (None: os.environ); ``tell``: where the lines a person should read go, as
    they are found. Raises LaunchError."""
    environ = dict(os.environ if environ is None else environ)
    refusal = platform.refusal()
    if refusal is not None:
        raise LaunchError(refusal)
    check_options(options)
    where = proxy_mode(options, platform, environ)
    project = check_folders(options)
    reader = PolicySnapshot()
    given = PolicySource(options.policies, options.allow, options.deny, options.network, command_line=True,
                         read=reader)
    user = user_policy(given)
    options = options.settled(user)
    if options.guard_commands:
        guard_command(options, user, tell)
    source = given.decided(user)
    mode = source.network or DEFAULT_NETWORK  # decided: never None here
    # The full policy and the credentials are needed before the command starts only when
    # secrets are brokered (the command's environment holds placeholders) or output is
    # redacted; otherwise they are built when the proxy starts, so a command that opens
    # no connection never pays for them (the user's own files were checked just above).
    eager = options.redact or (user is not None and bool(user.credential_tables))
    policy = build_policy(source) if mode != "off" and eager else None
    credentials = load_credentials(policy, environ) if eager else None
    return RunPlan(options, platform, project, where, mode, source, reader, user, environ, policy, credentials)


def check_options(options: RunOptions) -> None:
    """The options no parser checks against each other. Raises LaunchError."""
    if options.network not in NETWORK_MODES + (None,):
        raise LaunchError(f"--network must be one of {', '.join(NETWORK_MODES)}")
    if options.proxy.listen is not None:  # the run's proxy serves its sandbox, and nothing else
        raise LaunchError("egress run's proxy listens only inside the sandbox; use egress serve to listen")


def check_folders(options: RunOptions) -> str:
    """The project folder, resolved (as pathlib's Path.resolve()); every folder and file named must
    exist. Raises LaunchError."""
    project = os.path.realpath(options.project)
    if not os.path.isdir(project):
        raise LaunchError(f"the project folder {options.project} does not exist")
    for directory in options.add_dirs:
        if not os.path.isdir(directory):
            raise LaunchError(f"--add-dir {directory} does not exist")
    for path in options.read:
        if not os.path.exists(path):
            raise LaunchError(f"--read {path} does not exist")
    return project


def proxy_mode(options: RunOptions, platform: Platform | None = None, environ=None) -> str:
    """Where the run's proxy lives: "warm" (the per-user warm proxy, egress.run.warm.client) or "lazy" (this
    process, started when the command first connects); always lazy where the platform's sandbox
    cannot hand its socket to the warm proxy (sandbox/platforms.py says why)."""
    environ = os.environ if environ is None else environ
    mode = options.proxy_mode or environ.get(PROXY_MODE_ENV) or "warm"
    if mode not in PROXY_MODES:
        raise LaunchError(f"--proxy (or ${PROXY_MODE_ENV}) must be one of {', '.join(PROXY_MODES)}, not {mode!r}")
    if platform is not None and not platform.warm:
        return "lazy"
    return mode


# ------------------------------------------------------------------ the policy


def user_policy(source: PolicySource):
    """The user's own policy files and flags, loaded (so checked) before anything runs; None if
    none. Read through the source's reader: the files read now are the ones used later."""
    if not source.given:
        return None  # the loader is not even imported
    from egress.policy.loader import PolicyError

    try:
        return source.own()
    except PolicyError as e:
        raise policy_failure(e) from None


def build_policy(source: PolicySource):
    """The run's policy: built-in 'dev' (allowlist mode), the user's files, then --allow/--deny.
    Raises LaunchError."""
    from egress.policy.loader import PolicyError

    try:
        return source.load()
    except PolicyError as e:
        raise policy_failure(e) from None


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


def policy_failure(error) -> LaunchError:
    return LaunchError("the policy cannot be loaded:\n  " + "\n  ".join(map(str, error.problems)))


def guard_command(options: RunOptions, user=None, tell: Callable[[str], None] = say) -> None:
    """Refuse the command if it is on the deny list (egress.agent.commands), before anything starts:
    one line naming the rule and where it came from (status 125). The guardrails' warnings go to
    ``tell`` first."""
    from egress.agent.commands import builtin_rules, check

    rules = list(user.command_rules) if user is not None else []
    for problem in (user.warnings if user is not None else []):
        if problem.message.startswith("guardrails:"):
            tell(f"egress: {problem.as_warning()}")
    refusal = check(options.argv, builtin_rules() + [r for r in rules if r.kind == "deny"],
                    [r for r in rules if r.kind == "allow"])
    if refusal is not None:
        text = str(refusal)
        if options.redact:
            from egress.scan.detect import Detector

            text = Detector().redact(text.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")
        raise LaunchError(text + "; it was not run")


# ---------------------------------------------------------------- the provider


def choose_provider(options: RunOptions) -> Platform:
    """The platform object for --provider (sandbox/providers.py), with the container's image,
    mounts and volumes (the flags, else the policy files' [container] table). Raises LaunchError."""
    from sandbox.providers import CONTAINER_ENGINES, select

    container = None
    if options.provider in CONTAINER_ENGINES:
        from sandbox.container import ContainerSpec

        table = container_table(options.policies)
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


def container_table(policies: list[str]) -> dict:
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
        known: dict[str, type | tuple[type, ...]] = {"image": str, "mounts": list, "persist": list,
                                                     "cpus": (str, int, float), "memory": str}
        for key, value in table.items():
            if key not in known or not isinstance(value, known[key]):
                raise LaunchError(f"{name}: [container] {key}: expected one of "
                                  f"image (text), mounts (list), persist (list), cpus, memory (text)")
        found = table
    return found
