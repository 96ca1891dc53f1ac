"""What serve and run both run around a proxy: the control socket and the live policy."""
