"""The domain policy's loader: TOML files, includes, built-in sets, every problem with file:line.

A policy file is TOML with its keys at the top level, so the smallest policy is
one line, ``allow = ["pypi.org"]``. Loading checks every entry (refusing public
suffixes, URLs, bad CIDRs, unknown keys, include cycles...) and reports each
problem where it can be fixed, as ``file:line: what to write instead``. The result
is an egress.policy.matcher.Policy. ``[credentials]`` tables are kept as written, for
egress.policy.settings to parse beside the policy; this module knows nothing of secrets.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import itertools
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from egress.agent.commands import Rule, compile_rule
from egress.agent.output_cap import parse_size
from egress.core.contract import NETWORK_MODES
from egress.core.hosts import _ASCII_NAME, _NUMERIC_LABEL, InvalidHost, parse_host, split_host_port
from egress.core.public_suffix import is_icann_suffix, is_public_suffix, none_public
from egress.policy.matcher import LIST_KEYS, Entry, EntryParts, Policy
from egress.policy.text import Lines, Strings, read_toml

# "container": egress run --provider podman|docker's image and mounts (egress/run/launcher.py reads it)
KNOWN_KEYS = ("include", "network", "credentials", "profile", "limits", "guardrails", "container") + LIST_KEYS
PROFILES = ("default", "agent")  # `profile = "agent"`: as `egress run --agent`
LIMIT_KEYS = ("max_output",)
GUARDRAIL_KEYS = ("deny_commands", "allow_commands")

# Built-in sets, by the name used in `include`.
BUILTIN_SETS = {"dev": "default.toml"}


# --------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy file (or worth a warning), located as precisely as we can."""

    path: str
    line: int | None
    message: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" if self.line else self.path

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"

    def as_warning(self) -> str:
        return f"{self.where}: warning: {self.message}"


class ReadRefused(Exception):
    """A read hook will not read a file; the message says why (it becomes a Problem)."""


class PolicyError(Exception):
    """A policy could not be loaded; ``problems`` lists every reason found."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


# ------------------------------------------------------------- file:line


def unknown_key(key: str, known: Sequence[str], prefix: str = "") -> str:
    """The problem for a key the policy does not know, with the closest known one or the list."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
    return f"{prefix}unknown key {key!r}{hint}"


def find_line(path: str, text: str | None, key: str | None = None) -> int | None:
    """The line of the quoted ``text`` in ``key``'s list (else anywhere), else of ``key``.

    The same text may be in several lists (``github.com`` in allow and in
    passthrough, ``10.0.0.0/8`` in deny and allow_private): the line reported is
    the one in the list meant. ``allow`` must not find ``allow_private``.

    Answers are cached per file version: the proxy names the deciding rule in every
    event, and re-reading a large file each time would stall every request (bench/README.md, Policy).
    """
    pinned = _pinned.get(path)
    if pinned is not None:
        return _find_line_cached(path, pinned[0], text, key)
    try:
        version = os.stat(path).st_mtime_ns
    except OSError:
        return None
    return _find_line_cached(path, version, text, key)


# path -> (version < 0, lines): files whose rules come from a text read earlier (see
# pin_text), so that file:line names that text, not what the file holds now.
_pinned: dict[str, tuple[int, list[str]]] = {}
_pin_versions = itertools.count(-1, -1)  # a new version per pin: cached answers never outlive it


def pin_text(path: str, text: str) -> None:
    """Name lines of ``path`` from ``text`` from now on (a snapshot reader's recorded copy)."""
    _pinned[path] = (next(_pin_versions), text.splitlines())


@functools.lru_cache(maxsize=8192)
def _find_line_cached(path: str, version: int, text: str | None, key: str | None) -> int | None:
    lines = _file_lines(path, version)
    if lines is None:
        return None
    key_at = None
    if key:
        # `key = ...`, `"key" = ...`, `key.x = ...` or a `[key]` table header
        pattern = re.compile(rf"\s*(?:\[\s*)?[\"']?{re.escape(key)}[\"']?\s*[=.\]]")
        key_at = next((n for n, line in enumerate(lines) if pattern.match(line)), None)
    if text is not None:
        for first in dict.fromkeys((key_at or 0, 0)):  # from the key's line on, then from the top
            for quote in ('"', "'"):
                needle = f"{quote}{text}{quote}"
                for number in range(first, len(lines)):
                    if needle in lines[number]:
                        return number + 1
    return key_at + 1 if key_at is not None else None


@functools.lru_cache(maxsize=8)
def _file_lines(path: str, version: int) -> list[str] | None:
    if version < 0:
        pinned = _pinned.get(path)
        return pinned[1] if pinned is not None and pinned[0] == version else None
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None


# --------------------------------------------------------------- entry parsing


class EntryError(ValueError):
    pass


# The common entry: a plain lower-case ASCII name (hosts.py's own pattern), optionally with a
# leading '*.' and a ':port'. Its parts are the very result of the general path (split_host_port
# and parse_host would return them unchanged; tests/policy/test_policy.py checks the two agree) in a
# fraction of the time. A loader reads a batch of entries at once (:func:`plain_parts`): one
# findall over the batch's lines costs less than a match per entry (bench/README.md, Policy).
# Anything else (upper case, IDN, IP, CIDR, spaces, errors) takes the general path.
_PLAIN = re.compile(r"(\*\.)?(" + _ASCII_NAME.pattern.strip("^$") + r")(?::([0-9]{1,5}))?")
_PLAIN_LINES = re.compile(rf"^(?:{_PLAIN.pattern}$|.*)", re.M)  # per line: _PLAIN's parts, or nothing
_NUMERIC_ENDS = frozenset("0123456789abcdefx")
# An IPv4 address or network written the common way (decimal octets without leading zeros: the
# general path reads '010.0.0.1' as octal), with an optional port, read in a fraction of the
# general path's time (bench/README.md, Policy): that reads every inet_aton form, and builds the
# network from text.
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}(?:/(3[0-2]|[12]?[0-9]))?(?::([0-9]{{1,5}}))?")


def parse_entry(text: str, key: str) -> Entry:
    """Parse one list entry; raise EntryError with what to write instead."""
    return Entry._make(entry_parts(text, key))


def entry_parts(text: str, key: str) -> EntryParts:
    """:func:`parse_entry`'s (kind, value, port) as a plain tuple: what a loader adds."""
    return plain_parts([text], key)[0] or _other_parts(text, key)


def plain_parts(texts: Sequence[Any], key: str) -> list[EntryParts | None]:
    """:func:`entry_parts` of each plain entry of ``texts``, a batch read at once; None for each
    other text (for :func:`_other_parts`), for every text of a batch with one that is not a
    string or holds a newline, and for a plain entry there is something to say about: no dot
    (a top-level domain, or localhost), a port in ``allow_private``, none in ``passthrough``."""
    try:
        found: list[tuple[str, str, str]] = _PLAIN_LINES.findall("\n".join(texts))
    except TypeError:  # not all strings
        found = []
    if len(found) != len(texts):  # that, or a newline in a text
        return [None] * len(texts)
    ports_ok, bare_ok, suffixes = key != "allow_private", key != "passthrough", key != "deny"
    # A last label that is a number makes an IPv4 address (general path); only a digit, a-f
    # or x can end one, and most names end otherwise: the cheap test first.
    parts: list[Any] = [  # (kind, name, port) or None
        ("subdomains" if wildcard else "domain", name, int(port) if port else None)
        if name and len(name) <= 253 and (0 < int(port) < 65536 and ports_ok if port else bare_ok)
        and (name[-1] not in _NUMERIC_ENDS or not _NUMERIC_LABEL.match(name.rpartition(".")[2]))
        and ("." in name or not suffixes) else None
        for wildcard, name, port in found]
    # a public suffix is refused (_other_parts says so); a few set operations say the batch has none
    if suffixes and not none_public([entry[1] for entry in parts if entry is not None]):
        parts = [None if entry is None or is_public_suffix(entry[1]) else entry for entry in parts]
    return parts


def _other_parts(text: object, key: str) -> EntryParts:
    """:func:`entry_parts` of an entry :func:`plain_parts` leaves (any entry, but slower)."""
    if not isinstance(text, str):
        raise EntryError(f"{key}: entries must be strings, not {type(text).__name__} {text!r}")
    quad = _IPV4.fullmatch(text)
    if quad is not None:
        a, b, c, d, prefixlen, port_text = quad.groups()
        address, prefixlen = int(a) << 24 | int(b) << 16 | int(c) << 8 | int(d), int(prefixlen or 32)
        port = int(port_text) if port_text is not None else None
        if not address & (0xFFFFFFFF >> prefixlen) and (port is None or 0 < port < 65536):  # else: say why
            return ("net", ipaddress.IPv4Network((address, prefixlen)), port)
    host_part, port, exact = _split_entry(text, key)
    if "/" in host_part:
        return _parse_cidr(host_part.strip("[]"), port, text, key)
    return _name_entry(host_part, port, exact, text, key)


def _split_entry(text: str, key: str) -> tuple[str, int | None, bool]:
    """(host part, port, exact) of an entry as written; raises EntryError for a URL, a bare
    wildcard and the like."""
    raw = text.strip()
    if not raw:
        raise EntryError(f"{key}: empty entry")
    if "://" in raw:
        named = raw.split("://", 1)[1].split("/", 1)[0]
        raise EntryError(f"{key}: {text!r} is a URL; write the host only, e.g. {named!r}")
    if raw in ("*", "*.", "**"):
        hint = ("to allow every domain, run with --network all instead"
                if key == "allow" else "list the domains themselves")
        raise EntryError(f"{key}: a bare {raw!r} is not allowed; {hint}")

    # Split off an optional port, keeping CIDR slashes and IPv6 brackets intact.
    try:
        host_part, port = split_host_port(raw)
    except InvalidHost as e:
        raise EntryError(f"{key}: {e}") from None

    # '=host': that exact host, none of its subdomains. A leading mark like '*.', read
    # before anything else; it is the one way to name a host that is itself a public
    # suffix of the list's private section (httpbin.org, s3.amazonaws.com).
    exact = host_part.startswith("=")
    if exact:
        host_part = host_part[1:].strip()
        if host_part.startswith("*") or "/" in host_part:
            raise EntryError(f"{key}: {text!r}: '=' names one exact host; it takes neither a "
                             f"wildcard nor a CIDR")
    return host_part, port, exact


def _name_entry(host_part: str, port: int | None, exact: bool, text: str, key: str) -> Entry:
    """The entry for a host name or an IP address (not a CIDR), ``*.`` and ``=`` read."""
    wildcard = False
    if host_part.startswith("*."):
        wildcard, host_part = True, host_part[2:]
    if "*" in host_part:
        raise EntryError(
            f"{key}: {text!r} has a wildcard in the middle of the name; only a leading "
            f"'*.' is understood (e.g. '*.example.com'), or write 'example.com' for the "
            f"domain and all its subdomains")
    try:
        host = parse_host(host_part)
    except InvalidHost as e:
        raise EntryError(f"{key}: {e}") from None
    if host.ip is not None:
        if wildcard:
            raise EntryError(f"{key}: {text!r}: a wildcard cannot apply to an IP address")
        if exact:
            raise EntryError(f"{key}: {text!r}: an IP address is always exact; write "
                             f"{text.strip()[1:].strip()!r}")
        return Entry("net", ipaddress.ip_network(host.ip), port)
    if exact:
        if key != "deny" and is_icann_suffix(host.name):
            raise EntryError(f"{key}: {text!r} is a public suffix, not a host: sites are registered "
                             f"under it; write a registrable domain such as 'example.{host.name}'")
        return Entry("exact", host.name, port)
    if key != "deny":
        _refuse_public_suffix(host.name, text, key, port, wildcard)
    return Entry("subdomains" if wildcard else "domain", host.name, port)


def _parse_cidr(text: str, port: int | None, original: str, key: str) -> Entry:
    try:
        return Entry("net", ipaddress.ip_network(text, strict=True), port)
    except ValueError as e:
        try:
            fixed = ipaddress.ip_network(text, strict=False)
        except ValueError:
            if "/" in text and not _looks_like_ip(text.split("/", 1)[0]):
                raise EntryError(
                    f"{key}: {original!r} has a path; write the host only, "
                    f"e.g. {text.split('/', 1)[0]!r}") from None
            raise EntryError(f"{key}: {original!r} is not a valid CIDR ({e})") from None
        raise EntryError(
            f"{key}: {original!r} has host bits set; did you mean {str(fixed)!r}?") from None


def _looks_like_ip(text: str) -> bool:
    try:
        return parse_host(text).is_ip
    except InvalidHost:
        return False


def _refuse_public_suffix(name: str, text: str, key: str, port: int | None = None,
                          wildcard: bool = False) -> None:
    if "." not in name and name != "localhost":
        raise EntryError(
            f"{key}: {text!r} is a top-level domain: it would cover every site under it; "
            f"write a registrable domain such as 'example.{name}'")
    if is_public_suffix(name):
        # A suffix only the list's private section names (github.io, httpbin.org) is also a
        # company's own host: that host alone may be allowed. An ICANN one (co.uk) is no host.
        if not wildcard and not is_icann_suffix(name):
            exact = f"={name}" + (f":{port}" if port is not None else "")
            raise EntryError(
                f"{key}: {text!r} is a public suffix (in the list's private section): it would cover "
                f"every site registered under it; write {exact!r} to allow that host only, or a "
                f"registrable domain such as 'example.{name}'")
        raise EntryError(
            f"{key}: {text!r} is a public suffix: it would cover every site registered "
            f"under it; write a registrable domain such as 'example.{name}'")


def passthrough_warning(text: str) -> str | None:
    """Why a passthrough entry deserves a second look, or None.

    Without a port it relays every protocol on every port of that host untouched
    (ssh, SMTP, anything): rarely what was meant for a host with pinned HTTPS.
    """
    try:
        host, port = split_host_port(text.strip())
    except InvalidHost:
        return None
    if port is not None:
        return None
    bare = host.strip("[]")
    suggestion = f"[{bare}]:443" if ":" in bare else f"{bare}:443"  # IPv6 takes brackets before a port
    return (f"passthrough: {text!r} has no port: every protocol on every port of it is relayed "
            f"untouched, never inspected; write {suggestion!r} (or the port it needs) to open "
            f"only that")


# ------------------------------------------------------------------ loading


def builtin_dir() -> Path:
    """Where the shipped policy files live (installed package or source tree)."""
    try:
        return Path(str(resources.files("egress.policies")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "policies"


@functools.cache
def _builtin_sets() -> dict[Path, str]:
    """Every shipped set's file (resolved) and text, read once per process.

    They are package data, not user files: a reinstall under a running ``serve``
    (``pip install -e .`` replacing site-packages) deletes them, and the next live
    reload must still find them, not look for ``dev`` in the working directory.
    """
    sets = {}
    for path in sorted(builtin_dir().glob("*.toml")):
        try:
            sets[path.resolve()] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # reported as a missing set where it is named
    return sets


def builtin_path(name: str) -> Path | None:
    """The file of built-in set ``name`` (``dev``), or None if there is no such set."""
    file = BUILTIN_SETS.get(name, f"{name}.toml")
    path = (builtin_dir() / file).resolve()
    return path if path in _builtin_sets() else None


def _is_set_name(text: str) -> bool:
    """A bare word (no slash, no .toml) names a built-in set, never a file in the working directory."""
    return "/" not in text and not text.endswith(".toml")


# What a loader calls between pieces of its work (a few hundred entries, or a chunk of text), or
# None. A live reload builds in a thread beside the proxy's event loop and sets it (egress.host.live):
# a build that never stops to sleep holds the GIL, and the loop then waits up to the switch
# interval (5 ms) for it after each of its own system calls: a reload would stall the proxy
# (bench/README.md, Policy).
PACE: ContextVar[Callable[[], None] | None] = ContextVar("egress_policy_pace", default=None)
BATCH = 256  # entries between two calls of the pace (well under the switch interval)


def _no_pause() -> None:
    pass


def read_file(path: Path) -> str:
    """The default read hook: the file as it is now (as ``Path.read_text``).

    Read a MiB at a time with the loader's pause between pieces (:data:`PACE`): a large policy
    decoded in one call held the GIL longer than any other step of a reload (bench/README.md, Policy).
    """
    pause, text = PACE.get() or _no_pause, []
    try:
        with path.open(encoding="utf-8") as file:
            while piece := file.read(1 << 20):
                text.append(piece)
                pause()
    except UnicodeDecodeError:
        return path.read_text(encoding="utf-8")  # raises again, the position counted in the file
    return "".join(text)


Reader = Callable[[Path], str]
Report = Callable[..., None]  # load_mapping's problem(message, needle, key, to=, line=)
Adder = Callable[[list[EntryParts | None], Sequence[Any], Sequence[int]], None]  # Policy.adder's add
Sources = list[str] | tuple[str, ...] | str  # policy files or built-in set names


class _Loader:
    def __init__(self, policy: Policy, problems: list[Problem], read: Reader | None = None):
        self.pause = PACE.get() or _no_pause
        self.policy = policy
        self.problems = problems
        self.loaded: set[Path] = set()
        self.read = read or read_file
        # A reader that serves recorded texts also says where each path led when it
        # read it: names, include folders and cycles then follow that, not a symlink
        # changed since.
        self.resolve = getattr(read, "resolve", None) or Path.resolve

    def load_file(self, given: Path, stack: tuple[Path, ...], included_as: str | None = None,
                  missing: Callable[[], None] | None = None) -> None:
        """Load ``given``; ``missing()`` reports it if there is no such file (default: here)."""
        path = self.resolve(given)
        if path in stack:
            chain = " -> ".join(str(p) for p in stack + (path,))
            line = find_line(str(stack[-1]), included_as, "include") if included_as else None
            self.problems.append(Problem(str(stack[-1]), line, f"include cycle: {chain}"))
            return
        if path in self.loaded:
            return  # a diamond include: the same rules once
        self.loaded.add(path)
        try:
            text = _builtin_sets().get(path) or self.read(given.absolute())
        except ReadRefused as e:
            self.problems.append(Problem(str(given.absolute()), None, str(e)))
            return
        except FileNotFoundError:
            self.loaded.discard(path)  # each include of a missing file is reported where it is
            if missing is not None:
                missing()
            else:
                self.problems.append(Problem(str(path), None, "no such file"))
            return
        except (OSError, UnicodeDecodeError) as e:
            self.problems.append(Problem(str(path), None, f"cannot read: {e}"))
            return
        try:
            data, lines = read_toml(text, self.pause)
        except tomllib.TOMLDecodeError as e:
            self.problems.append(_toml_problem(str(path), e, text))
            return
        del text  # a large file's text is not kept while its rules are built
        self.load_mapping(data, str(path), True, stack + (path,), lines)

    def load_mapping(self, data: dict[str, Any], path: str, from_file: bool, stack: tuple[Path, ...],
                     lines: dict[str, Lines] | None = None) -> None:
        """Add ``data``'s rules; ``lines``: the line of each entry of its lists (egress.policy.text)."""
        policy = self.policy
        source = policy.add_source(path)
        lines = lines or {}

        def problem(message: str, needle: str | None = None, key: str | None = None,
                    to: list[Problem] | None = None, line: int | None = None) -> None:
            if line is None and (needle or key) and from_file:
                line = find_line(path, needle, key)
            (self.problems if to is None else to).append(Problem(path, line, message))

        for key in data:
            if key not in KNOWN_KEYS:
                problem(unknown_key(key, KNOWN_KEYS), key=key)

        if "credentials" in data:
            policy.credential_tables.append((path, data["credentials"]))

        if "profile" in data:
            self.load_profile(data["profile"], problem)
        if "limits" in data:
            self.load_limits(data["limits"], problem)
        if "guardrails" in data:
            self.load_guardrails(data["guardrails"], path, from_file, problem)
        if "network" in data:
            self.load_network(data["network"], problem)
        self.load_includes(data.get("include", []), path, from_file, stack, problem)
        self.load_lists(data, source, lines, problem)

    def load_network(self, mode: object, problem: Report) -> None:
        policy = self.policy
        if mode not in NETWORK_MODES:
            problem(f"network: {mode!r} is not a mode; write one of {', '.join(NETWORK_MODES)}", key="network")
        elif policy.network not in (None, mode):
            problem(f"network: {mode!r} conflicts with {policy.network!r} set by another file", key="network")
        else:
            policy.network = mode

    def load_includes(self, includes: object, path: str, from_file: bool, stack: tuple[Path, ...],
                      problem: Report) -> None:
        """Load each file (or built-in set) ``include`` names, relative to the including file."""
        if isinstance(includes, str):
            includes = [includes]
        if not isinstance(includes, list):
            problem("include: expected a list of file paths or built-in set names", key="include")
            includes = []
        base = Path(path).parent if from_file else Path.cwd()
        for name in includes:
            if not isinstance(name, str):
                problem(f"include: entries must be strings, not {name!r}", key="include")
                continue
            bare = _is_set_name(name)
            target = builtin_path(name) if bare else None
            missing = None
            if target is None:
                target = base / name
                # Reported where it can be fixed: the including file, at the include. Whether
                # the file exists is the reader's answer (a recorded file may be gone since).
                if bare:
                    known = ", ".join(sorted(BUILTIN_SETS))
                    missing = functools.partial(
                        problem, f"include: {name!r} is neither a file nor a built-in set ({known})", name)
                else:
                    missing = functools.partial(
                        problem, f"include: {name!r}: no such file ({target})", name, "include")
            self.load_file(target, stack, name, missing)

    def load_lists(self, data: dict[str, Any], source: int, lines: dict[str, Lines], problem: Report) -> None:
        """Add the entries of each list key of ``data`` (from ``source``), a batch at a time."""
        policy = self.policy
        for key in LIST_KEYS:
            entries = data.get(key, [])
            if not isinstance(entries, (list, Strings)):
                problem(f"{key}: expected a list of strings, e.g. {key} = [\"example.com\"]", key=key)
                continue
            add = policy.adder(key, source, len(entries), self.pause)
            # the line of each entry, noted while reading (0: not known); none for a mapping
            key_lines = lines.get(key) or [0] * len(entries)
            for start in range(0, len(entries), BATCH):
                self.pause()
                self._add_batch(key, add, entries[start:start + BATCH], key_lines[start:start + BATCH],
                                problem)

    def _add_batch(self, key: str, add: Adder, entries: Sequence[Any], lines: Sequence[int], problem: Report
                   ) -> None:
        """Add ``entries`` (with their ``lines``) of ``key`` through ``add``; ``problem()`` the rest."""
        parts = plain_parts(entries, key)
        for n in [n for n, part in enumerate(parts) if part is None] if None in parts else ():
            entry_text, line = entries[n], lines[n]
            try:
                entry = _other_parts(entry_text, key)
            except EntryError as e:
                problem(str(e), entry_text if isinstance(entry_text, str) else None, key, line=line or None)
                continue  # parts[n] stays None: left out
            port = entry[2]
            if port is not None and key == "allow_private":
                problem(f"allow_private: {entry_text!r}: a port means nothing here (it names which "
                        f"hosts or ranges may be private); write it without ':{port}'",
                        entry_text, key, line=line or None)
                continue
            if port is None and key == "passthrough":
                problem(passthrough_warning(entry_text), entry_text, key, to=self.policy.warnings,
                        line=line or None)
            parts[n] = entry
        add(parts, entries, lines)

    def load_profile(self, profile: object, problem: Report) -> None:
        policy = self.policy
        if profile not in PROFILES:
            problem(f"profile: {profile!r} is not a profile; write one of {', '.join(map(repr, PROFILES))}",
                    key="profile")
        elif policy.profile not in (None, profile):
            problem(f"profile: {profile!r} conflicts with {policy.profile!r} set by another file", key="profile")
        else:
            policy.profile = profile

    def load_limits(self, table: object, problem: Report) -> None:
        if not isinstance(table, dict):
            problem("limits: expected a table, e.g. [limits] max_output = \"256K\"", key="limits")
            return
        for key, value in table.items():
            if key not in LIMIT_KEYS:
                problem(unknown_key(key, LIMIT_KEYS, "limits: "), key=key)
                continue
            try:
                size = parse_size(value)
            except ValueError as e:
                problem(f"limits: max_output: {e}", key=key)
                continue
            # Several files: the smallest cap stands (a cap is a guard; the stricter one wins).
            current = self.policy.max_output
            self.policy.max_output = size if current is None or (size and (not current or size < current)) \
                else current

    def load_guardrails(self, table: object, path: str, from_file: bool, problem: Report) -> None:
        if not isinstance(table, dict):
            problem("guardrails: expected a table, e.g. [guardrails] deny_commands = [\"git push --force\"]",
                    key="guardrails")
            return
        for key, entries in table.items():
            if key not in GUARDRAIL_KEYS:
                problem(unknown_key(key, GUARDRAIL_KEYS, "guardrails: "), key=key)
                continue
            if not isinstance(entries, list):
                problem(f"guardrails: {key}: expected a list of strings, e.g. {key} = [\"git push --force\"]",
                        key=key)
                continue
            kind = "deny" if key == "deny_commands" else "allow"
            for entry in entries:
                if not isinstance(entry, str) or not entry.strip():
                    problem(f"guardrails: {key}: entries must be non-empty strings, not {entry!r}", key=key)
                    continue
                pattern, warning = compile_rule(entry)
                line = find_line(path, entry, key) if from_file else None
                if warning:
                    problem(f"guardrails: {key}: {warning}", entry, key, to=self.policy.warnings)
                where = f"{path}:{line}" if line else path
                self.policy.command_rules.append(Rule(kind, entry, where, pattern))


def _toml_problem(path: str, error: tomllib.TOMLDecodeError, text: str) -> Problem:
    message = str(error)
    line = None
    if "(at line " in message:
        message, _, where = message.rpartition(" (at line ")
        try:
            line = int(where.split(",")[0])
        except ValueError:
            pass
    elif message.endswith("(at end of document)"):
        # e.g. an array never closed: the end of the file is the place to look
        line = text.count("\n") + (not text.endswith("\n"))
    return Problem(path, line, f"not valid TOML: {message}")


def read_policy(sources: Sources, read: Reader | None = None
                ) -> tuple[Policy, list[Problem]]:
    """Load one or more policy files (or built-in set names) into one policy, and every problem
    found (the policy is unusable if there is one: :func:`load_policy` raises them).

    ``read(path) -> str`` reads each file (default :func:`read_file`); it may raise
    OSError, or :class:`ReadRefused` to keep a file out.
    """
    if isinstance(sources, str):
        sources = [sources]
    policy = Policy()
    problems: list[Problem] = []
    loader = _Loader(policy, problems, read)
    for source in sources:
        path = Path(source)
        if _is_set_name(source):
            path = builtin_path(source) or path  # not a set: the file's problem names it
        loader.load_file(path, ())
    policy.allow_all = policy.network == "all"
    return policy, problems


def read_mapping(data: dict[str, Any], path: str = "<policy>", read: Reader | None = None
                 ) -> tuple[Policy, list[Problem]]:
    """A policy from an already-parsed mapping (``include`` resolved relative to cwd), and its problems."""
    policy = Policy()
    problems: list[Problem] = []
    _Loader(policy, problems, read).load_mapping(data, path, from_file=False, stack=())
    policy.allow_all = policy.network == "all"
    return policy, problems


def load_policy(sources: Sources, read: Reader | None = None) -> Policy:
    """:func:`read_policy`, raising :class:`PolicyError` listing every problem found."""
    return _usable(*read_policy(sources, read))


def policy_from_mapping(data: dict[str, Any], path: str = "<policy>", read: Reader | None = None) -> Policy:
    """:func:`read_mapping`, raising :class:`PolicyError` listing every problem found."""
    return _usable(*read_mapping(data, path, read))


def _usable(policy: Policy, problems: list[Problem]) -> Policy:
    if problems:
        raise PolicyError(problems)
    return policy

