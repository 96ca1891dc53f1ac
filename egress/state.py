"""Where egress keeps its state: the CA that signs intercepted connections.

The directory is ``$EGRESS_STATE_DIR`` if set, else ``$XDG_STATE_HOME/egress``,
else ``~/.local/state/egress``. The CA lives in its ``ca/`` folder under
mitmproxy's file names; the private key is readable by its owner only.
"""

from __future__ import annotations

import os
from pathlib import Path

CA_BASENAME = "mitmproxy"  # the names mitmproxy's TlsConfig looks for in its confdir
CA_KEY_SIZE = 2048


class StateError(Exception):
    """The state directory or the CA cannot be created or read."""


def state_dir() -> Path:
    if env := os.environ.get("EGRESS_STATE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "egress"


def ca_dir(base: Path | None = None) -> Path:
    return (base or state_dir()) / "ca"


def ca_cert_path(base: Path | None = None) -> Path:
    """The CA certificate (PEM) clients must trust to accept intercepted TLS."""
    return ca_dir(base) / f"{CA_BASENAME}-ca-cert.pem"


def ensure_ca(base: Path | None = None) -> Path:
    """Create the CA on first use; return the certificate's path. Raises StateError."""
    directory = ca_dir(base)
    if ca_cert_path(base).is_file() and (directory / f"{CA_BASENAME}-ca.pem").is_file():
        return ca_cert_path(base)  # the common case, without importing mitmproxy (~0.1 s)
    from mitmproxy import certs


    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        certs.CertStore.from_store(directory, CA_BASENAME, CA_KEY_SIZE)
    except (OSError, ValueError) as e:
        raise StateError(
            f"cannot create or read the CA in {directory}: {e}. Set EGRESS_STATE_DIR "
            f"(or --state-dir) to a folder you can write.") from None
    return ca_cert_path(base)
