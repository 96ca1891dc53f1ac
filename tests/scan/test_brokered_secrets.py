"""A brokered secret never reaches the command (issue 26, item 1): end to end, with a real
`egress run`, real curl inside its sandbox and a hostile bound host on 127.0.0.1.

The host keeps what it is sent (POST /store) and shows it back on a later request that
carries no placeholder (GET /fetch), in several forms; it also puts the Authorization value
it got into its reason phrase (GET /status). The review's reproductions (P5, P6, P18's
response side, N1). Not covered here, since the detector does not read them: a value shown
reversed, rot13-ed, XOR-ed, in UTF-16 or as HTML entities.

Every token is made up.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import ssl
import struct
import subprocess
import sys
import zlib

import pytest
from conftest import TEST_NAMES, RawServer, clean_env, egress_command
from test_credentials import GITHUB

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")

POLICY = ('allow = ["allowed.test", "other.test"]\nallow_private = ["allowed.test", "other.test"]\n'
          '[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["allowed.test"]\n')


def gzip_with_comment(comment: bytes, content: bytes = b"x=1") -> bytes:
    """A gzip member whose FCOMMENT header field is ``comment``: decoders skip it."""
    head = b"\x1f\x8b\x08\x10" + struct.pack("<I", 0) + b"\x00\xff" + comment.replace(b"\0", b" ") + b"\0"
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    body = deflate.compress(content) + deflate.flush()
    return head + body + struct.pack("<II", zlib.crc32(content), len(content))


class KeepingHost(RawServer):
    """A bound host that keeps what it is sent and gives it back: TLS on 127.0.0.1:0 for
    allowed.test and other.test, one request a connection.

    * ``POST /store``: keeps the request, head and body, as received;
    * ``GET /fetch?as=FORM``: the kept request, as FORM: raw, b64, gzraw (gzip with no
      Content-Encoding), gzcomment (Content-Encoding: gzip, the kept bytes in the gzip
      header's comment), b64head (the Authorization value kept, base64 in a header);
    * ``GET /status?as=FORM``: the request's own Authorization value in the reason phrase
      (raw or b64).
    """

    def __init__(self, test_ca):
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        test_ca.issue_cert("allowed.test", "other.test").configure_cert(context)
        self.kept = b"nothing kept"
        self.received = b""  # every byte of every request
        super().__init__(ssl_context=context)

    def url(self, host: str, path: str) -> str:
        return f"https://{host}:{self.port}{path}"

    def handle(self, tls):
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = tls.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            length = next((int(l.split(b":", 1)[1]) for l in lines if l.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                chunk = tls.recv(65536)
                if not chunk:
                    break
                body += chunk
            self.received += head + b"\r\n\r\n" + body
            tls.sendall(self._answer(lines, head + b"\r\n\r\n" + body))
        except ValueError:  # a request this host cannot read
            return

    def _answer(self, lines: list[bytes], request: bytes) -> bytes:
        target = lines[0].split(b" ")[1].decode()
        path, _, query = target.partition("?")
        form = query.partition("as=")[2] or "raw"
        auth = next((l.split(b":", 1)[1].strip() for l in lines if l.lower().startswith(b"authorization:")), b"-")
        headers, status = [], b"200 OK"
        if path == "/store":
            self.kept, body = request, b"stored"
        elif path == "/fetch":
            kept = self.kept
            if form == "b64":
                body = base64.b64encode(kept)
            elif form == "gzraw":
                body = gzip.compress(kept)
            elif form == "gzcomment":
                body, headers = gzip_with_comment(kept), [b"Content-Encoding: gzip"]
            elif form == "b64head":
                saved = kept.split(b"uthorization: ", 1)[-1].split(b"\r\n", 1)[0]
                body, headers = b"see header", [b"X-Saved: " + base64.b64encode(saved)]
            else:
                body = kept
        elif path == "/status":
            status, body = b"200 " + (base64.b64encode(auth) if form == "b64" else auth), b"ok"
        else:
            status, body = b"404 Not Found", b"no"
        head = [b"HTTP/1.1 " + status, b"Content-Length: %d" % len(body), b"Connection: close"] + headers
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    def close(self):
        self.sock.close()


@pytest.fixture
def keeping(test_ca):
    host = KeepingHost(test_ca)
    yield host
    host.close()


def egress_run(tmp_path, policy: str, script: str, upstream_ca):
    """``script`` under egress run (sh -c), the secret brokered; (result, the run's events, project)."""
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(policy)
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    audit = tmp_path / "audit.jsonl"
    args = [*egress_command(), "run", "--policy", str(policy_file), "--state-dir", str(tmp_path / "state"),
            "--upstream-ca", str(upstream_ca), "--audit-log", str(audit)]
    for name in TEST_NAMES:
        args += ["--resolve", f"{name}:127.0.0.1"]
    result = subprocess.run([*args, "--", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=project, env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), GITHUB_TOKEN=GITHUB))
    events = [json.loads(line) for line in audit.read_text().splitlines()] if audit.exists() else []
    return result, events, project


def shown_forms(data: bytes) -> bytes:
    """``data`` and what a command could make of it: gzip (whole or cut short) and base64 undone."""
    out = [data]
    for wbits in (31, 15, -15):
        try:
            out.append(zlib.decompressobj(wbits).decompress(data))
        except zlib.error:
            pass
    try:
        out.append(base64.b64decode(data))
    except ValueError:
        pass
    for line in data.split(b"\r\n"):
        try:
            out.append(base64.b64decode(line.split(b": ", 1)[-1]))
        except ValueError:
            pass
    return b"\n".join(out)


def assert_never_shown(result, project):
    """The real value reached neither the command's output nor anything it saved."""
    for text in (result.stdout, result.stderr):
        assert GITHUB not in text and base64.b64encode(GITHUB.encode()).decode()[:24] not in text
    for saved in project.iterdir():
        assert GITHUB.encode() not in shown_forms(saved.read_bytes()), saved.name


def answer(project, name: str) -> bytes:
    """What curl -i saved, without the proxy's answer to its CONNECT."""
    data = (project / name).read_bytes()
    connected = b"HTTP/1.1 200 Connection established\r\n\r\n"
    return data[len(connected):] if data.startswith(connected) else data


def curl(url: str, out: str, *args: str) -> str:
    return f'curl -sS -i -o {out} {" ".join(args)} "{url}"; '



# ------------------------------------------------------- where a secret is swapped in


def test_a_placeholder_outside_its_header_is_refused_and_never_sent(tmp_path, keeping, test_ca_file, curl_path):
    # N1: the command wrote its placeholder into a body; egress swapped the real value in;
    # the host kept it and gave it back. By default a secret goes in its header only.
    script = ('echo "$GITHUB_TOKEN"; '
              + curl(keeping.url("allowed.test", "/store"), "body", '--data-binary "tok=$GITHUB_TOKEN"')
              + curl(keeping.url("allowed.test", '/store?tok=$GITHUB_TOKEN'), "query", "-X POST")
              + curl(keeping.url("allowed.test", '/store/$GITHUB_TOKEN'), "path", "-X POST")
              + curl(keeping.url("allowed.test", "/store"), "header", '-H "X-Note: $GITHUB_TOKEN" -X POST'))
    result, events, project = egress_run(tmp_path, POLICY, script, test_ca_file)
    placeholder = result.stdout.splitlines()[0]
    assert placeholder.startswith("ghp_") and placeholder != GITHUB
    assert GITHUB.encode() not in keeping.received and placeholder.encode() not in keeping.received
    for name in ("body", "query", "path", "header"):
        got = answer(project, name)
        assert got.startswith(b"HTTP/1.1 403") and b"reason=credential" in got, (name, got[:300])
        # the refusal names the secret and where it is swapped in
        assert b"placeholder:GITHUB_TOKEN" in got and b"swapped in the Authorization header only" in got
    details = [e["detail"] for e in events if e.get("reason") == "credential"]
    assert [d.split(" (")[0] for d in details] == [
        "placeholder:GITHUB_TOKEN in the body", "placeholder:GITHUB_TOKEN in the URL",
        "placeholder:GITHUB_TOKEN in the URL", "placeholder:GITHUB_TOKEN in the X-Note header"], details
    assert_never_shown(result, project)


def test_body_query_and_path_swapping_are_opt_in(tmp_path, keeping, test_ca_file, curl_path):
    policy = POLICY + 'header = ["Authorization", "X-Api-Key"]\nswap = ["header", "body", "query"]\n'
    script = (curl(keeping.url("allowed.test", "/store"), "body", '-H "X-Api-Key: $GITHUB_TOKEN"',
                   '--data-binary "tok=$GITHUB_TOKEN"')
              + curl(keeping.url("allowed.test", "/fetch"), "fetched")
              + curl(keeping.url("allowed.test", '/store?tok=$GITHUB_TOKEN'), "query", "-X POST")
              + curl(keeping.url("allowed.test", '/store/$GITHUB_TOKEN'), "path", "-X POST"))
    result, events, project = egress_run(tmp_path, policy, script, test_ca_file)
    assert f"X-Api-Key: {GITHUB}\r\n".encode() in keeping.received  # a declared header
    assert f"\r\n\r\ntok={GITHUB}".encode() in keeping.received  # the body, opted in
    assert f"/store?tok={GITHUB} ".encode() in keeping.received  # the query, opted in
    assert answer(project, "path").startswith(b"HTTP/1.1 403")  # the path was not
    # What the host kept comes back with the placeholder in place of the real value.
    fetched = answer(project, "fetched")
    assert fetched.startswith(b"HTTP/1.1 200") and b"tok=ghp_" in fetched
    assert_never_shown(result, project)


# ------------------------------------------------- every response of a bound host is read


@pytest.mark.parametrize("form,cut", [
    ("raw", False),  # put back to the placeholder in place
    ("b64", True),
    ("gzraw", True),  # gzip with no Content-Encoding: decoded all the same
    ("gzcomment", True),  # in the gzip header's comment: read as sent
], ids=["raw", "base64", "unlabelled-gzip", "gzip-header-comment"])
def test_a_bound_host_giving_back_what_it_kept_never_gives_the_command_the_value(tmp_path, keeping, test_ca_file,
                                                                                  curl_path, form, cut):
    # P5: the request that stores carries the placeholder (swapped into its header, where it
    # belongs); the request that fetches carries none.
    script = (curl(keeping.url("allowed.test", "/store"), "stored", '-H "Authorization: token $GITHUB_TOKEN"',
                   "-X POST")
              + curl(keeping.url("allowed.test", f"/fetch?as={form}"), "fetched", "--raw"))
    result, events, project = egress_run(tmp_path, POLICY, script, test_ca_file)
    assert f"Authorization: token {GITHUB}\r\n".encode() in keeping.received
    fetched = answer(project, "fetched")
    details = [e["detail"] for e in events if e.get("reason") == "credential"]
    if cut:
        assert details and details[0].startswith("GITHUB_TOKEN given back in the response body"), details
    else:
        assert details == [] and b"Authorization: token ghp_" in fetched
    assert_never_shown(result, project)


@pytest.mark.parametrize("form,cut", [("raw", False), ("b64", True)], ids=["raw", "base64"])
def test_the_reason_phrase_never_gives_the_value_back(tmp_path, keeping, test_ca_file, curl_path, form, cut):
    # P6
    script = curl(keeping.url("allowed.test", f"/status?as={form}"), "status",
                  '-H "Authorization: token $GITHUB_TOKEN"')
    result, events, project = egress_run(tmp_path, POLICY, script, test_ca_file)
    assert f"Authorization: token {GITHUB}\r\n".encode() in keeping.received
    details = [e["detail"] for e in events if e.get("reason") == "credential"]
    if cut:
        assert details == ["GITHUB_TOKEN given back in the status line"], details
    else:
        assert details == [] and answer(project, "status").startswith(b"HTTP/1.1 200 token ghp_")
    assert_never_shown(result, project)


def test_a_header_the_value_comes_back_in_is_cut_off(tmp_path, keeping, test_ca_file, curl_path):
    # base64 in a header, on a request that carried no placeholder (hex in a Location path,
    # as the review did it, waits for the detector to read hex inside a path: issue 26 item 4)
    script = (curl(keeping.url("allowed.test", "/store"), "stored", '-H "Authorization: $GITHUB_TOKEN"', "-X POST")
              + curl(keeping.url("allowed.test", "/fetch?as=b64head"), "fetched"))
    result, events, project = egress_run(tmp_path, POLICY, script, test_ca_file)
    details = [e["detail"] for e in events if e.get("reason") == "credential"]
    assert details == ["GITHUB_TOKEN given back in a response header"], details
    assert_never_shown(result, project)


def test_where_a_secret_goes_is_read_from_its_table():
    from egress.scan.credentials import load_credentials, parse_settings

    tables = [("p.toml", {"secret": [{"env": "A_TOKEN", "hosts": ["a.test"]},
                                     {"env": "B_TOKEN", "hosts": ["b.test"], "header": "X-Api-Key",
                                      "swap": ["header", "query"]},
                                     {"env": "C_TOKEN", "hosts": ["c.test"], "header": ["X-One", "X-Two"]}]})]
    environ = {"A_TOKEN": GITHUB, "B_TOKEN": GITHUB[::-1], "C_TOKEN": GITHUB.upper()}
    secrets = load_credentials(parse_settings(tables), environ, broker=True).secrets
    assert [(s.headers, s.swap) for s in secrets] == [
        (("Authorization",), ("header",)), (("X-Api-Key",), ("header", "query")), (("X-One", "X-Two"), ("header",))]
    assert secrets[2].header_names == {"x-one", "x-two"}
