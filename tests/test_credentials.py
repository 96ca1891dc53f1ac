"""Credentials never leave: end to end through a real `egress serve` / `egress run`.

Every token here is made up to match its provider's format; none is real.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import string
import subprocess
import sys

import pytest
import requests

from conftest import DEFAULT_POLICY, TEST_NAMES, clean_env, egress_command

_RANDOM = random.Random(20261202)


def fake(prefix: str, length: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return prefix + "".join(_RANDOM.choice(alphabet) for _ in range(length))


GITHUB = fake("ghp_", 36)
STRIPE = fake("sk_live_", 24)
ANTHROPIC = fake("sk-ant-api03-", 93, string.ascii_letters + string.digits + "_-") + "AA"
STORED = fake("", 32)  # an install's own secret with no well-known shape


def session_for(proxy) -> requests.Session:
    session = requests.Session()
    session.trust_env = False
    session.proxies = {"http": proxy.url, "https": proxy.url}
    session.verify = str(proxy.ca_path)
    return session


def assert_refused(response, upstream, kind: str):
    assert response.status_code == 403, response.text
    assert "reason=credential" in response.headers["X-Egress-Blocked"]
    assert kind in response.text
    for value in (GITHUB, STRIPE, ANTHROPIC, STORED):
        assert value not in response.text and value not in str(response.headers)
    assert upstream.requests == []


# --------------------------------------------------------------- block (default)


@pytest.fixture
def guarded(proxy_factory):
    return proxy_factory(DEFAULT_POLICY, env={"MY_SERVICE_TOKEN": STORED})


@pytest.mark.parametrize("placement", ["query", "header", "bearer", "json", "form", "multipart", "basic"])
def test_token_anywhere_in_a_request_is_refused(guarded, https_upstream, placement):
    session = session_for(guarded)
    url = https_upstream.url("allowed.test", "/echo")
    if placement == "query":
        response = session.get(https_upstream.url("allowed.test", f"/small?token={GITHUB}"), timeout=20)
    elif placement == "header":
        response = session.get(url, headers={"X-Api-Key": ANTHROPIC}, timeout=20)
    elif placement == "bearer":
        response = session.get(url, headers={"Authorization": f"Bearer {STRIPE}"}, timeout=20)
    elif placement == "json":
        response = session.post(url, data=json.dumps({"config": {"token": GITHUB}}), timeout=20,
                                headers={"Content-Type": "application/json"})
    elif placement == "form":
        response = session.post(url, data={"key": STRIPE, "x": "y"}, timeout=20)
    elif placement == "multipart":
        response = session.post(url, files={"upload": ("env.txt", f"TOKEN={GITHUB}\n".encode())}, timeout=20)
    else:
        response = session.get(url, auth=("x-access-token", GITHUB), timeout=20)
    kind = {"header": "anthropic", "bearer": "stripe", "form": "stripe"}.get(placement, "github")
    assert_refused(response, https_upstream, kind)


def test_stored_secret_from_the_environment_is_refused(guarded, http_upstream):
    response = session_for(guarded).post(http_upstream.url("allowed.test", "/echo"),
                                         data=f"debug dump: {STORED}", timeout=20)
    assert_refused(response, http_upstream, "MY_SERVICE_TOKEN")


def test_token_inside_gzip_body_is_refused(guarded, https_upstream):
    body = gzip.compress(json.dumps({"t": GITHUB}).encode())
    response = session_for(guarded).post(https_upstream.url("allowed.test", "/echo"), data=body, timeout=20,
                                         headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert_refused(response, https_upstream, "github")


def test_unreadable_content_encoding_fails_closed(guarded, https_upstream):
    response = session_for(guarded).post(https_upstream.url("allowed.test", "/echo"), data=b"\x00\x01opaque",
                                         headers={"Content-Encoding": "x-mystery"}, timeout=20)
    assert response.status_code == 403
    assert "reason=credential" in response.headers["X-Egress-Blocked"]
    assert https_upstream.requests == []


def test_ordinary_requests_pass_untouched(guarded, https_upstream):
    body = json.dumps({"sha": "9fceb02d0ae598e95dc970b74767f19372d61af8",
                       "id": "123e4567-e89b-12d3-a456-426614174000", "note": "use a ghp_ token"})
    response = session_for(guarded).post(https_upstream.url("allowed.test", "/echo"), data=body, timeout=20)
    assert response.status_code == 200
    assert response.text == body


# ----------------------------------------------------------------------- mask


def test_mask_mode_forwards_the_redacted_request(proxy_factory, https_upstream):
    policy = DEFAULT_POLICY + '\n[credentials]\naction = "mask"\n'
    proxy = proxy_factory(policy)
    response = session_for(proxy).post(https_upstream.url("allowed.test", f"/echo?t={STRIPE}"),
                                       data=json.dumps({"token": GITHUB}),
                                       headers={"X-Api-Key": ANTHROPIC}, timeout=20)
    assert response.status_code == 200
    seen = https_upstream.requests[-1]
    assert seen["body"] == json.dumps({"token": "[redacted:github-token]"}).encode()
    assert GITHUB.encode() not in seen["body"] and STRIPE not in seen["path"]
    assert "[redacted:" in seen["path"] and seen["headers"]["X-Api-Key"].startswith("[redacted:")


# ------------------------------------------------------------------ bound secrets


BOUND_POLICY = DEFAULT_POLICY.replace('allow = ["allowed.test"', 'allow = ["allowed.test", "other.test"') \
    .replace('allow_private = ["allowed.test"', 'allow_private = ["allowed.test", "other.test"') + """
[[credentials.secret]]
env = "GITHUB_TOKEN"
hosts = ["allowed.test"]
"""


def test_bound_secret_reaches_its_host_only(proxy_factory, https_upstream):
    proxy = proxy_factory(BOUND_POLICY, env={"GITHUB_TOKEN": GITHUB})
    session = session_for(proxy)
    ok = session.get(https_upstream.url("allowed.test", "/small"), headers={"Authorization": f"token {GITHUB}"},
                     timeout=20)
    assert ok.status_code == 200
    assert https_upstream.requests[-1]["headers"]["Authorization"] == f"token {GITHUB}"
    before = len(https_upstream.requests)
    refused = session.get(https_upstream.url("other.test", "/small"), headers={"Authorization": f"token {GITHUB}"},
                          timeout=20)
    assert refused.status_code == 403 and "reason=credential" in refused.headers["X-Egress-Blocked"]
    assert len(https_upstream.requests) == before


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("table, env, message", [
    ('[credentials]\naction = "warn"\n', {}, "'warn' is not an action"),
    ('[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["nowhere.test"]\n', {"GITHUB_TOKEN": GITHUB},
     "bound to 'nowhere.test', which the policy does not allow"),
    ('[[credentials.secret]]\nfile = "/nonexistent/egress-secret"\n', {}, "cannot read /nonexistent/egress-secret"),
    ('[[credentials.secret]]\nenv = "SHORT"\n', {"SHORT": "abc"}, "needs at least"),
    ('[[credentials.secret]]\nenv = "UNSET_SECRET_X"\n', {}, "$UNSET_SECRET_X is not set"),
])
def test_bad_credential_settings_stop_serve_with_a_clear_error(tmp_path, table, env, message):
    policy = tmp_path / "p.toml"
    policy.write_text(DEFAULT_POLICY + "\n" + table)
    result = subprocess.run([*egress_command(), "serve", "--policy", str(policy), "--listen", "127.0.0.1:0",
                             "--metrics", "off", "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=60, env=clean_env(tmp_path, **env))
    assert result.returncode == 3
    assert message in result.stderr


# -------------------------------------------------------------------- redaction


def test_egress_redact_filters_a_stream(tmp_path):
    text = f"token {GITHUB}\nstored {STORED}\nexport API_PASSWORD=hunter2hunter2\nplain line\n"
    result = subprocess.run([*egress_command(), "redact"], input=text, capture_output=True, text=True,
                            timeout=60, env=clean_env(tmp_path, MY_SERVICE_TOKEN=STORED))
    assert result.returncode == 0, result.stderr
    assert GITHUB not in result.stdout and STORED not in result.stdout and "hunter2" not in result.stdout
    assert "[redacted:github-token]" in result.stdout
    assert "export API_PASSWORD=[redacted:env-secret]" in result.stdout
    assert result.stdout.endswith("plain line\n")


# ------------------------------------------------------------- brokered (egress run)


def egress_run(tmp_path, policy: str, env: dict, *command: str, upstream_ca=None):
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(policy)
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    args = [*egress_command(), "run", "--policy", str(policy_file), "--state-dir", str(tmp_path / "state")]
    for name in TEST_NAMES:
        args += ["--resolve", f"{name}:127.0.0.1"]
    if upstream_ca:
        args += ["--upstream-ca", str(upstream_ca)]
    return subprocess.run([*args, "--", *command], capture_output=True, text=True, timeout=120, cwd=project,
                          env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), **env))


@pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")
def test_brokered_secret_command_sees_only_a_placeholder(tmp_path, https_upstream, test_ca_file, curl_path):
    policy = 'allow = ["allowed.test", "other.test"]\nallow_private = ["allowed.test", "other.test"]\n' \
             '[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["allowed.test"]\n'
    script = (f'echo "$GITHUB_TOKEN"; '
              f'curl -sS -H "Authorization: token $GITHUB_TOKEN" {https_upstream.url("allowed.test", "/small")}; '
              f'curl -sS -H "Authorization: token $GITHUB_TOKEN" {https_upstream.url("other.test", "/small")}')
    result = egress_run(tmp_path, policy, {"GITHUB_TOKEN": GITHUB}, "sh", "-c", script, upstream_ca=test_ca_file)
    placeholder = result.stdout.splitlines()[0]
    assert placeholder != GITHUB and placeholder.startswith("ghp_") and len(placeholder) == len(GITHUB)
    assert GITHUB not in result.stdout and GITHUB not in result.stderr
    assert "hello from upstream" in result.stdout
    # The bound host received the real value; the other host received nothing.
    assert [r["headers"].get("Authorization") for r in https_upstream.requests] == [f"token {GITHUB}"]
    assert "EGRESS_BLOCKED other.test (the request carries a credential)" in result.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")
def test_trace_with_a_brokered_secret_is_refused(tmp_path, https_upstream, test_ca_file, curl_path):
    policy = 'allow = ["allowed.test"]\nallow_private = ["allowed.test"]\n' \
             '[[credentials.secret]]\nenv = "GITHUB_TOKEN"\nhosts = ["allowed.test"]\n'
    script = f'curl -sS -X TRACE -H "Authorization: token $GITHUB_TOKEN" {https_upstream.url("allowed.test", "/small")}'
    result = egress_run(tmp_path, policy, {"GITHUB_TOKEN": GITHUB}, "sh", "-c", script, upstream_ca=test_ca_file)
    assert "EGRESS_BLOCKED allowed.test" in result.stdout
    assert https_upstream.requests == []


@pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")
def test_run_redact_filters_the_commands_output(tmp_path):
    result = subprocess.run(
        [*egress_command(), "run", "--redact", "--network", "off", "--", "sh", "-c",
         f'echo "leak: $MY_SERVICE_TOKEN"; echo "{GITHUB}" >&2'],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env=clean_env(tmp_path, PYTHONPATH=os.getcwd(), MY_SERVICE_TOKEN=STORED))
    assert result.stdout == "leak: [redacted:MY_SERVICE_TOKEN]\n"
    assert "[redacted:github-token]" in result.stderr and GITHUB not in result.stderr


def test_basic_auth_decoding_is_real(guarded, https_upstream):
    # A Basic credential whose user part is innocent and whose password is a token.
    header = "Basic " + base64.b64encode(f"__token__:{GITHUB}".encode()).decode()
    response = session_for(guarded).get(https_upstream.url("allowed.test"), headers={"Authorization": header},
                                        timeout=20)
    assert_refused(response, https_upstream, "github")
