"""Where egress keeps its state: the CA that signs intercepted connections.

The directory is ``$EGRESS_STATE_DIR`` if set, else ``$XDG_STATE_HOME/egress``,
else ``~/.local/state/egress``. The CA lives in its ``ca/`` folder under
mitmproxy's file names; the private key is readable by its owner only.
"""

from __future__ import annotations

import os

# Paths are str here, not pathlib's: `egress run` reads this module before its command starts, and
# importing pathlib (with urllib.parse, ipaddress, fnmatch, ntpath) cost ~4-5 ms of every run.

CA_BASENAME = "mitmproxy"  # the names mitmproxy's TlsConfig looks for in its confdir
CA_KEY_SIZE = 2048


class StateError(Exception):
    """The state directory or the CA cannot be created or read."""


def state_dir() -> str:
    if env := os.environ.get("EGRESS_STATE_DIR"):
        return env
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "egress")


def ca_dir(base: str | os.PathLike | None = None) -> str:
    return os.path.join(base or state_dir(), "ca")


def ca_cert_path(base: str | os.PathLike | None = None) -> str:
    """The CA certificate (PEM) clients must trust to accept intercepted TLS."""
    return os.path.join(ca_dir(base), f"{CA_BASENAME}-ca-cert.pem")


def ensure_ca(base: str | os.PathLike | None = None) -> str:
    """Create the CA on first use; return the certificate's path. Raises StateError."""
    directory = ca_dir(base)
    if os.path.isfile(ca_cert_path(base)) and os.path.isfile(os.path.join(directory, f"{CA_BASENAME}-ca.pem")):
        return ca_cert_path(base)  # the common case, without importing mitmproxy (~0.1 s)
    from pathlib import Path

    from mitmproxy import certs

    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        certs.CertStore.from_store(Path(directory), CA_BASENAME, CA_KEY_SIZE)
    except (OSError, ValueError) as e:
        raise StateError(
            f"cannot create or read the CA in {directory}: {e}. Set EGRESS_STATE_DIR "
            f"(or --state-dir) to a folder you can write.") from None
    return ca_cert_path(base)
