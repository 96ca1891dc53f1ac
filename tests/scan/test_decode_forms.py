"""Forms of a credential the proxy reads, end to end through a real `egress serve`: hex inside a
run (red team 2026-12-07, P1), base64 a few characters into its run (P2), quoted-printable
parts and MIME words (P4); and a zstd body whose window is over RFC 9659's 8 MiB, refused
before it takes memory (P9). Real clients (requests, raw sockets), real upstreams on
127.0.0.1; every token is made up.

tests/scan/test_detect.py holds the same forms at the detector, span for span, and the ordinary
text that must pass.
"""

from __future__ import annotations

import base64
import json
import random
import socket
import string
from pathlib import Path

import pytest
from conftest import DEFAULT_POLICY, proxied_session

_RANDOM = random.Random(20261207)


def fake(prefix: str, length: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return prefix + "".join(_RANDOM.choice(alphabet) for _ in range(length))


GITHUB = fake("ghp_", 36)
STORED = fake("", 32)  # an install's own secret with no well-known shape


@pytest.fixture
def guarded(proxy_factory):
    return proxy_factory(DEFAULT_POLICY, env={"MY_SERVICE_TOKEN": STORED})


def assert_refused(response, upstream, kind: str):
    assert response.status_code == 403, response.text
    assert "reason=credential" in response.headers["X-Egress-Blocked"]
    assert kind in response.text
    for value in (GITHUB, STORED):
        assert value not in response.text and value not in str(response.headers)
    assert upstream.requests == []


def _hex(value: str, upper: bool = False) -> str:
    return value.encode().hex().upper() if upper else value.encode().hex()


# ---------------------------------------------------------------- hex in a run (P1)


@pytest.mark.parametrize("placement", ["path", "path-upper", "json-0x", "cookie", "header", "form", "stored-path"])
def test_hex_inside_a_run_is_refused(guarded, https_upstream, placement):
    session = proxied_session(guarded)
    url = https_upstream.url("allowed.test", "/echo")
    kind = "github-token"
    if placement == "path":
        response = session.get(https_upstream.url("allowed.test", f"/upload/{_hex(GITHUB)}"), timeout=20)
    elif placement == "path-upper":
        response = session.get(https_upstream.url("allowed.test", f"/u/{_hex(GITHUB, True)}"), timeout=20)
    elif placement == "json-0x":
        response = session.post(url, data=json.dumps({"d": "0x" + _hex(GITHUB)}), timeout=20,
                                headers={"Content-Type": "application/json"})
    elif placement == "cookie":
        response = session.get(url, headers={"Cookie": f"sid=s-{_hex(GITHUB)}"}, timeout=20)
    elif placement == "header":
        response = session.get(url, headers={"X-Trace": f"req_{_hex(GITHUB, True)}"}, timeout=20)
    elif placement == "form":
        response = session.post(url, data={"v": "v1-" + _hex(GITHUB)}, timeout=20)
    else:
        response = session.get(https_upstream.url("allowed.test", f"/x/{_hex(STORED)}"), timeout=20)
        kind = "MY_SERVICE_TOKEN"
    assert_refused(response, https_upstream, kind)


# --------------------------------------------------- base64 a few characters in (P2)


@pytest.mark.parametrize("placement", ["form-v1", "json-x-urlsafe", "query-ab", "header-sha256", "stored-id"])
def test_base64_after_a_short_prefix_is_refused(guarded, https_upstream, placement):
    session = proxied_session(guarded)
    url = https_upstream.url("allowed.test", "/echo")
    kind = "github-token"
    if placement == "form-v1":
        response = session.post(url, data={"id": "v1-" + base64.b64encode(GITHUB.encode()).decode()}, timeout=20)
    elif placement == "json-x-urlsafe":
        value = "x" + base64.urlsafe_b64encode(GITHUB.encode()).decode().rstrip("=")
        response = session.post(url, data=json.dumps({"d": value}), timeout=20, headers={"Content-Type": "application/json"})
    elif placement == "query-ab":
        state = "ab" + base64.urlsafe_b64encode(f"u=me&t={GITHUB}".encode()).decode()
        response = session.get(https_upstream.url("allowed.test", f"/cb?state={state}"), timeout=20)
    elif placement == "header-sha256":
        response = session.get(url, headers={"Integrity": "sha256-" + base64.b64encode(b"k=" + GITHUB.encode()).decode()},
                               timeout=20)
    else:
        response = session.post(url, data=f"id=Q{base64.b64encode(STORED.encode()).decode()}", timeout=20)
        kind = "MY_SERVICE_TOKEN"
    assert_refused(response, https_upstream, kind)


# ------------------------------------------------------------- quoted-printable (P4)


def multipart(*parts: tuple[str, str]) -> tuple[bytes, str]:
    """A multipart/form-data body of (name, quoted-printable text) parts, and its type."""
    out = []
    for name, text in parts:
        out.append(f'--xyz\r\nContent-Disposition: form-data; name="{name}"\r\n'
                   f"Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\n"
                   f"{text}\r\n")
    out.append("--xyz--\r\n")
    return "".join(out).encode(), "multipart/form-data; boundary=xyz"


@pytest.mark.parametrize("text,kind", [
    (f"token: {GITHUB[:14]}=\r\n{GITHUB[14:]}", "github-token"),  # a soft line break inside it
    ("".join("=%02X" % c for c in STORED.encode()), "MY_SERVICE_TOKEN"),  # written wholly as =XX
    (f"key=3D{GITHUB[:9]}=\r\n{GITHUB[9:20]}={ord(GITHUB[20]):02X}{GITHUB[21:]}", "github-token"),
], ids=["soft-break", "all-escaped", "escapes-and-a-break"])
def test_a_quoted_printable_part_is_refused(guarded, https_upstream, text, kind):
    body, content_type = multipart(("notes", "a plain line=\r\n and more"), ("secret", text))
    response = proxied_session(guarded).post(https_upstream.url("allowed.test", "/echo"), data=body, timeout=20,
                                             headers={"Content-Type": content_type})
    assert_refused(response, https_upstream, kind)


def test_mime_encoded_words_are_refused(guarded, https_upstream):
    session = proxied_session(guarded)
    url = https_upstream.url("allowed.test", "/echo")
    for word in (f"=?utf-8?Q?{GITHUB.replace('_', '=5F')}?=", f"=?UTF-8?B?{base64.b64encode(GITHUB.encode()).decode()}?="):
        response = session.post(url, data=f"Subject: {word}\r\n\r\nhello\r\n", timeout=20,
                                headers={"Content-Type": "message/rfc822"})
        assert_refused(response, https_upstream, "github-token")


def test_ordinary_hex_base64_and_quoted_printable_pass(guarded, https_upstream):
    r = random.Random(7)
    digest = "".join(r.choice("0123456789abcdef") for _ in range(64))
    sha = digest[:40]
    session = proxied_session(guarded)
    response = session.get(https_upstream.url("allowed.test", f"/v2/library/alpine/blobs/sha256:{digest}"), timeout=20,
                           headers={"X-Request-Id": f"req_{digest[:32]}", "If-None-Match": f'W/"{sha}"'})
    assert response.status_code == 404  # served: the upstream does not know the path
    body, content_type = multipart(("text", "Caf=C3=A9 cr=C3=A8me, 100 =E2=82=AC per item, a line that goes =\r\non=2E"),
                                   ("commit", f"0x{sha} tx=0x{digest}"))
    body += json.dumps({"integrity": "sha512-" + base64.b64encode(r.randbytes(64)).decode(), "tx": "0x" + digest,
                        "avatar": "x" + base64.b64encode(r.randbytes(3000)).decode()}).encode()
    response = session.post(https_upstream.url("allowed.test", "/echo"), data=body, timeout=20,
                            headers={"Content-Type": content_type})
    assert response.status_code == 200 and response.content == body


# ------------------------------------------------------------ the zstd window (P9)


def _zstd_window_frame() -> bytes:
    """One zstd frame (~2 KB) with a 64 MiB window that decodes to 60 MiB of zeros."""
    zstandard = pytest.importorskip("zstandard", reason="zstandard is needed to write zstd frames")
    params = zstandard.ZstdCompressionParameters(window_log=26, compression_level=3, write_content_size=False)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return writer.compress(b"\0" * (60 * 2**20)) + writer.flush()


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def test_a_zstd_body_with_a_window_over_8_mib_is_refused_and_pins_no_memory(guarded, http_upstream):
    # Before: each such upload, sent without its last bytes so that it never ends, held its
    # 64 MiB window (six: +359 MiB, kept after the connections closed). Now the frame is
    # refused at its header, for every one of them, and the proxy's peak RSS barely moves.
    frame = _zstd_window_frame()
    pid = guarded.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = _status(pid, "VmRSS")
    port = http_upstream.port
    socks = []
    try:
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", guarded.port), timeout=20)
            socks.append(sock)
            head = (f"POST http://allowed.test:{port}/echo HTTP/1.1\r\nHost: allowed.test:{port}\r\n"
                    f"Content-Encoding: zstd\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
            piece = frame[:-8]  # never finished: a decoder would hold its window for as long as the upload lasts
            sock.sendall(head + b"%x\r\n%s\r\n" % (len(piece), piece))
        events = guarded.wait_for_audit(lambda e: len([x for x in guarded.audit() if x["reason"] == "credential"]) >= 4,
                                        timeout=60)
        details = [e["detail"] for e in events if e["reason"] == "credential"]
        assert details == ["an unreadable body (a zstd window of 64 MiB, over the 8 MiB RFC 9659 allows the zstd "
                           "content coding)"] * 4, details
        grown = (_status(pid, "VmHWM") - before) / 1024
        assert grown < 48, f"peak RSS grew {grown:.0f} MiB for 4 uploads of {len(frame)} bytes"
    finally:
        for sock in socks:
            sock.close()
    assert all(not r.get("body") for r in http_upstream.requests)
