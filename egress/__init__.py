"""egress: an allow-list egress proxy built on mitmproxy."""

__version__ = "0.1.0"
