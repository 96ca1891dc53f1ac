"""The command line as a person uses it: messages, exit statuses, JSON output."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
from conftest import clean_env, egress_command


def egress(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*egress_command(), *args], capture_output=True, text=True, timeout=60,
                          env=clean_env(tmp_path, EGRESS_STATE_DIR=str(tmp_path / "state")))


def test_check_default_policy_allows_dev_hosts_and_names_the_rule(tmp_path):
    result = egress(tmp_path, "check", "files.pythonhosted.org")
    assert result.returncode == 0
    assert result.stdout.startswith("allow: files.pythonhosted.org: matched files.pythonhosted.org (")
    assert "default.toml:" in result.stdout


def test_check_refusal_exits_1_with_the_reason(tmp_path):
    result = egress(tmp_path, "check", "example.com")
    assert result.returncode == 1
    assert result.stdout.strip() == "block: example.com: not on the allow list"


def test_check_json_one_object_per_target(tmp_path):
    policy = tmp_path / "p.toml"
    policy.write_text('allow = ["example.org"]\ndeny = ["bad.example.org"]\n')
    result = egress(tmp_path, "check", "--json", "--policy", str(policy),
                    "https://www.example.org/path?q=1", "bad.example.org", "127.1")
    assert result.returncode == 1
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["host"], r["decision"], r["reason"]) for r in rows] == [
        ("www.example.org", "allow", "allowed"),
        ("bad.example.org", "block", "denied"),
        ("127.0.0.1", "block", "not-allowed"),
    ]
    assert rows[0]["port"] == 443 and rows[0]["rule"] == f"example.org ({policy}:1)"
    assert rows[1]["rule"] == f"bad.example.org ({policy}:2)"


def test_policy_validate_reports_file_line_and_fix(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('include = ["dev"]\nallow = ["example.org"]\n')
    bad = tmp_path / "bad.toml"
    bad.write_text('allow = [\n  "example.org",\n  "co.uk",\n]\nalow = []\n')
    result = egress(tmp_path, "policy", "validate", str(good), str(bad))
    assert result.returncode == 1
    assert f"{good}: OK" in result.stdout
    assert f"{bad}:3: allow: 'co.uk' is a public suffix" in result.stderr
    assert f"{bad}:5: unknown key 'alow'; did you mean 'allow'?" in result.stderr


def test_policy_validate_warns_of_a_passthrough_without_a_port_and_passes(tmp_path):
    policy = tmp_path / "p.toml"
    policy.write_text('allow = ["pinned.example.org"]\npassthrough = [\n  "pinned.example.org",\n]\n')
    result = egress(tmp_path, "policy", "validate", str(policy))
    assert result.returncode == 0 and f"{policy}: OK" in result.stdout
    assert result.stderr.startswith(f"{policy}:3: warning: passthrough: 'pinned.example.org' has no port")
    assert "write 'pinned.example.org:443'" in result.stderr


@pytest.mark.parametrize("entries, says", [(['"a.example"'], "1 entry from 1 file"),
                                           (['"a.example"', '"b.example"'], "2 entries from 1 file")])
def test_policy_validate_counts_in_words(tmp_path, entries, says):
    policy = tmp_path / "p.toml"
    policy.write_text(f"allow = [{', '.join(entries)}]\n")
    assert egress(tmp_path, "policy", "validate", str(policy)).stdout == f"{policy}: OK ({says})\n"


def test_serve_warns_at_start_up_of_a_passthrough_without_a_port(proxy_factory):
    proxy = proxy_factory()  # conftest's policy: passthrough = ["passthrough.test"]
    policy = proxy.audit_path.parent / "policy.toml"
    line = next(n for n, text in enumerate(policy.read_text().splitlines(), 1) if text.startswith("passthrough"))
    warnings = [text for text in proxy.stderr_lines if "warning:" in text]
    assert warnings == [f"egress: {policy}:{line}: warning: passthrough: 'passthrough.test' has no port: every "
                        f"protocol on every port of it is relayed untouched, never inspected; write "
                        f"'passthrough.test:443' (or the port it needs) to open only that\n"]
    assert proxy.stderr_lines.index(warnings[0]) < next(
        n for n, text in enumerate(proxy.stderr_lines) if "proxy listening on" in text)


def test_serve_with_broken_policy_exits_3_and_starts_nothing(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('allow = ["example.org"\n')
    result = egress(tmp_path, "serve", "--policy", str(bad), "--listen", "127.0.0.1:0", "--metrics", "off")
    assert result.returncode == 3
    assert f"{bad}:" in result.stderr and "not valid TOML" in result.stderr


def test_serve_on_a_port_in_use_exits_4(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = egress(tmp_path, "serve", "--listen", f"127.0.0.1:{port}", "--metrics", "off")
    assert result.returncode == 4
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_serve_metrics_port_in_use_exits_4(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = egress(tmp_path, "serve", "--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{port}")
    assert result.returncode == 4
    assert "cannot serve metrics" in result.stderr


def test_unwritable_state_dir_exits_5(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = egress(tmp_path, "ca", "path", "--state-dir", str(blocker / "state"))
    assert result.returncode == 5
    assert "cannot create or read the CA" in result.stderr


def test_ca_path_creates_a_ca_once(tmp_path):
    first = egress(tmp_path, "ca", "path")
    second = egress(tmp_path, "ca", "path")
    assert first.returncode == 0 and first.stdout == second.stdout
    cert = first.stdout.strip()
    assert cert.endswith("mitmproxy-ca-cert.pem")
    assert "BEGIN CERTIFICATE" in open(cert).read()


@pytest.mark.parametrize("bad", ["--resolve=nocolon", "--resolve=host.test:notanip", "--listen=1.2.3.4:99999"])
def test_bad_serve_options_are_usage_errors(tmp_path, bad):
    result = egress(tmp_path, "serve", bad)
    assert result.returncode == 2
    assert "Error" in result.stderr


# ---------------------------------------------- check: what the proxy refuses whatever DNS says

OPEN = 'network = "all"\n'  # every name allowed: only the address can refuse


def suggestion(address: str) -> str:
    return f'to allow it, add "{address}" to the policy\'s allow_private list: allow_private = ["{address}"]'


CHECK_SPECIAL = [
    # (target, host, port, detail): every one refused by the proxy after the policy allowed it
    ("169.254.169.254", "169.254.169.254", None,
     "169.254.169.254 is the cloud metadata service; " + suggestion("169.254.169.254")),
    ("127.0.0.1", "127.0.0.1", None, "127.0.0.1 is loopback; " + suggestion("127.0.0.1")),
    ("10.0.0.1", "10.0.0.1", None, "10.0.0.1 is private; " + suggestion("10.0.0.1")),
    ("0.0.0.0", "0.0.0.0", None, "0.0.0.0 is unspecified; " + suggestion("0.0.0.0")),
    ("::1", "::1", None, "::1 is loopback; " + suggestion("::1")),
    ("[::1]:8443", "::1", 8443, "::1 is loopback; " + suggestion("::1")),
    ("0x7f.1", "127.0.0.1", None, "127.0.0.1 is loopback; " + suggestion("127.0.0.1")),
    ("2130706433", "127.0.0.1", None, "127.0.0.1 is loopback; " + suggestion("127.0.0.1")),
    ("127.1", "127.0.0.1", None, "127.0.0.1 is loopback; " + suggestion("127.0.0.1")),
    ("0177.0.0.1", "127.0.0.1", None, "127.0.0.1 is loopback; " + suggestion("127.0.0.1")),
    ("[::ffff:127.0.0.1]", "127.0.0.1", None, "127.0.0.1 is loopback; " + suggestion("127.0.0.1")),
    ("http://[::ffff:169.254.169.254]/latest/meta-data", "169.254.169.254", 80,
     "169.254.169.254 is the cloud metadata service; " + suggestion("169.254.169.254")),
    ("203.0.113.80", "203.0.113.80", None, "203.0.113.80 is reserved for documentation; " + suggestion("203.0.113.80")),
    ("localhost", "localhost", None, "resolves to 127.0.0.1 and ::1, loopback; " + suggestion("127.0.0.1")),
    ("http://localhost:8080/x", "localhost", 8080,
     "resolves to 127.0.0.1 and ::1, loopback; " + suggestion("127.0.0.1")),
    ("api.LOCALHOST.", "api.localhost", None, "resolves to 127.0.0.1 and ::1, loopback; " + suggestion("127.0.0.1")),
]


def test_check_refuses_special_addresses_as_the_proxy_does(tmp_path):
    policy = tmp_path / "open.toml"
    policy.write_text(OPEN)
    targets = [target for target, *_ in CHECK_SPECIAL]
    result = egress(tmp_path, "check", "--json", "--policy", str(policy), *targets, "example.org")
    assert result.returncode == 1 and result.stderr == ""
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["target"], r["host"], r["port"], r["decision"], r["reason"], r["detail"]) for r in rows[:-1]] == [
        (target, host, port, "block", "private-address", detail) for target, host, port, detail in CHECK_SPECIAL]
    assert (rows[-1]["decision"], rows[-1]["reason"]) == ("allow", "allowed")  # a name: no DNS, so allowed

    text = egress(tmp_path, "check", "--policy", str(policy), *targets)
    assert text.returncode == 1
    assert text.stdout.splitlines() == [f"block: {host}: {detail}" for _, host, _, detail in CHECK_SPECIAL]


def test_check_allows_what_allow_private_covers(tmp_path):
    policy = tmp_path / "p.toml"
    policy.write_text(OPEN + 'allow_private = ["127.0.0.0/8", "169.254.169.254", "=localhost"]\n')
    result = egress(tmp_path, "check", "--policy", str(policy), "0x7f.1", "169.254.169.254", "localhost")
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines() == ["allow: 127.0.0.1: allowed (network mode 'all')",
                                          "allow: 169.254.169.254: allowed (network mode 'all')",
                                          "allow: localhost: allowed (network mode 'all')"]
    # '=localhost' is that name only, and ::1 is not in 127.0.0.0/8
    refused = egress(tmp_path, "check", "--policy", str(policy), "api.localhost", "::1", "10.0.0.1")
    assert refused.returncode == 1
    assert [line.split(":")[0] for line in refused.stdout.splitlines()] == ["allow", "block", "block"]


def test_check_names_the_policy_refusal_first_as_the_proxy_does(tmp_path):
    # The default policy does not allow 127.0.0.1 at all: the proxy says so before any address check.
    result = egress(tmp_path, "check", "127.0.0.1", "localhost")
    assert result.returncode == 1
    assert result.stdout.splitlines() == ["block: 127.0.0.1: not on the allow list",
                                          "block: localhost: not on the allow list"]


MALFORMED = [
    ("http://[bad", "egress check: 'http://[bad': not a valid URL (Invalid IPv6 URL)"),
    ("example.com:99999", "egress check: 'example.com:99999': '99999' is not a port number (1-65535)"),
    ("http://a b", "egress check: 'http://a b': 'a b' is not a valid host name"),
    ("", "egress check: '': empty host"),
    ("https://", "egress check: 'https://': empty host"),
    ("[::1", "egress check: '[::1': unclosed '['"),
    ("example.com/path", "egress check: 'example.com/path': a path without a scheme: write the host "
                         "('example.com') or a URL ('https://example.com/path')"),
]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize(("target", "line"), MALFORMED, ids=[t or "empty" for t, _ in MALFORMED])
def test_check_a_malformed_target_is_one_line_and_status_2(tmp_path, as_json, target, line):
    result = egress(tmp_path, "check", *(["--json"] if as_json else []), "example.org", target)
    assert result.returncode == 2
    assert result.stdout == ""  # nothing decided: the command line is wrong
    [said] = result.stderr.splitlines()
    assert said.startswith(line), said
    assert "Traceback" not in result.stderr


# ------------------------------------------- validate: what serve refuses to start with

SECRET = "s3cr3t-value-long-enough"
VALIDATE_CASES = [
    # (id, policy text, environment): serve exits 3 for each
    ("bound-to-a-host-not-allowed",
     'allow = ["example.org"]\n\n[[credentials.secret]]\nenv = "DEPLOY_TOKEN"\nhosts = ["example.org", "other.example.net"]\n',
     {"DEPLOY_TOKEN": SECRET}),
    ("unset-variable", 'allow = ["example.org"]\n\n[[credentials.secret]]\nenv = "UNSET_SECRET_X"\n', {}),
    ("unreadable-file", 'allow = ["example.org"]\n\n[[credentials.secret]]\nfile = "/nonexistent/egress-secret"\n', {}),
    ("too-short", 'allow = ["example.org"]\n\n[[credentials.secret]]\nenv = "SHORT_SECRET"\n', {"SHORT_SECRET": "abc"}),
    ("bad-action", 'allow = ["example.org"]\n\n[credentials]\naction = "warn"\n', {}),
    ("entry-and-secret", 'allow = ["co.uk"]\n', {}),
    ("two-problems",
     'allow = ["example.org"]\n\n[[credentials.secret]]\nenv = "UNSET_A"\n\n[[credentials.secret]]\nenv = "UNSET_B"\n',
     {}),
]


@pytest.mark.parametrize(("text", "env"), [c[1:] for c in VALIDATE_CASES], ids=[c[0] for c in VALIDATE_CASES])
def test_validate_reports_what_serve_refuses_to_start_with(tmp_path, text, env):
    policy = tmp_path / "p.toml"
    policy.write_text(text)
    environment = clean_env(tmp_path, EGRESS_STATE_DIR=str(tmp_path / "state"), **env)
    validate = subprocess.run([*egress_command(), "policy", "validate", str(policy)], capture_output=True,
                              text=True, timeout=60, env=environment)
    serve = subprocess.run([*egress_command(), "serve", "--policy", str(policy), "--listen", "127.0.0.1:0",
                            "--metrics", "off"], capture_output=True, text=True, timeout=60, env=environment)
    assert serve.returncode == 3
    assert validate.returncode == 1 and validate.stdout == ""
    problems = validate.stderr.splitlines()
    assert problems and all(line.startswith(f"{policy}:") for line in problems)
    # the same problems, word for word, and each at its file:line
    assert serve.stderr.splitlines() == [f"egress: {line}" for line in problems] + [
        "egress: the policy cannot be loaded (nothing was started)"]


def test_validate_reads_secrets_as_serve_does_and_then_says_ok(tmp_path):
    policy = tmp_path / "p.toml"
    policy.write_text(VALIDATE_CASES[0][1].replace(', "other.example.net"', ""))
    result = subprocess.run([*egress_command(), "policy", "validate", str(policy)], capture_output=True, text=True,
                            timeout=60, env=clean_env(tmp_path, DEPLOY_TOKEN=SECRET))
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"{policy}: OK (1 entry from 1 file)\n"
    assert SECRET not in result.stdout + result.stderr
