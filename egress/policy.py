"""The domain policy, as one name for its callers.

It lives in three modules: egress.policy_matcher (a loaded policy and its pure
decisions), egress.policy_loader (TOML files, includes, built-in sets, problems
with file:line) and egress.public_suffix (the public suffix list). The credential
settings written in policy files are parsed beside the policy, by egress.settings.
Everything callers used from here is re-exported.
"""

from __future__ import annotations

from .contract import NETWORK_MODES
from .policy_loader import (
    BUILTIN_SETS,
    KNOWN_KEYS,
    PolicyError,
    Problem,
    Reader,
    ReadRefused,
    builtin_dir,
    builtin_path,
    load_policy,
    pin_text,
    policy_from_mapping,
    read_file,
)
from .policy_matcher import LIST_KEYS, Decision, Policy, Rule
from .public_suffix import is_public_suffix, registrable_domain

__all__ = [
    "BUILTIN_SETS", "KNOWN_KEYS", "LIST_KEYS", "NETWORK_MODES", "Decision", "Policy", "PolicyError",
    "Problem", "ReadRefused", "Reader", "Rule", "builtin_dir", "builtin_path", "is_public_suffix",
    "load_policy", "pin_text", "policy_from_mapping", "read_file", "registrable_domain",
]
