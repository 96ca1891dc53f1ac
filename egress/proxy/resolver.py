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
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.resolver

from egress.core.addresses import known_addresses
from egress.core.hosts import Host, IPAddress


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

    def cached(self, host: Host) -> list[IPAddress] | None:
        """What :meth:`resolve` would return without waiting for anything: a literal, localhost,
        an override, or both of its DNS questions answered from the cache (an answer, or a cached
        NoAnswer/NXDOMAIN for one of them, as dnspython's own cache look-up reads them); None when
        resolve() would have to ask (or would fail). egress.proxy.fastpath decides only on these."""
        known = known_addresses(host)
        if known is not None:
            return known
        if host.name in self.overrides:
            return list(self.overrides[host.name])
        if self._dns is None:
            return None
        cache = self._dns.cache
        name = dns.name.from_text(host.name)
        found: list[IPAddress] = []
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            answer = cache.get((name, rdtype, dns.rdataclass.IN))
            if answer is None:
                negative = cache.get((name, dns.rdatatype.ANY, dns.rdataclass.IN))
                if negative is not None and negative.response.rcode() == dns.rcode.NXDOMAIN:
                    continue  # resolve() gets NXDOMAIN for it: no addresses of this type
                return None
            if answer.rrset is not None:  # None: a cached NoAnswer, no addresses of this type
                found += [ipaddress.ip_address(r.address) for r in answer]
        return found or None  # none at all: resolve() fails, and says why

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
