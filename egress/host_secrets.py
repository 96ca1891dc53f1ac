"""Credentials in a host name, found before any DNS query.

A lookup of ``<token>.attacker.example`` carries the token to whoever runs example's name
server, whatever the answer, so the name is read before it is resolved: by
:class:`~egress.addons.credential_guard.CredentialGuard` on CONNECT and on each request head,
and by the passthrough front (egress.front) through the same guard.
"""

from __future__ import annotations

from .detect import Detector, Finding

CACHE = 4096  # host names repeat; the cache is cleared when it grows past this


class HostSecrets:
    """The first credential in a host name, cached per name."""

    def __init__(self, detector: Detector, ignore_kinds: frozenset):
        self.detector = detector
        self.ignore_kinds = ignore_kinds
        self._found: dict[str, Finding | None] = {}

    def first(self, host: str) -> Finding | None:
        """The first credential in ``host``, in whatever case it was written; None if none."""
        if host not in self._found:
            if len(self._found) > CACHE:
                self._found.clear()
            findings = [f for f in self.detector.scan_text(host) if f.kind not in self.ignore_kinds]
            self._found[host] = findings[0] if findings else None
        return self._found[host]
