"""Resolve a destination once, asynchronously, with a bounded time.

Order: what needs no lookup (an IP literal; ``localhost`` and ``*.localhost``, loopback by
definition, RFC 6761: never asked of DNS, and not overridable), the user's overrides
(``--resolve HOST:ADDR``, like curl's), then DNS with dnspython (A and AAAA in parallel,
answers cached by TTL). The proxy dials the address it checked, so a second lookup (DNS
rebinding) cannot change it.
"""

from __future__ import annotations

import asyncio
import ipaddress

import dns.asyncresolver
import dns.exception
import dns.resolver

from .addresses import known_addresses
from .hosts import Host, IPAddress


class ResolveError(Exception):
    """The name could not be resolved; ``code`` is dns-failed or dns-timeout."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


class Resolver:
    def __init__(self, overrides: dict[str, list[IPAddress]] | None = None,
                 timeout: float = 5.0, nameserver: tuple[str, int] | None = None):
        """``nameserver`` (address, port) replaces the system's resolvers (``--dns-server``)."""
        self.overrides = overrides or {}
        self.timeout = timeout
        self._dns: dns.asyncresolver.Resolver | None = None
        self._nameserver = nameserver

    def _resolver(self) -> dns.asyncresolver.Resolver:
        if self._dns is None:
            try:
                resolver = dns.asyncresolver.Resolver(configure=self._nameserver is None)
            except dns.resolver.NoResolverConfiguration:
                resolver = dns.asyncresolver.Resolver(configure=False)
            if self._nameserver is not None:
                resolver.nameservers = [self._nameserver[0]]
                resolver.port = self._nameserver[1]
            resolver.cache = dns.resolver.Cache()
            self._dns = resolver
        return self._dns

    async def resolve(self, host: Host) -> list[IPAddress]:
        """All addresses of ``host``; raises ResolveError."""
        known = known_addresses(host)
        if known is not None:
            return known
        if host.name in self.overrides:
            return list(self.overrides[host.name])
        resolver = self._resolver()

        async def query(rdtype: str) -> list[IPAddress]:
            try:
                answer = await resolver.resolve(host.name, rdtype, lifetime=self.timeout,
                                                search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                return []
            return [ipaddress.ip_address(r.address) for r in answer]

        try:
            results = await asyncio.gather(query("A"), query("AAAA"))
        except dns.exception.Timeout:
            raise ResolveError("dns-timeout", f"no answer within {self.timeout:g} s") from None
        except dns.resolver.NoNameservers as e:
            raise ResolveError("dns-failed", f"no name server answered: {e}") from None
        except dns.exception.DNSException as e:
            raise ResolveError("dns-failed", str(e)) from None
        addresses = results[0] + results[1]
        if not addresses:
            raise ResolveError("dns-failed", "no such name")
        return addresses
