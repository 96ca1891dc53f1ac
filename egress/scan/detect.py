"""Credential detector: well-known token formats and the install's own secrets, raw or encoded.

What it finds
    * 45 kinds of token from 36 providers, each rule knowing its literal prefix, length and
      alphabet, including context-only formats (an AWS secret key beside its key id or
      under an AWS name, an Azure storage key after ``AccountKey=``); and 3 generic kinds:
      JWTs, PEM/OpenSSH/PGP/PuTTY private keys, passwords in URL userinfo. The closed set of
      kinds, with what each is, is :data:`KINDS`;
    * stored secrets: values given at construction, in any ASCII case (a secret upper-cased on
      its way out, or lower-cased in a host name, is the same secret), each reported under its label;
    * both through percent-encoding, JSON string escapes, quoted-printable (soft line breaks
      and ``=XX`` escapes; MIME's Q and B words), base64 (``Authorization: Basic`` included;
      also where its text starts a few characters into its run: ``v1-``, ``x``,
      ``sha256-``) and hex (also inside a run: ``/upload/<hex>``, ``0x<hex>``,
      ``req_<hex>``), decoded only where there is evidence and at most two layers deep.

What it leaves alone
    Placeholders (``ghp_xxxx…``, ``AKIAIOSFODNN7EXAMPLE``, ``${GITHUB_TOKEN}``, runs of one
    character, ``123456``/``abcdef`` sequences, low-variety bodies, words like *example*,
    *your*, *placeholder*, a body in one case where the alphabet has two), tokens that
    are part of a longer run of their own alphabet,
    public material (Stripe ``pk_``, PEM certificates and public keys, ``ssh-ed25519``
    keys), UUIDs, git SHAs, digests and ETags (hex is decoded only where it decodes to ASCII
    text; nothing is flagged for its shape alone).

How it is fast
    One compiled pass finds every candidate: Hyperscan (:mod:`egress.scan.multimatch`) runs
    every anchor (``ghp_``, ``AKIA``, ``eyJ``, ``-----BEGIN``, a URL with userinfo, the
    stored secrets in any case, ...) and the starts of the base64/hex runs worth decoding
    and quoted-printable evidence (:data:`egress.scan.decode.RUN_TRIGGERS`) over the buffer at
    once, so clean text costs one pass of SIMD code and no Python step per byte, word or
    run. At a candidate, the
    regex of the anchor's *lead* character runs (the anchors are grouped by a rare
    character each contains, ``_ - . : ~ A J B p``; one-character gates and look-arounds
    after it); only where it matches does a rule's full pattern run. Those lead regexes
    were the prefilter itself before (nine passes of CPython's engine; bench/README.md,
    Scanner, has the speeds): the compiled pass only has to find every
    place one of them matches, and the tests check that it does. JSON and percent
    escapes are found with literal searches (``\\``, ``%``) and one regex call a segment,
    and all of a buffer's segments are decoded at once; the layers' Python step per
    segment or run is most of what is left (bench/README.md, Scanner).
    ``bench/scanner_bench.py`` measures it.

Findings carry a kind and a span, never a value. A finding inside an encoded layer spans
the encoded text that carries it (for base64: the characters holding its bits).

Known gaps
    * Base64 runs under 20 characters are decoded only after ``Basic`` or as lines of a
      wrapped text (16+ a line); base64 that decodes to binary is scanned for tokens but
      not decoded further. Base64 whose text starts out of its run's phase is decoded only
      when 15 ASCII bytes start within the run's first 15 characters (not two texts glued
      mid-run, nor a token deep inside binary at a shifted phase).
    * Hex is decoded where 16 pairs that are ASCII bytes start at the first or second digit
      of a run of 32+ hex digits, and that run of digits starts its run, follows "-", "_"
      or "0x", or follows any other character in a run with no upper-case letter before
      it; so not hex glued after other hex digits that are not ASCII, nor after "/", "+"
      or a letter once its run has had an upper-case letter (``/Upload/<hex>``). Only
      stretches of 16+ ASCII bytes are decoded.
    * Quoted-printable is decoded where there is evidence: an escape of a printable
      character with a run character or another escape right after it, or 12 run
      characters right before it, or "=" at a line's end after anything but "=".
    * Escapes the layers do not know (``\\x41``, HTML entities, ``+`` for a space except in
      a stored secret), a third layer, compression inside a body beyond its
      Content-Encoding, and encryption hide a token.
    * Bearer tokens, passwords and API keys of no known format are found only as stored
      secrets (and, by StreamRedactor, as ``NAME=value`` with a secret name).
    * Google API keys (``AIza``), AWS key ids and JWTs are also used where they are not
      secret (web pages, session cookies); they are reported all the same.
    * Streams: an encoded token longer than :attr:`Detector.overlap` that straddles a chunk
      boundary can be missed.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
import zlib
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import accumulate, compress
from typing import Any, NamedTuple, cast

from egress.scan import multimatch
from egress.scan.decode import (
    B64_MIN_RUN,
    RUN_TABLE,
    RUN_TRIGGERS,
    Segment,
    Triggers,
    UndecodableBody,
    basic_segment,
    decode_content,
    layer_segments,
    run_start,
    span,
)

__all__ = ["Finding", "Detector", "StreamScanner", "StreamRedactor", "UndecodableBody", "decode_content",
           "is_secret_name", "MIN_SECRET_LENGTH", "RULES", "KINDS", "ENV_SECRET_KIND"]


class Finding(NamedTuple):
    """A credential found in a buffer: ``kind`` (a :data:`KINDS` key or a stored secret's
    label) and its span ``[start, end)``; never the value."""

    kind: str
    start: int
    end: int


#: Every kind a format rule can report, with the provider and what it is. Stored secrets
#: are reported under their own labels; StreamRedactor adds :data:`ENV_SECRET_KIND`.
KINDS: dict[str, str] = {
    "github-token": "GitHub: classic PAT ghp_, OAuth gho_, app ghu_/ghs_, refresh ghr_, fine-grained github_pat_",
    "gitlab-token": "GitLab: glpat-, gldt-, glrt-, glft-, glcbt-, glptt-, gloas-, glagent-, glimt-, glsoat-",
    "aws-access-key-id": "AWS: access key id AKIA/ASIA/ABIA/ACCA + 16 base32 characters (names the secret key it pairs with)",
    "aws-secret-access-key": "AWS: 40-character secret key beside its key id or under an AWS secret name",
    "aws-bedrock-key": "AWS: Bedrock long-lived API key ABSK",
    "slack-token": "Slack: xoxb-/xoxp-/xoxa-/xoxr-/xoxs-/xoxo-/xoxc- tokens, xoxe refresh tokens, xapp- app tokens",
    "slack-webhook": "Slack: incoming webhook / workflow URL path on hooks.slack.com",
    "stripe-secret-key": "Stripe: secret sk_live_ and restricted rk_live_ keys (not pk_ publishable keys)",
    "openai-api-key": "OpenAI: sk-proj-/sk-svcacct-/sk-admin- keys and legacy sk-…T3BlbkFJ… keys",
    "anthropic-api-key": "Anthropic: API key sk-ant-api03-…AA and admin key sk-ant-admin01-…AA",
    "anthropic-oauth-token": "Anthropic: OAuth/Claude Code tokens sk-ant-oat01-/sk-ant-ort01-",
    "google-api-key": "Google: API key AIza…",
    "google-oauth-secret": "Google: OAuth client secret GOCSPX-",
    "google-oauth-token": "Google: OAuth access token ya29.",
    "npm-token": "npm: access token npm_",
    "pypi-token": "PyPI / TestPyPI: upload token pypi-AgEIcHlwaS5vcmc… / pypi-AgENdGVzdC5weXBpLm9yZw…",
    "huggingface-token": "Hugging Face: user token hf_, org token api_org_",
    "sendgrid-api-key": "SendGrid: API key SG.<22>.<43>",
    "twilio-auth-token": "Twilio: auth token / API key secret after its SID (AC…/SK…:<32>, as in Basic auth)",
    "digitalocean-token": "DigitalOcean: dop_v1_/doo_v1_/dor_v1_",
    "shopify-token": "Shopify: shpat_/shpca_/shppa_/shpss_",
    "databricks-token": "Databricks: PAT dapi<32 hex>",
    "vault-token": "HashiCorp Vault: service hvs. and batch hvb. tokens",
    "terraform-token": "HashiCorp Terraform Cloud: <14>.atlasv1.<60+> API token",
    "discord-bot-token": "Discord: bot token <base64 user id>.<6>.<27-38>",
    "telegram-bot-token": "Telegram: bot token <8-10 digits>:A<34>",
    "jwt": "JSON Web Token eyJ….eyJ….<signature> (header names an alg)",
    "private-key": "PEM/OpenSSH/PGP private key block, SSH2 and PuTTY private key files",
    "azure-storage-key": "Azure: storage account key (88 base64) after AccountKey= / account_key",
    "azure-client-secret": "Azure / Entra ID: application client secret (…Q~…)",
    "azure-devops-pat": "Azure DevOps: personal access token (84 characters, AZDO signature)",
    "url-password": "Password in URL userinfo scheme://user:password@host",
    "age-secret-key": "age: secret key AGE-SECRET-KEY-1…",
    "groq-api-key": "Groq: API key gsk_",
    "linear-api-key": "Linear: API key lin_api_",
    "sentry-token": "Sentry: user token sntryu_, org token sntrys_",
    "postman-api-key": "Postman: API key PMAK-",
    "heroku-api-key": "Heroku: API key HRKU-AA",
    "grafana-token": "Grafana: service account glsa_, cloud glc_",
    "doppler-token": "Doppler: dp.pt./dp.st./dp.sa./dp.ct./dp.scim./dp.audit. tokens",
    "atlassian-api-token": "Atlassian: API token ATATT3",
    "alibaba-access-key-id": "Alibaba Cloud: AccessKey id LTAI",
    "square-token": "Square: access token sq0atp-, OAuth secret sq0csp-",
    "perplexity-api-key": "Perplexity: API key pplx-",
    "notion-token": "Notion: integration token ntn_",
    "replicate-api-token": "Replicate: API token r8_",
    "supabase-token": "Supabase: access token sbp_",
    "newrelic-api-key": "New Relic: user API key NRAK-",
}
ENV_SECRET_KIND = "env-secret"  # StreamRedactor: the value of NAME=value where NAME is_secret_name
RULES: tuple[str, ...] = tuple(KINDS)

#: A stored secret shorter than this would match ordinary text; Detector refuses it.
MIN_SECRET_LENGTH = 8

# Alphabets (regex class bodies).
_B62 = "A-Za-z0-9"
_B64U = r"A-Za-z0-9_\-"
_MAX_DEPTH = 2  # encoded layers: raw -> decoded -> decoded again
_SEP = b"\x00"  # between decoded segments scanned together: no rule crosses it
_GENERIC = {"url-password", "jwt", "aws-secret-access-key"}  # lose ties against specific kinds

# ------------------------------------------------------------------ placeholders

_WORDS = (b"example", b"your", b"placeholder", b"redacted", b"dummy", b"fake", b"sample", b"insert",
          b"replace", b"token", b"secret", b"xxxx", b"changeme", b"notreal")
_KNOWN_EXAMPLES = {
    b"AKIAIOSFODNN7EXAMPLE",  # AWS documentation
    b"wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    b"SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",  # jwt.io's example signature
}
_HEXDIGITS = b"0123456789abcdefABCDEF"


def _plausible(body: bytes, mixed: bool = False) -> bool:
    """False for a token body that looks made up: a placeholder word, a run of one
    character, an ascending/descending sequence, too few distinct characters, or (for
    ``mixed``: a random body over an alphabet with both cases, 16+ characters long) one
    case only -- a random 20-character base62 string is single-case about once in 50,000."""
    if body in _KNOWN_EXAMPLES:
        return False
    if mixed and len(body) >= 16 and (body.islower() or body.isupper() or not body.strip(_HEXDIGITS)):
        return False
    lower = body.lower()
    if any(w in lower for w in _WORDS):
        return False
    hexonly = not body.strip(_HEXDIGITS)
    limit = 8 if hexonly else 6  # a run this long in random text: ~1e-5 per token or less
    run = step_run = 1
    prev = -2
    for c in body:
        run = run + 1 if c == prev else 1
        step_run = step_run + 1 if abs(c - prev) == 1 else 1
        if run >= limit or step_run >= limit:
            return False
        prev = c
    return len(set(body)) >= min(8, len(body) // 3)


_B62_DIGITS = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_B62_DIGITS_ALT = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _crc_ok(token: bytes, prefix_len: int) -> bool:
    """GitHub/npm tokens end in 6 base62 digits of the CRC32 of the 30 characters before
    them. The digit order is not documented; both orders in use are accepted."""
    body = token[prefix_len:]
    if len(body) != 36:
        return False
    crc = zlib.crc32(body[:30])
    for digits in (_B62_DIGITS, _B62_DIGITS_ALT):
        n, out = crc, bytearray()
        while n:
            n, r = divmod(n, 62)
            out.append(digits[r])
        if bytes(reversed(out)).rjust(6, b"0") == body[30:]:
            return True
    return False


# ------------------------------------------------------------------------ rules


class _Rule(NamedTuple):
    kind: str
    regex: re.Pattern[bytes] | None  # matched at the token start; or ``match`` below
    offsets: tuple[int, ...]  # token start = anchor start - offset (tried in order)
    group: int | str  # the reported span
    check: Callable[[re.Match[bytes]], bool] | None
    match: Callable[[bytes, int], tuple[int, int] | None] | None = None


class _Anchor(NamedTuple):
    lead: bytes  # one character: the group (pass) it belongs to
    before: bytes  # regex, fixed width, for the text before the lead character
    before_len: int
    after: bytes  # regex for the text after it
    start_boundary: bytes  # class body: the character before the anchor must not be in it
    prev: bytes | None = None  # the characters that may come right before the lead one, if known
    next: bytes | None = None  # the characters that may come right after it, if known


def _body_check(prefix_len: int, crc: bool = False, mixed: bool = True) -> Callable[[re.Match[bytes]], bool]:
    """A check on what follows the prefix: plausible (see _plausible); a valid checksum
    (GitHub, npm) is enough on its own."""
    def check(m: re.Match[bytes]) -> bool:
        token = m.group(0)
        if crc and _crc_ok(token, prefix_len):
            return True
        return _plausible(token[prefix_len:], mixed)
    return check


def _group_check(group: str, mixed: bool = True) -> Callable[[re.Match[bytes]], bool]:
    return lambda m: _plausible(m.group(group), mixed)


def _tok(body: str, alphabet: str, start: str | None = None) -> re.Pattern[bytes]:
    """A token: ``body`` not preceded or followed by a character of ``alphabet``."""
    start = alphabet.replace("=", "") if start is None else start  # "=" is padding: only at the end
    return re.compile(f"(?<![{start}]){body}(?![{alphabet}])".encode())


def _mixed_b64(value: bytes) -> bool:
    """A 40-character AWS secret: random base64, so both cases and a digit (and not hex)."""
    v = value.replace(b"\\/", b"/")
    return (not v.islower() and not v.isupper() and any(48 <= c <= 57 for c in v)
            and bool(v.strip(_HEXDIGITS)) and _plausible(v))


def _jwt_check(m: re.Match[bytes]) -> bool:
    header = m.group(1)
    try:
        decoded = base64.urlsafe_b64decode(header + b"=" * (-len(header) % 4))
    except (binascii.Error, ValueError):
        return False
    signature = m.group(0).rsplit(b".", 1)[-1]
    return decoded.startswith(b"{") and b'"alg"' in decoded and signature not in _KNOWN_EXAMPLES


def _discord_check(m: re.Match[bytes]) -> bool:
    part = m.group(1)
    try:
        user_id = base64.urlsafe_b64decode(part + b"=" * (-len(part) % 4))
    except (binascii.Error, ValueError):
        return False
    return user_id.isdigit() and 17 <= len(user_id) <= 20 and _plausible(m.group(2), True)


_URL_PLACEHOLDERS = {b"password", b"passwd", b"pass", b"pwd", b"secret", b"token", b"x-oauth-basic",
                     b"changeme", b"pw", b"p", b"***", b"...", b"x"}


def _url_password_check(m: re.Match[bytes]) -> bool:
    pw = m.group("v")
    low = pw.lower()
    if low in _URL_PLACEHOLDERS or pw[:1] in (b"$", b"<", b"{", b"%") and not re.match(rb"%[0-9A-Fa-f]{2}", pw):
        return False
    if not pw.strip(b"*x.X") or (pw.isdigit() and len(pw) <= 5):  # masked, or a port (host:8080@…)
        return False
    if b"your" in low or b"placeholder" in low or b"example" in low:
        return False
    return True


_PEM_HEADER = re.compile(rb"(-----BEGIN|---- BEGIN) ((?:[A-Z0-9]{1,32} ){0,6})PRIVATE KEY(?: BLOCK)?( ?-{4,5})")
_PEM_FOOTER = re.compile(rb"(?:-----END|---- END) (?:[A-Z0-9]{1,32} ){0,6}PRIVATE KEY(?: BLOCK)? ?-{4,5}")
_PEM_NEXT = re.compile(rb"-----BEGIN |---- BEGIN ")
# Without an END line: base64 lines (raw or \n-escaped newlines) and armor headers.
_PEM_BODY = re.compile(rb"(?:[A-Za-z0-9+/=]+|\\/|[ \t]*(?:\r?\n|\\r\\n|\\n)[ \t]*|[A-Za-z-]+: [^\r\n\\]*)*")
_NON_B64 = bytes(c for c in range(256) if c not in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
_PEM_MAX = 16384


def _pem_match(data: bytes, pos: int) -> tuple[int, int] | None:
    """A private key block from its BEGIN line to its END line, with at least 64 base64
    characters. Without an END line: to the end of the data if that is near (a block cut
    short, or still arriving on a stream), else to where the base64 body stops.

    A block ends at the next BEGIN line at the latest: every search stops there, so a run
    of headers costs what its bytes cost (each header looking 16 KiB ahead wedged a scan on
    a small gzipped body: bench/README.md, Scanner, "Wedging")."""
    m = _PEM_HEADER.match(data, pos)
    if m is None:
        return None
    head = m.end()
    nxt = _PEM_NEXT.search(data, head, head + _PEM_MAX)
    stop = nxt.start() if nxt else head + _PEM_MAX
    footer = _PEM_FOOTER.search(data, head, stop)
    if footer:
        end = footer.end()
    elif nxt is None and len(data) - head <= _PEM_MAX:
        end = len(data)
    else:
        end = _PEM_BODY.match(data, head, stop).end()  # type: ignore[union-attr]  # (...)* matches
    body = data[head:end].replace(b"\\n", b"").translate(None, _NON_B64)
    if len(body) < 64 or len(set(body)) < 16:
        return None
    return pos, end


_PUTTY_MAC = re.compile(rb"Private-MAC: [0-9a-fA-F]{20,128}")


def _putty_match(data: bytes, pos: int) -> tuple[int, int] | None:
    nxt = data.find(b"PuTTY-User-Key-File-", pos + 1, pos + _PEM_MAX)  # as for PEM: stop at the next key
    k = data.find(b"Private-MAC: ", pos, nxt if nxt >= 0 else pos + _PEM_MAX)
    if k < 0 or data.find(b"Private-Lines:", pos, k) < 0:
        return None
    m = _PUTTY_MAC.match(data, k)
    return (pos, m.end()) if m else None


_URL_USERINFO = r"//[^\s:/?#\[\]@\"'<>\\]{0,256}:[^\s/?#\[\]@\"'<>\\]{1,256}@(?=[A-Za-z0-9\[])"
_AWS_KEYWORDS = ("secret_access_key", "SECRET_ACCESS_KEY", "SecretAccessKey", "secretAccessKey",
                 "secret-access-key", "aws_secret_key", "AWS_SECRET_KEY")
_AWS_VALUE = rb"(?P<v>(?:[A-Za-z0-9+]|\\?/){40})(?![A-Za-z0-9+/=\\])"
_AZURE_KEYWORDS = ("AccountKey", "account_key", "ACCOUNT_KEY", "storage_key", "STORAGE_KEY")
_SEPARATOR = rb"[\s\"'\\:=>]{1,12}"
_AWS_NEAR = re.compile(rb"(?<![A-Za-z0-9+/=\\])(?:[A-Za-z0-9+]|\\?/){40}(?![A-Za-z0-9+/=\\])")
_AWS_NEAR_REACH = 120

# (kind, anchors, pattern, offsets, group, check); anchors are literal strings, or
# (lead, before-regex, before-length, after-regex) tuples for anchors that are not literal.
# (kind, anchors, pattern, offsets, group, check[, match]): a _Rule and the anchors that lead to it
_TABLE: list[tuple[Any, ...]] = [
    ("github-token", ["ghp_", "gho_", "ghu_", "ghs_", "ghr_"],
     _tok(r"gh(?:[pous]_[A-Za-z0-9]{36}|r_[A-Za-z0-9]{36}(?:[A-Za-z0-9]{40})?)", _B62 + "_"), (0,), 0,
     _body_check(4, crc=True)),
    ("github-token", ["github_pat_"], _tok(r"github_pat_[A-Za-z0-9]{22}_[A-Za-z0-9]{59}", _B62 + "_"), (0,), 0,
     _body_check(11)),
    ("gitlab-token", ["glpat-", "gldt-", "glrt-", "glft-", "glcbt-", "glptt-", "gloas-", "glagent-", "glimt-",
                      "glsoat-", "glrtr-"],
     _tok(r"gl(?:pat|dt|rt|rtr|ft|cbt|ptt|oas|agent|imt|soat)-[A-Za-z0-9_-]{20,300}(?:\.[0-9a-z]{9})?", _B64U),
     (0,), 0, lambda m: _plausible(m.group(0).split(b"-", 1)[1], True)),
    ("aws-access-key-id", ["AKIA", "ASIA", "ABIA", "ACCA"], _tok(r"A(?:KIA|SIA|BIA|CCA)[A-Z2-7]{16}", _B62),
     (0,), 0, lambda m: m.group(0) not in _KNOWN_EXAMPLES and _plausible(m.group(0)[4:])),
    ("aws-secret-access-key", list(_AWS_KEYWORDS),
     re.compile(b"(?:" + "|".join(_AWS_KEYWORDS).encode() + b")" + _SEPARATOR + _AWS_VALUE), (0,), "v",
     lambda m: _mixed_b64(m.group("v"))),
    ("aws-bedrock-key", ["ABSK"], _tok(r"ABSK[A-Za-z0-9+/]{109,269}={0,2}", _B62 + "+/="), (0,), 0,
     _body_check(4)),
    ("slack-token", ["xoxb-", "xoxp-", "xoxa-", "xoxr-", "xoxs-", "xoxo-", "xoxc-", "xoxe-", "xoxe.", "xapp-"],
     _tok(r"(?:xox[abceoprs]-(?:[0-9]{6,14}-){1,3}[A-Za-z0-9]{20,64}"
          r"|xoxe(?:\.xox[bp])?-1-[A-Za-z0-9]{130,200}"
          r"|xapp-[0-9]-[A-Z0-9]{8,12}-[0-9]{10,14}-[a-f0-9]{60,70})", _B62 + r"\-"),
     (0,), 0, lambda m: _plausible(m.group(0).rsplit(b"-", 1)[1])),
    ("slack-webhook", ["hooks.slack.com/"],
     re.compile(rb"hooks\.slack\.com/(?P<v>services/T[A-Z0-9]{8,12}/B[A-Z0-9]{8,12}/[A-Za-z0-9]{23,25}"
                rb"|(?:workflows|triggers)/T[A-Z0-9]{8,12}/A[A-Z0-9]{8,12}/[0-9]{15,20}/[A-Za-z0-9]{32})"
                rb"(?![A-Za-z0-9])"),
     (0,), "v", lambda m: _plausible(m.group("v").rsplit(b"/", 1)[1], True)),
    ("stripe-secret-key", ["sk_live_", "rk_live_"], _tok(r"[sr]k_live_[A-Za-z0-9]{20,247}", _B62 + "_"), (0,), 0,
     _body_check(8)),
    ("openai-api-key", ["sk-proj-", "sk-svcacct-", "sk-admin-", "sk-None-"],
     _tok(r"sk-(?:proj|svcacct|admin|None)-[A-Za-z0-9_-]{40,250}", _B64U), (0,), 0,
     lambda m: _plausible(m.group(0).split(b"-", 2)[2], True)),
    ("openai-api-key", ["sk-"], _tok(r"sk-[A-Za-z0-9]{20}T3BlbkFJ[A-Za-z0-9]{20}", _B64U), (0,), 0,
     _body_check(3)),
    ("anthropic-api-key", ["sk-ant-"], _tok(r"sk-ant-(?:api|admin)[0-9]{2}-[A-Za-z0-9_-]{93}AA", _B64U), (0,), 0,
     lambda m: _plausible(m.group(0).split(b"-", 3)[3], True)),
    ("anthropic-oauth-token", ["sk-ant-"], _tok(r"sk-ant-(?:oat|ort|sid)[0-9]{2}-[A-Za-z0-9_-]{80,120}", _B64U),
     (0,), 0, lambda m: _plausible(m.group(0).split(b"-", 3)[3], True)),
    ("google-api-key", ["AIza"], _tok(r"AIza[A-Za-z0-9_-]{35}", _B64U), (0,), 0, _body_check(4)),
    ("google-oauth-secret", ["GOCSPX-"], _tok(r"GOCSPX-[A-Za-z0-9_-]{28}", _B64U), (0,), 0, _body_check(7)),
    ("google-oauth-token", ["ya29."], _tok(r"ya29\.[A-Za-z0-9_-]{30,1024}", _B64U), (0,), 0, _body_check(5)),
    ("npm-token", ["npm_"], _tok(r"npm_[A-Za-z0-9]{36}", _B62 + "_"), (0,), 0, _body_check(4, crc=True)),
    ("pypi-token", ["pypi-AgEIcHlwaS5vcmc", "pypi-AgENdGVzdC5weXBpLm9yZw"],
     _tok(r"pypi-(?:AgEIcHlwaS5vcmc|AgENdGVzdC5weXBpLm9yZw)[A-Za-z0-9_-]{50,1000}", _B64U), (0,), 0,
     _body_check(25)),
    ("huggingface-token", ["hf_", "api_org_"], _tok(r"(?:hf|api_org)_[A-Za-z]{34}", _B62 + "_"), (0,), 0,
     lambda m: _plausible(m.group(0)[-34:], True)),
    ("sendgrid-api-key", ["SG."], _tok(r"SG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}", _B64U + "."), (0,), 0,
     _body_check(3)),
    ("twilio-auth-token", [(":", "(?:AC|SK)[0-9a-f]{32}", 34, "[A-Za-z0-9]{32}", "", "0123456789abcdef")],
     re.compile(rb"(?<![A-Za-z0-9])(?:AC|SK)[0-9a-f]{32}:(?P<v>[A-Za-z0-9]{32})(?![A-Za-z0-9])"), (0,), "v",
     _group_check("v", mixed=False)),
    ("digitalocean-token", ["dop_v1_", "doo_v1_", "dor_v1_"], _tok(r"do[por]_v1_[a-f0-9]{64}", _B62 + "_"), (0,), 0,
     _body_check(7, mixed=False)),
    ("shopify-token", ["shpat_", "shpca_", "shppa_", "shpss_"],
     _tok(r"shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}", _B62 + "_"), (0,), 0,
     _body_check(6, mixed=False)),
    ("databricks-token", [("p", "da", 2, "i[a-f0-9]{32}", _B62, "a")],
     _tok(r"dapi[a-f0-9]{32}(?:-[0-9]{1,2})?", _B62 + r"\-"),
     (0,), 0, lambda m: _plausible(m.group(0)[4:36])),
    ("vault-token", ["hvs.", "hvb."], _tok(r"(?:hvs\.[A-Za-z0-9_-]{90,120}|hvb\.[A-Za-z0-9_-]{138,300})", _B64U),
     (0,), 0, _body_check(4)),
    ("terraform-token", [(".", "", 0, "atlasv1\\.", "", "", "a")],
     _tok(r"[a-z0-9]{14}\.atlasv1\.[a-z0-9_=-]{60,70}", _B64U + "="), (14,), 0,
     lambda m: _plausible(m.group(0)[23:])),
    ("discord-bot-token", [(".", "[A-Za-z0-9_-]{23}", 23, "[A-Za-z0-9_-]{6}\\.", "")],
     _tok(r"([MNO][DTjz][A-Za-z0-9_-]{22,24})\.[A-Za-z0-9_-]{6}\.([A-Za-z0-9_-]{27,38})", _B64U),
     (1, 2, 3), 0, _discord_check),
    ("telegram-bot-token", [(":", "[0-9]{8}", 8, "A[A-Za-z0-9_-]{34}", "", "0123456789")],
     re.compile(rb"(?:(?<=bot)|(?<![A-Za-z0-9]))[0-9]{8,10}:A[A-Za-z0-9_-]{34}(?![A-Za-z0-9_-])"), (0, 1, 2), 0,
     lambda m: _plausible(m.group(0).split(b":", 1)[1], True)),
    ("jwt", [("J", "ey", 2, "", _B64U, "y")],
     _tok(r"(eyJ[A-Za-z0-9_-]{8,4096})\.[A-Za-z0-9_-]{2,8192}\.[A-Za-z0-9_-]{0,2048}"
          r"(?:\.[A-Za-z0-9_-]{0,4096}\.[A-Za-z0-9_-]{0,2048})?", _B64U), (0,), 0, _jwt_check),
    ("private-key", ["-----BEGIN ", "---- BEGIN "], None, (0,), 0, None, _pem_match),
    ("private-key", ["PuTTY-User-Key-File-"], None, (0,), 0, None, _putty_match),
    ("azure-storage-key", list(_AZURE_KEYWORDS),
     re.compile(b"(?:" + "|".join(_AZURE_KEYWORDS).encode() + b")" + _SEPARATOR
                + rb"(?P<v>(?:[A-Za-z0-9+]|\\?/){86}==)(?![A-Za-z0-9+/=])"), (0,), "v",
     lambda m: _plausible(m.group("v"), True)),
    ("azure-client-secret", [("~", "[0-9]Q", 2, "", "", "Q")],
     _tok(r"[A-Za-z0-9_~.-]{3}[0-9]Q~[A-Za-z0-9_~.-]{31,34}", r"A-Za-z0-9_~.\-"), (3,), 0,
     lambda m: _plausible(m.group(0)[6:], True)),
    ("azure-devops-pat", [("A", "", 0, "ZDO", "", "", "Z")], _tok(r"[A-Za-z0-9]{76}AZDO[A-Za-z0-9]{4}", _B62), (76,), 0,
     lambda m: _plausible(m.group(0)[:76], True)),
    # The anchor carries the whole pattern as its look-ahead: "://" is in every URL, and
    # the ones without userinfo are turned down in the prefilter, not in Python (a clean
    # scan of JSON with URLs has many: bench/README.md, Scanner).
    ("url-password", [(":", "", 0, _URL_USERINFO, "", "", "/")],
     re.compile(rb":" + _URL_USERINFO.encode().replace(b":[^", b":(?P<v>[^", 1).replace(b"}@", b"})@", 1)), (0,),
     "v", _url_password_check),
    ("age-secret-key", ["AGE-SECRET-KEY-1"],
     _tok(r"AGE-SECRET-KEY-1[QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L]{58}", _B62 + r"\-"), (0,), 0,
     _body_check(16, mixed=False)),
    ("groq-api-key", ["gsk_"], _tok(r"gsk_[A-Za-z0-9]{52}", _B62 + "_"), (0,), 0, _body_check(4)),
    ("linear-api-key", ["lin_api_"], _tok(r"lin_api_[A-Za-z0-9]{40}", _B62 + "_"), (0,), 0, _body_check(8)),
    ("sentry-token", ["sntryu_"], _tok(r"sntryu_[a-f0-9]{64}", _B62 + "_"), (0,), 0,
     _body_check(7, mixed=False)),
    ("sentry-token", ["sntrys_eyJ"], _tok(r"sntrys_eyJ[A-Za-z0-9+/=_-]{60,400}", _B62 + r"+/=_\-"), (0,), 0,
     _body_check(10)),
    ("postman-api-key", ["PMAK-"], _tok(r"PMAK-[a-f0-9]{24}-[a-f0-9]{34}", _B62 + r"\-"), (0,), 0,
     _body_check(5, mixed=False)),
    ("heroku-api-key", ["HRKU-AA"], _tok(r"HRKU-AA[A-Za-z0-9_-]{58}", _B64U), (0,), 0, _body_check(7)),
    ("grafana-token", ["glsa_"], _tok(r"glsa_[A-Za-z0-9]{32}_[A-Fa-f0-9]{8}", _B62 + "_"), (0,), 0,
     _body_check(5)),
    ("grafana-token", ["glc_"], _tok(r"glc_[A-Za-z0-9+/]{32,400}={0,2}", _B62 + "+/=_"), (0,), 0, _body_check(4)),
    ("doppler-token", [(".", "dp", 2, "(?:pt|st|sa|ct|scim|audit)\\.", _B62, "p")],
     _tok(r"dp\.(?:pt|st(?:\.[a-z0-9_-]{1,40})?|sa|ct|scim|audit)\.[A-Za-z0-9]{40,44}", _B62), (0,), 0,
     lambda m: _plausible(m.group(0).rsplit(b".", 1)[1], True)),
    ("atlassian-api-token", ["ATATT3"], _tok(r"ATATT3[A-Za-z0-9_=-]{186}", _B64U + "="), (0,), 0, _body_check(6)),
    ("alibaba-access-key-id", ["LTAI"], _tok(r"LTAI[A-Za-z0-9]{20}", _B62), (0,), 0,
     _body_check(4, mixed=False)),
    ("square-token", ["sq0atp-", "sq0csp-"], _tok(r"(?:sq0atp-[A-Za-z0-9_-]{22}|sq0csp-[A-Za-z0-9_-]{43})", _B64U),
     (0,), 0, _body_check(7)),
    ("perplexity-api-key", ["pplx-"], _tok(r"pplx-[A-Za-z0-9]{48}", _B62 + r"\-"), (0,), 0, _body_check(5)),
    ("notion-token", ["ntn_"], _tok(r"ntn_[A-Za-z0-9]{46}", _B62 + "_"), (0,), 0, _body_check(4)),
    ("replicate-api-token", ["r8_"], _tok(r"r8_[A-Za-z0-9]{37}", _B62 + "_"), (0,), 0, _body_check(3)),
    ("supabase-token", ["sbp_"], _tok(r"sbp_[a-f0-9]{40}", _B62 + "_"), (0,), 0, _body_check(4, mixed=False)),
    ("newrelic-api-key", ["NRAK-"], _tok(r"NRAK-[A-Z0-9]{27}", _B62 + r"\-"), (0,), 0,
     _body_check(5, mixed=False)),
]
assert {row[0] for row in _TABLE} == set(KINDS), "KINDS and the rule table disagree"

# Lead characters, best first: rare in text, JSON and base64 alike, and shared by many
# anchors (every extra lead character is one more pass over the data).
_LEADS = b"~_.-:AJBp"
# Rough frequency rank of bytes in mixed text/JSON (rarest first) for other anchors.
_RARITY = (bytes(range(0x80, 0x100)) + bytes(range(0, 0x20)).replace(b"\t", b"").replace(b"\n", b"")
           + b"~^`|!$;?@#&*%+[]{}()<>QJZXKVWYUFGHBPMRDTOCLNSIEAqjzxkvwyb_-gpfmucldhrsnioate=.,:/'\"\\\t\n"
           + b"9876543210 ")


def _lead_of(text: bytes, leads: bytes) -> int:
    """Index in ``text`` of the character to lead with."""
    best: tuple[int, int] | None = None
    for i, c in enumerate(text):
        rank = (leads.find(bytes([c])) if c in leads else len(leads) + _RARITY.find(bytes([c])))
        if best is None or rank < best[0]:
            best = (rank, i)
    assert best is not None  # an anchor's text is never empty
    return best[1]


def _literal_anchor(text: str | bytes, boundary: str, leads: bytes = _LEADS) -> _Anchor:
    raw = text.encode() if isinstance(text, str) else text
    i = _lead_of(raw, leads)
    return _Anchor(raw[i:i + 1], re.escape(raw[:i]), i, re.escape(raw[i + 1:]), boundary.encode(),
                   raw[i - 1:i] or None, raw[i + 1:i + 2] or None)


def _both_cases(c: bytes) -> bytes:
    return bytes(sorted(set(c.lower() + c.upper())))


def _caseless_anchors(raw: bytes, leads: bytes) -> list[_Anchor]:
    """Anchors that find ``raw`` in any mix of ASCII case. The lead character is one that
    has no case if there is one; a letter leads as two anchors (one per case), since a pass
    starts with one literal character."""
    def rank(c: bytes) -> int:  # as _lead_of, and a new pass costs a little more
        return leads.find(c) if c in leads else len(leads) + 8 + _RARITY.find(c)

    def cost(i: int) -> int:
        c = raw[i:i + 1]
        return max(rank(c.lower()), rank(c.upper()))

    i = min(range(len(raw)), key=cost)
    before, after = raw[:i], raw[i + 1:]
    before_re = b"(?i:" + re.escape(before) + b")" if before else b""
    after_re = b"(?i:" + re.escape(after) + b")" if after else b""
    prev = _both_cases(raw[i - 1:i]) if i else None
    nxt = _both_cases(raw[i + 1:i + 2]) if after else None
    return [_Anchor(bytes([lead]), before_re, i, after_re, b"", prev, nxt) for lead in _both_cases(raw[i:i + 1])]


# A rule's anchors need the character before them to be a boundary when the rule's
# pattern does (a cheap early reject in the prefilter for prefixes like sk- and hf_).
_NO_BOUNDARY = {"aws-secret-access-key", "slack-webhook", "azure-storage-key", "url-password", "private-key",
                "sentry-token"}


# What a pass does where an anchor matches: apply a rule, decode "Basic " credentials, or
# report a stored secret (its label and length).
Action = _Rule | str | tuple[str, str, int]


def _static_rules() -> tuple[list[_Anchor], list[list[Action]]]:
    anchors: list[_Anchor] = []
    actions: list[list[Action]] = []
    index: dict[_Anchor, int] = {}
    for kind, anchor_specs, pattern, offsets, group, check, *rest in _TABLE:
        rule = _Rule(kind, pattern, offsets, group, check, rest[0] if rest else None)
        boundary = "" if kind in _NO_BOUNDARY else _B62
        for spec in anchor_specs:
            if isinstance(spec, str):
                anchor = _literal_anchor(spec, boundary)
            else:
                lead, before, before_len, after, start_boundary, *gates = spec
                gates = [g.encode() if g else None for g in gates] + [None, None]
                anchor = _Anchor(lead.encode(), before.encode(), before_len, after.encode(), start_boundary.encode(),
                                 gates[0], gates[1])
            if anchor not in index:
                index[anchor] = len(anchors)
                anchors.append(anchor)
                actions.append([])
            actions[index[anchor]].append(rule)
    # "Basic <base64>": decode short credentials the run finder would skip.
    for word in ("Basic ", "BASIC "):
        anchors.append(_literal_anchor(word, ""))
        actions.append(["basic"])
    return anchors, actions


_STATIC_ANCHORS, _STATIC_ACTIONS = _static_rules()


class _Pass(NamedTuple):
    regex: re.Pattern[bytes]
    anchors: tuple[int, ...]  # by capture group number - 1
    before: tuple[int, ...]
    lead: bytes  # every match starts with it


def _class(chars: Iterable[bytes]) -> bytes:
    return b"[" + b"".join(re.escape(bytes([c])) for c in sorted(set(b"".join(chars)))) + b"]"


def _compile_passes(anchors: list[_Anchor]) -> list[_Pass]:
    """One regex per lead character. After the lead character, cheap one-character gates
    come first -- the character before it (anchors that have text before the lead), the
    character after it and the start boundary (anchors that begin with it) -- so that the
    many lead characters that begin no anchor are rejected in a step or two."""
    groups: dict[bytes, list[int]] = defaultdict(list)
    for i, a in enumerate(anchors):
        groups[a.lead].append(i)
    return [_compile_pass(anchors, lead, members) for lead, members in groups.items()]


def _compile_pass(anchors: list[_Anchor], lead: bytes, members: list[int]) -> _Pass:
    """The pass of one lead character: ``members`` are the indexes of its anchors."""
    lead_re = re.escape(lead)
    # Longest anchors first: at one position the first alternative that fits wins
    # ("sk-ant-" before "sk-").
    members.sort(key=lambda i: -(anchors[i].before_len + len(anchors[i].after)))
    order: list[int] = []

    def leaf(i: int) -> bytes:
        a = anchors[i]
        alt = b""
        if a.before:
            alt += b"(?<=" + a.before + lead_re + b")"
        if a.start_boundary:
            alt += b"(?<![" + a.start_boundary + b"]" + b"." * a.before_len + lead_re + b")"
        if a.after:
            alt += b"(?=" + a.after + b")"
        order.append(i)
        return b"(" + alt + b")"

    by_prev: dict[bytes, list[int]] = defaultdict(list)
    by_next: dict[tuple[bytes, bytes], list[int]] = defaultdict(list)
    ungated = []
    for i in members:
        a = anchors[i]
        if a.prev is not None:
            by_prev[a.prev].append(i)
        elif a.next is not None:
            by_next[(a.start_boundary if a.before_len == 0 else b"", a.next)].append(i)
        else:
            ungated.append(i)
    parts = []
    if by_prev:
        sub = [b"(?<=" + _class([c]) + lead_re + b")(?:" + b"|".join(leaf(i) for i in ids) + b")"
               for c, ids in by_prev.items()]
        parts.append(b"(?<=" + _class(by_prev) + lead_re + b")(?:" + b"|".join(sub) + b")")
    for boundary in dict.fromkeys(b for b, _ in by_next):
        nexts = {c: ids for (b, c), ids in by_next.items() if b == boundary}
        sub = [b"(?=" + _class([c]) + b")(?:" + b"|".join(leaf(i) for i in ids) + b")"
               for c, ids in nexts.items()]
        gate = (b"(?<![" + boundary + b"]" + lead_re + b")") if boundary else b""
        parts.append(gate + b"(?=" + _class(nexts) + b")(?:" + b"|".join(sub) + b")")
    parts += [leaf(i) for i in ungated]
    regex = re.compile(lead_re + b"(?:" + b"|".join(parts) + b")", re.DOTALL)
    return _Pass(regex, tuple(order), tuple(anchors[i].before_len for i in order), lead)


_STATIC_PASSES = _compile_passes(_STATIC_ANCHORS)


# ------------------------------------------------------------ the compiled pass
#
# Every anchor is also a Hyperscan expression (egress.scan.multimatch): its before, lead and
# after as one pattern, look-arounds dropped (the gates and boundaries stay in the pass
# regexes). All of them, with the base64/hex run triggers (decode.RUN_TRIGGERS), are one
# database, so a buffer is one pass of compiled code; a match is only a candidate: the
# pass regex of its lead character is matched there, which is what that pass's finditer
# did at every lead character. A superset of candidates therefore gives the same findings.


def _width(pattern: bytes) -> tuple[int, int]:
    from re import _parser  # type: ignore[attr-defined]  # the regex parser (private): no stubs
    width: tuple[int, int] = _parser.parse(pattern).getwidth()  # the (min, max) match length
    return width


def _hs_anchor(a: _Anchor) -> tuple[bytes, int, int]:
    """(expression, flags, back) for an anchor: its lead character is at ``end - back`` of a
    match, or, for ``back <= 0`` (an after part of varying width, matched with its start),
    at ``start - back``."""
    after = a.after.replace(b"(?=", b"(?:")  # url-password ends in a look-ahead: match it
    lo, hi = _width(after) if after else (0, 0)
    expr = a.before + re.escape(a.lead) + after
    if lo == hi:
        return expr, 0, hi + 1
    return expr, multimatch.SOM, -a.before_len


def _hs_literal(text: bytes) -> bytes:
    return b"".join(b"\\x%02x" % c for c in text)


# Hyperscan's single-match flag (multimatch names SOM and CASELESS, not this one)
_SINGLE = multimatch.SINGLE


@functools.cache
def _static_database(runs: bool) -> tuple[multimatch.Database, list[int], list[tuple[str, int]]]:
    """The formats' database, with each anchor's back (see _hs_anchor); with ``runs``, also
    the run triggers, with theirs (decode.RUN_TRIGGERS). A scan that decodes no further
    layer (decoded binary, a second layer) uses the one without: the triggers cost most of
    a pass. Compiled on first use, not on import (it takes a while: bench/README.md,
    Scanner): the policy loader imports this module for KINDS."""
    exprs: list[bytes] = []
    flags: list[int] = []
    backs: list[int] = []
    for a in _STATIC_ANCHORS:
        expr, flag, back = _hs_anchor(a)
        exprs.append(expr)
        flags.append(flag)
        backs.append(back)
    run_backs: list[tuple[str, int]] = []
    for expr, kind, back in RUN_TRIGGERS if runs else ():
        exprs.append(expr)
        flags.append(_SINGLE if kind == "qp" else 0)  # the first: decode finds the rest
        run_backs.append((kind, back))
    return multimatch.Database(exprs, flags), backs, run_backs


# ---------------------------------------------------------------------- detector


def _merge(findings: list[Finding], priority: Callable[[str], int]) -> list[Finding]:
    """Sorted and non-overlapping: overlapping findings become one spanning them all,
    under the kind of the longest (on equal spans: stored secret, then specific, then generic)."""
    findings.sort(key=lambda f: (f.start, -f.end, priority(f.kind)))
    out: list[Finding] = []
    for f in findings:
        if out and f.start < out[-1].end:
            last = out[-1]
            if f.end > last.end:
                kind = f.kind if f.end - f.start > last.end - last.start else last.kind
                out[-1] = Finding(kind, last.start, f.end)
            continue
        out.append(f)
    return out


class Detector:
    """Finds credentials in buffers. Immutable once built; safe to share between threads."""

    def __init__(self, secrets: Iterable[tuple[str, str | bytes]] = (), formats: bool = True):
        """``secrets``: (label, value) pairs of the install's own secrets, found by exact
        value (raw, and through the encoded layers) and reported under ``label``.
        ``formats=False``: find only those, none of the well-known token formats.
        Raises ValueError for a value shorter than MIN_SECRET_LENGTH."""
        if formats:
            anchors, actions = list(_STATIC_ANCHORS), list(_STATIC_ACTIONS)
        else:  # "Basic " only: it is how short credentials get decoded
            anchors = [a for a, act in zip(_STATIC_ANCHORS, _STATIC_ACTIONS, strict=True) if act == ["basic"]]
            actions = [["basic"] for _ in anchors]
        leads = _LEADS
        self._labels: set[str] = set()
        secret_exprs: dict[tuple[bytes, int], int] = {}  # (expression, flags) -> back
        longest = 0
        for label, value in secrets:
            raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
            if len(raw) < MIN_SECRET_LENGTH:
                raise ValueError(f"stored secret {label!r}: {len(raw)} bytes; at least {MIN_SECRET_LENGTH} needed")
            self._labels.add(label)
            # The raw value is an anchor; its encodings are found by decoding the layers.
            # Only base64 of a short value alone (under 15 bytes: shorter than the runs the
            # base64 layer decodes) is looked for as a literal -- whole quanta only, since
            # what follows the value changes the last characters.
            forms = {raw}
            if len(raw) * 4 // 3 < B64_MIN_RUN:
                whole = len(raw) // 3 * 4
                forms |= {base64.b64encode(raw)[:whole], base64.urlsafe_b64encode(raw)[:whole]}
            if b" " in raw:  # form-encoding writes a space as "+", which the percent layer keeps
                forms.add(raw.replace(b" ", b"+"))
            for form in forms:
                # The value and its "+" form in any case (a secret upper-cased on its way out
                # is the same secret; host names are lower-cased); base64 forms as they are.
                caseless = form == raw or form == raw.replace(b" ", b"+")
                for anchor in _caseless_anchors(form, leads) if caseless else [_literal_anchor(form, "", leads)]:
                    if anchor.lead not in leads:  # a new pass: let later secrets share it
                        leads += anchor.lead
                    anchors.append(anchor)
                    actions.append([("secret", label, len(form))])
                    secret_exprs[(_hs_literal(form), multimatch.CASELESS if caseless else 0)] = \
                        len(form) - anchor.before_len
                longest = max(longest, len(form))
        self._actions = actions
        self._passes = _STATIC_PASSES if anchors == _STATIC_ANCHORS else _compile_passes(anchors)
        _static_database(True), _static_database(False)  # a pattern Hyperscan refuses fails here, not in a scan
        self._pass_of: list[int | None] = [None] * 256  # lead byte -> index of its pass
        for i, p in enumerate(self._passes):
            self._pass_of[p.lead[0]] = i
        # The stored secrets' own database (the static one holds the formats): compiled
        # here in a few ms, where adding them to the static one would recompile all of it.
        self._secret_db = multimatch.Database([e for e, _ in secret_exprs], [f for _, f in secret_exprs])
        self._secret_backs = list(secret_exprs.values())
        # A token split between two chunks is found when both halves are in the carried
        # window: the longest rule (PEM blocks, JWTs: up to ~16 KiB encoded) or secret form.
        self._overlap = max(16384, 3 * longest + 1024)

    @property
    def overlap(self) -> int:
        """Bytes a chunked scanner must carry from one chunk to the next."""
        return self._overlap

    def _priority(self, kind: str) -> int:
        return 0 if kind in self._labels else 2 if kind in _GENERIC else 1

    # ------------------------------------------------------------------ scanning

    def scan(self, data: bytes) -> list[Finding]:
        """Findings in ``data``, sorted and non-overlapping (overlaps merge into the outermost span)."""
        return _merge(self._scan(bytes(data), 0), self._priority)

    def scan_text(self, text: str) -> list[Finding]:
        """:meth:`scan` for a str (a header, a URL, a host name); spans index ``text``."""
        try:
            return self.scan(text.encode("latin-1"))
        except UnicodeEncodeError:
            pass
        data = text.encode("utf-8", "surrogatepass")
        chars = []  # byte offset -> index of the character it belongs to
        for i, ch in enumerate(text):
            chars += [i] * len(ch.encode("utf-8", "surrogatepass"))
        chars.append(len(text))
        return [Finding(f.kind, chars[f.start], chars[f.end - 1] + 1) for f in self.scan(data)]

    def redact(self, data: bytes) -> bytes:
        """``data`` with each finding replaced by ``[redacted:<kind>]``."""
        return _redact(data, self.scan(data), 0)

    def stream(self, batch: int = 0) -> StreamScanner:
        """A scanner for data that arrives in chunks (``batch``: see StreamScanner)."""
        return StreamScanner(self, batch)

    def _find(self, data: bytes, runs: bool = True) -> tuple[list[int], Triggers | None]:
        """Candidates: positions where an anchor's lead character may be (every one where
        a pass regex matches, and some more), and with ``runs`` where the layers have work
        (decode.RUN_TRIGGERS: the runs that may need decoding, hex, quoted-printable
        evidence); unsorted, perhaps repeated."""
        leads: list[int] = []
        # (tuple.__new__: Triggers' own __new__ is a Python call, felt in a header's short scan)
        # (None without runs: then no run trigger is in the database, and none reports)
        found: Triggers = tuple.__new__(Triggers, ([], [], [])) if runs else None  # type: ignore[assignment]
        db, backs, run_backs = _static_database(runs)
        n = len(backs)
        for i, start, end in db.scan(data, []):
            if i < n:
                back = backs[i]
                leads.append(end - back if back > 0 else start - back)
                continue
            kind, back = run_backs[i - n]
            if kind == "run":
                found.runs.append(end - back if back else run_start(data, end))
            elif kind == "hex":
                found.hexes.append(end - back)
            else:
                found.qp.append(end - back)
        if runs and data and RUN_TABLE[data[0]] == 0x61:
            # the triggers that want a character before the run miss this one
            found.runs.append(0)  # (and run_segments looks for the hex in it)
        if self._secret_db.size:
            backs = self._secret_backs
            for i, _start, end in self._secret_db.scan(data, []):
                leads.append(end - backs[i])
        return leads, found

    def _scan(self, data: bytes, depth: int) -> list[Finding]:
        found: list[Finding] = []
        segments: list[Segment] = []
        actions = self._actions
        leads, runs = self._find(data, depth < _MAX_DEPTH)
        by_pass: dict[int, list[int]] = {}
        pass_of = self._pass_of
        for pos in leads:
            k = pass_of[data[pos]]
            if k is not None:
                by_pass.setdefault(k, []).append(pos)
        for k in sorted(by_pass):
            regex, members, before, lead = self._passes[k]
            match = regex.match
            for pos in sorted(set(by_pass[k])):
                m = match(data, pos)
                if m is None:
                    continue
                g = m.lastindex - 1  # type: ignore[operator]  # a pass matches through one of its groups
                start = pos - before[g]
                for action in actions[members[g]]:
                    if type(action) is _Rule:
                        self._apply(action, data, start, found)
                    elif action == "basic":
                        if depth < _MAX_DEPTH:
                            seg = basic_segment(data, start + 6)
                            if seg is not None:
                                segments.append(seg)
                    else:  # a stored secret, found (mypy cannot narrow by type() is and ==)
                        _, label, n = cast("tuple[str, str, int]", action)
                        found.append(Finding(label, start, start + n))
        if depth < _MAX_DEPTH:
            segments += layer_segments(data, runs)
            if segments:
                found += self._scan_segments(segments, depth + 1)
        return found

    def _apply(self, rule: _Rule, data: bytes, start: int, found: list[Finding]) -> None:
        for offset in rule.offsets:
            pos = start - offset
            if pos < 0:
                continue
            if rule.match is not None:
                hit = rule.match(data, pos)
                if hit is not None:
                    found.append(Finding(rule.kind, *hit))
                return
            m = rule.regex.match(data, pos)  # type: ignore[union-attr]  # a rule has a match or a regex
            if m is None:
                continue
            if rule.check is None or rule.check(m):
                s, e = m.span(rule.group)
                found.append(Finding(rule.kind, s, e))
                if rule.kind == "aws-access-key-id":
                    _aws_pair(data, s, e, found)
            return

    def _scan_segments(self, segments: list[Segment], depth: int) -> list[Finding]:
        """Scan the decoded segments together (one pass, not one per segment) and map
        what is found back to the encoded spans. Segments that decoded to binary (images,
        compressed data) are scanned for tokens but not decoded any further. (List
        comprehensions, not a loop with a call per segment: a clean 16 MiB has ~16k.)"""
        texts = [seg[0] for seg in segments]
        text = [t.isascii() for t in texts]
        for i in [i for i, ascii in enumerate(text) if not ascii]:
            text[i] = _is_text(texts[i])
        groups = [(segments, texts, depth)] if all(text) else [
            (list(compress(segments, text)), list(compress(texts, text)), depth),
            (list(compress(segments, [not t for t in text])), list(compress(texts, [not t for t in text])), _MAX_DEPTH)]
        out: list[Finding] = []
        for group, group_texts, group_depth in groups:
            if not group:
                continue
            found = self._scan(_SEP.join(group_texts), group_depth)
            if not found:
                continue
            starts = list(accumulate([len(t) + len(_SEP) for t in group_texts], initial=0))
            for f in found:
                i = bisect_right(starts, f.start) - 1
                seg = group[i]
                s = f.start - starts[i]
                e = min(f.end - starts[i], len(seg[0]))
                if e > s:
                    out.append(Finding(f.kind, *span(seg, s, e)))
        return out


# Bytes no UTF-8 text starts with (continuation bytes, overlong and out-of-range leads):
# a decoded image or archive mostly starts with one (PNG 0x89, JPEG 0xFF), and this says
# so without a UnicodeDecodeError raised and caught.
_NOT_UTF8_FIRST = bytes(range(0x80, 0xC2)) + bytes(range(0xF5, 0x100))


def _is_text(data: bytes) -> bool:
    if data.isascii():
        return True
    if data[0] in _NOT_UTF8_FIRST:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _aws_pair(data: bytes, s: int, e: int, found: list[Finding]) -> None:
    """A secret access key right beside its key id (CSV exports, credential files, code)."""
    lo = max(0, s - _AWS_NEAR_REACH - 41)
    window = data[lo:e + _AWS_NEAR_REACH + 41]
    for m in _AWS_NEAR.finditer(window):
        a, b = m.span()
        if (lo + b <= s or lo + a >= e) and (b < len(window) or lo + b == len(data)) and (a > 0 or lo == 0):
            if _mixed_b64(m.group(0)):
                found.append(Finding("aws-secret-access-key", lo + a, lo + b))


def _redact(data: bytes, findings: list[Finding], offset: int) -> bytes:
    out = []
    last = offset
    for f in findings:
        out.append(data[last - offset:f.start - offset])
        out.append(b"[redacted:" + f.kind.encode("utf-8", "replace") + b"]")
        last = f.end
    out.append(data[last - offset:])
    return b"".join(out)


# ----------------------------------------------------------------------- streams

# What a token (or its percent/JSON/base64 form, a URL with a password, a Telegram token)
# is made of: a trailing run of these may be the start of one, so StreamRedactor holds it
# back; anything else -- a space, a quote, a comma -- ends the run, so a prompt like
# "Password: " goes out at once.
_TOKEN_MARKS = bytes(ord(".") if c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=_.~%\\-:@"
                     else ord("|") for c in range(256))


def _safe_cut(buf: bytes, cut: int, origin: int | None, base: int) -> int:
    """``cut`` moved back (never forward) so that the text from it on decodes as it does in
    the whole stream: not inside a ``%XX`` or ``\\uXXXX`` escape, inside a base64/hex
    run at a multiple of 4 characters from the run's start (``origin``: the absolute start
    of the run holding ``buf[0]``, if any), and inside base64 written through escapes at
    a multiple of 4 decoded characters (:func:`_escaped_cut`).

    A wrapped base64 text needs nothing more: the next window joins its lines again and
    decodes them from every phase a line starts at (decode._b64_wrapped), and with four
    lines or more after the cut (the 16 KiB overlap holds hundreds) the whole text's phase
    is one of them, wherever the cut fell."""
    return _escaped_cut(buf, _raw_cut(buf, cut, origin, base))


# Escapes that decode to a base64 character: "\/" (PHP-style JSON), "\u00XX", "%XX". The
# base64 layer decodes the run *after* the JSON or percent layer, where each counts as one
# character; a cut aligned on the raw run (which they break) left every later window
# decoding such a text out of phase, so a streamed JSON upload of \/-escaped base64 hid
# every token after its first 256 KiB batch (3 of 4 phases; found by a red-team pass).
_RUN_HEX = rb"(?:2[BbDdFf]|3[0-9]|4[1-9A-Fa-f]|5[0-9Aa]|5[Ff]|6[1-9A-Fa-f]|7[0-9Aa])"
_SOFT_ESCAPE = re.compile(rb"\\/|\\u00" + _RUN_HEX + rb"|%" + _RUN_HEX)
_HARD_ESCAPE = re.compile(rb"\\(?!/|u00" + _RUN_HEX + rb")|%(?!" + _RUN_HEX + rb")")
_ESCAPED_RUN_TABLE = bytes(ord("a") if RUN_TABLE[c] == 0x61 or c in b"\\%" else ord(" ") for c in range(256))


def _escaped_cut(buf: bytes, cut: int) -> int:
    """``cut`` (already safe for the raw text) moved back, by up to 3 decoded characters, to
    a multiple of 4 decoded characters from the start of the escaped base64 run holding it:
    the next window's JSON/percent segment, or its raw run, then starts there and decodes in
    phase. A run that reaches back to ``buf[0]`` is counted from there: every earlier cut
    inside it was made here, at a multiple of 4. (Not from the raw run's origin: a single
    early escape, which an attacker can place, puts the raw origin out of phase for good.)"""
    if cut <= 0 or cut >= len(buf):
        return cut
    if RUN_TABLE[buf[cut]] != 0x61 and not _SOFT_ESCAPE.match(buf, cut):
        return cut  # a break: no run goes on from here
    start = _last_break(buf, cut, _ESCAPED_RUN_TABLE) + 1  # after the last byte of neither a run nor an escape
    if start > 0 and buf.find(b"\\", start, cut) < 0 and buf.find(b"%", start, cut) < 0:
        return cut  # a run of raw characters that began here: _raw_cut aligned it
    for m in _HARD_ESCAPE.finditer(buf, start, cut):  # "\n", "%20", "\"": breaks too
        k = m.start()
        if buf[k] == 0x5C:  # a backslash
            start = k + (6 if buf[k + 1:k + 2] == b"u" else 2)
        else:
            start = k + (3 if _HEX_PAIR.match(buf, k + 1) else 1)
    if start >= cut:
        return cut
    # decoded characters in buf[start:cut]: only soft escapes are left in it
    decoded = (cut - start) - buf.count(b"\\/", start, cut) - 5 * buf.count(b"\\u", start, cut) \
        - 2 * buf.count(b"%", start, cut)
    for _ in range(decoded % 4):  # back one decoded character: an escape ending here, or a byte
        if cut - 2 >= start and buf[cut - 2] == 0x5C:
            cut -= 2
        elif cut - 6 >= start and buf[cut - 6] == 0x5C and buf[cut - 5] == 0x75:  # "\u00XX"
            cut -= 6
        elif cut - 3 >= start and buf[cut - 3] == 0x25:
            cut -= 3
        else:
            cut -= 1
    return cut


_HEX_PAIR = re.compile(rb"[0-9A-Fa-f]{2}")


def _raw_cut(buf: bytes, cut: int, origin: int | None, base: int) -> int:
    """_safe_cut for the raw text: escapes and raw base64/hex runs."""
    if cut <= 0:
        return 0
    for _ in range(2):
        k = buf.rfind(b"%", max(0, cut - 2), cut)
        if k >= 0:
            cut = k
        k = buf.rfind(b"\\", max(0, cut - 11), cut)
        if k >= 0:
            cut = k
        if cut == 0 or RUN_TABLE[buf[cut]] != 0x61 or RUN_TABLE[buf[cut - 1]] != 0x61:
            return cut  # not inside a run
        r = _last_break(buf, cut)
        start = base + r + 1 if r >= 0 else (origin if origin is not None else base)
        cut -= (base + cut - start) % 4
    return cut


def _last_break(buf: bytes, end: int, table: bytes = RUN_TABLE) -> int:
    """The last position before ``end`` of a byte that is not a run character (``table`` maps
    those to "a"), or -1.

    Looked for 4 KiB at a time from ``end`` back: translating all of ``buf[:end]`` (a 256
    KiB body batch) for one answer cost a share of an upload's scanning (bench/README.md, Scanner)."""
    hi = end
    while hi > 0:
        lo = max(0, hi - 4096)
        r = buf[lo:hi].translate(table).rfind(b" ")
        if r >= 0:
            return lo + r
        hi = lo
    return -1


def _run_origin(buf: bytes, cut: int, origin: int | None, base: int) -> int | None:
    """The absolute start of the base64/hex run holding ``buf[cut]`` (None: not in a run)."""
    if cut >= len(buf) or RUN_TABLE[buf[cut]] != 0x61:
        return None
    r = _last_break(buf, cut + 1)
    if r >= 0:
        return base + r + 1
    return origin if origin is not None else base


class StreamScanner:
    """Scans a stream chunk by chunk; offsets are in the whole stream.

    Linear in the bytes: chunks are gathered until at least ``batch`` new bytes wait
    (:attr:`Detector.overlap` at least; or the stream ends), then scanned together with the
    :attr:`Detector.overlap` bytes carried from the last scan, so a token split between
    chunks is still found and no byte is scanned more than about twice, whatever the chunk
    sizes (re-scanning the carried window for every chunk made 34 KB of one-byte chunks
    cost two minutes). A larger ``batch`` scans each byte fewer times (1 + overlap/batch)
    and holds more bytes unsettled.

    :attr:`settled` says how far the stream is done with: every finding that starts before
    it has been reported, so a proxy may relay those bytes and must hold back the rest.
    A finding is reported with all the context a one-shot scan would give it: one that
    reaches the end of the scanned data (it may still grow: a longer token, a key block
    whose END line has not come) waits for the next scan, and stays unsettled until then.
    Reported once: a later, longer span that overlaps one reported is not reported again.
    A token whose encoded form is longer than the overlap can be missed when it straddles
    a scan boundary.
    """

    _CONTEXT = 512  # bytes kept before a finding that waits: rules look back (url userinfo, AWS names)

    def __init__(self, detector: Detector, batch: int = 0):
        self._detector = detector
        self._overlap = detector.overlap
        self._batch = max(batch, self._overlap)
        self._kept = b""  # scanned already; carried as context
        self._new: list[bytes] = []  # not scanned yet
        self._new_len = 0
        self._base = 0  # stream offset of _kept[0]
        self._origin: int | None = None  # stream offset of the run holding _kept[0]
        self._reported: list[tuple[int, int]] = []  # spans already reported (stream offsets)

    @property
    def settled(self) -> int:
        """Stream offset before which every byte has been scanned and every finding reported."""
        return self._base

    @property
    def held(self) -> int:
        """Bytes fed and not settled yet."""
        return len(self._kept) + self._new_len

    def would_scan(self, n: int) -> bool:
        """Whether feeding ``n`` more bytes makes a scan happen (else a feed only keeps them)."""
        return self._new_len + n >= self._batch

    def feed(self, chunk: bytes) -> list[Finding]:
        """Findings that this chunk lets the scanner be sure of (often none until enough
        bytes have come to scan)."""
        if chunk:
            self._new.append(bytes(chunk))
            self._new_len += len(chunk)
        if self._new_len < self._batch:
            return []
        return self._process(final=False)

    def finish(self) -> list[Finding]:
        """Every finding not reported yet; the stream is settled to its end."""
        found = self._process(final=True)
        self._base += len(self._kept)
        self._kept, self._reported, self._origin = b"", [], None
        return found

    def _process(self, final: bool) -> list[Finding]:
        # one join, not a join and a concatenation: the batch is copied once (256 KiB a scan)
        buf = b"".join([self._kept, *self._new]) if self._new else self._kept
        self._new, self._new_len = [], 0
        base, n = self._base, len(buf)
        cut = n if final else _safe_cut(buf, n - self._overlap, self._origin, base)
        new = []
        for f in self._detector.scan(buf):
            if f.start == 0 and base > 0:
                continue  # the tail of something that began before the carried window
            if not final and f.end >= n - 3 and f.start >= max(cut, self._CONTEXT):
                # it may grow with more data (-3: a base64 quantum): scan it again then,
                # with context before it
                cut = min(cut, _safe_cut(buf, f.start - self._CONTEXT, self._origin, base))
                continue
            span = (f.start + base, f.end + base)
            if any(s < span[1] and span[0] < e for s, e in self._reported):
                continue
            self._reported.append(span)
            new.append(Finding(f.kind, *span))
        if final:
            self._kept = buf
        elif cut > 0:
            self._origin = _run_origin(buf, cut, self._origin, base)
            self._kept = buf[cut:]
            self._base = base + cut
            self._reported = [(s, e) for s, e in self._reported if e > self._base]
        else:
            self._kept = buf
        return new


# ------------------------------------------------------------------- env names

_SECRET_SUFFIXES = ("_TOKEN", "_SECRET", "_KEY", "_APIKEY", "_PASSWORD", "_PASSWD", "_PWD", "_PASSPHRASE",
                    "_CREDENTIALS", "_CREDENTIAL", "_AUTH", "_PAT")
_SECRET_NAMES = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY", "API_KEY", "CREDENTIALS",
                 "AUTH_TOKEN", "ACCESS_TOKEN", "SECRET_KEY", "PRIVATE_KEY"}
#: Names that end like a secret's but hold public or non-secret values.
_NOT_SECRET_SUFFIXES = ("_PUBLIC_KEY", "_PUB_KEY", "_PUBLISHABLE_KEY", "_SITE_KEY", "_CACHE_KEY", "_SORT_KEY",
                        "_PARTITION_KEY", "_PRIMARY_KEY", "_FOREIGN_KEY", "_IDEMPOTENCY_KEY", "_GPG_KEY",
                        "_SIGNING_KEY_ID", "_NO_AUTH", "_SKIP_AUTH")
_NOT_SECRET_NAMES = {"GPG_KEY", "PUBLIC_KEY", "SSH_AUTH", "GPG_TTY", "SSH_AUTH_SOCK", "XAUTHORITY", "KEYBOARD"}
_NUMBERED = re.compile(r"_[0-9]+$")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable named ``name`` holds a secret by its name.

    Secret: names ending in _TOKEN, _SECRET, _KEY, _APIKEY, _PASSWORD, _PASSWD, _PWD,
    _PASSPHRASE, _CREDENTIAL(S), _AUTH or _PAT, or one of these words alone (TOKEN,
    PASSWORD, API_KEY, ...); case-insensitive, and a numbered variant (GITHUB_TOKEN_2)
    counts. Not secret: public halves and lookup keys (*_PUBLIC_KEY, *_PUB_KEY,
    *_PUBLISHABLE_KEY, *_SITE_KEY, *_CACHE_KEY, *_SORT_KEY, *_PARTITION_KEY,
    *_PRIMARY_KEY, *_FOREIGN_KEY, *_IDEMPOTENCY_KEY), GPG key ids (GPG_KEY: Docker's
    python images set it to a public fingerprint), switches (*_NO_AUTH, *_SKIP_AUTH) and
    GPG_TTY, SSH_AUTH_SOCK, XAUTHORITY. Identifiers are not secrets: AWS_ACCESS_KEY_ID,
    *_KEY_ID, *_KEY_FILE, *_TOKEN_URL, *_PATH and KEYBOARD*/KEYMAP do not end in a secret
    suffix (the AKIA rule still finds an AWS key id by its format).
    """
    upper = _NUMBERED.sub("", name.strip().upper().replace("-", "_"))
    if not upper or upper in _NOT_SECRET_NAMES or upper.endswith(_NOT_SECRET_SUFFIXES):
        return False
    return upper in _SECRET_NAMES or upper.endswith(_SECRET_SUFFIXES)


# ------------------------------------------------------------------ terminal noise

# What a terminal shows nothing for, in a command's output (red team N8: `ghp_Ky9P…3wWD\033[0m25RQ…`
# was printed because neither half is a token, and a terminal -- or a harness that strips escape
# codes before a model reads the output -- shows the token whole):
# - escape sequences: CSI (``ESC [ … final``: colours, cursor and mode changes), OSC, DCS, SOS,
#   PM and APC strings (``ESC ] … BEL`` or ``ST``: a title, a hyperlink, the clipboard; their own
#   text is scanned apart), every other ``ESC …`` sequence (character sets, ``ESC 7``), and their
#   8-bit (C1) forms written as UTF-8;
# - backspaces, each with the character before it (``X\b``: X is written over);
# - carriage returns, the other C0 controls a terminal draws nothing for (NUL, BEL, SO/SI, DEL,
#   …) and the C1 controls;
# - invisible characters: U+00AD soft hyphen, U+034F combining grapheme joiner, U+061C Arabic
#   letter mark, U+17B4/17B5 Khmer invisible vowels, U+180B-180F Mongolian selectors and vowel
#   separator, U+200B-200F zero-width space, non-joiner, joiner and direction marks, U+202A-202E
#   direction embeddings and overrides, U+2060-2064 word joiner and invisible operators,
#   U+2066-206F direction isolates and deprecated format characters, U+FE00-FE0F variation
#   selectors, U+FEFF zero-width no-break space, U+FFF9-FFFB annotation marks, U+E0000-E007F tags
#   and U+E0100-E01EF variation selectors.
# Not seen through: cursor movements that draw a token's parts out of order, a visible character
# inside it, a line break (tokens wrapped over lines), tabs.
_STRING_START = rb"(?:\x1b[\]PX^_]|\xc2[\x90\x98\x9d\x9e\x9f])"
_STRING_BODY = rb"(?:[^\x07\x1b\x18\x1a\xc2]|\xc2(?!\x9c))"  # to its end, never past it (not to a later one)
# The bytes noise starts with: a buffer without any is shown as it is (the common case, found by
# one bytes.translate); the lookahead lets the regex engine skip to them.
_NOISE_LEADS = b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x0d\x0e\x0f" + bytes(range(0x10, 0x20)) + b"\x7f\xc2\xcd\xd8\xe1\xe2\xef\xf3"
_NOT_NOISE_LEADS = bytes(c for c in range(256) if c not in _NOISE_LEADS)
_NOISE = re.compile(
    rb"(?=[" + re.escape(_NOISE_LEADS) + rb"])(?:"
    + _STRING_START + rb"(" + _STRING_BODY + rb"*)(?:\x07|\x1b\\|\xc2\x9c|(?=[\x18\x1a]))"  # a string: its text apart
    rb"|(?:\x1b\[|\xc2\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]"  # CSI
    rb"|\x1b[\x20-\x2f]*[\x30-\x7e]"  # any other escape sequence
    rb"|(\x08+)"  # backspaces: each takes back the character before it
    rb"|[\x00-\x07\x0d-\x1a\x1c-\x1f\x7f]+"  # controls drawn as nothing (CR included; not TAB, LF, VT, FF)
    rb"|\xc2[\x80-\x9f\xad]|\xcd\x8f|\xd8\x9c|\xe1\x9e[\xb4\xb5]|\xe1\xa0[\x8b-\x8f]"
    rb"|\xe2\x80[\x8b-\x8f\xaa-\xae]|\xe2\x81[\xa0-\xa4\xa6-\xaf]|\xef\xb8[\x80-\x8f]|\xef\xbb\xbf|\xef\xbf[\xb9-\xbb]"
    rb"|\xf3\xa0(?:[\x80\x81\x84-\x86][\x80-\xbf]|\x87[\x80-\xaf]))")
# The start of any of these, unfinished at the end of what has come so far.
_UNFINISHED = re.compile(rb"(?:" + _STRING_START + _STRING_BODY + rb"*(?:\x1b|\xc2)?|(?:\x1b\[|\xc2\x9b)[\x30-\x3f]*"
                         rb"[\x20-\x2f]*|\x1b[\x20-\x2f]*|\xc2|\xcd|\xd8|\xe1[\x9e\xa0]?|\xe2[\x80\x81]?"
                         rb"|\xef[\xb8\xbb\xbf]?|\xf3(?:\xa0[\x80\x81\x84-\x87]?)?)\Z")
_C1_STARTS = (b"\xc2\x90", b"\xc2\x98", b"\xc2\x9b", b"\xc2\x9d", b"\xc2\x9e", b"\xc2\x9f")  # DCS SOS CSI OSC PM APC
# The common cases, each a pattern led by one literal byte (the regex engine then skips to it):
_STRINGS = re.compile(_STRING_START)
_C1 = re.compile(rb"\xc2[\x80-\x9f\xad]")  # C1 controls and the soft hyphen, the noise \xc2 starts
_ESCAPES = re.compile(rb"\x1b(?:\[[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]|[\x20-\x2f]*[\x30-\x7e])")
_INVISIBLE = re.compile(rb"\xcd\x8f|\xd8\x9c|\xe1(?:\x9e[\xb4\xb5]|\xa0[\x8b-\x8f])|\xe2(?:\x80[\x8b-\x8f\xaa-\xae]"
                        rb"|\x81[\xa0-\xa4\xa6-\xaf])|\xef(?:\xb8[\x80-\x8f]|\xbb\xbf|\xbf[\xb9-\xbb])"
                        rb"|\xf3\xa0(?:[\x80\x81\x84-\x86][\x80-\xbf]|\x87[\x80-\xaf])")
_VIEW_SEP = b"\n\x00\n"  # between the visible text and each string's text: no rule and no NAME=value crosses it
_HOLD_WINDOW = 4096  # the hold's run is looked for in the last this many bytes first (doubled as needed)


def _noise_walk(buf: bytes, start: int, end: int) -> tuple[list[list[int]], list[tuple[int, int]], bytearray]:
    """The pieces of ``buf[start:end]`` a terminal shows ([start, end] each), the strings' texts
    (spans), and ``buf[start:]`` with every byte not shown as "a" (``buf[end:]``: unfinished)."""
    pieces: list[list[int]] = []
    strings: list[tuple[int, int]] = []
    mask = bytearray(buf[start:])
    position = start
    for match in _NOISE.finditer(buf, start, end):
        first, stop = match.span()
        if first > position:
            pieces.append([position, first])
        mask[first - start:stop - start] = b"a" * (stop - first)
        if match.group(2) is not None:  # backspaces: take back as many characters shown before them
            for _ in range(stop - first):
                if not pieces or buf[pieces[-1][1] - 1] == 0x0A:
                    break  # not past the line's start
                piece = pieces[-1]
                back = piece[1] - 1
                while back > piece[0] and 0x80 <= buf[back] < 0xC0:
                    back -= 1  # the whole UTF-8 character
                mask[back - start:piece[1] - start] = b"a" * (piece[1] - back)
                piece[1] = back
                if piece[1] == piece[0]:
                    pieces.pop()
        elif match.group(1):
            strings.append(match.span(1))
        position = stop
    if position < end:
        pieces.append([position, end])
    mask[end - start:] = b"a" * (len(buf) - end)
    return pieces, strings, mask


class _Shown:
    """What a terminal shows of a buffer that holds noise: the text the redactor scans, where a
    finding in it lies in the buffer (the token with the noise inside it), and the trailing run."""

    def __init__(self, buf: bytes, end: int, leads: bytes):
        self.buf = buf
        self.end = end  # where noise not finished yet begins (len(buf): none)
        self.mapped = b"\x08" in leads  # backspaces take characters back: only the walk knows which
        if self.mapped:
            self._map()
        # else the regex engine drops the noise (the walk is made only when a finding needs mapping),
        # with a pattern that starts with one literal where it can: it skips to them many times faster
        elif not leads.strip(b"\x1b") and not _STRINGS.search(buf, 0, end):  # colours, cursor moves
            self.text = _ESCAPES.sub(b"", buf[:end])
            self.visible = len(self.text)
        elif not leads.translate(None, b"\xcd\xd8\xe1\xe2\xef\xf3"):  # invisible characters in UTF-8 text
            self.text = _INVISIBLE.sub(b"", buf[:end])
            self.visible = len(self.text)
        else:
            strings = [m.group(1) for m in _NOISE.finditer(buf, 0, end) if m.group(1)] \
                if _STRINGS.search(buf, 0, end) else []
            shown = _NOISE.sub(b"", buf[:end])
            self.visible = len(shown)  # the strings' texts come after it
            self.text = b"".join([shown, *(_VIEW_SEP + s for s in strings)])

    @classmethod
    def of(cls, buf: bytes, final: bool) -> _Shown | None:
        """None when a terminal shows all of ``buf`` (no noise). Unless ``final``, noise not
        finished at the end counts as noise."""
        leads = buf.translate(None, _NOT_NOISE_LEADS)
        if not leads:
            return None
        if b"\xc2" in leads and not _C1.search(buf):  # µ, °, ±, ...: text, not a control
            leads = leads.replace(b"\xc2", b"")
        end = len(buf) if final else _unfinished(buf, leads)
        if not leads and end == len(buf):
            return None
        shown = cls(buf, end, leads)
        if end == len(buf) and not shown.mapped and shown.text == buf:
            return None  # UTF-8 text without an invisible character in it
        return shown

    def _map(self) -> None:
        pieces, strings, _ = _noise_walk(self.buf, 0, self.end)
        starts, raw, sizes, text = [], [], [], []
        at = 0
        for (start, stop), sep in [(p, b"") for p in pieces] + [(s, _VIEW_SEP) for s in strings]:
            at += len(sep)
            starts.append(at)
            raw.append(start)
            sizes.append(stop - start)
            text.append(sep + self.buf[start:stop])
            at += stop - start
        self.text = b"".join(text)
        self.visible = sum(stop - start for start, stop in pieces)
        self._starts, self._raw, self._sizes = starts or [0], raw or [0], sizes or [1]
        self.mapped = True

    def remap(self) -> bytes:
        """The text as the exact walk shows it, which :meth:`span` maps back (the regex engine's
        :attr:`text` is the same, the walk keeping each string's text where the engine found it)."""
        if not self.mapped:
            self._map()
        return self.text

    def span(self, start: int, end: int, final: bool) -> tuple[int, int]:
        """The bytes of buf from the one shown at ``start`` to the one shown at ``end - 1``; unless
        ``final``, to buf's end if the shown text ends there: a finding that reaches the end of
        what has come may still grow (a key block whose END line is still to come)."""
        if start < self.visible < end:
            end = self.visible  # a key block "to the end of the data" stops where the strings' texts begin
        if not final and end == self.visible:
            return self._at(start), len(self.buf)
        return self._at(start), self._at(end - 1) + 1

    def raw_at(self, position: int) -> int:
        """Where in buf the byte shown at ``position`` of :attr:`text` is."""
        self.remap()
        return self._at(position)

    def _at(self, position: int) -> int:
        i = max(0, bisect_right(self._starts, position) - 1)
        return self._raw[i] + min(max(position - self._starts[i], 0), self._sizes[i] - 1)

    def last_break(self, floor: int) -> int:
        """The last byte at or after ``floor`` that ends a run of token characters, noise being part
        of the run (a colour change inside a token); -1 if none. Walked from the end, in a window
        doubled until the break lies clear of where a sequence may have been cut."""
        n = len(self.buf)
        window = max(floor, n - _HOLD_WINDOW)
        while True:
            _, _, mask = _noise_walk(self.buf, window, self.end if self.end >= window else window)
            k = bytes(mask).translate(_TOKEN_MARKS).rfind(b"|")
            if window == floor or k >= 256:
                return window + k if k >= 0 else -1
            window = max(floor, n - 2 * (n - window))


def _unfinished(buf: bytes, leads: bytes) -> int:
    """Where noise not finished at the end of ``buf`` begins (len(buf): none); ``leads``: the
    bytes of buf that noise starts with."""
    n = len(buf)
    low = max(0, n - 65536)
    candidates = {n - 3, n - 2, n - 1}
    if b"\x1b" in leads:
        candidates.add(buf.rfind(b"\x1b", low, max(low, n - 1)))  # before a last ESC: a string's ST
    if b"\xc2" in leads:
        candidates.update(buf.rfind(start, low) for start in _C1_STARTS)
    for start in sorted(c for c in candidates if c >= low):
        if _UNFINISHED.match(buf, start):
            return start
    return n


# ---------------------------------------------------------------- stream redactor

# NAME=value at a line start or after whitespace, ;, &, |, ( -- `export NAME=...`,
# `env NAME=... cmd`, `ENV NAME=...` (Dockerfile), `- NAME=...` (compose) included.
_ASSIGNMENT = re.compile(rb"(?m)(?:^|(?<=[\s;&|(]))([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*"
                         rb"(?:\"([^\"\n]*)\"|'([^'\n]*)'|([^\s\"';&|]+))")
_OPEN_ASSIGNMENT = re.compile(rb"(?:^|(?<=[\s;&|(]))([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*[\"']")
_REFERENCE = re.compile(rb"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|\$\(|\*+$")


def _env_findings(buf: bytes) -> list[Finding]:
    if b"=" not in buf:
        return []
    out = []
    for m in _ASSIGNMENT.finditer(buf):
        if not is_secret_name(m.group(1).decode("latin-1")):
            continue
        g = 2 if m.group(2) is not None else 3 if m.group(3) is not None else 4
        value = m.group(g)
        if value and not _REFERENCE.match(value):
            out.append(Finding(ENV_SECRET_KIND, *m.span(g)))
    return out


class StreamRedactor:
    """Redacts a stream (``egress redact``, a command's output) as it flows: what
    :meth:`feed` returns can be written at once; it holds back only a trailing piece
    that might still become (part of) a secret -- the last run of token characters
    (letters, digits, ``+/=_.~%\\-:@``), an unfinished quoted ``NAME="…`` assignment, an
    unterminated private key block -- at most :attr:`Detector.overlap` bytes, plus the rest
    of a finding that crosses that limit.

    With ``env_assignments``, ``NAME=value`` / ``export NAME="value"`` where
    :func:`is_secret_name` (NAME) keeps the name and shows ``[redacted:env-secret]``.

    It reads the stream as a terminal shows it: escape sequences, backspaces, carriage returns
    and invisible characters (the "terminal noise" above) inside a token do not hide it, and the
    token is redacted whole, with the noise inside it (colours around it are kept); the text of
    an OSC or DCS string (a title, a hyperlink) is scanned on its own. A buffer without noise
    costs one bytes.translate more than before.

    The output equals a one-shot redaction of the whole stream, except where a secret is
    recognised only by context that comes after it on the stream (an AWS secret key whose
    key id follows it) or spans a line break outside a key block (base64 wrapped over
    lines), once its first part has been emitted.
    """

    _CONTEXT = 1024  # emitted bytes kept for look-behind context (AWS names, URL userinfo)

    def __init__(self, detector: Detector, env_assignments: bool = True):
        self._detector = detector
        self._env = env_assignments
        self._buf = b""
        self._done = 0  # _buf[:_done] was emitted already (kept as context)
        self._base = 0
        self._origin: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Redacted output that can be emitted now."""
        if not chunk:
            return b""
        self._buf += chunk
        return self._emit(final=False)

    def finish(self) -> bytes:
        """The rest, redacted."""
        out = self._emit(final=True)
        self._buf, self._done = b"", 0
        return out

    def cut(self) -> int:
        """The stream is cut here (egress run's output cap elides what follows): what is held
        back, which might be the start of a secret, is dropped, never emitted. Returns how many
        bytes were dropped; the redactor starts afresh."""
        held = len(self._buf) - self._done
        self._buf, self._done, self._base, self._origin = b"", 0, 0, None
        return held

    def _findings(self, buf: bytes, shown: _Shown | None, final: bool) -> list[Finding]:
        found = self._scan(buf if shown is None else shown.text)
        if shown is not None and found:  # each finding, with the noise inside it, in buf
            text = shown.text
            if shown.remap() != text:
                found = self._scan(shown.text)
            found = _merge([Finding(f.kind, *shown.span(f.start, f.end, final)) for f in found],
                           self._detector._priority)
        return found

    def _scan(self, text: bytes) -> list[Finding]:
        found = self._detector.scan(text)
        if self._env:
            env = _env_findings(text)
            if env:
                found = _merge(found + env, self._detector._priority)
        return found

    def _hold(self, buf: bytes, shown: _Shown | None) -> int:
        """Where the trailing piece that must wait for more data begins."""
        n = len(buf)
        floor = max(self._done, n - self._detector.overlap)
        if shown is None:
            k = buf[floor:].translate(_TOKEN_MARKS).rfind(b"|")
            hold = floor + k + 1 if k >= 0 else floor
            where: Callable[[int], int]
            text, low, where = buf, floor, int
        else:  # noise is part of a run of token characters, never its end; the rest is read as shown
            k = shown.last_break(floor)
            hold = k + 1 if k >= 0 else floor
            text, low, where = shown.text[:shown.visible], 0, shown.raw_at
        line = max(text.rfind(b"\n", low), low - 1) + 1
        if self._env and b"=" in text[line:]:
            for m in _OPEN_ASSIGNMENT.finditer(text, line):
                rest = text[m.end():]
                if is_secret_name(m.group(1).decode("latin-1")) and text[m.end() - 1:m.end()] not in rest:
                    hold = min(hold, max(floor, where(m.start())))
                    break
        k = max(text.rfind(b"BEGIN ", low), text.rfind(b"PuTTY-User-Key-File-", low))
        if k >= 0 and not _PEM_FOOTER.search(text, k) and not _PUTTY_MAC.search(text, k) and where(k) >= floor:
            hold = min(hold, max(floor, where(max(0, k - 5))))
        return max(hold, self._done)

    def _emit(self, final: bool) -> bytes:
        buf, done = self._buf, self._done
        n = len(buf)
        shown = _Shown.of(buf, final)
        limit = n if final else self._hold(buf, shown)
        findings = self._findings(buf, shown, final)
        if self._base > 0 and findings and findings[0].start == 0:
            findings = findings[1:]  # the tail of something that began before the kept context
        if not final:
            for f in findings:
                if f.start < limit < f.end or (f.end >= n and f.start < limit):
                    limit = f.end if f.end < n else max(done, f.start)
        out = []
        last = done
        for f in findings:
            if f.end <= done or f.start >= limit:
                continue
            out.append(buf[last:max(f.start, done)])
            out.append(b"[redacted:" + f.kind.encode("utf-8", "replace") + b"]")
            last = f.end
        out.append(buf[last:max(last, limit)])
        emitted = max(last, limit)
        if not final:
            cut = _safe_cut(buf, emitted - self._CONTEXT, self._origin, self._base)
            if cut > 0:
                self._origin = _run_origin(buf, cut, self._origin, self._base)
                self._buf = buf[cut:]
                self._base += cut
                emitted -= cut
            self._done = emitted
        return b"".join(out)
