"""Real clients inside `egress run`: what each one gets, and that it works.

wget over HTTPS: it ignores SSL_CERT_FILE, so the run gives it a WGETRC. Upstreams listen on
the host's 127.0.0.1; the names resolve there only through the proxy's --resolve. A test
whose client is not installed is skipped with a reason naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import textwrap
import threading
from email.utils import formatdate
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from test_run import egress_run, namespaces_available  # noqa: F401 (an autouse fixture: skips without namespaces)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egress run confines with Linux namespaces")


def need(tool: str, why: str = "") -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed{why}")
    return path


def audit(tmp_path: Path) -> list[dict]:
    path = tmp_path / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------- wget


def test_wget_fetches_over_https_trusting_the_runs_bundle_and_keeps_the_users_wgetrc(tmp_path, https_upstream,
                                                                                      test_ca_file):
    wget = need("wget", " (scripts/test installs Debian's wget)")
    # The user's own ~/.wgetrc: its user agent still applies; its proxy and CA give way to egress's
    # (a proxy on the sandbox's own loopback port 9 would refuse, a missing CA file would fail).
    (tmp_path / ".wgetrc").write_text("user_agent = agent-from-the-users-wgetrc\n"
                                      "https_proxy = http://127.0.0.1:9/\nca_certificate = /nonexistent/ca.pem\n")
    result = egress_run(tmp_path, wget, "-q", "-O", "-", https_upstream.url("allowed.test"),
                        upstream_ca=test_ca_file)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello from upstream\n"
    assert https_upstream.requests[-1]["headers"]["User-Agent"] == "agent-from-the-users-wgetrc"
    assert (tmp_path / ".wgetrc").read_text().startswith("user_agent")  # the user's file is not touched
