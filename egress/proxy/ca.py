"""Where egress keeps its state (StateDir), and the CA that signs intercepted connections.

The directory is ``$EGRESS_STATE_DIR`` if set (or --state-dir), else ``$XDG_STATE_HOME/egress``,
else ``~/.local/state/egress``. Its folders:

    ca/      the CA, under mitmproxy's file names; the private key is readable by its owner only
    runs/    the control sockets of runs and serves (egress.host.control)
    warm/    the warm proxy's socket, lock, record and log (egress.run.warm.client)
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


class StateDir:
    """The state folder and its folders, as str paths; ``StateDir.of(given)`` (None: the default).

    A plain class, not a dataclass nor a namedtuple: every `egress run` makes one, and both cost
    more to define than this whole module (egress.proxy.config says what a dataclass cost).
    """

    __slots__ = ("root",)
    root: str

    def __init__(self, root: str):
        object.__setattr__(self, "root", root)

    def __setattr__(self, name, value):
        raise AttributeError("a StateDir does not change")

    def __eq__(self, other) -> bool:
        return isinstance(other, StateDir) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def __repr__(self) -> str:
        return f"StateDir({self.root!r})"

    @classmethod
    def of(cls, given: StateDir | str | os.PathLike | None = None) -> StateDir:
        """``given`` (--state-dir, a ProxyConfig's state_dir), else the default, read now."""
        if isinstance(given, StateDir):
            return given
        return cls(os.fspath(given) if given else state_dir())

    @property
    def ca(self) -> str:
        return os.path.join(self.root, "ca")

    @property
    def runs(self) -> str:
        return os.path.join(self.root, "runs")

    @property
    def warm(self) -> str:
        return os.path.join(self.root, "warm")

    @property
    def ca_cert(self) -> str:
        """The CA certificate (PEM) clients must trust to accept intercepted TLS."""
        return os.path.join(self.ca, f"{CA_BASENAME}-ca-cert.pem")


def ca_dir(base: StateDir | str | os.PathLike | None = None) -> str:
    return StateDir.of(base).ca


def ca_cert_path(base: StateDir | str | os.PathLike | None = None) -> str:
    """The CA certificate (PEM) clients must trust to accept intercepted TLS."""
    return StateDir.of(base).ca_cert


def ensure_ca(base: StateDir | str | os.PathLike | None = None) -> str:
    """Create the CA on first use; return the certificate's path. Raises StateError."""
    state = StateDir.of(base)
    directory, cert = state.ca, state.ca_cert
    if os.path.isfile(cert) and os.path.isfile(os.path.join(directory, f"{CA_BASENAME}-ca.pem")):
        return cert  # the common case, without importing mitmproxy (~0.1 s)
    from pathlib import Path

    from mitmproxy import certs

    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        certs.CertStore.from_store(Path(directory), CA_BASENAME, CA_KEY_SIZE)
    except (OSError, ValueError) as e:
        raise StateError(
            f"cannot create or read the CA in {directory}: {e}. Set EGRESS_STATE_DIR "
            f"(or --state-dir) to a folder you can write.") from None
    return cert
