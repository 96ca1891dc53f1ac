"""Credentials in a host name, found before any DNS query.

A lookup of ``<token>.attacker.example`` carries the token to whoever runs example's name
server, whatever the answer, so the name is read before it is resolved: by
:class:`~egress.proxy.addons.credential_guard.CredentialGuard` on CONNECT and on each request head,
and by the passthrough front (egress.proxy.fastpath) through the same guard.

A name is read three ways, and every finding counts:

* as written, by the detector (every format at its boundaries, the stored secrets in any case);
* with the dots between its labels above the registered one removed, by the detector again, so
  that a token or a stored secret cut over labels is whole (``<first 20>.<rest>.ok.test``,
  ``<hex, cut>.<in two>.ok.test``), standing alone before ``.ok.test`` as before;
* by :data:`RULES`, over the labels above the public suffix joined, lower-cased, with no
  boundary rule. A name is not text: nothing in DNS needs a token to stand alone, and DNS
  folds case on the way (a resolver may send any mix, 0x20). So ``x<token>.ok.test``,
  ``<token>z.ok.test`` and ``<token lower-cased>.ok.test`` are the token. A rule fires in one
  case where that form still gives the token away (``CASELESS``): formats with a checksum
  (GitHub's ``ghp_``…, npm's ``npm_``: the CRC32 in the last 6 characters lets the case be
  brute-forced back, ~2^26 tries), formats of one case or hex (``AKIA``, ``dop_v1_``, age keys:
  nothing is lost), and long or underscored prefixes no real name has (``sk-ant-api03-``,
  ``glpat-``, ``sk_live_``, ``ntn_``). Short word-like prefixes (``AIza``, ``ya29``, ``LTAI``,
  ``hvs``, ``SG``) need both cases in the body as written, as the detector does, or a name
  like ``kaizen…`` would be a key. Every body is checked as the detector checks one (no
  placeholder word, no run, enough distinct characters) and holds a digit if its alphabet has them.

The labels above the public suffix, not above the allowed parent: this module does not know the
policy, and a public suffix is where nobody's data starts (``<token>.s3.amazonaws.com`` is a
bucket name anyone can ask for). The real names of tests/core/test_exfil.py and the look-alikes of
tests/scan/test_host_secrets.py (``asiapacific…``, ``accademia2024…``) have no finding.

Not read: a token cut by hyphens, or encoded in a way the detector does not decode (base32;
base64 whose case DNS took away). ``network = "all"`` refuses names shaped like that as
``exfiltration`` (egress.core.exfil); under an allowed parent (``allow = ["ok.test"]``) they go.

A finding names its kind and its span in the name, never the value; :meth:`HostSecrets.redact`
shows a name with each span replaced by ``[redacted:<kind>]``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from egress.core.public_suffix import is_public_suffix
from egress.scan.detect import Detector, Finding

CACHE = 4096  # host names repeat; the cache is cleared when it grows past this

CASELESS, MIXED = True, False


class Rule(NamedTuple):
    """A token format as it can stand in a host name: lower-cased, dots removed."""

    kind: str  # a detect.KINDS key
    regex: re.Pattern[str]  # over the joined, lower-cased labels; group "b" (or "c") is the random body
    shortest: re.Pattern[str]  # the same, each range as short as it can be: the body that is checked
    caseless: bool  # one case is enough (see the module docstring); else both cases as written
    digits: bool = True  # the body's alphabet has digits: a random body holds one


def _rule(kind: str, pattern: str, caseless: bool, digits: bool = True) -> Rule:
    # A body of a range of lengths is checked at its shortest: after it in a name come other
    # labels (``<token>.secret-store.ok.test``), whose words are not the token's.
    return Rule(kind, re.compile(pattern), re.compile(re.sub(r"(\{\d+,\d+\})", r"\1?", pattern)), caseless, digits)


_B62 = "[a-z0-9]"
_B64U = "[a-z0-9_-]"

#: Every format of detect.KINDS whose token can be written in a host name with a prefix to find
#: it by (no ``+``, ``/``, ``=``, ``:``, ``~``; dots are removed before these run). Left out:
#: formats that need one of those characters or a context (Twilio, Telegram, Azure storage and
#: client secrets, AWS secret keys, URL passwords, private keys, Slack webhooks), and those with
#: no prefix of their own (Discord, JWT): the detector still reads them in the name as written.
RULES: tuple[Rule, ...] = (
    # A checksum: the case comes back by brute force.
    _rule("github-token", rf"gh[pousr]_(?P<b>{_B62}{{36}})", CASELESS),
    _rule("npm-token", rf"npm_(?P<b>{_B62}{{36}})", CASELESS),
    # One case, or hex: the lower-cased form is the token.
    _rule("aws-access-key-id", r"a(?:kia|sia|bia|cca)(?P<b>[a-z2-7]{16})", CASELESS),  # AWS writes ids in base32
    _rule("digitalocean-token", r"do[por]_v1_(?P<b>[0-9a-f]{64})", CASELESS),
    _rule("shopify-token", r"shp(?:at|ca|pa|ss)_(?P<b>[0-9a-f]{32})", CASELESS),
    _rule("databricks-token", r"dapi(?P<b>[0-9a-f]{32})", CASELESS),
    _rule("terraform-token", rf"{_B62}{{14}}atlasv1(?P<b>{_B64U}{{60,70}})", CASELESS),
    _rule("age-secret-key", r"age-secret-key-1(?P<b>[qpzry9x8gf2tvdw0s3jn54khce6mua7l]{58})", CASELESS),
    _rule("sentry-token", r"sntryu_(?P<b>[0-9a-f]{64})", CASELESS),
    _rule("postman-api-key", r"pmak-(?P<b>[0-9a-f]{24}-[0-9a-f]{34})", CASELESS),
    _rule("supabase-token", r"sbp_(?P<b>[0-9a-f]{40})", CASELESS),
    _rule("newrelic-api-key", rf"nrak-(?P<b>{_B62}{{27}})", CASELESS),
    # A prefix no real name has (long, or with an underscore): the one-case form is still the token.
    _rule("github-token", rf"github_pat_(?P<b>{_B62}{{22}}_{_B62}{{59}})", CASELESS),
    _rule("gitlab-token", rf"gl(?:pat|dt|rtr|rt|ft|cbt|ptt|oas|agent|imt|soat)-(?P<b>{_B64U}{{20,300}})", CASELESS),
    _rule("slack-token", rf"xox[abceoprs]-(?:[0-9]{{6,14}}-){{1,3}}(?P<b>{_B62}{{20,64}})", CASELESS),
    _rule("slack-token", rf"xoxe(?:xox[bp])?-1-(?P<b>{_B62}{{130,200}})", CASELESS),
    _rule("slack-token", r"xapp-[0-9]-[a-z0-9]{8,12}-[0-9]{10,14}-(?P<b>[a-f0-9]{60,70})", CASELESS),
    _rule("stripe-secret-key", rf"[sr]k_live_(?P<b>{_B62}{{20,247}})", CASELESS),
    _rule("openai-api-key", rf"sk-(?:proj|svcacct|admin|none)-(?P<b>{_B64U}{{40,250}})", CASELESS),
    _rule("openai-api-key", rf"sk-(?P<b>{_B62}{{20}}t3blbkfj{_B62}{{20}})", CASELESS),
    _rule("anthropic-api-key", rf"sk-ant-(?:api|admin)[0-9]{{2}}-(?P<b>{_B64U}{{93}})aa", CASELESS),
    _rule("anthropic-oauth-token", rf"sk-ant-(?:oat|ort|sid)[0-9]{{2}}-(?P<b>{_B64U}{{80,120}})", CASELESS),
    _rule("google-oauth-secret", rf"gocspx-(?P<b>{_B64U}{{28}})", CASELESS),
    _rule("pypi-token", rf"pypi-(?:ageichlwas5vcmc|agendgvzdc5wexbplm9yzw)(?P<b>{_B64U}{{50,1000}})", CASELESS),
    _rule("huggingface-token", r"(?:hf|api_org)_(?P<b>[a-z]{34})", CASELESS, digits=False),
    _rule("heroku-api-key", rf"hrku-aa(?P<b>{_B64U}{{58}})", CASELESS),
    _rule("atlassian-api-token", rf"atatt3(?P<b>{_B64U}{{186}})", CASELESS),
    _rule("groq-api-key", rf"gsk_(?P<b>{_B62}{{52}})", CASELESS),
    _rule("linear-api-key", rf"lin_api_(?P<b>{_B62}{{40}})", CASELESS),
    _rule("sentry-token", rf"sntrys_eyj(?P<b>{_B64U}{{60,400}})", CASELESS),
    _rule("grafana-token", rf"glsa_(?P<b>{_B62}{{32}})_[a-f0-9]{{8}}", CASELESS),
    _rule("grafana-token", rf"glc_(?P<b>{_B62}{{32,400}})", CASELESS),
    _rule("square-token", rf"sq0(?:atp-(?P<b>{_B64U}{{22}})|csp-(?P<c>{_B64U}{{43}}))", CASELESS),
    _rule("perplexity-api-key", rf"pplx-(?P<b>{_B62}{{48}})", CASELESS),
    _rule("notion-token", rf"ntn_(?P<b>{_B62}{{46}})", CASELESS),
    _rule("replicate-api-token", rf"r8_(?P<b>{_B62}{{37}})", CASELESS),
    # Short, word-like prefixes: both cases as written, as the detector asks of a random body.
    _rule("google-api-key", rf"aiza(?P<b>{_B64U}{{35}})", MIXED),
    _rule("google-oauth-token", rf"ya29(?P<b>{_B64U}{{30,1024}})", MIXED),
    _rule("vault-token", rf"hv(?:s(?P<b>{_B64U}{{90,120}})|b(?P<c>{_B64U}{{138,300}}))", MIXED),
    _rule("sendgrid-api-key", rf"sg(?P<b>{_B64U}{{65}})", MIXED),
    _rule("alibaba-access-key-id", rf"ltai(?P<b>{_B62}{{20}})", MIXED),
    _rule("azure-devops-pat", rf"(?P<b>{_B62}{{76}})azdo{_B62}{{4}}", MIXED),
)

# Any rule at all, in one search: most names hold none, and one pass costs a fifth of the rules'.
_ANY_RULE = re.compile("|".join(re.sub(r"\(\?P<[bc]>", "(?:", rule.regex.pattern) for rule in RULES))

# What makes a body made up rather than random: the detector's placeholder words, which a
# name's words could also spell (a real token holds one about once in 10^7).
_WORDS = ("example", "your", "placeholder", "redacted", "dummy", "fake", "sample", "insert",
          "replace", "token", "secret", "xxxx", "changeme", "notreal")
_DIGITS = frozenset("0123456789")


class HostSecrets:
    """The first credential in a host name, cached per name."""

    def __init__(self, detector: Detector, ignore_kinds: frozenset[str]):
        self.detector = detector
        self.ignore_kinds = ignore_kinds
        self._found: dict[str, Finding | None] = {}

    def first(self, host: str) -> Finding | None:
        """The first credential in ``host``, in whatever case it was written, split over its
        labels or glued to other characters; None if none. Its span indexes ``host``."""
        if host not in self._found:
            if len(self._found) > CACHE:
                self._found.clear()
            findings = self.findings(host)
            self._found[host] = findings[0] if findings else None
        return self._found[host]

    def findings(self, host: str) -> list[Finding]:
        """Every credential in ``host`` (not cached), each spanning the characters of ``host``
        that carry it, dots included; in order of where they start."""
        found = self.detector.scan_text(host)
        labels = _labels(host)
        if labels is not None:
            data, registered, suffix = labels
            if len(data) > 1:  # the data labels joined, the rest a name as before
                text, where = _join(data, [registered] + suffix)
                found += [_at(f, where) for f in self.detector.scan_text(text)]
            text, where = _join(data + [registered], [])
            found += [_at(f, where) for f in _rule_findings(text)]
        return sorted((f for f in found if f.kind not in self.ignore_kinds), key=lambda f: (f.start, -f.end))

    def redact(self, text: str) -> str:
        """``text`` with each credential :meth:`findings` sees in its host names (runs of
        letters, digits, ``.``, ``-``, ``_``) replaced by ``[redacted:<kind>]``: what a refusal,
        an event or a log line may show of a name the detector alone reads as clean."""
        out, at = [], 0
        for m in _NAME_RUN.finditer(text):
            spans = _merged(self.findings(m.group()))
            for f in spans:
                out.append(text[at:m.start() + f.start])
                out.append(f"[redacted:{f.kind}]")
                at = m.start() + f.end
        out.append(text[at:])
        return "".join(out)


_NAME_RUN = re.compile(r"[A-Za-z0-9._-]{8,}")


def _merged(findings: list[Finding]) -> list[Finding]:
    """Non-overlapping findings, the outermost span of each overlap kept, with its first kind."""
    out: list[Finding] = []
    for f in findings:
        if out and f.start < out[-1].end:
            if f.end > out[-1].end:
                out[-1] = out[-1]._replace(end=f.end)
        else:
            out.append(f)
    return out


def _labels(host: str) -> tuple[list[str], str, list[str]] | None:
    """``host`` as (the labels above its registered one, the registered label, the public
    suffix's labels); the suffix is the longest the list names, or the top-level label (``.test``,
    ``.internal``). None for an address or a name of one label."""
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if len(labels) < 2 or ":" in name or name.replace(".", "").isdigit():
        return None
    cut = len(labels) - 1
    for i in range(1, len(labels) - 1):  # the longest suffix the list names
        if is_public_suffix(".".join(labels[i:]).lower()):
            cut = i
            break
    return labels[:cut - 1], labels[cut - 1], labels[cut:]


def _join(glued: list[str], rest: list[str]) -> tuple[str, list[int]]:
    """The ``glued`` labels without the dots between them, then ``rest`` as a name (``.a.b``);
    and for each character, its index in the name the labels came from."""
    where: list[int] = []
    at = 0
    for label in glued:
        where.extend(range(at, at + len(label)))
        at += len(label) + 1
    text = "".join(glued)
    if rest:
        tail = "." + ".".join(rest)
        where.extend(range(at - 1, at - 1 + len(tail)))
        text += tail
    return text, where


def _at(finding: Finding, where: list[int]) -> Finding:
    """``finding`` in a joined text, spanning the characters of the name that carry it."""
    return Finding(finding.kind, where[finding.start], where[finding.end - 1] + 1)


def _rule_findings(joined: str) -> list[Finding]:
    """:data:`RULES` over ``joined`` (as written: a MIXED rule asks its case)."""
    folded = joined.lower()
    found: list[Finding] = []
    if _ANY_RULE.search(folded) is None:
        return found
    for rule in RULES:
        pos = 0
        while True:
            m = rule.regex.search(folded, pos)
            if m is None:
                break
            short = rule.shortest.match(folded, m.start())
            assert short is not None  # where regex matches, its shortest form does
            group = "c" if short.groupdict().get("c") else "b"
            body, written = short.group(group), joined[short.start(group):short.end(group)]
            if _random(body, rule.digits) and (rule.caseless or (not written.islower() and not written.isupper())):
                found.append(Finding(rule.kind, m.start(), m.end()))
                break  # one finding of a rule is enough to refuse the name
            pos = m.start() + 1
    return found


def _random(body: str, digits: bool = True) -> bool:
    """Whether a lower-cased token body looks random, not made up or spelt from words: a letter
    and a digit (a random 16 characters of [a-z0-9] have no digit 6% of the time, of 36
    characters 0.2%; of hex, 32 characters, 10^-7), no placeholder word, no run or sequence of
    six, and a spread of distinct characters (as the detector's placeholder test)."""
    chars = set(body)
    if digits and (chars.isdisjoint(_DIGITS) or chars <= _DIGITS):
        return False
    if any(w in body for w in _WORDS):
        return False
    run = step = 1
    prev = -2
    for c in map(ord, body):
        run = run + 1 if c == prev else 1
        step = step + 1 if abs(c - prev) == 1 else 1
        if run >= 6 or step >= 6:
            return False
        prev = c
    return len(chars) >= min(8, len(body) // 3)
