"""Credential scanning: the detector, its decoders, and the install's stored secrets. No mitmproxy."""
