"""Exfiltration-shaped host names: data smuggled out in the labels of a name.

A lookup of ``<data>.exfil.example`` delivers ``<data>`` to whoever runs example's name
server, whatever the answer; so does an HTTP request to that name under ``network = "all"``.
Encoders (dnscat2, iodine, DNSExfiltrator, a shell one-liner with ``base32``/``xxd -p``) put
hex, base32 or base64 text in labels of up to 63 characters. ``shape(name)`` says whether a
canonical name (egress.hosts: lower case, punycode; case is gone, so base64 reads as its
lower-case letters and digits) looks like that, and why, in a few words; None if it does not.

Rules, over the parts of each label between hyphens and underscores ("runs"), measured on the
tables in tests/test_exfil.py (real CDN, cloud and mirror names that must pass; encoder output
that must not):

* A label directly under a public suffix (either section of the list: ``cloudfront.net``,
  ``s3.amazonaws.com``, ``supabase.co``) is a customer's registered name, assigned or bought,
  whose queries go to the provider's name servers, never to an attacker's: not examined.
  So ``d111111abcdef8.cloudfront.net`` and ``abcdefghijklmnopqrst.supabase.co`` pass.
* hex: a run of 40 or more hex digits (160 bits). Cloudflare R2's account ids are 32
  (``<32 hex>.r2.cloudflarestorage.com``) and Netlify's deploy ids 24, so 40 leaves room.
* base32: a run of 16 or more characters, all in base32's alphabet (a-z, 2-7), with at least
  two digits and at least 3.3 bits of entropy per character (``jbswy3dpehpk3pxp``: 3.45;
  words and word-like ids: no digits, or few distinct letters). Random ids of other alphabets
  usually hold a 0, 1, 8 or 9: a 16-character [a-z0-9] id avoids all four 15% of the time,
  and a 32-character one (an AWS Lambda function URL) 2.3% of the time, so an id of that
  kind can be refused; an allow-list entry naming it lets it through (policy_matcher).
* random: a run of 40 or more letters and digits with at least 4 bits of entropy per
  character and a digit in it (a 32-character Lambda function URL id is below the length).
* spread: code-like runs (10+ characters mixing letters and digits, 2.8 bits/character or
  more: 12 random base32 characters measured 2.9-3.4) adding up to 48 characters or more across the name, for encoders that split data
  into many short labels (``<15>.<15>.<15>.<15>.exfil.example``).

Pure, no network. Cost: names whose runs are all shorter than 10 characters (almost all)
return after one pass over the labels (~0.6 us); a name with a long run that mixes letters and
digits asks the public suffix list once (~3.6 us) and computes an entropy per such run (~30 us
in all for a Lambda function URL).
"""

from __future__ import annotations

import math
import re
from collections import Counter

from .public_suffix import is_public_suffix

HEX_RUN = 40
BASE32_RUN = 16
BASE32_BITS = 3.3
RANDOM_RUN = 40
RANDOM_BITS = 4.0
SPREAD_RUN = 10
SPREAD_BITS = 2.8
SPREAD_TOTAL = 48

_RUNS = re.compile(r"[^-_]+")
_HEX = re.compile(r"[0-9a-f]+")
_BASE32 = re.compile(r"[a-z2-7]+")
_ALNUM = re.compile(r"[a-z0-9]+")
_NO_DIGITS = str.maketrans("", "", "0123456789")


def shape(name: str) -> str | None:
    """Why ``name`` (canonical: lower case, no trailing dot) looks like data leaving in its
    labels, in a few words; None when it does not. IP literals and short names return None."""
    if len(name) < SPREAD_RUN + 3:
        return None
    labels = name.split(".")
    if len(labels) < 2 or max(map(len, labels)) < SPREAD_RUN:
        return None  # almost every name: one pass
    spread = 0
    for i, label in enumerate(labels[:-1]):  # the top-level label is never the data
        if len(label) < SPREAD_RUN:
            continue
        registered = None
        for run in _RUNS.findall(label):
            n = len(run)
            if n < SPREAD_RUN or not _ALNUM.fullmatch(run):
                continue
            digits = n - len(run.translate(_NO_DIGITS))
            if digits == 0 or digits == n:
                continue  # words, or a number: no encoder's output looks like either for long
            if registered is None:
                registered = _registered(labels, i)  # ~3.6 us: only for labels that look like data
            if registered:
                break
            bits = _entropy(run)
            if n >= HEX_RUN and _HEX.fullmatch(run):
                return f"a label of {n} hex digits"
            if n >= BASE32_RUN and digits >= 2 and bits >= BASE32_BITS and _BASE32.fullmatch(run):
                return f"a base32-shaped label of {n} characters ({bits:.1f} bits each)"
            if n >= RANDOM_RUN and bits >= RANDOM_BITS:
                return f"a random-looking label of {n} characters ({bits:.1f} bits each)"
            if bits >= SPREAD_BITS:
                spread += n
    if spread >= SPREAD_TOTAL:
        return f"{spread} random-looking characters spread over its labels"
    return None


def _registered(labels: list[str], i: int) -> bool:
    """Whether labels[i] is the label right under a public suffix (a registered name)."""
    parent = ".".join(labels[i + 1:])
    return is_public_suffix(parent)


def _entropy(text: str) -> float:
    """Shannon entropy of the characters of ``text``, in bits per character."""
    n = len(text)
    return -sum(k / n * math.log2(k / n) for k in Counter(text).values())
