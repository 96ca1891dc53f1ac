"""egress.scan.host_secrets: a credential in a host name, however it is cut, glued or cased, is found
before any DNS query; real names have none.

The unit tests read names with HostSecrets over the detector; the proxy tests send the red
team's names (P15) to a real `egress serve` whose DNS server is one the test runs on loopback,
by CONNECT and in absolute form, through mitmproxy and through the passthrough front, and check
that the refusal names the kind and never reached that DNS server.
"""

from __future__ import annotations

import random
import socket
import string
import time
import zlib

import pytest
from conftest import run_curl
from test_dns import DnsServer
from test_exfil import REAL

from egress.scan import host_secrets
from egress.scan.detect import KINDS, Detector
from egress.scan.host_secrets import RULES, HostSecrets

_RANDOM = random.Random(26)
_B62 = string.ascii_uppercase + string.ascii_lowercase + string.digits
_B62_DIGITS = string.digits + string.ascii_uppercase + string.ascii_lowercase  # detect._crc_ok's order
_HEX = "0123456789abcdef"


def _pick(alphabet: str, n: int) -> str:
    return "".join(_RANDOM.choice(alphabet) for _ in range(n))


def _crc(prefix: str) -> str:
    """A GitHub/npm token: 30 random characters and 6 base62 digits of their CRC32."""
    body = _pick(_B62, 30)
    crc, digits = zlib.crc32(body.encode()), ""
    while crc:
        crc, r = divmod(crc, 62)
        digits = _B62_DIGITS[r] + digits
    return prefix + body + digits.rjust(6, "0")


_LOWER = string.ascii_lowercase + string.digits
# One token of each format HostSecrets.RULES knows, as the provider writes it (both cases where
# the format has them): (kind, token, found in one case).
SAMPLES = [
    ("github-token", _crc("ghp_"), True),
    ("github-token", _crc("gho_"), True),
    ("npm-token", _crc("npm_"), True),
    ("aws-access-key-id", "AKIA" + _pick("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16), True),
    ("aws-access-key-id", "ASIA" + _pick("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16), True),
    ("digitalocean-token", "dop_v1_" + _pick(_HEX, 64), True),
    ("shopify-token", "shpat_" + _pick(_HEX, 32), True),
    ("databricks-token", "dapi" + _pick(_HEX, 32), True),
    ("terraform-token", _pick(_LOWER, 14) + ".atlasv1." + _pick(_LOWER, 67), True),
    ("age-secret-key", "AGE-SECRET-KEY-1" + _pick("QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L", 58), True),
    ("sentry-token", "sntryu_" + _pick(_HEX, 64), True),
    ("postman-api-key", "PMAK-" + _pick(_HEX, 24) + "-" + _pick(_HEX, 34), True),
    ("supabase-token", "sbp_" + _pick(_HEX, 40), True),
    ("newrelic-api-key", "NRAK-" + _pick(string.ascii_uppercase + string.digits, 27), True),
    ("github-token", "github_pat_" + _pick(_B62, 22) + "_" + _pick(_B62, 59), True),
    ("gitlab-token", "glpat-" + _pick(_B62, 20), True),
    ("slack-token", "xoxb-1234567890-1234567890123-" + _pick(_B62, 24), True),
    ("slack-token", "xapp-1-A0123456789-1234567890123-" + _pick(_HEX, 64), True),
    ("stripe-secret-key", "sk_live_" + _pick(_B62, 24), True),
    ("openai-api-key", "sk-proj-" + _pick(_B62, 48), True),
    ("openai-api-key", "sk-" + _pick(_B62, 20) + "T3BlbkFJ" + _pick(_B62, 20), True),
    ("anthropic-api-key", "sk-ant-api03-" + _pick(_B62, 93) + "AA", True),
    ("anthropic-oauth-token", "sk-ant-oat01-" + _pick(_B62, 90), True),
    ("google-oauth-secret", "GOCSPX-" + _pick(_B62, 28), True),
    ("pypi-token", "pypi-AgEIcHlwaS5vcmc" + _pick(_B62, 60), True),
    ("huggingface-token", "hf_" + _pick(string.ascii_letters, 34), True),
    ("heroku-api-key", "HRKU-AA" + _pick(_B62, 58), True),
    ("atlassian-api-token", "ATATT3" + _pick(_B62, 186), True),
    ("groq-api-key", "gsk_" + _pick(_B62, 52), True),
    ("linear-api-key", "lin_api_" + _pick(_B62, 40), True),
    ("sentry-token", "sntrys_eyJ" + _pick(_B62, 80), True),
    ("grafana-token", "glsa_" + _pick(_B62, 32) + "_" + _pick(_HEX, 8), True),
    ("grafana-token", "glc_" + _pick(_B62, 40), True),
    ("square-token", "sq0atp-" + _pick(_B62, 22), True),
    ("square-token", "sq0csp-" + _pick(_B62, 43), True),
    ("perplexity-api-key", "pplx-" + _pick(_B62, 48), True),
    ("notion-token", "ntn_" + _pick(_B62, 46), True),
    ("replicate-api-token", "r8_" + _pick(_B62, 37), True),
    # Short word-like prefixes: both cases as written
    ("google-api-key", "AIza" + _pick(_B62, 35), False),
    ("google-oauth-token", "ya29." + _pick(_B62, 60), False),
    ("vault-token", "hvs." + _pick(_B62, 95), False),
    ("sendgrid-api-key", "SG." + _pick(_B62, 22) + "." + _pick(_B62, 43), False),
    ("alibaba-access-key-id", "LTAI" + _pick(_B62, 20), False),
    ("azure-devops-pat", _pick(_B62, 76) + "AZDO" + _pick(_B62, 4), False),
]
_IDS = [f"{kind}:{token[:7]}" for kind, token, _ in SAMPLES]


def labels(text: str, size: int = 40) -> str:
    """``text`` cut into labels of ``size`` characters (a label holds 63 at most)."""
    return ".".join(text[i:i + size] for i in range(0, len(text), size))


@pytest.fixture
def dns_server():
    """A DNS server on loopback that records each query (test_dns.DnsServer)."""
    server = DnsServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def hosts():
    return HostSecrets(Detector([("my-secret", "Zq8vLm2Rt7Kx")]), frozenset())


# ---------------------------------------------------------------- the tables


def test_the_samples_are_the_detectors_formats_and_cover_every_rule():
    # Each sample is a token the detector itself finds, standing alone, under the same kind:
    # the rules read in a name what the detector reads in text, no other kind.
    detector = Detector()
    for kind, token, _ in SAMPLES:
        assert kind in KINDS
        assert [f.kind for f in detector.scan_text(f"x {token} x")] == [kind], (kind, token)
    assert {r.kind for r in RULES} == {kind for kind, _, _ in SAMPLES}
    assert {r.caseless for r in RULES if r.kind == "google-api-key"} == {False}


@pytest.mark.parametrize("kind,token,caseless", SAMPLES, ids=_IDS)
def test_a_token_glued_or_split_is_found(hosts, kind, token, caseless):
    names = [
        labels(token) + ".ok.test",  # as it is (a long token needs several labels)
        "x" + labels(token) + ".ok.test",  # glued to a letter
        labels("a1" + token + "z", 20) + ".ok.test",  # glued on both sides, cut every 20
        labels(token, 7) + ".ok.test",  # cut every 7
        labels(token[:5]) + "." + labels(token[5:]) + ".ok.test",  # cut after its prefix
        "api." + labels(token) + ".example.com",
        labels(token) + ".s3.amazonaws.com",  # a registered label under a public suffix
    ]
    for name in names:
        found = hosts.first(name)
        assert found is not None and found.kind == kind, (name, found)
        assert token.lower().replace(".", "") not in hosts.redact(name).lower().replace(".", "")


@pytest.mark.parametrize("kind,token,caseless", SAMPLES, ids=_IDS)
def test_a_token_in_one_case_is_found_where_the_case_does_not_hide_it(hosts, kind, token, caseless):
    for name in (labels(token.lower()) + ".ok.test", "x" + labels(token.upper(), 9) + ".ok.test"):
        found = hosts.first(name)
        if caseless:
            assert found is not None and found.kind == kind, (name, found)
            assert token.lower().replace(".", "") not in hosts.redact(name).lower().replace(".", "")
        else:  # a random body in one case where the format has two: the detector's rule too
            assert found is None, (name, found)


def test_a_stored_secret_split_over_labels_is_found(hosts):
    for name in ("zq8vlm.2rt7kx.ok.test", "ZQ8V.LM2RT7KX.ok.test", "abc.zq8v.lm2r.t7kx.example.com",
                 "xzq8vlm2rt7kxy.ok.test"):
        found = hosts.first(name)
        assert found is not None and found.kind == "my-secret", name
        assert "[redacted:my-secret]" in hosts.redact(name)


def test_hex_of_a_token_split_over_labels_is_found(hosts):
    token = SAMPLES[0][1]
    hexed = token.encode().hex()
    assert hosts.first(labels(hexed, 40) + ".ok.test").kind == "github-token"
    assert hosts.first(labels(hexed, 16) + ".ok.test").kind == "github-token"


# Names with a format's prefix in them, or long runs of letters and digits: none is a credential.
LOOKALIKES = [
    "asiapacificnewsservice.com",
    "asia-east1-docker.pkg.dev",
    "storage.asia-northeast1.gcp.example.com",
    "southeastasia.azurecr.io",
    "accademia2024firenze.example.it",
    "kaizen-consulting-group-europe-west.example.com",
    "ghp-docs.example.com",
    "npm-mirror.internal.example.com",
    "registry.npmjs.org",
    "npm.pkg.github.com",
    "desk-api.example.com",
    "task-runner-4f2a9c.sk-prod.example.com",
    "sg-0123456789abcdef0.eu-west-1.example.com",
    "hvs-proxy.example.com",
    "ya29-migration.example.com",
    "dapi-gateway.example.com",
    "ltai-support.example.com",
    "my-long-service-name-with-many-words-and-2024-numbers.example.com",
    "github-production-user-asset-6210df.s3.amazonaws.com",
    "github-production-repository-file-5c1aeb.s3.amazonaws.com",
]


@pytest.mark.parametrize("name", REAL + LOOKALIKES)
def test_real_names_have_no_credential(hosts, name):
    assert hosts.first(name) is None
    assert hosts.redact(name) == name
    # Upper-cased, nothing the detector does not find in the name as written (it reads
    # ACCADEMIA2024FIRENZE as an AWS key id: 20 characters of its alphabet, standing alone).
    upper = name.upper()
    assert {f.kind for f in hosts.findings(upper)} <= {f.kind for f in hosts.detector.scan_text(upper)}


def test_addresses_and_single_labels_are_read_as_written(hosts):
    assert hosts.first("127.0.0.1") is None and hosts.first("::1") is None and hosts.first("localhost") is None
    assert hosts.first(SAMPLES[0][1]).kind == "github-token"  # one label: the detector's read


def test_an_ignored_kind_is_not_a_finding():
    detector = Detector()
    token = SAMPLES[0][1].lower()
    assert HostSecrets(detector, frozenset({"github-token"})).first("x" + token + ".ok.test") is None
    assert HostSecrets(detector, frozenset()).first("x" + token + ".ok.test").kind == "github-token"


def test_redact_names_the_kind_in_any_text(hosts):
    token = SAMPLES[0][1]
    line = f"CONNECT {token[:20].lower()}.{token[20:].lower()}.ok.test:443 refused (github-token in the host name)"
    assert hosts.redact(line) == "CONNECT [redacted:github-token].ok.test:443 refused (github-token in the host name)"


def test_the_cache_is_bounded(hosts):
    fresh = HostSecrets(Detector(), frozenset())
    for i in range(host_secrets.CACHE + 10):
        fresh.first(f"h{i}.example.com")
    assert len(fresh._found) <= host_secrets.CACHE + 1


# ---------------------------------------------------------------- through a real proxy

# The red team's token (P15: a made-up value) and the three forms that reached DNS.
TOKEN = "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"
P15_NAMES = [
    TOKEN.lower() + ".ok.test",
    TOKEN[:20] + "." + TOKEN[20:] + ".ok.test",
    "x" + TOKEN + ".ok.test",
    "x" + TOKEN.lower()[:20] + "." + TOKEN.lower()[20:] + ".ok.test",
]


def _connect(proxy, name: str, port: int = 443) -> str:
    """The proxy's whole answer to a CONNECT to ``name``."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {name}:{port} HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):  # a refusal closes the connection
            answer += chunk
    return answer.decode("latin-1")


def _refusals(proxy, count: int) -> list[dict]:
    events = []
    for _ in range(200):  # events are written as flows finish, maybe just after the answers
        events = [e for e in proxy.audit() if e["reason"] == "credential"]
        if len(events) >= count:
            break
        time.sleep(0.05)
    return events


@pytest.mark.parametrize("front", ["on", "off"])
def test_p15_names_are_refused_before_dns(proxy_factory, curl_path, tmp_path, dns_server, front):
    # ok.test is allowed (and on passthrough: the front's road) and resolvable; each name is
    # refused as a credential in the host name, by CONNECT and in absolute form, and the DNS
    # server the proxy uses was never asked about it.
    dns_server.answers["ok.test"] = ["127.0.0.1"]
    env = {"EGRESS_PASSTHROUGH_FRONT": "off"} if front == "off" else None
    proxy = proxy_factory('allow = ["ok.test"]\npassthrough = ["ok.test"]\nallow_private = ["ok.test"]\n',
                          "--dns-server", f"127.0.0.1:{dns_server.port}", names=[], env=env)
    for name in P15_NAMES:
        head = _connect(proxy, name)
        assert head.startswith("HTTP/1.1 403") and "reason=credential" in head, (name, head)
        assert "github-token in the host name" in head
        result = run_curl(curl_path, proxy, f"http://{name}/", "-i", home=tmp_path)
        out = result.stdout.decode()
        assert " 403 " in out.splitlines()[0], (name, out)
        assert "reason=credential" in out and "github-token in the host name" in out
    events = _refusals(proxy, 2 * len(P15_NAMES))
    assert len(events) == 2 * len(P15_NAMES)
    assert {e["detail"] for e in events} == {"github-token in the host name"}
    asked = {name.lower() for name, _ in dns_server.queries}
    assert asked.isdisjoint(name.lower() for name in P15_NAMES), dns_server.queries


def test_a_refusal_never_shows_the_token(proxy_factory, curl_path, tmp_path, dns_server):
    proxy = proxy_factory('allow = ["ok.test"]\n', "--dns-server", f"127.0.0.1:{dns_server.port}", names=[])
    for name in P15_NAMES:
        head = _connect(proxy, name)
        out = run_curl(curl_path, proxy, f"http://{name}/", "-i", home=tmp_path).stdout.decode()
        for text in (head, out):
            assert TOKEN.lower()[4:20] not in text.lower() and TOKEN.lower()[24:] not in text.lower(), text
    for event in _refusals(proxy, 2 * len(P15_NAMES)):
        assert event["host"] == "[redacted:github-token].ok.test" or event["host"].startswith("x[redacted:"), event


def test_a_mixed_case_token_in_absolute_form_is_refused_before_dns(proxy_factory, curl_path, tmp_path, dns_server):
    # A format whose one-case form is not the token (AIza: a short word-like prefix) is found in
    # the name as the client wrote it; by CONNECT it is (test_a_token_glued_or_split_is_found).
    dns_server.answers["ok.test"] = ["127.0.0.1"]
    proxy = proxy_factory('allow = ["ok.test"]\n', "--dns-server", f"127.0.0.1:{dns_server.port}", names=[])
    key = next(token for kind, token, _ in SAMPLES if kind == "google-api-key")
    names = [key + ".ok.test", "x" + key + ".ok.test", key[:20] + "." + key[20:] + ".ok.test"]
    for name in names:
        assert "reason=credential" in _connect(proxy, name)
        out = run_curl(curl_path, proxy, f"http://{name}/", "-i", home=tmp_path).stdout.decode()
        assert " 403 " in out.splitlines()[0] and "google-api-key in the host name" in out, (name, out)
    asked = {name.lower() for name, _ in dns_server.queries}
    assert asked.isdisjoint(name.lower() for name in names), dns_server.queries
