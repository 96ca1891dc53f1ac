"""Which CAs egress trusts for upstream servers: the system's store, plus ``--upstream-ca``.

egress verifies the certificate of every upstream it intercepts for, and trusts what
curl and the OS trust: OpenSSL's own variables in egress's environment
(``SSL_CERT_FILE``; ``SSL_CERT_DIR``, one folder or several joined by ``:``), else the
distribution's bundle (the first of :data:`SYSTEM_BUNDLES` that exists), else certifi's
roots (a system with no bundle at all). ``--upstream-ca FILE`` adds a CA on top of
them, never instead. A network that re-signs outbound TLS with a CA of its own in the
system store (many companies do) then works with no flag; before, egress trusted
certifi's roots only, and every HTTPS request there failed.

The same roots reach `egress run`'s command (sandbox.environment.trust_bundle), beside
egress's CA: it talks to passthrough hosts itself.

Everything is checked when the proxy is built (egress.proxy.build.ProxyBuilder.open, so
before `egress run`'s command starts), each problem one line naming the file or
variable: missing, a folder, empty, unreadable, no PEM certificate in it, and for
``--upstream-ca`` one OpenSSL cannot read.

Stdlib only, cheap to import: `egress run` uses it before its command starts.
"""

from __future__ import annotations

import os
import stat

# Where distributions keep their bundle: Debian/Ubuntu/Alpine/Arch, Fedora/RHEL,
# macOS/OpenBSD/Alpine, openSUSE. The first that exists is the system's.
SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                  "/etc/ssl/cert.pem", "/etc/ssl/ca-bundle.pem")

PEM_CERTIFICATE = "-----BEGIN CERTIFICATE-----"


class TrustError(Exception):
    """A CA file or folder egress was told to trust cannot be used; the message is one line."""


class UpstreamTrust:
    """What upstream certificates are verified against.

    * ``cafile``: the system's bundle (a PEM file)
    * ``capath``: ``SSL_CERT_DIR`` (OpenSSL's hashed folders, ``:``-separated), or None
    * ``extra``: ``--upstream-ca``, trusted beside them, or None
    * ``source``: where ``cafile`` came from, in words (for messages)

    A plain class: a namedtuple's generated class cost ~0.3 ms of every `egress run`.
    """

    __slots__ = ("cafile", "capath", "extra", "source")

    def __init__(self, cafile: str, capath: str | None = None, extra: os.PathLike | None = None, source: str = ""):
        self.cafile, self.capath, self.extra, self.source = cafile, capath, extra, source

    def describe(self) -> str:
        """In words: ``the system's CA bundle /etc/ssl/... and --upstream-ca corp.pem``."""
        text = f"{self.source} {self.cafile}"
        if self.capath is not None:
            text += f", SSL_CERT_DIR {self.capath}"
        if self.extra is not None:
            text += f" and --upstream-ca {self.extra}"
        return text

    @property
    def roots(self) -> list[str]:
        """The PEM files, system's first: what a client of passthrough hosts must trust too."""
        return [self.cafile] + ([str(self.extra)] if self.extra is not None else [])


def upstream_trust(extra_ca: os.PathLike | str | None = None, environ=None) -> UpstreamTrust:
    """The system's store as egress's environment names it, plus ``extra_ca``, all checked.

    Raises TrustError (one line naming the file and the problem).
    """
    env = os.environ if environ is None else environ
    named = env.get("SSL_CERT_FILE")
    if named:
        cafile, source = named, "SSL_CERT_FILE"
        check_ca_file(named, f"SSL_CERT_FILE={named} (egress's environment)")
    else:
        cafile = next((path for path in SYSTEM_BUNDLES if os.path.isfile(path)), None)
        if cafile is not None:
            source = "the system's CA bundle"
            check_ca_file(cafile, f"the system's CA bundle {cafile}")
        else:  # no bundle installed (a minimal container): the public roots egress ships with
            import certifi

            cafile, source = certifi.where(), "certifi's CA bundle"
    capath = env.get("SSL_CERT_DIR") or None
    if capath is not None:
        for folder in capath.split(":"):
            if not os.path.isdir(folder):
                raise TrustError(f"SSL_CERT_DIR={capath} (egress's environment): {folder} is not a folder")
    extra = None
    if extra_ca is not None:
        from pathlib import Path  # here: `egress run` never imports pathlib (egress.proxy.ca says why)

        extra = Path(extra_ca)
        check_ca_file(str(extra), f"--upstream-ca {extra}", parse=True)
    return UpstreamTrust(cafile, capath, extra, source)


def check_ca_file(path: str, label: str, parse: bool = False) -> str:
    """The text of a PEM file of CA certificates; TrustError naming ``label`` and the problem.

    ``parse``: also have OpenSSL read it (a small file: 0.1 ms; a distribution bundle of ~140
    certificates costs ~25 ms that way, so bundles are only checked for a PEM certificate).
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise TrustError(f"{label}: no such file") from None
    except OSError as e:
        raise TrustError(f"{label}: {e.strerror or e}") from None
    if stat.S_ISDIR(info.st_mode):
        raise TrustError(f"{label}: is a folder; expected a PEM file of CA certificates")
    if not stat.S_ISREG(info.st_mode):
        raise TrustError(f"{label}: is not a regular file; expected a PEM file of CA certificates")
    if info.st_size == 0:
        raise TrustError(f"{label}: is empty; expected a PEM file of CA certificates")
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise TrustError(f"{label}: cannot be read ({e.strerror or e})") from None
    if PEM_CERTIFICATE not in text:
        raise TrustError(f"{label}: holds no PEM certificate ({PEM_CERTIFICATE})")
    if parse:
        import ssl

        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=text)
        except (ssl.SSLError, ValueError) as e:
            reason = getattr(e, "reason", None) or str(e)
            raise TrustError(f"{label}: OpenSSL cannot read its certificates ({reason})") from None
    return text


def proxy_locations(trust: UpstreamTrust, state_dir: str | os.PathLike) -> tuple[str, str | None]:
    """(CA file, CA folder or None) for mitmproxy, which takes one of each.

    Without ``--upstream-ca`` the system's bundle is used where it lies; with it, the two
    are written as one file into the state directory, named by content (proxies trusting
    different CAs never overwrite each other's). Raises TrustError.
    """
    if trust.extra is None:
        return trust.cafile, trust.capath
    from pathlib import Path

    state_dir = Path(state_dir)
    try:
        bundle = "\n".join(Path(path).read_text(encoding="ascii", errors="replace") for path in trust.roots)
    except OSError as e:  # changed since it was checked
        raise TrustError(f"cannot read {e.filename}: {e.strerror or e}") from None
    import hashlib  # here: ~3 ms to import, and only --upstream-ca needs it

    digest = hashlib.sha256(bundle.encode()).hexdigest()[:16]
    target = state_dir / f"upstream-ca-{digest}.pem"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(bundle, encoding="ascii")
            tmp.replace(target)
    except OSError as e:
        raise TrustError(f"cannot write {target}: {e.strerror or e}") from None
    return str(target), trust.capath
