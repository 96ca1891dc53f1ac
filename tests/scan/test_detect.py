"""The credential detector (egress.scan.detect): every format in several placements, the close
misses that must pass untouched, stored secrets, streams, and content decoding.

All token values are made up here from a seeded random source: right prefix, length and
alphabet, never a real secret.
"""

from __future__ import annotations

import base64
import gzip
import json
import random
import re
import string
import textwrap
import urllib.parse
import zlib

import brotli
import pytest
import zstandard

from egress.scan import detect
from egress.scan.decode import ContentDecoder, WindowTooLarge
from egress.scan.detect import (
    KINDS,
    MIN_SECRET_LENGTH,
    RULES,
    Detector,
    Finding,
    StreamRedactor,
    UndecodableBody,
    decode_content,
    is_secret_name,
)

R = random.Random(20260101)
B62 = string.ascii_letters + string.digits
B64U = B62 + "_-"
B64 = B62 + "+/"
HEX = "0123456789abcdef"
UPPER_DIGITS = string.ascii_uppercase + string.digits
BASE32 = string.ascii_uppercase + "234567"  # AWS writes key ids in it
DET = Detector()


def rnd(n: int, alphabet: str = B62) -> str:
    return "".join(R.choice(alphabet) for _ in range(n))


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt() -> str:
    header = b64u(b'{"alg":"HS256","typ":"JWT"}')
    payload = b64u(json.dumps({"sub": rnd(12), "iat": 1767225600}).encode())
    return f"{header}.{payload}.{rnd(43, B64U)}"


def pem(label: str = "RSA PRIVATE KEY") -> str:
    body = base64.b64encode(R.randbytes(600)).decode()
    lines = "\n".join(body[i:i + 64] for i in range(0, len(body), 64))
    return f"-----BEGIN {label}-----\n{lines}\n-----END {label}-----"


def discord() -> str:
    user_id = "1" + rnd(17, string.digits)
    return f"{b64u(user_id.encode())}.{rnd(6, B64U)}.{rnd(38, B64U)}"


# (kind, text placed in the data, the secret inside it (the expected span); None = all of it)
CASES: list[tuple[str, str, str | None]] = [
    ("github-token", "ghp_" + rnd(36), None),
    ("github-token", "gho_" + rnd(36), None),
    ("github-token", "ghu_" + rnd(36), None),
    ("github-token", "ghs_" + rnd(36), None),
    ("github-token", "ghr_" + rnd(36), None),
    ("github-token", "github_pat_" + rnd(22) + "_" + rnd(59), None),
    ("gitlab-token", "glpat-" + rnd(20, B64U), None),
    ("gitlab-token", "glpat-" + rnd(36, B64U) + ".01" + rnd(7, string.ascii_lowercase + string.digits), None),
    ("gitlab-token", "gldt-" + rnd(20, B64U), None),
    ("gitlab-token", "glrt-" + rnd(20, B64U), None),
    ("aws-access-key-id", "AKIA" + rnd(16, "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"), None),
    ("aws-access-key-id", "ASIA" + rnd(16, "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"), None),
    ("aws-secret-access-key", "aws_secret_access_key = {}", "Ab1/" + rnd(36, B64)),
    ("aws-secret-access-key", '"SecretAccessKey": "{}"', "cD2+" + rnd(36, B64)),
    ("aws-bedrock-key", "ABSK" + rnd(132, B64), None),
    ("slack-token", f"xoxb-{rnd(12, string.digits)}-{rnd(13, string.digits)}-{rnd(24)}", None),
    ("slack-token", f"xoxp-{rnd(12, string.digits)}-{rnd(12, string.digits)}-{rnd(13, string.digits)}-{rnd(32, HEX)}",
     None),
    ("slack-token", f"xapp-1-A{rnd(10, UPPER_DIGITS)}-{rnd(13, string.digits)}-{rnd(64, HEX)}", None),
    ("slack-webhook", "https://hooks.slack.com/{}",
     f"services/T{rnd(10, UPPER_DIGITS)}/B{rnd(10, UPPER_DIGITS)}/{rnd(24)}"),
    ("stripe-secret-key", "sk_live_" + rnd(99), None),
    ("stripe-secret-key", "rk_live_" + rnd(24), None),
    ("openai-api-key", "sk-proj-" + rnd(74, B64U) + "T3BlbkFJ" + rnd(74, B64U), None),
    ("openai-api-key", "sk-svcacct-" + rnd(74, B64U) + "T3BlbkFJ" + rnd(74, B64U), None),
    ("openai-api-key", "sk-" + rnd(20) + "T3BlbkFJ" + rnd(20), None),
    ("anthropic-api-key", "sk-ant-api03-" + rnd(93, B64U) + "AA", None),
    ("anthropic-api-key", "sk-ant-admin01-" + rnd(93, B64U) + "AA", None),
    ("anthropic-oauth-token", "sk-ant-oat01-" + rnd(95, B64U), None),
    ("google-api-key", "AIzaSy" + rnd(33, B64U), None),
    ("google-oauth-secret", "GOCSPX-" + rnd(28, B64U), None),
    ("google-oauth-token", "ya29." + rnd(160, B64U), None),
    ("npm-token", "npm_" + rnd(36), None),
    ("pypi-token", "pypi-AgEIcHlwaS5vcmc" + rnd(160, B64U), None),
    ("pypi-token", "pypi-AgENdGVzdC5weXBpLm9yZw" + rnd(160, B64U), None),
    ("huggingface-token", "hf_" + rnd(34, string.ascii_letters), None),
    ("sendgrid-api-key", f"SG.{rnd(22, B64U)}.{rnd(43, B64U)}", None),
    ("twilio-auth-token", f"AC{rnd(32, HEX)}:{{}}", rnd(32, HEX)),
    ("twilio-auth-token", f"SK{rnd(32, HEX)}:{{}}", rnd(32)),
    ("digitalocean-token", "dop_v1_" + rnd(64, HEX), None),
    ("shopify-token", "shpat_" + rnd(32, HEX), None),
    ("databricks-token", "dapi" + rnd(32, HEX), None),
    ("vault-token", "hvs." + rnd(95, B64U), None),
    ("terraform-token", rnd(14, HEX) + ".atlasv1." + rnd(67, string.ascii_lowercase + string.digits), None),
    ("discord-bot-token", discord(), None),
    ("telegram-bot-token", f"{rnd(10, string.digits)}:AA{rnd(33, B64U)}", None),
    ("jwt", jwt(), None),
    ("private-key", pem(), None),
    ("private-key", pem("PRIVATE KEY"), None),
    ("private-key", pem("OPENSSH PRIVATE KEY"), None),
    ("private-key", pem("EC PRIVATE KEY"), None),
    ("azure-storage-key",
     "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={};EndpointSuffix=core.windows.net",
     base64.b64encode(R.randbytes(64)).decode()),
    ("azure-client-secret", rnd(3) + "8Q~" + rnd(34, B62 + "_~.-"), None),
    ("azure-devops-pat", rnd(76) + "AZDO" + rnd(4), None),
    ("url-password", "https://deploy:{}@registry.example.com/v2/", rnd(20)),
    ("url-password", "postgres://app:{}@db.internal:5432/main", "S3cr" + rnd(12)),
    ("age-secret-key", "AGE-SECRET-KEY-1" + rnd(58, "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L"), None),
    ("groq-api-key", "gsk_" + rnd(52), None),
    ("linear-api-key", "lin_api_" + rnd(40), None),
    ("sentry-token", "sntryu_" + rnd(64, HEX), None),
    ("postman-api-key", f"PMAK-{rnd(24, HEX)}-{rnd(34, HEX)}", None),
    ("heroku-api-key", "HRKU-AA" + rnd(58, B64U), None),
    ("grafana-token", f"glsa_{rnd(32)}_{rnd(8, HEX)}", None),
    ("doppler-token", "dp.pt." + rnd(43), None),
    ("atlassian-api-token", "ATATT3" + rnd(186, B64U), None),
    ("alibaba-access-key-id", "LTAI" + rnd(20), None),
    ("square-token", "sq0atp-" + rnd(22, B64U), None),
    ("perplexity-api-key", "pplx-" + rnd(48), None),
    ("notion-token", "ntn_" + rnd(46), None),
    ("replicate-api-token", "r8_" + rnd(37), None),
    ("supabase-token", "sbp_" + rnd(40, HEX), None),
    ("newrelic-api-key", "NRAK-" + rnd(27, UPPER_DIGITS), None),
]


def case_id(case) -> str:
    return case[0]


def materialise(case) -> tuple[str, str, str]:
    """(kind, placed text, secret)."""
    kind, text, secret = case
    if secret is None:
        return kind, text, text
    return kind, text.replace("{}", secret), secret


def test_every_kind_has_a_positive_case():
    assert {c[0] for c in CASES} == set(KINDS) == set(RULES)
    assert len({d.split(":")[0] for d in KINDS.values()}) >= 30  # providers


def kinds(findings: list[Finding]) -> list[str]:
    return [f.kind for f in findings]


def assert_found(data: bytes, kind: str, span: tuple[int, int] | None = None):
    findings = DET.scan(data)
    assert kind in kinds(findings), (kind, data[:200], findings)
    if span is not None:
        assert any(f.kind == kind and (f.start, f.end) == span for f in findings), (span, findings)
    redacted = DET.redact(data)
    assert f"[redacted:{kind}]".encode() in redacted
    return findings


# ------------------------------------------------------------------- placements


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_raw(case):
    kind, text, secret = materialise(case)
    data = f"before {text} after\n".encode()
    start = data.index(secret.encode())
    assert_found(data, kind, (start, start + len(secret)))
    assert secret.encode() not in DET.redact(data)


@pytest.mark.parametrize("case", [c for c in CASES if "\n" not in materialise(c)[1]], ids=case_id)
def test_in_url_query(case):
    # Multi-line values (PEM keys) reach a URL only percent-encoded: see test_percent_encoded.
    kind, text, secret = materialise(case)
    data = f"GET /v1/items?page=2&token={text}&sort=asc HTTP/1.1".encode()
    start = data.index(secret.encode())
    assert_found(data, kind, (start, start + len(secret)))


def json_escape_hard(text: str) -> str:
    """JSON string body of ``text`` as a strict encoder writes it, with "/" as "\\/" and
    one character in the middle as a \\u escape."""
    body = json.dumps(text)[1:-1].replace("/", "\\/")
    mid = len(body) // 2
    while not body[mid].isalnum():
        mid += 1
    return body[:mid] + "\\u%04x" % ord(body[mid]) + body[mid + 1:]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_in_json_with_escapes(case):
    kind, text, secret = materialise(case)
    escaped_text = json_escape_hard(text)
    data = ('{"name": "ci", "config": "' + escaped_text + '", "n": 3}').encode()
    assert_found(data, kind)
    redacted = DET.redact(data)
    # nothing of the secret survives in the escaped body
    assert json.loads(redacted.decode()).get("config", "").find(secret) < 0


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_percent_encoded(case):
    kind, text, secret = materialise(case)
    quoted = urllib.parse.quote(text, safe="")
    i = len(quoted) // 2
    while not quoted[i].isalnum() or quoted[i - 1] == "%" or quoted[i - 2] == "%":
        i += 1
    quoted = quoted[:i] + "%%%02X" % ord(quoted[i]) + quoted[i + 1:]  # one letter escaped for good measure
    data = f"grant_type=client&value={quoted}&scope=read".encode()
    q_start = data.index(quoted.encode())
    if secret == text:  # the whole value: the finding spans exactly the encoded text
        assert_found(data, kind, (q_start, q_start + len(quoted)))
    else:
        findings = assert_found(data, kind)
        assert all(q_start <= f.start and f.end <= q_start + len(quoted) for f in findings if f.kind == kind)
    assert urllib.parse.unquote(DET.redact(data).decode()).find(secret) < 0


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_basic_auth(case):
    kind, text, secret = materialise(case)
    plain = f"x-access-token:{text}".encode()
    credentials = base64.b64encode(plain).decode()
    data = f"Authorization: Basic {credentials}".encode()
    b_start = data.index(credentials.encode())
    # the base64 characters that carry the secret's bits
    ds = plain.index(secret.encode())
    de = ds + len(secret.encode())
    assert_found(data, kind, (b_start + ds * 4 // 3, b_start + -(-de * 4 // 3)))


def stream_scan(scanner, chunks) -> list[Finding]:
    """Feed ``chunks``; check the held-back rule after every feed: nothing a later finding
    starts in has been settled (a proxy relays settled bytes)."""
    found, settled = [], []
    for chunk in chunks:
        found += scanner.feed(chunk)
        settled.append((scanner.settled, len(found)))
    found += scanner.finish()
    for mark, reported in settled:
        assert all(f.start >= mark for f in found[reported:]), (mark, found[reported:])
    return found


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_split_across_stream_chunks(case):
    kind, text, secret = materialise(case)
    # enough before it that the scanner scans (and settles) before the token is complete
    data = f"{rnd(DET.overlap + 3000, string.ascii_lowercase + ' ')} {text} tail".encode()
    start = data.index(secret.encode())
    cut = start + len(secret) // 2
    found = stream_scan(DET.stream(), [data[:cut], data[cut:]])
    assert [tuple(f) for f in found] == [(kind, start, start + len(secret))]


def test_placements_beyond_the_table():
    token = "ghp_" + rnd(36)
    # Telegram in the URL path, GitHub token as a URL user, gitlab via oauth2 basic
    tg = f"{rnd(9, string.digits)}:AA{rnd(33, B64U)}"
    assert_found(f"https://api.telegram.org/bot{tg}/getMe".encode(), "telegram-bot-token")
    data = f"https://{token}@github.com/o/r.git".encode()
    assert_found(data, "github-token", (8, 48))
    data = f"https://x-access-token:{token}@github.com/o/r.git".encode()
    assert kinds(DET.scan(data)) == ["github-token"]  # the specific kind wins over url-password
    glpat = "glpat-" + rnd(20, B64U)
    assert_found(b"Authorization: Basic " + base64.b64encode(f"oauth2:{glpat}".encode()), "gitlab-token")
    # a PEM key inside a service-account JSON (\n escapes), and hex-encoded tokens
    key = pem("PRIVATE KEY")
    assert_found(json.dumps({"type": "service_account", "private_key": key}).encode(), "private-key")
    assert_found(b"payload=" + token.encode().hex().encode(), "github-token")
    # two layers: base64 of a percent-encoded form, base64 of JSON with a \u escape, and
    # percent-encoded base64; URL-safe base64; JSON-escaped base64
    escaped = token[:10] + "%%%02X" % ord(token[10]) + token[11:]
    inner = base64.b64encode(f"user=me&token={escaped}".encode())
    assert_found(b"data: " + inner, "github-token")
    inner = base64.b64encode(('{"t": "' + token[:10] + "\\u%04x" % ord(token[10]) + token[11:] + '"}').encode())
    assert_found(b"data: " + inner, "github-token")
    inner = urllib.parse.quote(base64.b64encode(b"\x00\x01" + token.encode()).decode(), safe="")
    assert_found(b"q=" + inner.encode(), "github-token")
    assert_found(b'{"blob":"' + base64.b64encode(b"k = " + token.encode() + b"\n" * 40).replace(b"/", b"\\/") + b'"}',
                 "github-token")
    assert_found(b"t=" + base64.urlsafe_b64encode(b"\xff\xfe" + token.encode()), "github-token")
    # a base64 file body wrapped at 76 columns (MIME), token across a line break
    blob = base64.encodebytes(R.randbytes(40) + b" " + token.encode() + b" " + R.randbytes(200))
    assert_found(b"Content-Transfer-Encoding: base64\r\n\r\n" + blob.replace(b"\n", b"\r\n"), "github-token")
    # AWS secret key beside its id, and the pair in a credentials CSV
    akia = "AKIA" + rnd(16, BASE32)
    secret = "Zz9/" + rnd(36, B64)
    found = DET.scan(f"User,{akia},{secret}\n".encode())
    assert kinds(found) == ["aws-access-key-id", "aws-secret-access-key"]
    escaped = secret.replace("/", "\\/")
    found = DET.scan(f'{{"AccessKeyId": "{akia}", "SecretAccessKey": "{escaped}"}}'.encode())
    assert kinds(found) == ["aws-access-key-id", "aws-secret-access-key"]
    # multipart form body: text once decoded
    body = (f"--xyz\r\nContent-Disposition: form-data; name=\"token\"\r\n\r\n{token}\r\n--xyz--\r\n").encode()
    assert_found(body, "github-token")


# ----------------------------------------------------------------- close misses

NEGATIVES = [
    "ghp_" + "x" * 36,
    "ghp_" + "X" * 36,
    "ghp_1234567890abcdefghijklmnopqrstuvwxyz",
    "ghp_<your token>",
    "${GITHUB_TOKEN}",
    "AKIAXXXXXXXXXXXXXXXX",
    "AKIAIOSFODNN7EXAMPLE",
    "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "your-token-here",
    "Authorization: Bearer <token>",
    "sk-ant-api03-...",
    "sk_live_" + "0" * 24,
    "sk-proj-" + "x" * 100,
    "xoxb-your-token",
    "https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX",
    "use a ghp_ token, or a github_pat_ one; AKIA ids and sk- keys, xoxb- and xapp- too",
    "a JWT starts with eyJ and a key block with -----BEGIN PRIVATE KEY----- and ends with -----END PRIVATE KEY-----",
    "-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----",
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA...\n-----END RSA PRIVATE KEY-----",
    "123e4567-e89b-12d3-a456-426614174000",
    "commit 3f786850e387550fdab836ed7e6dc881de23001b",
    "sha256:" + "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    'ETag: W/"5d41402abc4b2a76b9719d911017c592"',
    "integrity sha512-" + base64.b64encode(R.randbytes(64)).decode(),
    "pk_live_" + rnd(24),
    "gho_" + rnd(36, string.ascii_lowercase),  # one case: not a random token body
    "hf_" + rnd(30, string.ascii_letters) + "7x9Q",  # Hugging Face tokens are letters only
    "MTx" + rnd(21, B64U) + "." + rnd(6, B64U) + "." + rnd(38, B64U),  # Discord-shaped, no user id
    "npm_" + rnd(36, HEX),
    "pk_test_" + rnd(99),
    "postgres://user:password@localhost:5432/db",
    "redis://:${REDIS_PASSWORD}@cache:6379",
    "https://user@example.com/path",
    "https://example.com:8443/api?x=1",
    "http://localhost:8080@evil.example/",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI" + rnd(43, B64) + " me@laptop",
    "https://api.example.com/v1/users/" + rnd(24, HEX) + "/repos?per_page=100",
    "x-request-id: " + rnd(32, HEX),
    "Cookie: session=" + rnd(64, HEX),
    "eyJub3QiOiAiYSBqd3QifQ== is base64 JSON, not a JWT",
]


def certificate() -> str:
    body = base64.b64encode(R.randbytes(900)).decode()
    lines = "\n".join(body[i:i + 64] for i in range(0, len(body), 64))
    return f"-----BEGIN CERTIFICATE-----\n{lines}\n-----END CERTIFICATE-----\n" \
           f"-----BEGIN PUBLIC KEY-----\n{lines[:400]}\n-----END PUBLIC KEY-----\n"


def png_data_uri() -> str:
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + R.randbytes(3000)
    return '{"avatar": "data:image/png;base64,' + base64.b64encode(png).decode() + '"}'


@pytest.mark.parametrize("text", NEGATIVES + [certificate(), png_data_uri()], ids=lambda t: t[:40])
def test_close_misses_pass_untouched(text):
    for data in (text.encode(), urllib.parse.quote(text).encode(), json.dumps({"v": text}).encode(),
                 base64.b64encode(text.encode())):
        assert DET.scan(data) == [], (data[:120], DET.scan(data))
        assert DET.redact(data) == data


@pytest.mark.parametrize("case", [c for c in CASES if c[2] is None and c[0] not in ("private-key", "url-password")],
                         ids=case_id)
def test_inside_a_longer_run_of_its_alphabet(case):
    kind, text, _ = materialise(case)
    alphabet_char = "Q"
    assert DET.scan(f"{alphabet_char}{alphabet_char}{text} ".encode()) == [] or kind == "azure-devops-pat"
    if kind not in ("stripe-secret-key", "openai-api-key", "gitlab-token", "google-oauth-token", "pypi-token",
                    "vault-token", "atlassian-api-token", "aws-bedrock-key", "grafana-token", "jwt", "slack-token",
                    "telegram-bot-token", "discord-bot-token", "anthropic-oauth-token", "terraform-token",
                    "sendgrid-api-key", "doppler-token", "postman-api-key"):
        # fixed length: one more character of the alphabet and it is not that token
        assert DET.scan(f" {text}{alphabet_char}7 ".encode()) == [], kind


def test_clean_traffic_has_no_findings():
    parts = []
    for i in range(300):
        parts.append(json.dumps({
            "id": "%08x-%04x-%04x-%04x-%012x" % (R.getrandbits(32), R.getrandbits(16), R.getrandbits(16),
                                                 R.getrandbits(16), R.getrandbits(48)),
            "sha": "%040x" % R.getrandbits(160), "digest": "sha256:%064x" % R.getrandbits(256),
            "url": f"https://api.example.com/v1/items/{i}?page=2&per_page=50",
            "thumb": base64.b64encode(R.randbytes(300)).decode(),
            "text": " ".join(R.choice(["token", "secret", "key", "the", "ghp", "AKIA", "sk", "eyJ"])
                             for _ in range(20)),
        }).replace("/", "\\/"))
        parts.append(f"GET /search?q=caf%C3%A9+{i}&lang=fr HTTP/1.1 host=example.com etag=\"{R.getrandbits(128):x}\"")
    data = "\n".join(parts).encode()
    assert DET.scan(data) == []


def test_checksum_strengthens_but_is_not_required():
    from egress.scan.detect import _B62_DIGITS, _crc_ok
    body = "aaaaaa" + rnd(24)  # a run of one character: implausible on its own
    crc = zlib.crc32(body.encode())
    digits = ""
    while crc:
        crc, r = divmod(crc, 62)
        digits = chr(_B62_DIGITS[r]) + digits
    token = "ghp_" + body + digits.rjust(6, "0")
    assert _crc_ok(token.encode(), 4)
    assert kinds(DET.scan(token.encode())) == ["github-token"]
    assert DET.scan(("ghp_" + body + "Zz9Qq1").encode()) == []
    assert kinds(DET.scan(("ghp_" + rnd(36)).encode())) == ["github-token"]  # random checksum: still found


# ---------------------------------------------------------------- stored secrets


SECRET = "s3cr3t-Value/with+chars&=" + rnd(8)


@pytest.mark.parametrize("encode", [
    lambda s: s,
    lambda s: urllib.parse.quote(s, safe=""),
    lambda s: urllib.parse.quote_plus(s),
    lambda s: base64.b64encode(s.encode()).decode(),
    lambda s: base64.b64encode(f"deploy:{s}".encode()).decode(),
    lambda s: json.dumps(s)[1:-1].replace("/", "\\/"),
    lambda s: json.dumps(s, ensure_ascii=True)[1:-1].replace("s", "\\u0073"),
    lambda s: s.encode().hex(),
], ids=["raw", "percent", "percent-plus", "base64", "basic", "json", "json-unicode", "hex"])
def test_stored_secret_found_through_encodings(encode):
    det = Detector([("DEPLOY_TOKEN", SECRET)])
    data = f'POST /x HTTP/1.1\r\nAuthorization: Basic {encode(SECRET)}\r\n\r\n{{"v": "{encode(SECRET)}"}}'.encode()
    found = det.scan(data)
    assert [f.kind for f in found] == ["DEPLOY_TOKEN", "DEPLOY_TOKEN"], found
    redacted = det.redact(data)
    assert b"[redacted:DEPLOY_TOKEN]" in redacted
    assert SECRET.encode() not in redacted and encode(SECRET).encode() not in redacted


@pytest.mark.parametrize("secret", [
    "9f2c4e7a1b3d5f60718293a4b5c6d7e8f9012345",  # hex: leads with a digit
    "QwErTyUiOpAsDfGhJkLz",  # letters only: leads with a letter, in both cases
    "s3cr3t_Value-With.Punct",
], ids=["hex", "letters", "punctuated"])
@pytest.mark.parametrize("change", [str.upper, str.lower, str.swapcase], ids=["upper", "lower", "swapcase"])
def test_stored_secrets_match_in_any_case(secret, change):
    det = Detector([("MY_TOKEN", secret)])
    shown = change(secret)
    for data in (f"x {shown} y", f"q={urllib.parse.quote(shown)}", base64.b64encode(f"u:{shown}".encode()).decode(),
                 f"{shown}.attacker.example"):
        assert kinds(det.scan(data.encode())) == ["MY_TOKEN"], data


def test_a_run_of_key_headers_ends_each_block_at_the_next():
    # A key block ends at the next BEGIN line at the latest: each header of a run looking
    # 16 KiB ahead (to a far END line) was quadratic (30 KB of gzip: a 19 s scan).
    key = pem()
    headers = "-----BEGIN RSA PRIVATE KEY-----\n" * 2000
    found = DET.scan((headers + key).encode())
    assert [tuple(f) for f in found] == [("private-key", len(headers), len(headers) + len(key))]
    assert DET.scan(headers.encode()) == []


def test_stored_secret_label_wins_and_short_values_refused():
    token = "ghp_" + rnd(36)
    det = Detector([("placeholder:GITHUB_TOKEN", token)])
    assert kinds(det.scan(f"x {token} y".encode())) == ["placeholder:GITHUB_TOKEN"]
    assert DET.scan(b"short") == []
    with pytest.raises(ValueError):
        Detector([("PIN", "1" * (MIN_SECRET_LENGTH - 1))])
    assert Detector([("PIN", "1" * MIN_SECRET_LENGTH)]).scan(b"a 11111111 b") == [Finding("PIN", 2, 10)]


def test_scan_text_indexes_characters():
    token = "ghp_" + rnd(36)
    text = f"héllo ✓ {token} end"
    (f,) = DET.scan_text(text)
    assert text[f.start:f.end] == token
    (f,) = DET.scan_text(f"café {token}")
    assert f.start == 5


def test_findings_are_sorted_and_never_overlap():
    token = "ghp_" + rnd(36)
    data = f"{token} https://u:{token}@h.example {base64.b64encode(token.encode()).decode()}".encode()
    found = DET.scan(data)
    assert found == sorted(found, key=lambda f: f.start)
    assert all(a.end <= b.start for a, b in zip(found, found[1:]))
    for f in found:
        assert token.encode() not in repr(f).encode()


# ------------------------------------------------------------- the prefilter


def _url_password_reference(data: bytes) -> list[tuple[int, int]]:
    """Where the url-password rule matches, found without the prefilter: its full pattern
    tried at every "://" in turn, then its check."""
    kind, _, pattern, _, group, check = next(row for row in detect._TABLE if row[0] == "url-password")
    spans, pos = [], data.find(b"://")
    while pos >= 0:
        m = pattern.match(data, pos)
        if m is not None and check(m):
            spans.append(m.span(group))
        pos = data.find(b"://", pos + 1)
    return spans


def _urls(r: random.Random) -> str:
    user = rnd(r.randrange(0, 12), string.ascii_lowercase)
    secret = rnd(r.randrange(1, 30), B62 + "-_.~!$&'()*+,;=%")
    host = r.choice(["db.internal", "example.com", "10.0.0.1", "[::1]", "h", "registry.example.com:5000"])
    return r.choice([
        f"https://{user}:{secret}@{host}/path?q=1",  # userinfo with a password
        f"https://{host}/path?next=http://{user}:{secret}@{host}",
        f"https://{host}:8443/{user}@{secret}",  # '@' after the path: no userinfo
        f"ftp://{user}@{host}/",  # no password
        f"http://{user}:{secret}",  # no '@'
        f"https://{user}:password@{host}/",  # a placeholder
        f"ssh://{user}:{secret}@-not-a-host",
        f'"url": "https://{host}/v1/items?page=2", "ok": true',
        f"svn+ssh://{user}:{secret}@{host}:22@{host}",
    ])


@pytest.mark.parametrize("seed", range(4))
def test_url_password_prefilter_finds_exactly_what_its_pattern_finds(seed):
    # The anchor for url-password carries the rule's whole pattern as a look-ahead, so the
    # prefilter turns down "://" without userinfo in C: it must never drop a position
    # where the full pattern (and its check) would have matched, nor add one.
    r = random.Random(seed)
    parts = [materialise(c)[1] for c in CASES if c[0] == "url-password"]
    parts += [_urls(r) for _ in range(400)] + [rnd(r.randrange(0, 80), B62 + " :/@.") for _ in range(400)]
    r.shuffle(parts)
    data = " \n".join(parts).encode()
    found = [(f.start, f.end) for f in detect.Detector(formats=True)._scan(data, detect._MAX_DEPTH)
             if f.kind == "url-password"]
    assert sorted(found) == _url_password_reference(data)
    assert found  # the table and the generator do hold passwords


# ------------------------------------------------------------------------ streams


def stream_text() -> bytes:
    lines = []
    for i in range(120):
        kind, text, _ = materialise(CASES[i % len(CASES)])
        # filler in one case: a mixed-case 40-character word beside an AWS key id would
        # be that key's secret, which a stream cannot take back once emitted (documented)
        lines.append(f"{i} {rnd(R.randrange(0, 300), string.ascii_lowercase + string.digits + ' ')} {text} "
                     f"{rnd(40, ' abcdef')}")
    lines.append("export GITHUB_TOKEN=\"abc def 123\"")
    lines.append("API_KEY=plainvalue12 and NEXT_PAGE=3")
    return ("\n".join(lines) + "\n").encode()


def chunked(data: bytes, sizes) -> list[bytes]:
    out, i = [], 0
    for n in sizes:
        out.append(data[i:i + n])
        i += n
    out.append(data[i:])
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stream_scanner_agrees_with_one_shot(seed):
    data = stream_text()
    r = random.Random(seed)
    found = stream_scan(DET.stream(), chunked(data, [r.choice([1, 7, 100, 3000, 20000]) for _ in range(400)]))
    # the same findings, spans included: one that reaches the end of what was scanned
    # waits for more data instead of being reported short
    assert found == DET.scan(data)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("batch", [0, 65536, 262144])
def test_a_batched_stream_scanner_agrees_with_one_shot_and_scans_less(seed, batch):
    # The credential guard's body scanner gathers 256 KiB before scanning (SCAN_BATCH):
    # the same findings, each byte scanned 1 + overlap/batch times instead of ~1.25.
    det = CountingDetector()
    data = stream_text() * 40  # ~1 MiB
    r = random.Random(seed)
    found = stream_scan(det.stream(batch), chunked(data, [r.choice([100, 16384, 65536]) for _ in range(60)]))
    assert found == DET.scan(data)
    assert det.scanned <= len(data) * (1 + det.overlap / max(batch, det.overlap)) + det.overlap + 65536


def test_a_batched_stream_scanner_settles_at_most_a_batch_behind():
    scanner = DET.stream(262144)
    fed = 0
    for _ in range(20):
        scanner.feed(b"plain words and digits 0123456789 " * 2000)  # 68 KB a chunk
        fed += 68000
        assert fed - scanner.settled <= 262144 + DET.overlap + 68000
    scanner.finish()
    assert scanner.settled == fed


@pytest.mark.parametrize("seed", range(3))
def test_the_last_run_break_is_found_as_a_whole_translate_finds_it(seed):
    # _last_break looks back 4 KiB at a time; runs longer than that, breaks at either end
    # of a window and none at all must give what translating everything before gives.
    from egress.scan.decode import RUN_TABLE

    r = random.Random(seed)
    pieces = [rnd(r.choice([1, 50, 4095, 4096, 4097, 9000]), B62 + "+/") + r.choice([" ", "\n", '"', ""])
              for _ in range(30)]
    buf = "".join(pieces).encode()
    for end in sorted({0, 1, len(buf)} | {r.randrange(len(buf) + 1) for _ in range(200)}):
        assert detect._last_break(buf, end) == buf[:end].translate(RUN_TABLE).rfind(b" ")


class CountingDetector(Detector):
    """A real detector that also counts the bytes it is asked to scan."""

    scanned = 0

    def scan(self, data):
        self.scanned += len(data)
        return super().scan(data)


@pytest.mark.parametrize("size", [1, 7, 4096, 65536])
def test_stream_scanner_is_linear_in_the_bytes(size):
    # Re-scanning the carried window for every chunk made 34 KB of one-byte chunks cost
    # two minutes of CPU: each byte may be scanned about twice, whatever the chunk size.
    det = CountingDetector()
    data = stream_text() * 3
    found = stream_scan(det.stream(), chunked(data, [size] * (len(data) // size)))
    assert det.scanned <= 2.1 * len(data) + det.overlap
    assert found == DET.scan(data)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stream_redactor_equals_one_shot(seed):
    data = stream_text()
    r = random.Random(seed)
    for env in (False, True):
        redactor = StreamRedactor(DET, env_assignments=env)
        out = b"".join(redactor.feed(c) for c in chunked(data, [r.choice([1, 5, 64, 999, 5000]) for _ in range(400)]))
        out += redactor.finish()
        one_shot = StreamRedactor(DET, env_assignments=env)
        expected = one_shot.feed(data) + one_shot.finish()
        assert out == expected
        if not env:
            assert out == DET.redact(data)


def test_stream_scanner_holds_back_a_token_until_it_is_reported():
    akia = "AKIA" + rnd(16, BASE32)
    pad = rnd(DET.overlap, string.ascii_lowercase + " ").encode()
    scanner = DET.stream()
    assert scanner.feed(pad + b" id: " + akia[:10].encode()) == []
    start = len(pad) + 5
    assert scanner.settled <= start  # scanned, but not far enough to be sure of what follows
    assert scanner.feed(akia[10:].encode()) == []  # too little new data to scan again
    assert scanner.settled <= start
    assert scanner.finish() == [Finding("aws-access-key-id", start, start + 20)]
    assert scanner.settled == start + 20


def test_stream_scanner_waits_for_a_token_that_may_grow():
    # AKIA + 16 at the end of a scan is no token if the next chunk continues the run
    pad = rnd(DET.overlap + 100, string.ascii_lowercase + " ").encode()
    scanner = DET.stream()
    assert scanner.feed(pad + b" AKIA" + rnd(16, BASE32).encode()) == []
    assert scanner.feed(b"MORE" + b" " * DET.overlap) == [] and scanner.finish() == []


def test_stream_scanner_window_start_is_not_a_boundary():
    # "zzz…AKIA…" is no token (part of a longer run); when the carried window starts
    # right at "AKIA", it must not become one.
    overlap = DET.overlap
    chunk = b"z" * 1000 + b"AKIA" + rnd(16, BASE32).encode() + b" " + b"y" * (overlap - 21)
    scanner = DET.stream()
    assert scanner.feed(chunk) + scanner.feed(b"\n") + scanner.finish() == []


def test_stream_scanner_keeps_base64_aligned_across_chunks():
    token = "ghp_" + rnd(36)
    blob = base64.b64encode(R.randbytes(40000) + f" {token} ".encode() + R.randbytes(3000))
    data = b'{"file": "' + blob + b'"}'
    for size in (7001, 10007, 65536):
        scanner = DET.stream()
        found = []
        for i in range(0, len(data), size):
            found += scanner.feed(data[i:i + size])
        found += scanner.finish()
        assert found == DET.scan(data) and [f.kind for f in found] == ["github-token"], size


def test_ties_go_to_stored_secrets_then_specific_kinds():
    from egress.scan.detect import _merge
    det = Detector([("MY_TOKEN", "ghp_" + rnd(36))])
    for order in ([Finding("url-password", 5, 45), Finding("github-token", 5, 45)],
                  [Finding("github-token", 5, 45), Finding("url-password", 5, 45)]):
        assert _merge(list(order), det._priority) == [Finding("github-token", 5, 45)]
        assert _merge(list(order) + [Finding("MY_TOKEN", 5, 45)], det._priority) == [Finding("MY_TOKEN", 5, 45)]
        assert _merge([Finding("MY_TOKEN", 5, 45)] + list(order), det._priority) == [Finding("MY_TOKEN", 5, 45)]
    # overlapping spans merge into one covering both, named after the longer
    assert _merge([Finding("jwt", 0, 10), Finding("github-token", 5, 40)], det._priority) == \
        [Finding("github-token", 0, 40)]


def test_stream_redactor_holds_back_little():
    token = "ghp_" + rnd(36)
    redactor = StreamRedactor(DET)
    assert redactor.feed(b"building...\n") == b"building...\n"  # a finished line goes out at once
    assert redactor.feed(b"progress 10% ") == b"progress 10% "
    assert redactor.feed(b"Enter token: ") == b"Enter token: "  # a prompt shows at once
    assert redactor.feed(token[:20].encode()) == b""  # could be the start of a token
    assert redactor.feed(token[20:].encode() + b" done\n") == b"[redacted:github-token] done\n"
    big = b"A" * (3 * DET.overlap)  # one endless word: held back at most `overlap` bytes
    out = redactor.feed(big)
    assert len(big) - len(out) <= DET.overlap
    assert out + redactor.finish() == big


def test_stream_redactor_env_assignments():
    redactor = StreamRedactor(DET)
    data = (b"GITHUB_TOKEN=abc123def\n"
            b"export API_KEY=\"with spaces inside\"\n"
            b"  declare -x DB_PASSWORD='p@ss w0rd'\n"
            b"env NPM_TOKEN=xyz789 npm publish\n"
            b"AWS_ACCESS_KEY_ID=notsecret PATH=/usr/bin HOME=/root\n"
            b"GITHUB_TOKEN=$GITHUB_TOKEN SECRET_KEY=${SECRET_KEY}\n")
    out = b"".join(redactor.feed(data[i:i + 3]) for i in range(0, len(data), 3)) + redactor.finish()
    assert out == (b"GITHUB_TOKEN=[redacted:env-secret]\n"
                   b"export API_KEY=\"[redacted:env-secret]\"\n"
                   b"  declare -x DB_PASSWORD='[redacted:env-secret]'\n"
                   b"env NPM_TOKEN=[redacted:env-secret] npm publish\n"
                   b"AWS_ACCESS_KEY_ID=notsecret PATH=/usr/bin HOME=/root\n"
                   b"GITHUB_TOKEN=$GITHUB_TOKEN SECRET_KEY=${SECRET_KEY}\n")
    plain = StreamRedactor(DET, env_assignments=False)
    assert plain.feed(b"GITHUB_TOKEN=abc123def\n") + plain.finish() == b"GITHUB_TOKEN=abc123def\n"


# ------------------------------------------------- what a terminal shows (red team N8)

TERMINAL_TOKEN = b"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"
# Inside a token, each of these leaves it whole on a terminal (or after a harness strips escape codes).
NOISE = {
    "SGR reset": b"\x1b[0m", "colours": b"\x1b[1;31m\x1b[39;49m", "cursor save": b"\x1b7", "charset": b"\x1b(B",
    "OSC title, BEL": b"\x1b]0;build\x07", "OSC hyperlink, ST": b"\x1b]8;;https://x.test/\x1b\\",
    "OSC 52 clipboard": b"\x1b]52;c;aGVsbG8=\x07", "DCS": b"\x1bPq#0\x1b\\", "APC": b"\x1b_Gi=1\x1b\\",
    "8-bit CSI": b"\xc2\x9b1m", "8-bit OSC": b"\xc2\x9d0;t\xc2\x9c", "backspace": b"X\x08", "two backspaces": b"ab\x08\x08",
    "carriage return": b"\r", "NUL": b"\x00", "BEL": b"\x07", "DEL": b"\x7f", "SO SI": b"\x0e\x0f",
    **{f"U+{c:04X}": chr(c).encode() for c in (0x00AD, 0x034F, 0x061C, 0x17B4, 0x180E, 0x200B, 0x200C, 0x200D, 0x200E,
                                               0x202E, 0x2060, 0x2063, 0x2066, 0xFE0F, 0xFEFF, 0xFFF9, 0xE0041, 0xE0100)},
}


def redacted(data: bytes, size: int) -> bytes:
    redactor = StreamRedactor(DET)
    return b"".join(redactor.feed(data[i:i + size]) for i in range(0, len(data), size)) + redactor.finish()


@pytest.mark.parametrize("noise", list(NOISE.values()), ids=list(NOISE))
def test_a_token_with_terminal_noise_inside_is_redacted_whole(noise):
    for at in (4, 10, 20, 39):
        data = b"tok " + TERMINAL_TOKEN[:at] + noise + TERMINAL_TOKEN[at:] + b" end \xe2\x94\x80\n"
        for size in (1, 2, 3, 7, 64, len(data)):  # a token split across reads, anywhere
            assert redacted(data, size) == b"tok [redacted:github-token] end \xe2\x94\x80\n", (at, size)


def test_noise_around_a_token_stays_and_noise_without_one_passes_byte_for_byte():
    coloured = b"\x1b[31m" + TERMINAL_TOKEN + b"\x1b[0m ok\n"
    assert redacted(coloured, 5) == b"\x1b[31m[redacted:github-token]\x1b[0m ok\n"
    title = b"\x1b]0;" + TERMINAL_TOKEN + b"\x07done\n"  # a title shows a token too
    assert redacted(title, 3) == b"\x1b]0;[redacted:github-token]\x07done\n"
    text = (b"\x1b[1;32mPASS\x1b[0m tests/a.py \x1b]8;;file:///a.py\x1b\\a.py\x1b]8;;\x1b\\ 50%\r100%\n"
            b"caf\xc3\xa9 \xc2\xb5s \xe2\x80\x9cquoted\xe2\x80\x9d ab\x08c \xe2\x80\x8b\n")
    for size in (1, 4, len(text)):
        assert redacted(text, size) == text


def test_a_coloured_prompt_still_shows_at_once():
    redactor = StreamRedactor(DET)
    assert redactor.feed(b"\x1b[1mEnter token:\x1b[0m ") == b"\x1b[1mEnter token:\x1b[0m "
    assert redactor.feed(b"\x1b[32mok\x1b[0m\n") == b"\x1b[32mok\x1b[0m\n"
    assert redactor.feed(TERMINAL_TOKEN[:12] + b"\x1b[0") == b""  # a token's start, an unfinished sequence
    assert redactor.feed(b"m" + TERMINAL_TOKEN[12:] + b"\n") == b"[redacted:github-token]\n"


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_noisy_stream_redacts_as_one_shot_whatever_the_reads(seed):
    # Noise anywhere (inside tokens, key blocks, NAME="value" assignments, between lines), read
    # in pieces of any size: the same output as all at once.
    r = random.Random(seed)
    noises = list(NOISE.values())
    pieces = []
    for line in stream_text().split(b"\n"):
        for _ in range(r.randrange(0, 4)):
            cut = r.randrange(0, len(line) + 1)
            line = line[:cut] + r.choice(noises) + line[cut:]
        pieces.append(line)
    data = b"\n".join(pieces)
    one_shot = StreamRedactor(DET)
    expected = one_shot.feed(data) + one_shot.finish()
    redactor = StreamRedactor(DET)
    out = b"".join(redactor.feed(c) for c in chunked(data, [r.choice([1, 5, 64, 999, 5000]) for _ in range(400)]))
    assert out + redactor.finish() == expected


# -------------------------------------------------------------------- env names


@pytest.mark.parametrize("name,secret", [
    ("GITHUB_TOKEN", True), ("github_token", True), ("AWS_SECRET_ACCESS_KEY", True), ("AWS_SESSION_TOKEN", True),
    ("OPENAI_API_KEY", True), ("DB_PASSWORD", True), ("MYSQL_ROOT_PASSWD", True), ("GOOGLE_CREDENTIALS", True),
    ("NPM_CONFIG__AUTH", True), ("GITLAB_PAT", True), ("CLIENT_SECRET", True), ("STRIPE_APIKEY", True),
    ("GITHUB_TOKEN_2", True), ("PASSWORD", True), ("API_KEY", True),
    ("AWS_ACCESS_KEY_ID", False), ("SSH_PUBLIC_KEY", False), ("STRIPE_PUBLISHABLE_KEY", False),
    ("RECAPTCHA_SITE_KEY", False), ("GPG_KEY", False), ("GPG_TTY", False), ("SSH_AUTH_SOCK", False),
    ("KEYBOARD_LAYOUT", False), ("PATH", False), ("LD_LIBRARY_PATH", False), ("TOKEN_URL", False),
    ("SSL_KEY_FILE", False), ("HOME", False), ("TERM", False), ("", False),
])
def test_is_secret_name(name, secret):
    assert is_secret_name(name) is secret


# --------------------------------------------- forms inside a run, and quoted-printable
#
# Red team 2026-12-07: hex was decoded only when it was a whole run (P1), base64 only from
# its run's first character (P2), and quoted-printable not at all (P4). Each form here, for a
# token format and for a stored secret; the span is the encoded text that carries the value.

FORM_TOKEN = "ghp_" + rnd(36)
FORM_SECRET = "s3cr3t-" + rnd(20)  # a stored secret with no known shape
FORM_DET = Detector([("MY_SECRET", FORM_SECRET)])


def _hex(value: str, upper: bool = False) -> str:
    return value.encode().hex().upper() if upper else value.encode().hex()


@pytest.mark.parametrize("before,upper,after", [
    ("GET /upload/", False, " HTTP/1.1"),  # a URL path segment
    ("GET /", False, " HTTP/1.1"),
    ("GET /u/", True, " HTTP/1.1"),
    ('{"d": "0x', False, '"}'),  # JSON, 0x-prefixed
    ("Cookie: sid=s-", False, "; path=/"),
    ("X-Trace: req_", True, "\r\n"),
    ("v=v1-", False, "&x=1"),
    ("X-Up: Upload-", False, "\r\n"),  # after "-" in a run with upper case before it
    ("ref=abc/", False, " "),
], ids=["path", "root", "path-upper", "json-0x", "cookie", "header-upper", "form", "upper-before-dash", "after-slash"])
@pytest.mark.parametrize("value,kind", [(FORM_TOKEN, "github-token"), (FORM_SECRET, "MY_SECRET")], ids=["token", "secret"])
def test_hex_inside_a_run_is_read(before, upper, after, value, kind):
    encoded = _hex(value, upper)
    data = (before + encoded + after).encode()
    start = len(before)
    assert [tuple(f) for f in FORM_DET.scan(data)] == [(kind, start, start + len(encoded))]


def test_hex_is_read_from_its_second_digit_and_up_to_bytes_that_are_not_ascii():
    token = FORM_TOKEN
    for data in (b"/x/7" + _hex(token).encode(),  # one stray digit before it
                 b"/x/" + _hex(token).encode() + b"ff00ff" + _hex(FORM_SECRET).encode()):  # binary after it
        found = FORM_DET.scan(data)
        assert [tuple(f) for f in found][:1] == [("github-token", 4 if data[3:4] == b"7" else 3,
                                                 (4 if data[3:4] == b"7" else 3) + 2 * len(token))], data[:20]
    assert [f.kind for f in FORM_DET.scan(data)] == ["github-token", "MY_SECRET"]  # and after the binary


@pytest.mark.parametrize("prefix", ["v1-", "x", "ab", "sha256-", "id_", "Ab1", "token-0123"])
@pytest.mark.parametrize("urlsafe", [False, True], ids=["std", "urlsafe"])
@pytest.mark.parametrize("value,kind", [(FORM_TOKEN, "github-token"), (FORM_SECRET, "MY_SECRET")], ids=["token", "secret"])
def test_base64_a_few_characters_into_its_run_is_read(prefix, urlsafe, value, kind):
    encode = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    plain = b"t=" + value.encode() + b" and more text after it"
    encoded = encode(plain).decode()
    data = f'{{"state": "{prefix}{encoded}"}}'.encode()
    start = data.index(encoded.encode())
    ds = plain.index(value.encode())
    de = ds + len(value)
    assert [tuple(f) for f in FORM_DET.scan(data)] == [(kind, start + ds * 4 // 3, start + -(-de * 4 // 3))]


def test_base64_of_binary_a_few_characters_in_is_read_where_its_text_starts():
    # \xff\xfe before the token: the text starts 2 bytes in, still in the first groups
    data = b"id=x" + base64.b64encode(b"\xff\xfe" + FORM_TOKEN.encode() + b" tail of the value")
    assert [f.kind for f in DET.scan(data)] == ["github-token"]


def qp_encode(text: str, width: int = 76) -> str:
    """Quoted-printable as an encoder writes it: "=" escaped, lines cut at ``width`` with
    soft line breaks."""
    escaped = text.replace("=", "=3D")
    lines = [escaped[i:i + width - 1] for i in range(0, len(escaped), width - 1)]
    return "=\r\n".join(lines)


@pytest.mark.parametrize("value,kind", [(FORM_TOKEN, "github-token"), (FORM_SECRET, "MY_SECRET")], ids=["token", "secret"])
@pytest.mark.parametrize("at", [1, 4, 10, 20, 26], ids=lambda at: f"break-at-{at}")
def test_a_quoted_printable_soft_break_inside_a_value_is_read(value, kind, at):
    shown = value[:at] + "=\r\n" + value[at:]
    data = ("--b\r\nContent-Type: text/plain\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\n"
            f"token: {shown}\r\n--b--\r\n").encode()
    start = data.index(shown.encode())
    assert [tuple(f) for f in FORM_DET.scan(data)] == [(kind, start, start + len(shown))]


@pytest.mark.parametrize("escape", [
    lambda v: "".join("=%02X" % c for c in v.encode()),  # every character escaped
    lambda v: "".join("=%02x" % c for c in v.encode()),  # in lower case, as decoders take it
    lambda v: v[:7] + "=%02X" % ord(v[7]) + v[8:],  # one in the middle
    lambda v: "=%02X" % ord(v[0]) + v[1:],  # the first
    lambda v: v[:-1] + "=%02X" % ord(v[-1]),  # the last
], ids=["all", "all-lower", "middle", "first", "last"])
@pytest.mark.parametrize("value,kind", [(FORM_TOKEN, "github-token"), (FORM_SECRET, "MY_SECRET")], ids=["token", "secret"])
def test_quoted_printable_escapes_are_read(escape, value, kind):
    shown = escape(value)
    data = f"field: {shown}\r\nnext: 1\r\n".encode()
    start = data.index(shown.encode())
    assert [tuple(f) for f in FORM_DET.scan(data)] == [(kind, start, start + len(shown))]


def test_a_quoted_printable_body_as_an_encoder_writes_it_is_read():
    text = "config = {" + ", ".join(f"k{i} = v{i}" for i in range(12)) + f", token = {FORM_TOKEN} }}"
    data = qp_encode(text, 40).encode()
    assert b"=\r\n" in data[data.index(b"ghp_"):data.index(b"ghp_") + 60]  # the token is broken
    assert [f.kind for f in DET.scan(data)] == ["github-token"]


def test_mime_encoded_words_are_read():
    q = FORM_TOKEN.replace("_", "=5F")
    for header in (f"Subject: =?utf-8?Q?key_{q}?=", f"Subject: =?UTF-8?B?{base64.b64encode(FORM_TOKEN.encode()).decode()}?="):
        assert [f.kind for f in DET.scan(header.encode())] == ["github-token"], header


def test_a_quoted_printable_segment_maps_back_across_its_soft_breaks():
    from egress.scan.decode import qp_segments, span
    data = b"a: x=3Dy ghp=\r\n_ab=\ncd=41 tail"
    first, seg = qp_segments(data)
    assert first[0] == b"x=y" and span(first, 0, 3) == (3, 8)  # out to the spaces around it
    assert seg[0] == b"ghp_abcdA"  # on over both soft breaks
    for ds, de, raw in ((0, 3, b"ghp"), (3, 4, b"_"), (3, 6, b"_ab"), (6, 8, b"cd"), (8, 9, b"=41"),
                        (2, 4, b"p=\r\n_"), (5, 7, b"b=\nc"), (0, 9, b"ghp=\r\n_ab=\ncd=41")):
        s, e = span(seg, ds, de)
        assert data[s:e] == raw, (ds, de, data[s:e])


# What looks like these forms in ordinary traffic must not be a finding (the detector reports
# tokens: a digest may be decoded, as long as nothing is found in it).
ORDINARY = [
    f"GET /repos/o/r/git/commits/{rnd(40, HEX)} HTTP/1.1",
    f"GET /v2/library/alpine/blobs/sha256:{rnd(64, HEX)} HTTP/1.1",
    f"GET /api/items/{rnd(32, HEX)}/files/{rnd(64, HEX)}?v={rnd(8, HEX)}",
    f'{{"tx": "0x{rnd(64, HEX)}", "from": "0x{rnd(40, HEX)}", "block": "0x{rnd(6, HEX)}"}}',
    f'{{"id": "req_{rnd(32, HEX)}", "trace": "00-{rnd(32, HEX)}-{rnd(16, HEX)}-01"}}',
    f"traceparent: 00-{rnd(32, HEX)}-{rnd(16, HEX)}-01",
    f"X-Request-Id: v1-{rnd(48, HEX)}",
    f"ETag: W/\"{rnd(32, HEX)}\"",
    f"id={rnd(8, HEX)}-{rnd(4, HEX)}-{rnd(4, HEX)}-{rnd(4, HEX)}-{rnd(12, HEX)}",
    f"integrity=\"sha512-{base64.b64encode(R.randbytes(64)).decode()}\"",
    f"integrity=\"sha256-{base64.b64encode(R.randbytes(32)).decode()}\"",
    f"data:image/png;base64,x{base64.b64encode(R.randbytes(900)).decode()}",
    "GET /search?q=a+b&page=2&per_page=50&limit=100&offset=4500&ts=1767225600 HTTP/1.1",
    f"amount=4999&currency=usd&qty=30&sku=AB12CD34EF56&ref={rnd(24, HEX)}",
    "NAME=\nOTHER=value\nEMPTY=\r\nLAST=1\n",
    "==========\nA heading\n==========\n",
    "a = b\nc == d\nx=1; y=2;\n",
    base64.encodebytes(R.randbytes(400)).decode(),  # MIME base64: "=" padding at a line's end
    "Content-Transfer-Encoding: quoted-printable\r\n\r\nCaf=C3=A9 cr=C3=A8me, 100 =E2=82=AC=\r\n per item=2E\r\n",
    f"cookie: session={rnd(64, HEX)}; csrftoken={rnd(32, B62)}",
    f"/assets/app-{rnd(20, HEX)}.js /assets/vendor.{rnd(32, HEX)}.css",
    f"git@github.com:org/repo.git#{rnd(40, HEX)}",
    f"{rnd(64, HEX)}  file.tar.gz\n{rnd(128, HEX)}  other.tar.gz\n",
    f"0x{rnd(64, HEX).upper()} 0X{rnd(40, HEX)}",
    "".join(f"{i:08x}: " + R.randbytes(16).hex() + "\n" for i in range(0, 400, 16)),  # a hex dump of binary
]


@pytest.mark.parametrize("text", ORDINARY, ids=lambda t: t[:30])
def test_ordinary_hex_base64_and_equals_signs_are_not_findings(text):
    for data in (text.encode(), json.dumps({"v": text}).encode(), urllib.parse.quote(text).encode()):
        assert DET.scan(data) == [] and FORM_DET.scan(data) == [], data[:120]


def test_a_hex_token_in_a_run_split_across_stream_chunks_is_found():
    encoded = _hex(FORM_TOKEN)
    data = f"{rnd(DET.overlap + 3000, string.ascii_lowercase + ' ')} /upload/{encoded} tail".encode()
    start = data.index(encoded.encode())
    for cut in (start - 3, start + 17, start + len(encoded) - 2):
        found = stream_scan(DET.stream(), [data[:cut], data[cut:]])
        assert [tuple(f) for f in found] == [("github-token", start, start + len(encoded))], cut


# ------------------------------------------------------------------ content decoding


def test_decode_content_round_trips():
    body = json.dumps({"token": "ghp_" + rnd(36), "pad": rnd(5000)}).encode()
    deflate_raw = zlib.compressobj(wbits=-15)
    raw = deflate_raw.compress(body) + deflate_raw.flush()
    assert decode_content(gzip.compress(body), "gzip") == body
    assert decode_content(gzip.compress(body[:100]) + gzip.compress(body[100:]), "x-gzip") == body
    assert decode_content(zlib.compress(body), "deflate") == body
    assert decode_content(raw, "deflate") == body
    assert decode_content(brotli.compress(body), "br") == body
    assert decode_content(brotli.compress(gzip.compress(body)), "gzip, br") == body
    assert decode_content(body, "identity") == body
    assert decode_content(body, "") == body


@pytest.mark.parametrize("data,encoding", [
    (b"hello", "compress"),
    (b"hello", "gzip"),
    (gzip.compress(b"x" * 1000)[:-8], "gzip"),
    (gzip.compress(b"x") + b"garbage", "gzip"),
    (b"\x00\x01\x02", "deflate"),
    (b"not brotli at all", "br"),
    (brotli.compress(b"y" * 5000)[:-3], "br"),
], ids=["unknown", "gzip-corrupt", "gzip-truncated", "gzip-trailing", "deflate-corrupt", "br-corrupt", "br-truncated"])
def test_decode_content_undecodable(data, encoding):
    with pytest.raises(UndecodableBody):
        decode_content(data, encoding)


@pytest.mark.parametrize("compress,encoding", [
    (gzip.compress, "gzip"), (zlib.compress, "deflate"), (brotli.compress, "br"),
])
def test_decode_content_bomb_cap(compress, encoding):
    bomb = compress(b"\0" * (8 * 2**20))
    assert len(bomb) < 2**16
    with pytest.raises(UndecodableBody, match="exceeds"):
        decode_content(bomb, encoding, limit=2**20)
    assert len(decode_content(bomb, encoding, limit=8 * 2**20)) == 8 * 2**20


def _deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


CODED = [  # (Content-Encoding, how the body was coded)
    ("gzip", gzip.compress),
    ("x-gzip", lambda b: gzip.compress(b[:999]) + gzip.compress(b[999:])),  # two members
    ("gzip", lambda b: gzip.compress(b) + b"\0" * 10),  # zero padding after the last member
    ("deflate", zlib.compress),
    ("deflate", _deflate_raw),
    ("br", lambda b: brotli.compress(b, quality=5)),
    ("zstd", zstandard.ZstdCompressor().compress),
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b[:777]) + zstandard.ZstdCompressor().compress(b[777:])),
    ("gzip, br", lambda b: brotli.compress(gzip.compress(b), quality=5)),
    ("identity", lambda b: b),
]


@pytest.mark.parametrize("encoding,code", CODED, ids=[f"{e}-{i}" for i, (e, _) in enumerate(CODED)])
@pytest.mark.parametrize("size", [1, 13, 4096])
def test_content_decoder_streams_what_the_whole_body_decodes_to(encoding, code, size):
    body = json.dumps({"token": "ghp_" + rnd(36), "pad": rnd(60000)}).encode()
    coded = code(body)
    decoder = ContentDecoder(encoding, piece=2**12)
    pieces = [p for k in range(0, len(coded), size) for p in decoder.feed(coded[k:k + size])]
    pieces += list(decoder.finish())
    assert b"".join(pieces) == body == decode_content(coded, encoding)
    assert max(map(len, pieces)) <= 2**12 and decoder.size == len(body)


def test_content_decoder_refuses_an_unknown_coding_before_any_byte():
    with pytest.raises(UndecodableBody, match="unknown content-encoding 'x-mystery'"):
        ContentDecoder("gzip, x-mystery")


@pytest.mark.parametrize("compress,encoding", [
    (gzip.compress, "gzip"), (zlib.compress, "deflate"), (brotli.compress, "br"),
    (zstandard.ZstdCompressor().compress, "zstd"),
])
def test_content_decoder_stops_a_bomb_in_small_pieces(compress, encoding):
    bomb = compress(b"\0" * (8 * 2**20))
    decoder = ContentDecoder(encoding, limit=2**20, piece=2**16)
    seen = []
    with pytest.raises(UndecodableBody, match="exceeds"):
        for piece in decoder.feed(bomb):
            seen.append(len(piece))
    assert sum(seen) <= 2**20 and all(n <= 2**16 for n in seen)


# ---------------------------------------------------- decoders' windows (red team P9)


def _zstd_frame(window_log: int, size: int) -> bytes:
    params = zstandard.ZstdCompressionParameters(window_log=window_log, compression_level=3, write_content_size=False)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return writer.compress(b"\0" * size) + writer.flush()


def test_a_zstd_window_over_8_mib_is_refused_before_it_is_decoded():
    # RFC 9659: the zstd content coding's window is at most 8 MB. A 64 MiB window pinned
    # its 64 MiB for each upload that asked for it (12 KiB of uploads: 360 MiB).
    frame = _zstd_frame(26, 60 * 2**20)
    assert zstandard.get_frame_parameters(frame).window_size == 64 * 2**20 and len(frame) < 4096
    decoder = ContentDecoder("zstd")
    with pytest.raises(UndecodableBody, match="a zstd window of 64 MiB, over the 8 MiB RFC 9659 allows"):
        for _ in decoder.feed(frame):
            pass
    assert decoder.size == 0
    with pytest.raises(WindowTooLarge, match="zstd window"):  # an UndecodableBody a caller can tell apart
        decode_content(frame, "zstd")
    # 8 MiB is allowed
    assert decode_content(_zstd_frame(23, 9 * 2**20), "zstd") == b"\0" * (9 * 2**20)


def test_a_zstd_decoder_call_makes_at_most_2_mib_and_lets_go_of_its_window():
    # RLE blocks (4 bytes for 128 KiB): what one call of 64 input bytes can make
    frame = zstandard.ZstdCompressor(level=1).compress(b"a" * (8 * 2**20))
    decoder = ContentDecoder("zstd", piece=2**30)
    stage = decoder._stages[0]
    assert max(len(piece) for piece in decoder.feed(frame)) <= 2 * 2**20
    list(decoder.finish())
    assert stage.decompressor is None and stage.d is None
    cut = ContentDecoder("zstd")
    list(cut.feed(frame[:1000]))
    cut.close()  # a body cut off: its window goes now, not when the collector finds the flow
    assert cut._stages[0].decompressor is None


def test_brotli_and_deflate_decoders_let_go_when_their_stream_ends_or_fails():
    body = brotli.compress(b"x" * 100_000)
    decoder = ContentDecoder("br, gzip".replace(", gzip", ""))
    list(decoder.feed(body))
    list(decoder.finish())
    assert decoder._stages[0].d is None
    broken = ContentDecoder("br")
    with pytest.raises(UndecodableBody):
        list(broken.feed(b"not brotli at all"))
    assert broken._stages[0].d is None
    gz = ContentDecoder("gzip")
    list(gz.feed(gzip.compress(b"y" * 1000)[:20]))
    gz.close()
    assert gz._stages[0].d is None


# ------------------------------------------------- the compiled pass, differentially
#
# The detector finds its candidates in one Hyperscan pass (egress.scan.multimatch): anchors,
# stored secrets and the starts of the base64/hex runs worth decoding. It must find what
# the pure-Python search it replaced found: every pass regex's finditer over the whole
# buffer, and every run of B64_MIN_RUN+ run characters. ReferenceDetector is that search;
# everything after it is the same code, so equal findings on varied inputs -- every format
# raw and under each layer, at run and chunk edges -- say the compiled pass lost nothing.

from egress.scan.decode import qp_segments, run_segments  # noqa: E402


class ReferenceDetector(Detector):
    """The detector with the pure-Python candidate search (nine-odd regex passes, one per
    lead character; for the layers, every run and a regex search for the rest: what
    layer_segments does when it is told nothing)."""

    def _find(self, data: bytes, runs: bool = True):
        leads = [m.start() for p in self._passes if p.lead in data for m in p.regex.finditer(data)]
        return leads, None


def _segments(segments: list) -> list:
    """Each segment as what it decodes to and the span it maps back to."""
    from egress.scan.decode import span
    return [(seg[0], span(seg, 0, len(seg[0]))) for seg in segments]


def triggered_layers(data: bytes, found) -> list:
    """The segments of the layers the compiled pass finds evidence for, from what it found."""
    return _segments(qp_segments(data, found.qp) + run_segments(data, found.runs, found.hexes))


def searched_layers(data: bytes) -> list:
    """The same, from the layers' own (slow) search."""
    return _segments(qp_segments(data) + run_segments(data))


def _encodings(r: random.Random, text: str) -> str:
    """``text`` under zero, one or two of the layers, as senders write them."""
    raw = text.encode()
    forms = [
        lambda: text,
        lambda: urllib.parse.quote(text, safe=r.choice(["", "/", ":/"])),
        lambda: urllib.parse.quote_plus(text),
        lambda: json_escape_hard(text) if any(c.isalnum() for c in text) else json.dumps(text)[1:-1],
        lambda: json.dumps(text)[1:-1].replace("/", "\\/"),
        lambda: base64.b64encode(raw).decode(),
        lambda: base64.urlsafe_b64encode(raw).decode().rstrip("="),
        lambda: "Basic " + base64.b64encode(b"x-access-token:" + raw).decode(),
        lambda: r.choice(["\n", "\r\n", "\\n", "\n  "]).join(textwrap.wrap(
            base64.b64encode(r.randbytes(r.randrange(0, 40)) + raw).decode(), r.choice([16, 17, 19, 22, 57, 64, 76]))),
        lambda: raw.hex() if r.random() < .5 else raw.hex().upper(),
        lambda: urllib.parse.quote(base64.b64encode(raw).decode(), safe=""),
        lambda: base64.b64encode(json.dumps({"k": text}).replace("/", "\\/").encode()).decode(),
        lambda: json.dumps(urllib.parse.quote(text, safe=""))[1:-1].replace("/", "\\/"),
        lambda: "".join("\\u%04x" % ord(c) for c in text) if len(text) < 400 else text,
        # hex inside a run, after a prefix (red team P1)
        lambda: r.choice(["/upload/", "0x", "s-", "req_", "v1-", "/u/", "x", "A-", "Up/", "b"])
        + (raw.hex() if r.random() < .5 else raw.hex().upper()),
        # base64 a few characters into its run (P2)
        lambda: r.choice(["v1-", "x", "ab", "sha256-", "id_", "Q", "token-0123"])
        + (base64.b64encode if r.random() < .5 else base64.urlsafe_b64encode)(r.randbytes(r.randrange(0, 3)) + raw).decode(),
        # quoted-printable (P4): a soft line break, every character escaped, some escaped
        lambda: qp_soft_break(text, r.randrange(1, max(2, len(text)))),
        lambda: "".join("=%02X" % c for c in raw) if len(raw) < 400 else text,
        lambda: "".join("=%02x" % c if r.random() < .3 else chr(c) for c in raw),
    ]
    return r.choice(forms)()


def qp_soft_break(text: str, at: int) -> str:
    """``text`` with a quoted-printable soft line break before character ``at``."""
    return text[:at] + "=\r\n" + text[at:]


def _filler(r: random.Random) -> str:
    """Text around the tokens: what the clean benchmark mix holds, near misses, and runs
    whose length or case sits at the edges of the run triggers."""
    k = r.randrange(9)
    if k == 0:
        return json.dumps({"id": "%032x" % r.getrandbits(128), "url": f"https://api.example.com/v1/{r.randrange(99)}",
                           "sha": "%040x" % r.getrandbits(160), "n": r.randrange(10**9)}).replace("/", "\\/")
    if k == 1:
        return " ".join(r.choice(["the", "token", "Secret", "key", "ghp_", "sk-", "AKIA", "eyJ", "xoxb-", "://",
                                  "-----BEGIN", "Basic", "dp.", "dapi", "Q~", "AZDO", ".atlasv1.", "hooks.slack.com/",
                                  "AccountKey=", "%2F", "\\/", "\\u0041"]) for _ in range(r.randrange(3, 30)))
    if k == 2:
        return "data:image/png;base64," + base64.b64encode(r.randbytes(r.randrange(10, 600))).decode()
    if k == 3:  # a run at a trigger's edge: length 19-21 or 31-33, the first upper case around index 20
        n = r.choice([19, 20, 21, 31, 32, 33, 40, 41, 44])
        body = [r.choice(string.ascii_lowercase + string.digits + "+/_-") for _ in range(n)]
        if r.random() < .7:
            body[min(n - 1, r.choice([0, 18, 19, 20, 21]))] = r.choice(string.ascii_uppercase)
        return "".join(body)
    if k == 4:  # digits and symbols only, or hex (ASCII bytes or not)
        n = r.choice([19, 20, 21, 31, 32, 33, 64])
        if r.random() < .5:
            return "".join(r.choice(string.digits + "+/_-") for _ in range(n))
        text = "".join(r.choice(string.printable[:62]) for _ in range(n // 2 + 1)).encode().hex()[:n]
        return text if r.random() < .5 else "%0*x" % (n, r.getrandbits(4 * n))
    if k == 5:
        return f"GET /api/v2/users/{r.randrange(10**5)}/repos?q={urllib.parse.quote(' '.join(['a b', 'c/d']))} 200"
    if k == 6:
        return "-" * r.randrange(15, 80)
    if k == 7:
        return r.choice(NEGATIVES)
    return "".join(r.choice(B64 + "\n") for _ in range(r.randrange(1, 200)))


def generated(seed: int) -> bytes:
    r = random.Random(seed)
    parts = []
    for _ in range(r.randrange(10, 60)):
        if r.random() < .3:
            kind, text, _ = materialise(r.choice(CASES))
            piece = _encodings(r, text)
        else:
            piece = _filler(r)
        parts.append(piece)
        parts.append(r.choice([" ", "\n", '"', ", ", "=", ":", "/", "", "a", "Z", "9", "&", "\\n", "\r\n"]))
    return "".join(parts).encode()


def _secrets(r: random.Random) -> list[tuple[str, str]]:
    values = ["s3cr3t-Value/with+chars&=" + rnd(8), "QwErTyUiOp" + rnd(10), "pass word " + rnd(6),
              rnd(40, HEX), rnd(60, B64 + "-_")]
    return [(f"SECRET_{i}", v) for i, v in enumerate(r.sample(values, r.randrange(1, len(values) + 1)))]


def _placed_secrets(r: random.Random, data: bytes, secrets) -> bytes:
    for _, value in secrets:
        shown = r.choice([value, value.upper(), value.lower(), value.swapcase()])
        k = r.randrange(len(data) + 1)
        data = data[:k] + _encodings(r, shown).encode() + data[k:]
    return data




@pytest.mark.parametrize("seed", range(60))
def test_the_compiled_pass_finds_what_the_regex_passes_found(seed):
    r = random.Random(seed)
    secrets = _secrets(r)
    data = _placed_secrets(r, generated(seed), secrets)
    for det, ref in ((DET, ReferenceDetector()), (Detector(secrets), ReferenceDetector(secrets)),
                     (Detector(secrets, formats=False), ReferenceDetector(secrets, formats=False))):
        leads, found = det._find(data)
        ref_leads, _ = ref._find(data)
        assert set(ref_leads) <= set(leads), sorted(set(ref_leads) - set(leads))[:5]
        assert triggered_layers(data, found) == searched_layers(data)
        assert det.scan(data) == ref.scan(data)
        chunks = chunked(data, [r.randrange(1, 5000) for _ in range(20)])
        assert stream_scan(det.stream(), chunks) == stream_scan(ref.stream(), chunks)


def test_the_compiled_pass_at_the_edges_of_the_buffer():
    # Runs and anchors that begin at byte 0 or end at the last byte (the triggers' "^").
    r = random.Random(7)
    ref = ReferenceDetector()
    for case in CASES:
        kind, text, _ = materialise(case)
        for form in {text, base64.b64encode(text.encode()).decode(), text.encode().hex(),
                     urllib.parse.quote(text, safe="")}:
            data = form.encode()
            assert DET.scan(data) == ref.scan(data), (kind, form[:60])
    for n in (19, 20, 21, 32, 33):
        for data in ("".join(r.choice(B64) for _ in range(n)).encode(), b"4142434445464748494a4b4c4d4e4f50"[:n],
                     b"0123456789+/_-0123456789+/_-"[:n], b"a" * (n - 1) + b"Q", b"Q" + b"a" * (n - 1)):
            assert triggered_layers(data, DET._find(data)[1]) == searched_layers(data), data


HEX_TEXT = b"the hex of a line of text".hex().encode()
RUN_EDGES = [
    b"Q" + b"a" * 19,  # a run at the start of the buffer that reaches its end
    b" " + b"a" * 19 + b"Q",  # the upper case last of 20; and the run reaches the end
    b" " + b"a" * 19 + b"Q ",
    b" " + b"a" * 20 + b"Q" + b"b" * 30 + b'"',  # the first upper case comes late
    b" " + b"a" * 18 + b"Q",  # 19: too short
    b'"' + b"aB" * 40 + b'"' + b"cD" * 12 + b"=",  # runs one character apart; "=" padding after
    b" " + b"QUJD" * 20 + b"\n" + b"QUJD" * 5 + b"\n",  # wrapped base64: the second line joined
    b"QUJDRA" * 3 + b"\n" + b"RUZHSA" * 3 + b"\n" + b"SUpLTA" * 3 + b"\n",  # lines of 18: no run start of 20
    b"x: " + b"QUJDR" * 3 + b"AB\\n" + b"RUZHSA" * 3 + b"\\n" + b"SUpL",  # 17 then 18, JSON-escaped
    b"QUJDRA" * 3 + b"\n  " + b"RUZHSA" * 3 + b"\n" + b"SUpLTA" * 3,  # the indentation changes
    b" " + b"4142434445464748494A4B4C4D4E4F50" + b".",  # hex with upper-case letters (an ASCII layer)
    b" " + b"0123456789+/_-0123456789" + b" " + b"a" * 25 + b"Z" * 25,
    b"x-" + b"aZ" * 2000 + b"|",  # longer than a 4 KiB step back
    # hex in a run: after a character that is no hex digit, with no upper case before it; after
    # "-", "_", "0x" anywhere; from its second digit; at the very start; not after other hex
    b" /upload/" + HEX_TEXT + b" ",
    HEX_TEXT + b" ",
    b"-" + HEX_TEXT,
    b"0x" + HEX_TEXT,
    b"a" + HEX_TEXT,
    b"ab" + HEX_TEXT,
    b"xY/" + HEX_TEXT.upper() + b"/z",
    b" Upload/" + HEX_TEXT + b" Up-" + HEX_TEXT + b" Up_0x" + HEX_TEXT,
    b"q" * 5000 + HEX_TEXT,
    b"Q" * 3 + b"q" * 40 + HEX_TEXT,
    b" " + HEX_TEXT[:31] + b" " + HEX_TEXT[:33] + b"/" + b"ff" + HEX_TEXT,
    b"=" + HEX_TEXT + b"=\n" + HEX_TEXT,
    # base64 a few characters into a run
    b"x" + base64.b64encode(b"some text to find here"),
    b" sha256-" + base64.b64encode(b"\xff\xfeand text after it"),
    b" " + b"Q" * 16 + base64.b64encode(b"a phase too far in"),
    # quoted-printable evidence
    b"=41=42=43", b"x" * 12 + b"=41", b"x" * 11 + b"=41\n", b'per_page=50"', b"A=\n", b"==\n", b"=\r\nab",
    b"key=\r\nvalue", b"a=4", b"a=4G", b"=7F=80",
]


@pytest.mark.parametrize("data", RUN_EDGES, ids=lambda b: repr(b[:24]))
def test_the_run_triggers_at_the_edges_of_a_run(data):
    assert triggered_layers(data, DET._find(data)[1]) == searched_layers(data)


def test_an_error_inside_a_compiled_scan_raises():
    # Fail closed: a scan that cannot finish raises (the guard refuses), never returns
    # what it had so far. An exception in the match callback stops Hyperscan's scan.
    from egress.scan import multimatch

    class Full(list):
        def append(self, item):
            raise MemoryError("no room for a match")

    db = multimatch.Database([b"ghp_"], [0])
    assert db.scan(b"x ghp_ y", []) == [(0, 0, 6)]
    with pytest.raises(MemoryError):
        db.scan(b"x ghp_ y", Full())


# The escape segments as they were found one regex search, one translate and one decode
# per segment (before 2026-12-04): the reference for the one-call segment regexes and the
# decoding of all segments at once.

def _reference_escape_segments(buf: bytes, evidence: bytes, left: bytes, right: bytes, decode):
    evidence, right = re.compile(evidence), re.compile(right)
    marks = bytes(ord("|") if c in left else ord(".") for c in range(256))
    out, floor = [], 0
    while (m := evidence.search(buf, floor)) is not None:
        lo = floor + buf[floor:m.start()].translate(marks).rfind(b"|") + 1
        d = right.search(buf, m.end())
        hi = d.start() if d else len(buf)
        out.append((decode(buf[lo:hi], lo, False)[0], lo, hi))
        floor = hi
    return out


def _reference_layers(buf: bytes):
    from egress.scan.decode import _json_decode, _percent_decode
    return (_reference_escape_segments(buf, rb"%[0-9A-Fa-f]{2}", b" \t\r\n\"'<>", rb"[ \t\r\n\"'<>]", _percent_decode),
            _reference_escape_segments(buf, rb"\\(?:u[0-9A-Fa-f]{4}|/)", b"{[,\r\n", rb'(?<!\\)"|[\r\n]', _json_decode))


ESCAPE_EDGES = [
    b"%41",  # evidence at the start and the end of the buffer
    b"\\/",
    b"\\u0041",
    b'{"a": "x\\/y", "b": "W\\/\\"abc\\"", "c": "\\"q\\" \\/"}',  # escaped quotes inside and after
    b'"k": "\\\\"\\/"',  # an escaped backslash before a quote still reads as an escape
    b'"k": "a\\/b"x\\/y"',  # the next segment starts at the quote that ended the last
    b"q=a%20b c=%2F%2f d=%zz%4 e=%%41 f=%2541",  # percent runs at delimiters, bad and double escapes
    b"<a href='/p?q=%41'>%42</a>\t%43\r\n%44\"%45\"",
    b"x" * 70 + b"%41" + b" " + b"y" * 600 + b"\\/" + b"z" * 5000 + b"%42",  # no delimiter in 64, 512, 4096 bytes
    b", " + b"w" * 63 + b"\\/ ,\n" + b"v" * 64 + b"\\/",  # a delimiter 64 and 65 bytes back
    # NULs (what joins the segments decoded at once) in the raw text or from an escape:
    # those segments are decoded one by one
    b"a%00b c%41 %00", b"a%41b c%41\x00d %42", b'"k": "\\u0000\\/"', b'"k": "a\\/", "j": "\\/\x00", "i": "\\/"',
    b'"k": "\\ud83d\\ude00\\/", "j": "\\n\\t\\b\\f\\r\\/"',  # a surrogate pair; every one-character escape
    b'"k": "a\\\\/b", "j": "\\x\\/"',  # an escaped backslash; an escape JSON does not know
]


@pytest.mark.parametrize("buf", ESCAPE_EDGES + [generated(seed) for seed in range(40)]
                         + [bytes(random.Random(seed).choice(b'ab"\\\r\n/u%20{,[ <\x00') for _ in range(60))
                            for seed in range(200)], ids=lambda b: repr(b[:24]))
def test_escape_segments_are_the_ones_a_search_per_segment_found(buf):
    from egress.scan.decode import json_segments, percent_segments, span
    for segments, reference in zip((percent_segments(buf), json_segments(buf)), _reference_layers(buf)):
        # the whole of a segment maps back to the whole of its raw text (it starts with an escape)
        assert [(seg[0], *span(seg, 0, len(seg[0]))) for seg in segments] == reference


@pytest.mark.parametrize("data", [b"", b"abc", "é".encode(), "©x".encode(), "\U0010ffff".encode(), b"\x89PNG\r\n",
                                  b"\xff\xd8\xff", b"\x80a", b"\xc0\xaf", b"\xc1\xbf", b"\xc2\xa9", b"\xf4\x8f\xbf\xbf",
                                  b"\xf5\x80\x80\x80", b"\x1f\x8b\x08", b"GIF89a\xff", b"a\xc3"])
def test_decoded_text_is_what_utf8_decodes(data):
    try:
        data.decode("utf-8")
        expected = True
    except UnicodeDecodeError:
        expected = False
    assert detect._is_text(data) is expected


@pytest.mark.parametrize("seed", range(5))
def test_a_json_segment_ends_where_its_pattern_says(seed):
    from egress.scan.decode import _json_right
    r = random.Random(seed)
    pattern = re.compile(rb'(?<!\\)"|[\r\n]')
    for _ in range(300):
        buf = bytes(r.choice(b'ab"\\\r\n/u') for _ in range(r.randrange(1, 40)))
        for pos in range(1, len(buf) + 1):
            d = pattern.search(buf, pos)
            assert _json_right(buf, pos) == (d.start() if d else len(buf)), (buf, pos)


def test_one_detector_scans_in_several_threads_at_once():
    # egress run scans its command's output in one thread while its proxy scans bodies
    # in another: each thread has its own Hyperscan scratch space (one used by two
    # scans at once is an error, and would fail closed -- a refusal for nothing).
    import threading
    det = Detector([("MY_TOKEN", "QwErTyUiOp" + rnd(10))])
    data = [generated(seed) for seed in range(4)]
    expected = [det.scan(d) for d in data]
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(20):
                results[i] = det.scan(data[i])
                assert results[i] == expected[i]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and [results[i] for i in range(4)] == expected


@pytest.mark.parametrize("escape", [
    lambda b: json.dumps({"file": b}).replace("/", "\\/"),  # PHP's json_encode
    lambda b: json.dumps({"file": b}).replace("/", "\\u002F"),
    lambda b: json.dumps({"file": b}).replace("/", "\\/").replace("+", "\\u002b"),
    lambda b: urllib.parse.urlencode({"file": b}),  # %2F, %2B, %3D
], ids=["json-slash", "json-u002f", "json-mixed", "form"])
def test_a_stream_keeps_escaped_base64_in_phase_across_batches(escape):
    # The base64 layer decodes these after the JSON/percent layer, where an escape is one
    # character; cuts aligned on the raw run put 3 of 4 later windows out of phase, and a
    # token after the first 256 KiB batch was missed (red-team pass).
    token = "ghp_" + rnd(36)
    for n in range(300_000, 300_000 + 6 * 997, 997):
        r = random.Random(n)
        blob = base64.b64encode(r.randbytes(n) + f" {token} ".encode() + r.randbytes(3000)).decode()
        data = escape(blob).encode()
        scanner = DET.stream(262144)  # fed as the credential guard does: 64 KiB slices
        found = [f for k in range(0, len(data), 65536) for f in scanner.feed(data[k:k + 65536])]
        found += scanner.finish()
        assert [f.kind for f in found] == ["github-token"] and found == DET.scan(data), n


def _without_slash_or_plus(r: random.Random, n: int) -> bytes:
    """n bytes (a multiple of 3) whose base64 has no "/" and no "+": nothing to escape."""
    out = bytearray()
    while len(out) < n:
        group = r.randbytes(3)
        if not set(base64.b64encode(group)) & set(b"/+"):
            out += group
    return bytes(out)


@pytest.mark.parametrize("escape", [
    lambda b: json.dumps({"file": b}).replace("/", "\\/"),
    lambda b: json.dumps({"file": b}).replace("/", "\\u002f"),
    lambda b: urllib.parse.urlencode({"file": b}),
], ids=["json-slash", "json-u002f", "form"])
@pytest.mark.parametrize("lead", range(4))
def test_one_escape_early_in_streamed_base64_does_not_hide_what_follows(lead, escape):
    # A hostile command controls its base64: one "\/" near the start (and no other escape)
    # puts the raw run after it out of phase with the decoded one for good, and every later
    # window was cut on the raw run's phase: the token 600 KiB on went out (red-team pass).
    token = "ghp_" + rnd(36)
    for n in (600_000 + 1001 * lead,):  # past two cuts; the lead's 4 phases, each at another cut
        r = random.Random(n + lead)
        plain = (_without_slash_or_plus(r, 3 * lead) + b"\x00\x00\x3f" + _without_slash_or_plus(r, n)
                 + f" {token} ".encode() + _without_slash_or_plus(r, 3000))
        data = escape(base64.b64encode(plain).decode()).encode()
        scanner = DET.stream(262144)
        found = [f for k in range(0, len(data), 65536) for f in scanner.feed(data[k:k + 65536])]
        found += scanner.finish()
        assert [f.kind for f in found] == ["github-token"] and found == DET.scan(data), n


# ------------------------------------------------------------ wrapped base64
#
# A hostile command picks its own wrapping: `base64 -w 32` decoded each line alone (the
# token split over NUL-separated pieces), `base64 -w 57` decoded lines out of phase, and
# indented (YAML) or CRLF/JSON-escaped lines were not joined at all; only widths 40, 44,
# ... 76 were caught (red-team pass).

WRAP_WIDTHS = [*range(16, 25), 28, 32, 36, 57, 60, 64, 76, 77, 80]
# (what writes it, text before the first line, line break, indentation, text after)
WRAP_FORMS = [
    ("base64 -w W", "", "\n", "", "\n"),
    ("MIME, CRLF", "Content-Transfer-Encoding: base64\r\n\r\n", "\r\n", "", "\r\n"),
    ("a JSON string", '{"file": "', "\\n", "", '"}'),
    ("a JSON string of CRLF text", '{"file": "', "\\r\\n", "", '"}'),
    ("a YAML block scalar", "data:\n  file: |\n    ", "\n", "    ", "\n  other: 1\n"),
    ("tab-indented", "\t", "\n", "\t", "\n"),
    ("a decoy line of the same width first", "", "\n", "", "\n"),
]


def wrapped(form, b64: str, width: int) -> tuple[bytes, list[int]]:
    """``b64`` wrapped at ``width`` as ``form`` writes it, and where each of its characters is."""
    name, before, brk, indent, after = form
    lines = [b64[i:i + width] for i in range(0, len(b64), width)]
    if name.startswith("a decoy"):  # a line the reader drops: the text starts a line later
        before = rnd(width, B64) + brk
    where, pos = [], len(before)
    for line in lines:
        where += range(pos, pos + len(line))
        pos += len(line) + len(brk) + len(indent)
    return (before + (brk + indent).join(lines) + after).encode(), where


def carried_by(where: list[int], plain: bytes, value: bytes) -> tuple[int, int]:
    """The raw span of the base64 characters that carry ``value``'s bits in base64(plain)."""
    ds = plain.index(value)
    de = ds + len(value)
    return where[ds * 4 // 3], where[-(-de * 4 // 3) - 1] + 1


@pytest.mark.parametrize("width", WRAP_WIDTHS)
def test_wrapped_base64_is_decoded_at_any_width(width):
    token = "ghp_" + rnd(36)
    secret = rnd(32)
    det = Detector(secrets=[("MY_SECRET", secret)])
    for form in WRAP_FORMS:
        for lead in range(4):  # the value at each phase of the text, after 66 lines or more
            plain = R.randbytes(width * 50 + lead) + f" token={token} and {secret} ".encode() + R.randbytes(3000)
            data, where = wrapped(form, base64.b64encode(plain).decode(), width)
            expected = [("github-token", *carried_by(where, plain, token.encode())),
                        ("MY_SECRET", *carried_by(where, plain, secret.encode()))]
            assert [tuple(f) for f in det.scan(data)] == expected, (form[0], lead)


@pytest.mark.parametrize("width", [57, 58, 61])
def test_lines_of_one_width_that_are_not_one_text_still_decode_alone(width):
    # A list of values of one width (not a multiple of 4), one a line: the lines are joined
    # as a wrapped text, and decoded from every phase a line starts at, so the value that
    # holds the token still decodes as it does alone, whichever line it is on.
    token = "ghp_" + rnd(36)
    for k in range(4):
        values = [base64.urlsafe_b64encode(R.randbytes(60)).decode()[:width] for _ in range(6)]
        values[k] = base64.b64encode(f" {token} ".encode() + R.randbytes(40)).decode()[:width]
        data = ("\n".join(values) + "\n").encode()
        start = data.index(values[k].encode())
        assert [tuple(f) for f in DET.scan(data)] == [("github-token", start + 1, start + 55)], k


@pytest.mark.parametrize("width", WRAP_WIDTHS)
def test_a_stream_of_wrapped_base64_finds_what_the_whole_does(width):
    # Fed as the credential guard feeds a body: 64 KiB slices, 256 KiB batches. The cuts
    # between windows fall anywhere in the text; the token comes after the first batch,
    # the stored secret a MiB later.
    token = "ghp_" + rnd(36)
    secret = rnd(32)
    det = Detector(secrets=[("MY_SECRET", secret)])
    form = [f for f in WRAP_FORMS if f[0] in ("a JSON string", "a YAML block scalar", "tab-indented",
                                              "a JSON string of CRLF text")][width % 4]
    r = random.Random(width)
    plain = (r.randbytes(300_000 + width * 997) + f" {token} ".encode() + r.randbytes(1_000_000)
             + f" {secret} ".encode() + r.randbytes(500_000))
    data, _ = wrapped(form, base64.b64encode(plain).decode(), width)
    scanner = det.stream(262144)
    found = [f for k in range(0, len(data), 65536) for f in scanner.feed(data[k:k + 65536])]
    found += scanner.finish()
    assert [f.kind for f in found] == ["github-token", "MY_SECRET"] and found == det.scan(data), form[0]


def test_a_wrapped_text_ends_where_its_line_break_changes():
    # Full lines are checked 64 at a time on a translated copy, where the "n" of a JSON
    # "\n" reads as any run character: a "\t" (or "\x") in its place ends the text there.
    from egress.scan.decode import _wrapped_span
    lines = ["".join(R.choice(B64) for _ in range(16)) for _ in range(150)]
    for other in ("\\t", "\\x", "\n", "\\n "):
        data = ("\\n".join(lines[:100]) + other + "\\n".join(lines[100:])).encode()
        at = data.index(other.encode(), 100 * 18 - 10)
        texts = {seg[2][1:3] for seg in run_segments(data) if seg[1] is _wrapped_span}
        assert len(texts) == 2 and all(end <= at or start > at for start, end in texts), (other, texts)


def test_an_aws_key_id_is_base32_so_upper_case_words_with_0_1_8_9_are_not_one():
    # AWS key ids are base32 after their prefix (as gitleaks' rule reads them); an upper-case
    # name such as a host label ACCADEMIA2024FIRENZE was read as an ACCA key id.
    assert DET.scan(b"ACCADEMIA2024FIRENZE.example.it") == []
    assert DET.scan(b"host ACCADEMIA2024FIRENZE") == []
    key = "ACCA" + rnd(16, BASE32)
    assert kinds(DET.scan(f"host {key}".encode())) == ["aws-access-key-id"]
