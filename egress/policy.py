"""The domain policy: plain data and pure functions, no sockets, no DNS.

A policy file is TOML with its keys at the top level, so the smallest policy is
one line, ``allow = ["pypi.org"]``. Semantics:

* ``example.com`` covers the apex and every subdomain; ``*.example.com`` covers
  subdomains only; ``host:443`` narrows an entry to one port.
* IP addresses and CIDRs match IP literals only; a domain entry never matches
  an IP literal.
* ``deny`` wins over every ``allow``.

Lookups cost O(labels of the host) for names and O(distinct prefix lengths) for
addresses, whatever the number of rules: entries live in dictionaries keyed by
the name (or the masked network), never in a list that is scanned.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import gc
import importlib.util
import ipaddress
import itertools
import os
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

from . import reasons
from .hosts import Host, InvalidHost, IPAddress, parent_domains, parse_host, split_host_port
from .hosts import _ASCII_NAME, _NUMERIC_LABEL  # the fast path of _parse_entry must agree with parse_host

LIST_KEYS = ("allow", "deny", "passthrough", "allow_private")
NETWORK_MODES = ("allowlist", "all", "off")
KNOWN_KEYS = ("include", "network", "credentials") + LIST_KEYS

# Built-in sets, by the name used in `include`.
BUILTIN_SETS = {"dev": "default.toml"}


# --------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy file, located as precisely as we can."""

    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.message}"


class ReadRefused(Exception):
    """A read hook will not read a file; the message says why (it becomes a Problem)."""


class PolicyError(Exception):
    """A policy could not be loaded; ``problems`` lists every reason found."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


# ---------------------------------------------------------------------- rules


@dataclass(frozen=True, slots=True)
class Rule:
    """An entry of a policy list, as written, with the file it came from."""

    key: str  # allow | deny | passthrough | allow_private
    text: str  # the entry as written in the file
    path: str

    def location(self) -> str:
        """``path:line`` of the entry (found on demand: loading stays fast)."""
        line = _find_line(self.path, self.text, self.key)
        return f"{self.path}:{line}" if line else self.path

    def __str__(self) -> str:
        return f"{self.text} ({self.location()})"


def _find_line(path: str, text: str | None, key: str | None = None) -> int | None:
    """The line of the quoted ``text`` in ``key``'s list (else anywhere), else of ``key``.

    The same text may be in several lists (``github.com`` in allow and in
    passthrough, ``10.0.0.0/8`` in deny and allow_private): the line reported is
    the one in the list meant. ``allow`` must not find ``allow_private``.

    Answers are cached per file version: the proxy names the deciding rule in every
    event, and re-reading the file each time cost up to 100 ms per request.
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


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer for one destination: allowed or not, why, and which rule said so."""

    host: str
    port: int | None
    allowed: bool
    reason: str  # "allowed" or a code from egress.reasons.REFUSALS
    rule: Rule | None = None
    detail: str = ""

    def words(self) -> str:
        """Plain words a person can act on."""
        if self.allowed:
            if self.rule is None:
                return f"allowed ({self.detail})" if self.detail else "allowed"
            return f"matched {self.rule}"
        text = reasons.words(self.reason)
        if self.rule is not None:
            text += f": matched {self.rule}"
        if self.detail:
            text += f" ({self.detail})"
        return text


# --------------------------------------------------------------- entry parsing


@dataclass(frozen=True, slots=True)
class _Entry:
    kind: str  # "domain" (apex + subdomains) | "subdomains" | "net"
    value: str | ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None


class _EntryError(ValueError):
    pass


def _parse_entry(text: str, key: str) -> _Entry:
    """Parse one list entry; raise _EntryError with what to write instead."""
    if not isinstance(text, str):
        raise _EntryError(f"{key}: entries must be strings, not {type(text).__name__} {text!r}")
    # Fast path for the common entry: a plain lower-case ASCII name, optionally
    # with a leading '*.' and a ':port'. It gives the very result of the general
    # path below (split_host_port and parse_host would return the parts unchanged;
    # tests/test_policy.py checks the two agree) in about half the time: ~1.5 s
    # of a 1M-entry load. Anything else (upper case, IDN, IP, CIDR, spaces,
    # errors) takes the general path.
    name, colon, port_text = text.partition(":")
    wildcard = name.startswith("*.")
    if wildcard:
        name = name[2:]
    if (_ASCII_NAME.fullmatch(name) and len(name) <= 253
            and not _NUMERIC_LABEL.match(name.rpartition(".")[2])
            and (not colon or (len(port_text) <= 5 and port_text.isascii() and port_text.isdigit()
                               and 0 < int(port_text) < 65536))):
        if key != "deny":
            _refuse_public_suffix(name, text, key)
        return _Entry("subdomains" if wildcard else "domain", name, int(port_text) if colon else None)
    raw = text.strip()
    if not raw:
        raise _EntryError(f"{key}: empty entry")
    if "://" in raw:
        host = raw.split("://", 1)[1].split("/", 1)[0]
        raise _EntryError(f"{key}: {text!r} is a URL; write the host only, e.g. {host!r}")
    if raw in ("*", "*.", "**"):
        hint = ("to allow every domain, run with --network all instead"
                if key == "allow" else "list the domains themselves")
        raise _EntryError(f"{key}: a bare {raw!r} is not allowed; {hint}")

    # Split off an optional port, keeping CIDR slashes and IPv6 brackets intact.
    try:
        host_part, port = split_host_port(raw)
    except InvalidHost as e:
        raise _EntryError(f"{key}: {e}") from None

    if "/" in host_part:
        return _parse_cidr(host_part.strip("[]"), port, text, key)

    wildcard = False
    if host_part.startswith("*."):
        wildcard, host_part = True, host_part[2:]
    if "*" in host_part:
        raise _EntryError(
            f"{key}: {text!r} has a wildcard in the middle of the name; only a leading "
            f"'*.' is understood (e.g. '*.example.com'), or write 'example.com' for the "
            f"domain and all its subdomains")
    try:
        host = parse_host(host_part)
    except InvalidHost as e:
        raise _EntryError(f"{key}: {e}") from None
    if host.is_ip:
        if wildcard:
            raise _EntryError(f"{key}: {text!r}: a wildcard cannot apply to an IP address")
        return _Entry("net", ipaddress.ip_network(host.ip), port)
    if key != "deny":
        _refuse_public_suffix(host.name, text, key)
    return _Entry("subdomains" if wildcard else "domain", host.name, port)


def _parse_cidr(text: str, port: int | None, original: str, key: str) -> _Entry:
    try:
        return _Entry("net", ipaddress.ip_network(text, strict=True), port)
    except ValueError as e:
        try:
            fixed = ipaddress.ip_network(text, strict=False)
        except ValueError:
            if "/" in text and not _looks_like_ip(text.split("/", 1)[0]):
                raise _EntryError(
                    f"{key}: {original!r} has a path; write the host only, "
                    f"e.g. {text.split('/', 1)[0]!r}") from None
            raise _EntryError(f"{key}: {original!r} is not a valid CIDR ({e})") from None
        raise _EntryError(
            f"{key}: {original!r} has host bits set; did you mean {str(fixed)!r}?") from None


def _looks_like_ip(text: str) -> bool:
    try:
        return parse_host(text).is_ip
    except InvalidHost:
        return False


def _refuse_public_suffix(name: str, text: str, key: str) -> None:
    if "." not in name and name != "localhost":
        raise _EntryError(
            f"{key}: {text!r} is a top-level domain: it would cover every site under it; "
            f"write a registrable domain such as 'example.{name}'")
    if is_public_suffix(name):
        raise _EntryError(
            f"{key}: {text!r} is a public suffix: it would cover every site registered "
            f"under it; write a registrable domain such as 'example.{name}'")


@functools.cache
def _suffix_rules() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """The public suffix list bundled with tldextract, as (exact, wildcard parents, exceptions).

    The snapshot file shipped inside the tldextract package is read directly: it is
    the only source (nothing is ever fetched), and importing tldextract itself
    (which imports requests) would cost ~75 ms on every `egress run`.
    """
    spec = importlib.util.find_spec("tldextract")
    if spec is None or spec.origin is None:
        raise RuntimeError("tldextract is not installed (pip install tldextract)")
    text = (Path(spec.origin).parent / ".tld_set_snapshot").read_text(encoding="utf-8")
    exact, wild, exceptions = set(), set(), set()
    for line in text.splitlines():
        rule = line.strip()
        if not rule or rule.startswith("//"):
            continue
        rule = rule.split()[0]
        target = exact
        if rule.startswith("!"):
            target, rule = exceptions, rule[1:]
        elif rule.startswith("*."):
            target, rule = wild, rule[2:]
        target.add(rule)  # IDN rules stay in Unicode: names are decoded to match them (rarely needed)
    return frozenset(exact), frozenset(wild), frozenset(exceptions)


def is_public_suffix(name: str) -> bool:
    """True if ``name`` (canonical punycode) is itself a public suffix (``com``, ``co.uk``, ``github.io``)."""
    exact, wild, exceptions = _suffix_rules()
    candidates = [name]
    if "xn--" in name:  # the list writes IDN suffixes in Unicode
        import idna

        try:
            candidates.append(idna.decode(name))
        except idna.IDNAError:
            pass
    for candidate in candidates:
        if candidate in exact:
            return True
        if candidate in exceptions:
            continue
        parent = candidate.partition(".")[2]
        if parent and parent in wild:
            return True
    return False


@functools.cache
def _registrable_extractor():
    import tldextract

    return tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


def registrable_domain(host: str) -> str | None:
    """``a.b.example.co.uk`` -> ``example.co.uk``; None for IPs and bare suffixes.

    A name under a suffix the public list does not know (``.test``, ``.internal``)
    counts its last two labels.
    """
    result = _registrable_extractor()(host)
    if result.suffix:
        return f"{result.domain}.{result.suffix}" if result.domain else None
    if result.ipv4 or result.ipv6 or not result.domain:
        return None
    return ".".join(host.rsplit(".", 2)[-2:])


# ---------------------------------------------------------------------- tables


class _DomainTable:
    """Domain entries keyed by name: a lookup walks the host's parents, O(labels)."""

    def __init__(self) -> None:
        # name -> list of (port or None, rule index); two maps for the two wildcard kinds.
        self.apex_and_subdomains: dict[str, list[tuple[int | None, int]]] = {}
        self.subdomains_only: dict[str, list[tuple[int | None, int]]] = {}

    def add(self, entry: _Entry, rule: int) -> None:
        table = self.subdomains_only if entry.kind == "subdomains" else self.apex_and_subdomains
        table.setdefault(entry.value, []).append((entry.port, rule))

    def match(self, name: str, port: int | None) -> int | None:
        """The most specific rule covering ``name`` (and ``port``), or None."""
        for depth, candidate in enumerate(parent_domains(name)):
            for table in (self.apex_and_subdomains, self.subdomains_only):
                if depth == 0 and table is self.subdomains_only:
                    continue
                for rule_port, rule in table.get(candidate, ()):
                    if rule_port is None or rule_port == port:
                        return rule
        return None

    def __len__(self) -> int:
        return len(self.apex_and_subdomains) + len(self.subdomains_only)


class _NetTable:
    """IP and CIDR entries keyed by masked network: O(distinct prefix lengths) per lookup."""

    def __init__(self) -> None:
        # (version, prefixlen) -> {network int: [(port, rule)]}
        self.by_prefix: dict[tuple[int, int], dict[int, list[tuple[int | None, int]]]] = {}
        self._order: dict[int, list[tuple[int, dict]]] | None = None

    def add(self, entry: _Entry, rule: int) -> None:
        net = entry.value
        bucket = self.by_prefix.setdefault((net.version, net.prefixlen), {})
        bucket.setdefault(int(net.network_address), []).append((entry.port, rule))
        self._order = None

    def _prefixes(self, version: int) -> list[tuple[int, dict]]:
        if self._order is None:
            # Longest prefix first: the most specific rule is the one reported.
            order: dict[int, list[tuple[int, dict]]] = {4: [], 6: []}
            for (ver, plen), bucket in sorted(self.by_prefix.items(), key=lambda kv: -kv[0][1]):
                order[ver].append((plen, bucket))
            # Published only when complete: a concurrent first lookup must never
            # see a half-built (say, empty) list and miss a deny rule.
            self._order = order
        return self._order[version]

    def match(self, ip: IPAddress, port: int | None) -> int | None:
        value, bits = int(ip), ip.max_prefixlen
        for plen, bucket in self._prefixes(ip.version):
            masked = (value >> (bits - plen)) << (bits - plen) if plen else 0
            for rule_port, rule in bucket.get(masked, ()):
                if rule_port is None or rule_port == port:
                    return rule
        return None

    def __len__(self) -> int:
        return sum(len(b) for b in self.by_prefix.values())


@dataclass
class _List:
    domains: _DomainTable = field(default_factory=_DomainTable)
    nets: _NetTable = field(default_factory=_NetTable)

    def add(self, entry: _Entry, rule: int) -> None:
        (self.nets if entry.kind == "net" else self.domains).add(entry, rule)

    def match(self, host: Host, port: int | None) -> int | None:
        if host.ip is not None:
            return self.nets.match(host.ip, port)
        return self.domains.match(host.name, port)


# ---------------------------------------------------------------------- policy


class Policy:
    """A loaded policy. Build with :func:`load_policy` or :meth:`Policy.from_mapping`."""

    def __init__(self) -> None:
        self._rules: list[tuple[str, str, int]] = []  # (key, text, source index)
        self._sources: list[str] = []
        self._lists = {key: _List() for key in LIST_KEYS}
        self.files: list[str] = []  # every file that went into this policy, in load order
        # network mode "all": every destination not denied is allowed (addresses are still checked)
        self.allow_all = False
        # the `network` key of the policy files (for `egress run`), None if no file sets it
        self.network: str | None = None
        # the [credentials] tables, as (file, table), in load order (see egress.credentials)
        self.credential_tables: list[tuple[str, object]] = []

    # -- building

    def _add(self, key: str, entry: _Entry, text: str, source: int) -> None:
        self._rules.append((key, text, source))
        self._lists[key].add(entry, len(self._rules) - 1)

    def _rule(self, index: int | None) -> Rule | None:
        if index is None:
            return None
        key, text, source = self._rules[index]
        return Rule(key, text, self._sources[source])

    @property
    def rule_count(self) -> int:
        return len(self._rules)

    # -- decisions (pure)

    def decide(self, host: str | Host, port: int | None = None) -> Decision:
        """Allow or refuse ``host`` (as the client wrote it) on ``port``. No network."""
        if not isinstance(host, Host):
            try:
                host = parse_host(host)
            except InvalidHost as e:
                return Decision(str(host), port, False, "invalid-host", detail=str(e))
        denied = self._lists["deny"].match(host, port)
        if denied is not None:
            return Decision(host.name, port, False, "denied", self._rule(denied))
        allowed = self._lists["allow"].match(host, port)
        if allowed is not None:
            return Decision(host.name, port, True, reasons.ALLOWED, self._rule(allowed))
        if self.allow_all:
            return Decision(host.name, port, True, reasons.ALLOWED, detail="network mode 'all'")
        return Decision(host.name, port, False, "not-allowed")

    def passthrough(self, host: Host, port: int | None = None) -> Rule | None:
        """The passthrough rule for ``host``: its tunnels are relayed without TLS interception."""
        return self._rule(self._lists["passthrough"].match(host, port))

    def private_allowed(self, host: Host, ip: IPAddress, kind: str) -> Rule | None:
        """The allow_private rule that lets ``host`` reach ``ip`` (of kind ``kind``), if any.

        An address or range always counts; a name counts for every kind except the
        cloud metadata service, which must be named by address.
        """
        private = self._lists["allow_private"]
        by_net = private.nets.match(ip, None)
        if by_net is not None:
            return self._rule(by_net)
        if kind != "metadata" and host.ip is None:
            return self._rule(private.domains.match(host.name, None))
        return None

    # -- loading

    @classmethod
    def from_mapping(cls, data: dict, path: str = "<policy>", read: Reader | None = None) -> "Policy":
        """A policy from an already-parsed mapping (``include`` resolved relative to cwd).

        ``read``: how the included files are read (see :func:`load_policy`).
        """
        policy = cls()
        problems: list[Problem] = []
        with _gc_paused():
            _Loader(policy, problems, read).load_mapping(data, path, text=None, stack=())
        _check_credentials(policy, problems)
        if problems:
            raise PolicyError(problems)
        policy.allow_all = policy.network == "all"
        return policy


def builtin_dir() -> Path:
    """Where the shipped policy files live (installed package or source tree)."""
    try:
        return Path(str(resources.files("egress.policies")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "policies"


def builtin_path(name: str) -> Path | None:
    """The file of built-in set ``name`` (``dev``), or None if there is no such set."""
    file = BUILTIN_SETS.get(name, f"{name}.toml")
    path = builtin_dir() / file
    return path if path.is_file() else None


def read_file(path: Path) -> str:
    """The default read hook: the file as it is now."""
    return path.read_text(encoding="utf-8")


Reader = Callable[[Path], str]


class _Loader:
    def __init__(self, policy: Policy, problems: list[Problem], read: Reader | None = None):
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
            line = _find_line(str(stack[-1]), included_as, "include") if included_as else None
            self.problems.append(Problem(str(stack[-1]), line, f"include cycle: {chain}"))
            return
        if path in self.loaded:
            return  # a diamond include: the same rules once
        self.loaded.add(path)
        try:
            text = self.read(given.absolute())
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
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            self.problems.append(_toml_problem(str(path), e, text))
            return
        self.load_mapping(data, str(path), text, stack + (path,))

    def load_mapping(self, data: dict, path: str, text: str | None, stack: tuple[Path, ...]) -> None:
        policy = self.policy
        policy.files.append(path)
        source = len(policy._sources)
        policy._sources.append(path)

        def problem(message: str, needle: str | None = None, key: str | None = None) -> None:
            line = _find_line(path, needle, key) if (needle or key) and text is not None else None
            self.problems.append(Problem(path, line, message))

        for key in data:
            if key not in KNOWN_KEYS:
                close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(KNOWN_KEYS)}"
                problem(f"unknown key {key!r}{hint}", key=key)

        if "credentials" in data:
            policy.credential_tables.append((path, data["credentials"]))

        if "network" in data:
            mode = data["network"]
            if mode not in NETWORK_MODES:
                problem(f"network: {mode!r} is not a mode; write one of {', '.join(NETWORK_MODES)}",
                        key="network")
            elif policy.network not in (None, mode):
                problem(f"network: {mode!r} conflicts with {policy.network!r} set by another file",
                        key="network")
            else:
                policy.network = mode

        includes = data.get("include", [])
        if isinstance(includes, str):
            includes = [includes]
        if not isinstance(includes, list):
            problem("include: expected a list of file paths or built-in set names", key="include")
            includes = []
        base = Path(path).parent if text is not None else Path.cwd()
        for name in includes:
            if not isinstance(name, str):
                problem(f"include: entries must be strings, not {name!r}", key="include")
                continue
            bare = "/" not in name and not name.endswith(".toml")
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

        for key in LIST_KEYS:
            entries = data.get(key, [])
            if not isinstance(entries, list):
                problem(f"{key}: expected a list of strings, e.g. {key} = [\"example.com\"]", key=key)
                continue
            for entry_text in entries:
                try:
                    entry = _parse_entry(entry_text, key)
                except _EntryError as e:
                    problem(str(e), entry_text if isinstance(entry_text, str) else None, key)
                    continue
                if key == "allow_private" and entry.port is not None:
                    problem(f"allow_private: {entry_text!r}: a port means nothing here (it names which "
                            f"hosts or ranges may be private); write it without ':{entry.port}'",
                            entry_text, key)
                    continue
                policy._add(key, entry, entry_text, source)


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector while a policy is built.

    Loading makes millions of small objects that all live on and form no cycles,
    yet each full collection walks every one made so far: loading 1M entries ran
    ~4,000 collections, 13 of them full, for 1-2 s of the load. Paused, there is
    one collection, after loading. The previous state is restored (a caller that
    had disabled the collector keeps it disabled).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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


def load_policy(sources: list[str] | tuple[str, ...] | str, read: Reader | None = None) -> Policy:
    """Load one or more policy files (or built-in set names) into one policy.

    ``read(path) -> str`` reads each file (default :func:`read_file`); it may raise
    OSError, or :class:`ReadRefused` to keep a file out. Raises :class:`PolicyError`
    listing every problem found.
    """
    if isinstance(sources, str):
        sources = [sources]
    policy = Policy()
    problems: list[Problem] = []
    loader = _Loader(policy, problems, read)
    with _gc_paused():
        for source in sources:
            path = Path(source)
            if not path.exists() and "/" not in source and not source.endswith(".toml"):
                builtin = builtin_path(source)
                if builtin is not None:
                    path = builtin
            loader.load_file(path, ())
    _check_credentials(policy, problems)
    if problems:
        raise PolicyError(problems)
    policy.allow_all = policy.network == "all"
    return policy


def _check_credentials(policy: Policy, problems: list[Problem]) -> None:
    """The [credentials] tables' shape (their values are read when a proxy starts)."""
    if not policy.credential_tables:
        return
    from .credentials import CredentialError, parse_settings

    try:
        parse_settings(policy.credential_tables)
    except CredentialError as e:
        for path, key, message in e.problems:
            problems.append(Problem(path, _find_line(path, None, key) if key else None, message))
