"""Which secrets this install holds, where each may go, and the placeholders that stand in for them.

Policy files describe credentials in a ``[credentials]`` table::

    [credentials]
    action = "block"                 # block (default) | mask
    scan_env = true                  # the caller's secret-named variables are stored secrets too
    ignore_env = ["MY_PUBLIC_KEY"]   # ...except these
    ignore_kinds = ["jwt"]           # token formats this install lets pass (see egress/scan/detect.py KINDS)

    [[credentials.secret]]
    env = "GITHUB_TOKEN"             # or: file = "~/.config/tool/token"
    hosts = ["github.com"]           # bound: it may reach these hosts (and their subdomains) only
    broker = true                    # under `egress run`, the command sees a placeholder (default: when bound)
    header = "Authorization"         # brokered: the request header(s) the real value is swapped into (default)
    swap = ["header"]                # ...and where else: "body", "query", "path" (opt-in: see below)

A brokered secret is swapped in only where it is declared to go: by default the request
headers named by ``header``. A placeholder anywhere else in a request to its host is
refused (the request would carry a useless stand-in, by mistake, or to get the real value
written into data the host keeps and shows back). ``swap`` adds the body, the query or the
path: a host that stores what it is sent there (an issue, a gist, a paste) then holds the
real value as data and can show it back; the proxy cuts off a response that does, in the
forms its detector reads, but a form it does not read reaches the command.

:func:`parse_settings` turns the tables into plain data (pure; errors carry file
and line); :func:`load_credentials` reads the values (environment, files) and
builds the :class:`Credentials` the proxy uses.
"""

from __future__ import annotations

import os
import secrets as random_source
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACTIONS = ("block", "mask")
SECRET_KEYS = ("env", "file", "hosts", "broker", "name", "header", "swap")
SWAP_PLACES = ("header", "body", "query", "path")  # where a brokered secret may be swapped in
DEFAULT_HEADERS = ("Authorization",)
DEFAULT_SWAP = ("header",)
SETTINGS_KEYS = ("action", "scan_env", "ignore_env", "ignore_kinds", "secret")

# (policy file, key, message) or, where the text as written locates the line better, (..., text)
Problem = tuple[str, str | None, str] | tuple[str, str | None, str, str | None]
_PLACEHOLDER_ALPHABET = string.ascii_letters + string.digits


class CredentialError(Exception):
    """A credential setting cannot be honoured; ``problems`` are (path, key, message), or
    (path, key, message, text) where the text as written (a variable's name, a host) locates
    the problem's line more precisely than its key (egress.policy.settings)."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(f"{p[0]}: {p[2]}" for p in problems))


@dataclass(frozen=True)
class SecretSpec:
    """One ``[[credentials.secret]]`` entry, as written."""

    path: str  # the policy file it came from
    env: str | None = None
    file: str | None = None
    hosts: tuple[str, ...] = ()
    broker: bool | None = None
    name: str | None = None
    headers: tuple[str, ...] = DEFAULT_HEADERS  # ``header``: the request headers it is swapped into
    swap: tuple[str, ...] = DEFAULT_SWAP  # where it is swapped in (SWAP_PLACES)

    @property
    def label(self) -> str:
        return self.name or self.env or Path(self.file or "secret").name

    @property
    def brokered(self) -> bool:
        return bool(self.hosts) if self.broker is None else self.broker and bool(self.hosts)


@dataclass
class CredentialSettings:
    action: str = "block"
    scan_env: bool = True
    ignore_env: list[str] = field(default_factory=list)
    ignore_kinds: list[str] = field(default_factory=list)
    secrets: list[SecretSpec] = field(default_factory=list)


def parse_settings(tables: list[tuple[str, object]]) -> CredentialSettings:
    """``[credentials]`` tables from policy files (in load order) -> settings. Raises CredentialError."""
    import difflib

    settings = CredentialSettings()
    problems: list[Problem] = []
    action_from: str | None = None
    for path, table in tables:
        if not isinstance(table, dict):
            problems.append((path, "credentials", "credentials: expected a table ([credentials])"))
            continue
        for key in table:
            if key not in SETTINGS_KEYS:
                close = difflib.get_close_matches(key, SETTINGS_KEYS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(SETTINGS_KEYS)}"
                problems.append((path, key, f"credentials: unknown key {key!r}{hint}"))
        if "action" in table:
            action = table["action"]
            if action not in ACTIONS:
                problems.append((path, "action", f"credentials.action: {action!r} is not an action; "
                                                 f"write one of {', '.join(ACTIONS)}"))
            elif action_from is not None and action != settings.action:
                problems.append((path, "action", f"credentials.action: {action!r} conflicts with "
                                                 f"{settings.action!r} set in {action_from}"))
            else:
                settings.action, action_from = action, path
        _read_scan_settings(path, table, settings, problems)
        entries = table.get("secret", [])
        if not isinstance(entries, list):
            problems.append((path, "secret", "credentials.secret: write [[credentials.secret]] tables"))
            continue
        for entry in entries:
            spec = _parse_secret(path, entry, problems)
            if spec is not None:
                settings.secrets.append(spec)
    if problems:
        raise CredentialError(problems)
    return settings


def _read_scan_settings(path: str, table: dict[str, Any], settings: CredentialSettings, problems: list[Problem]) -> None:
    """A table's ``scan_env``, ``ignore_env`` and ``ignore_kinds``, added to ``settings``."""
    import difflib

    from egress.scan.detect import KINDS

    if "scan_env" in table:
        if not isinstance(table["scan_env"], bool):
            problems.append((path, "scan_env", "credentials.scan_env: write true or false"))
        else:
            settings.scan_env = settings.scan_env and table["scan_env"]
    ignore = table.get("ignore_env", [])
    if not isinstance(ignore, list) or not all(isinstance(n, str) for n in ignore):
        problems.append((path, "ignore_env", "credentials.ignore_env: expected a list of variable names"))
    else:
        settings.ignore_env += ignore
    kinds = table.get("ignore_kinds", [])
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        problems.append((path, "ignore_kinds", "credentials.ignore_kinds: expected a list of kinds"))
        return
    for kind in kinds:
        if kind not in KINDS:
            close = difflib.get_close_matches(kind, list(KINDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append((path, "ignore_kinds", f"credentials.ignore_kinds: {kind!r} is not a kind{hint}"))
    settings.ignore_kinds += [k for k in kinds if k in KINDS]


def _parse_secret(path: str, entry: object, problems: list[Problem]) -> SecretSpec | None:
    if not isinstance(entry, dict):
        problems.append((path, "secret", "credentials.secret: each entry is a table with env or file"))
        return None
    unknown = [k for k in entry if k not in SECRET_KEYS]
    for key in unknown:
        problems.append((path, key, f"credentials.secret: unknown key {key!r}; known: {', '.join(SECRET_KEYS)}"))
    env, file = entry.get("env"), entry.get("file")
    if (env is None) == (file is None):
        problems.append((path, "secret", "credentials.secret: give exactly one of env = \"NAME\" or file = \"PATH\""))
        return None
    hosts = entry.get("hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        problems.append((path, "hosts", "credentials.secret.hosts: expected a list of host names"))
        return None
    broker = entry.get("broker")
    if broker is not None and not isinstance(broker, bool):
        problems.append((path, "broker", "credentials.secret.broker: write true or false"))
        return None
    name = entry.get("name")
    headers = entry.get("header", list(DEFAULT_HEADERS))
    if isinstance(headers, str):
        headers = [headers]
    if not isinstance(headers, list) or not all(isinstance(h, str) and _is_token(h) for h in headers):
        problems.append((path, "header", "credentials.secret.header: write a header name, or a list of them "
                                         "(default \"Authorization\")"))
        return None
    swap = entry.get("swap", list(DEFAULT_SWAP))
    if not isinstance(swap, list) or not all(isinstance(w, str) for w in swap):
        problems.append((path, "swap", f"credentials.secret.swap: expected a list of {', '.join(SWAP_PLACES)}"))
        return None
    for where in swap:
        if where not in SWAP_PLACES:
            problems.append((path, "swap", f"credentials.secret.swap: {where!r} is not a place; "
                                           f"write some of {', '.join(SWAP_PLACES)}"))
            return None
    if unknown:
        return None
    return SecretSpec(path=path, env=env, file=file, hosts=tuple(hosts), broker=broker, name=name,
                      headers=tuple(headers), swap=tuple(dict.fromkeys(swap)))


_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)


def _is_token(name: str) -> bool:
    """A header name as HTTP allows one (RFC 9110 token)."""
    return bool(name) and all(c in _TOKEN_CHARS for c in name)


# ------------------------------------------------------------------ values


@dataclass
class StoredSecret:
    label: str
    value: str
    hosts: tuple[str, ...] = ()  # empty: may go nowhere
    placeholder: str | None = None  # set when brokered: what the command sees instead
    env: str | None = None
    file: str | None = None  # the file it was read from (absolute)
    headers: tuple[str, ...] = DEFAULT_HEADERS  # brokered: the request headers it is swapped into
    swap: tuple[str, ...] = DEFAULT_SWAP  # brokered: where it is swapped in (SWAP_PLACES)

    @property
    def header_names(self) -> frozenset[str]:
        """``headers``, lower-cased: header names match in any case."""
        return frozenset(h.lower() for h in self.headers)


@dataclass
class Credentials:
    """What the credential guard needs: the action, the stored secrets, their bindings."""

    action: str
    secrets: list[StoredSecret]
    ignore_kinds: frozenset[str] = frozenset()  # well-known formats let through (stored secrets never are)

    @property
    def brokered(self) -> list[StoredSecret]:
        return [s for s in self.secrets if s.placeholder]

    def placeholder_environment(self) -> dict[str, str]:
        """Variables whose value the command sees as a placeholder."""
        return {s.env: s.placeholder for s in self.secrets if s.placeholder and s.env}

    def to_dict(self) -> dict[str, Any]:
        """As JSON-able data, placeholders included (egress run hands them to its warm proxy)."""
        return {"action": self.action, "ignore_kinds": sorted(self.ignore_kinds),
                "secrets": [{"label": s.label, "value": s.value, "hosts": list(s.hosts),
                             "placeholder": s.placeholder, "env": s.env, "file": s.file,
                             "headers": list(s.headers), "swap": list(s.swap)} for s in self.secrets]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Credentials:
        secrets = [StoredSecret(s["label"], s["value"], tuple(s["hosts"]), s["placeholder"], s["env"], s["file"],
                                tuple(s.get("headers", DEFAULT_HEADERS)), tuple(s.get("swap", DEFAULT_SWAP)))
                   for s in data["secrets"]]
        return cls(data["action"], secrets, frozenset(data["ignore_kinds"]))

    def placeholder_files(self) -> dict[str, bytes]:
        """Files the command sees with the placeholder where the secret was (the rest kept as written)."""
        shown = {}
        for secret in self.secrets:
            if secret.placeholder and secret.file:
                try:
                    text = Path(secret.file).read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    text = secret.value + "\n"  # it was readable a moment ago; show the placeholder anyway
                shown[secret.file] = text.replace(secret.value, secret.placeholder).encode()
        return shown


def load_credentials(settings: CredentialSettings, environ: dict[str, str], *, broker: bool,
                     host_allowed: Callable[[str], bool] | None = None) -> Credentials:
    """Read every stored secret's value; raises CredentialError for what cannot be honoured.

    ``broker``: make placeholders for bound secrets (egress run does; a sidecar does not).
    ``host_allowed(host) -> bool``: a secret may only be bound to hosts the policy allows.
    """
    from egress.scan.detect import MIN_SECRET_LENGTH, is_secret_name

    problems: list[Problem] = []
    stored: list[StoredSecret] = []
    named_envs = set()
    for spec in settings.secrets:
        value = _read_value(spec, environ, problems)
        if value is None:
            continue
        if len(value) < MIN_SECRET_LENGTH:
            problems.append((spec.path, spec.env and "env" or "file",
                             f"credentials.secret {spec.label}: the value is {len(value)} characters; "
                             f"a stored secret needs at least {MIN_SECRET_LENGTH} to be told apart from "
                             f"ordinary text", spec.env or spec.file))
            continue
        for host in spec.hosts:
            if host_allowed is not None and not host_allowed(host):
                problems.append((spec.path, "hosts", f"credentials.secret {spec.label}: bound to {host!r}, "
                                                     f"which the policy does not allow; allow it or unbind it",
                                 host))
        placeholder = make_placeholder(value) if broker and spec.brokered else None
        file = str(Path(os.path.expanduser(spec.file)).absolute()) if spec.file else None
        stored.append(StoredSecret(spec.label, value, spec.hosts, placeholder, spec.env, file, spec.headers, spec.swap))
        if spec.env:
            named_envs.add(spec.env)
    if settings.scan_env:
        ignored = set(settings.ignore_env)
        for name, value in environ.items():
            if name in named_envs or name in ignored or not is_secret_name(name):
                continue
            if len(value) >= MIN_SECRET_LENGTH:
                stored.append(StoredSecret(name, value, env=name))
    if problems:
        raise CredentialError(problems)
    return Credentials(settings.action, stored, frozenset(settings.ignore_kinds))


def _read_value(spec: SecretSpec, environ: dict[str, str], problems: list[Problem]) -> str | None:
    if spec.env is not None:
        value = environ.get(spec.env)
        if value is None:
            problems.append((spec.path, "env", f"credentials.secret: ${spec.env} is not set", spec.env))
        return value
    assert spec.file is not None  # an entry names env or file (_parse_secret)
    path = Path(os.path.expanduser(spec.file))
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        problems.append((spec.path, "file", f"credentials.secret: cannot read {path}: {e}", spec.file))
        return None


def make_placeholder(value: str) -> str:
    """A random stand-in of the same length that keeps the value's prefix (``ghp_``, ``sk-ant-``).

    Same length: a substituted body keeps its Content-Length. Same prefix: clients
    that check a token's shape still accept it.
    """
    cut = max((value.rfind(sep, 0, 16) for sep in "_-."), default=-1) + 1
    prefix = value[:cut] if cut >= 3 else ""
    body = "".join(random_source.choice(_PLACEHOLDER_ALPHABET) for _ in range(len(value) - len(prefix)))
    return prefix + body
