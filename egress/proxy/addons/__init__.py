"""mitmproxy addons, one concern each; assembled in egress.proxy.master."""
