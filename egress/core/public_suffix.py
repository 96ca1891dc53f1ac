"""Public suffixes (``com``, ``co.uk``, ``github.io``), from the list bundled with tldextract.

Three questions: :func:`is_public_suffix` (a policy entry must not cover every site
under one), :func:`is_icann_suffix` (is it one in the list's ICANN section, ``com``,
``co.uk``, never a host; or only in the private section, ``github.io``, ``httpbin.org``,
where a company registered its own name and serves it: that exact host may be allowed,
``=httpbin.org``) and :func:`registrable_domain` (the bounded ``domain`` label of metrics).
The list is tldextract's bundled snapshot of the Public Suffix List, both sections;
nothing is ever fetched.

tldextract's public API, ``TLDExtract(suffix_list_urls=(), cache_dir=None)``, is the
reference, and answers :func:`registrable_domain` (only the proxy asks, after it has
started). :func:`is_public_suffix` is asked for every entry of every policy, on the
path of each `egress run --policy/--allow`, where the public API costs too much:
importing tldextract imports requests, and its first answer builds a trie, many times what
reading the same snapshot into three sets costs (docs/decisions/public-suffixes.md). So
:func:`suffix_rules` reads the snapshot file tldextract ships; tests/core/test_public_suffix.py
checks that both give the same answer for every rule of the list, except where tldextract's
trie misses a wildcard rule that also has children (``*.customer-oci.com`` beside
``*.ocs.customer-oci.com``: the list makes ``ocs.customer-oci.com`` a suffix, tldextract says
``customer-oci.com`` is a domain; 8 names in this snapshot), where the sets follow the list
and refuse more. If a tldextract release
moves or reshapes that file, the public API answers instead: slower, and lenient on those.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Collection
from itertools import repeat
from operator import itemgetter
from pathlib import Path

TYPE_CHECKING = False  # typing's, without importing typing
if TYPE_CHECKING:
    import tldextract

SNAPSHOT = ".tld_set_snapshot"  # the file inside the tldextract package
ICANN_END = "===END ICANN DOMAINS==="  # the list's marker between its two sections

Rules = tuple[frozenset[str], frozenset[str], frozenset[str]]  # exact rules, wildcard parents, exceptions


@functools.cache
def extractor() -> tldextract.TLDExtract:
    """tldextract's public API over its bundled snapshot (never fetched, no cache folder)."""
    import tldextract

    return tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


@functools.cache
def suffix_rules() -> Rules | None:
    """The bundled list as (exact rules, wildcard parents, exceptions); None if the file is not
    where this expects it (then :func:`is_public_suffix` asks the public API)."""
    text = _snapshot()
    return _parse(text) if text is not None else None


@functools.cache
def icann_rules() -> Rules | None:
    """The list's ICANN section alone, as :func:`suffix_rules`; None if it cannot be told apart.
    Parsed only when asked (an entry that is a suffix, or an '=' entry): not on the common path."""
    text = _snapshot()
    if text is None:
        return None
    icann, marker, _ = text.partition(ICANN_END)
    return _parse(icann) if marker else None


@functools.cache
def _snapshot() -> str | None:
    """The snapshot file's text; None if it is not where this expects it."""
    spec = importlib.util.find_spec("tldextract")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise RuntimeError("tldextract is not installed (pip install tldextract)")
    try:
        return (Path(spec.origin).parent / SNAPSHOT).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def forget() -> None:
    """Drop what was read (tests that move the snapshot or its marker)."""
    for cached in (suffix_rules, icann_rules, _snapshot):
        cached.cache_clear()


def _parse(text: str) -> Rules | None:
    exact: set[str] = set()
    wild: set[str] = set()
    exceptions: set[str] = set()
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
    if len(exact) < 1000 or "com" not in exact:  # not the list this expects: do not guess
        return None
    return frozenset(exact), frozenset(wild), frozenset(exceptions)


def is_public_suffix(name: str) -> bool:
    """True if ``name`` (canonical punycode) is itself a public suffix (``com``, ``co.uk``, ``github.io``)."""
    rules = suffix_rules()
    if rules is None:
        return public_api_is_public_suffix(name)
    return _matches(rules, name)


def none_public(names: Collection[str]) -> bool:
    """True if no name of ``names`` (canonical punycode) is a public suffix, in a few set
    operations for a whole batch of a loader's entries (a call each was ~10% of a 1M-entry
    load); False if one may be: then ask :func:`is_public_suffix` of each."""
    rules = suffix_rules()
    if rules is None:
        return False
    exact, wild, _ = rules  # an exception only ever makes the answer no: not needed for "none"
    return (exact.isdisjoint(names) and wild.isdisjoint(map(itemgetter(2), map(str.partition, names, repeat("."))))
            and "xn--" not in "\n".join(names))  # the list writes IDN suffixes in Unicode


def is_icann_suffix(name: str) -> bool:
    """True if ``name`` is a public suffix by the list's ICANN section (``com``, ``co.uk``): no
    one's host. False for one only the private section names (``github.io``, ``httpbin.org``)."""
    rules = icann_rules()
    if rules is None:
        return public_api_is_icann_suffix(name)
    return _matches(rules, name)


def _matches(rules: Rules, name: str) -> bool:
    # Asked for every entry of every policy (1M times for a 1M-entry policy): the common
    # answer, no, in one call and a few set lookups.
    exact, wild, exceptions = rules
    if name in exact:
        return True
    if name not in exceptions:
        parent = name.partition(".")[2]
        if parent and parent in wild:
            return True
    if "xn--" in name:  # the list writes IDN suffixes in Unicode
        import idna

        try:
            decoded = idna.decode(name)
        except idna.IDNAError:
            return False
        return decoded != name and _matches(rules, decoded)
    return False


def public_api_is_public_suffix(name: str) -> bool:
    """:func:`is_public_suffix` through tldextract's public API (the reference, and the fallback)."""
    result = extractor()(name, include_psl_private_domains=True)
    return not result.domain and not result.subdomain and result.suffix == name


def public_api_is_icann_suffix(name: str) -> bool:
    """:func:`is_icann_suffix` through tldextract's public API (the reference, and the fallback)."""
    result = extractor()(name, include_psl_private_domains=False)
    return not result.domain and not result.subdomain and result.suffix == name


def registrable_domain(host: str) -> str | None:
    """``a.b.example.co.uk`` -> ``example.co.uk``; None for IPs and bare suffixes.

    A name under a suffix the public list does not know (``.test``, ``.internal``)
    counts its last two labels.
    """
    result = extractor()(host)
    if result.suffix:
        return f"{result.domain}.{result.suffix}" if result.domain else None
    if result.ipv4 or result.ipv6 or not result.domain:
        return None
    return ".".join(host.rsplit(".", 2)[-2:])
