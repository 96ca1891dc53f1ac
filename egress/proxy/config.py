"""What shapes a proxy, as one value: ProxyConfig, for `egress serve` and `egress run` alike.

Kept apart from the builder (egress.proxy.build) so that the master (egress.proxy.master) and
the builder both read it without importing each other. Imports nothing heavy: every
`egress run` makes one.
"""

from __future__ import annotations

from collections import namedtuple
from types import MappingProxyType

from egress.proxy.ca import StateDir

_NOTHING = MappingProxyType({})  # an empty mapping no one can change, shared by every default

# The limits addon's options (egress/proxy/addons/limits.py) and their defaults, as the CLI passes them.
DEFAULT_LIMITS = MappingProxyType({"egress_max_client_connections": 256, "egress_idle_timeout": 300.0,
                                   "egress_head_timeout": 60.0, "egress_max_head_bytes": 65536,
                                   "egress_label_injection": False})  # addons.injection_label


class ProxyConfig(namedtuple("ProxyConfig", (
        "listen", "metrics", "audit_log", "resolve", "dns_server", "dns_timeout", "upstream_timeout",
        "upstream_ca", "state_dir", "extra_options", "auth", "front"),
        defaults=(None, None, None, _NOTHING, None, 5.0, 60.0, None, None, _NOTHING, None, False))):
    """Everything that shapes a proxy except its policy and credentials, for serve and run alike.

    Keyword fields (``config._replace(listen=...)`` makes a changed copy):

    * ``listen``: (host, port); None: listen nowhere, serve only handed-over sockets (egress run)
    * ``metrics``: (host, port) of the Prometheus endpoint (/metrics); None: off
    * ``audit_log``: a file (appended to), ``-`` (standard output); None: off
    * ``resolve``: name -> [address], answered without DNS (--resolve)
    * ``dns_server``: (address, port); None: the system's resolvers
    * ``dns_timeout``: seconds to wait for DNS answers (5)
    * ``upstream_timeout``: seconds until an upstream's response head (60); 0: wait forever
    * ``upstream_ca``: a CA (PEM) also trusted for upstream servers, beside the system's (egress.proxy.trust)
    * ``state_dir``: where the CA and control sockets live; None: the default (``config.state``)
    * ``extra_options``: mitmproxy options on top (tests, benchmarks)
    * ``auth``: (user, password) every client must send (egress.proxy.auth); None: none asked
    * ``front``: passthrough CONNECTs answered and relayed before mitmproxy (egress.proxy.fastpath; serve)

    A namedtuple, not a dataclass: every `egress run` makes one, and generating a dataclass's
    methods cost ~2 ms of its ~130 ms.
    """

    __slots__ = ()

    @property
    def state(self) -> StateDir:
        """Where this proxy's CA and control sockets live (``state_dir``, else the default)."""
        return StateDir.of(self.state_dir)

    def to_dict(self) -> dict:
        """As JSON-able data (egress run hands its proxy's configuration to the warm proxy)."""
        return {"listen": self.listen, "metrics": self.metrics, "audit_log": self.audit_log,
                "resolve": {name: [str(address) for address in addresses] for name, addresses in self.resolve.items()},
                "dns_server": self.dns_server, "dns_timeout": self.dns_timeout,
                "upstream_timeout": self.upstream_timeout,
                "upstream_ca": str(self.upstream_ca) if self.upstream_ca is not None else None,
                "state_dir": str(self.state_dir) if self.state_dir is not None else None,
                "extra_options": dict(self.extra_options),
                "auth": list(self.auth) if self.auth is not None else None, "front": self.front}

    @classmethod
    def from_dict(cls, data: dict) -> ProxyConfig:
        import ipaddress
        from pathlib import Path

        pair = lambda value: tuple(value) if value is not None else None  # noqa: E731
        return cls(listen=pair(data["listen"]), metrics=pair(data["metrics"]), audit_log=data["audit_log"],
                   resolve={name: [ipaddress.ip_address(a) for a in addresses]
                            for name, addresses in data["resolve"].items()},
                   dns_server=pair(data["dns_server"]), dns_timeout=data["dns_timeout"],
                   upstream_timeout=data["upstream_timeout"],
                   upstream_ca=Path(data["upstream_ca"]) if data["upstream_ca"] is not None else None,
                   state_dir=Path(data["state_dir"]) if data["state_dir"] is not None else None,
                   extra_options=data["extra_options"],
                   auth=tuple(data["auth"]) if data.get("auth") is not None else None,
                   front=bool(data.get("front", False)))
