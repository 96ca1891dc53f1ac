"""The mitmproxy data plane: the master and its addons, the fast path, refusals, the CA."""
