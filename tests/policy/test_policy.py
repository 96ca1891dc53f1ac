"""The domain policy, through real TOML files: what it allows, refuses, and why.

Every policy here is written to a file under tmp_path and read back with
load_policy (directly or through `include`), so file parsing, include resolution
and the file:line reported for rules and problems are all exercised. No mocks.
"""

from __future__ import annotations

import gc
import ipaddress
import textwrap
from pathlib import Path

import pytest

from egress.core import reasons
from egress.core.addresses import classify
from egress.core.hosts import parse_host
from egress.core.public_suffix import is_public_suffix, registrable_domain
from egress.policy.loader import PolicyError, Problem, builtin_path, load_policy, policy_from_mapping
from egress.policy.matcher import Decision, Policy


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def problems_of(*paths: Path) -> list[Problem]:
    with pytest.raises(PolicyError) as info:
        load_policy([str(p) for p in paths])
    assert info.value.problems, "PolicyError without problems"
    # the exception's text lists every problem as path:line: message
    assert str(info.value) == "\n".join(str(p) for p in info.value.problems)
    return info.value.problems


def quoted(text: str) -> str:
    return '"' + text + '"'


def line_of(path: Path, needle: str) -> int:
    """1-based line of the first line containing needle (how the tests locate entries)."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in {path}")


# ------------------------------------------------------------------- matching

MATCHING = """
    # Matching: apex + subdomains, subdomains only, IDN, case, trailing dot.
    allow = [
        "example.com",
        "*.wild.org",
        "bücher.de",
        "xn--mnchen-3ya.de",
        "UPPER.Example.NET.",
        "api.example.com",
        "localhost",
    ]
    deny = [
        "bad.example.com",
        "*.evil.wild.org",
    ]
"""

MATCHING_CASES = [
    # (id, host, allowed, reason, rule text as written)
    ("apex", "example.com", True, "allowed", "example.com"),
    ("subdomain", "www.example.com", True, "allowed", "example.com"),
    ("deep-subdomain", "a.b.c.d.example.com", True, "allowed", "example.com"),
    ("upper-case-request", "WWW.EXAMPLE.COM", True, "allowed", "example.com"),
    ("trailing-dot-request", "example.com.", True, "allowed", "example.com"),
    ("most-specific-rule-reported", "v1.api.example.com", True, "allowed", "api.example.com"),
    ("label-boundary", "notexample.com", False, "not-allowed", None),
    ("label-boundary-prefix", "xample.com", False, "not-allowed", None),
    ("suffix-is-not-parent", "example.com.evil.net", False, "not-allowed", None),
    ("parent-not-covered", "com", False, "not-allowed", None),
    ("denied-name", "bad.example.com", False, "denied", "bad.example.com"),
    ("denied-subdomain", "x.y.bad.example.com", False, "denied", "bad.example.com"),
    ("wildcard-subdomain", "a.wild.org", True, "allowed", "*.wild.org"),
    ("wildcard-deep", "a.b.wild.org", True, "allowed", "*.wild.org"),
    ("wildcard-not-apex", "wild.org", False, "not-allowed", None),
    ("wildcard-boundary", "awild.org", False, "not-allowed", None),
    ("deny-wildcard-not-apex", "evil.wild.org", True, "allowed", "*.wild.org"),
    ("deny-wildcard-subdomain", "x.evil.wild.org", False, "denied", "*.evil.wild.org"),
    ("idn-entry-punycode-request", "xn--bcher-kva.de", True, "allowed", "bücher.de"),
    ("idn-entry-unicode-request", "www.BÜCHER.de", True, "allowed", "bücher.de"),
    ("punycode-entry-unicode-request", "münchen.de", True, "allowed", "xn--mnchen-3ya.de"),
    ("punycode-entry-punycode-request", "shop.xn--mnchen-3ya.de", True, "allowed", "xn--mnchen-3ya.de"),
    ("entry-case-and-dot-normalised", "upper.example.net", True, "allowed", "UPPER.Example.NET."),
    ("single-label", "localhost", True, "allowed", "localhost"),
    ("ip-literal-never-matches-name", "127.0.0.1", False, "not-allowed", None),
    ("invalid-host", "a..example.com", False, "invalid-host", None),
]


@pytest.fixture(scope="module")
def matching(tmp_path_factory) -> tuple[Policy, Path]:
    path = write(tmp_path_factory.mktemp("matching"), "policy.toml", MATCHING)
    return load_policy([str(path)]), path.resolve()


@pytest.mark.parametrize(("host", "allowed", "reason", "rule"), [c[1:] for c in MATCHING_CASES],
                         ids=[c[0] for c in MATCHING_CASES])
def test_domain_matching(matching, host, allowed, reason, rule):
    policy, path = matching
    decision = policy.decide(host, 443)
    assert (decision.allowed, decision.reason) == (allowed, reason)
    assert decision.reason == reasons.ALLOWED or decision.reason in reasons.REFUSALS
    if rule is None:
        assert decision.rule is None
    else:
        assert decision.rule.text == rule
        assert decision.rule.key == ("deny" if reason == "denied" else "allow")
        assert decision.rule.path == str(path)
        assert decision.rule.location() == f"{path}:{line_of(path, quoted(rule))}"
    if reason != "invalid-host":
        assert decision.host == parse_host(host).name  # reported canonical
    assert decision.port == 443


def test_invalid_host_decision_says_why(matching):
    decision = matching[0].decide("a..example.com", 443)
    assert decision.host == "a..example.com"
    assert "not a valid host name" in decision.detail
    assert decision.words().startswith(reasons.words("invalid-host"))


def test_decision_words_name_rule_and_line(matching):
    policy, path = matching
    denied = policy.decide("bad.example.com", 443)
    line = line_of(path, '"bad.example.com"')
    assert denied.words() == f"on the deny list: matched bad.example.com ({path}:{line})"
    allowed = policy.decide("www.example.com", 443)
    assert allowed.words() == f"matched example.com ({path}:{line_of(path, quoted('example.com'))})"


# ------------------------------------------------------------ deny wins always

DENY_WINS = """
    allow = [
        "exact.example.com",
        "very.specific.api.example.org",
        "yandex.ru",
        "*.example.net",
        "example.io:22",
        "10.1.2.3",
        "10.0.0.0/8",
        "[2001:db8::1]",
    ]
    deny = [
        "exact.example.com",
        "example.org",
        "ru",
        "example.net",
        "example.io:22",
        "10.1.0.0/16",
        "2001:db8::/32",
    ]
"""

DENY_WINS_CASES = [
    ("same-entry", "exact.example.com", 443, "exact.example.com"),
    ("broad-deny-specific-allow", "very.specific.api.example.org", 443, "example.org"),
    ("tld-deny", "yandex.ru", 443, "ru"),
    ("apex-deny-wildcard-allow", "a.example.net", 443, "example.net"),
    ("same-port-entry", "example.io", 22, "example.io:22"),
    ("cidr-deny-ip-allow", "10.1.2.3", 443, "10.1.0.0/16"),
    ("cidr-deny-ip-allow-obfuscated", "0xa010203", 443, "10.1.0.0/16"),
    ("ipv6-cidr-deny", "[2001:db8::1]", 443, "2001:db8::/32"),
]


@pytest.mark.parametrize(("host", "port", "rule"), [c[1:] for c in DENY_WINS_CASES],
                         ids=[c[0] for c in DENY_WINS_CASES])
def test_deny_wins_over_every_allow(tmp_path, host, port, rule):
    policy = load_policy([str(write(tmp_path, "p.toml", DENY_WINS))])
    decision = policy.decide(host, port)
    assert (decision.allowed, decision.reason, decision.rule.text, decision.rule.key) == (
        False, "denied", rule, "deny")


def test_deny_in_a_later_file_wins_over_allow_in_an_earlier_one(tmp_path):
    first = write(tmp_path, "first.toml", 'allow = ["example.com"]\n')
    second = write(tmp_path, "second.toml", 'deny = ["tracker.example.com"]\n')
    policy = load_policy([str(first), str(second)])
    assert policy.decide("www.example.com", 443).allowed
    decision = policy.decide("tracker.example.com", 443)
    assert decision.reason == "denied" and decision.rule.path == str(second.resolve())
    assert policy.files == [str(first.resolve()), str(second.resolve())]


# ----------------------------------------------------------------- IP literals

ADDRESSES = """
    allow = [
        "127.0.0.1",
        "0.1",
        "10.0.0.0/8",
        "10.1.0.0/16",
        "10.1.2.3",
        "2001:db8::/32",
        "[::1]:8080",
        "192.0.2.7:443",
        "203.0.113.0/24:22",
    ]
    deny = ["10.66.0.0/16"]
"""

ADDRESS_CASES = [
    # (id, host, port, allowed, rule)
    ("dotted", "127.0.0.1", 443, True, "127.0.0.1"),
    ("decimal", "2130706433", 443, True, "127.0.0.1"),
    ("hex", "0x7f.1", 443, True, "127.0.0.1"),
    ("octal", "0177.0.0.1", 443, True, "127.0.0.1"),
    ("short", "127.1", 443, True, "127.0.0.1"),
    ("mapped", "[::ffff:127.0.0.1]", 443, True, "127.0.0.1"),
    ("ideographic-dots", "127。0。0。1", 443, True, "127.0.0.1"),
    ("ip-entry-is-not-a-name-suffix", "10.0.0.1", 443, True, "10.0.0.0/8"),  # "0.1" is 0.0.0.1
    ("short-entry-is-an-address", "0.0.0.1", 443, True, "0.1"),
    ("longest-prefix-reported", "10.1.2.3", 443, True, "10.1.2.3"),
    ("middle-prefix", "10.1.9.9", 443, True, "10.1.0.0/16"),
    ("shortest-prefix", "10.200.0.1", 443, True, "10.0.0.0/8"),
    ("ipv6-in-cidr", "[2001:db8::5]", 443, True, "2001:db8::/32"),
    ("ipv6-bare", "2001:db8:ffff::1", 443, True, "2001:db8::/32"),
    ("ipv6-port-entry", "[::1]", 8080, True, "[::1]:8080"),
    ("ipv6-port-entry-other-port", "[::1]", 80, False, None),
    ("ip-port-entry", "192.0.2.7", 443, True, "192.0.2.7:443"),
    ("ip-port-entry-other-port", "192.0.2.7", 80, False, None),
    ("cidr-port-entry", "203.0.113.9", 22, True, "203.0.113.0/24:22"),
    ("cidr-port-entry-other-port", "203.0.113.9", 443, False, None),
    ("zone-id", "[fe80::1%eth0]", 443, False, None),
    ("outside", "11.0.0.1", 443, False, None),
    ("denied-inside-allowed", "10.66.1.1", 443, False, "10.66.0.0/16"),
    ("denied-obfuscated", "012.0x42.1.1", 443, False, "10.66.0.0/16"),
    ("denied-mapped", "[::ffff:10.66.0.1]", 443, False, "10.66.0.0/16"),
]


@pytest.mark.parametrize(("host", "port", "allowed", "rule"), [c[1:] for c in ADDRESS_CASES],
                         ids=[c[0] for c in ADDRESS_CASES])
def test_ip_literals_match_ip_entries(tmp_path, host, port, allowed, rule):
    policy = load_policy([str(write(tmp_path, "p.toml", ADDRESSES))])
    decision = policy.decide(host, port)
    assert decision.allowed is allowed
    assert (decision.rule.text if decision.rule else None) == rule
    assert decision.host == str(parse_host(host).ip)


def test_domain_entries_never_match_ip_literals(tmp_path):
    # "1.0.0.127.in-addr.arpa"-style tricks aside, no name entry can cover an address:
    # the host name of 127.0.0.1 ends in ".0.1", ".1", but those entries are addresses.
    policy = load_policy([str(write(tmp_path, "p.toml", 'allow = ["localhost", "example.com"]\n'))])
    for host in ("127.0.0.1", "2130706433", "[::1]", "93.184.216.34"):
        assert policy.decide(host, 443).reason == "not-allowed"


# ---------------------------------------------------------------------- ports

PORTS = """
    allow = [
        "tls.example.com:443",
        "any.example.com",
        "*.alt.example.com:8443",
        "multi.example.com:80",
        "multi.example.com:443",
    ]
    deny = ["any.example.com:25"]
"""

PORT_CASES = [
    ("port-entry-same-port", "tls.example.com", 443, True, "tls.example.com:443"),
    ("port-entry-subdomain", "www.tls.example.com", 443, True, "tls.example.com:443"),
    ("port-entry-other-port", "tls.example.com", 80, False, None),
    ("port-entry-unknown-port", "tls.example.com", None, False, None),
    ("no-port-entry-any-port", "any.example.com", 12345, True, "any.example.com"),
    ("no-port-entry-unknown-port", "any.example.com", None, True, "any.example.com"),
    ("port-deny-on-its-port", "any.example.com", 25, False, "any.example.com:25"),
    ("wildcard-port-entry", "a.alt.example.com", 8443, True, "*.alt.example.com:8443"),
    ("wildcard-port-entry-other-port", "a.alt.example.com", 443, False, None),
    ("two-ports-first", "multi.example.com", 80, True, "multi.example.com:80"),
    ("two-ports-second", "multi.example.com", 443, True, "multi.example.com:443"),
    ("two-ports-neither", "multi.example.com", 8080, False, None),
]


@pytest.mark.parametrize(("host", "port", "allowed", "rule"), [c[1:] for c in PORT_CASES],
                         ids=[c[0] for c in PORT_CASES])
def test_ports(tmp_path, host, port, allowed, rule):
    policy = load_policy([str(write(tmp_path, "p.toml", PORTS))])
    decision = policy.decide(host, port)
    assert decision.allowed is allowed
    assert (decision.rule.text if decision.rule else None) == rule
    assert decision.port == port


# ------------------------------------------------- the loader's fast path

# Plain lower-case ASCII names (with '*.' or ':port') skip split_host_port and
# parse_host. Surrounding spaces force the general path (the fast path takes no
# spaces, the general one strips them), so the two can be compared entry by entry.
FAST_PATH_ENTRIES = [
    "example.com", "*.example.com", "example.com:443", "*.example.com:8443", "a_b.example.com",
    "localhost", "localhost:80", "x.com:1", "x.com:65535", "x" * 63 + ".com",
    ("a" * 62 + ".") * 4 + "co",  # 254 characters: too long
    "x.com:0", "x.com:65536", "x.com:", "x.com:12:3", "x.com:²", "x.com:٣",
    "com", "*.com", "co.uk:443", "*.github.io", "foo.ck", "www.ck",
    "foo.123", "foo.0x1", "*.1.2.3.4", "1.2.3.4:80", "-a.com", "a-.com", "a..com",
    "*.*.x.com", "x.*.com", "*x.com", "*", "*.",
    "=httpbin.org", "=x.com:443", "=co.uk", "=*.x.com", "=1.2.3.4",
    # IPv4 addresses and networks written the common way, and around it
    "1.2.3.4", "0.0.0.0", "255.255.255.255", "256.1.1.1", "1.2.3", "1.2.3.4.5", "01.2.3.4", "08.1.2.3", "1.2.3.09", "1.2.3.010", "010.0.0.0/8",
    "0x1.2.3.4", "1.2.3.4:443", "1.2.3.4:0", "1.2.3.4:65536", "1.2.3.4:", "10.0.0.0/8", "10.0.0.0/08",
    "10.0.0.1/8", "0.0.0.0/0", "1.0.0.0/0", "1.2.3.4/32", "1.2.3.4/33", "1.2.3.0/24:443", "1.2.3.0/24:0",
    "10.0.0.0/", "10.0.0.0/8/8", "*.1.2.3.4", "192.168.1.0/24", "127.0.0.1", "169.254.169.254",
]


@pytest.mark.parametrize("key", ["allow", "deny", "passthrough", "allow_private"])
def test_fast_path_agrees_with_the_general_path(key):
    from egress.policy.loader import EntryError, parse_entry

    def parse(text):
        try:
            return parse_entry(text, key)
        except EntryError:
            return "refused"

    for entry in FAST_PATH_ENTRIES:
        assert parse(entry) == parse(f" {entry} "), entry


def _batch_agrees_with_the_general_path(texts, key):
    # A batch's answer for an entry is the general path's (for an entry with nothing to say
    # about it), or None: the general path reads it alone.
    from egress.policy.loader import EntryError, _other_parts, plain_parts

    answers = plain_parts(texts, key)
    assert len(answers) == len(texts)
    for text, answer in zip(texts, answers):
        if answer is None:
            continue
        try:
            expected = _other_parts(text, key)
        except EntryError as e:
            raise AssertionError(f"{text!r}: the batch read {answer}, the general path refused it: {e}") from None
        assert answer == expected, text
        if key == "allow_private":
            assert answer[2] is None, text  # a port there is a problem to report
        if key == "passthrough":
            assert answer[2] is not None, text  # no port there, a warning to give
    return answers


@pytest.mark.parametrize("key", ["allow", "deny", "passthrough", "allow_private"])
def test_a_batch_reads_entries_as_the_general_path(key):
    from egress.policy.loader import plain_parts

    tricky = FAST_PATH_ENTRIES + [
        "", ":443", "*.:443", "x.com:00443", "x.com:00000", "x.com:99999", "x.com:443 ", "X.com", "x.com.",
        ".x.com", "x.com\t", "bücher.de", "xn--bcher-kva.de", "xn--p1ai", "a." + "b" * 63 + ".com",
        "a." + "b" * 64 + ".com", "a-b.c-d.com", "-", "_", "_.com", "1.2.3.4/24", "::1", "[::1]:443",
        "2001:db8::/32", "fe80::1", "x.de", "x.0xfe", "x.0x", "x.0xg", "x.123a", "\ud800.com",
        "localhost:8443", "a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61, "*.x.com:443:1",
    ]
    seen = _batch_agrees_with_the_general_path(tricky, key)
    # the plain ones are read in the batch, not left to the general path: the point of it
    plain = ["*.example.com:8443", "x.com:00443"] if key == "passthrough" else ["example.com", "*.example.com",
                                                                              "a-b.c-d.com"]
    assert all(seen[tricky.index(text)] is not None for text in plain)
    for text in tricky:
        _batch_agrees_with_the_general_path(["ok.example.com", text, "ok.example.org"], key)
    # not strings, and a newline inside one: every text to the general path
    assert plain_parts(["x.com", 7], key) == [None, None]
    assert plain_parts(["x.com", "a\nb.com"], key) == [None, None]
    assert plain_parts([], key) == []


def test_a_batch_reads_generated_entries_as_the_general_path():
    # Thousands of short texts from the characters that matter to a plain entry's shape.
    import random

    rng = random.Random(11)
    alphabet = "ab9x0-_.*:/= Aé"
    for _ in range(400):
        batch = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))) for _ in range(25)]
        batch += [rng.choice(["", "*."]) + ".".join(rng.choice(["a", "b0", "x-y", "0x1f", "12", "a" * 63, "a" * 64])
                                                       for _ in range(rng.randrange(1, 6)))
                  + rng.choice(["", ":", ":1", ":443", ":65535", ":65536", ":0", ":123456"]) for _ in range(25)]
        for key in ("allow", "deny", "passthrough", "allow_private"):
            _batch_agrees_with_the_general_path(batch, key)


# ------------------------------------------------------------ refused at load

REFUSED = [
    # (id, list, entry, helpful part of the message)
    ("tld", "allow", "com", "'com' is a top-level domain"),
    ("tld-trailing-dot", "allow", "COM.", "top-level domain"),
    ("tld-wildcard", "allow", "*.com", "'*.com' is a top-level domain"),
    ("public-suffix-cctld", "allow", "co.uk", "'co.uk' is a public suffix"),
    ("public-suffix-private-section", "allow", "github.io", "'github.io' is a public suffix"),
    ("public-suffix-wildcard", "allow", "*.github.io", "public suffix"),
    ("public-suffix-user-content", "allow", "githubusercontent.com", "public suffix"),
    ("public-suffix-with-port", "allow", "co.uk:443", "public suffix"),
    ("public-suffix-wildcard-rule", "allow", "foo.ck", "public suffix"),  # *.ck in the list
    ("public-suffix-idn", "allow", "xn--p1ai", "top-level domain"),
    ("public-suffix-passthrough", "passthrough", "co.uk", "passthrough: 'co.uk' is a public suffix"),
    ("public-suffix-allow-private", "allow_private", "github.io", "allow_private: 'github.io' is a public"),
    ("suggests-registrable", "allow", "co.uk", "write a registrable domain such as 'example.co.uk'"),
    ("bare-star", "allow", "*", "a bare '*' is not allowed; to allow every domain, run with --network all"),
    ("bare-star-dot", "allow", "*.", "a bare '*.' is not allowed"),
    ("bare-star-deny", "deny", "*", "a bare '*' is not allowed"),
    ("wildcard-middle", "allow", "a.*.com", "'a.*.com' has a wildcard in the middle of the name"),
    ("wildcard-glued", "allow", "*foo.com", "'*foo.com' has a wildcard in the middle"),
    ("wildcard-tld", "allow", "example.*", "'example.*' has a wildcard in the middle"),
    ("wildcard-twice", "allow", "*.*.example.com", "wildcard in the middle"),
    ("wildcard-on-ip", "allow", "*.10.0.0.1", "a wildcard cannot apply to an IP address"),
    ("scheme", "allow", "https://x.com", "'https://x.com' is a URL; write the host only, e.g. 'x.com'"),
    ("scheme-path", "allow", "http://x.com/a/b", "write the host only, e.g. 'x.com'"),
    ("path", "allow", "x.com/path", "'x.com/path' has a path; write the host only, e.g. 'x.com'"),
    ("cidr-host-bits", "allow", "10.0.0.1/8", "'10.0.0.1/8' has host bits set; did you mean '10.0.0.0/8'?"),
    ("cidr-host-bits-v6", "deny", "2001:db8::1/32", "did you mean '2001:db8::/32'?"),
    ("cidr-host-bits-private", "allow_private", "192.168.1.1/16", "did you mean '192.168.0.0/16'?"),
    ("cidr-prefix-too-long", "allow", "10.0.0.0/33", "'10.0.0.0/33' is not a valid CIDR"),
    ("cidr-prefix-not-number", "deny", "10.0.0.0/x", "is not a valid CIDR"),
    ("empty", "allow", "", "allow: empty entry"),
    ("blank", "deny", "   ", "deny: empty entry"),
    ("port-zero", "allow", "x.com:0", "'0' is not a port number (1-65535)"),
    ("port-too-big", "allow", "x.com:65536", "'65536' is not a port number"),
    ("port-not-ascii", "allow", "x.com:²", "is not a port number"),
    ("bad-name", "allow", "a..b.com", "not a valid host name"),
    ("bad-ipv4", "deny", "1.2.3.4.5", "neither a host name nor an IPv4 address"),
    ("unclosed-bracket", "allow", "[::1", "unclosed '['"),
    # the list's private section: that exact host may be allowed, and the error says how
    ("private-section-suggests-exact", "allow", "httpbin.org",
     "'httpbin.org' is a public suffix (in the list's private section): it would cover every site registered "
     "under it; write '=httpbin.org' to allow that host only, or a registrable domain such as "
     "'example.httpbin.org'"),
    ("private-section-keeps-the-port", "allow", "s3.amazonaws.com:443", "write '=s3.amazonaws.com:443' to allow"),
    ("private-section-passthrough", "passthrough", "herokuapp.com:443", "write '=herokuapp.com:443' to allow"),
    ("private-section-allow-private", "allow_private", "github.io", "write '=github.io' to allow that host only"),
    ("exact-icann-suffix", "allow", "=co.uk", "'=co.uk' is a public suffix, not a host"),
    ("exact-tld", "allow", "=com", "is a public suffix, not a host"),
    ("exact-wildcard", "allow", "=*.example.com", "'=' names one exact host; it takes neither a wildcard nor"),
    ("exact-cidr", "allow", "=10.0.0.0/8", "it takes neither a wildcard nor a CIDR"),
    ("exact-ip", "allow", "=10.0.0.1", "'=10.0.0.1': an IP address is always exact; write '10.0.0.1'"),
    ("exact-empty", "allow", "=", "empty host"),
]


@pytest.mark.parametrize("entry", ["co.uk", "*.github.io", "foo.ck", "com.", "*.httpbin.org"])
def test_no_exact_form_is_suggested_where_it_would_not_help(tmp_path, entry):
    # An ICANN suffix is no one's host; a wildcard asked for the sites under it, not the host.
    path = write(tmp_path, "p.toml", f'allow = [{quoted(entry)}]\n')
    [problem] = problems_of(path)
    assert "'=" not in problem.message, problem.message


@pytest.mark.parametrize("key", ["allow", "deny", "passthrough", "allow_private"])
@pytest.mark.parametrize("entry", ["=httpbin.org", "=s3.amazonaws.com:443", "=github.io", " =herokuapp.com ",
                                   "=intranet", "=localhost", "=bücher.de"])
def test_exact_entries_load_in_every_list(tmp_path, key, entry):
    if key == "allow_private" and ":" in entry:
        return  # allow_private takes no port (tested above)
    policy = load_policy([str(write(tmp_path, "p.toml", f'{key} = [{quoted(entry)}]\n'))])
    assert policy.rule_count == 1


@pytest.mark.parametrize(("key", "entry", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_entries_are_refused_with_file_and_line(tmp_path, key, entry, message):
    other = "deny" if key != "deny" else "allow"
    path = write(tmp_path, "p.toml", f"""
        # a policy with one bad entry among good ones
        {key} = [
            "fine.example.org",
            "{entry}",
        ]
        {other} = ["other.example.com"]
        """)
    [problem] = problems_of(path)
    assert message in problem.message
    assert problem.message.startswith(f"{key}: ")
    assert problem.path == str(path.resolve())
    assert problem.line == 4, str(problem)
    assert str(problem).startswith(f"{path.resolve()}:4: ")


def test_non_string_entries_are_refused(tmp_path):
    path = write(tmp_path, "p.toml", """
        allow = ["ok.example.com"]
        deny = [
            "also.example.com",
            42,
        ]
    """)
    [problem] = problems_of(path)
    assert problem.message == "deny: entries must be strings, not int 42"
    assert problem.line == 2  # the list's line: the entry itself cannot be found as text


@pytest.mark.parametrize("key", ["allow", "deny", "passthrough", "allow_private"])
def test_a_list_key_must_be_a_list(tmp_path, key):
    first = "allow" if key == "allow_private" else "allow_private"
    path = write(tmp_path, "p.toml", f"""
        # another key that starts alike comes first: its line is not the one
        {first} = []
        {key} = "example.com"
    """)
    [problem] = problems_of(path)
    assert problem.message == f'{key}: expected a list of strings, e.g. {key} = ["example.com"]'
    assert problem.line == 3


def test_deny_may_name_public_suffixes(tmp_path):
    path = write(tmp_path, "p.toml", """
        allow = ["yandex.ru", "user.github.io", "example.co.uk"]
        deny = ["ru", "*.github.io", "co.uk", "com"]
    """)
    policy = load_policy([str(path)])
    for host, rule in [("yandex.ru", "ru"), ("user.github.io", "*.github.io"),
                       ("example.co.uk", "co.uk"), ("example.com", "com")]:
        decision = policy.decide(host, 443)
        assert (decision.reason, decision.rule.text) == ("denied", rule)
    assert policy.decide("github.io", 443).reason == "not-allowed"  # *. is subdomains only


def test_every_problem_is_reported_in_file_order(tmp_path):
    path = write(tmp_path, "p.toml", """
        allow = [
            "ok.example.com",
            "com",
            "a.*.b.com",
            "10.0.0.1/8",
        ]
        passthrough = ["https://pinned.example.com"]
    """)
    problems = problems_of(path)
    assert [(p.line, p.message.split(":")[0]) for p in problems] == [
        (3, "allow"), (4, "allow"), (5, "allow"), (7, "passthrough")]


def test_line_is_the_one_in_the_list_meant(tmp_path):
    # the same text in deny (fine) and allow (refused): the allow line is reported
    path = write(tmp_path, "p.toml", """
        deny = [
            "co.uk",
        ]
        allow = [
            "co.uk",
        ]
    """)
    [problem] = problems_of(path)
    assert problem.line == 5


def test_rule_location_is_in_its_own_list(tmp_path):
    path = write(tmp_path, "p.toml", """
        allow = [
            "github.com",
        ]
        passthrough = [
            "github.com",
        ]
    """)
    policy = load_policy([str(path)])
    rule = policy.passthrough(parse_host("github.com"), 443)
    assert (rule.key, rule.text, rule.location()) == ("passthrough", "github.com", f"{path.resolve()}:5")
    assert policy.decide("github.com", 443).rule.location() == f"{path.resolve()}:2"


UNKNOWN_KEYS = [
    ("alow", "did you mean 'allow'?"),
    ("Allow", "did you mean 'allow'?"),
    ("denny", "did you mean 'deny'?"),
    ("passthru", "did you mean 'passthrough'?"),
    ("allow-private", "did you mean 'allow_private'?"),
    ("includes", "did you mean 'include'?"),
    ("zzz", "known keys: include,"),
]


@pytest.mark.parametrize(("key", "hint"), UNKNOWN_KEYS, ids=[k for k, _ in UNKNOWN_KEYS])
def test_unknown_keys_suggest_the_nearest(tmp_path, key, hint):
    path = write(tmp_path, "p.toml", f"""
        allow = ["example.com"]

        {key} = ["example.org"]
    """)
    [problem] = problems_of(path)
    assert problem.message.startswith(f"unknown key {key!r}")
    assert hint in problem.message
    assert problem.line == 3


def test_unknown_key_as_a_table(tmp_path):
    path = write(tmp_path, "p.toml", """
        allow = ["example.com"]
        [alow]
        x = 1
    """)
    [problem] = problems_of(path)
    assert "did you mean 'allow'?" in problem.message and problem.line == 2


TOML_ERRORS = [
    # (id, text, line, message part)
    ("missing-equals", 'allow = ["a.example.com"]\ndeny\n', 2, "not valid TOML: Expected '=' after a key"),
    ("missing-comma", 'allow = [\n  "a.example.com"\n  "b.example.com"\n]\n', 3, "not valid TOML: Unclosed array"),
    ("duplicate-key", 'allow = ["a.example.com"]\nallow = ["b.example.com"]\n', 2, "Cannot overwrite a value"),
    ("unclosed-string", 'allow = ["a.example.com]\n', 1, "not valid TOML"),
    ("unclosed-at-end", '# policy\nallow = [\n  "a.example.com",\n', 3, "(at end of document)"),
]


@pytest.mark.parametrize(("text", "line", "message"), [c[1:] for c in TOML_ERRORS], ids=[c[0] for c in TOML_ERRORS])
def test_toml_syntax_errors_have_a_line(tmp_path, text, line, message):
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    [problem] = problems_of(path)
    assert message in problem.message
    assert (problem.path, problem.line) == (str(path.resolve()), line)


def test_missing_policy_file(tmp_path):
    [problem] = problems_of(tmp_path / "nope.toml")
    assert (problem.path, problem.line, problem.message) == (str(tmp_path / "nope.toml"), None, "no such file")


# -------------------------------------------------------------------- include


def test_include_is_relative_to_the_including_file(tmp_path, monkeypatch):
    write(tmp_path, "shared.toml", """
        allow = ["shared.example.com"]
    """)
    sub = write(tmp_path, "teams/web.toml", """
        include = ["../shared.toml"]
        allow = ["web.example.com"]
    """)
    main = write(tmp_path, "main.toml", """
        include = ["teams/web.toml", "extra.toml"]
        deny = ["blocked.web.example.com"]
    """)
    write(tmp_path, "extra.toml", 'allow = ["extra.example.com"]\n')
    monkeypatch.chdir(tmp_path / "teams")  # a cwd where none of the paths resolve
    policy = load_policy([str(main)])
    web = policy.decide("www.web.example.com", 443)
    assert web.allowed and web.rule.path == str(sub.resolve())
    assert web.rule.location() == f"{sub.resolve()}:2"
    shared = policy.decide("shared.example.com", 443)
    assert shared.allowed and shared.rule.path == str((tmp_path / "shared.toml").resolve())
    assert policy.decide("extra.example.com", 443).allowed
    assert policy.decide("blocked.web.example.com", 443).reason == "denied"
    assert policy.files == [str(p.resolve()) for p in (
        main, sub, tmp_path / "shared.toml", tmp_path / "extra.toml")]


def test_include_a_single_string(tmp_path):
    write(tmp_path, "a.toml", 'allow = ["a.example.com"]\n')
    main = write(tmp_path, "main.toml", 'include = "a.toml"\n')
    assert load_policy([str(main)]).decide("a.example.com", 443).allowed


def test_diamond_include_loads_each_file_once(tmp_path):
    write(tmp_path, "base.toml", 'allow = ["base.example.com", "other.example.com"]\n')
    write(tmp_path, "left.toml", 'include = ["base.toml"]\n')
    write(tmp_path, "right.toml", 'include = ["base.toml"]\n')
    main = write(tmp_path, "main.toml", 'include = ["left.toml", "right.toml"]\n')
    policy = load_policy([str(main), str(tmp_path / "base.toml")])
    assert policy.rule_count == 2
    assert policy.decide("base.example.com", 443).allowed


def test_include_cycle(tmp_path):
    a = write(tmp_path, "a.toml", """
        allow = ["a.example.com"]
        include = ["b.toml"]
    """)
    b = write(tmp_path, "b.toml", """
        # b includes a back
        include = ["a.toml"]
    """)
    [problem] = problems_of(a)
    assert problem.message == f"include cycle: {a.resolve()} -> {b.resolve()} -> {a.resolve()}"
    assert (problem.path, problem.line) == (str(b.resolve()), 2)


def test_include_self(tmp_path):
    a = write(tmp_path, "a.toml", 'allow = ["a.example.com"]\ninclude = ["a.toml"]\n')
    [problem] = problems_of(a)
    assert "include cycle" in problem.message and problem.line == 2


def test_missing_include_is_reported_at_the_include(tmp_path):
    main = write(tmp_path, "main.toml", """
        allow = ["a.example.com"]
        include = [
            "missing.toml",
        ]
    """)
    [problem] = problems_of(main)
    assert problem.path == str(main.resolve())
    assert problem.line == 3
    assert problem.message == f"include: 'missing.toml': no such file ({main.resolve().parent / 'missing.toml'})"


def test_unknown_builtin_set(tmp_path):
    main = write(tmp_path, "main.toml", 'include = ["dve"]\n')
    [problem] = problems_of(main)
    assert problem.message == "include: 'dve' is neither a file nor a built-in set (dev)"
    assert problem.line == 1


def test_problems_in_included_files_name_those_files(tmp_path):
    write(tmp_path, "bad.toml", '# included\nallow = ["co.uk"]\n')
    main = write(tmp_path, "main.toml", 'include = ["bad.toml"]\nallow = ["com"]\n')
    problems = problems_of(main)
    assert [(Path(p.path).name, p.line) for p in problems] == [("bad.toml", 2), ("main.toml", 2)]


def test_each_include_of_a_missing_file_is_reported_at_its_include(tmp_path):
    write(tmp_path, "left.toml", 'include = ["gone.toml"]\n')
    write(tmp_path, "right.toml", '# right\ninclude = ["gone.toml"]\n')
    main = write(tmp_path, "main.toml", 'include = ["left.toml", "right.toml"]\n')
    problems = problems_of(main)
    assert [(Path(p.path).name, p.line) for p in problems] == [("left.toml", 1), ("right.toml", 2)]


# ------------------------------------------------------------------ read hook


def test_the_read_hook_supplies_every_text_and_says_what_exists(tmp_path):
    tmp_path = tmp_path.resolve()  # the loader names files by their real path
    # Files that exist nowhere on disk: the hook alone decides, includes and all.
    texts = {tmp_path / "main.toml": 'include = ["team.toml"]\nallow = ["main.example.com"]\n',
             tmp_path / "team.toml": 'include = ["gone.toml"]\nallow = ["team.example.com"]\n'}

    def read(path: Path) -> str:
        if path not in texts:
            raise FileNotFoundError(path)
        return texts[path]

    with pytest.raises(PolicyError) as info:
        load_policy([str(tmp_path / "main.toml")], read=read)
    [problem] = info.value.problems
    assert problem.message == f"include: 'gone.toml': no such file ({tmp_path / 'gone.toml'})"
    texts[tmp_path / "team.toml"] = 'allow = ["team.example.com"]\n'
    policy = load_policy([str(tmp_path / "main.toml")], read=read)
    assert policy.decide("team.example.com", 443).allowed and policy.decide("main.example.com", 443).allowed
    from_mapping = policy_from_mapping({"include": [str(tmp_path / "team.toml")]}, read=read)
    assert from_mapping.decide("team.example.com", 443).allowed


def test_a_refused_read_is_a_problem_naming_the_file(tmp_path):
    tmp_path = tmp_path.resolve()  # the loader names files by their real path
    from egress.policy.loader import ReadRefused

    main = write(tmp_path, "main.toml", 'include = ["other.toml"]\n')
    write(tmp_path, "other.toml", 'allow = ["other.example.com"]\n')

    def read(path: Path) -> str:
        if path.name == "other.toml":
            raise ReadRefused("not this one")
        return path.read_text()

    [problem] = problems_of_read(main, read)
    assert str(problem) == f"{tmp_path / 'other.toml'}: not this one"


def problems_of_read(path: Path, read) -> list[Problem]:
    with pytest.raises(PolicyError) as info:
        load_policy([str(path)], read=read)
    return info.value.problems


# ------------------------------------------------------------ built-in dev set

DEV_ALLOWED = [
    "pypi.org", "files.pythonhosted.org",
    "registry.npmjs.org", "registry.yarnpkg.com",
    "crates.io", "static.crates.io", "index.crates.io",
    "rubygems.org", "index.rubygems.org",
    "repo.maven.apache.org", "repo1.maven.org",
    "proxy.golang.org", "sum.golang.org",
    "github.com", "api.github.com", "codeload.github.com",
    "raw.githubusercontent.com", "objects.githubusercontent.com",
    "gitlab.com", "bitbucket.org",
]
DEV_REFUSED = ["example.com", "pypi.org.evil.com", "notgithub.com", "gist.githubusercontent.com",
               "githubusercontent.com", "127.0.0.1"]


@pytest.fixture(scope="module", params=["name", "include"])
def dev(request, tmp_path_factory) -> Policy:
    if request.param == "name":
        return load_policy(["dev"])
    path = write(tmp_path_factory.mktemp("dev"), "p.toml", 'include = ["dev"]\n')
    return load_policy([str(path)])


@pytest.mark.parametrize("host", DEV_ALLOWED)
def test_dev_set_allows(dev, host):
    decision = dev.decide(host, 443)
    assert decision.allowed, decision
    assert decision.rule.path == str(builtin_path("dev").resolve())


@pytest.mark.parametrize("host", DEV_REFUSED)
def test_dev_set_refuses(dev, host):
    assert dev.decide(host, 443).reason == "not-allowed"


# ---------------------------------------------------------- passthrough, private


def test_passthrough(tmp_path):
    path = write(tmp_path, "p.toml", """
        allow = ["bank.example.com", "pinned.example.org"]
        passthrough = [
            "*.bank.example.com:443",
            "pinned.example.org",
        ]
    """)
    policy = load_policy([str(path)])
    rule = policy.passthrough(parse_host("app.bank.example.com"), 443)
    assert (rule.key, rule.text, rule.location()) == ("passthrough", "*.bank.example.com:443",
                                                       f"{path.resolve()}:3")
    assert policy.passthrough(parse_host("app.bank.example.com"), 8443) is None
    assert policy.passthrough(parse_host("bank.example.com"), 443) is None
    assert policy.passthrough(parse_host("cdn.pinned.example.org"), 80).text == "pinned.example.org"
    assert policy.passthrough(parse_host("example.org"), 443) is None


PASSTHROUGH_PORTS = [
    # (entry, the entry the warning suggests, or None: no warning)
    ("pinned.example.org", "pinned.example.org:443"),
    ("*.bank.example.com", "*.bank.example.com:443"),
    ("bücher.de", "bücher.de:443"),
    ("10.0.0.0/8", "10.0.0.0/8:443"),
    ("2001:db8::/32", "[2001:db8::/32]:443"),
    ("[2001:db8::1]", "[2001:db8::1]:443"),
    ("pinned.example.org:443", None),
    ("ssh.example.org:22", None),
    ("[2001:db8::1]:8443", None),
]


@pytest.mark.parametrize(("entry", "suggested"), PASSTHROUGH_PORTS, ids=[e for e, _ in PASSTHROUGH_PORTS])
def test_a_passthrough_without_a_port_loads_with_a_warning_at_its_line(tmp_path, entry, suggested):
    path = write(tmp_path, "p.toml", f"""
        allow = ["example.org"]
        passthrough = [
            "other.example.org:443",
            {quoted(entry)},
        ]
    """)
    policy = load_policy([str(path)])  # a warning, not a problem: the policy loads
    if suggested is None:
        assert policy.warnings == []
        return
    [warning] = policy.warnings
    assert warning.as_warning() == (
        f"{path.resolve()}:4: warning: passthrough: {entry!r} has no port: every protocol on every port "
        f"of it is relayed untouched, never inspected; write {suggested!r} (or the port it needs) to "
        f"open only that")
    fixed = write(tmp_path, "fixed.toml", f'passthrough = [{quoted(suggested)}]\n')
    assert load_policy([str(fixed)]).warnings == []  # the suggestion is a valid entry with a port


def test_passthrough_warnings_name_the_included_file(tmp_path):
    inc = write(tmp_path, "inc.toml", 'passthrough = ["pinned.example.org"]\n')
    main = write(tmp_path, "main.toml", 'include = ["inc.toml"]\npassthrough = ["a.example.org:443"]\n')
    assert [(w.path, w.line) for w in load_policy([str(main)]).warnings] == [(str(inc.resolve()), 1)]


PRIVATE = """
    allow = ["example.com"]
    allow_private = [
        "db.example.com",
        "meta.example.com",
        "10.1.0.0/16",
        "169.254.169.254",
        "fd12::/16",
    ]
"""

PRIVATE_CASES = [
    # (id, host, resolved address, kind, rule or None)
    ("name-private", "db.example.com", "10.9.9.9", "private", "db.example.com"),
    ("name-subdomain-loopback", "x.db.example.com", "127.0.0.1", "loopback", "db.example.com"),
    ("name-link-local", "db.example.com", "169.254.1.1", "link-local", "db.example.com"),
    ("name-cgnat", "db.example.com", "100.64.0.1", "cgnat", "db.example.com"),
    ("name-never-metadata", "meta.example.com", "169.254.169.254", "metadata", "169.254.169.254"),
    ("name-never-metadata-v6", "meta.example.com", "fd00:ec2::254", "metadata", None),
    ("name-never-metadata-alibaba", "meta.example.com", "100.100.100.200", "metadata", None),
    ("range-any-name", "other.example.com", "10.1.2.3", "private", "10.1.0.0/16"),
    ("range-ula", "other.example.com", "fd12::1", "private", "fd12::/16"),
    ("address-metadata", "other.example.com", "169.254.169.254", "metadata", "169.254.169.254"),
    ("not-listed", "other.example.com", "10.2.0.1", "private", None),
    ("not-listed-loopback", "other.example.com", "::1", "loopback", None),
    ("ip-literal-host-not-by-name", "10.9.9.9", "10.9.9.9", "private", None),
    ("ip-literal-host-by-range", "10.1.0.9", "10.1.0.9", "private", "10.1.0.0/16"),
]


@pytest.mark.parametrize(("host", "address", "kind", "rule"), [c[1:] for c in PRIVATE_CASES],
                         ids=[c[0] for c in PRIVATE_CASES])
def test_allow_private(tmp_path, host, address, kind, rule):
    policy = load_policy([str(write(tmp_path, "p.toml", PRIVATE))])
    ip = ipaddress.ip_address(address)
    assert classify(ip) == kind
    got = policy.private_allowed(parse_host(host), ip, kind)
    assert (got.text if got else None) == rule
    if got:
        assert got.key == "allow_private"


# ------------------------------------------- which address to dial, or why not

PRIVATE_REFUSAL = 'to allow it, add "{0}" to the policy\'s allow_private list: allow_private = ["{0}"]'

CHOOSE_CASES = [
    # (id, host, addresses in resolver order, allow_private, dialled address, or the refusal's detail)
    ("public", "pypi.org", ["151.101.0.223"], [], "151.101.0.223", None),
    ("company-dns-reserved", "pypi.org", ["203.0.113.80"], [], None,
     "resolves to 203.0.113.80, reserved for documentation; " + PRIVATE_REFUSAL.format("203.0.113.80")),
    ("first-usable-wins", "pypi.org", ["10.0.0.5", "151.101.0.223"], [], "151.101.0.223", None),
    ("covered-by-address", "pypi.org", ["203.0.113.80"], ["203.0.113.80"], "203.0.113.80", None),
    ("covered-by-range", "pypi.org", ["203.0.113.80"], ["203.0.113.0/24"], "203.0.113.80", None),
    ("covered-by-name", "pypi.org", ["203.0.113.80"], ["pypi.org"], "203.0.113.80", None),
    ("covered-by-exact-name", "pypi.org", ["203.0.113.80"], ["=pypi.org"], "203.0.113.80", None),
    ("exact-name-not-subdomain", "x.pypi.org", ["203.0.113.80"], ["=pypi.org"], None,
     "resolves to 203.0.113.80, reserved for documentation; " + PRIVATE_REFUSAL.format("203.0.113.80")),
    ("covered-one-of-two", "db.test", ["10.0.0.5", "fd12::5"], ["fd12::/16"], "fd12::5", None),
    ("same-class-grouped", "localhost", ["127.0.0.1", "::1"], [], None,
     "resolves to 127.0.0.1 and ::1, loopback; " + PRIVATE_REFUSAL.format("127.0.0.1")),
    ("classes-listed", "mixed.test", ["10.0.0.5", "2001:db8::5"], [], None,
     "resolves to 10.0.0.5, private, and 2001:db8::5, reserved for documentation; "
     + PRIVATE_REFUSAL.format("10.0.0.5")),
    ("at-most-three", "many.test", ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"], [], None,
     "resolves to 10.0.0.1 and 10.0.0.2 and 10.0.0.3, private (and 2 more); " + PRIVATE_REFUSAL.format("10.0.0.1")),
    ("ip-literal", "0x7f.1", ["127.0.0.1"], [], None, "127.0.0.1 is loopback; " + PRIVATE_REFUSAL.format("127.0.0.1")),
    ("ip-literal-metadata", "169.254.169.254", ["169.254.169.254"], [], None,
     "169.254.169.254 is the cloud metadata service; " + PRIVATE_REFUSAL.format("169.254.169.254")),
    ("name-never-opens-metadata", "meta.test", ["169.254.169.254"], ["meta.test"], None,
     "resolves to 169.254.169.254, the cloud metadata service; " + PRIVATE_REFUSAL.format("169.254.169.254")),
    # the loader reads ::ffff:a.b.c.d as IPv4: the suggestion must still cover the IPv6 answer
    ("mapped-answer", "m.test", ["::ffff:10.0.0.1"], [], None,
     "resolves to ::ffff:a00:1, IPv4-mapped IPv6; " + PRIVATE_REFUSAL.format("::ffff:a00:1/128")),
]


@pytest.mark.parametrize(("host", "addresses", "private", "dialled", "detail"), [c[1:] for c in CHOOSE_CASES],
                         ids=[c[0] for c in CHOOSE_CASES])
def test_choose_address(host, addresses, private, dialled, detail):
    policy = policy_from_mapping({"network": "all", "allow_private": private})
    chosen = policy.choose_address(parse_host(host), 443, [ipaddress.ip_address(a) for a in addresses])
    if dialled is not None:
        assert chosen == ipaddress.ip_address(dialled)
        return
    assert isinstance(chosen, Decision)
    assert (chosen.allowed, chosen.reason, chosen.host, chosen.port) == (False, "private-address",
                                                                          parse_host(host).name, 443)
    assert chosen.detail == detail
    assert chosen.words() == detail  # the words a person reads are the specific ones


# Deny wins by address (P17): an IP or CIDR deny entry refuses every name that resolves into it.
DENIED_BY_ADDRESS = [  # (id, deny, host, addresses, allow_private, the entry matched, detail)
    ("name-into-address", ["203.0.113.5"], "any.name.test", ["203.0.113.5"], [], "203.0.113.5",
     "resolves to 203.0.113.5"),
    ("name-into-range", ["203.0.113.0/24"], "x.sslip.test", ["203.0.113.77"], [], "203.0.113.0/24",
     "resolves to 203.0.113.77"),
    ("public-range", ["8.8.8.0/24"], "dns.test", ["8.8.8.8"], [], "8.8.8.0/24", "resolves to 8.8.8.8"),
    ("allow-private-does-not-undo-it", ["127.0.0.2"], "any.name.test", ["127.0.0.2"], ["127.0.0.0/8"],
     "127.0.0.2", "resolves to 127.0.0.2"),
    ("one-of-two-answers", ["203.0.113.0/24"], "two.test", ["151.101.0.223", "203.0.113.5"], [],
     "203.0.113.0/24", "resolves to 203.0.113.5"),
    ("ipv6-range", ["2001:db8::/32"], "v6.test", ["2001:db8::5"], ["2001:db8::/32"], "2001:db8::/32",
     "resolves to 2001:db8::5"),
    ("mapped-answer", ["10.0.0.0/8"], "m.test", ["::ffff:10.0.0.1"], ["::ffff:0:0/96"], "10.0.0.0/8",
     "resolves to ::ffff:a00:1"),
    ("nat64-answer", ["8.8.8.8"], "n.test", ["64:ff9b::808:808"], ["64:ff9b::/96"], "8.8.8.8",
     "resolves to 64:ff9b::808:808"),
    ("nat64-literal", ["8.8.8.8"], "[64:ff9b::808:808]", ["64:ff9b::808:808"], ["64:ff9b::/96"], "8.8.8.8",
     "64:ff9b::808:808 embeds 8.8.8.8"),
    ("on-its-port", ["203.0.113.5:443"], "p.test", ["203.0.113.5"], [], "203.0.113.5:443",
     "resolves to 203.0.113.5"),
]


@pytest.mark.parametrize(("deny", "host", "addresses", "private", "entry", "detail"),
                         [c[1:] for c in DENIED_BY_ADDRESS], ids=[c[0] for c in DENIED_BY_ADDRESS])
def test_a_deny_entry_that_is_an_address_refuses_every_name_resolving_into_it(
        deny, host, addresses, private, entry, detail):
    policy = policy_from_mapping({"network": "all", "deny": deny, "allow_private": private})
    parsed = parse_host(host)
    assert policy.decide(parsed, 443).allowed  # the name itself is not on the deny list
    chosen = policy.choose_address(parsed, 443, [ipaddress.ip_address(a) for a in addresses])
    assert isinstance(chosen, Decision)
    detail += f", covered by the deny entry {entry}"
    assert (chosen.allowed, chosen.reason, chosen.host, chosen.rule.text, chosen.detail) == (
        False, "denied", parsed.name, entry, detail)
    assert chosen.words() == f"on the deny list: matched {entry} (<policy>) ({detail})"


def test_an_address_deny_entry_leaves_other_addresses_and_ports_alone():
    policy = policy_from_mapping({"network": "all", "deny": ["203.0.113.0/24", "198.51.100.7:443", "evil.test"]})
    host = parse_host("ok.test")
    assert policy.choose_address(host, 443, [ipaddress.ip_address("151.101.0.223")]) == ipaddress.ip_address(
        "151.101.0.223")
    assert isinstance(policy.choose_address(host, 80, [ipaddress.ip_address("198.51.100.7")]), Decision)
    assert policy.choose_address(host, 443, [ipaddress.ip_address("198.51.100.7")]).reason == "denied"
    # another port of an address denied on one port only: the private-address check decides, not deny
    assert policy.choose_address(host, 80, [ipaddress.ip_address("198.51.100.7")]).reason == "private-address"


def _special_addresses():
    from test_addresses import ADDRESSES, CLASSES

    return sorted({a for a, kind in ADDRESSES + CLASSES if classify(ipaddress.ip_address(a)) is not None})


@pytest.mark.parametrize("address", _special_addresses())
def test_the_suggested_allow_private_line_allows_exactly_that(tmp_path, address):
    """Every special address: the refusal's suggested line, pasted into a policy, lets the same
    request through, and lets nothing else of that class through."""
    ip = ipaddress.ip_address(address)
    hosts = [parse_host("pypi.org")] + ([parse_host(address)] if parse_host(address).ip == ip else [])
    for host in hosts:
        refusal = policy_from_mapping({"network": "all"}).choose_address(host, 443, [ip])
        line = refusal.detail.rpartition(": ")[2]
        assert line.startswith("allow_private = [")
        path = write(tmp_path, "fixed.toml", f'network = "all"\n{line}\n')
        fixed = load_policy([str(path)])
        assert fixed.choose_address(host, 443, [ip]) == ip, (address, line)
        neighbour = ipaddress.ip_address(int(ip) ^ 1)
        if classify(neighbour) is not None:
            assert isinstance(fixed.choose_address(host, 443, [neighbour]), Decision), (address, line)


# ------------------------------------------------------------- exact entries

EXACT = """
    allow = [
        "=httpbin.org",
        "=s3.amazonaws.com:443",
        "=github.io",
        "=intranet",
        "example.com",
    ]
    deny = [
        "=example.com",
        "=api.example.org",
    ]
    passthrough = ["=herokuapp.com:443"]
"""

EXACT_CASES = [
    # (id, host, port, allowed, reason, rule)
    ("private-suffix-host", "httpbin.org", 443, True, "allowed", "=httpbin.org"),
    ("not-its-subdomains", "www.httpbin.org", 443, False, "not-allowed", None),
    ("not-deeper", "a.b.httpbin.org", 443, False, "not-allowed", None),
    ("case-and-dot", "HTTPBIN.ORG.", 443, True, "allowed", "=httpbin.org"),
    ("with-port", "s3.amazonaws.com", 443, True, "allowed", "=s3.amazonaws.com:443"),
    ("other-port", "s3.amazonaws.com", 80, False, "not-allowed", None),
    ("bucket-not-covered", "bucket.s3.amazonaws.com", 443, False, "not-allowed", None),
    ("github-io-host", "github.io", 443, True, "allowed", "=github.io"),
    ("a-github-pages-site-not", "user.github.io", 443, False, "not-allowed", None),
    ("single-label", "intranet", 443, True, "allowed", "=intranet"),
    ("deny-exact-apex", "example.com", 443, False, "denied", "=example.com"),
    ("deny-exact-not-subdomain", "www.example.com", 443, True, "allowed", "example.com"),
    ("deny-exact-only", "api.example.org", 443, False, "denied", "=api.example.org"),
]


@pytest.mark.parametrize(("host", "port", "allowed", "reason", "rule"), [c[1:] for c in EXACT_CASES],
                         ids=[c[0] for c in EXACT_CASES])
def test_exact_entries(tmp_path, host, port, allowed, reason, rule):
    path = write(tmp_path, "p.toml", EXACT)
    decision = load_policy([str(path)]).decide(host, port)
    assert (decision.allowed, decision.reason) == (allowed, reason)
    assert (decision.rule.text if decision.rule else None) == rule
    if rule:
        assert decision.rule.location() == f"{path.resolve()}:{line_of(path, quoted(rule))}"


def test_exact_passthrough_and_allow_private(tmp_path):
    policy = load_policy([str(write(tmp_path, "p.toml", EXACT))])
    assert policy.passthrough(parse_host("herokuapp.com"), 443).text == "=herokuapp.com:443"
    assert policy.passthrough(parse_host("app.herokuapp.com"), 443) is None


# --------------------------------------------------------- purity, mapping, misc


def test_decisions_are_pure(tmp_path):
    path = write(tmp_path, "p.toml", MATCHING)
    one, two = load_policy([str(path)]), load_policy([str(path)])
    hosts = [c[1] for c in MATCHING_CASES] + ["10.0.0.1", "[::1]"]
    first = [one.decide(h, 443) for h in hosts]
    assert [one.decide(h, 443) for h in hosts] == first  # again: same answers
    assert [two.decide(h, 443) for h in reversed(hosts)] == first[::-1]  # another load, other order
    assert [one.decide(parse_host(h), 443) for h in hosts if h != "a..example.com"] == [
        d for h, d in zip(hosts, first) if h != "a..example.com"]  # str or Host: same
    assert one.rule_count == two.rule_count == 9
    assert all(isinstance(d, Decision) for d in first)


def test_from_mapping(tmp_path, monkeypatch):
    write(tmp_path, "inc.toml", 'allow = ["inc.example.com"]\n')
    monkeypatch.chdir(tmp_path)  # a mapping's includes are relative to the cwd
    policy = policy_from_mapping({"allow": ["example.com"], "deny": ["x.example.com"],
                                  "include": ["inc.toml"]}, "cli")
    assert policy.decide("www.example.com").rule.path == "cli"
    assert policy.decide("x.example.com").reason == "denied"
    assert policy.decide("inc.example.com").allowed
    with pytest.raises(PolicyError) as info:
        policy_from_mapping({"allow": ["com"], "alow": []})
    assert [(p.path, p.line) for p in info.value.problems] == [("<policy>", None)] * 2


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-enabled", "gc-disabled"])
def test_loading_restores_the_garbage_collector(tmp_path, enabled):
    path = write(tmp_path, "p.toml", 'allow = ["example.com"]\n')
    bad = write(tmp_path, "bad.toml", 'allow = ["com"]\n')
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        load_policy([str(path)])
        with pytest.raises(PolicyError):
            load_policy([str(bad)])
        policy_from_mapping({"allow": ["example.com"]})
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


PUBLIC_SUFFIXES = [
    ("com", True), ("uk", True), ("co.uk", True), ("github.io", True),
    ("githubusercontent.com", True), ("xn--p1ai", True), ("foo.ck", True),
    ("www.ck", False),  # exception rule !www.ck
    ("example.com", False), ("example.co.uk", False), ("user.github.io", False),
]


@pytest.mark.parametrize(("name", "expected"), PUBLIC_SUFFIXES, ids=[n for n, _ in PUBLIC_SUFFIXES])
def test_is_public_suffix(name, expected):
    assert is_public_suffix(name) is expected


REGISTRABLE = [
    ("a.b.example.co.uk", "example.co.uk"),
    ("www.example.com", "example.com"),
    ("example.com", "example.com"),
    ("co.uk", None),
    ("com", None),
    ("1.2.3.4", None),
]


@pytest.mark.parametrize(("host", "expected"), REGISTRABLE, ids=[h for h, _ in REGISTRABLE])
def test_registrable_domain(host, expected):
    assert registrable_domain(host) == expected


def test_allow_private_entries_take_no_port(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('allow = ["db.example.org"]\nallow_private = ["db.example.org:5432"]\n')
    with pytest.raises(PolicyError) as error:
        load_policy([str(path)])
    assert f"{path}:2: allow_private: 'db.example.org:5432': a port means nothing here" in str(error.value)


def test_a_set_name_is_never_a_file_in_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path, "dev", 'allow = ["only.example"]\n')
    monkeypatch.chdir(tmp_path)
    assert load_policy(["dev"]).files == [str(builtin_path("dev"))]
    assert load_policy(["./dev"]).decide("only.example", 443).allowed  # a path is a path


# Several entries for one name: the first written that covers the port decides (and is the
# rule reported), whatever the file's size.
SAME_NAME = """
    allow = [
        "a.example:443",
        "a.example",
        "a.example:443",
        "a.example:80",
        "=b.example:8443",
        "=b.example:8443",
        "b.example:8443",
        "10.1.0.0/16:22",
        "10.1.0.0/16",
    ]
    deny = ["x.a.example:443", "x.a.example:443", "x.a.example"]
"""

SAME_NAME_CASES = [
    # (host, port, allowed, rule, its line)
    ("a.example", 443, True, "a.example:443", 2),
    ("a.example", 80, True, "a.example", 3),
    ("www.a.example", 8080, True, "a.example", 3),
    ("x.a.example", 443, False, "x.a.example:443", 12),
    ("x.a.example", 80, False, "x.a.example", 12),
    ("b.example", 8443, True, "=b.example:8443", 6),
    ("www.b.example", 8443, True, "b.example:8443", 8),
    ("b.example", 443, False, None, None),
    ("10.1.2.3", 22, True, "10.1.0.0/16:22", 9),
    ("10.1.2.3", 443, True, "10.1.0.0/16", 10),
]


@pytest.mark.parametrize(("host", "port", "allowed", "rule", "line"), SAME_NAME_CASES,
                         ids=[f"{c[0]}:{c[1]}" for c in SAME_NAME_CASES])
def test_the_first_entry_covering_the_port_decides(tmp_path, host, port, allowed, rule, line):
    path = write(tmp_path, "p.toml", SAME_NAME)
    decision = load_policy([str(path)]).decide(host, port)
    assert decision.allowed is allowed
    assert (str(decision.rule) if decision.rule else None) == (rule and f"{rule} ({path.resolve()}:{line})")


# ------------------------------------------------------------- the tables themselves

# Policies whose decisions must not depend on how keys hash: names, wildcards, exact entries,
# ports, several entries per name, IDN, networks of several prefix lengths.
TABLE_POLICIES = [MATCHING, SAME_NAME, EXACT]
TABLE_HOSTS = sorted({c[1] for c in MATCHING_CASES + EXACT_CASES} | {c[0] for c in SAME_NAME_CASES}
                     | {"10.1.2.3", "10.2.0.1", "b.example", "www.a.example", "x.a.example", "y.x.a.example"})


def _decisions(path: Path) -> list[tuple]:
    policy = load_policy([str(path)])
    return [(host, port, d.allowed, d.reason, str(d.rule)) for host in TABLE_HOSTS for port in (None, 22, 80, 443, 8443)
            for d in [policy.decide(host, port)]]


@pytest.mark.parametrize("text", TABLE_POLICIES, ids=["matching", "same-name", "exact"])
def test_keys_that_all_collide_decide_as_keys_that_do_not(tmp_path, monkeypatch, text):
    # Every key hashed alike: one probe run holds them all, and only the key kept in the blob
    # tells them apart. A hash match alone must never make a host match another's rule.
    from egress.policy import matcher as policy_matcher

    path = write(tmp_path, "p.toml", text)
    spread = _decisions(path)
    monkeypatch.setattr(policy_matcher, "_hash", lambda key: 0x5EED_0000_0000_0001)
    assert _decisions(path) == spread


def test_a_list_spread_over_files_keeps_every_rule_and_its_line(tmp_path):
    # Each file's list is reserved for as it comes; the next file's grows the table (a rehash).
    names = [f"host{i}.part{i % 7}.example" for i in range(600)]
    includes = []
    for part in range(6):
        chunk = names[part * 100:(part + 1) * 100]
        write(tmp_path, f"part{part}.toml", "allow = [\n" + "".join(f'  "{n}",\n' for n in chunk) + "]\n")
        includes.append(f"part{part}.toml")
    main = write(tmp_path, "main.toml", f"include = {includes!r}\n" + 'allow = ["=part0.example"]\n')
    policy = load_policy([str(main)])
    assert policy.rule_count == 601
    for i, name in enumerate(names):
        rule = policy.decide(f"www.{name}", 443).rule
        assert str(rule) == f"{name} ({(tmp_path / f'part{i // 100}.toml').resolve()}:{i % 100 + 2})"
    assert str(policy.decide("part0.example").rule) == f"=part0.example ({main.resolve()}:2)"
    assert not policy.decide("www.part0.example").allowed


def test_a_loaded_policy_keeps_no_small_object_per_entry(tmp_path):
    # The reason for the tables' shape (policy_matcher, "tables"): small objects that outlive a
    # reload's build pin the allocator's arenas. 20,000 entries (names, wildcards, ports,
    # networks, IDN) may keep a few arrays and a blob, not an object each.
    import sys

    entries = []
    for i in range(20_000):
        entries.append([f"h{i}.example.com", f"*.w{i}.example.org", f"p{i}.example.net:443",
                        f"10.{i >> 8 & 255}.{i & 255}.0/24", f"bücher{i}.de"][i % 5])
    path = write(tmp_path, "big.toml", "allow = [\n" + "".join(f'  "{e}",\n' for e in entries) + "]\n")
    load_policy([str(path)])  # imports, caches (the public suffix list), warm
    gc.collect()
    before = sys.getallocatedblocks()
    policy = load_policy([str(path)])
    gc.collect()
    kept = sys.getallocatedblocks() - before
    assert policy.rule_count == 20_000 and kept < 500, kept
