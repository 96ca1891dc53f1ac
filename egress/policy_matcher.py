"""The domain policy's matcher: a loaded policy and its decisions. Pure: no files, sockets or DNS.

Semantics:

* ``example.com`` covers the apex and every subdomain; ``*.example.com`` covers
  subdomains only; ``=example.com`` covers that exact host only (the one way to name a
  host that is itself a public suffix of the list's private section, ``=httpbin.org``);
  ``host:443`` narrows an entry to one port.
* IP addresses and CIDRs match IP literals only; a domain entry never matches
  an IP literal.
* ``deny`` wins over every ``allow``.
* A name that no ``allow`` entry covers and that looks like data leaving in its labels
  (egress.exfil) is refused as ``exfiltration``, in every network mode.
* After a destination is allowed and its addresses known, :meth:`Policy.choose_address`
  says which one may be dialled, or refuses (``private-address``) naming the address, its
  class and the ``allow_private`` line that would allow it. The proxy asks it after
  resolving; ``egress check`` asks it for what needs no lookup (IP literals, localhost).

Lookups cost O(labels of the host) for names and O(distinct prefix lengths) for
addresses, whatever the number of rules: entries live in dictionaries keyed by
the name (or the masked network), never in a list that is scanned.

Policies are built by egress.policy_loader (files, includes, problems with file:line).
"""

from __future__ import annotations

import ipaddress
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from . import reasons
from .addresses import address_class, classify
from .exfil import shape
from .hosts import Host, InvalidHost, IPAddress, parent_domains, parse_host

LIST_KEYS = ("allow", "deny", "passthrough", "allow_private")


# ---------------------------------------------------------------------- rules


@dataclass(frozen=True, slots=True)
class Rule:
    """An entry of a policy list, as written, with the file and line it came from."""

    key: str  # allow | deny | passthrough | allow_private
    text: str  # the entry as written in the file
    path: str
    line: int | None = None  # noted when the file was read (None: a mapping, or not found)

    def location(self) -> str:
        """``path:line`` of the entry (``path`` alone when the line is not known)."""
        return f"{self.path}:{self.line}" if self.line else self.path

    def __str__(self) -> str:
        return f"{self.text} ({self.location()})"


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
        text, detail = reasons.phrase(self.reason, self.detail)
        if self.rule is not None:
            text += f": matched {self.rule}"
        if detail:
            text += f" ({detail})"
        return text


# ------------------------------------------------------------------- entries


class Entry(NamedTuple):
    """A list entry, parsed (by egress.policy_loader.parse_entry): what the tables are keyed by."""

    kind: str  # "domain" (apex + subdomains) | "subdomains" | "exact" (that host only) | "net"
    value: str | ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None


# ---------------------------------------------------------------------- tables

# A table maps a name (or a masked network) to its rules, each packed in one int,
# ``rule index << 16 | port`` (port 0: any; entries never have port 0), or a list of
# them for a name with several entries, in the order written. 1M entries used to cost a
# list, a tuple and an Entry each (~450 MB and ~4,000 garbage collections to load); ints
# and strings are not tracked by the collector, so a full collection no longer walks them.
#
# A table is SHARDS dicts, a key's chosen by hash(key) % SHARDS: a reload builds its tables
# in a thread while the proxy's loop runs, and growing one 1M-key dict moves every key in one
# call that holds the GIL (29 ms at 800k keys); a shard of ~8k keys grows in well under 1 ms.
# A prime count spreads network keys too (their low bits are 0). Costs a hash per lookup.
SHARDS = 127
Table = list  # of SHARDS dicts: key -> int | list[int]


def _table() -> Table:
    return [{} for _ in range(SHARDS)]


def _first(held: int | list[int], port: int | None) -> int | None:
    """The first of a name's rules that covers ``port``."""
    if type(held) is int:
        return held >> 16 if not held & 0xFFFF or held & 0xFFFF == port else None
    for packed in held:
        if not packed & 0xFFFF or packed & 0xFFFF == port:
            return packed >> 16
    return None


def _put(table: Table, key, rule: int, port: int | None) -> None:
    """Add a rule to ``key``'s, unless an earlier one shadows it (any port, or the same
    port: it would always be found first)."""
    shard = table[hash(key) % SHARDS]
    packed = rule << 16 | (port or 0)
    held = shard.get(key)
    if held is None:
        shard[key] = packed
        return
    for earlier in ((held,) if type(held) is int else held):
        if not earlier & 0xFFFF or earlier & 0xFFFF == packed & 0xFFFF:
            return
    if type(held) is int:
        shard[key] = [held, packed]
    else:
        held.append(packed)


class _DomainTable:
    """Domain entries keyed by name: a lookup walks the host's parents, O(labels)."""

    def __init__(self) -> None:
        # a table per kind of domain entry
        self.apex_and_subdomains: Table = _table()
        self.subdomains_only: Table = _table()
        self.exact: Table = _table()

    def match(self, name: str, port: int | None) -> int | None:
        """The most specific rule covering ``name`` (and ``port``), or None."""
        held = self.exact[hash(name) % SHARDS].get(name)  # only the host itself, never a parent
        if held is not None and (rule := _first(held, port)) is not None:
            return rule
        apex, subdomains = self.apex_and_subdomains, self.subdomains_only
        for depth, candidate in enumerate(parent_domains(name)):
            shard = hash(candidate) % SHARDS
            held = apex[shard].get(candidate)
            if held is not None and (rule := _first(held, port)) is not None:
                return rule
            if depth:
                held = subdomains[shard].get(candidate)
                if held is not None and (rule := _first(held, port)) is not None:
                    return rule
        return None

    def __len__(self) -> int:
        return sum(len(shard) for table in (self.apex_and_subdomains, self.subdomains_only, self.exact)
                   for shard in table)


class _NetTable:
    """IP and CIDR entries keyed by masked network: O(distinct prefix lengths) per lookup."""

    def __init__(self) -> None:
        # (version, prefixlen) -> table of network int -> packed rules
        self.by_prefix: dict[tuple[int, int], Table] = {}
        self._order: dict[int, list[tuple[int, Table]]] | None = None

    def add(self, net: ipaddress.IPv4Network | ipaddress.IPv6Network, port: int | None, rule: int) -> None:
        key = (net.version, net.prefixlen)
        bucket = self.by_prefix.get(key)
        if bucket is None:
            bucket = self.by_prefix[key] = _table()
        _put(bucket, int(net.network_address), rule, port)
        self._order = None

    def _prefixes(self, version: int) -> list[tuple[int, Table]]:
        if self._order is None:
            # Longest prefix first: the most specific rule is the one reported.
            order: dict[int, list[tuple[int, Table]]] = {4: [], 6: []}
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
            held = bucket[hash(masked) % SHARDS].get(masked)
            if held is not None and (rule := _first(held, port)) is not None:
                return rule
        return None

    def __len__(self) -> int:
        return sum(len(shard) for bucket in self.by_prefix.values() for shard in bucket)


@dataclass
class _List:
    domains: _DomainTable = field(default_factory=_DomainTable)
    nets: _NetTable = field(default_factory=_NetTable)

    def match(self, host: Host, port: int | None) -> int | None:
        if host.ip is not None:
            return self.nets.match(host.ip, port)
        return self.domains.match(host.name, port)


# ---------------------------------------------------------------------- policy


class Policy:
    """A loaded policy. Built by egress.policy_loader (load_policy, policy_from_mapping)."""

    def __init__(self) -> None:
        # Rules by index: the entry as written and its line (0: not known) side by side, and
        # the (key, file) of each run of consecutive rules: a file's list is added in one run.
        self._texts: list[str] = []
        self._lines = array("I")
        self._run_starts: list[int] = []
        self._runs: list[tuple[str, int]] = []  # (key, source index)
        self._sources: list[str] = []
        self._lists = {key: _List() for key in LIST_KEYS}
        self.files: list[str] = []  # every file that went into this policy, in load order
        # network mode "all": every destination not denied is allowed (addresses are still checked)
        self.allow_all = False
        # the `network` key of the policy files (for `egress run`), None if no file sets it
        self.network: str | None = None
        # the [credentials] tables, as (file, table), in load order, unread: egress.settings
        # parses them beside the policy (see egress.credentials)
        self.credential_tables: list[tuple[str, object]] = []
        # what loaded but deserves a second look (a passthrough without a port), with file:line
        self.warnings: list = []
        # for `egress run` (sandbox.launcher), read as written: `profile`, `[limits] max_output`
        # (bytes, None if no file sets it) and `[guardrails]` (egress.command_guard.Rule, in load order)
        self.profile: str | None = None
        self.max_output: int | None = None
        self.command_rules: list = []

    # -- building (egress.policy_loader)

    def add_source(self, path: str) -> int:
        """Record a file (or mapping) rules come from; the index to give :meth:`add`."""
        self.files.append(path)
        self._sources.append(path)
        return len(self._sources) - 1

    def adder(self, key: str, source: int) -> Callable[[list, list, Sequence[int]], None]:
        """``add(entries, texts, lines)``: adds ``key`` rules from ``source`` (a list of one file:
        one run of rules), a batch at a time: each entry's parts (an Entry, or None to leave that
        one out), the entry as written, its line (0 if not known). A call per entry cost ~0.2 s
        of a 1M-entry load."""
        texts, lines = self._texts, self._lines
        self._run_starts.append(len(texts))
        self._runs.append((key, source))
        domains, nets = self._lists[key].domains, self._lists[key].nets
        tables = {"domain": domains.apex_and_subdomains, "subdomains": domains.subdomains_only,
                  "exact": domains.exact}

        def add(entries: list, written: list, at: Sequence[int]) -> None:
            if None in entries:
                kept = [i for i, entry in enumerate(entries) if entry is not None]
                entries, written, at = [entries[i] for i in kept], [written[i] for i in kept], [at[i] for i in kept]
            index = len(texts)
            texts.extend(written)
            lines.extend(at)
            for index, (kind, value, port) in enumerate(entries, index):
                if kind == "net":
                    nets.add(value, port, index)
                    continue
                shard = tables[kind][hash(value) % SHARDS]
                if value in shard:
                    _put(tables[kind], value, index, port)
                else:  # the common case, inline: a name's first entry
                    shard[value] = index << 16 | (port or 0)

        return add

    def dismantle(self, pause: Callable[[], None]) -> None:
        """Empty this policy a piece at a time, calling ``pause()`` between pieces: its last
        reference dropped at once would free 1M entries in one call (~40 ms holding the GIL).
        For a policy no one else can reach any more (egress.live, after a reload); even so, half
        emptied it refuses more, never less: network mode "all" off first, then the allow lists."""
        self.allow_all = False
        tables = [table for rules in self._lists.values()
                  for table in (rules.domains.apex_and_subdomains, rules.domains.subdomains_only,
                                rules.domains.exact, *rules.nets.by_prefix.values())]
        for shard in (shard for table in tables for shard in table if shard):
            shard.clear()  # ~8k keys
            pause()
        while self._texts:
            del self._texts[-65536:]
            pause()

    def _rule(self, index: int | None) -> Rule | None:
        if index is None:
            return None
        key, source = self._runs[bisect_right(self._run_starts, index) - 1]
        return Rule(key, self._texts[index], self._sources[source], self._lines[index] or None)

    @property
    def rule_count(self) -> int:
        return len(self._texts)

    @property
    def size(self) -> str:
        """``1 entry``, ``19 entries``: how many rules, in words for a person."""
        return f"{self.rule_count} {'entry' if self.rule_count == 1 else 'entries'}"

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
        # An allow entry wins (the one way to pass an id the shape test takes for data); anything
        # else, network "all" included, is looked at for data in its labels (egress.exfil).
        data = None if host.is_ip else shape(host.name)
        if data is not None:
            return Decision(host.name, port, False, "exfiltration", detail=data)
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

    def choose_address(self, host: Host, port: int | None, addresses) -> IPAddress | Decision:
        """The address of an allowed ``host`` to dial, or the ``private-address`` refusal.

        ``addresses`` as resolved (or known without a lookup: an IP literal, localhost), in
        order. The first that is public, or that an ``allow_private`` entry lets this host
        reach, is the one; if none is, the refusal names the addresses, their class and the
        entry that would allow the first (its address: the narrowest entry that works, and
        the only one that opens the metadata service or an IP literal).
        """
        refused: list[tuple[IPAddress, str]] = []
        for ip in addresses:
            kind = classify(ip)
            if kind is None or self.private_allowed(host, ip, kind) is not None:
                return ip
            refused.append((ip, address_class(ip)))
        if not refused:  # a resolver never answers nothing; if it did, nothing is dialled
            return Decision(host.name, port, False, "private-address", detail="no address to check")
        return Decision(host.name, port, False, "private-address", detail=private_detail(host, refused))

    # -- loading

    @classmethod
    def from_mapping(cls, data: dict, path: str = "<policy>", read=None) -> "Policy":
        """Kept for callers: egress.policy_loader.policy_from_mapping."""
        from .policy_loader import policy_from_mapping

        return policy_from_mapping(data, path, read)


# ---------------------------------------------------------- private addresses


def allow_private_entry(ip: IPAddress) -> str:
    """The ``allow_private`` entry that covers exactly ``ip``, as a policy file writes it.

    The address itself, except an IPv4-mapped IPv6 one: the loader reads
    ``::ffff:10.0.0.1`` as the IPv4 address 10.0.0.1 (as sockets do), which would not
    cover the IPv6 address DNS answered, so it is written as its /128.
    """
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return f"{ip}/128"
    return str(ip)


def private_detail(host: Host, refused: list[tuple[IPAddress, str]]) -> str:
    """``resolves to 203.0.113.80, reserved for documentation; to allow it, add "203.0.113.80"
    to the policy's allow_private list: allow_private = ["203.0.113.80"]`` (an IP literal:
    ``127.0.0.1 is loopback; ...``): the address, its class and the line that allows it."""
    if host.ip is not None:
        what = f"{host.ip} is {refused[0][1]}"
    else:
        shown = refused[:3]
        groups: list[tuple[list[str], str]] = []  # consecutive addresses of one class together
        for ip, name in shown:
            if groups and groups[-1][1] == name:
                groups[-1][0].append(str(ip))
            else:
                groups.append(([str(ip)], name))
        parts = [f"{' and '.join(ips)}, {name}" for ips, name in groups]
        what = "resolves to " + ", and ".join(parts)
        if len(refused) > len(shown):
            what += f" (and {len(refused) - len(shown)} more)"
    entry = allow_private_entry(refused[0][0])
    return f'{what}; to allow it, add "{entry}" to the policy\'s allow_private list: allow_private = ["{entry}"]'
