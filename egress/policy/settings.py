"""What policy files set: the domain policy and, beside it, the credential settings.

The policy loader (egress.policy.loader) reads the files and keeps each
``[credentials]`` table as written; they are parsed here, next to it, by
egress.scan.credentials, so the domain policy knows nothing of secrets. Both sets of
problems come back together, each with file:line, and a policy whose credential
settings are wrong is not used (every command, and every live reload, loads
through here).

:func:`load_for_proxy` adds what a proxy checks when it starts: the stored secrets'
values, read now (a variable that is not set, a file that cannot be read, a value too
short, a secret bound to a host the policy does not allow). `egress serve` starts
through it and `egress policy validate` validates through it, so validate says OK
exactly when serve would start; `egress run` reads its credentials through
:func:`read_credentials`, the same checks on its own policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from egress.policy.loader import PolicyError, Problem, Reader, Sources, find_line, read_mapping, read_policy
from egress.policy.matcher import Policy

if TYPE_CHECKING:  # egress run's start-up does not import the scanner's modules
    from egress.scan.credentials import Credentials, CredentialSettings


@dataclass(frozen=True)
class Settings:
    policy: Policy
    credentials: CredentialSettings | None  # None: no table, the defaults


def load(sources: Sources, read: Reader | None = None) -> Settings:
    """Policy files (or built-in set names) -> settings. Raises PolicyError listing every problem."""
    return _beside(*read_policy(sources, read))


def from_mapping(data: dict[str, Any], path: str = "<policy>", read: Reader | None = None) -> Settings:
    """An already-parsed mapping (the command line's) -> settings. Raises PolicyError."""
    return _beside(*read_mapping(data, path, read))


def load_for_proxy(sources: Sources, environ: dict[str, str], *, broker: bool = False,
                   read: Reader | None = None) -> tuple[Policy, Credentials]:
    """Every check a proxy makes before it starts: the policy files (and their credential
    settings), then the stored secrets' values from ``environ`` and the files they name.
    Returns (policy, credentials); raises PolicyError listing every problem."""
    policy = load(sources, read).policy
    return policy, read_credentials(policy, environ, broker=broker)


def reloadable(sources: Sources, read: Reader | None = None) -> Policy:
    """A live reload's policy: the files load and the secrets they name can be read now.
    The secrets are not applied (a running proxy keeps the ones it started with), but a policy
    whose secrets cannot be read is refused: a worker restarted later would have to start with
    it (egress.serve.workers keeps the last good policy's texts), and could not."""
    policy = load(sources, read).policy
    read_credentials(policy, dict(os.environ), broker=False)
    return policy


def read_credentials(policy: Policy, environ: dict[str, str], *, broker: bool) -> Credentials:
    """The stored secrets a loaded policy describes, with their values read now (a secret may
    be bound only to hosts the policy allows); raises PolicyError, each problem at file:line."""
    from egress.scan.credentials import CredentialError, load_credentials, parse_settings

    try:
        return load_credentials(parse_settings(policy.credential_tables), environ, broker=broker,
                                host_allowed=lambda host: policy.decide(host).allowed)
    except CredentialError as e:
        raise PolicyError([_located(*problem) for problem in e.problems]) from None


def _located(path: str, key: str | None, message: str, text: str | None = None) -> Problem:
    """A credential problem as a Problem, at the line of its text as written (a host, a
    variable's name) under its key, else of its key (``env``, ``hosts``...)."""
    return Problem(path, find_line(path, text, key) if key or text else None, message)


def credential_settings(policy: Policy) -> tuple[CredentialSettings | None, list[Problem]]:
    """The policy files' ``[credentials]`` tables, parsed (None if there is none); their
    problems located at file:line."""
    if not policy.credential_tables:
        return None, []  # egress.scan.credentials is not even imported (egress run's start-up)
    from egress.scan.credentials import CredentialError, parse_settings

    try:
        return parse_settings(policy.credential_tables), []
    except CredentialError as e:
        return None, [_located(*problem) for problem in e.problems]


def _beside(policy: Policy, problems: list[Problem]) -> Settings:
    credentials, more = credential_settings(policy)
    if problems or more:
        raise PolicyError(problems + more)
    return Settings(policy, credentials)
