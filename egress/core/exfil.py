"""Exfiltration-shaped host names: data smuggled out in the labels of a name.

A lookup of ``<data>.exfil.example`` delivers ``<data>`` to whoever runs example's name
server, whatever the answer; so does an HTTP request to that name under ``network = "all"``.
Encoders (dnscat2, iodine, DNSExfiltrator, a shell one-liner with ``base32``/``xxd -p``) put
hex, base32 or base64 text in labels of up to 63 characters, or in many short ones.
``shape(name)`` says whether a canonical name (egress.core.hosts: lower case, punycode; case is
gone, so base64 reads as its lower-case letters and digits, with ``-`` and ``_``) looks like
that, and why, in a few words; None if it does not.

Rules, over the parts of each label between hyphens and underscores ("runs"), measured on the
tables in tests/core/test_exfil.py (real CDN, cloud, registry, mirror and cluster names that must
pass; encoder output that must not):

* A label directly under a public suffix (either section of the list: ``cloudfront.net``,
  ``s3.amazonaws.com``, ``supabase.co``) is a customer's registered name, assigned or bought,
  whose queries go to the provider's name servers, never to an attacker's: not examined.
  So ``d111111abcdef8.cloudfront.net`` and ``abcdefghijklmnopqrst.supabase.co`` pass.
* hex: a run of 40 or more hex digits (160 bits). Cloudflare R2's account ids and EKS's
  cluster ids are 32 (``<32 hex>.r2.cloudflarestorage.com``) and Netlify's deploy ids 24, so
  40 leaves room.
* base32: a run of 16 or more characters, all in base32's alphabet (a-z, 2-7), with at least
  two digits and at least 3.3 bits of entropy per character (``jbswy3dpehpk3pxp``: 3.45;
  words and word-like ids: no digits, or few distinct letters). Random ids of other alphabets
  usually hold a 0, 1, 8 or 9: a 16-character [a-z0-9] id avoids all four 15% of the time,
  and a 32-character one (an AWS Lambda function URL) 2.3% of the time, so an id of that
  kind can be refused (an OpenSearch endpoint's 26-character id is, most of the time); an
  allow-list entry naming it lets it through (policy_matcher).
* random: a run of 40 or more letters and digits with at least 4 bits of entropy per
  character and a digit in it (a 32-character Lambda function URL id is below the length).
* base64: a label of 20 or more characters with an underscore inside it (base64url's ``_``;
  no host name has one but in a leading service label, ``_dmarc``), letters and digits; or a
  label of 40 or more whose hyphens split base64url's text into runs, read as one run without
  them by the random rule (a name's hyphens join words: they leave it under 4 bits).
* spread: code-like runs (10+ characters mixing letters and digits, 2.8 bits/character or
  more: 12 random base32 characters measured 2.9-3.4) adding up to 48 characters or more across
  the name, for encoders that split data into many labels (``<15>.<15>.<15>.<15>.exfil.example``).
* short labels: code-like runs of 4 characters or more (letters and digits interleaved, not a
  word and a number: ``x1y2z3``, not ``central1`` or ``abc123``; from 10 characters, the
  spread's) in 2 labels or more, adding up to 16; hex runs (4+ characters with a digit, a
  number included: hex of text is mostly digits) in 2 labels or more, adding up to 24 (hex of
  12 bytes). In the tables no real name has code-like runs in two labels; the most hex is 10
  in 2 (``my-cache.abc123.ng.0001.use1``); ids sit in one label (EKS: 32 hex).
* chain: more than 10 labels (the tables' longest real names have 9: a dotted S3 bucket, an
  MSK broker, an Akamai chain), whatever is in them. Reverse-lookup names (``in-addr.arpa``,
  ``ip6.arpa``: one address, one nibble or number a label) are what they say and pass.

Known gaps, each the price of a real name passing: up to 16 bytes as one label of 32 hex (an
EKS or R2 id), base64 of up to ~20 bytes in one label (a Lambda function URL id), data spelt in
letters only (a-p for each nibble: words cannot be told from it) in fewer than 11 labels, and
small payloads (10 bytes) in any form. An allowed wildcard parent is never examined.

Pure, no network. A name of at most 3 labels whose labels are all shorter than 10 characters
(almost all) returns after one pass over them; other names look at the runs of each label
holding a digit or a hyphen; a label with a hex or code-like run asks the public suffix list
once, and a long run costs an entropy (the costs: bench/README.md, "Exfiltration-shaped names").
"""

from __future__ import annotations

import math
import re
from collections import Counter

from egress.core.public_suffix import is_public_suffix

HEX_RUN = 40
BASE32_RUN = 16
BASE32_BITS = 3.3
RANDOM_RUN = 40
RANDOM_BITS = 4.0
BASE64_UNDERSCORE = 20
SPREAD_RUN = 10
SPREAD_BITS = 2.8
SPREAD_TOTAL = 48
CODE_RUN = 4
CODE_LABELS = 2
CODE_TOTAL = 16
HEX_PART = 4
HEX_LABELS = 2
HEX_TOTAL = 24
MAX_LABELS = 10

_BASE32 = re.compile(r"[a-z2-7]+")
_ALNUM = re.compile(r"[a-z0-9]+")
_WORD_AND_NUMBER = re.compile(r"[a-z]+[0-9]+|[0-9]+[a-z]+")
_NO_DIGITS = str.maketrans("", "", "0123456789")
_HEXDIGITS = frozenset("0123456789abcdef")


def shape(name: str) -> str | None:
    """Why ``name`` (canonical: lower case, no trailing dot) looks like data leaving in its
    labels, in a few words; None when it does not. IP literals and short names return None."""
    if len(name) < SPREAD_RUN + 3:
        return None
    labels = name.split(".")
    count = len(labels)
    if count > MAX_LABELS:
        return None if _reverse(labels) else f"a chain of {count} labels"
    if count < 4 and max(map(len, labels)) < SPREAD_RUN:
        return None  # almost every name: one pass (short runs count in 2 labels above the registered one)
    spread = code = hexes = 0
    code_labels = hex_labels = 0
    for i, label in enumerate(labels[:-1]):  # the top-level label is never the data
        if len(label) < CODE_RUN or label.isalpha():
            continue
        in_code = in_hex = 0
        registered = None
        for run in (label.replace("_", "-") if "_" in label else label).split("-"):
            length = len(run)
            if length < CODE_RUN or run.isalpha() or not (run.isascii() and run.isalnum()):
                continue  # short, a word, or not letters and digits
            is_hex = _HEXDIGITS.issuperset(run)  # a number too: hex of text is mostly digits
            code_like = not run.isdigit() and (length >= SPREAD_RUN or not _WORD_AND_NUMBER.fullmatch(run))
            if not (is_hex or code_like):
                continue  # a number, or a word and a number: us-central1, use1, host12
            if registered is None:
                registered = _registered(labels, i)  # a suffix-list look: only for labels that may hold data
            if registered:
                break
            if is_hex:
                in_hex += length
            if not code_like:
                continue
            if length < SPREAD_RUN:
                in_code += length
                continue
            bits = _entropy(run)
            digits = length - len(run.translate(_NO_DIGITS))
            if length >= HEX_RUN and is_hex:
                return f"a label of {length} hex digits"
            if length >= BASE32_RUN and digits >= 2 and bits >= BASE32_BITS and _BASE32.fullmatch(run):
                return f"a base32-shaped label of {length} characters ({bits:.1f} bits each)"
            if length >= RANDOM_RUN and bits >= RANDOM_BITS:
                return f"a random-looking label of {length} characters ({bits:.1f} bits each)"
            if bits >= SPREAD_BITS:
                spread += length
                in_code += length
        if len(label) >= BASE64_UNDERSCORE and not label.isalnum() and (in_code or "_" in label.lstrip("_")):
            why = None if registered or registered is None and _registered(labels, i) else _base64(label)
            if why is not None:
                return why
        if in_code:
            code += in_code
            code_labels += 1
        if in_hex:
            hexes += in_hex
            hex_labels += 1
    if spread >= SPREAD_TOTAL:
        return f"{spread} random-looking characters spread over its labels"
    if hex_labels >= HEX_LABELS and hexes >= HEX_TOTAL:
        return f"{hexes} hex digits split over {hex_labels} labels"
    if code_labels >= CODE_LABELS and code >= CODE_TOTAL:
        return f"{code} code-like characters in short labels ({code_labels} labels)"
    return None


def _base64(label: str) -> str | None:
    """Why ``label`` (20+ characters, with a hyphen or underscore) reads as base64url lower-cased."""
    body = label.lstrip("_")
    if "_" in body:
        if not _ALNUM.fullmatch(body.replace("_", "").replace("-", "")):
            return None
        digits = len(body) - len(body.translate(_NO_DIGITS))
        if 0 < digits < len(body) - body.count("_") - body.count("-"):
            return f"a base64-shaped label of {len(label)} characters (an underscore inside)"
        return None
    if len(body) < RANDOM_RUN:
        return None
    joined = body.replace("-", "")
    if len(joined) < RANDOM_RUN or not _ALNUM.fullmatch(joined) or joined.isalpha():
        return None
    bits = _entropy(joined)
    if bits >= RANDOM_BITS:
        return f"a base64-shaped label of {len(label)} characters ({bits:.1f} bits each, hyphens aside)"
    return None


def _registered(labels: list[str], i: int) -> bool:
    """Whether labels[i] is the label right under a public suffix (a registered name)."""
    return is_public_suffix(".".join(labels[i + 1:]))


def _reverse(labels: list[str]) -> bool:
    """Whether ``labels`` are a reverse-lookup name: ``d.c.b.a.in-addr.arpa`` (up to 4 numbers
    0-255) or ``<up to 32 nibbles>.ip6.arpa`` (one hex digit a label)."""
    if len(labels) < 3 or labels[-1] != "arpa":
        return False
    parts = labels[:-2]
    if labels[-2] == "ip6":
        return len(parts) <= 32 and all(len(p) == 1 and p in _HEXDIGITS for p in parts)
    if labels[-2] == "in-addr":
        return len(parts) <= 4 and all(p.isdigit() and len(p) <= 3 and int(p) <= 255 for p in parts)
    return False


def _entropy(text: str) -> float:
    """Shannon entropy of the characters of ``text``, in bits per character."""
    n = len(text)
    return -sum(k / n * math.log2(k / n) for k in Counter(text).values())
