"""What `egress run` was asked to do (RunOptions, as both parsers make it), and the one failure
it reports before its command starts (LaunchError).

RunOptions is the input of the run's pipeline (egress.run.launcher):
plan(options, platform) -> prepare(plan) -> execute(prepared).
"""

from __future__ import annotations

import os

from egress.core.contract import EXIT_LAUNCHER
from egress.proxy.config import ProxyConfig

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

DEFAULT_PROXY = ProxyConfig()  # immutable: one default serves every RunOptions

# `egress run --agent` (or a policy's `profile = "agent"`): what an agent harness would otherwise
# set by hand. Each can still be set on its own (--timeout, --max-output 0, --ask tty).
# (It also turns on --headless, --redact and --guard-commands.)
AGENT_PROFILE: dict[str, Any] = {"max_output": 256 * 1024, "timeout": 120.0}


class LaunchError(Exception):
    """egress run could not start the command; nothing ran."""

    def __init__(self, message: str, status: int = EXIT_LAUNCHER):
        self.status = status
        super().__init__(message)


class RunOptions:
    """What `egress run` was asked to do. A plain class: `egress run` imports no dataclasses
    (bench/README.md, "Launcher"). Its folders (project, add_dirs, the proxy's state_dir) are str,
    as both parsers (egress.entry, click) give them, or made str from a caller's PathLike:
    `egress run` never imports pathlib (bench/README.md, "Launch without pathlib and json")."""

    __slots__ = ("argv", "network", "policies", "allow", "deny", "project", "add_dirs", "timeout",
                 "fs_confinement", "proxy", "redact", "ask", "proxy_mode", "agent", "max_output", "guard_commands",
                 "provider", "image", "mounts", "persist", "read", "allow_hooks")

    def __init__(self, argv: Iterable[str], network: str | None = None, policies: Iterable[str] = (),
                 allow: Iterable[str] = (), deny: Iterable[str] = (), project: str | os.PathLike | None = None,
                 add_dirs: Iterable[str | os.PathLike] = (), timeout: float | None = None,
                 fs_confinement: bool = True, proxy: ProxyConfig = DEFAULT_PROXY, redact: bool = False,
                 ask: str | None = None, proxy_mode: str | None = None, agent: bool = False,
                 max_output: int | None = None, guard_commands: bool = False, provider: str | None = None,
                 image: str | None = None, mounts: Iterable[str] = (), persist: Iterable[str] = (),
                 read: Iterable[str | os.PathLike] = (), allow_hooks: bool = False):
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
        self.proxy = proxy
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
