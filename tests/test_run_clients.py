"""Real clients inside `egress run`: what each one gets, and that it works.

wget over HTTPS (it ignores SSL_CERT_FILE, so the run gives it a WGETRC), apt through a
loopback Debian mirror (as root it drops to _apt, whose ids do not exist in the sandbox).
Upstreams listen on the host's 127.0.0.1; the names resolve there only through the proxy's
--resolve. A test whose client is not installed is skipped with a reason naming it.
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


# ----------------------------------------------------------------------------- apt


class _Mirror(ThreadingHTTPServer):
    daemon_threads = True


class _MirrorHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.paths.append(self.path)
        super().do_GET()


def build_deb_repository(root: Path, work: Path) -> bytes:
    """A flat Debian repository in ``root``: one real .deb (dpkg-deb), Packages, and a Release
    written by hand (apt-ftparchive is in apt-utils, seldom installed). Returns the .deb's bytes."""
    package = work / "egress-hello"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "usr/share/doc/egress-hello").mkdir(parents=True)
    (package / "usr/share/doc/egress-hello/README").write_text("built by egress's tests\n")
    control = ("Package: egress-hello\nVersion: 1.0\nArchitecture: all\n"
               "Maintainer: egress tests <tests@egress.invalid>\nDescription: a package egress's tests build\n")
    (package / "DEBIAN/control").write_text(control)
    root.mkdir()
    deb = root / "egress-hello_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(package), str(deb)], check=True,
                   capture_output=True)
    data = deb.read_bytes()
    packages = (control + f"Filename: ./{deb.name}\nSize: {len(data)}\n"
                f"SHA256: {hashlib.sha256(data).hexdigest()}\n\n").encode()
    (root / "Packages").write_bytes(packages)
    (root / "Release").write_text(f"Date: {formatdate(usegmt=True)}\nSHA256:\n"
                                  f" {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n")
    return data


@pytest.fixture
def apt_tools():
    for tool in ("apt-get", "dpkg-deb"):
        need(tool)


def isolated_apt(tmp_path: Path, source: str) -> Path:
    """An apt configuration of the test's own, in the project (the command can write there):
    its sources, lists, caches and dpkg status; the machine's apt state is never read or written."""
    apt = tmp_path / "project" / "apt"
    for folder in ("sources.list.d", "state/lists/partial", "cache/archives/partial"):
        (apt / folder).mkdir(parents=True)
    (apt / "sources.list").write_text(source + "\n")
    (apt / "status").write_text("")
    (apt / "apt.conf").write_text(textwrap.dedent(f"""\
        Dir::Etc::sourcelist "{apt}/sources.list";
        Dir::Etc::sourceparts "{apt}/sources.list.d";
        Dir::State "{apt}/state";
        Dir::State::status "{apt}/status";
        Dir::Cache "{apt}/cache";
        Acquire::Languages "none";
        // The user's own proxies, for every host and for one: egress's must win over them.
        Acquire::http::Proxy "http://127.0.0.1:9/";
        Acquire::https::Proxy "http://127.0.0.1:9/";
        Acquire::http::Proxy::mirror.test "DIRECT";
        Acquire::https::Proxy::mirror.test "DIRECT";
        """))
    return apt / "apt.conf"


def apt_dump(config: str | None) -> list[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C"}
    if config:
        env["APT_CONFIG"] = config
    return subprocess.run(["apt-config", "dump"], capture_output=True, text=True, env=env, check=True,
                          timeout=60).stdout.splitlines()


EGRESS_APT_KEYS = ("APT::Sandbox::User", "Acquire::Retries", "Acquire::http::Proxy", "Acquire::https::Proxy",
                   "Acquire::https::CAInfo", "Dir::Etc::parts", "Dir::Etc::main")


def test_the_runs_apt_configuration_is_the_systems_with_egresss_settings_last(tmp_path):
    need("apt-config")
    from sandbox.environment import command_environment

    bundle = tmp_path / "bundle.pem"
    bundle.write_text("")
    env = command_environment({"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, proxy_url="http://127.0.0.1:3128",
                              ca_bundle=bundle, tmpdir=tmp_path)
    system, run = apt_dump(None), apt_dump(env["APT_CONFIG"])

    ours = tuple(k.lower() + c for k in EGRESS_APT_KEYS for c in " :") + ('acquire::http "', 'acquire::https "')

    def others(lines):  # without egress's keys (and the two sections that hold some of them)
        return [line for line in lines if not line.lower().startswith(ours)]

    assert others(run) == others(system)  # every setting of the system's own files, as apt reads them
    for line in ('APT::Sandbox::User "root";', 'Acquire::Retries "0";', 'Acquire::http::Proxy "http://127.0.0.1:3128";',
                 'Acquire::https::Proxy "http://127.0.0.1:3128";', f'Acquire::https::CAInfo "{bundle}";'):
        assert line in run


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_apt_get_downloads_a_package_through_egress_from_a_loopback_mirror(tmp_path, apt_tools, test_ca,
                                                                          test_ca_file, scheme):
    deb = build_deb_repository(tmp_path / "mirror", tmp_path / "build")
    server = _Mirror(("127.0.0.1", 0), partial(_MirrorHandler, directory=str(tmp_path / "mirror")))
    server.paths = []
    if scheme == "https":
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        test_ca.issue_cert("mirror.test").configure_cert(context)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        source = f"deb [trusted=yes] {scheme}://mirror.test:{server.server_address[1]}/ ./"
        config = isolated_apt(tmp_path, source)  # given as the caller's APT_CONFIG: egress includes it
        result = egress_run(tmp_path, "sh", "-c", "apt-get -q update && apt-get -q download egress-hello",
                            policy='allow = ["mirror.test"]\nallow_private = ["mirror.test"]\n',
                            extra=["--resolve", "mirror.test:127.0.0.1"], upstream_ca=test_ca_file,
                            env={"APT_CONFIG": str(config)})
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "project" / "egress-hello_1.0_all.deb").read_bytes() == deb
    assert server.paths[-1] == "/./egress-hello_1.0_all.deb", server.paths  # it came from the mirror
    assert "EGRESS" not in result.stderr
