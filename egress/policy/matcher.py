"""The domain policy's matcher: a loaded policy and its decisions. Pure: no files, sockets or DNS.

Semantics:

* ``example.com`` covers the apex and every subdomain; ``*.example.com`` covers
  subdomains only; ``=example.com`` covers that exact host only (the one way to name a
  host that is itself a public suffix of the list's private section, ``=httpbin.org``);
  ``host:443`` narrows an entry to one port.
* IP addresses and CIDRs match IP literals; a domain entry never matches
  an IP literal. On the deny list they also match every address a name resolves to
  (see :meth:`Policy.choose_address`).
* ``deny`` wins over every ``allow``.
* A name that no ``allow`` entry covers and that looks like data leaving in its labels
  (egress.core.exfil) is refused as ``exfiltration``, in every network mode.
* After a destination is allowed and its addresses known, :meth:`Policy.choose_address`
  says which one may be dialled, or refuses (``private-address``) naming the address, its
  class and the ``allow_private`` line that would allow it. The proxy asks it after
  resolving; ``egress check`` asks it for what needs no lookup (IP literals, localhost).
  It refuses first (``denied``) a host any of whose addresses an IP or CIDR deny entry
  covers: deny wins by address too, whatever name led there.

Lookups cost O(labels of the host) for names and O(distinct prefix lengths) for
addresses, whatever the number of rules: entries live in hash tables keyed by the
name (or the masked network), never in a list that is scanned; the tables are flat
arrays and one byte blob, no Python object per entry (see "tables" below).

Policies are built by egress.policy.loader (files, includes, problems with file:line).
"""

from __future__ import annotations

import ipaddress
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, count
from operator import add as add_, or_
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from egress.core import reasons
from egress.core.addresses import address_class, classify, embedded_ipv4
from egress.core.exfil import shape
from egress.core.hosts import Host, InvalidHost, IPAddress, parent_domains, parse_host

if TYPE_CHECKING:
    from egress.agent.commands import Rule as CommandRule
    from egress.policy.loader import Problem

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
    reason: str  # "allowed" or a code from egress.core.reasons.REFUSALS
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
    """A list entry, parsed (by egress.policy.loader.parse_entry): what the tables are keyed by."""

    kind: str  # "domain" (apex + subdomains) | "subdomains" | "exact" (that host only) | "net"
    value: str | ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None


# An Entry's fields as a plain tuple: what a loader adds (an Entry per entry costs: bench/README.md, Policy)
EntryParts = tuple[str, str | ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]


# ---------------------------------------------------------------------- tables

# A list's entries live in a handful of flat arrays and the policy's one byte blob, never in a
# Python object per entry. The last design (a dict per shard, name -> packed int) kept two small
# objects per entry (the name, shared with the rule's text, and the int); built while requests
# allocate their own, they interleave in pymalloc's arenas, and the few request objects that live
# on pin those arenas once the policy is freed: RSS stepped up at the second reload of a large
# policy and stayed there (bench/README.md, "Policy"). Arrays and a bytearray are large buffers
# from malloc, not the small-object allocator: freed, malloc_trim gives their pages back.
#
# A table is open addressing with linear probing on the key's hash (Python's own, of the name or
# of a network's bytes), a power-of-two number of slots at most a quarter full: a miss looks at
# ~1.4 slots on average (half full: ~2.5; Knuth's 1/2 (1 + 1/(1 - load)^2)). A slot holds a tag
# (30 bits of the hash, never 0: 0 is a free slot) and the newest record of its key, in two
# arrays: ints of 30 bits are CPython's cheapest (one 64-bit int per slot cost 257 against 214
# ns per insert). A key's records are chained, newest first. The key itself is in the blob
# (inside the rule's text where the entry wrote it as is, else appended): a tag that matches is
# checked against it, so a hash collision never makes a host match another's rule.

EXACT, DOMAIN, SUBDOMAINS, NET = 0, 1, 2, 3  # kinds of entry; at one name the lower kind wins
KIND = {"exact": EXACT << 16, "domain": DOMAIN << 16, "subdomains": SUBDOMAINS << 16, "net": NET << 16}
PORT = {None: 0}  # PORT.get(port, port): 0 (any) for None; entries never have port 0
_hash = hash  # the one hash of keys, for building and lookups alike (tests make every key collide)


def _no_pause() -> None:
    pass


class _Keys:
    """One list's entries: key -> its records, each ``kind << 16 | port`` and the rule's index."""

    def __init__(self, blob: bytearray) -> None:
        self.blob = blob  # the policy's: rules' texts, and keys not found in their text
        self.mask = 7
        self.tags = array("i", [0]) * 8  # per slot: the tag, hash >> 34 | 1, or 0: free
        self.slots = array("I", [0]) * 8  # per slot: the newest record of its key
        # per record (record 0 unused: 0 ends a chain)
        self.codes = array("I", [0])  # kind << 16 | port
        self.older = array("I", [0])  # the previous record of the same key, or 0
        self.key_at = array("Q", [0])  # where the key's bytes are in the blob
        self.key_len = array("B", [0])  # a name is at most 253 bytes, a network's key 18
        # record -> rule: from run_starts[n] on, rule = record + shifts[n] (a file's list is one run)
        self.run_starts = array("Q")
        self.shifts = array("q")
        self.keys = 0  # distinct keys

    def rule(self, record: int) -> int:
        return record + self.shifts[bisect_right(self.run_starts, record) - 1]

    def key(self, record: int) -> str | bytes:
        at = self.key_at[record]
        key = bytes(self.blob[at:at + self.key_len[record]])
        return key if self.codes[record] >> 16 == NET else key.decode("ascii")

    def is_key(self, record: int, key: str | bytes) -> bool:
        """Whether ``record``'s key is ``key`` (a name is ASCII: hosts.parse_host makes it so)."""
        if self.key_len[record] != len(key):
            return False
        # type(key) is str (not isinstance): a step less per lookup; mypy cannot narrow the other branch
        return self.blob.startswith(key.encode() if type(key) is str else key, self.key_at[record])  # type: ignore[arg-type]

    def find(self, h: int, key: str | bytes) -> int:
        """The newest record of ``key`` (hashed ``h``), or 0."""
        tags, mask, tag = self.tags, self.mask, h >> 34 | 1
        i = h & mask
        while held := tags[i]:
            if held == tag and self.is_key(record := self.slots[i], key):
                return record
            i = (i + 1) & mask
        return 0

    def first(self, record: int, port: int | None, lowest: int, highest: int) -> int | None:
        """The rule of a key's records that covers ``port``, of a kind in ``lowest..highest``: the
        lowest kind, and of that kind the first written (the chain runs newest first)."""
        best_kind, best = highest, 0
        codes, older = self.codes, self.older
        while record:
            code = codes[record]
            kind = code >> 16
            if lowest <= kind <= best_kind and (not code & 0xFFFF or code & 0xFFFF == port):
                best_kind, best = kind, record
            record = older[record]
        return self.rule(best) if best else None

    def reserve(self, records: int, pause: Callable[[], None]) -> None:
        """Room for ``records`` more records: a table never grows while a batch is added. Growing
        (a list spread over several files) rehashes every key, paced by ``pause()``."""
        size = self.mask + 1
        while size < 4 * (self.keys + records):
            size *= 2
        if size == self.mask + 1:
            return
        tags, slots, mask = array("i", [0]) * size, array("I", [0]) * size, size - 1
        for start in range(0, len(self.tags), 1024):
            for tag, record in zip(self.tags[start:start + 1024], self.slots[start:start + 1024], strict=True):
                if tag:
                    i = _hash(self.key(record)) & mask
                    while tags[i]:
                        i = (i + 1) & mask
                    tags[i], slots[i] = tag, record
            pause()
        self.tags, self.slots, self.mask = tags, slots, mask

    def extend(self, first_rule: int, keys: list[str | bytes], places: list[int], codes: Iterable[int]) -> None:
        """Add a record per key, for rules ``first_rule`` on: ``keys[n]`` (a name, or a network's
        bytes) is at ``places[n]`` in the blob, ``codes[n]`` its kind and port. After :meth:`reserve`."""
        first = len(self.codes)
        if not self.shifts or self.shifts[-1] != first_rule - first:
            self.run_starts.append(first)
            self.shifts.append(first_rule - first)
        self.codes.extend(codes)
        self.key_at.extend(places)
        self.key_len.extend(map(len, keys))
        self.older.frombytes(bytes(self.older.itemsize * len(keys)))
        tags, slots, older, mask, seen = self.tags, self.slots, self.older, self.mask, 0
        for record, h, key in zip(count(first), map(_hash, keys), keys):
            i, tag = h & mask, h >> 34 | 1
            while held := tags[i]:
                if held == tag and self.is_key(slots[i], key):  # a key seen before: chained
                    older[record], slots[i] = slots[i], record
                    seen += 1
                    break
                i = (i + 1) & mask
            else:
                tags[i], slots[i] = tag, record
        self.keys += len(keys) - seen


def _net_key(version: int, prefixlen: int, network: int) -> bytes:
    return bytes((version, prefixlen)) + network.to_bytes(16, "big")


class _List:
    """A list's entries: names (the host, then each parent: O(labels)) and networks (one probe
    per distinct prefix length of the host's version, longest first)."""

    def __init__(self, blob: bytearray) -> None:
        self.keys = _Keys(blob)
        self.prefixes: dict[int, list[int]] = {4: [], 6: []}  # prefix lengths in use, longest first

    def match(self, host: Host, port: int | None) -> int | None:
        if host.ip is not None:
            return self.match_ip(host.ip, port)
        return self.match_name(host.name, port)

    def match_name(self, name: str, port: int | None) -> int | None:
        """The most specific rule covering ``name`` (and ``port``), or None: at the host itself an
        exact entry, then a domain one; at a parent a domain entry, then a ``*.`` one."""
        keys = self.keys
        tags, slots, mask = keys.tags, keys.slots, keys.mask
        lowest, highest = EXACT, DOMAIN
        for candidate in parent_domains(name):
            h = _hash(candidate)
            i, tag = h & mask, h >> 34 | 1
            # _Keys.find, inline: a call per label cost ~8% of a decision
            while held := tags[i]:
                if held == tag and keys.is_key(record := slots[i], candidate):
                    if (rule := keys.first(record, port, lowest, highest)) is not None:
                        return rule
                    break
                i = (i + 1) & mask
            lowest, highest = DOMAIN, SUBDOMAINS
        return None

    def match_ip(self, ip: IPAddress, port: int | None) -> int | None:
        value, bits, version, keys = int(ip), ip.max_prefixlen, ip.version, self.keys
        for plen in self.prefixes[version]:
            key = _net_key(version, plen, (value >> (bits - plen)) << (bits - plen) if plen else 0)
            record = keys.find(_hash(key), key)
            if record and (rule := keys.first(record, port, NET, NET)) is not None:
                return rule
        return None

    def add_prefix(self, version: int, prefixlen: int) -> None:
        if prefixlen not in self.prefixes[version]:
            # a new list, published whole: a lookup never sees one half sorted
            self.prefixes = {**self.prefixes, version: sorted((*self.prefixes[version], prefixlen), reverse=True)}


# ---------------------------------------------------------------------- policy


class Policy:
    """A loaded policy. Built by egress.policy.loader (load_policy, policy_from_mapping)."""

    def __init__(self) -> None:
        # Rules by index: where the entry as written is in the blob (UTF-8), its size and its
        # line (0: not known) side by side, and the (key, file) of each run of consecutive
        # rules: a file's list is added in one run. No Python object per rule (see "tables").
        self._blob = bytearray()
        self._text_at = array("Q")
        self._text_len = array("I")
        self._lines = array("I")
        self._run_starts: list[int] = []
        self._runs: list[tuple[str, int]] = []  # (key, source index)
        self._sources: list[str] = []
        self._lists = {key: _List(self._blob) for key in LIST_KEYS}
        self.files: list[str] = []  # every file that went into this policy, in load order
        # network mode "all": every destination not denied is allowed (addresses are still checked)
        self.allow_all = False
        # the `network` key of the policy files (for `egress run`), None if no file sets it
        self.network: str | None = None
        # the [credentials] tables, as (file, table), in load order, unread: egress.policy.settings
        # parses them beside the policy (see egress.scan.credentials)
        self.credential_tables: list[tuple[str, object]] = []
        # what loaded but deserves a second look (a passthrough without a port), with file:line
        self.warnings: list[Problem] = []
        # for `egress run` (egress.run.launcher), read as written: `profile`, `[limits] max_output`
        # (bytes, None if no file sets it) and `[guardrails]` (egress.agent.commands.Rule, in load order)
        self.profile: str | None = None
        self.max_output: int | None = None
        self.command_rules: list[CommandRule] = []

    # -- building (egress.policy.loader)

    def add_source(self, path: str) -> int:
        """Record a file (or mapping) rules come from; the index to give :meth:`add`."""
        self.files.append(path)
        self._sources.append(path)
        return len(self._sources) - 1

    def adder(self, key: str, source: int, expected: int = 0, pause: Callable[[], None] | None = None
              ) -> Callable[[list[EntryParts | None], Sequence[Any], Sequence[int]], None]:
        """``add(entries, texts, lines)``: adds ``key`` rules from ``source`` (a list of one file:
        one run of rules), a batch at a time: each entry's parts (an Entry, or None to leave that
        one out), the entry as written, its line (0 if not known); a call per entry cost a large
        load too much (bench/README.md, Policy). ``expected``: how many entries will come, room
        made for them now (the making paced by ``pause()``)."""
        blob, text_at, text_len, lines = self._blob, self._text_at, self._text_len, self._lines
        self._run_starts.append(len(text_at))
        self._runs.append((key, source))
        rules = self._lists[key]
        rules.keys.reserve(expected, pause or _no_pause)

        def add(entries: list[Any], written: Sequence[Any], at: Sequence[int]) -> None:  # Any: EntryParts | None
            if None in entries:
                kept = [i for i, entry in enumerate(entries) if entry is not None]
                entries, written, at = [entries[i] for i in kept], [written[i] for i in kept], [at[i] for i in kept]
            if not entries:
                return
            table = rules.keys
            table.reserve(len(entries), _no_pause)  # nothing to do when the loader said how many
            first = len(text_at)
            # the batch's texts at once; an ASCII text (every plain entry) is its own bytes
            joined = "".join(written)
            encoded = joined.encode()
            ascii = len(encoded) == len(joined)
            sizes = list(map(len, written)) if ascii else [len(text.encode()) for text in written]
            starts = list(accumulate(sizes, initial=len(blob)))
            blob.extend(encoded)
            text_at.extend(starts[:-1])
            text_len.extend(sizes)
            lines.extend(at)
            # Each key's place in the blob: a name is found as is in its text (every plain entry),
            # one call for the batch; a name written otherwise (=, upper case, IDN) and a network
            # are appended.
            kinds, names, ports = zip(*entries, strict=True)
            keys: list[Any] = list(names)  # str, or a network until it is given its bytes
            nets = [n for n, kind in enumerate(kinds) if kind == "net"] if "net" in kinds else ()
            for n in nets:
                keys[n] = ""  # found at 0 below; its key comes after
            found = list(map(str.find, written, keys))
            for n in nets:
                net = entries[n][1]
                keys[n], found[n] = _net_key(net.version, net.prefixlen, int(net.network_address)), -1
                rules.add_prefix(net.version, net.prefixlen)
            if not ascii:  # character and byte offsets differ, but in an ASCII text
                found = [where if text.isascii() else -1 for where, text in zip(found, written, strict=True)]
            places = list(map(add_, found, starts))
            if -1 in found:
                for n in [n for n, where in enumerate(found) if where < 0]:
                    places[n] = len(blob)
                    blob.extend(keys[n] if type(keys[n]) is bytes else keys[n].encode())
            table.extend(first, keys, places, map(or_, map(KIND.__getitem__, kinds), map(PORT.get, ports, ports)))

        return add

    def dismantle(self, pause: Callable[[], None]) -> None:
        """Empty this policy a piece at a time, calling ``pause()`` between pieces: a few large
        buffers (the free of each holds the GIL while the system takes its pages back). For a policy no one else can reach any more
        (egress.host.live, after a reload); even so, half emptied it refuses more, never less:
        network mode "all" off first, then the allow lists."""
        self.allow_all = False
        for rules in self._lists.values():  # allow first (LIST_KEYS)
            old, rules.keys = rules.keys, _Keys(self._blob)
            pieces = [old.tags, old.slots, old.codes, old.older, old.key_at, old.key_len]
            del old
            while pieces:
                pieces.pop()
                pause()
        for name in ("_text_at", "_text_len", "_lines"):
            setattr(self, name, array(getattr(self, name).typecode))
            pause()
        for rules in self._lists.values():
            rules.keys.blob = bytearray()
        self._blob = bytearray()

    @overload
    def _rule(self, index: int) -> Rule: ...

    @overload
    def _rule(self, index: int | None) -> Rule | None: ...

    def _rule(self, index: int | None) -> Rule | None:
        if index is None:
            return None
        key, source = self._runs[bisect_right(self._run_starts, index) - 1]
        at = self._text_at[index]
        text = self._blob[at:at + self._text_len[index]].decode()
        return Rule(key, text, self._sources[source], self._lines[index] or None)

    @property
    def rule_count(self) -> int:
        return len(self._text_at)

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
        # else, network "all" included, is looked at for data in its labels (egress.core.exfil).
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
        by_net = private.match_ip(ip, None)
        if by_net is not None:
            return self._rule(by_net)
        if kind != "metadata" and host.ip is None:
            return self._rule(private.match_name(host.name, None))
        return None

    def denied_address(self, host: Host, port: int | None, addresses: Iterable[IPAddress]) -> Decision | None:
        """The ``denied`` refusal if a deny entry that is an address or a range covers any of
        ``addresses`` (or the IPv4 address one of them embeds: NAT64, mapped, 6to4, ...), else None.
        Deny wins by address as it does by name: a name whose DNS the command controls
        (``203-0-113-5.sslip.io``) must not reach a denied range, and one bad address in an
        answer refuses the name (the next lookup could pick it)."""
        deny = self._lists["deny"]
        if not (deny.prefixes[4] or deny.prefixes[6]):  # no address entries: nothing to look up
            return None
        for ip in addresses:
            for candidate in (ip, *embedded_ipv4(ip)):
                index = deny.match_ip(candidate, port)
                if index is None:
                    continue
                rule = self._rule(index)
                # the refusal line a client reads shows the detail, not the rule: name both here
                covered = f"covered by the deny entry {rule.text}"
                if host.ip is None:
                    detail = f"resolves to {ip}, {covered}"
                elif candidate != ip:
                    detail = f"{ip} embeds {candidate}, {covered}"
                else:
                    detail = covered
                return Decision(host.name, port, False, "denied", rule, detail=detail)
        return None

    def choose_address(self, host: Host, port: int | None, addresses: Iterable[IPAddress]) -> IPAddress | Decision:
        """The address of an allowed ``host`` to dial, or the ``denied`` or ``private-address`` refusal.

        Any address (or the IPv4 address it embeds) that a deny entry covers refuses the host,
        naming the address and the entry (:meth:`denied_address`).

        ``addresses`` as resolved (or known without a lookup: an IP literal, localhost), in
        order. The first that is public, or that an ``allow_private`` entry lets this host
        reach, is the one; if none is, the refusal names the addresses, their class and the
        entry that would allow the first (its address: the narrowest entry that works, and
        the only one that opens the metadata service or an IP literal).
        """
        denied = self.denied_address(host, port, addresses)
        if denied is not None:
            return denied
        refused: list[tuple[IPAddress, str]] = []
        for ip in addresses:
            kind = classify(ip)
            if kind is None or self.private_allowed(host, ip, kind) is not None:
                return ip
            refused.append((ip, address_class(ip) or kind))  # kind: never used, a class is named
        if not refused:  # a resolver never answers nothing; if it did, nothing is dialled
            return Decision(host.name, port, False, "private-address", detail="no address to check")
        return Decision(host.name, port, False, "private-address", detail=private_detail(host, refused))


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
