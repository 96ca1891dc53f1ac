"""Untrusted content for an agent to read: fenced, cleaned of hidden characters, and scored.

``egress fence`` (and :func:`fence`) writes text inside ``<untrusted-content-NONCE>`` ...
``</untrusted-content-NONCE>`` with a fresh random nonce per call (128 bits), the trusted
fields (its source, what the harness knows about it) outside the fence, before it::

    source: https://example.org/issue/12
    fetched: 2026-12-03
    <untrusted-content-5b0c6f0a9d3e41c7a8f2e61b4d9c0a17>
    ...the text...
    </untrusted-content-5b0c6f0a9d3e41c7a8f2e61b4d9c0a17>

The text cannot close the fence: it cannot know the nonce, and any fence tag it holds
(``<untrusted-content...``, ``</untrusted-content...``, whatever the case) has its ``<``
written as ``&lt;``. Characters a person reading the text would not see are stripped from
it (:func:`strip_hidden`): bidirectional controls (the "Trojan Source" reordering), zero-width
characters, Unicode tag characters (text that is invisible yet read by a model), variation
selectors, other format and control characters.

:func:`score` reports signals of a prompt injection, each with the text that showed it, and a
score in [0, 1] (``1 - prod(1 - weight)`` over the signals found): telling the reader to ignore
its instructions, a new persona, an instruction to send data to a URL, references to key
material, telling the reader to call its tools, fake conversation markers, hidden characters.
What tag characters spell (invisible ASCII) is scored too. One weak signal alone
(documentation that mentions an API key: 0.25) scores low, under 0.3; one strong signal is
0.5-0.6, and an injection usually shows several. It is a heuristic for a harness to act on (fence harder, ask a person,
drop the text), not a verdict.
"""

from __future__ import annotations

import re
import secrets
import unicodedata
from collections.abc import Sequence

FENCE = "untrusted-content"
NONCE_BYTES = 16  # 128 bits, fresh for every fence

# Hidden from a person, read by a machine: stripped from fenced text.
_HIDDEN_RANGES = (
    (0x0000, 0x0008), (0x000B, 0x001F), (0x007F, 0x009F),  # control characters but \t and \n
    (0x00AD, 0x00AD),  # soft hyphen
    (0x034F, 0x034F),  # combining grapheme joiner
    (0x061C, 0x061C),  # Arabic letter mark (bidi)
    (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F),  # fillers, Khmer vowels, Mongolian selectors
    (0x200B, 0x200F),  # zero-width space, joiners, LRM, RLM
    (0x202A, 0x202E),  # bidi embeddings and overrides
    (0x2060, 0x206F),  # word joiner, invisible operators, bidi isolates, deprecated formats
    (0x3164, 0x3164), (0xFFA0, 0xFFA0),  # Hangul fillers
    (0xFE00, 0xFE0F),  # variation selectors
    (0xFEFF, 0xFEFF),  # zero-width no-break space (BOM)
    (0xFFF9, 0xFFFB),  # interlinear annotations
    (0x1BCA0, 0x1BCA3),  # shorthand format controls
    (0x1D173, 0x1D17A),  # musical format controls
    (0xE0000, 0xE007F),  # tag characters: invisible ASCII
    (0xE0100, 0xE01EF),  # variation selectors supplement
)
_HIDDEN = re.compile("[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in _HIDDEN_RANGES) + "]")
_FENCE_TAG = re.compile(r"<(?=\s*/?\s*untrusted-content)", re.IGNORECASE)
_FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def strip_hidden(text: str) -> tuple[str, int]:
    """``text`` without characters hidden from a reader (CR LF becomes LF; a lone CR, which lets
    a terminal overwrite a line, is dropped), and how many were removed."""
    text = text.replace("\r\n", "\n")
    cleaned, count = _HIDDEN.subn("", text)
    # anything else of category Cf (format) the table above does not know yet
    if any(unicodedata.category(c) == "Cf" for c in cleaned if ord(c) > 0x7F):
        kept = "".join(c for c in cleaned if ord(c) <= 0x7F or unicodedata.category(c) != "Cf")
        count += len(cleaned) - len(kept)
        cleaned = kept
    return cleaned, count


def clean_field(value: str) -> str:
    """A trusted field's value on one line: hidden characters stripped, line breaks as spaces."""
    value, _ = strip_hidden(value)
    return " ".join(value.split())


def fence(text: str, source: str | None = None, fields: Sequence[tuple[str, str]] = (), nonce: str | None = None) -> str:
    """``text`` fenced for an agent to read as data (see the module's doc). Raises ValueError for
    a field name that is not a plain name."""
    nonce = nonce or secrets.token_hex(NONCE_BYTES)
    body, _ = strip_hidden(text)
    body = _FENCE_TAG.sub("&lt;", body)
    head = []
    if source is not None:
        head.append(f"source: {clean_field(source)}")
    for name, value in fields:
        if not _FIELD_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a field name (letters, digits, _ . -; a letter first)")
        head.append(f"{name}: {clean_field(value)}")
    if body and not body.endswith("\n"):
        body += "\n"
    return "".join(line + "\n" for line in head) + f"<{FENCE}-{nonce}>\n{body}</{FENCE}-{nonce}>\n"


# ------------------------------------------------------------------- scoring

_I = re.IGNORECASE
# (signal, weight, patterns): each pattern a regular expression on the cleaned text.
SIGNALS = (
    ("ignore-instructions", 0.6, [
        # within one clause: "ignore the proxy variables: captured, held to the policy" is documentation
        r"\b(?:ignore|disregard|forget|skip|override|bypass)\b[^.\n:;,]{0,40}\b(?:previous|prior|above|earlier|"
        r"preceding|all|any|your|the|system|original)\b[^.\n:;,]{0,30}\b(?:instructions?|prompts?|directions?|"
        r"rules|guidelines|context|messages?|guardrails|polic(?:y|ies))\b",
        r"\bnew (?:instructions|rules|task|directive)s?\s*:",
        r"\b(?:disregard|forget|ignore) (?:all of |everything )?(?:the |what (?:is|was) )?(?:above|previous|prior|said)"
        r"(?=\s*(?:and\b|[.,;:!]|$))",
        r"\b(?:do not|don't) (?:follow|obey) (?:your|the|any) (?:previous |prior |original )?"
        r"(?:instructions|rules|guidelines)\b",
    ]),
    ("persona", 0.5, [
        r"\byou are (?:now|no longer)\b", r"\bfrom now on,? you\b", r"\byou (?:will |must |should |shall |now |are to )+(?:act|behave|respond) as\b",
        r"(?m)(?:^|[.!?:]\s+)(?:now |from now on,? )?(?:act|behave) as (?:an?|my|if)\b",
        r"\b(?:act|behave) as an? (?:unrestricted|unfiltered|uncensored|jailbroken|evil|rogue|different)\b",
        r"\bpretend (?:to be|you are)\b", r"\byour new (?:role|persona|name|identity)\b",
        r"\b(?:developer|god|jailbreak|DAN) mode\b", r"\bjailbr[eo]ak",
    ]),
    ("exfiltration", 0.6, [
        r"\b(?:send|post|upload|forward|transmit|submit|exfiltrate|leak|email|report|beacon|paste)\b[^\n]{0,80}?"
        r"\b(?:to|at|into|via)\b[^\n]{0,40}?(?:https?://|www\.|[\w.+-]+@[\w-]+\.[\w.-]+)",
        r"!\[[^\]]*\]\(https?://[^)\s]*[?&][\w-]+=[^)\s]*\)",  # a markdown image that carries data out
        r"\b(?:curl|wget)\b[^\n]{0,80}(?:-d\b|--data|-F\b|--upload-file|-T\b)[^\n]{0,80}https?://",
    ]),
    ("key-material", 0.25, [
        r"\b(?:api[ _-]?keys?|secret[ _-]?keys?|private[ _-]?keys?|access[ _-]?tokens?|auth(?:entication)? tokens?|"
        r"passwords?|credentials|ssh keys?|seed phrase|mnemonic)\b",
        r"(?:~/\.ssh|id_rsa|id_ed25519|\.env\b|\.aws/credentials|\.netrc|\.npmrc|\.pypirc|/etc/shadow)",
        r"\b[A-Z][A-Z0-9_]*_(?:TOKEN|SECRET|API_KEY|PASSWORD|PRIVATE_KEY)\b",
    ]),
    ("tool-call", 0.35, [
        r"\b(?:call|use|invoke|run|trigger)\s+(?:the|your|this|a)\s+(?:[\w`'\"-]+\s+){0,2}tools?\b",
        r"\b(?:immediately|now|silently|quietly|secretly) (?:run|execute|call|invoke)\b",
        r"</?(?:tool_use|tool_call|function_calls?|invoke|antml:[\w]+)\b",
        r"\"(?:tool_calls?|function_call)\"\s*:",
    ]),
    ("fake-role", 0.5, [
        r"<\|(?:im_start|im_end|system|user|assistant|endoftext)\|>",
        r"(?m)^\s*(?:#{1,3}\s*)?\[?(?:system|assistant|developer)\]?\s*(?:message|prompt)?\s*:",
        r"</?(?:system|system-prompt|assistant|instructions)>",
        r"(?m)^\s*(?:Human|Assistant)\s*:",
    ]),
    ("addressing-the-model", 0.3, [
        r"\b(?:attention|note to|message for|instructions for)\b[^.\n]{0,20}\b(?:AI|LLM|agent|assistant|model|bot)s?\b",
        r"\bif you are an? (?:AI|LLM|language model|agent|assistant)\b",
        r"\b(?:dear|hey|hello) (?:AI|LLM|agent|assistant|Claude|ChatGPT|GPT|Copilot|Gemini)\b",
    ]),
)
_COMPILED = tuple((name, weight, [re.compile(p, _I) for p in patterns]) for name, weight, patterns in SIGNALS)
HIDDEN_WEIGHT = 0.5  # hidden characters in text meant for a person to read are rarely innocent
MAX_SCORED = 1 << 20  # characters scored: a longer text is scored on its first MiB


class Signal:
    __slots__ = ("name", "weight", "excerpt")

    def __init__(self, name: str, weight: float, excerpt: str):
        self.name = name
        self.weight = weight
        self.excerpt = excerpt

    def as_dict(self) -> dict[str, object]:
        return {"signal": self.name, "weight": self.weight, "excerpt": self.excerpt}


class Score:
    """Signals found (one per kind, its first occurrence) and the score they add up to."""

    __slots__ = ("signals", "score", "hidden")

    def __init__(self, signals: list[Signal], hidden: int):
        self.signals = signals
        self.hidden = hidden
        remaining = 1.0
        for signal in signals:
            remaining *= 1.0 - signal.weight
        self.score = round(1.0 - remaining, 3)

    @property
    def names(self) -> list[str]:
        return [signal.name for signal in self.signals]

    def as_dict(self) -> dict[str, object]:
        return {"score": self.score, "signals": [s.as_dict() for s in self.signals], "hidden_characters": self.hidden}


def score(text: str) -> Score:
    """The injection signals in ``text`` and their score (see the module's doc). Pure."""
    text = text[:MAX_SCORED]
    cleaned, hidden = strip_hidden(text)
    # Unicode tag characters spell ASCII no one sees: what they say is scored too
    revealed = "".join(chr(ord(c) - 0xE0000) for c in text if 0xE0020 <= ord(c) <= 0xE007E)
    if revealed:
        cleaned += "\n" + revealed
    found: list[Signal] = []
    for name, weight, patterns in _COMPILED:
        for pattern in patterns:
            match = pattern.search(cleaned)
            if match:
                found.append(Signal(name, weight, _excerpt(match.group(0))))
                break
    if hidden:
        found.append(Signal("hidden-characters", HIDDEN_WEIGHT, f"{hidden} hidden character(s)"))
    return Score(found, hidden)


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:77] + "..."
