"""Where a proxy's policy comes from: one source for serve, run, the warm child and doctor.

A :class:`PolicySource` holds the policy files, ``--allow``/``--deny`` and the network mode as one
value; :meth:`PolicySource.load` makes the Policy, :meth:`PolicySource.reload` makes it again
when the files change. Two forms, as the two commands have always loaded:

    PolicySource(files)          serve, doctor: the files (the built-in set without any)
    PolicySource(files, allow, deny, network, command_line=True)
                                 egress run: one mapping at "<command line>": the built-in set
                                 first in allowlist mode, the files, then --allow/--deny

``network``: the mode given (--network); None: the files' `network` key, else allowlist. The
source sets the policy's allow_all from it: no caller sets it after a load.

Every load goes through egress.policy.settings (the credential settings are checked beside the
policy) and a load that fails raises PolicyError, its problems worded by the loader.

A plain class, not a dataclass, and nothing of the loader imported until a load: every `egress
run` makes one, and most end before their proxy needs a policy (the imports' cost: bench/README.md,
"Launch without pathlib and json").
"""

from __future__ import annotations

from egress.core.contract import DEFAULT_NETWORK, NETWORK_MODES

TYPE_CHECKING = False  # egress run's path imports no typing; mypy reads this name as True
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any, NoReturn

    from egress.policy.loader import Reader
    from egress.policy.matcher import Policy

BUILTIN = "dev"  # the built-in set (policies/default.toml): serve's without files, a run's in allowlist mode
COMMAND_LINE = "<command line>"  # where a run's flags stand in the loader's problems


class PolicySource:
    """Policy files, ``--allow``/``--deny`` and the network mode; see the module.

    ``read``: the loader's read hook (egress.policy.loader.Reader): a run's PolicySnapshot, a
    worker's recorder of texts; None: each file as it is now."""

    __slots__ = ("files", "allow", "deny", "network", "command_line", "read")

    files: tuple[str, ...]
    allow: tuple[str, ...]
    deny: tuple[str, ...]
    network: str | None
    command_line: bool
    read: Reader | None

    def __init__(self, files: Iterable[str] = (), allow: Iterable[str] = (), deny: Iterable[str] = (),
                 network: str | None = None, *, command_line: bool = False, read: Reader | None = None):
        if network is not None and network not in NETWORK_MODES:
            raise ValueError(f"network must be one of {', '.join(NETWORK_MODES)}, not {network!r}")
        if (allow or deny) and not command_line:
            raise ValueError("--allow and --deny stand in a run's command line: command_line=True")
        values: tuple[tuple[str, object], ...] = (
            ("files", tuple(files)), ("allow", tuple(allow)), ("deny", tuple(deny)), ("network", network),
            ("command_line", command_line), ("read", read))
        for name, value in values:
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"a PolicySource does not change: use .replace({name}=...)")

    def replace(self, **changes: Any) -> PolicySource:
        """This source with some fields changed (another reader, the mode once decided)."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return PolicySource(**fields)

    @property
    def given(self) -> bool:
        """Whether the user named any policy: files, --allow or --deny."""
        return bool(self.files or self.allow or self.deny)

    def decided(self, own: Policy | None = None) -> PolicySource:
        """This source with its network mode decided: the one given, else ``own``'s `network` key
        (:meth:`own`'s policy), else allowlist."""
        if self.network is not None:
            return self
        return self.replace(network=(own.network if own is not None else None) or DEFAULT_NETWORK)

    def load(self) -> Policy:
        """The policy (egress.policy.matcher.Policy). Raises egress.policy.loader.PolicyError."""
        from egress.policy import settings

        if not self.command_line:
            policy = settings.load(list(self.files) or [BUILTIN], self.read).policy
            if self.network is not None:
                policy.allow_all = self.network == "all"
            return policy
        if self.network is None:
            return self.decided(self.own()).load()
        include = ([BUILTIN] if self.network == "allowlist" else []) + list(self.files)
        policy = self._command_line(include)
        policy.allow_all = self.network == "all"  # the run's mode, whatever a file's `network` key says
        return policy

    def reload(self) -> Policy:
        """A live reload's policy: :meth:`load` again. serve's also refuses a policy whose stored
        secrets cannot be read now (egress.policy.settings.reloadable says why); a run's proxy
        keeps the credentials it started with and reads no secret again, as it never has."""
        if self.command_line:
            return self.load()
        from egress.policy import settings

        policy = settings.reloadable(list(self.files) or [BUILTIN], self.read)
        if self.network is not None:
            policy.allow_all = self.network == "all"
        return policy

    def own(self) -> Policy | None:
        """The user's own files and flags alone, without the built-in set (what they say of the
        network mode, the profile, the guardrails); None if the user named none. Raises PolicyError."""
        if not self.given:
            return None
        if not self.command_line:
            from egress.policy import settings

            return settings.load(list(self.files), self.read).policy
        return self._command_line(list(self.files))

    def _command_line(self, include: list[str]) -> Policy:
        from egress.policy import settings

        return settings.from_mapping({"include": include, "allow": list(self.allow), "deny": list(self.deny)},
                                     path=COMMAND_LINE, read=self.read).policy

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicySource) and all(
            getattr(self, name) == getattr(other, name) for name in self.__slots__)

    def __hash__(self) -> int:
        return hash((self.files, self.allow, self.deny, self.network, self.command_line))

    def __repr__(self) -> str:
        return "PolicySource(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__) + ")"
