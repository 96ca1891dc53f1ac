"""What policy files set: the domain policy and, beside it, the credential settings.

The policy loader (egress.policy_loader) reads the files and keeps each
``[credentials]`` table as written; they are parsed here, next to it, by
egress.credentials, so the domain policy knows nothing of secrets. Both sets of
problems come back together, each with file:line, and a policy whose credential
settings are wrong is not used (every command, and every live reload, loads
through here).
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy_loader import PolicyError, Problem, Reader, find_line, read_mapping, read_policy
from .policy_matcher import Policy


@dataclass(frozen=True)
class Settings:
    policy: Policy
    credentials: object | None  # egress.credentials.CredentialSettings; None: no table, the defaults


def load(sources, read: Reader | None = None) -> Settings:
    """Policy files (or built-in set names) -> settings. Raises PolicyError listing every problem."""
    return _beside(*read_policy(sources, read))


def from_mapping(data: dict, path: str = "<policy>", read: Reader | None = None) -> Settings:
    """An already-parsed mapping (the command line's) -> settings. Raises PolicyError."""
    return _beside(*read_mapping(data, path, read))


def credential_settings(policy: Policy) -> tuple[object, list[Problem]]:
    """The policy files' ``[credentials]`` tables, parsed (None if there is none); their
    problems located at file:line."""
    if not policy.credential_tables:
        return None, []  # egress.credentials is not even imported (egress run's start-up)
    from .credentials import CredentialError, parse_settings

    try:
        return parse_settings(policy.credential_tables), []
    except CredentialError as e:
        return None, [Problem(path, find_line(path, None, key) if key else None, message)
                      for path, key, message in e.problems]


def _beside(policy: Policy, problems: list[Problem]) -> Settings:
    credentials, more = credential_settings(policy)
    if problems or more:
        raise PolicyError(problems + more)
    return Settings(policy, credentials)
