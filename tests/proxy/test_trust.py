"""egress.proxy.trust: which CAs upstream certificates are verified against, and the checks of a CA
file a person names. Files are real (in tmp_path); the environment is passed in, never the
machine's."""

from __future__ import annotations

import pytest

from egress.proxy.addons.upstream_errors import UPSTREAM_CA_HINT, classify_tls_failure
from egress.proxy.trust import SYSTEM_BUNDLES, TrustError, proxy_locations, upstream_trust


@pytest.fixture
def pem(tmp_path, test_ca):
    path = tmp_path / "network-ca.pem"
    test_ca.cert_pem.write_to_path(str(path))
    return path


def test_without_variables_the_distribution_bundle_is_the_system_store():
    import certifi

    trust = upstream_trust(environ={})
    installed = [path for path in SYSTEM_BUNDLES if __import__("os").path.isfile(path)]
    assert trust.cafile == (installed[0] if installed else certifi.where())
    assert trust.source == ("the system's CA bundle" if installed else "certifi's CA bundle")
    assert (trust.capath, trust.extra, trust.roots) == (None, None, [trust.cafile])


def test_ssl_cert_file_and_dir_of_egress_environment_are_the_system_store(tmp_path, pem):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    folders = f"{tmp_path / 'a'}:{tmp_path / 'b'}"  # OpenSSL takes several, ':'-separated
    trust = upstream_trust(environ={"SSL_CERT_FILE": str(pem), "SSL_CERT_DIR": folders})
    assert (trust.cafile, trust.capath, trust.source) == (str(pem), folders, "SSL_CERT_FILE")
    assert trust.describe() == f"SSL_CERT_FILE {pem}, SSL_CERT_DIR {folders}"
    assert upstream_trust(environ={"SSL_CERT_FILE": ""}).source != "SSL_CERT_FILE"  # empty: unset


def test_upstream_ca_is_added_on_top(tmp_path, pem):
    trust = upstream_trust(pem, environ={"SSL_CERT_FILE": str(pem)})
    assert trust.roots == [str(pem), str(pem)] and trust.describe().endswith(f" and --upstream-ca {pem}")


@pytest.mark.parametrize("environ, problem", [
    ({"SSL_CERT_FILE": "{missing}"}, "SSL_CERT_FILE={missing} (egress's environment): no such file"),
    ({"SSL_CERT_FILE": "{tmp}"}, "SSL_CERT_FILE={tmp} (egress's environment): is a folder; expected a PEM file"),
    ({"SSL_CERT_DIR": "{tmp}:{missing}"}, "SSL_CERT_DIR={tmp}:{missing} (egress's environment): {missing} is "
                                          "not a folder"),
])
def test_a_variable_naming_something_unusable_is_refused(tmp_path, environ, problem):
    names = {"tmp": tmp_path, "missing": tmp_path / "missing"}
    with pytest.raises(TrustError) as error:
        upstream_trust(environ={k: v.format(**names) for k, v in environ.items()})
    assert str(error.value).startswith(problem.format(**names))


@pytest.mark.parametrize("content, problem", [
    (None, "no such file"),
    (b"", "is empty; expected a PEM file of CA certificates"),
    (b"\x30\x82\x01\x0a", "holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
    (b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n",
     "OpenSSL cannot read its certificates ("),
    ("/dev/null", "is not a regular file"),
])
def test_a_bad_upstream_ca_is_refused_in_one_line_naming_it(tmp_path, content, problem):
    path = tmp_path / "ca.pem"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path = content
    with pytest.raises(TrustError) as error:
        upstream_trust(path, environ={})
    assert str(error.value).startswith(f"--upstream-ca {path}: {problem}")
    assert "\n" not in str(error.value)


def test_mitmproxy_gets_the_bundle_where_it_lies_or_one_file_with_the_upstream_ca(tmp_path, pem, test_ca):
    system = upstream_trust(environ={"SSL_CERT_FILE": str(pem)})
    assert proxy_locations(system, tmp_path / "state") == (str(pem), None)
    assert not (tmp_path / "state").exists()  # nothing written without --upstream-ca

    import trustme

    extra = tmp_path / "company-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(extra))
    both = upstream_trust(extra, environ={"SSL_CERT_FILE": str(pem)})
    cafile, capath = proxy_locations(both, tmp_path / "state")
    assert cafile.startswith(str(tmp_path / "state" / "upstream-ca-")) and capath is None
    text = open(cafile).read()
    assert pem.read_text() in text and extra.read_text() in text
    assert proxy_locations(both, tmp_path / "state") == (cafile, None)  # named by content: written once


# What mitmproxy 11's TLS layer says when an upstream handshake fails, with OpenSSL's verification
# result: each case and what egress calls it (the --upstream-ca hint only where another CA helps).
TLS_FAILURES = [
    ("Certificate verify failed: unable to get local issuer certificate", 20,
     "upstream-certificate", f"unable to get local issuer certificate; {UPSTREAM_CA_HINT}"),
    ("Certificate verify failed: self-signed certificate", 18,
     "upstream-certificate", f"self-signed certificate; {UPSTREAM_CA_HINT}"),
    ("Certificate verify failed: self-signed certificate in certificate chain", 19,
     "upstream-certificate", f"self-signed certificate in certificate chain; {UPSTREAM_CA_HINT}"),
    ("Certificate verify failed: certificate has expired", 10, "upstream-certificate", "certificate has expired"),
    ("Certificate verify failed: hostname mismatch", 62, "upstream-certificate", "hostname mismatch"),
    ("The remote server does not speak TLS.", 0, "tls-failed", "The remote server does not speak TLS."),
    ("The remote server and mitmproxy cannot agree on a TLS version to use. You may need to adjust "
     "mitmproxy's tls_version_server_min option.", 0, "tls-failed",
     "The remote server and mitmproxy cannot agree on a TLS version to use. You may need to adjust "
     "mitmproxy's tls_version_server_min option."),
    ("connection closed", 0, "tls-failed", "connection closed"),
]


@pytest.mark.parametrize("message, verify, code, detail", TLS_FAILURES)
def test_upstream_tls_failures_are_named(message, verify, code, detail):
    assert classify_tls_failure(message, verify) == (code, detail)
